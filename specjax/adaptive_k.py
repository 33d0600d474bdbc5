"""k that adapts: vLLM 0.34's batch-size k schedule and adaptive verification, as pure
functions (the schedule on the host, the rest jit-able on device state).

:func:`k_schedule_lookup` (``num_speculative_tokens_per_batch_size``); vLLM's online
acceptance estimator (``estimator_*``, ``c_j = sigmoid(omega * f + beta_j)``) with its
budget (:func:`verification_budget`, :func:`admit`); specjax's policy (:func:`choose_k` over
:func:`acceptance_rate`; :func:`choose_caps` per request over flat token batches). docs/adaptive_k.md.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from specjax.checks import ArgumentError, ArgumentTypeError, show

__all__ = ["validate_k_schedule", "k_schedule_lookup", "draft_feature", "EstimatorState",
           "estimator_init", "estimator_predict", "estimator_observe", "estimator_refit",
           "survival", "verification_budget", "admit", "rectangle_budget", "observe_acceptance",
           "acceptance_rate", "choose_k", "choose_caps"]

FIELD = "num_speculative_tokens_per_batch_size"
#: The estimator's constants (vLLM 0.34 ``acceptance_estimator.py``).
REFIT_INTERVAL, RIDGE, DAMPING, MAX_FEATURE = 100, 1e-3, 50.0, 40.0
OMEGA0, BETA0 = 0.5, -0.2
#: The policy's per-step decay of a request's evidence: recent steps weigh more, and a
#: request drafting nothing drifts back to the (optimistic) prior, so K = 0 is retried.
DECAY = 0.9
#: The acceptance prior: mean and weight in trials (optimistic, so a request with little
#: evidence drafts and gathers some).
PRIOR, PRIOR_WEIGHT = 0.8, 2.0


def validate_k_schedule(schedule: Any) -> list[tuple[int, int, int]]:
    """vLLM's checks of a ``[lo, hi, K]`` schedule (messages name the field); the entries
    sorted."""
    if schedule is None:
        raise ArgumentError(f"{FIELD} is required for dynamic speculative decoding")
    if not isinstance(schedule, (list, tuple)):
        raise ArgumentTypeError(f"{FIELD} must be a list of [lo, hi, K], got {show(schedule)}")
    if not schedule:
        raise ArgumentError(f"{FIELD} must not be empty")
    out = []
    for e in schedule:
        if (not isinstance(e, (list, tuple)) or len(e) != 3
                or not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in e)):
            raise ArgumentError(f"each {FIELD} entry must be a 3-item sequence of ints "
                                f"[lo, hi, K] (vLLM 0.34 has no context ranges), got {show(e)}")
        lo, hi, k = (int(v) for v in e)
        if lo <= 0 or hi <= 0 or lo > hi:
            raise ArgumentError(f"{FIELD} range {show([lo, hi])}: needs 0 < lo <= hi")
        if k < 0:
            raise ArgumentError(f"{FIELD} K values must be >= 0, got {k}")
        out.append((lo, hi, k))
    out.sort()
    end = 0
    for lo, hi, _ in out:
        if lo <= end:
            raise ArgumentError(f"{FIELD} ranges must be non-overlapping and sorted")
        end = hi
    if out[0][0] != 1:
        raise ArgumentError(f"{FIELD}: the first range must start at 1, got {out[0][0]}")
    return out


def k_schedule_lookup(schedule: Any, max_num_seqs: int, k: int) -> np.ndarray:
    """``dense[b]`` (b = 0..max_num_seqs; 0 unused, 0) = the K of the range holding b,
    a gap or the tail carrying the previous range's K, each capped at ``k``."""
    entries = validate_k_schedule(schedule)
    if max_num_seqs < 1 or k < 1:
        raise ArgumentError(f"{FIELD} needs max_num_seqs >= 1 and k >= 1, got "
                            f"{max_num_seqs}, {k}")
    dense = np.zeros(max_num_seqs + 1, np.int32)
    for i, (lo, _, kk) in enumerate(entries):
        stop = entries[i + 1][0] if i + 1 < len(entries) else max_num_seqs + 1
        dense[lo:stop] = min(kk, k)
    return dense


def draft_feature(logits: jax.Array, temperature: jax.Array | float = 1.0) -> jax.Array:
    """``logit(q_max) = -log sum_{z != argmax} exp(z - z_max)`` of ``softmax(logits / T)``
    (T <= 0 reads as 1), clipped to +-40: ``[..., V]`` -> ``[...]`` float32. It scores the
    distribution, not the drawn token, so trimming on it stays lossless."""
    t = jnp.asarray(temperature, jnp.float32)
    z = logits.astype(jnp.float32) / jnp.where(t > 0, t, 1.0)[..., None]
    m = jnp.max(z, axis=-1, keepdims=True)
    first = jnp.argmax(z, axis=-1)[..., None]
    others = jnp.where(jnp.arange(z.shape[-1]) == first, -jnp.inf, z - m)
    return jnp.clip(-jax.nn.logsumexp(others, axis=-1), -MAX_FEATURE, MAX_FEATURE)


class EstimatorState(NamedTuple):
    """``omega`` (shared slope, >= 0), ``beta [k]`` (per-position intercepts); this round's
    IRLS statistics ``info [k+1, k+1]`` / ``grad [k+1]`` over design rows ``[f, e_j]`` and
    ``count``; ``steps`` since the last refit; ``refits`` so far."""

    omega: jax.Array
    beta: jax.Array
    info: jax.Array
    grad: jax.Array
    count: jax.Array
    steps: jax.Array
    refits: jax.Array


def estimator_init(k: int) -> EstimatorState:
    f = jnp.float32
    return EstimatorState(jnp.asarray(OMEGA0, f), jnp.full((k,), BETA0, f),
                          jnp.zeros((k + 1, k + 1), f), jnp.zeros((k + 1,), f),
                          jnp.zeros((), f), jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32))


def estimator_predict(st: EstimatorState, feature: jax.Array) -> jax.Array:
    """Acceptance probability of each draft position: ``feature [B, k]`` -> ``[B, k]``."""
    return jax.nn.sigmoid(st.omega * feature + st.beta)


def estimator_observe(st: EstimatorState, feature: jax.Array, num_accepted: jax.Array,
                      num_verified: jax.Array) -> EstimatorState:
    """Fold one verified step into the round's statistics and count the step. Position j
    of a request is observed iff ``j <= num_accepted`` and ``j < num_verified`` (the chain
    reached it and it was verified); its label is ``j < num_accepted``. Padded rows pass
    ``num_verified = 0``."""
    b, k = feature.shape
    j = jnp.arange(k)
    obs = (j <= num_accepted[:, None]) & (j < num_verified[:, None])
    y = (j < num_accepted[:, None]).astype(jnp.float32)
    p = estimator_predict(st, feature)
    w = jnp.where(obs, p * (1 - p), 0.0)
    r = jnp.where(obs, y - p, 0.0)
    x = jnp.concatenate([feature[..., None], jnp.broadcast_to(jnp.eye(k), (b, k, k))], -1)
    info = st.info + jnp.einsum("bj,bjp,bjq->pq", w, x, x)
    grad = st.grad + jnp.einsum("bj,bjp->p", r, x)
    return st._replace(info=info, grad=grad, count=st.count + jnp.sum(obs),
                       steps=st.steps + 1)


def estimator_refit(st: EstimatorState) -> EstimatorState:
    """Every :data:`REFIT_INTERVAL` steps (else unchanged): one Newton step
    ``(info + ridge I)^-1 grad``, damped by ``n / (n + 50)`` (n: the round's observations),
    ``omega`` kept >= 0; the statistics reset."""
    def refit(st):
        n = st.info.shape[0]
        delta = jnp.linalg.solve(st.info + RIDGE * jnp.eye(n), st.grad)
        delta = jnp.where(jnp.all(jnp.isfinite(delta)), delta, 0.0) * st.count / (st.count + DAMPING)
        return EstimatorState(jnp.maximum(st.omega + delta[0], 0.0), st.beta + delta[1:],
                              jnp.zeros_like(st.info), jnp.zeros_like(st.grad),
                              jnp.zeros_like(st.count), jnp.zeros_like(st.steps), st.refits + 1)
    return jax.lax.cond(st.steps >= REFIT_INTERVAL, refit, lambda s: s, st)


def survival(conf: jax.Array) -> jax.Array:
    """``S_{r,j} = prod_{i <= j} c_{r,i}``: the chance draft j is reached and accepted."""
    return jnp.cumprod(conf, axis=-1)


def verification_budget(surv: jax.Array, num_drafts: jax.Array, n0: jax.Array,
                        draft_cost: jax.Array, verify_cost: jax.Array,
                        non_draft_tokens: jax.Array, cap: jax.Array) -> jax.Array:
    """``b* = argmax_b (n0 + sum of the top b survivals) / (draft_cost + verify_cost[
    non_draft_tokens + b])``, ``0 <= b <= min(sum(num_drafts), cap)``; ``verify_cost [T]``
    covers every T used (past its end: its last entry)."""
    k = surv.shape[1]
    valid = jnp.arange(k) < num_drafts[:, None]
    s = jnp.sort(jnp.where(valid, surv, -1.0).reshape(-1))[::-1]
    gain = n0 + jnp.concatenate([jnp.zeros(1), jnp.cumsum(jnp.maximum(s, 0.0))])
    b = jnp.arange(gain.shape[0])
    cost = draft_cost + verify_cost[jnp.minimum(non_draft_tokens + b, verify_cost.shape[0] - 1)]
    ok = b <= jnp.minimum(jnp.sum(valid), cap)
    return jnp.argmax(jnp.where(ok, gain / cost, -jnp.inf)).astype(jnp.int32)


def admit(surv: jax.Array, num_drafts: jax.Array, budget: jax.Array) -> jax.Array:
    """Drafts each request keeps (``[B]``): the global top-``budget`` slots by survival,
    ties to the earlier request. Survival falls along a request, so each keeps a prefix."""
    bsz, k = surv.shape
    valid = jnp.arange(k) < num_drafts[:, None]
    key = jnp.where(valid, surv, -1.0).reshape(-1)
    order = jnp.lexsort((jnp.arange(bsz * k), -key))          # survival down, then slot
    rank = jnp.zeros(bsz * k, jnp.int32).at[order].set(jnp.arange(bsz * k, dtype=jnp.int32))
    keep = (rank < budget).reshape(bsz, k) & valid
    return jnp.sum(jnp.cumprod(keep, axis=1), axis=1).astype(jnp.int32)


def rectangle_budget(surv: np.ndarray, num_drafts: np.ndarray, n0: int,
                     cost: np.ndarray) -> int:
    """The budget for a ``[B, K + 1]`` verify step costing ``cost[K]``: ``K* = argmax_K (n0 +
    sum_r sum_{j < min(K, num_drafts[r])} surv[r, j]) / cost[K]`` (ties: the smaller K)."""
    surv = np.asarray(surv, np.float64)
    k = surv.shape[1]
    valid = np.arange(k)[None, :] < np.asarray(num_drafts)[:, None]
    gain = n0 + np.concatenate([[0.0], np.cumsum(np.where(valid, surv, 0.0).sum(0))])
    kk = min(k, len(cost) - 1)
    return int(np.argmax(gain[:kk + 1] / np.asarray(cost, np.float64)[:kk + 1]))


def observe_acceptance(hits: np.ndarray, trials: np.ndarray, drafts: np.ndarray,
                       accepted: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One step's evidence per request: ``accepted`` of ``drafts`` means
    ``min(accepted + 1, drafts)`` positions tried. Old evidence decays by :data:`DECAY`."""
    tried = np.minimum(accepted + 1, drafts)
    return DECAY * hits + accepted, DECAY * trials + tried


def acceptance_rate(hits: np.ndarray, trials: np.ndarray) -> np.ndarray:
    """The conditional acceptance estimate ``(hits + PRIOR * w) / (trials + w)``, w the
    prior's weight."""
    return ((np.asarray(hits, np.float64) + PRIOR * PRIOR_WEIGHT)
            / (np.asarray(trials, np.float64) + PRIOR_WEIGHT))


def choose_k(rates: np.ndarray, caps: np.ndarray, cost: np.ndarray) -> int:
    """``argmax_K sum_r E(a_r, min(K, cap_r)) / cost[K]``, ``E(a, K) = (1 - a^(K+1)) /
    (1 - a)`` (ties: the smaller K)."""
    a = np.clip(np.asarray(rates, np.float64), 0.0, 1.0 - 1e-9)[:, None]
    ks = np.minimum(np.arange(len(cost))[None, :], np.asarray(caps)[:, None])
    gain = ((1 - a ** (ks + 1)) / (1 - a)).sum(0)
    return int(np.argmax(gain / np.asarray(cost, np.float64)))


def choose_caps(rates: np.ndarray, caps: np.ndarray, options: list[tuple[int, int, float]]
                ) -> tuple[int, int, np.ndarray]:
    """Per-request drafts: option ``(K, T, cost)`` chains K drafts and holds ``n`` tokens
    plus ``T - n`` drafts (T None: every request ``min(K, cap_r)``), given to the highest
    survivals ``a_r^j``, ``j <= min(K, cap_r)``. Returns ``(K, T, c [n])`` of the most
    expected tokens a second (ties: the first option)."""
    a = np.clip(np.asarray(rates, np.float64), 0.0, 1.0 - 1e-9)
    caps = np.asarray(caps, np.int64)
    n = a.shape[0]
    kmax = max(k for k, _, _ in options)
    j = np.arange(1, kmax + 1)
    surv = a[:, None] ** j[None, :]                                    # [n, kmax]
    best = None
    for k, t, cost in options:
        lim = np.minimum(caps, k)
        ok = j[None, :] <= lim[:, None]
        if t is None or t - n >= int(lim.sum()):
            c = lim
        else:
            order = np.argsort(np.where(ok, -surv, np.inf), axis=None, kind="stable")[: t - n]
            c = np.bincount(order // kmax, minlength=n)
        gain = n + float(np.where(j[None, :] <= c[:, None], surv, 0.0).sum())
        if best is None or gain / cost > best[0]:
            best = (gain / cost, k, t, c)
    return best[1], best[2], best[3].astype(np.int64)

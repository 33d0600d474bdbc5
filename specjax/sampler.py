"""Rejection sampler: verify drafts against the target (vLLM ``rejection_sampler.py``).

Greedy rows accept while the draft equals the target argmax and then emit the target's
token; random rows accept a draft token x when ``p_target(x) / p_draft(x) >= u`` and, on
rejection, sample from the normalized residual ``max(p_target - p_draft, 0)``. Greedy and
random rows mix in one batch. Every proposer of specjax drafts greedily and passes no draft
probabilities (a certain draft: ``p_draft(x) = 1``, and the residual is ``p_target`` with
the draft token removed), as vLLM v0.20 does; the probability path is for sampled drafts.

Randomness is per request: row r uses only ``keys[r]`` (folded with the draft position and
a stream id), so a seeded request gives the same tokens whatever else is in the batch.
Uniforms are float32 (vLLM draws float64; JAX would need ``jax_enable_x64``).

Token trees (EAGLE / EAGLE-3 ``speculative_token_tree``): ``tree_greedy_verify`` walks the
tree from the root on the target's argmax; ``tree_rejection_sample`` verifies from logits,
greedy rows as ``tree_greedy_verify`` and random rows (temperature > 0) by multi-draft
rejection sampling of the certain drafts level by level (siblings tried in tree order
against the residual left by the rejected ones; recovered token from the final residual,
bonus token at a node without drafted children): lossless, and a chain tree is exactly
the chain rule above.

Logits processing (``specjax.logits_processors``: penalties, min_p, logit_bias, bad words,
allowed_token_ids, min_tokens, user processors) runs when ``SamplingMetadata.procs`` is set,
at every verified position with the preceding drafts counted as output, BEFORE greedy and
random verification (:func:`process_logits`); ``procs=None`` is the plain program.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax.logits_processors import ProcessorState, apply_min_p, apply_processors
from specjax.metadata import SpecDecodeMetadata

PLACEHOLDER_TOKEN_ID = -1
GREEDY_TEMPERATURE = 0.0
MAX_SPEC_LEN = 128

# Stream ids folded into a request's key, one per use of randomness.
_STREAM_ACCEPT, _STREAM_RECOVER, _STREAM_BONUS = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class SamplingMetadata:
    """Per-request sampling parameters, ``[B_pad]`` each (a pytree).

    temperature: float32; ``0`` means greedy.
    top_k: int32; ``0`` (or >= vocab) disables top-k.
    top_p: float32 in (0, 1]; ``1`` disables top-p.
    keys: ``[B_pad, 2] uint32`` raw PRNG keys (``jax.random.key_data``), one per request.
    procs: ``specjax.logits_processors.ProcessorState`` or None (no logits processing:
      the plain program).
    all_greedy: static; lets the jit skip the random path entirely.
    processors: static tuple of user logits processors (``procs.selector`` picks one).
    """

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    keys: jax.Array
    procs: ProcessorState | None = None
    all_greedy: bool = False
    processors: tuple = ()

    @classmethod
    def create(cls, temperature, top_k=None, top_p=None, seeds=None, *, step: int = 0
               ) -> "SamplingMetadata":
        """Build on the host. ``seeds``: one int per request (None draws from 0..B-1);
        ``step`` is folded into each key so successive steps differ."""
        import numpy as np

        t = np.asarray(temperature, np.float32)
        if t.ndim != 1:
            raise ValueError(f"temperature must be [B], got shape {t.shape}")
        if (t < 0).any() or not np.isfinite(t).all():
            raise ValueError("temperature must be finite and >= 0 (0 means greedy)")
        b = t.shape[0]
        k = np.zeros(b, np.int32) if top_k is None else np.asarray(top_k, np.int32)
        p = np.ones(b, np.float32) if top_p is None else np.asarray(top_p, np.float32)
        if k.shape != (b,) or (k < 0).any():
            raise ValueError(f"top_k must be [B={b}] ints >= 0 (0 disables), got {k!r}")
        if p.shape != (b,) or (p <= 0).any() or (p > 1).any():
            raise ValueError(f"top_p must be [B={b}] values in (0, 1], got {p!r}")
        s = np.arange(b) if seeds is None else np.asarray(seeds, np.int64)
        if s.shape != (b,):
            raise ValueError(f"seeds must hold one int per request ({b}), got shape {s.shape}")
        keys = jax.vmap(lambda sd: jax.random.key_data(
            jax.random.fold_in(jax.random.key(sd), step)))(jnp.asarray(s % 2**31, jnp.uint32))
        return cls(jnp.asarray(t), jnp.asarray(k), jnp.asarray(p), keys,
                   all_greedy=bool((t == GREEDY_TEMPERATURE).all()))


jax.tree_util.register_dataclass(
    SamplingMetadata, data_fields=["temperature", "top_k", "top_p", "keys", "procs"],
    meta_fields=["all_greedy", "processors"])


@dataclasses.dataclass(frozen=True)
class SamplingState:
    """Per-request sampling state the device decode loop carries (``specjax.decode_loop``),
    ``[B_pad]`` each (a pytree owned by the sampler).

    temperature / top_k / top_p: as in :class:`SamplingMetadata`; seeds: uint32;
    counters: int32, tokens each request has generated so far. A request's key for a step
    is ``fold_in(key(seed), counter)`` (the per-step path's rule), so the loop's keys
    advance exactly as the per-step loop's do. procs: the logits processors' state
    (``specjax.logits_processors.ProcessorState``: parameters and token history, which
    :meth:`advance` extends with the emitted tokens), or None.
    """

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    seeds: jax.Array
    counters: jax.Array
    procs: ProcessorState | None = None

    def metadata(self, all_greedy: bool, processors: tuple = ()) -> "SamplingMetadata":
        """This step's ``SamplingMetadata`` (traceable)."""
        keys = jax.vmap(lambda s, c: jax.random.key_data(
            jax.random.fold_in(jax.random.key(s), c)))(self.seeds, self.counters)
        return SamplingMetadata(self.temperature, self.top_k, self.top_p, keys, self.procs,
                                all_greedy=all_greedy, processors=processors)

    def advance(self, num_emitted: jax.Array, emitted: jax.Array | None = None
                ) -> "SamplingState":
        """After a step that emitted ``num_emitted [B]`` tokens per request
        (``emitted [B, k+1]``, -1 padded: appended to ``procs``' token history)."""
        n = num_emitted.astype(jnp.int32)
        procs = self.procs
        if procs is not None:
            w = procs.token_ids.shape[1]
            jj = jnp.arange(emitted.shape[1], dtype=jnp.int32)[None, :]
            col = jnp.where(jj < n[:, None], procs.num_tokens[:, None] + jj, w)
            rows = jnp.broadcast_to(jnp.arange(n.shape[0], dtype=jnp.int32)[:, None], col.shape)
            procs = dataclasses.replace(
                procs, token_ids=procs.token_ids.at[rows, col].set(emitted, mode="drop"),
                num_tokens=procs.num_tokens + n)
        return dataclasses.replace(self, counters=self.counters + n, procs=procs)


jax.tree_util.register_dataclass(
    SamplingState, data_fields=["temperature", "top_k", "top_p", "seeds", "counters", "procs"],
    meta_fields=[])


def apply_top_k_top_p(logits: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Mask logits outside the top-k / top-p set to ``-inf``.

    ``logits``: ``[..., V]`` float32; ``top_k``, ``top_p``: ``[...]``. Top-k keeps values
    >= the k-th largest (ties kept); top-p keeps the smallest prefix of the sorted
    distribution whose mass reaches p (at least one token).
    """
    v = logits.shape[-1]
    srt = jnp.sort(logits, axis=-1)[..., ::-1]                       # descending
    k = jnp.where((top_k <= 0) | (top_k >= v), v, top_k)
    kth = jnp.take_along_axis(srt, (k - 1)[..., None], axis=-1)
    logits = jnp.where(logits < kth, -jnp.inf, logits)
    srt = jnp.where(jnp.arange(v) < k[..., None], srt, -jnp.inf)
    probs = jax.nn.softmax(srt, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs                  # mass of strictly larger
    keep_sorted = (mass_before < top_p[..., None]) | (jnp.arange(v) == 0)
    # threshold: smallest kept sorted value
    n_keep = keep_sorted.sum(axis=-1)
    thr = jnp.take_along_axis(srt, (n_keep - 1)[..., None], axis=-1)
    use_p = (top_p < 1.0)[..., None]
    return jnp.where(use_p & (logits < thr), -jnp.inf, logits)


def _process(logits: jax.Array, temperature, top_k, top_p, min_p=None) -> jax.Array:
    """Temperature, then min_p (when given), then top-k/top-p; greedy rows (temperature 0)
    are divided by 1."""
    t = jnp.where(temperature == GREEDY_TEMPERATURE, 1.0, temperature)
    logits = logits / t[..., None]
    if min_p is not None:
        logits = apply_min_p(logits, min_p)
    return apply_top_k_top_p(logits, top_k, top_p)


def _pre(logits: jax.Array, sampling: SamplingMetadata, prefix_tokens=None, prefix_len=None
         ) -> jax.Array:
    """``logits [B, T, V]`` through the logits processors (float32; unchanged without
    ``sampling.procs``): what greedy verification takes the argmax of."""
    logits = logits.astype(jnp.float32)
    if sampling.procs is None:
        return logits
    return apply_processors(logits, sampling.procs, prefix_tokens, prefix_len, sampling.processors)


def _post(logits: jax.Array, sampling: SamplingMetadata) -> jax.Array:
    """``[B, T, V]`` processed logits -> temperature, min_p, top-k / top-p."""
    col = lambda x: x[:, None]  # noqa: E731
    min_p = None if sampling.procs is None else col(sampling.procs.min_p)
    return _process(logits, col(sampling.temperature), col(sampling.top_k), col(sampling.top_p),
                    min_p)


def process_logits(logits: jax.Array, sampling: SamplingMetadata,
                   prefix_tokens: jax.Array | None = None, prefix_len: jax.Array | None = None
                   ) -> jax.Array:
    """The fully processed logits the rejection sampler and the bonus sampler draw from.

    ``logits``: ``[B, V]`` or ``[B, T, V]`` (T positions per request); ``prefix_tokens
    [B, T, D] int32`` / ``prefix_len [B, T] int32``: the drafts before each position,
    counted as output by the processors (None: none; chain verification passes the
    request's drafts with ``prefix_len = j`` at draft position j). Applies the logits
    processors (``sampling.procs``), then temperature (greedy rows: 1), min_p, top-k /
    top-p. Returns float32 of ``logits``' shape; ``softmax`` of it is the target
    distribution, and its argmax is greedy's token.
    """
    squeeze = logits.ndim == 2
    x = logits[:, None] if squeeze else logits
    if squeeze and prefix_tokens is not None and prefix_tokens.ndim == 2:
        prefix_tokens, prefix_len = prefix_tokens[:, None], jnp.reshape(prefix_len, (-1, 1))
    out = _post(_pre(x, sampling, prefix_tokens, prefix_len), sampling)
    return out[:, 0] if squeeze else out


def _chain_prefix(drafts: jax.Array, t: int):
    """Chain verification: position j's prefix is the request's first j drafts."""
    b, k = drafts.shape
    tok = jnp.broadcast_to(drafts[:, None, :], (b, t, k))
    return tok, jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None, :], (b, t))


def _keys(keys: jax.Array, stream: int, pos: jax.Array | int):
    """``[B, 2]`` raw keys -> typed keys folded with a stream and a position."""
    k = jax.random.wrap_key_data(keys)
    k = jax.vmap(lambda kk: jax.random.fold_in(kk, stream))(k)
    return jax.vmap(lambda kk: jax.random.fold_in(kk, pos))(k) if isinstance(pos, int) else \
        jax.vmap(lambda kk: jax.vmap(lambda p: jax.random.fold_in(kk, p))(pos))(k)


def sample_tokens(logits: jax.Array, sampling: SamplingMetadata,
                  prefix_tokens: jax.Array | None = None, prefix_len: jax.Array | None = None
                  ) -> jax.Array:
    """The ordinary sampler for the bonus position: ``[B, V]`` -> ``[B] int32``.

    Greedy rows take the argmax; random rows sample the processed distribution with the
    exponential trick (``argmax p / q``, ``q ~ Exp(1)``), keyed per request. With logits
    processors, ``prefix_tokens [B, D]`` / ``prefix_len [B]`` are the drafts before the
    position (see :func:`process_logits`).
    """
    logits = logits.astype(jnp.float32)
    if sampling.procs is None:       # the plain program
        greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        if sampling.all_greedy:
            return greedy
        probs = jax.nn.softmax(_process(logits, sampling.temperature, sampling.top_k,
                                        sampling.top_p), -1)
    else:
        if prefix_tokens is not None:
            prefix_tokens, prefix_len = prefix_tokens[:, None], prefix_len[:, None]
        pre = _pre(logits[:, None], sampling, prefix_tokens, prefix_len)
        greedy = jnp.argmax(pre[:, 0], axis=-1).astype(jnp.int32)
        if sampling.all_greedy:
            return greedy
        probs = jax.nn.softmax(_post(pre, sampling)[:, 0], -1)
    keys = _keys(sampling.keys, _STREAM_BONUS, 0)
    q = jax.vmap(lambda k: jax.random.exponential(k, (logits.shape[-1],)))(keys)
    sampled = jnp.argmax(probs / q, axis=-1).astype(jnp.int32)
    return jnp.where(sampling.temperature == GREEDY_TEMPERATURE, greedy, sampled)


@jax.jit
def rejection_sample(
    metadata: SpecDecodeMetadata,
    draft_probs: jax.Array | None,
    logits: jax.Array,
    sampling: SamplingMetadata,
    synthetic_conditional_rates: jax.Array | None = None,
) -> jax.Array:
    """Verify the drafts of a batch.

    Args:
      metadata: where the drafts are (``max_spec_len`` static, at most ``MAX_SPEC_LEN``).
      draft_probs: ``[N_pad, V]`` float probabilities the drafts were sampled from, or None
        for certain (greedy / n-gram) drafts.
      logits: ``[N_pad + B_pad, V]`` target logits, rows as ``metadata.logits_indices``
        (the draft positions and each request's bonus position).
      sampling: per-request parameters.
      synthetic_conditional_rates: ``[max_spec_len]`` float32 for vLLM's synthetic mode
        (accept position j with probability ``rate[j]`` given j-1 accepted), or None.

    Returns:
      ``[B_pad, max_spec_len + 1] int32``: accepted drafts, then the recovered token at the
      first rejection, or the bonus token when every draft was accepted; -1 after. Padding
      rows (past ``num_reqs``) are all -1.
    """
    k = metadata.max_spec_len
    if k > MAX_SPEC_LEN:
        raise ValueError(f"max_spec_len={k} exceeds MAX_SPEC_LEN={MAX_SPEC_LEN}")
    b = metadata.num_draft_tokens.shape[0]
    v = logits.shape[-1]
    n_draft = metadata.num_draft_tokens
    rows = jnp.arange(b, dtype=jnp.int32)
    real = rows < metadata.num_reqs
    start = metadata.cu_num_draft_tokens - n_draft                    # exclusive cumsum
    j = jnp.arange(k, dtype=jnp.int32)
    has = j[None, :] < n_draft[:, None]                               # [B, K]
    flat = jnp.where(has, start[:, None] + j[None, :], 0)
    n_pad = metadata.draft_token_ids.shape[0]
    flat = jnp.clip(flat, 0, max(n_pad - 1, 0))
    drafts = metadata.draft_token_ids[flat] if n_pad else jnp.zeros((b, k), jnp.int32)
    tgt_rows = metadata.target_logits_indices[flat] if n_pad else jnp.zeros((b, k), jnp.int32)
    tgt_logits = logits[tgt_rows].astype(jnp.float32)                 # [B, K, V]
    bonus_logits = logits[metadata.bonus_logits_indices]              # [B, V]
    greedy_row = sampling.temperature == GREEDY_TEMPERATURE
    safe_drafts = jnp.clip(drafts, 0, v - 1)
    if sampling.procs is not None:     # position j sees drafts[:j] as output; bonus all
        if k:
            tgt_logits = _pre(tgt_logits, sampling, *_chain_prefix(safe_drafts, k))
        bonus = sample_tokens(bonus_logits, sampling, safe_drafts, n_draft)
    else:
        bonus = sample_tokens(bonus_logits, sampling)
    tgt_argmax = jnp.argmax(tgt_logits, axis=-1).astype(jnp.int32)

    if synthetic_conditional_rates is not None:
        u = jax.vmap(lambda kk: jax.random.uniform(kk, (k,)))(_keys(sampling.keys, _STREAM_ACCEPT, 0))
        synth_accept = u < synthetic_conditional_rates[None, :k]

    # --- greedy rows
    if synthetic_conditional_rates is None:
        accept_g = drafts == tgt_argmax
    else:
        accept_g = synth_accept
    recovered_g = tgt_argmax

    if sampling.all_greedy:
        accept, recovered = accept_g, recovered_g
    else:
        # --- random rows
        proc = _post(tgt_logits, sampling)
        tgt_probs = jax.nn.softmax(proc, axis=-1)
        p_t = jnp.take_along_axis(tgt_probs, safe_drafts[..., None], axis=-1)[..., 0]
        if draft_probs is None:
            p_d = jnp.ones_like(p_t)
            residual = jnp.where(jnp.arange(v)[None, None, :] == safe_drafts[..., None], 0.0, tgt_probs)
        else:
            dprobs = draft_probs[flat].astype(jnp.float32)           # [B, K, V]
            p_d = jnp.take_along_axis(dprobs, safe_drafts[..., None], axis=-1)[..., 0]
            residual = jnp.maximum(tgt_probs - dprobs, 0.0)
        if synthetic_conditional_rates is None:
            u = jax.vmap(lambda kk: jax.random.uniform(kk, (k,)))(
                _keys(sampling.keys, _STREAM_ACCEPT, 0))
            ratio = p_t / jnp.where(p_d > 0, p_d, 1.0)
            accept_r = (p_d > 0) & (ratio >= u)
        else:
            accept_r = synth_accept
        qkeys = _keys(sampling.keys, _STREAM_RECOVER, j)                  # [B, K] keys
        q = jax.vmap(jax.vmap(lambda kk: jax.random.exponential(kk, (v,))))(qkeys)
        recovered_r = jnp.argmax(residual / q, axis=-1).astype(jnp.int32)
        accept = jnp.where(greedy_row[:, None], accept_g, accept_r)
        recovered = jnp.where(greedy_row[:, None], recovered_g, recovered_r)

    # Leading accepted drafts; the first rejection emits the recovered token.
    accepted_prefix = jnp.cumprod((accept & has).astype(jnp.int32), axis=1).astype(bool)
    n_acc = accepted_prefix.sum(axis=1)                                # [B]
    out = jnp.full((b, k + 1), PLACEHOLDER_TOKEN_ID, jnp.int32)
    jj = jnp.arange(k + 1, dtype=jnp.int32)[None, :]
    drafts_ext = jnp.concatenate([drafts, jnp.zeros((b, 1), jnp.int32)], axis=1)
    rec_ext = jnp.concatenate([recovered, jnp.zeros((b, 1), jnp.int32)], axis=1)
    all_acc = n_acc == n_draft
    out = jnp.where(jj < n_acc[:, None], drafts_ext, out)
    out = jnp.where((jj == n_acc[:, None]) & ~all_acc[:, None], rec_ext, out)
    out = jnp.where((jj == n_draft[:, None]) & all_acc[:, None], bonus[:, None], out)
    return jnp.where(real[:, None], out, PLACEHOLDER_TOKEN_ID)


def unconditional_to_conditional_rates(rates) -> list[float]:
    """vLLM's synthetic-mode helper: ``out[i] = rates[i] / rates[i-1]`` (``rates[-1] = 1``),
    0 where the denominator is 0."""
    out, prev = [], 1.0
    for r in rates:
        out.append(0.0 if prev == 0 else float(r) / prev)
        prev = float(r)
    return out


def parse_output(output_token_ids, vocab_size: int, discard_req_indices=()) -> list[list[int]]:
    """Host-side: keep entries that are not -1 and below vocab; empty discarded rows."""
    import numpy as np

    arr = np.asarray(output_token_ids)
    out = [[int(t) for t in row if t != PLACEHOLDER_TOKEN_ID and t < vocab_size] for row in arr]
    for i in discard_req_indices:
        out[i] = []
    return out


# ---------------------------------------------------------------------------------------
# tree verification (specjax's own: vLLM v0.20 verifies every draft as a chain)


def tree_greedy_verify(target_token_ids: jax.Array, draft_token_ids: jax.Array,
                       num_drafts: jax.Array | None = None, *, tree, num_reqs=None
                       ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Greedy verification of a token tree (traceable; the tree is static).

    Walk from the root: at the current node (the root first) the target's argmax is
    compared with the drafted tokens of the node's children, in tree order; the first
    child that matches is accepted and the walk continues from it, otherwise it stops.
    (Drafts of one level are distinct in a top-k tree, so at most one child matches;
    otherwise the first in tree order wins.) The emitted tokens are the accepted drafts,
    then the target's argmax at the last accepted node (the bonus / recovered token).

    Args:
      target_token_ids: ``[B, 1 + N] int32``, the target's argmax at every query slot of
        the verification pass: slot 0 is the root (the last committed token), slot
        ``1 + j`` is node ``j``.
      draft_token_ids: ``[B, N] int32``, the drafted token of each node, in tree order
        (``tree.choices``).
      num_drafts: ``[B] int32`` or None (all ``N``): nodes ``j >= num_drafts[b]`` are
        absent. A prefix of the breadth-first node order holds every ancestor of its
        nodes, so any prefix is a valid (truncated) tree; 0 verifies the root only.
      tree: a ``specjax.token_tree.TokenTree`` (static).
      num_reqs: 0-d int or None (every row real): rows ``>= num_reqs`` are padding.

    Returns:
      ``(output, accepted_nodes, num_accepted)``:

      * ``output [B, depth + 1] int32``: as ``rejection_sample`` (the chain version):
        accepted drafts, then the target's argmax at the last accepted node; -1 after. A
        real row without drafts gives just the root's argmax; padding rows are all -1.
      * ``accepted_nodes [B, depth] int32``: the accepted node indices, level 1 first;
        -1 after the last (and on padding rows).
      * ``num_accepted [B] int32`` (0 on padding rows).

    A chain tree (``TokenTree.chain(k)``) gives exactly ``rejection_sample``'s greedy
    output.
    """
    n, depth = tree.num_nodes, tree.depth
    tgt = jnp.asarray(target_token_ids).astype(jnp.int32)
    drafts = jnp.asarray(draft_token_ids).astype(jnp.int32)
    b = tgt.shape[0]
    if tgt.shape != (b, n + 1) or drafts.shape != (b, n):
        raise ValueError(f"target_token_ids must be [B, 1+N] and draft_token_ids [B, N] with "
                         f"N={n} tree nodes; got {tgt.shape} and {drafts.shape}")
    rows = jnp.arange(b, dtype=jnp.int32)
    real = jnp.ones((b,), bool) if num_reqs is None else rows < num_reqs
    nd = jnp.full((b,), n, jnp.int32) if num_drafts is None else jnp.asarray(num_drafts, jnp.int32)
    parents = tree.parents
    cur = jnp.full((b,), -1, jnp.int32)                # current node, -1 = the root
    alive = real
    accepted = []
    start = 0
    for size in tree.level_sizes:                      # static: one small step per level
        nodes = jnp.arange(start, start + size, dtype=jnp.int32)
        par = jnp.asarray(parents[start : start + size], jnp.int32)
        at_cur = jnp.take_along_axis(tgt, (cur + 1)[:, None], axis=1)       # [B, 1]
        match = ((par[None, :] == cur[:, None]) & (drafts[:, start : start + size] == at_cur)
                 & (nodes[None, :] < nd[:, None]) & alive[:, None])          # [B, size]
        hit = match.any(axis=1)
        first = nodes[jnp.argmax(match, axis=1)]
        alive = alive & hit
        cur = jnp.where(alive, first, cur)
        accepted.append(jnp.where(alive, first, -1))
        start += size
    acc_nodes = jnp.stack(accepted, axis=1)            # [B, depth]
    n_acc = (acc_nodes >= 0).sum(axis=1).astype(jnp.int32)
    acc_tokens = jnp.take_along_axis(drafts, jnp.maximum(acc_nodes, 0), axis=1)
    bonus = jnp.take_along_axis(tgt, (cur + 1)[:, None], axis=1)[:, 0]
    jj = jnp.arange(depth + 1, dtype=jnp.int32)[None, :]
    ext = jnp.concatenate([acc_tokens, jnp.zeros((b, 1), jnp.int32)], axis=1)
    out = jnp.where(jj < n_acc[:, None], ext, PLACEHOLDER_TOKEN_ID)
    out = jnp.where(jj == n_acc[:, None], bonus[:, None], out)
    out = jnp.where(real[:, None], out, PLACEHOLDER_TOKEN_ID)
    return out, acc_nodes, jnp.where(real, n_acc, 0)


def _tree_children(tree) -> tuple[tuple[tuple[int, ...], ...], tuple[int, ...]]:
    """Static: ``(kids, max_kids)``: ``kids[1 + i]`` the children of node ``i`` in tree
    order (``kids[0]`` the root's), padded with -1 to the widest; ``max_kids[l]`` the most
    children of any node of level ``l`` (the root is level 0)."""
    n = tree.num_nodes
    kids = [[] for _ in range(n + 1)]
    for j, p in enumerate(tree.parents):
        kids[p + 1].append(j)
    level_of = (0,) + tree.depths                      # level of slot 1 + i (root 0)
    max_kids = [0] * (tree.depth + 1)
    for s, ks in enumerate(kids):
        max_kids[level_of[s]] = max(max_kids[level_of[s]], len(ks))
    width = max(max_kids)
    table = tuple(tuple(ks + [-1] * (width - len(ks))) for ks in kids)
    return table, tuple(max_kids)


def _tree_prefix(draft_token_ids: jax.Array, tree, v: int):
    """Tree verification: slot 0 (the root) has no prefix; slot ``1 + j`` the drafted tokens
    of node ``j``'s path from level 1 down to ``j`` (``[B, 1 + N, depth]``, ``[B, 1 + N]``)."""
    n, depth = tree.num_nodes, tree.depth
    paths = [[]]
    for j in range(n):
        p = tree.parents[j]
        paths.append((paths[p + 1] if p >= 0 else []) + [j])
    table = jnp.asarray([pp + [0] * (depth - len(pp)) for pp in paths], jnp.int32)
    lens = jnp.asarray([len(pp) for pp in paths], jnp.int32)
    d = jnp.clip(jnp.asarray(draft_token_ids).astype(jnp.int32), 0, v - 1)
    b = d.shape[0]
    tok = d[:, table]                                   # [B, 1 + N, depth]
    return tok, jnp.broadcast_to(lens[None, :], (b, n + 1))


def tree_rejection_sample(target_logits: jax.Array, draft_token_ids: jax.Array,
                          num_drafts: jax.Array | None, sampling: SamplingMetadata, *, tree,
                          num_reqs=None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Verify tree drafts from the target's logits ``[B, 1 + N, V]`` (slot 0 the root,
    slot ``1 + j`` node ``j``); same arguments (``draft_token_ids [B, N]``, ``num_drafts``,
    ``tree``, ``num_reqs``) and outputs as ``tree_greedy_verify``.

    Greedy rows (temperature 0) are ``tree_greedy_verify`` of the argmax. Random rows use
    multi-draft rejection sampling for certain drafts (a tree proposer drafts point masses,
    distinct among siblings): at the current node (the root first) let ``r = p``, the
    target's processed distribution (``_process``: temperature, top-k, top-p) at the
    node's slot; its present children ``c_1, c_2, ...`` (nodes ``< num_drafts``) are tried
    in tree order: ``c_j`` is accepted when ``u_j * sum(r) < r(c_j)`` (``u_j`` uniform,
    one per node; ``sum(r)`` is taken as 1 before any rejection) or when ``c_j`` holds all
    of ``r``'s mass (float rounding), otherwise
    ``r(c_j) = 0`` and the next child is tried. An accepted child becomes the current
    node; when every child is rejected the walk emits a token sampled from the residual
    ``r`` (the recovered token) and stops; at a node without present children it emits a
    token sampled from ``p`` there (the bonus token). Each emitted token is then
    distributed exactly as the target's ``p`` (lossless); a chain tree is vLLM's rule for
    ``draft_probs=None``.

    Randomness (per request, from ``sampling.keys[r]`` only, as ``rejection_sample``):
    ``u_j`` is element ``j`` of ``uniform(_keys(keys, ACCEPT, 0), (N,))``; the recovered
    token at a node of level ``l`` (root 0) uses ``exponential(_keys(keys, RECOVER, l),
    (V,))`` and the bonus token ``exponential(_keys(keys, BONUS, 0), (V,))``, both with
    the exponential trick (``argmax r / q``). These are the keys ``rejection_sample`` uses
    for draft position / accepted count ``l``, so a chain tree of ``k`` nodes gives the
    same tokens as chain verification with ``max_spec_len = k``.
    """
    n, depth = tree.num_nodes, tree.depth
    logits = target_logits.astype(jnp.float32)
    if sampling.procs is not None:     # slot 1 + j sees node j's path (its drafts) as output
        logits = _pre(logits, sampling, *_tree_prefix(draft_token_ids, tree, logits.shape[-1]))
    tgt = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    greedy = tree_greedy_verify(tgt, draft_token_ids, num_drafts, tree=tree, num_reqs=num_reqs)
    if sampling.all_greedy:
        return greedy
    drafts = jnp.asarray(draft_token_ids).astype(jnp.int32)
    b, v = logits.shape[0], logits.shape[-1]
    rows = jnp.arange(b, dtype=jnp.int32)
    real = jnp.ones((b,), bool) if num_reqs is None else rows < num_reqs
    nd = jnp.full((b,), n, jnp.int32) if num_drafts is None else jnp.asarray(num_drafts, jnp.int32)
    probs = jax.nn.softmax(_post(logits, sampling), axis=-1)
    u = jax.vmap(lambda kk: jax.random.uniform(kk, (n,)))(_keys(sampling.keys, _STREAM_ACCEPT, 0))
    kids, max_kids = _tree_children(tree)
    kids = jnp.asarray(kids, jnp.int32)                # [1 + N, W]
    safe = jnp.clip(drafts, 0, v - 1)
    vocab = jnp.arange(v, dtype=jnp.int32)[None, :]

    cur = jnp.full((b,), -1, jnp.int32)                # current node, -1 = the root
    walking = real                                      # still descending
    rejected = jnp.zeros((b,), bool)                    # stopped: every child rejected
    resid = jnp.zeros((b, v), jnp.float32)              # residual at the stop (rejected rows)
    level = jnp.zeros((b,), jnp.int32)                  # level of the final node
    accepted = []
    for lv in range(depth):                             # static: the tree's levels
        r = jnp.take_along_axis(probs, (cur + 1)[:, None, None], axis=1)[:, 0]   # [B, V]
        any_rej = jnp.zeros((b,), bool)
        present = jnp.zeros((b,), bool)
        hit = jnp.full((b,), -1, jnp.int32)
        for c in range(max_kids[lv]):                   # static: children tried in order
            j = kids[cur + 1, c]                        # [B], -1 past the node's children
            jc = jnp.maximum(j, 0)
            try_ = walking & (hit < 0) & (j >= 0) & (jc < nd)
            tok = jnp.take_along_axis(safe, jc[:, None], axis=1)[:, 0]
            rc = jnp.take_along_axis(r, tok[:, None], axis=1)[:, 0]
            total = jnp.where(any_rej, r.sum(axis=1), 1.0)
            uj = jnp.take_along_axis(u, jc[:, None], axis=1)[:, 0]
            acc = try_ & ((uj * total < rc) | (rc >= total))
            rej = try_ & ~acc
            hit = jnp.where(acc, j, hit)
            r = jnp.where(rej[:, None] & (vocab == tok[:, None]), 0.0, r)
            any_rej = any_rej | rej
            present = present | try_
        stop_rej = walking & present & (hit < 0)
        resid = jnp.where(stop_rej[:, None], r, resid)
        rejected = rejected | stop_rej
        level = jnp.where(walking & ~(hit >= 0), lv, level)
        walking = walking & (hit >= 0)
        cur = jnp.where(walking, hit, cur)
        accepted.append(jnp.where(walking, hit, -1))
    level = jnp.where(walking, depth, level)
    acc_nodes = jnp.stack(accepted, axis=1)             # [B, depth]
    n_acc = (acc_nodes >= 0).sum(axis=1).astype(jnp.int32)

    # the final token: recovered (residual, key RECOVER level) or bonus (p at cur, BONUS 0)
    rec_base = jax.vmap(lambda kk: jax.random.fold_in(kk, _STREAM_RECOVER))(
        jax.random.wrap_key_data(sampling.keys))
    rec_keys = jax.vmap(jax.random.fold_in)(rec_base, level)      # as _keys(.., RECOVER, level)
    q_rec = jax.vmap(lambda kk: jax.random.exponential(kk, (v,)))(rec_keys)
    q_bonus = jax.vmap(lambda kk: jax.random.exponential(kk, (v,)))(
        _keys(sampling.keys, _STREAM_BONUS, 0))
    p_cur = jnp.take_along_axis(probs, (cur + 1)[:, None, None], axis=1)[:, 0]
    last = jnp.where(rejected, jnp.argmax(resid / q_rec, axis=-1),
                     jnp.argmax(p_cur / q_bonus, axis=-1)).astype(jnp.int32)

    acc_tokens = jnp.take_along_axis(drafts, jnp.maximum(acc_nodes, 0), axis=1)
    jj = jnp.arange(depth + 1, dtype=jnp.int32)[None, :]
    ext = jnp.concatenate([acc_tokens, jnp.zeros((b, 1), jnp.int32)], axis=1)
    out = jnp.where(jj < n_acc[:, None], ext, PLACEHOLDER_TOKEN_ID)
    out = jnp.where(jj == n_acc[:, None], last[:, None], out)
    out = jnp.where(real[:, None], out, PLACEHOLDER_TOKEN_ID)
    n_acc = jnp.where(real, n_acc, 0)

    g = (sampling.temperature == GREEDY_TEMPERATURE)
    return (jnp.where(g[:, None], greedy[0], out), jnp.where(g[:, None], greedy[1], acc_nodes),
            jnp.where(g, greedy[2], n_acc))

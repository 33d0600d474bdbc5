"""``specjax.adaptive_k``: vLLM's ``tests/v1/spec_decode/test_dynamic_sd.py`` lookup cases
restated, and the acceptance estimator / verification budget against NumPy brute force
written from the specification (``vllm_delta_0.33.md`` section 4.2, 0.34's changes)."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import adaptive_k as ak


# -- the batch-size schedule (vLLM's test cases) ------------------------------------------------

def test_lookup_ranges_gaps_and_tail():
    d = ak.k_schedule_lookup([(1, 16, 3), (32, 128, 2), (256, 2048, 0)], 256, 3)
    assert [d[b] for b in (1, 16, 17, 31, 32, 128, 129, 255, 256)] == [3, 3, 3, 3, 2, 2, 2, 2, 0]
    assert d[0] == 0 and len(d) == 257
    with pytest.raises(IndexError):
        d[257]


def test_lookup_caps_k_and_tail_past_the_last_range():
    assert set(ak.k_schedule_lookup([(1, 256, 4)], 256, 3)[1:].tolist()) == {3}
    d = ak.k_schedule_lookup([(1, 4, 2), (8, 8, 1)], 20, 5)
    assert d[1:].tolist() == [2] * 7 + [1] * 13


@pytest.mark.parametrize("bad,match", [
    ([(2, 16, 3)], "must start at 1"),
    ([(1, 16, 3), (32, 64)], "3-item sequence"),
    ([(1, 16, 3), (16, 32, 2)], "non-overlapping and sorted"),
    ([(1, 16, -1)], "values must be >= 0"),
    ([], "must not be empty"),
    (None, "is required"),
    ([(1, 16, 2, 0, 1)], "3-item sequence"),
    ([(3, 1, 2)], "0 < lo <= hi"),
    ([(1, 2, True)], "3-item sequence of ints"),
    ("1,16,3", "must be a list"),
])
def test_bad_schedules_refused_naming_the_field(bad, match):
    with pytest.raises((ValueError, TypeError), match=match) as e:
        ak.k_schedule_lookup(bad, 16, 3)
    assert ak.FIELD in str(e.value)


# -- the feature --------------------------------------------------------------------------------

def test_feature_is_logit_of_the_top_probability():
    rng = np.random.default_rng(0)
    z = rng.standard_normal((5, 7)) * 2
    for t in (1.0, 0.5, 0.0):
        p = np.exp(z / (t or 1.0))
        p /= p.sum(-1, keepdims=True)
        q = p.max(-1)
        want = np.log(q / (1 - q))
        got = ak.draft_feature(jnp.asarray(z, jnp.float32), jnp.full((5,), t))
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    tied = jnp.asarray([[2.0, 2.0, -30.0]])            # two maxima: q = 1/2, logit 0
    assert abs(float(ak.draft_feature(tied)[0])) < 1e-6
    assert float(ak.draft_feature(jnp.asarray([[0.0, -1e4]]))[0]) == ak.MAX_FEATURE


# -- the estimator --------------------------------------------------------------------------

def _simulate(st, omega, beta, steps, b, rng, step_fn):
    """Draft features ~ N(0, 2); each position accepted with sigmoid(omega f + beta_j),
    the chain stopping at the first rejection; every draft verified."""
    k = len(beta)
    for _ in range(steps):
        f = rng.normal(0, 2, (b, k)).astype(np.float32)
        acc = rng.random((b, k)) < 1 / (1 + np.exp(-(omega * f + beta)))
        n_acc = np.cumprod(acc, 1).sum(1)
        st = step_fn(st, jnp.asarray(f), jnp.asarray(n_acc), jnp.full((b,), k))
    return st


@jax.jit
def _step(st, f, n_acc, n_ver):
    return ak.estimator_refit(ak.estimator_observe(st, f, n_acc, n_ver))


def test_refits_recover_slope_and_intercepts():
    rng = np.random.default_rng(1)
    omega, beta = 1.3, np.array([1.0, 0.2, -0.6], np.float32)
    st = _simulate(ak.estimator_init(3), omega, beta, 30 * ak.REFIT_INTERVAL, 64, rng, _step)
    assert int(st.refits) == 30 and int(st.steps) == 0
    assert abs(float(st.omega) - omega) < 0.1
    np.testing.assert_allclose(st.beta, beta, atol=0.15)


def test_statistics_match_a_brute_force_irls_and_damping_scales_with_evidence():
    """One round's info / grad against a per-observation loop; the refit's step is the
    ridge Newton step times n / (n + 50)."""
    rng = np.random.default_rng(2)
    k, b = 3, 5
    st = ak.estimator_init(k)
    f = rng.normal(0, 2, (b, k)).astype(np.float32)
    n_acc = np.array([0, 1, 3, 2, 1])
    n_ver = np.array([3, 3, 3, 0, 1])              # row 3 padded; row 4 verified one draft
    got = ak.estimator_observe(st, jnp.asarray(f), jnp.asarray(n_acc), jnp.asarray(n_ver))
    info, grad, n = np.zeros((k + 1, k + 1)), np.zeros(k + 1), 0
    for r, j in itertools.product(range(b), range(k)):
        if j <= n_acc[r] and j < n_ver[r]:
            x = np.zeros(k + 1)
            x[0], x[1 + j] = f[r, j], 1
            p = 1 / (1 + np.exp(-(ak.OMEGA0 * f[r, j] + ak.BETA0)))
            info += p * (1 - p) * np.outer(x, x)
            grad += ((j < n_acc[r]) - p) * x
            n += 1
    np.testing.assert_allclose(got.info, info, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got.grad, grad, rtol=1e-5, atol=1e-6)
    assert float(got.count) == n == 1 + 2 + 3 + 0 + 1
    due = got._replace(steps=jnp.asarray(ak.REFIT_INTERVAL))
    new = ak.estimator_refit(due)
    delta = np.linalg.solve(info + ak.RIDGE * np.eye(k + 1), grad) * n / (n + ak.DAMPING)
    np.testing.assert_allclose(new.beta - st.beta, delta[1:], rtol=1e-4, atol=1e-6)
    assert float(new.omega) == pytest.approx(max(ak.OMEGA0 + delta[0], 0), abs=1e-5)
    assert float(new.count) == 0 and not np.any(np.asarray(new.info))
    assert ak.estimator_refit(got) is not None and int(ak.estimator_refit(got).refits) == 0


# -- the budget and admission ---------------------------------------------------------------

def _brute_budget(surv, nd, n0, dcost, vcost, non_draft, cap):
    slots = sorted((surv[r, j] for r in range(len(nd)) for j in range(nd[r])), reverse=True)
    best, arg = -1.0, 0
    for b in range(min(len(slots), cap) + 1):
        v = (n0 + sum(slots[:b])) / (dcost + vcost[min(non_draft + b, len(vcost) - 1)])
        if v > best + 1e-12:
            best, arg = v, b
    return arg


@pytest.mark.parametrize("seed", range(6))
def test_budget_and_admission_against_brute_force(seed):
    rng = np.random.default_rng(seed)
    bsz, k = 4, 5
    conf = rng.uniform(0.05, 0.99, (bsz, k)).astype(np.float32)
    surv = np.cumprod(conf, 1)
    nd = rng.integers(0, k + 1, bsz)
    # a verify cost rising in steps (a launch floor, then per-token), as a profiled table
    vcost = (1.0 + 0.02 * np.arange(64) + 0.3 * (np.arange(64) > 16)).astype(np.float32)
    cap = int(rng.integers(3, 30))
    b = int(ak.verification_budget(jnp.asarray(surv), jnp.asarray(nd), 4.0, 0.4,
                                   jnp.asarray(vcost), 4, cap))
    assert b == _brute_budget(surv, nd, 4.0, 0.4, vcost, 4, cap)
    kept = np.asarray(ak.admit(jnp.asarray(surv), jnp.asarray(nd), b))
    assert kept.sum() == b and np.all(kept <= nd)              # compaction keeps totals
    chosen = sorted(((surv[r, j], r, j) for r in range(bsz) for j in range(kept[r])))
    rest = [surv[r, j] for r in range(bsz) for j in range(kept[r], nd[r])]
    assert not chosen or not rest or chosen[0][0] >= max(rest)  # the top-b by survival


def test_budget_stops_where_drafts_stop_paying_and_zero_budget():
    surv = jnp.asarray([[0.9, 0.1, 0.01]])
    cost = 1 + 0.1 * jnp.arange(8, dtype=jnp.float32)        # each verified token costs 10%
    assert int(ak.verification_budget(surv, jnp.asarray([3]), 1.0, 0.0, cost, 1, 10)) == 1
    cheap = 1 + 0.001 * jnp.arange(8, dtype=jnp.float32)
    assert int(ak.verification_budget(surv, jnp.asarray([3]), 1.0, 0.0, cheap, 1, 10)) == 3
    assert int(ak.verification_budget(surv, jnp.asarray([3]), 1.0, 0.0, cost, 1, 0)) == 0
    assert np.asarray(ak.admit(surv, jnp.asarray([3]), 0)).tolist() == [0]
    ties = jnp.asarray([[0.5, 0.25], [0.5, 0.25]])
    assert np.asarray(ak.admit(ties, jnp.asarray([2, 2]), 1)).tolist() == [1, 0]


@pytest.mark.parametrize("seed", range(6))
def test_rectangle_budget_against_every_admission(seed):
    """Every admission of per-request prefixes: gain ``n0 + sum of admitted survivals``,
    cost ``cost[widest prefix]``; the rule's K* (each keeps ``min(K*, drafts)``) attains
    the best ratio."""
    rng = np.random.default_rng(seed)
    b, k = 3, 3
    surv = np.cumprod(rng.uniform(0.05, 1.0, (b, k)), axis=1)
    nd = rng.integers(0, k + 1, b)
    cost = np.cumsum(np.r_[1.0, rng.uniform(0.02, 0.6, k)])
    best = 0.0
    for pre in itertools.product(*[range(n + 1) for n in nd]):
        gain = 2 + sum(surv[r, :p].sum() for r, p in enumerate(pre))
        best = max(best, gain / cost[max(pre)])
    kk = ak.rectangle_budget(surv, nd, 2, cost)
    keep = np.minimum(kk, nd)
    got = (2 + sum(surv[r, :p].sum() for r, p in enumerate(keep))) / cost[kk]
    assert got == pytest.approx(best)

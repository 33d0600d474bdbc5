"""Rejection sampler against a NumPy oracle (greedy) and the target distribution (random)."""

import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from specjax.metadata import SpecDecodeMetadata
from specjax.sampling import (
    SamplingMetadata,
    apply_top_k_top_p,
    parse_output,
    rejection_sample,
    unconditional_to_conditional_rates,
)


def greedy_oracle(drafts, logits_per_req, bonus):
    """vLLM's greedy rule, request by request."""
    out = []
    for d, lg, bt in zip(drafts, logits_per_req, bonus):
        row = []
        for j, tok in enumerate(d):
            am = int(np.argmax(lg[j]))
            row.append(am)
            if am != tok:
                break
        else:
            row.append(bt)
        out.append(row)
    return out


def _batch(rng, n_reqs, vocab, kmax, agree=0.6):
    drafts, per_req, rows, bonus_rows = [], [], [], []
    for _ in range(n_reqs):
        n = int(rng.integers(0, kmax + 1))
        lg = rng.normal(size=(n + 1, vocab)).astype(np.float32)
        am = lg.argmax(-1)
        d = [int(am[j]) if rng.random() < agree else int(rng.integers(0, vocab)) for j in range(n)]
        drafts.append(d)
        per_req.append(lg[:n])
        rows.append(lg[:n])
        bonus_rows.append(lg[n])
    return drafts, per_req, rows, bonus_rows


def _logits(meta, rows, bonus_rows, vocab, n_pad, b_pad):
    """Place the rows where metadata.target/bonus_logits_indices say they are."""
    logits = np.full((n_pad + b_pad, vocab), -50.0, np.float32)
    tgt = np.asarray(meta.target_logits_indices)
    bon = np.asarray(meta.bonus_logits_indices)
    flat = [r for req in rows for r in req]
    for i, r in enumerate(flat):
        logits[tgt[i]] = r
    for i, r in enumerate(bonus_rows):
        logits[bon[i]] = r
    return jnp.asarray(logits)


@pytest.mark.smoke
@pytest.mark.parametrize("seed", range(5))
def test_greedy_matches_oracle_with_padding(seed):
    rng = np.random.default_rng(seed)
    vocab, kmax = 7, 5
    n = int(rng.integers(1, 12))
    drafts, per_req, rows, bonus_rows = _batch(rng, n, vocab, kmax)
    b_pad, n_pad = 16, 64
    meta = SpecDecodeMetadata.from_draft_lists(drafts, num_reqs_pad=b_pad, num_drafts_pad=n_pad,
                                               max_spec_len=kmax)
    logits = _logits(meta, rows, bonus_rows, vocab, n_pad, b_pad)
    sm = SamplingMetadata.create(np.zeros(b_pad))
    out = np.asarray(rejection_sample(meta, None, logits, sm))
    assert out.shape == (b_pad, kmax + 1) and out.dtype == np.int32
    want = greedy_oracle(drafts, per_req, [int(np.argmax(b)) for b in bonus_rows])
    for r in range(b_pad):
        exp = want[r] if r < n else []
        np.testing.assert_array_equal(out[r], exp + [-1] * (kmax + 1 - len(exp)))


@pytest.mark.smoke
def test_all_accepted_gets_bonus_and_first_mismatch_recovers():
    vocab = 5
    lg = np.full((3, vocab), 0.0, np.float32)
    lg[0, 2] = lg[1, 4] = lg[2, 1] = 5.0                    # argmax 2, 4, then bonus 1
    meta = SpecDecodeMetadata.from_draft_lists([[2, 4], [2, 3]])
    logits = jnp.asarray(np.concatenate([lg, lg]))          # both requests see the same rows
    out = rejection_sample(meta, None, logits, SamplingMetadata.create(np.zeros(2)))
    np.testing.assert_array_equal(out, [[2, 4, 1], [2, 4, -1]])
    assert parse_output(out, vocab) == [[2, 4, 1], [2, 4]]
    assert parse_output(out, vocab, discard_req_indices=[0]) == [[], [2, 4]]


def _chi2_pvalue(samples, probs):
    counts = np.bincount(samples, minlength=len(probs))
    return stats.chisquare(counts, probs * len(samples)).pvalue


P_T = np.array([0.4, 0.25, 0.15, 0.12, 0.08])
P_D_DISAGREE = np.array([0.05, 0.1, 0.15, 0.3, 0.4])


@pytest.mark.smoke
@pytest.mark.parametrize("case", ["agree", "disagree", "no_probs"])
def test_random_rows_emit_the_target_distribution(case):
    """First emitted token ~ p_target whatever the draft distribution (chi-square, alpha=1e-3)."""
    rng = np.random.default_rng(1)
    b, vocab = 20000, len(P_T)
    p_d = {"agree": P_T, "disagree": P_D_DISAGREE, "no_probs": P_D_DISAGREE}[case]
    drafts = rng.choice(vocab, size=b, p=p_d)
    meta = SpecDecodeMetadata.from_draft_lists([[int(d)] for d in drafts])
    # logits rows: [draft_0, bonus_0, draft_1, bonus_1, ...]
    logits = jnp.asarray(np.tile(np.log(P_T).astype(np.float32), (2 * b, 1)))
    draft_probs = None if case == "no_probs" else jnp.asarray(np.tile(p_d.astype(np.float32), (b, 1)))
    sm = SamplingMetadata.create(np.ones(b), seeds=np.arange(b) + 1000)
    out = np.asarray(rejection_sample(meta, draft_probs, logits, sm))
    first = out[:, 0]
    assert (first >= 0).all()
    assert _chi2_pvalue(first, P_T) > 1e-3
    # power check: the same test rejects the draft distribution when it differs
    if case != "agree":
        assert _chi2_pvalue(drafts, P_T) < 1e-6
    # acceptance rate = sum min(p_t, p_d) for probability drafts, p_t(x) for certain drafts
    acc = (out[:, 1] >= 0).mean()
    want = np.minimum(P_T, p_d).sum() if case != "no_probs" else (P_T * p_d).sum()
    assert abs(acc - want) < 0.02


@pytest.mark.smoke
def test_seeded_request_reproducible_across_batches():
    rng = np.random.default_rng(3)
    vocab = 11
    lg = rng.normal(size=(4, vocab)).astype(np.float32)
    drafts_a = [[1, 2, 3]]
    meta_a = SpecDecodeMetadata.from_draft_lists(drafts_a, num_reqs_pad=4, num_drafts_pad=12, max_spec_len=3)
    sm_a = SamplingMetadata.create(np.array([0.9, 0, 0, 0]), seeds=[77, 0, 0, 0])
    la = np.zeros((16, vocab), np.float32)
    la[np.asarray(meta_a.logits_indices)[:4]] = lg
    out_a = np.asarray(rejection_sample(meta_a, None, jnp.asarray(la), sm_a))
    # same request second in a different batch, with a greedy neighbour
    drafts_b = [[5], [1, 2, 3], [4, 4]]
    meta_b = SpecDecodeMetadata.from_draft_lists(drafts_b, num_reqs_pad=4, num_drafts_pad=12, max_spec_len=3)
    sm_b = SamplingMetadata.create(np.array([0.0, 0.9, 1.3, 0]), seeds=[5, 77, 9, 0])
    lb = rng.normal(size=(16, vocab)).astype(np.float32)
    li = np.asarray(meta_b.logits_indices)
    lb[li[2:6]] = lg
    out_b = np.asarray(rejection_sample(meta_b, None, jnp.asarray(lb), sm_b))
    np.testing.assert_array_equal(out_a[0], out_b[1])


@pytest.mark.smoke
def test_top_k_top_p_against_numpy():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(6, 9)).astype(np.float32)
    top_k = np.array([0, 1, 3, 9, 20, 2], np.int32)
    top_p = np.array([1.0, 1.0, 0.5, 0.3, 0.9, 1.0], np.float32)
    got = np.asarray(apply_top_k_top_p(jnp.asarray(logits), jnp.asarray(top_k), jnp.asarray(top_p)))
    for r in range(6):
        x = logits[r].astype(np.float64)
        order = np.argsort(-x)
        keep = np.ones(9, bool)
        k = top_k[r]
        if 0 < k < 9:
            keep[order[k:]] = False
        if top_p[r] < 1:
            p = np.exp(x - x.max()) * keep
            p /= p.sum()
            mass = 0.0
            kept_p = np.zeros(9, bool)
            for i in order:
                if not keep[i]:
                    continue
                if mass < top_p[r] or not kept_p.any():
                    kept_p[i] = True
                mass += p[i]
            keep &= kept_p
        np.testing.assert_array_equal(np.isfinite(got[r]), keep, err_msg=f"row {r}")


def test_greedy_bonus_with_top_k_one_is_argmax_and_temperature_validation():
    rng = np.random.default_rng(0)
    lg = rng.normal(size=(2 * 8, 13)).astype(np.float32)
    meta = SpecDecodeMetadata.from_draft_lists([[0]] * 8)
    sm = SamplingMetadata.create(np.full(8, 0.7), top_k=np.ones(8, np.int32), seeds=np.arange(8))
    out = np.asarray(rejection_sample(meta, None, jnp.asarray(lg), sm))
    # top_k=1: target is a point mass at its argmax: accept iff draft 0 is the argmax, then argmax
    am = lg.argmax(-1)
    for r in range(8):
        if am[2 * r] == 0:
            np.testing.assert_array_equal(out[r], [0, am[2 * r + 1]])
        else:
            np.testing.assert_array_equal(out[r], [am[2 * r], -1])
    with pytest.raises(ValueError, match="temperature"):
        SamplingMetadata.create(np.array([-1.0]))
    with pytest.raises(ValueError, match="top_p"):
        SamplingMetadata.create(np.array([1.0]), top_p=np.array([0.0]))
    with pytest.raises(ValueError, match="top_k"):
        SamplingMetadata.create(np.array([1.0]), top_k=np.array([-2]))


def test_synthetic_mode_acceptance_rates():
    b, k, vocab = 20000, 3, 4
    uncond = [0.8, 0.5, 0.2]
    cond = unconditional_to_conditional_rates(uncond)
    assert cond == pytest.approx([0.8, 0.625, 0.4])
    assert unconditional_to_conditional_rates([0.5, 0.0, 0.0]) == [0.5, 0.0, 0.0]
    meta = SpecDecodeMetadata.from_draft_lists([[1, 1, 1]] * b)
    logits = jnp.zeros((b * (k + 1), vocab), jnp.float32).at[:, 0].set(1.0)   # argmax 0 != draft
    sm = SamplingMetadata.create(np.zeros(b), seeds=np.arange(b))
    out = np.asarray(rejection_sample(meta, None, logits, sm, jnp.asarray(cond, jnp.float32)))
    for j, want in enumerate(uncond):
        assert abs((out[:, j] == 1).mean() - want) < 0.015
    # a rejected synthetic position emits the target argmax
    first_rej = (out == 1).sum(1)
    rows = first_rej < k
    assert (out[rows, first_rej[rows]] == 0).all()
    # one rate row per batch row (benchmarks' mixed cells): even rows 0.9, odd rows 0.3
    per_row = jnp.asarray([[0.9] * k, [0.3] * k] * (b // 2), jnp.float32)
    out = np.asarray(rejection_sample(meta, None, logits, sm, per_row))
    for r0, a in ((0, 0.9), (1, 0.3)):
        assert abs((out[r0::2, 0] == 1).mean() - a) < 0.015
        assert abs((out[r0::2, 1] == 1).mean() - a * a) < 0.015

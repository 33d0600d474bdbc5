"""Logits processors (``specjax.sampling.logits_processors``, ``specjax.sampling.process_logits``)
against a NumPy oracle written from vLLM v0.20's sampler semantics, vLLM's own
rejection-sampler cases for penalties / bad words / allowed ids restated, and chi-square
tests of random verification with processors on (agreeing and disagreeing drafts)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from specjax.sampling.logits_processors import (ProcessorLimits, RequestProcessing, make_processor_state)
from specjax.metadata import SpecDecodeMetadata
from specjax.sampling import SamplingMetadata, process_logits, rejection_sample
from specjax.sampling.metadata import _pre

NEG = -np.inf


# --- the oracle (vLLM v0.20 semantics, one request and position at a time) -------------


def oracle_processors(logits, prompt, output, rp: RequestProcessing):
    """vLLM ``Sampler.apply_logits_processors`` for one row: ``output`` is the request's
    output tokens followed by the drafts before this position."""
    x = np.array(logits, np.float64)
    v = x.shape[0]
    if rp.allowed_token_ids is not None:                      # allowed_token_ids_mask
        keep = np.zeros(v, bool)
        keep[list(rp.allowed_token_ids)] = True
        x[~keep] = NEG
    for w in rp.bad_words:                                     # _apply_bad_words_single_batch
        if len(w) > len(output) + 1:
            continue
        pl = len(w) - 1
        actual = list(output[len(output) - pl:]) if pl > 0 else []
        if actual == list(w[:pl]):
            x[w[-1]] = NEG
    if len(output) < rp.min_tokens:                            # MinTokensLogitsProcessor
        for s in rp.stop_ids:
            x[s] = NEG
    for t, b in (rp.logit_bias or {}).items():                 # LogitBiasLogitsProcessor
        x[t] += b
    counts = np.bincount(np.asarray(output, np.int64), minlength=v).astype(np.float64)
    seen = np.zeros(v, bool)                                    # apply_penalties
    seen[list(prompt)] = True
    seen |= counts > 0
    r = np.where(seen, rp.repetition_penalty, 1.0)
    x = np.where(x > 0, x / r, x * r)
    x = x - rp.frequency_penalty * counts
    return x - rp.presence_penalty * (counts > 0)


def oracle_finish(x, temperature, top_k, top_p, min_p):
    """Temperature (0 -> 1), min_p (vLLM MinP), top-k (ties kept), top-p (smallest prefix
    of the sorted distribution reaching p)."""
    x = np.array(x, np.float64) / (temperature if temperature > 0 else 1.0)
    with np.errstate(invalid="ignore"):
        p = np.exp(x - x.max())
        p /= p.sum()
    if min_p > 0:
        x = np.where(p < min_p * p.max(), NEG, x)
    v = len(x)
    if 0 < top_k < v:
        kth = np.sort(x)[::-1][top_k - 1]
        x = np.where(x < kth, NEG, x)
    if top_p < 1:
        srt = np.sort(x)[::-1]
        p = np.exp(srt - srt[0])
        p /= p.sum()
        before = np.cumsum(p) - p
        n = int(((before < top_p) | (np.arange(v) == 0)).sum())
        x = np.where(x < srt[n - 1], NEG, x)
    return x


def _random_request(rng, v, prompt, output):
    def maybe(p, f):
        return f() if rng.random() < p else None
    bias = maybe(0.5, lambda: {int(t): float(rng.normal() * 3) for t in rng.choice(v, 3, replace=False)})
    words = []
    if rng.random() < 0.7:      # bad words that sometimes match the output tail
        for _ in range(int(rng.integers(1, 4))):
            n = int(rng.integers(1, 4))
            tail = list(output[-(n - 1):]) if n > 1 and len(output) >= n - 1 and rng.random() < 0.6 \
                else [int(t) for t in rng.integers(0, v, n - 1)]
            words.append(tuple(tail + [int(rng.integers(0, v))]))
    allowed = maybe(0.3, lambda: tuple(int(t) for t in rng.choice(v, int(rng.integers(3, v)), replace=False)))
    stops = tuple(int(t) for t in rng.choice(v, 2, replace=False))
    return RequestProcessing(
        presence_penalty=float(rng.uniform(-2, 2)) if rng.random() < 0.6 else 0.0,
        frequency_penalty=float(rng.uniform(-2, 2)) if rng.random() < 0.6 else 0.0,
        repetition_penalty=float(rng.uniform(0.5, 2)) if rng.random() < 0.6 else 1.0,
        min_p=float(rng.uniform(0, 0.3)) if rng.random() < 0.5 else 0.0,
        logit_bias=bias, bad_words=tuple(words), allowed_token_ids=allowed,
        min_tokens=int(rng.integers(0, len(output) + 4)), stop_ids=stops)


LIM = ProcessorLimits(max_logit_bias=4, max_bad_words=4, max_bad_word_len=4,
                      max_allowed_token_ids=32, max_stop_ids=3, num_processor_params=2)


def _case(seed, b=5, v=23, k=4, max_len=24):
    rng = np.random.default_rng(seed)
    reqs, hist, npr, drafts, temps, tks, tps = [], [], [], [], [], [], []
    for _ in range(b):
        n_p = int(rng.integers(1, 6))
        n_o = int(rng.integers(0, 8))
        h = [int(t) for t in rng.integers(0, v // 2, n_p + n_o)]   # repeats: penalties bite
        hist.append(h)
        npr.append(n_p)
        reqs.append(_random_request(rng, v, h[:n_p], h[n_p:]))
        drafts.append([int(t) for t in rng.integers(0, v // 2, k)])
        temps.append(float(rng.choice([0.0, 0.7, 1.3])))
        tks.append(int(rng.choice([0, 3, 8])))
        tps.append(float(rng.choice([1.0, 0.8])))
    st = make_processor_state(reqs, hist, npr, num_reqs_pad=b + 2, max_len=max_len, limits=LIM)
    logits = rng.normal(size=(b + 2, k + 1, v)).astype(np.float32) * 3
    dr = np.zeros((b + 2, k), np.int32)
    dr[:b] = drafts
    pad = lambda a, f: np.concatenate([np.asarray(a), np.full(2, f, np.asarray(a).dtype)])  # noqa: E731
    sm = SamplingMetadata(jnp.asarray(pad(np.float32(temps), 0)), jnp.asarray(pad(np.int32(tks), 0)),
                          jnp.asarray(pad(np.float32(tps), 1)), jnp.zeros((b + 2, 2), jnp.uint32),
                          jax.tree.map(jnp.asarray, st))
    return reqs, hist, npr, drafts, temps, tks, tps, logits, dr, sm


def _check_rows(got, want):
    assert np.array_equal(np.isneginf(got), np.isneginf(want))
    fin = ~np.isneginf(want)
    np.testing.assert_allclose(got[fin], want[fin], rtol=2e-5, atol=2e-4)


@pytest.mark.smoke
@pytest.mark.parametrize("seed", range(6))
def test_processors_match_numpy_oracle_at_every_draft_position(seed):
    """Random requests (all features mixed in one batch): position j of the chain sees the
    request's output plus its first j drafts; processors, then the full pipeline."""
    reqs, hist, npr, drafts, temps, tks, tps, logits, dr, sm = _case(seed)
    b, t, v = logits.shape
    k = t - 1
    tok = jnp.broadcast_to(jnp.asarray(dr)[:, None, :], (b, t, k))
    plen = jnp.broadcast_to(jnp.arange(t)[None, :], (b, t))
    pre = np.asarray(_pre(jnp.asarray(logits), sm, tok, plen))
    full = np.asarray(process_logits(jnp.asarray(logits), sm, tok, plen))
    for i, rp in enumerate(reqs):
        prompt, out = hist[i][: npr[i]], hist[i][npr[i]:]
        for j in range(t):
            want = oracle_processors(logits[i, j], prompt, out + drafts[i][:j], rp)
            _check_rows(pre[i, j], want)
            _check_rows(full[i, j], oracle_finish(want, temps[i], tks[i], tps[i], rp.min_p))
    # padding rows: nothing processed but temperature / top-k / top-p defaults
    _check_rows(pre[b - 1], logits[b - 1])


@pytest.mark.smoke
def test_process_logits_two_dim_and_without_procs_is_the_plain_pipeline():
    rng = np.random.default_rng(3)
    lg = jnp.asarray(rng.normal(size=(3, 11)).astype(np.float32))
    sm = SamplingMetadata.create([0.0, 0.5, 2.0], top_k=[0, 4, 0], top_p=[1.0, 1.0, 0.7])
    got = np.asarray(process_logits(lg, sm))
    for i, (t, k, p) in enumerate([(0.0, 0, 1.0), (0.5, 4, 1.0), (2.0, 0, 0.7)]):
        _check_rows(got[i], oracle_finish(np.asarray(lg[i]), t, k, p, 0.0))


# --- vLLM v0.20's rejection-sampler cases (tests/v1/sample/test_rejection_sampler.py) ---


def _vllm_logits(output_tokens, vocab=100, override=None):
    """vLLM's ``create_logits_tensor``, with the bonus row kept (specjax samples the bonus
    token from it instead of mocking the sampler): 100 at each row's token, -100 elsewhere,
    99 at ``override``."""
    rows = [t for toks in output_tokens for t in toks]
    lg = np.full((len(rows), vocab), -100.0, np.float32)
    lg[np.arange(len(rows)), rows] = 100.0
    if override:
        lg[:, override] = 99.0
    return jnp.asarray(lg)


def _vllm_run(spec_tokens, output_tokens, reqs, prompts, outputs, override=15, limits=LIM):
    n = len(spec_tokens)
    meta = SpecDecodeMetadata.from_draft_lists(spec_tokens)
    st = make_processor_state(reqs, [list(p) + list(o) for p, o in zip(prompts, outputs)],
                              [len(p) for p in prompts], num_reqs_pad=n, max_len=16, limits=limits)
    sm = SamplingMetadata.create(np.zeros(n))
    sm = SamplingMetadata(sm.temperature, sm.top_k, sm.top_p, sm.keys,
                          jax.tree.map(jnp.asarray, st), all_greedy=True)
    return np.asarray(rejection_sample(meta, None, _vllm_logits(output_tokens, override=override), sm))


@pytest.mark.smoke
def test_vllm_frequency_penalties():
    spec = [[1, 1, 1], [], [1, 1, 1]]
    out_tokens = [[1, 1, 1, 1], [7], [1, 1, 1, 1]]
    reqs = [RequestProcessing(frequency_penalty=f) for f in (1.5, 1.5, 0.7)]
    got = _vllm_run(spec, out_tokens, reqs, [[5, 6, 7], [6, 7, 8], [7, 8, 9]], [[2], [3], [4]])
    np.testing.assert_array_equal(got, [[1, 15, -1, -1], [7, -1, -1, -1], [1, 1, 15, -1]])


@pytest.mark.smoke
def test_vllm_bad_words():
    spec = [[1, 2, 3], [1, 15, 3], [1, 2, 3]]
    out_tokens = [[1, 2, 3, 4]] * 3
    reqs = [RequestProcessing(bad_words=((2,),)), RequestProcessing(bad_words=((2,),)),
            RequestProcessing()]
    got = _vllm_run(spec, out_tokens, reqs, [[0]] * 3, [[2], [3], [4]])
    np.testing.assert_array_equal(got, [[1, 15, -1, -1], [1, 15, 3, 4], [1, 2, 3, 4]])


@pytest.mark.smoke
def test_vllm_bad_words_multi_token_with_drafts():
    """A two-token bad word completed by a draft: ``(2, 3)`` bans 3 right after 2, whether
    the 2 is an output token or the preceding draft; the prompt never completes one."""
    spec = [[2, 3, 3], [3, 3, 3], [3, 3, 3]]
    out_tokens = [[2, 3, 3, 4], [3, 3, 3, 4], [3, 3, 3, 4]]
    reqs = [RequestProcessing(bad_words=((2, 3),))] * 3
    got = _vllm_run(spec, out_tokens, reqs, [[1], [1], [2]], [[5], [2], []])
    np.testing.assert_array_equal(got, [[2, 15, -1, -1], [15, -1, -1, -1], [3, 3, 3, 4]])


@pytest.mark.smoke
def test_vllm_allowed_token_ids():
    """vLLM's case: rows 0 and 2 disallow tokens 0-4 and 2-6 (``create_allowed_token_ids``),
    row 1 has no mask. vLLM mocks the bonus sampler (row 2's bonus 5 is returned as is);
    specjax samples it through the same processors, so the disallowed 5 becomes 15 (the
    override), as vLLM's real sampler would give."""
    spec = [[1, 2, 10], [10, 5, 3], [7, 10, 12]]
    out_tokens = [[1, 2, 10, 5], [10, 5, 10, 5], [7, 10, 12, 5]]
    allow = lambda lo: tuple(t for t in range(100) if not lo <= t < lo + 5)  # noqa: E731
    reqs = [RequestProcessing(allowed_token_ids=allow(0)), RequestProcessing(),
            RequestProcessing(allowed_token_ids=allow(2))]
    got = _vllm_run(spec, out_tokens, reqs, [[0]] * 3, [[], [], []],
                    limits=LIM._replace(max_allowed_token_ids=100))
    np.testing.assert_array_equal(got, [[15, -1, -1, -1], [10, 5, 10, -1], [7, 10, 12, 15]])


@pytest.mark.smoke
def test_vllm_min_tokens_masks_stop_tokens_at_draft_positions():
    """vLLM's ``test_min_tokens_masks_stop_tokens``: with min_tokens=2 and no output yet,
    the stop token 9 is masked at both draft positions; row 1's argmax falls to 5."""
    lg = np.asarray(_vllm_logits([[1, 9, 0]], override=None)).copy()
    lg[1, 5] = 50.0
    meta = SpecDecodeMetadata.from_draft_lists([[1, 2]])
    st = make_processor_state([RequestProcessing(min_tokens=2, stop_ids=(9,))], [[3]], [1],
                              num_reqs_pad=1, max_len=8, limits=LIM)
    sm = SamplingMetadata(jnp.zeros(1), jnp.zeros(1, jnp.int32), jnp.ones(1),
                          jnp.zeros((1, 2), jnp.uint32), jax.tree.map(jnp.asarray, st), all_greedy=True)
    np.testing.assert_array_equal(rejection_sample(meta, None, jnp.asarray(lg), sm), [[1, 5, -1]])


# --- random verification with processors: chi-square -----------------------------------


def _chi2(samples, probs):
    counts = np.bincount(samples, minlength=len(probs)).astype(np.float64)
    big = probs * len(samples) >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(probs[big], probs[~big].sum()) * len(samples)
    keep = exp > 0
    return stats.chisquare(obs[keep], exp[keep] * obs[keep].sum() / exp[keep].sum()).pvalue


def _softmax(x):
    e = np.exp(x - x[np.isfinite(x)].max())
    return e / e.sum()


@pytest.mark.parametrize("case", ["agree", "disagree"])
def test_random_verification_emits_the_processed_distribution(case):
    """20000 requests, one context, two drafts each: the first emitted token ~ the
    processed target at position 0; the second, given the first draft was accepted, ~ the
    processed target at position 1 (its context holds that draft: the penalties move).
    Power: the same test rejects the unprocessed distribution and position 0's."""
    rng = np.random.default_rng(5)
    b, v = 20000, 8
    base = np.array([2.0, 1.6, 1.2, 1.0, 0.6, 0.3, 0.0, -0.5], np.float32)
    rp = RequestProcessing(presence_penalty=0.8, frequency_penalty=0.4, repetition_penalty=1.5,
                           min_p=0.05, logit_bias={5: 1.5}, bad_words=((3, 2),),
                           min_tokens=0)
    prompt, out = [4, 4], [0, 3]                # bad word (3, 2): 2 banned at position 0 only
    temp = 0.9
    p0 = _softmax(oracle_finish(oracle_processors(base, prompt, out, rp), temp, 0, 1.0, rp.min_p))
    # the processed mode, or the least likely token kept above 5%
    d0 = int(np.argmax(p0)) if case == "agree" else int(np.where(p0 > 0.05, -p0, -2).argmax())
    p1 = _softmax(oracle_finish(oracle_processors(base, prompt, out + [d0], rp), temp, 0, 1.0,
                                rp.min_p))
    drafts = [[d0, int(rng.integers(0, v))] for _ in range(b)]
    meta = SpecDecodeMetadata.from_draft_lists(drafts)
    logits = jnp.asarray(np.tile(base, (3 * b, 1)))
    st = make_processor_state([rp] * b, [prompt + out] * b, [2] * b, num_reqs_pad=b, max_len=8,
                              limits=LIM)
    sm = SamplingMetadata.create(np.full(b, temp), seeds=np.arange(b) + 77)
    sm = SamplingMetadata(sm.temperature, sm.top_k, sm.top_p, sm.keys, jax.tree.map(jnp.asarray, st))
    res = np.asarray(rejection_sample(meta, None, logits, sm))
    assert np.abs(p0 - p1).max() > 0.05            # the draft changes position 1's target
    assert _chi2(res[:, 0], p0) > 1e-3
    acc = res[:, 0] == d0
    assert abs(acc.mean() - p0[d0]) < 0.02
    second = res[acc, 1]
    assert len(second) > 500
    assert _chi2(second, p1) > 1e-3
    # power
    raw = _softmax(base.astype(np.float64) / temp)
    assert _chi2(res[:, 0], raw) < 1e-6
    assert _chi2(second, p0) < 1e-6

"""Logprobs (``specjax.sampling.logprobs``): vLLM v0.20's ``RejectionSampler`` logprobs, four modes.

References, independent of the code under test:

* a NumPy oracle written from vLLM's semantics (``_get_logprobs_tensors``,
  ``Sampler.gather_logprobs``, ``apply_top_k_top_p`` in vLLM's own ascending-sort form,
  ``batched_count_greater_than``) on the verification's logits, for every mode and every
  kind of emitted token (accepted drafts, the recovered token, the bonus token);
* plain (non-speculative) decoding of the same target: greedy speculative decoding must give
  the same tokens, the same top-n ids (except at ties) and values within 1e-5 (fp32, CPU),
  ranks equal: vLLM's ``test_spec_decode_logprobs`` (tests/v1/sample/test_logprobs.py,
  n-gram and EAGLE-3 at k = 3, ``logprobs`` 0 and 3, every ``LogprobsMode``) restated
  (its ``presence_penalty`` request belongs with the penalties, not here);
* a dense forward of the emitted sequence (no paging, no speculation) for sampled runs;
* the per-step path for the device-resident loop.
"""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.attention_metadata import CommonAttentionMetadata
from specjax.runtime.batch import spec_metadata_np
from specjax.engine import Engine, SamplingParams, generate, step_cache_size
from specjax.sampling.logprobs import LOGPROBS_MODES, Logprob, chain_logprobs, logprobs_bucket
from specjax.sampling import SamplingMetadata, rejection_sample
from specjax.runtime.step import make_step

try:
    from test_engine import (FIXED, METHODS, MML, PARAMS_A, PARAMS_B, PROMPTS_A, PROMPTS_B, V,
                             _dense_forward, build, eos_b, fixed,  # noqa: F401
                             target)
except ImportError:  # tests/ made a package
    from tests.test_engine import (FIXED, METHODS, MML, PARAMS_A, PARAMS_B, PROMPTS_A,  # noqa: F401
                                   PROMPTS_B, V, _dense_forward, build, eos_b,
                                   fixed, target)

TOL = 1e-5


# --- the NumPy oracle (vLLM's semantics) -------------------------------------------------


def np_log_softmax(x):
    x = np.asarray(x, np.float64)
    m = np.max(x[np.isfinite(x)])
    z = np.log(np.sum(np.exp(np.where(np.isfinite(x), x - m, -np.inf))))
    return np.where(np.isfinite(x), x - m - z, -np.inf)


def np_processed(x, t, k, p):
    """vLLM: temperature (greedy: none, and SamplingParams resets top-k / top-p), then
    ``apply_top_k_top_p``: sort ascending, mask below the k-th largest, then mask the
    ascending prefix whose cumulative probability is <= 1 - p (the largest always kept)."""
    x = np.asarray(x, np.float64).copy()
    if t == 0:
        return x
    x = x / t
    v = x.shape[0]
    if 0 < k < v:
        srt = np.sort(x)
        x = np.where(x < srt[v - k], -np.inf, x)
    if p < 1:
        order = np.argsort(x, kind="stable")
        e = np.exp(x[order] - np.max(x))
        cum = np.cumsum(e / e.sum())
        mask = cum <= 1 - p
        mask[-1] = False
        x[order[mask]] = -np.inf
    return x


def np_values(raw, t, k, p, mode):
    x = np.asarray(raw, np.float64)
    if mode.startswith("processed"):
        x = np_processed(x, t, k, p)
    return np_log_softmax(x) if mode.endswith("logprobs") else x


def check_position(vals, tok, ids, got_vals, rank, n):
    """One emitted token against the oracle's values ``vals [V]`` (float64)."""
    assert ids[0] == tok
    assert abs(got_vals[0] - vals[tok]) <= TOL, (got_vals[0], vals[tok])
    assert rank == int(np.sum(vals >= vals[tok])), (rank, int(np.sum(vals >= vals[tok])))
    top = np.sort(vals)[::-1][:n]
    np.testing.assert_allclose(got_vals[1 : n + 1], top, atol=TOL)
    # ids equal except at ties: each listed id has the listed value, and they are distinct
    np.testing.assert_allclose(vals[np.asarray(ids[1 : n + 1])], top, atol=TOL)
    assert len(set(ids[1 : n + 1])) == n


@pytest.mark.parametrize("mode", LOGPROBS_MODES)
def test_chain_logprobs_match_numpy_oracle(mode):
    """Mixed greedy / random rows with top-k / top-p, chain drafts accepted, rejected and
    absent: every emitted token's value and rank and the top-n against the oracle, at the
    logits row vLLM reads it from; padding slots follow the convention."""
    rng = np.random.default_rng(0)
    B, K, n = 6, 3, 8
    temp = np.array([0.0, 0.0, 0.7, 1.3, 0.0, 1.0], np.float32)
    top_k = np.array([5, 0, 5, 0, 0, 0], np.int32)          # row 0: greedy, top-k ignored
    top_p = np.array([1.0, 0.5, 1.0, 0.8, 1.0, 1.0], np.float32)
    kinds = set()
    for trial in range(6):
        nreq = 5                                              # row 5 is padding
        nd = [3, 3, 3, 2, 0]
        logits = rng.normal(0, 2, (B * (K + 1), V)).astype(np.float32)
        start = np.cumsum([d + 1 for d in nd]) - np.array(nd) - 1
        drafts = []
        for r in range(nreq):
            am = [int(np.argmax(logits[start[r] + j])) for j in range(nd[r])]
            if r == 1 or (r >= 2 and trial % 2):
                am = am[:1] + [(a + 1) % V for a in am[1:]]   # rejected at position 1
            drafts.append(am)
        sdm = spec_metadata_np(drafts, [d + 1 for d in nd], num_reqs_pad=B, max_spec_len=K)
        sdm = jax.tree.map(jnp.asarray, sdm)
        sampling = SamplingMetadata.create(temp[:B], top_k, top_p, seeds=list(range(B)),
                                           step=trial)
        sampled = rejection_sample(sdm, None, jnp.asarray(logits), sampling)
        lp = jax.jit(functools.partial(chain_logprobs, num_logprobs=n, mode=mode))(
            sdm, jnp.asarray(logits), sampling, sampled)
        sampled, lp = np.asarray(sampled), jax.tree.map(np.asarray, lp)
        assert lp.logprob_token_ids.shape == (B, K + 1, n + 1)
        for r in range(B):
            emitted = [t for t in sampled[r] if t != -1]
            for j in range(K + 1):
                if j >= len(emitted):
                    assert (lp.logprob_token_ids[r, j] == -1).all()
                    assert np.isneginf(lp.logprobs[r, j]).all() and lp.selected_token_ranks[r, j] == -1
                    continue
                n_acc = len(emitted) - 1
                kinds.add("accepted" if j < n_acc else "bonus" if j == nd[r] else "recovered")
                vals = np_values(logits[start[r] + j], temp[r], top_k[r], top_p[r], mode)
                check_position(vals, emitted[j], lp.logprob_token_ids[r, j].tolist(),
                               lp.logprobs[r, j], int(lp.selected_token_ranks[r, j]), n)
    assert kinds == {"accepted", "recovered", "bonus"}


@pytest.mark.smoke
def test_oracle_can_fail():
    """Power check: the oracle notices the wrong row, the wrong mode and a wrong rank."""
    rng = np.random.default_rng(1)
    x = rng.normal(0, 2, V)
    y = rng.normal(0, 2, V)
    tok = int(np.argmax(x))
    vals = np_values(x, 0.0, 0, 1.0, "raw_logprobs")
    order = np.argsort(vals)[::-1]
    good = ([tok] + order[:3].tolist(), np.r_[vals[tok], vals[order[:3]]], 1)
    check_position(vals, tok, *good, 3)
    bad_row = np_values(y, 0.0, 0, 1.0, "raw_logprobs")
    bad_mode = np_values(x, 0.0, 0, 1.0, "raw_logits")
    for wrong in (bad_row, bad_mode):
        with pytest.raises(AssertionError):
            check_position(wrong, tok, *good, 3)
    with pytest.raises(AssertionError):
        check_position(vals, tok, good[0], good[1], 2, 3)


# --- validation ---------------------------------------------------------------------------


@pytest.mark.smoke
def test_bad_arguments_name_themselves():
    for bad, what in ((21, "logprobs"), (-1, "whole vocabulary"), (-2, "logprobs"),
                      (True, "logprobs"), ("3", "logprobs"), (2.0, "logprobs")):
        with pytest.raises(ValueError, match=what):
            SamplingParams(logprobs=bad)
    assert SamplingParams(logprobs=0).logprobs == 0 and SamplingParams().logprobs is None
    for call in (lambda: make_step(target().model, None, logprobs_mode="logprobs"),
                 lambda: Engine(target(), None, logprobs_mode="raw", max_num_seqs=4, **FIXED)):
        with pytest.raises(ValueError, match="logprobs_mode"):
            call()
    assert [logprobs_bucket(x) for x in ([None], [0], [None, 3], [5, 1], [17])] == [None, 0, 4, 8, 20]


# --- speculative == plain (greedy) --------------------------------------------------------

NS = (0, 3, None, 20)       # per request: mixed in one batch (None: off)


def _with_logprobs(params, ns=NS):
    return [dataclasses.replace(p, logprobs=n) for p, n in zip(params, ns * 4)]


@functools.lru_cache(maxsize=None)
def plain(mode: str, which: str = "A"):
    if which == "A":
        return generate(target(), None, PROMPTS_A, _with_logprobs(PARAMS_A), logprobs_mode=mode,
                        **fixed(steps_per_sync=1))
    return generate(target(), None, PROMPTS_B, _with_logprobs(PARAMS_B), logprobs_mode=mode,
                    max_num_seqs=3, eos_token_id=eos_b(), **fixed(steps_per_sync=1))


def assert_same_logprobs(got, want, ns):
    assert got.token_ids == want.token_ids
    for o, w, n in zip(got.outputs, want.outputs, ns):
        if n is None:
            assert o.logprobs is None and w.logprobs is None
            continue
        assert len(o.logprobs) == len(w.logprobs) == len(o.token_ids)
        for tok, a, b in zip(o.token_ids, o.logprobs, w.logprobs):
            assert tok in a and len(a) in (n, n + 1) and all(isinstance(x, Logprob) for x in a.values())
            assert set(a) == set(b), (a, b)          # top-n ids equal (no ties in these logits)
            for t in a:
                assert abs(a[t].logprob - b[t].logprob) <= TOL and a[t].rank == b[t].rank


# EAGLE-3's random head accepts little; the draft model (the target itself) accepts every
# draft, so every emitted token but the bonus is an accepted draft.
CASES = [(m, 3, mode) for m in ("ngram", "eagle3") for mode in LOGPROBS_MODES] + \
        [(m, k, mode) for m in ("ngram", "eagle3") for k in (1, 5)
         for mode in ("raw_logprobs", "processed_logits")] + \
        [("draft_model", 3, mode) for mode in ("raw_logprobs", "processed_logprobs")]


@pytest.mark.parametrize("method, k, mode", [c for c in CASES if c[0] in METHODS])
def test_greedy_speculative_logprobs_equal_plain(method, k, mode):
    prop = build(method, k)
    ns = (NS * 4)[: len(PARAMS_A)]
    out = generate(target(), prop, PROMPTS_A, _with_logprobs(PARAMS_A), logprobs_mode=mode,
                   **FIXED)
    s = out.spec_stats
    assert s.num_accepted_tokens > 0
    if method == "draft_model":
        assert s.num_accepted_tokens == s.num_draft_tokens > 0
    assert_same_logprobs(out, plain(mode), ns)


@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs"])
def test_greedy_logprobs_with_eos_and_joining_requests(mode):
    """Workload B (3 running at a time, an EOS stops some early): n-gram per step and
    EAGLE-3 in the device loop both equal plain decoding's logprobs."""
    ns = (NS * 4)[: len(PARAMS_B)]
    for prop in (build("ngram", 3), build("eagle3", 3)):
        out = generate(target(), prop, PROMPTS_B, _with_logprobs(PARAMS_B), logprobs_mode=mode,
                       max_num_seqs=3, eos_token_id=eos_b(), **FIXED)
        assert_same_logprobs(out, plain(mode, "B"), ns)


def test_plain_logprobs_match_dense_forward():
    """Plain decoding's logprobs themselves: the dense forward of each prefix."""
    base = plain("raw_logprobs")
    check_against_dense(base, PROMPTS_A, _with_logprobs(PARAMS_A), "raw_logprobs")


# --- sampled runs: against a dense forward ------------------------------------------------


def dense_logits(prompt, out_tokens):
    """Target logits ``[len(out), V]`` predicting each output token (one dense pass)."""
    tgt = target()
    fwd = _dense_forward(tgt.model)
    seq = list(prompt) + list(out_tokens)
    n = len(seq)
    md = CommonAttentionMetadata.from_query_lens([n], [n], [[0]], block_size=64,
                                                 num_tokens_pad=64, max_query_len=64)
    ids = np.zeros(64, np.int32)
    ids[:n] = seq
    h = fwd(tgt.params, jnp.asarray(ids), jnp.arange(64, dtype=jnp.int32),
            tgt.model.init_kv_caches(1, 64), md)
    p = len(prompt)
    return np.asarray(tgt.model.compute_logits(tgt.params, h[p - 1 : n - 1]))


def check_against_dense(result, prompts, params, mode):
    for prompt, sp, o in zip(prompts, params, result.outputs):
        if sp.logprobs is None:
            continue
        lg = dense_logits(prompt, o.token_ids)
        for j, tok in enumerate(o.token_ids):
            d = o.logprobs[j]
            vals = np_values(lg[j], sp.temperature, sp.top_k, sp.top_p, mode)
            assert abs(d[tok].logprob - vals[tok]) <= 1e-4
            assert d[tok].rank == int(np.sum(vals >= vals[tok]))
            top = np.sort(vals)[::-1][: sp.logprobs]
            got = sorted((v.logprob for t, v in d.items() if v.rank <= sp.logprobs
                          and (t != tok or len(d) == sp.logprobs)), reverse=True)
            np.testing.assert_allclose(got[: sp.logprobs], top, atol=1e-4)


@pytest.mark.parametrize("mode", ["processed_logprobs", "raw_logits"])
def test_sampled_speculative_logprobs_match_dense_forward(mode):
    """Random verification (temperature, top-k, top-p; accepted, recovered and bonus
    tokens): each emitted token's values are those of the dense forward of its prefix."""
    params = [SamplingParams(max_tokens=m, temperature=t, top_k=k, top_p=p, seed=s, logprobs=n)
              for m, t, k, p, s, n in ((12, 0.8, 10, 1.0, 1, 5), (5, 1.0, 0, 0.9, 2, 2),
                                       (20, 0.0, 0, 1.0, 3, 4), (30, 1.5, 4, 0.95, 4, 20))]
    out = generate(target(), build("ngram", 3), PROMPTS_A, params, logprobs_mode=mode, **FIXED)
    assert out.spec_stats.num_accepted_tokens > 0
    check_against_dense(out, PROMPTS_A, params, mode)


# --- the device loop ----------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("method", [m for m in ("eagle3", "ngram_gpu") if m in METHODS])
def test_device_loop_equals_per_step(method):
    """Seeded sampled and greedy requests, an EOS stop inside an iteration's block: the
    loop's logprobs are the per-step path's."""
    params = [dataclasses.replace(p, temperature=0.9 if i % 2 else 0.0, top_k=8, seed=i,
                                  logprobs=(3, None, 0, 5)[i % 4])
              for i, p in enumerate(PARAMS_B)]
    mode = "processed_logprobs"
    runs = [generate(target(), build(method, 3), PROMPTS_B, params, logprobs_mode=mode,
                     max_num_seqs=3, eos_token_id=eos_b(), **fixed(steps_per_sync=n))
            for n in (1, 4)]
    a, b = runs
    assert a.token_ids == b.token_ids
    for x, y in zip(a.outputs, b.outputs):
        assert (x.logprobs is None) == (y.logprobs is None)
        for dx, dy in zip(x.logprobs or [], y.logprobs or []):
            assert set(dx) == set(dy)
            for t in dx:
                assert abs(dx[t].logprob - dy[t].logprob) <= 1e-6 and dx[t].rank == dy[t].rank


# --- trees --------------------------------------------------------------------------------


def _tree_proposers():
    """The answer-knowing tree stub of ``test_engine_tree`` (accepts along one branch to a
    depth that varies per step) and the real EAGLE-3 tree proposer (random head)."""
    try:
        from test_engine_tree import stub
    except ImportError:  # tests/ made a package
        from tests.test_engine_tree import stub
    yield stub((2, 2, 1))
    if "eagle3" in METHODS:
        yield build("eagle3", 6,
                    speculative_token_tree="[(0,), (1,), (0, 0), (1, 0), (0, 0, 0), (1, 0, 0)]")


@pytest.mark.parametrize("n_sync", [1, 4])
def test_tree_verification_logprobs_equal_plain(n_sync):
    """Tree verification, per step and in the device loop: each emitted token's logprobs
    come from its parent's slot on the accepted path; greedy: plain decoding's."""
    for prop, mode in zip(_tree_proposers(), ("processed_logprobs", "raw_logprobs")):
        eng = Engine(target(), prop, max_num_seqs=4, logprobs_mode=mode,
                     **fixed(steps_per_sync=n_sync))
        assert eng.tree is not None and not eng.tree.is_chain
        out = eng.generate(PROMPTS_A, _with_logprobs(PARAMS_A))
        assert out.spec_stats.num_accepted_tokens > 0
        assert_same_logprobs(out, plain(mode), (NS * 4)[: len(PARAMS_A)])


@pytest.mark.skipif("eagle3" not in METHODS, reason="needs EAGLE-3")
def test_non_padded_drafter_batch_keeps_logprobs():
    """vLLM's non-padded mode (the drafts come from a second call after the host's
    prepare_inputs): the step's logprobs survive it."""
    prop = build("eagle3", 3, disable_padded_drafter_batch=True)
    assert prop.feed.drafts_in == "split"
    out = generate(target(), prop, PROMPTS_A, _with_logprobs(PARAMS_A), **FIXED)
    assert_same_logprobs(out, plain("raw_logprobs"), (NS * 4)[: len(PARAMS_A)])


def test_warmup_compiles_the_logprobs_buckets():
    """``Engine.warmup(num_logprobs=...)`` compiles the logprobs variants (per step and in
    the device loop): a mixed run afterwards compiles nothing."""
    from specjax.runtime.decode_loop import loop_cache_size

    eng = Engine(target(), build("eagle3", 3), max_num_seqs=4, **FIXED)
    with pytest.raises(ValueError, match="num_logprobs"):
        eng.warmup([4], [16], num_logprobs=(99,))
    # the batch's bucket follows its running requests' largest n: 4 (n = 3), then 2, 0, off
    eng.warmup([4], [16], all_greedy=(True,), num_logprobs=(None, 0, 2, 3))
    before = step_cache_size() + loop_cache_size()
    ns = (None, 3, 0, 2)
    out = eng.generate(PROMPTS_A, _with_logprobs(PARAMS_A, ns))
    assert step_cache_size() + loop_cache_size() == before
    assert out.token_ids == plain("raw_logprobs").token_ids
    for o, w, n in zip(out.outputs, plain("raw_logprobs").outputs, ns):
        if n is not None:      # plain asked each request for NS's n: compare the emitted entries
            assert all(len(d) in (n, n + 1) for d in o.logprobs)
            for tok, d, e in zip(o.token_ids, o.logprobs, w.logprobs or [{}] * len(o.token_ids)):
                if tok in e:
                    assert abs(d[tok].logprob - e[tok].logprob) <= TOL and d[tok].rank == e[tok].rank
    assert [o.logprobs is None for o in out.outputs] == [n is None for n in ns]


# --- off by default -----------------------------------------------------------------------


def test_off_compiles_the_same_step():
    """Without logprobs the step lowers to the same program as a step built before any
    logprobs argument existed (no logprobs op in it), and a logprobs batch adds one
    variant; the default Engine result has ``logprobs`` None."""
    from specjax.runtime.batch import build_batch

    step = make_step(target().model, None)
    kv, st = step.init_caches(8, 8)
    b = build_batch([[1, 2, 3]], num_computed=[0], num_drafts=[0], block_ids=[[1]], block_size=8,
                    num_reqs_pad=2, query_len_pad=4, blocks_per_req_pad=2, max_spec_len=0)
    off = step.lower(target().params, None, kv, st, b).as_text()
    on = step.lower(target().params, None, kv, st, dataclasses.replace(b, num_logprobs=2)).as_text()
    ops = lambda t: set(re.findall(r"(?:stablehlo|chlo)\.[a-z_]+", t))  # noqa: E731
    assert "chlo.top_k" in ops(on) and "chlo.top_k" not in ops(off)
    assert "stablehlo.log" in ops(on) - ops(off)        # the log_softmax
    with pytest.raises(ValueError, match="num_logprobs"):
        step(target().params, None, kv, st, dataclasses.replace(b, num_logprobs=40))
    out = generate(target(), None, PROMPTS_A[:1], PARAMS_A[:1], **FIXED)
    assert out.outputs[0].logprobs is None


@pytest.mark.parametrize("method", [m for m in ("ngram", "draft_model") if m in METHODS])
def test_processed_logprobs_with_logits_processors_equal_plain(method):
    """With penalties, logit_bias and min_tokens on (``specjax.sampling.logits_processors``), the
    processed modes read the distribution verification used: the step's emitted tokens
    before each slot count as output, so greedy speculative logprobs equal plain
    decoding's with the same parameters (the draft model accepts every draft: every slot
    but the bonus has accepted drafts before it)."""
    ns = (NS * 4)[: len(PARAMS_A)]
    feats = dict(presence_penalty=0.7, frequency_penalty=0.3, repetition_penalty=1.3,
                 logit_bias={3: 2.5, 7: -4.0}, min_tokens=2)
    params = [dataclasses.replace(p, **feats) for p in _with_logprobs(PARAMS_A)]
    for mode in ("processed_logprobs", "processed_logits"):
        want = generate(target(), None, PROMPTS_A, params, logprobs_mode=mode,
                        **fixed(steps_per_sync=1))
        out = generate(target(), build(method, 3), PROMPTS_A, params, logprobs_mode=mode, **FIXED)
        if method == "draft_model":     # n-gram's repeats are penalized away: it may accept none
            assert out.spec_stats.num_accepted_tokens > 0
        assert_same_logprobs(out, want, ns)
        # the processors changed what was emitted or its values: the test can tell
        base = generate(target(), None, PROMPTS_A, _with_logprobs(PARAMS_A), logprobs_mode=mode,
                        **fixed(steps_per_sync=1))
        assert base.token_ids != want.token_ids or any(
            a != b for o, w in zip(base.outputs, want.outputs) if o.logprobs
            for a, b in zip(o.logprobs, w.logprobs))


BF16_TOL = 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("method", [m for m in ("ngram", "draft_model") if m in METHODS])
def test_bf16_gpu_speculative_logprobs_close_to_plain(method):
    """On the GPU, bf16 weights and KV cache: speculative logprobs within 2e-2 absolute of
    plain decoding's (the 4-token verify and the 1-token step round differently in bf16),
    top-n ids equal except at ties (values within the tolerance of the n-th), over each
    request's tokens up to the first place the two runs' bf16 argmaxes part."""
    from specjax.engine import TargetModel

    tgt = target()
    cast = lambda x: x.astype(jnp.bfloat16) if jnp.issubdtype(x.dtype, jnp.floating) else x  # noqa: E731
    t16 = TargetModel(tgt.model, jax.tree.map(cast, tgt.params))
    params = _with_logprobs(PARAMS_A)
    ns = (NS * 4)[: len(PARAMS_A)]
    kw = dict(FIXED, kv_dtype=jnp.bfloat16, logprobs_mode="raw_logprobs")
    want = generate(t16, None, PROMPTS_A, params, **dict(kw, **fixed(steps_per_sync=1)))
    got = generate(t16, build(method, 3, t16), PROMPTS_A, params, **kw)
    assert got.spec_stats.num_accepted_tokens > 0
    compared = 0
    for o, w, n in zip(got.outputs, want.outputs, ns):
        if n is None:
            assert o.logprobs is None
            continue
        for tok_o, tok_w, a, b in zip(o.token_ids, w.token_ids, o.logprobs, w.logprobs):
            if tok_o != tok_w:
                break                       # bf16 parted the runs: later tokens differ
            assert abs(a[tok_o].logprob - b[tok_w].logprob) <= BF16_TOL
            nth = min(x.logprob for t, x in b.items() if t != tok_w or len(b) == 1)
            for t in set(a) ^ set(b):       # differing top-n ids: only at ties
                v = a[t].logprob if t in a else b[t].logprob
                assert abs(v - nth) <= BF16_TOL, (t, v, nth)
            for t in set(a) & set(b):
                assert abs(a[t].logprob - b[t].logprob) <= BF16_TOL
            compared += 1
    assert compared >= 10

"""k that adapts in the engine (issue 55): vLLM's ``num_speculative_tokens_per_batch_size``
and the per-request ``SamplingParams.num_speculative_tokens``, on the per-step path and the
device loop (with and without overlap). The draft model is the target, so every draft is
accepted and each step's draft count is exactly what the caps allow: greedy output equals
plain, every step verifies at most ``K(requests)`` drafts per request, zero recompiles
after warm-up while K changes, and seeded sampling keeps the target's distribution."""

import io
import sys

import numpy as np
import pytest

import suite_paths  # tests/support
from specjax.engine import Engine, SamplingParams, generate
from test_engine import (
    BS, _chi2_first_verified, build, fixed, target, SAMPLE_PROMPT, N_SAMPLES)

from specjax.engine import LoopOptions

sys.path.insert(0, str(suite_paths.BENCHMARKS))
import recompiles as bench  # noqa: E402

SCHED = ((1, 1, 3), (2, 2, 2), (3, 8, 0))      # K = 3 alone, 2 in pairs, none from 3 up
PROMPTS = [[5, 9, 2, 7], [11, 3, 3], [8, 1, 6, 2, 9], [4, 4]]
LENGTHS = (3, 7, 11, 19)                       # requests leave one by one


def _k(n: int) -> int:
    return next(k for lo, hi, k in SCHED if lo <= n <= hi)


def _run(prop, sps, n, overlap, logs=None):
    eng = Engine(target(), prop, max_num_seqs=4, **fixed(steps_per_sync=n, overlap=overlap))
    return eng.generate(PROMPTS, sps, stat_loggers=[] if logs is None else [logs.append])


@pytest.mark.parametrize("n,overlap", [(1, False), (4, False), (4, True)])
def test_batch_size_schedule_caps_every_step_and_keeps_greedy_output(n, overlap):
    sps = [SamplingParams(max_tokens=m) for m in LENGTHS]
    plain = _run(None, sps, n, overlap)
    logs: list = []
    out = _run(build("draft_model", 3, num_speculative_tokens_per_batch_size=SCHED), sps, n,
               overlap, logs)
    assert out.token_ids == plain.token_ids
    steps = [s for s in logs if s.num_drafts]
    # drafts proposed after a step of m >= num_drafts requests: K(m) <= K(num_drafts)
    assert steps and all(s.num_draft_tokens <= s.num_drafts * _k(s.num_drafts) for s in steps)
    assert any(s.num_draft_tokens == 3 for s in steps)     # the last request alone drafts 3
    full = _run(build("draft_model", 3), sps, n, overlap)
    assert out.spec_stats.num_draft_tokens < full.spec_stats.num_draft_tokens
    assert out.spec_stats.num_accepted_tokens == out.spec_stats.num_draft_tokens


@pytest.mark.parametrize("n", (1, 4))
def test_per_request_k(n):
    caps = (0, 1, None, 2)
    sps = [SamplingParams(max_tokens=12, num_speculative_tokens=c) for c in caps]
    plain = _run(None, [SamplingParams(max_tokens=12)] * 4, n, False)
    out = _run(build("draft_model", 3), sps, n, False)
    assert out.token_ids == plain.token_ids
    o = out.outputs
    assert o[0].num_draft_tokens == 0
    # every draft accepted: a step emits its drafts + 1, so drafts <= tokens * cap / (cap + 1)
    for r, cap in ((o[1], 1), (o[3], 2)):
        assert 0 < r.num_draft_tokens <= len(r.token_ids) * cap / (cap + 1)
    assert o[2].num_draft_tokens > o[3].num_draft_tokens > o[1].num_draft_tokens  # 3 > 2 > 1


def test_bad_values_refused_naming_the_field():
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SamplingParams(num_speculative_tokens=-1)
    with pytest.raises(ValueError, match=r"num_speculative_tokens=4: .* at most k=3"):
        _run(build("draft_model", 3), [SamplingParams(num_speculative_tokens=4)] * 4, 1, False)
    with pytest.raises(ValueError, match="at most k=0"):
        _run(None, [SamplingParams(num_speculative_tokens=1)] * 4, 1, False)
    with pytest.raises(ValueError, match="must start at 1"):
        build("draft_model", 3, num_speculative_tokens_per_batch_size=((2, 8, 1),))


def test_no_recompile_while_k_changes():
    """``benchmarks/recompiles.py``'s stream (joins and leaves, so K follows the batch) after
    the engine's warm-up, per step; the device loop's count is the thousand-iteration
    test's."""
    prop = build("eagle3", 3, num_speculative_tokens_per_batch_size=SCHED)
    eng = Engine(target(), prop, max_num_seqs=4, **fixed(steps_per_sync=1))
    log = io.StringIO()
    out = bench.run(eng, iters=40, log=log, vocab=64, max_prompt=14, max_tokens=32)
    assert out["iterations"] >= 40 and out["joins"] > 0
    assert out["compiles"] == 0 and out["compile_logs"] == [], log.getvalue()


def test_sampling_with_mixed_caps_keeps_the_target_distribution():
    """Chi-square at alpha = 1e-3 on the first verified token, requests alternating cap 1
    and 2 (the draft model is the target drafting its argmax)."""
    tgt = target(4.0)
    prop = build("draft_model", 2, tgt, max_model_len=16)
    sps = [SamplingParams(max_tokens=4, temperature=1.0, seed=i,
                          num_speculative_tokens=1 + i % 2) for i in range(N_SAMPLES)]
    kw = dict(max_model_len=16, block_size=BS,
              options=LoopOptions(query_buckets=(8,), context_buckets=(2,)))
    out = generate(tgt, prop, [SAMPLE_PROMPT] * N_SAMPLES, sps, **kw)
    assert _chi2_first_verified(out, tgt) > 1e-3
    full = generate(tgt, prop, [SAMPLE_PROMPT] * N_SAMPLES,
                    [SamplingParams(max_tokens=4, temperature=1.0, seed=i)
                     for i in range(N_SAMPLES)], **kw)
    drafted = np.array([o.num_draft_tokens for o in out.outputs])
    assert drafted[1::2].max() >= 2 and 0 < drafted.sum() < full.spec_stats.num_draft_tokens


def _spy_rows(monkeypatch) -> list:
    """``(requests, query_len_pad)`` of each device-loop call's state, appended as made."""
    from specjax.engine import device_loop

    seen: list = []
    real = device_loop.DeviceLoopDriver.loop_state

    def spy(self, running, ahead=1):
        st = real(self, running, ahead)
        seen.append((len(running), st.query_len_pad))
        return st

    monkeypatch.setattr(device_loop.DeviceLoopDriver, "loop_state", spy)
    return seen


def test_device_loop_rows_shrink_to_the_k_in_force(monkeypatch):
    """With the default buckets the device loop's rows hold ``K + 1`` tokens (rounded to a
    power of two): 1 while three requests run (K = 0), 4 for the last one (K = 3)."""
    from test_engine import FIXED

    seen = _spy_rows(monkeypatch)
    prop = build("draft_model", 3, num_speculative_tokens_per_batch_size=((1, 1, 3), (2, 8, 0)))
    eng = Engine(target(), prop, max_num_seqs=4, max_model_len=FIXED["max_model_len"],
                 block_size=BS, options=LoopOptions(steps_per_sync=4))
    sps = [SamplingParams(max_tokens=m) for m in (5, 9, 20)]
    out = eng.generate(PROMPTS[:3], sps)
    assert out.token_ids == _run(None, sps + [SamplingParams()], 1, False).token_ids[:3]
    assert (3, 1) in seen and (1, 4) in seen and all(q == (4 if n == 1 else 1) for n, q in seen)


@pytest.mark.parametrize("n", (1, 4))
def test_exact_query_buckets_rows_of_k_plus_one(monkeypatch, n):
    """``query_buckets`` 1..k + 1 (no power-of-two padding of decode rows): the device loop's
    rows hold exactly ``K + 1`` tokens (3 in pairs: K = 2), and greedy output equals plain
    on the per-step path and the device loop."""
    seen = _spy_rows(monkeypatch)
    sps = [SamplingParams(max_tokens=m) for m in LENGTHS]
    prop = build("draft_model", 3, num_speculative_tokens_per_batch_size=SCHED)
    eng = Engine(target(), prop, max_num_seqs=4,
                 **fixed(steps_per_sync=n, query_buckets=(1, 2, 3, 4, 32)))
    assert eng.generate(PROMPTS, sps).token_ids == _run(None, sps, 1, False).token_ids
    if n > 1:
        assert (2, 3) in seen and (1, 4) in seen


def test_device_loop_drafts_only_the_k_in_force(monkeypatch):
    """Each device-loop call's chain drafter proposes the K its steps verify: chains of 3
    (k) alone, 2 in pairs, 1 (the first pass only) from three requests up; output unchanged."""
    dl = sys.modules["specjax.runtime.decode_loop"]
    seen = set()
    real = dl._loop_jit

    def spy(spec, *args):
        seen.add(spec.impl.chain_len)
        return real(spec, *args)

    monkeypatch.setattr(dl, "_loop_jit", spy)
    sps = [SamplingParams(max_tokens=m) for m in LENGTHS]
    out = _run(build("draft_model", 3, num_speculative_tokens_per_batch_size=SCHED), sps, 4, False)
    assert out.token_ids == _run(None, sps, 1, False).token_ids
    assert seen == {None, 2, 1}


def test_a_smaller_k_computes_the_target_logits_of_its_rows_only():
    """A step drafting K < k (``draft_len``; rows of Q = K + 1 rounded up) computes the
    target's logits for its B x Q token slots, not B x (k + 1): the vocabulary projection of
    a small K costs what it costs in an engine of k = K. Read off the lowered program of a
    history proposer's engine (no draft logits): its ``[rows, V]`` product (V = 64; the
    hidden and MLP widths differ from it)."""
    import re

    from specjax.engine import TargetModel
    from specjax.models import registry
    from test_engine import FIXED, GEO

    cfg = registry.config_from_hf("llama", dict(GEO, intermediate_size=48, num_hidden_layers=1))
    tgt = TargetModel(registry.make_model("llama", cfg), registry.init_params("llama", cfg, 0))
    eng = Engine(tgt, build("ngram_gpu", 3, tgt), max_num_seqs=4,
                 max_model_len=FIXED["max_model_len"], block_size=BS,
                 options=LoopOptions(steps_per_sync=4))
    s = eng.scheduler
    rows = {}
    for dl in (None, 1, 0):
        kk = eng.k if dl is None else dl
        batch = s.dummy_batch(4, s.buckets(4, kk + 1, 1, kk)[1], s.max_blocks_per_req)
        text = eng.step.lower(tgt.params, eng.step.draft_params, eng.target_kv, eng.draft_state,
                              batch, draft_len=dl).as_text()
        rows[dl] = re.findall(rf"dot_general.*-> tensor<(\d+)x{eng.vocab_size}xf32>", text)
    assert rows == {None: ["16"], 1: ["8"], 0: ["4"]}, rows


# -- LoopOptions(adaptive_k=True): the policy --------------------------------------------------

def test_choose_k_and_the_acceptance_estimate():
    from specjax import adaptive_k as ak

    cost = np.array([1.0, 1.2, 1.4, 1.6])          # each draft costs 20% of a step
    assert ak.choose_k(np.array([0.05] * 4), np.array([3] * 4), cost) == 0
    assert ak.choose_k(np.array([0.95] * 4), np.array([3] * 4), cost) == 3
    assert ak.choose_k(np.array([0.95] * 4), np.array([1] * 4), cost) == 1     # caps bind
    # E(0.5, 1) / 1.2 = 1.25 > E(0.5, 2) / 1.4 = 1.25 (tie: the smaller K) > 1
    assert ak.choose_k(np.array([0.5]), np.array([3]), cost) == 1
    h, t = ak.observe_acceptance(np.zeros(2), np.zeros(2), np.array([3, 3]), np.array([3, 1]))
    assert h.tolist() == [3, 1] and t.tolist() == [3, 2]
    assert np.allclose(ak.acceptance_rate(h, t), [(3 + 1.6) / 5, (1 + 1.6) / 4])
    assert ak.acceptance_rate(np.zeros(1), np.zeros(1))[0] == pytest.approx(ak.PRIOR)
    h2, t2 = ak.observe_acceptance(h, t, np.array([0, 0]), np.array([0, 0]))   # no drafts
    assert np.allclose(h2, 0.9 * h) and np.allclose(t2, 0.9 * t)


@pytest.mark.parametrize("n,overlap", [(1, False), (4, False), (4, True)])
@pytest.mark.parametrize("method", ("draft_model", "eagle3"))
def test_adaptive_k_keeps_greedy_output_and_follows_acceptance(method, n, overlap):
    """Drafts cost 50% of a step each (a hand-set table): the target drafting for itself
    (every draft accepted) keeps k = 3; a random EAGLE-3 head (drafts rejected) drops to
    K = 0 after its first steps and retries only as its evidence decays."""
    sps = [SamplingParams(max_tokens=24)] * 4
    plain = _run(None, sps, n, overlap)
    eng = Engine(target(), build(method, 3), max_num_seqs=4,
                 **fixed(steps_per_sync=n, overlap=overlap, adaptive_k=True))
    eng.k_costs[4] = np.array([1.0, 1.5, 2.0, 2.5])
    logs: list = []
    out = eng.generate(PROMPTS, sps, stat_loggers=[logs.append])
    assert out.token_ids == plain.token_ids
    s = out.spec_stats
    if method == "draft_model":
        assert s.num_accepted_tokens == s.num_draft_tokens and s.num_draft_tokens > 3 * 4 * 2
    else:
        drafted = [x.num_draft_tokens for x in logs]
        assert sum(drafted[len(drafted) // 2:]) < sum(drafted[: len(drafted) // 2]) + 4
        assert sum(d > 0 for d in drafted) < len(drafted) / 2


def test_overlapped_calls_continue_across_a_k_change(monkeypatch):
    """A call dispatched behind one in flight takes the policy's new K and continues that
    call's state (no commit first): the rejected random head's K falls, output unchanged."""
    from specjax.engine import device_loop

    ks = []
    real = device_loop.DeviceLoopDriver.recap

    def spy(self, rows, state, pol):
        ks.append(pol.k)
        return real(self, rows, state, pol)

    monkeypatch.setattr(device_loop.DeviceLoopDriver, "recap", spy)
    sps = [SamplingParams(max_tokens=24)] * 4
    eng = Engine(target(), build("eagle3", 3), max_num_seqs=4,
                 **fixed(steps_per_sync=4, overlap=True, adaptive_k=True))
    eng.k_costs[4] = np.array([1.0, 1.5, 2.0, 2.5])
    out = eng.generate(PROMPTS, sps)
    assert out.token_ids == _run(None, sps, 1, False).token_ids
    assert ks and min(ks) < 3, ks


def test_adaptive_k_warmup_profiles_and_compiles_every_k():
    prop = build("eagle3", 3)
    eng = Engine(target(), prop, max_num_seqs=4, **fixed(steps_per_sync=4, adaptive_k=True))
    log = io.StringIO()
    out = bench.run(eng, iters=30, log=log, vocab=64, max_prompt=14, max_tokens=32)
    assert set(eng.k_costs) == {4} and eng.k_costs[4].shape == (4,) and (eng.k_costs[4] > 0).all()
    assert out["compiles"] == 0 and out["compile_logs"] == [], log.getvalue()


@pytest.mark.slow
def test_thousand_iterations_no_recompile_while_k_changes(tmp_path):
    """Issue 55's proof: 1,000 iterations of joins and leaves with the schedule and the
    policy both changing K, zero compiles after warm-up."""
    prop = build("eagle3", 3, num_speculative_tokens_per_batch_size=SCHED)
    eng = Engine(target(), prop, max_num_seqs=4, **fixed(steps_per_sync=8, adaptive_k=True))
    path = tmp_path / "recompiles.log"
    with open(path, "w") as log:
        out = bench.run(eng, iters=1000, log=log, vocab=64, max_prompt=14, max_tokens=32)
    assert out["iterations"] >= 1000 and out["joins"] > 100
    assert out["compiles"] == 0 and out["compile_logs"] == [], path.read_text()

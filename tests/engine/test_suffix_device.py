"""``method="suffix"`` on the device backend (vLLM 0.34's GPU suffix speculator) in the engine:
greedy output equals plain decoding on the step loop and the device loop; a finished request's
response joins the corpus as it finishes, so a later request of the same ``generate`` drafts
from it; seeded sampling keeps the target's distribution (chi-square); the device loop refuses
a stateful drafter without its state."""

import numpy as np
import pytest

from specjax import SpeculativeConfig
from specjax.engine import Engine, LoopOptions, SamplingParams, generate
from specjax.proposers import make_proposer
from specjax.proposers.suffix_gpu import SuffixGPUProposerAdapter
from test_engine import (
    BS, MML, N_SAMPLES, SAMPLE_PROMPT, _chi2_first_verified, baseline, fixed,
    run, target)


def build(k=4, mml=MML, **kw):
    cfg = SpeculativeConfig(method="suffix", num_speculative_tokens=k, **kw)
    prop = make_proposer(cfg, max_model_len=mml, block_size=BS)
    assert isinstance(prop, SuffixGPUProposerAdapter) and cfg.suffix_backend == "device"
    return prop


@pytest.mark.parametrize("which", ["A", "B"])
def test_greedy_output_equals_plain(which):
    out = run(build(), which)
    base = baseline(which)
    assert out.token_ids == base.token_ids
    assert [o.finish_reason for o in out.outputs] == [o.finish_reason for o in base.outputs]


@pytest.mark.parametrize("loop", [dict(steps_per_sync=4), dict(steps_per_sync=4, overlap=True)])
def test_the_device_loop_drafts_from_the_corpus(loop):
    """Same prompt three times, one request at a time: greedy output equals plain decoding on
    the device loop, and the later requests, whose first response is in the corpus by then,
    accept more drafts than the first."""
    prompts = [[5, 9, 2, 7, 11, 3]] * 3
    sps = [SamplingParams(max_tokens=24, ignore_eos=True)] * 3
    plain = Engine(target(), None, max_num_seqs=1, **fixed()).generate(prompts, sps)
    for opts in ({}, loop):
        prop = build()
        out = Engine(target(), prop, max_num_seqs=1, **fixed(**opts)).generate(prompts, sps)
        assert out.token_ids == plain.token_ids, opts
        acc = [o.num_accepted_tokens for o in out.outputs]
        assert acc[1] > acc[0] and acc[2] > acc[0], (opts, acc)
        assert int(np.asarray(prop.state.doc_seq)) == 3          # each response ingested once


def test_without_the_corpus_nothing_is_learned_across_requests():
    prompts = [[5, 9, 2, 7, 11, 3]] * 2
    sps = [SamplingParams(max_tokens=24, ignore_eos=True)] * 2
    out = Engine(target(), build(suffix_decoding_corpus_tokens=0), max_num_seqs=1,
                 **fixed()).generate(prompts, sps)
    acc = [o.num_accepted_tokens for o in out.outputs]
    assert acc[0] == acc[1]


def test_sampling_keeps_the_target_distribution():
    """Chi-square at alpha = 1e-3 on the first verified token (the own-history match of
    the repeated prompt drafts it)."""
    tgt = target(4.0)
    sps = [SamplingParams(max_tokens=4, temperature=1.0, seed=i) for i in range(N_SAMPLES)]
    out = generate(tgt, build(2, 16), [SAMPLE_PROMPT] * N_SAMPLES, sps, max_model_len=16,
                   block_size=BS, options=LoopOptions(query_buckets=(8,), context_buckets=(2,)))
    assert out.spec_stats.num_draft_tokens > 0
    assert _chi2_first_verified(out, tgt) > 1e-3


def test_the_device_loop_needs_the_drafter_state():
    from specjax.runtime.decode_loop import decode_loop, make_loop_state

    eng = Engine(target(), build(), max_num_seqs=1, **fixed(steps_per_sync=4))
    st = make_loop_state(last_token=[3], num_computed=[5], drafts=[[]], max_tokens=[4],
                         num_output=[0], block_ids=[[1]], k=4, num_reqs_pad=1,
                         blocks_per_req_pad=MML // BS, query_len_pad=8, max_model_len=MML,
                         block_size=BS, history=[[5, 9, 2, 7, 11, 3]])
    with pytest.raises(ValueError, match="drafter_state=proposer.device_drafter_state"):
        decode_loop(eng.step, eng.target.params, eng.step.draft_params, eng.target_kv,
                    eng.draft_state, st, steps_per_sync=4)


def test_confidence_buckets():
    from specjax.proposers.suffix_gpu import confidence_bucket

    got = [confidence_bucket(n) for n in (1, 2, 6, 7, 10, 11, 20, 21, 500)]
    assert got == [0, 1, 5, 6, 6, 7, 7, 8, 8]


def test_observed_statistics_follow_vllms_rule():
    """Slots ``i <= accepted``, ``i < verified``, ``i < num_valid`` observed; ``i < accepted``
    accepted; features are Laplace ``(acc + 1) / (obs + 2)`` on the real drafts, 0 on
    fillers; the counts halve every STATS_HALF_LIFE steps."""
    from specjax.proposers import suffix_gpu as sg

    prop = build(4, enable_adaptive_verification=True)
    assert prop.drafts_confidence
    prop._last = {"a": (sg.SOURCE_OWN, 2, 3), "b": (sg.SOURCE_CORPUS, 8, 4),
                  "c": (sg.SOURCE_NONE, 0, 0)}
    prop.observe_verification(["a", "b", "c"], [4, 2, 4], [1, 2, 4])
    st = prop._stats
    assert st[0, 2, :, 0].tolist() == [1, 1, 0, 0] and st[0, 2, :, 1].tolist() == [1, 0, 0, 0]
    assert st[1, 8, :, 0].tolist() == [1, 1, 0, 0] and st[1, 8, :, 1].tolist() == [1, 1, 0, 0]
    assert st.sum() == 7 and prop._last == {}
    prop._observed_steps = sg.STATS_HALF_LIFE - 1
    prop._stats[0, 2, 0] = [9, 5]
    prop.observe_verification([], [], [])
    assert prop._stats[0, 2, 0].tolist() == [4, 2]


def test_adaptive_verification_on_suffix_statistics(monkeypatch):
    """``enable_adaptive_verification`` with the device suffix speculator: greedy output
    equals plain decoding, the features seen by the admission are the Laplace confidences of
    the statistics (0 for fillers), and the statistics fill as drafts are verified."""
    from specjax.engine.verification import AdaptiveVerifier

    seen = []
    real = AdaptiveVerifier.admit

    def spy(self, reqs, n0, cost):
        seen.extend(np.asarray(r.draft_features) for r in reqs)
        return real(self, reqs, n0, cost)

    monkeypatch.setattr(AdaptiveVerifier, "admit", spy)
    prompts = [[5, 9, 2, 7, 11, 3, 5, 9, 2], [4, 4, 4, 4]] * 2
    sps = [SamplingParams(max_tokens=20, ignore_eos=True)] * 4
    plain = Engine(target(), None, max_num_seqs=4, **fixed()).generate(prompts, sps)
    prop = build(4, enable_adaptive_verification=True)
    eng = Engine(target(), prop, max_num_seqs=4, **fixed())
    eng.k_costs[4] = np.asarray([1.0, 1.05, 1.1, 1.15, 1.2])
    out = eng.generate(prompts, sps)
    assert out.token_ids == plain.token_ids
    assert prop._stats[..., 0].sum() > 0 and eng.verifier.history
    feats = np.concatenate(seen)
    assert ((feats == 0) | ((feats > 0) & (feats < 1))).all() and (feats == 0.5).any()
    assert int(eng.verifier.state.refits) == 0       # the estimator is not used
    with pytest.raises(ValueError, match="method='suffix' on the device backend"):
        SpeculativeConfig(method="suffix", num_speculative_tokens=4, suffix_backend="arctic",
                          enable_adaptive_verification=True)


def test_requests_finishing_after_warmup_compile_nothing():
    """``Engine.warmup`` compiles the corpus's ingestion for up to ``max_num_seqs``
    documents; requests of different lengths then finish one, two or more at a time and
    join the corpus without a compile."""
    from specjax.proposers import suffix_gpu_corpus as co
    from test_engine import PARAMS_A, PROMPTS_A

    prop = build()
    eng = Engine(target(), prop, max_num_seqs=4, **fixed())
    eng.warmup([4], [16])
    before = co.ingest._cache_size()
    out = eng.generate(PROMPTS_A, PARAMS_A)
    assert out.token_ids == baseline("A").token_ids
    assert int(np.asarray(prop.state.doc_seq)) == len(PROMPTS_A)
    assert co.ingest._cache_size() == before

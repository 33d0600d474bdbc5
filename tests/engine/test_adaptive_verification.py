"""vLLM's adaptive verification (``enable_adaptive_verification``, issue 55) in the engine:
greedy output equals plain decoding for every method that scores its drafts; the draft
features are ``logit(q_max)`` of the draft distribution (checked against a dense forward of
the target, the draft model's own weights); the cost table decides how many drafts are
verified; the online estimator learns from what was verified; seeded sampling keeps the
target's distribution; every combination it cannot serve is refused by name."""

import dataclasses

import numpy as np
import pytest

from specjax import SpeculativeConfig
from specjax.engine import Engine, LoopOptions, SamplingParams, generate
from specjax.engine.verification import AdaptiveVerifier
from test_engine import (
    BS, LOOP, N_SAMPLES, SAMPLE_PROMPT, _chi2_first_verified, _target_probs,
    build, fixed, target)

PROMPTS = [[5, 9, 2, 7], [11, 3, 3], [8, 1, 6, 2, 9], [4, 4]]
AV = dict(enable_adaptive_verification=True)


def _engine(prop, cost, **kw):
    eng = Engine(target(), prop, max_num_seqs=4, **fixed(**kw))
    eng.k_costs[4] = np.asarray(cost, np.float64)
    return eng


@pytest.mark.parametrize("method", ("eagle", "eagle3", "mtp", "draft_model", "dflash", "dspark",
                                    "medusa"))
def test_greedy_output_equals_plain(method):
    sps = [SamplingParams(max_tokens=m) for m in (6, 9, 12, 15)]
    plain = Engine(target(), None, max_num_seqs=4, **fixed()).generate(PROMPTS, sps)
    eng = _engine(build(method, 3, **AV), [1.0, 1.1, 1.2, 1.3])
    out = eng.generate(PROMPTS, sps)
    assert out.token_ids == plain.token_ids
    assert eng.options.steps_per_sync == 1 and not eng.options.overlap
    assert eng.verifier.history and set(eng.verifier.history) <= {0, 1, 2, 3}


def test_features_are_logit_qmax_of_the_draft_distribution(monkeypatch):
    """The draft model is the target: draft j's feature is ``log(q / (1 - q))`` of the
    target's next-token distribution after the context and drafts ``0..j-1``."""
    seen = []
    real = AdaptiveVerifier.admit

    def spy(self, reqs, n0, cost):
        for r in reqs:
            seen.append((r.prompt + r.output, list(r.drafts), np.array(r.draft_features)))
        return real(self, reqs, n0, cost)

    monkeypatch.setattr(AdaptiveVerifier, "admit", spy)
    eng = _engine(build("draft_model", 3, **AV), [1.0, 1.0, 1.0, 1.0])
    eng.generate(PROMPTS, [SamplingParams(max_tokens=8)] * 4)
    checked = 0
    for ctx, drafts, feats in seen[:6]:
        for j in range(len(drafts)):
            q = _target_probs(target(), [ctx + drafts[:j]])[0]
            assert int(np.argmax(q)) == drafts[j]
            want = np.log(q.max()) - np.log1p(-q.max())
            assert feats[j] == pytest.approx(want, abs=2e-3)
            checked += 1
    assert checked >= 12


def test_the_cost_table_decides_how_many_drafts_are_verified():
    sps = [SamplingParams(max_tokens=12)] * 4
    dear = _engine(build("draft_model", 3, **AV), [1.0, 9.0, 9.5, 10.0])
    out = dear.generate(PROMPTS, sps)
    assert out.spec_stats.num_draft_tokens == 0 and set(dear.verifier.history) == {0}
    free = _engine(build("draft_model", 3, **AV), [1.0, 1.0, 1.0, 1.0])
    out = free.generate(PROMPTS, sps)
    static = _engine(build("draft_model", 3), [1.0, 1.0, 1.0, 1.0]).generate(PROMPTS, sps)
    assert max(free.verifier.history) == 3      # (fewer once every row's drafts are cut)
    assert out.spec_stats.num_draft_tokens == static.spec_stats.num_draft_tokens > 0


@pytest.mark.parametrize("method,rises", [("draft_model", True), ("eagle3", False)])
def test_the_estimator_learns_from_verified_drafts(method, rises):
    """Past 100 verified steps the estimator refits: drafts that are always accepted (the
    target drafting for itself) raise the intercepts, a random head's rejected drafts lower
    the first one."""
    mml = 512 if rises else 256      # at least 100 verified steps each
    prop = build(method, 3, max_model_len=mml, **AV)
    opts = dataclasses.replace(LOOP, context_buckets=(mml // BS,), token_buckets=None)
    eng = Engine(target(), prop, max_num_seqs=4, max_model_len=mml, block_size=BS,
                 options=opts)
    eng.k_costs[4] = np.array([1.0, 1.0, 1.0, 1.0])
    out = eng.generate(PROMPTS, [SamplingParams(max_tokens=mml - 8, ignore_eos=True)] * 4)
    st = eng.verifier.state
    assert int(st.refits) >= 1, out.num_steps
    beta = np.asarray(st.beta)
    if rises:
        assert (beta > -0.2).all()
    else:
        assert beta[0] < -0.2


def test_sampling_keeps_the_target_distribution(monkeypatch):
    """Chi-square at alpha = 1e-3 on the first verified token with drafts admitted by
    confidence (the draft model is the target drafting its argmax). The cost table is flat
    (not timed: on a loaded CPU the profile can price every draft out)."""

    def flat_costs(eng, batch_sizes, reps=3):
        for b in batch_sizes:
            eng.k_costs[b] = np.ones(eng.k + 1)
        return eng.k_costs

    monkeypatch.setattr(Engine, "profile_k_costs", flat_costs)
    tgt = target(4.0)
    prop = build("draft_model", 2, tgt, max_model_len=16, **AV)
    sps = [SamplingParams(max_tokens=4, temperature=1.0, seed=i) for i in range(N_SAMPLES)]
    out = generate(tgt, prop, [SAMPLE_PROMPT] * N_SAMPLES, sps, max_model_len=16,
                   block_size=BS, options=LoopOptions(query_buckets=(8,), context_buckets=(2,)))
    assert _chi2_first_verified(out, tgt) > 1e-3
    assert out.spec_stats.num_draft_tokens > 0


def test_refused_by_name():
    for bad in (dict(method="ngram"), dict(method="suffix", suffix_backend="arctic"),
                dict(method="eagle3", speculative_token_tree="[(0,), (1,), (0, 0), (1, 0)]"),
                dict(method="eagle3", use_local_argmax_reduction=True)):
        kw = dict(num_speculative_tokens=3, **AV, **bad)
        if bad["method"] == "ngram":
            kw["model"] = "ngram"
        with pytest.raises(ValueError, match="enable_adaptive_verification"):
            SpeculativeConfig(**kw)
    with pytest.raises(TypeError, match="enable_adaptive_verification"):
        SpeculativeConfig(method="eagle3", num_speculative_tokens=3,
                          enable_adaptive_verification="yes")
    prop = build("eagle3", 3, **AV)
    with pytest.raises(ValueError, match="adaptive_k=True and enable_adaptive_verification"):
        Engine(target(), prop, max_num_seqs=4, **fixed(adaptive_k=True))
    with pytest.raises(ValueError, match="steps_per_sync=4: enable_adaptive_verification"):
        Engine(target(), prop, max_num_seqs=4, **fixed(steps_per_sync=4))
    cfg = SpeculativeConfig.from_vllm({"method": "eagle3", "num_speculative_tokens": 3, **AV})
    assert cfg.enable_adaptive_verification is True

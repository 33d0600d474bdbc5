"""``method="dspark"``: greedy DSpark decoding equals plain greedy decoding (random heads, with
and without the confidence head, both block layouts, a reduced-vocab rnn head); the
confidence head decides what adaptive verification verifies (and the estimator is not
used); sampled anchored drafts keep the target's distribution; a head whose drafts are
forced right accepts every draft."""

import numpy as np
import pytest

from specjax.config import SpeculativeConfig
from specjax.models import registry
from specjax.proposers import make_proposer

import test_engine as te

DSPARK = dict(te.HEADS["dflash"][1], markov_rank=8)


def build(k, params=None, tgt=None, spec=None, mml=te.MML, **hf):
    tgt = tgt or te.target()
    dcfg = registry.config_from_hf("dspark", dict(DSPARK, **hf))
    params = params(dcfg) if params else registry.init_params("dspark", dcfg, 1)
    cfg = SpeculativeConfig(method="dspark", num_speculative_tokens=k, **(spec or {}))
    return make_proposer(cfg, draft=dcfg, draft_params=params, target=tgt.model,
                         target_params=tgt.params, max_model_len=mml, block_size=te.BS,
                         kernel_backend="xla")


def texts(out):
    return [o.token_ids for o in out.outputs]


@pytest.mark.parametrize("k,hf", [
    (3, {}), (3, dict(enable_confidence_head=True, confidence_head_with_markov=True)),
    (2, dict(sample_from_anchor=False)), (1, dict(sample_from_anchor=False)),
    (3, dict(markov_head_type="rnn", draft_vocab_size=40, has_d2t=True,
                                                    has_lm_head=True)),
])
def test_dspark_greedy_is_lossless(k, hf):
    assert texts(te.run(build(k, **hf), "A")) == texts(te.baseline("A"))


def test_one_token_anchored_block_is_refused():
    with pytest.raises(ValueError, match="sample_from_anchor=True needs"):
        build(1)


def test_refusals_by_name():
    with pytest.raises(ValueError, match="branching"):
        SpeculativeConfig(method="dspark", num_speculative_tokens=2,
                          speculative_token_tree="[(0,), (1,)]")


CONF = dict(enable_confidence_head=True, confidence_head_with_markov=True)
AV = dict(enable_adaptive_verification=True)
PROMPTS = [[5, 9, 2, 7], [11, 3, 3], [8, 1, 6, 2, 9], [4, 4]]


def _constant_confidence(bias):
    """A confidence head answering ``sigmoid(bias)`` for every draft."""
    def make(dcfg):
        p = registry.init_params("dspark", dcfg, 1)
        proj = p["confidence_head"]["proj"]
        return dict(p, confidence_head={"proj": {"kernel": np.zeros_like(proj["kernel"]),
                                                 "bias": np.full_like(proj["bias"], bias)}})
    return make


@pytest.mark.parametrize("bias,cost,verified", [
    (8.0, [1.0, 1.01, 1.02, 1.03], "all"),      # sure drafts, cheap verification: all 3
    (-8.0, [1.0, 1.01, 1.02, 1.03], "none"),    # hopeless drafts: none is worth a column
    (0.0, [1.0, 1.3, 1.6, 1.9], "rectangle"),   # c = 1/2: the cost table's own answer
])
def test_the_confidence_head_decides_what_is_verified(monkeypatch, bias, cost, verified):
    from specjax.adaptive_k import rectangle_budget
    from specjax.engine import Engine, SamplingParams
    from specjax.engine.verification import AdaptiveVerifier

    feats = []
    real = AdaptiveVerifier.admit

    def spy(self, reqs, n0, cst):
        feats.extend(np.asarray(r.draft_features[: len(r.drafts)]) for r in reqs)
        return real(self, reqs, n0, cst)

    monkeypatch.setattr(AdaptiveVerifier, "admit", spy)
    prop = build(3, _constant_confidence(bias), spec=AV, **CONF)
    assert prop.drafts_confidence
    eng = Engine(te.target(), prop, max_num_seqs=4, **te.fixed())
    eng.k_costs[4] = np.asarray(cost)
    sps = [SamplingParams(max_tokens=m) for m in (6, 9, 12, 15)]
    out = eng.generate(PROMPTS, sps)
    plain = Engine(te.target(), None, max_num_seqs=4, **te.fixed()).generate(PROMPTS, sps)
    assert out.token_ids == plain.token_ids
    c = 1.0 / (1.0 + np.exp(-bias))
    assert feats and all(np.allclose(f, c, atol=1e-6) for f in feats)
    first = eng.verifier.history[0]
    want = {"all": 3, "none": 0,
            "rectangle": rectangle_budget(np.cumprod(np.full((4, 3), c), 1), np.full(4, 3), 4,
                                          np.asarray(cost))}[verified]
    assert first == want
    if verified == "rectangle":
        assert 0 < want < 3          # the case separates "all" from "none"
    st = eng.verifier.state           # the estimator is not used with a confidence head
    assert int(st.refits) == 0 and int(np.asarray(st.count).sum()) == 0


def test_without_a_confidence_head_the_estimator_scores_the_markov_logits():
    from specjax.engine import Engine, SamplingParams

    prop = build(3, spec=AV)
    assert not prop.drafts_confidence
    eng = Engine(te.target(), prop, max_num_seqs=4, **te.fixed())
    eng.k_costs[4] = np.asarray([1.0, 1.0, 1.0, 1.0])
    sps = [SamplingParams(max_tokens=m) for m in (6, 9, 12, 15)]
    out = eng.generate(PROMPTS, sps)
    plain = Engine(te.target(), None, max_num_seqs=4, **te.fixed()).generate(PROMPTS, sps)
    assert out.token_ids == plain.token_ids
    assert int(np.asarray(eng.verifier.state.count).sum()) > 0


def test_topk_markov_is_lossless():
    """``dspark_draft_topk``: greedy output equals plain decoding; the drafts differ from
    the full evaluation's (a strong Markov bias, top-2 base logits only)."""
    def strong(dcfg):
        p = registry.init_params("dspark", dcfg, 1)
        mh = p["markov_head"]
        w2 = {"kernel": np.asarray(mh["markov_w2"]["kernel"]) * 50}
        return dict(p, markov_head=dict(mh, markov_w2=w2))

    topk = te.run(build(3, strong, spec=dict(dspark_draft_topk=2)), "A")
    full = te.run(build(3, strong), "A")
    assert texts(topk) == texts(full) == texts(te.baseline("A"))
    assert topk.spec_stats.num_accepted_tokens != full.spec_stats.num_accepted_tokens


@pytest.mark.parametrize("hf", [{}, dict(CONF), dict(topk=3)])
def test_anchored_sampled_drafts_keep_the_target_distribution(hf):
    """Chi-square on the first verified token, drafts sampled from the Markov-biased logits
    of an anchored block (every slot drafting), T = 1."""
    from specjax.engine import LoopOptions, SamplingParams, generate
    from test_draft_sampling import _chi2

    tgt = te.target(4.0)
    hf = dict(hf)
    spec = dict(draft_sample_method="probabilistic", dspark_draft_topk=hf.pop("topk", None))
    prop = build(2, tgt=tgt, mml=16, spec=spec, **hf)
    sps = [SamplingParams(max_tokens=3, temperature=1.0, seed=i) for i in range(te.N_SAMPLES)]
    out = generate(tgt, prop, [te.SAMPLE_PROMPT] * te.N_SAMPLES, sps, max_model_len=16,
                   block_size=te.BS, options=LoopOptions(query_buckets=(8,), context_buckets=(2,)))
    assert out.spec_stats.num_accepted_tokens > 0
    assert _chi2(out, tgt, 1.0) > 1e-3


@pytest.mark.parametrize("loop", [dict(steps_per_sync=4), dict(steps_per_sync=4, overlap=True)])
def test_dspark_in_the_device_loop_equals_plain(loop):
    from specjax.engine import Engine, SamplingParams

    sps = [SamplingParams(max_tokens=m) for m in (6, 9, 12, 15)]
    plain = Engine(te.target(), None, max_num_seqs=4, **te.fixed()).generate(PROMPTS, sps)
    out = Engine(te.target(), build(3, **CONF), max_num_seqs=4, **te.fixed(**loop)).generate(
        PROMPTS, sps)
    assert out.token_ids == plain.token_ids and out.spec_stats.num_draft_tokens > 0


def test_a_head_whose_drafts_are_forced_right_accepts_the_whole_block():
    """A structured pair: a target whose next token depends on the current one only (every
    layer's output projections zero: the residual stream is the embedding), and a DSpark
    head with zero base logits whose rank-V Markov table holds exactly that bigram map.
    Every draft is then the target's own greedy continuation: each step accepts all k."""
    import jax.numpy as jnp

    from specjax.engine import Engine, SamplingParams, TargetModel

    tgt = te.target()
    tp = dict(tgt.params, layers={i: dict(lp, self_attn=dict(lp["self_attn"], o_proj={
        "kernel": jnp.zeros_like(lp["self_attn"]["o_proj"]["kernel"])}), mlp=dict(
            lp["mlp"], down_proj={"kernel": jnp.zeros_like(lp["mlp"]["down_proj"]["kernel"])}))
        for i, lp in tgt.params["layers"].items()})
    bigram = TargetModel(tgt.model, tp)
    v = te.V
    ids = jnp.arange(v, dtype=jnp.int32)
    hid, _, _ = tgt.model.forward(tp, ids, jnp.zeros(v, jnp.int32),
                                  tgt.model.init_kv_caches(v, te.BS), _one_token_rows(v))
    nxt = np.asarray(jnp.argmax(tgt.model.compute_logits(tp, hid), -1))    # f(token)

    def forced(dcfg):
        p = registry.init_params("dspark", dcfg, 1)
        w2 = np.zeros((v, v), np.float32)
        w2[np.arange(v), nxt] = 30.0                 # W2 . W1[p] peaks at f(p)
        return dict(p, lm_head={"kernel": np.zeros_like(p["lm_head"]["kernel"])},
                    markov_head={"markov_w1": {"embedding": np.eye(v, dtype=np.float32)},
                                 "markov_w2": {"kernel": w2}})

    prop = build(3, forced, tgt=bigram, markov_rank=v, has_lm_head=True)
    sps = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (13, 17, 9, 21)]
    plain = Engine(bigram, None, max_num_seqs=4, **te.fixed()).generate(PROMPTS, sps)
    out = Engine(bigram, prop, max_num_seqs=4, **te.fixed()).generate(PROMPTS, sps)
    assert out.token_ids == plain.token_ids
    st = out.spec_stats
    assert st.num_draft_tokens > 0 and st.num_accepted_tokens == st.num_draft_tokens


def _one_token_rows(n):
    """Attention metadata of ``n`` one-token requests at position 0 (a dense probe)."""
    from specjax.attention_metadata import CommonAttentionMetadata

    table = np.arange(1, n + 1, dtype=np.int32)[:, None]
    return CommonAttentionMetadata.from_query_lens([1] * n, [1] * n, table, block_size=te.BS)

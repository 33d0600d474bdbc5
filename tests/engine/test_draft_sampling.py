"""vLLM's probabilistic drafting (``draft_sample_method="probabilistic"``, issue 56): drafts
sampled at the request's temperature, verified with their probabilities. Greedy output is
unchanged; chi-square on the first verified token at T = 1 and 0.6 for every model method;
a mutation (verification with wrong draft probabilities) fails the same test, while
ignoring them stays exact but accepts less; vLLM's noise-sharing bias restated; refusals by
name."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from specjax import SpeculativeConfig
from specjax.engine import Engine, LoopOptions, SamplingParams, generate
from specjax.sampling import draft_sample as ds
from test_engine import (
    BS, N_SAMPLES, SAMPLE_PROMPT, V, _target_probs, build, fixed, target)

PD = dict(draft_sample_method="probabilistic")
METHODS = ("eagle", "eagle3", "mtp", "draft_model", "dflash", "dspark", "medusa")
PROMPTS = [[5, 9, 2, 7], [11, 3, 3], [8, 1, 6, 2, 9], [4, 4]]


def _sampled(method, temperature, loop=None, **extra):
    tgt = target(4.0)
    prop = build(method, 2, tgt, max_model_len=16, **PD, **extra)
    sps = [SamplingParams(max_tokens=3, temperature=temperature, seed=i)
           for i in range(N_SAMPLES)]
    return tgt, generate(tgt, prop, [SAMPLE_PROMPT] * N_SAMPLES, sps, max_model_len=16,
                         block_size=BS, options=LoopOptions(query_buckets=(8,),
                                                            context_buckets=(2,), **(loop or {})))


def _chi2(result, tgt, temperature):
    """Token 1 of each request (verified against sampled drafts) against ``sum_r p_T(. |
    prompt, token 0 of r)``, ``p_T`` the target's distribution at the temperature."""
    t0 = np.array([o.token_ids[0] for o in result.outputs])
    t1 = np.array([o.token_ids[1] for o in result.outputs])
    uniq = np.unique(t0)
    p = _target_probs(tgt, [SAMPLE_PROMPT + [int(t)] for t in uniq]) ** (1.0 / temperature)
    p /= p.sum(1, keepdims=True)
    expected = p[np.searchsorted(uniq, t0)].sum(0)
    observed = np.bincount(t1, minlength=V).astype(np.float64)
    big = expected >= 5
    obs, exp = np.append(observed[big], observed[~big].sum()), np.append(expected[big],
                                                                         expected[~big].sum())
    return stats.chisquare(obs, exp * (obs.sum() / exp.sum())).pvalue


@pytest.mark.parametrize("method", METHODS)
def test_greedy_output_unchanged(method):
    sps = [SamplingParams(max_tokens=m) for m in (6, 9, 12, 15)]
    plain = Engine(target(), None, max_num_seqs=4, **fixed()).generate(PROMPTS, sps)
    out = Engine(target(), build(method, 3, **PD), max_num_seqs=4, **fixed()).generate(PROMPTS, sps)
    assert out.token_ids == plain.token_ids


@pytest.mark.parametrize("temperature", (1.0, 0.6))
@pytest.mark.parametrize("method", METHODS)
def test_sampled_drafts_keep_the_target_distribution(method, temperature):
    tgt, out = _sampled(method, temperature)
    assert out.spec_stats.num_accepted_tokens > 0
    assert _chi2(out, tgt, temperature) > 1e-3


def _mutated(monkeypatch, read, method):
    from specjax.runtime import step

    monkeypatch.setattr(step, "read_draft_probs", read)
    jax.clear_caches()                      # the step retraces with the mutation
    try:
        return _sampled(method, 1.0)
    finally:
        monkeypatch.undo()
        jax.clear_caches()


@pytest.mark.parametrize("loop", [dict(steps_per_sync=4), dict(steps_per_sync=4, overlap=True)])
def test_the_device_loop_keeps_draft_probabilities_per_slot(loop):
    """The device loop (and its overlapped form) carries each request's draft slot: greedy
    output unchanged, and seeded sampled output token for token the step loop's (which the
    chi-square tests above check); rows reading another row's probabilities diverge."""
    sps = [SamplingParams(max_tokens=m) for m in (6, 9, 12, 15)]
    plain = Engine(target(), None, max_num_seqs=4, **fixed()).generate(PROMPTS, sps)
    out = Engine(target(), build("eagle3", 3, **PD), max_num_seqs=4,
                 **fixed(**loop)).generate(PROMPTS, sps)
    assert out.token_ids == plain.token_ids
    sps = [SamplingParams(max_tokens=12, temperature=1.0, seed=i) for i in range(16)]

    def run(**kw):
        return Engine(target(4.0), build("eagle3", 3, **PD), max_num_seqs=16,
                      **fixed(batch_buckets=(16,), **kw)).generate(PROMPTS * 4, sps)

    step, dev = run(), run(**loop)
    assert dev.token_ids == step.token_ids
    assert dev.spec_stats.num_accepted_tokens > 0


def test_truncated_medusa_heads_sample_over_the_target_vocabulary():
    """A Medusa checkpoint with a ``token_map`` (heads over 48 of the 64 ids): its draft
    probabilities are scattered to target ids, the output passes the chi-square test, and
    greedy output is unchanged."""
    from specjax.models import registry
    from specjax.proposers import make_proposer

    def medusa(tgt, **spec):
        cfg = registry.config_from_hf("medusa", dict(num_heads=3, num_hidden_layers=1,
                                                     hidden_size=32, vocab_size=V,
                                                     truncated_vocab_size=48, has_token_map=True))
        p = registry.init_params("medusa", cfg, 1)
        assert np.asarray(p["token_map"]).shape == (48,)
        return make_proposer(SpeculativeConfig(method="medusa", num_speculative_tokens=2, **spec),
                             draft=cfg, draft_params=p, target=tgt.model, target_params=tgt.params,
                             max_model_len=16, block_size=BS, kernel_backend="xla")

    tgt = target(4.0)
    sps = [SamplingParams(max_tokens=3, temperature=1.0, seed=i) for i in range(N_SAMPLES)]
    out = generate(tgt, medusa(tgt, **PD), [SAMPLE_PROMPT] * N_SAMPLES, sps, max_model_len=16,
                   block_size=BS, options=LoopOptions(query_buckets=(8,), context_buckets=(2,)))
    assert out.spec_stats.num_draft_tokens > 0
    assert _chi2(out, tgt, 1.0) > 1e-3
    greedy = [SamplingParams(max_tokens=8)]
    plain = generate(tgt, None, [SAMPLE_PROMPT], greedy, max_model_len=16, block_size=BS)
    got = generate(tgt, medusa(tgt, **PD), [SAMPLE_PROMPT], greedy, max_model_len=16,
                   block_size=BS)
    assert got.token_ids == plain.token_ids


def test_wrong_draft_probabilities_fail_the_test(monkeypatch):
    """The mutation: verification with probabilities other than the drafts' (uniform) is
    biased, and the chi-square catches it."""
    uniform = lambda state, slots: jnp.full(state.probs[slots].shape, 1.0 / V)  # noqa: E731
    tgt, out = _mutated(monkeypatch, uniform, "eagle3")
    assert _chi2(out, tgt, 1.0) < 1e-3


def test_ignoring_the_draft_probabilities_is_exact_but_accepts_less(monkeypatch):
    """Treating sampled drafts as certain (q = 1, the greedy path's test: accept with p(x),
    else resample p without x) keeps the target's distribution for any draft independent of
    the verification noise; what the probabilities buy is acceptance (the target drafting
    for itself: q = p accepts every draft)."""
    tgt, out = _mutated(monkeypatch, lambda state, slots: None, "draft_model")
    assert _chi2(out, tgt, 1.0) > 1e-3
    _, full = _sampled("draft_model", 1.0)
    s, f = out.spec_stats, full.spec_stats
    assert f.num_accepted_tokens == f.num_draft_tokens
    assert s.num_accepted_tokens < 0.8 * s.num_draft_tokens


def test_draft_samples_follow_the_tempered_distribution():
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(1, 12)) * 2, jnp.float32)
    n = 4000
    keys = jax.vmap(lambda i: jax.random.key_data(jax.random.key(i)))(jnp.arange(n))
    for t in (1.0, 0.5):
        smp = ds.DraftSampling(jnp.full((n,), t, jnp.float32), keys)
        tok, probs = ds.sample_draft(jnp.repeat(logits, n, 0), smp, 3)
        want = np.asarray(jax.nn.softmax(logits[0] / t))
        assert np.allclose(np.asarray(probs[0]), want, atol=1e-6)
        obs = np.bincount(np.asarray(tok), minlength=12)
        exp = want.astype(np.float64) / want.astype(np.float64).sum() * n
        assert stats.chisquare(obs, exp).pvalue > 1e-3
    greedy = ds.DraftSampling(jnp.zeros((2,), jnp.float32), keys[:2])
    assert (np.asarray(ds.sample_draft(jnp.repeat(logits, 2, 0), greedy, 0)[0])
            == int(jnp.argmax(logits))).all()
    one = ds.DraftSampling(jnp.ones((n,), jnp.float32), keys)
    a = np.asarray(ds.sample_draft(jnp.repeat(logits, n, 0), one, 0)[0])
    b = np.asarray(ds.sample_draft(jnp.repeat(logits, n, 0), one, 1)[0])
    assert (a != b).mean() > 0.3          # each column its own noise


def test_shared_draft_and_residual_noise_is_biased():
    """vLLM's ``test_gumbel_drafted_rejection_sample_is_unbiased`` restated in NumPy: a draft
    by Gumbel-max, the ratio test, then the residual by Gumbel-max with the SAME noise is
    biased; with fresh noise it is exact. specjax draws drafts from a salted stream."""
    rng = np.random.default_rng(1)
    v, n = 6, 60000
    p, q = rng.dirichlet(np.ones(v)), rng.dirichlet(np.ones(v))
    res = np.maximum(p - q, 0) / np.maximum(p - q, 0).sum()

    def run(shared):
        g = rng.gumbel(size=(n, v))
        x = np.argmax(np.log(q) + g, 1)
        ok = rng.uniform(size=n) < np.minimum(1, p[x] / q[x])
        g2 = g if shared else rng.gumbel(size=(n, v))
        y = np.argmax(np.log(np.maximum(res, 1e-30)) + g2, 1)
        return stats.chisquare(np.bincount(np.where(ok, x, y), minlength=v), p * n).pvalue

    assert run(shared=True) < 1e-6 and run(shared=False) > 1e-3
    assert ds.DRAFT_NOISE_SALT not in (0, 1, 2)   # the verification streams


def test_refused_by_name():
    base = dict(num_speculative_tokens=3, **PD)
    for bad, why in ((dict(method="ngram", model="ngram"), "no draft distribution"),
                     (dict(method="eagle3", speculative_token_tree="[(0,), (1,), (0, 0), (1, 0)]"),
                      "branching"),
                     (dict(method="eagle3", use_local_argmax_reduction=True), "local_argmax"),
                     (dict(method="eagle3", rejection_sample_method="synthetic",
                           synthetic_acceptance_length=2.0), "synthetic"),
                     (dict(method="eagle3", disable_padded_drafter_batch=True), "padded")):
        with pytest.raises(ValueError, match=f"draft_sample_method='probabilistic'.*{why}"):
            SpeculativeConfig(**base, **bad)
    with pytest.raises(ValueError, match="draft_sample_method='gumbel'; allowed"):
        SpeculativeConfig(method="eagle3", num_speculative_tokens=3, draft_sample_method="gumbel")
    prop = build("eagle3", 3, **PD)
    from specjax.runtime.batch import build_batch
    from specjax.runtime.verify import make_verify_step

    vs = make_verify_step(prop, vocab_size=V)
    batch = build_batch([[1, 2]], num_computed=[0], num_drafts=[0], block_ids=[[1]], block_size=BS,
                        num_reqs_pad=1, query_len_pad=4, blocks_per_req_pad=2, max_spec_len=3)
    state = vs.init_draft_state(8, max_num_seqs=2)
    with pytest.raises(ValueError, match="batch.slots must give each row's request slot"):
        vs(vs.draft_params, state, batch, np.zeros((4, V), np.float32), aux=np.zeros((4, 3, 32)))
    cfg = SpeculativeConfig.from_vllm({"method": "eagle3", "num_speculative_tokens": 3, **PD})
    assert cfg.draft_sample_method == "probabilistic"

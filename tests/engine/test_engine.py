"""The reference decoding loop (``specjax.engine``) and ``make_proposer``.

Lossless: for every method available, greedy speculative decoding emits exactly the tokens
of plain greedy decoding of the same target, and plain greedy decoding itself equals a naive
loop that re-runs the whole sequence through the model with a fresh dense cache each token.
Random sampling: the first verified token's distribution is the target's (chi-square).

Everything runs on tiny fp32 models with fixed buckets, so each (method, k) compiles one
step (the jit cache is keyed by value: equal configs built twice share it).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

import specjax
from specjax.attention_metadata import CommonAttentionMetadata
from specjax.config import SpeculativeConfig
from specjax.engine import (Engine, LoopOptions, SamplingParams, TargetModel, generate,
                            step_cache_size)
from specjax.metrics import SpecDecodingLogging
from specjax.models import registry
from specjax.proposers import (DraftOutput, Feed, Proposer, TokenHistory, available_methods,
                               make_proposer)


V = 64
GEO = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
           rms_norm_eps=1e-5, vocab_size=V)
AUX = (0, 1)                  # target layers read by EAGLE-3 / DFlash / extract-hidden-states
MML, BS = 48, 8
# One bucket each: every (method, k) compiles exactly one step.
LOOP = LoopOptions(batch_buckets=(4,), query_buckets=(16,), context_buckets=(MML // BS,),
                   token_buckets=(64,))
FIXED = dict(max_model_len=MML, block_size=BS, num_blocks=1 + 4 * (MML // BS), options=LOOP)


def fixed(**loop) -> dict:
    """``FIXED`` with these ``LoopOptions`` fields changed."""
    return dict(FIXED, options=dataclasses.replace(LOOP, **loop))

METHODS = available_methods()
HEADS = {
    "eagle": ("eagle", dict(GEO, num_hidden_layers=1, bias=True)),
    "eagle3": ("eagle3", dict(GEO, num_hidden_layers=1, draft_vocab_size=40, has_d2t=True,
                              target_hidden_size=32, eagle_aux_hidden_state_layer_ids=list(AUX))),
    "dflash": ("dflash", dict(GEO, num_hidden_layers=1, target_hidden_size=32,
                              aux_hidden_state_layer_ids=list(AUX), mask_token_id=V - 1)),
    "dspark": ("dspark", dict(GEO, num_hidden_layers=1, target_hidden_size=32, markov_rank=8,
                              aux_hidden_state_layer_ids=list(AUX), mask_token_id=V - 1,
                              sample_from_anchor=False)),   # (k = 1 needs DFlash's layout)
    "medusa": ("medusa", dict(num_heads=5, num_hidden_layers=1, hidden_size=32, vocab_size=V)),
    "mtp": ("mtp", dict(GEO, num_hidden_layers=1, num_nextn_predict_layers=1)),
}




@functools.lru_cache(maxsize=None)
def target(scale: float = 1.0) -> TargetModel:
    cfg = registry.config_from_hf("llama", dict(GEO, num_hidden_layers=2))
    params = registry.init_params("llama", cfg, 0)
    if scale != 1.0:   # a more peaked distribution (sampling tests)
        params = dict(params, lm_head={"kernel": params["lm_head"]["kernel"] * scale})
    return TargetModel(registry.make_model("llama", cfg), params)


def build(method: str, k: int, tgt: TargetModel | None = None, *, max_model_len=MML, **extra):
    """A proposer of ``method`` on ``tgt``: random heads; the draft model IS the target."""
    tgt = tgt or target()
    common = dict(target=tgt.model, target_params=tgt.params, max_model_len=max_model_len,
                  block_size=BS, kernel_backend="xla")
    if method in ("ngram", "ngram_gpu"):
        extra = dict(dict(prompt_lookup_min=1, prompt_lookup_max=3), **extra)
    if method == "suffix":
        extra = dict(dict(suffix_decoding_min_token_prob=0.0), **extra)
    if method == "draft_model":
        extra = dict(model="target-copy", **extra)
    cfg = SpeculativeConfig(method=method, num_speculative_tokens=k, **extra)
    if method in ("ngram", "ngram_gpu", "suffix"):
        return make_proposer(cfg, max_model_len=max_model_len, block_size=BS)
    if method == "extract_hidden_states":
        return make_proposer(cfg, aux_layer_ids=AUX, **common)
    if method == "draft_model":
        return make_proposer(cfg, draft=tgt.model, draft_params=tgt.params, **common)
    kind, hf = HEADS[method]
    dcfg = registry.config_from_hf(kind, hf)
    return make_proposer(cfg, draft=dcfg, draft_params=registry.init_params(kind, dcfg, 1), **common)


# --- workloads ------------------------------------------------------------------------

_rng = np.random.default_rng(7)
REPEAT = [5, 9, 2, 17] * 3
PROMPTS_A = [REPEAT, list(_rng.integers(0, V, 9)), [3, 3], list(_rng.integers(0, V, 14))]
# different lengths; the last runs into max_model_len (14 + 40 > 48)
PARAMS_A = [SamplingParams(max_tokens=m) for m in (12, 5, 20, 40)]
PROMPTS_B = [list(_rng.integers(0, V, n)) for n in (4, 11, 6, 16, 2, 8)] + [[1, 2, 3, 4] * 4]
PARAMS_B = [SamplingParams(max_tokens=m) for m in (9, 3, 25, 14, 30, 7, 18)]


@functools.lru_cache(maxsize=None)
def baseline(which: str):
    """Plain greedy decoding (no proposer) of workload A (all at once) or B (3 running at
    a time, so requests join while others decode; an EOS token ends some early)."""
    if which == "A":
        return generate(target(), None, PROMPTS_A, PARAMS_A, **FIXED)
    return generate(target(), None, PROMPTS_B, PARAMS_B, max_num_seqs=3, eos_token_id=eos_b(), **FIXED)


@functools.lru_cache(maxsize=None)
def eos_b() -> int:
    """A token some requests of workload B emit early (their EOS)."""
    out = generate(target(), None, PROMPTS_B, PARAMS_B, max_num_seqs=3, **FIXED)
    toks = [t for o in out.outputs for t in o.token_ids[1:4]]
    return int(np.bincount(toks).argmax())


def run(proposer, which: str):
    if which == "A":
        return generate(target(), proposer, PROMPTS_A, PARAMS_A, **FIXED)
    return generate(target(), proposer, PROMPTS_B, PARAMS_B, max_num_seqs=3, eos_token_id=eos_b(),
                    **FIXED)


# --- plain decoding is right ----------------------------------------------------------


def naive_greedy(tgt: TargetModel, prompt, max_tokens, max_model_len=MML, eos=None):
    """Whole sequence through the model each token, one dense block, no paging."""
    fwd = _dense_forward(tgt.model)
    seq = list(prompt)
    out = []
    while len(out) < max_tokens and len(seq) < max_model_len:
        n = len(seq)
        md = CommonAttentionMetadata.from_query_lens([n], [n], [[0]], block_size=64,
                                                     num_tokens_pad=64, max_query_len=64)
        ids = np.zeros(64, np.int32)
        ids[:n] = seq
        h = fwd(tgt.params, jnp.asarray(ids), jnp.arange(64, dtype=jnp.int32),
                tgt.model.init_kv_caches(1, 64), md)
        tok = int(np.argmax(np.asarray(tgt.model.compute_logits(tgt.params, h[n - 1 : n]))[0]))
        out.append(tok)
        seq.append(tok)
        if tok == eos:
            break
    return out


@functools.lru_cache(maxsize=None)
def _dense_forward(model):
    return jax.jit(lambda p, ids, pos, kv, md: model.forward(p, ids, pos, kv, md)[0])


@pytest.mark.smoke
def test_plain_greedy_matches_naive_loop():
    base = baseline("A")
    for p, sp, o in zip(PROMPTS_A, PARAMS_A, base.outputs):
        assert o.token_ids == naive_greedy(target(), p, sp.max_tokens)
    assert [o.finish_reason for o in base.outputs] == ["length"] * 4
    assert len(base.outputs[3].token_ids) == MML - len(PROMPTS_A[3])      # max_model_len
    assert [len(o.token_ids) for o in base.outputs[:3]] == [12, 5, 20]
    b = baseline("B")
    stopped = [o for o in b.outputs if o.finish_reason == "stop"]
    eos = eos_b()
    assert stopped and all(o.token_ids[-1] == eos and eos not in o.token_ids[:-1] for o in stopped)
    for p, sp, o in zip(PROMPTS_B, PARAMS_B, b.outputs):
        assert o.token_ids == naive_greedy(target(), p, sp.max_tokens, eos=eos)


# --- lossless, every method -----------------------------------------------------------

CASES = [(m, k) for m in METHODS for k in ((1,) if m == "extract_hidden_states" else (1, 3, 5))]
#: ``-m smoke`` runs every method once (k = 3; extract_hidden_states: k = 1).
SMOKE_CASES = [pytest.param(m, k, marks=pytest.mark.smoke)
               if k == 3 or m == "extract_hidden_states" else (m, k) for m, k in CASES]


@pytest.mark.parametrize("method, k", SMOKE_CASES)
def test_greedy_speculative_equals_plain(method, k):
    prop = build(method, k)
    for which in ("A", "B"):
        out = run(prop, which)
        base = baseline(which)
        assert out.token_ids == base.token_ids, f"{method} k={k} workload {which}"
        assert [o.finish_reason for o in out.outputs] == [o.finish_reason for o in base.outputs]
        s = out.spec_stats
        assert s.num_spec_tokens == k and s.num_accepted_tokens <= s.num_draft_tokens
        assert sum(o.num_accepted_tokens for o in out.outputs) == s.num_accepted_tokens
        # every accepted token saves a step
        assert out.num_steps <= base.num_steps
        if method == "draft_model":          # the draft is the target: everything accepted
            assert s.num_draft_tokens > 0 and s.num_accepted_tokens == s.num_draft_tokens
            assert s.num_accepted_tokens_per_pos[0] == s.num_drafts
        if method in ("ngram", "ngram_gpu", "suffix") and which == "A":
            assert s.num_accepted_tokens > 0   # repetitive text: drafts get accepted


@pytest.mark.skipif("eagle3" not in METHODS, reason="needs the EAGLE-3 proposer")
def test_non_padded_drafter_batch_is_lossless():
    """vLLM's non-padded mode: the host drops rejected tokens (prepare_inputs), then drafts
    from the kept tokens' aux hidden states."""
    prop = build("eagle3", 3, disable_padded_drafter_batch=True)
    assert prop.feed.drafts_in == "split"
    for which in ("A", "B"):
        assert run(prop, which).token_ids == baseline(which).token_ids


def test_default_buckets_and_no_recompile_inside_a_bucket():
    """Power-of-two buckets: the batch shrinks as requests finish; a second run whose batch
    compositions stay inside the same buckets compiles nothing new."""
    prop = build("ngram", 2)
    kw = dict(max_model_len=MML, block_size=BS, options=LoopOptions(context_buckets=(MML // BS,)))
    first = generate(target(), prop, PROMPTS_A, PARAMS_A, **kw)
    assert first.token_ids == baseline("A").token_ids
    before = step_cache_size()
    again = generate(target(), prop, PROMPTS_A[::-1], PARAMS_A[::-1], **kw)
    assert again.token_ids == baseline("A").token_ids[::-1]
    assert step_cache_size() == before


def test_engine_warmup_then_no_compile():
    eng = Engine(target(), build("ngram", 3), max_num_seqs=4, **FIXED)
    eng.warmup([4], [16])
    before = step_cache_size()
    out = eng.generate(PROMPTS_A, PARAMS_A)
    assert out.token_ids == baseline("A").token_ids
    assert step_cache_size() == before
    # the engine is reusable: blocks and rows came back
    assert len(eng.scheduler.free_blocks) == eng.num_blocks - 1
    assert len(eng.scheduler.free_rows) == 4


def test_one_token_steps_do_not_copy_the_kv_cache():
    """The e2e anomaly (plain step at B=1 slower than a speculative one): a one-token step
    wrote each layer's KV cache with a one-row scatter, which XLA turns into a
    dynamic-update-slice and then copied every donated K and V cache around. The cache
    write (specjax.kernels.paged_attention.scatter_slots) now keeps one-row writes in place: no cache
    copy in any step, target or draft (EAGLE's one-token chain steps), padded or not. (The
    engine no longer pads one-token steps by default; ``min_tokens_per_step=2`` still
    pads them, for comparison.)"""
    tgt = target()
    n_layers = tgt.model.config.num_hidden_layers
    loop = LoopOptions(batch_buckets=(1,), context_buckets=(MML // BS,))
    pad2 = dataclasses.replace(loop, min_tokens_per_step=2)
    kw = dict(max_model_len=MML, block_size=BS, max_num_seqs=1)
    copies = {}
    for name, prop, opts in (("plain T=1", None, loop), ("plain T=2", None, pad2),
                             ("ngram k=3", build("ngram", 3), loop), ("eagle k=3", build("eagle", 3), loop)):
        eng = Engine(tgt, prop, **kw, options=opts)
        low = eng.diagnostics.lower_decode_step(1, 20)
        # donated: every K and V cache aliases an output, whatever the step
        assert low.as_text().count("tf.aliasing_output") >= 2 * n_layers, name
        hlo = low.compile().as_text()
        assert "input_output_alias" in hlo
        t_pad = eng.diagnostics.decode_step_tokens(1, 20)
        copies[name] = (t_pad, eng.diagnostics.kv_cache_copies(hlo))
        assert len(eng.scheduler.free_rows) == 1
        assert len(eng.scheduler.free_blocks) == eng.num_blocks - 1
    assert copies == {"plain T=1": (1, 0), "plain T=2": (2, 0), "ngram k=3": (4, 0),
                      "eagle k=3": (4, 0)}, copies
    # padding changes nothing but the shapes: same tokens, one request at a time
    a = generate(tgt, None, PROMPTS_A, PARAMS_A, **kw, options=loop)
    b = generate(tgt, None, PROMPTS_A, PARAMS_A, **kw, options=pad2)
    assert a.token_ids == b.token_ids == baseline("A").token_ids
    with pytest.raises(ValueError, match="min_tokens_per_step"):
        LoopOptions(min_tokens_per_step=0)


@pytest.mark.gpu
def test_gpu_tree_step_updates_the_caches_in_place(monkeypatch):
    """The tree step's KV compaction (``specjax.runtime.tree.compact_tree_kv``: gather the accepted
    nodes' K / V, scatter them into place) compiles on XLA:GPU with no whole-cache copy
    (Llama-3.1-8B widths, 4 layers, bf16, B = 8, a 1k context: 529 blocks). A control shows
    the check can see them: without the optimization barrier between the gather and the
    scatter, XLA:GPU fuses the gather into the scatter, which then cannot run in place, and
    copies every donated K and V cache each step (16 copies here, 128 at 32 layers: the H200
    profile's ~1 ms ``memcpy`` per step at B = 8). At the demo's or 128-token shapes XLA does
    not fuse them, so the test needs these sizes."""
    import sys

    import suite_paths
    from specjax.kernels.paged_attention import kv_cache as kv_cache_mod
    sys.path.insert(0, str(suite_paths.BENCHMARKS))
    from e2e import TARGETS, random_params

    tree = "[(0,), (1,), (0, 0), (1, 0), (0, 0, 0), (1, 0, 0)]"
    mml, bs, batch = 1056, 16, 8
    geo = dict(TARGETS["8b"], num_hidden_layers=4)
    cfg = registry.config_from_hf("llama", geo)
    tgt = TargetModel(registry.make_model("llama", cfg),
                      random_params("llama", cfg, jnp.bfloat16, jax.random.key(0)))
    hcfg = registry.config_from_hf("eagle3", dict(
        geo, num_hidden_layers=1, target_hidden_size=4096, draft_vocab_size=32000, has_d2t=True,
        eagle_aux_hidden_state_layer_ids=[1, 2, 3]))
    hparams = random_params("eagle3", hcfg, jnp.bfloat16, jax.random.key(1))

    def copies():
        jax.clear_caches()
        spec = SpeculativeConfig(method="eagle3", num_speculative_tokens=6,
                                 speculative_token_tree=tree)
        prop = make_proposer(spec, draft=hcfg, draft_params=hparams, target=tgt.model,
                             target_params=tgt.params, max_model_len=mml, block_size=bs)
        eng = Engine(tgt, prop, max_model_len=mml, block_size=bs, max_num_seqs=batch,
                     kv_dtype=jnp.bfloat16, options=LoopOptions(batch_buckets=(batch,),
                                                                context_buckets=(mml // bs,)))
        assert eng.tree is not None
        diag = eng.diagnostics
        return diag.kv_cache_copies(diag.lower_decode_step(batch, 1000).compile().as_text())

    fixed = copies()
    monkeypatch.setattr(kv_cache_mod, "optimization_barrier", lambda x: x)
    unfixed = copies()
    monkeypatch.undo()
    jax.clear_caches()
    assert (fixed, unfixed) == (0, 4 * geo["num_hidden_layers"]), (fixed, unfixed)


def test_one_row_cache_write_is_in_place():
    """Without the dropped second row, XLA's one-row scatter copies the cache: the check
    above can see copies (a control), and the write's values are unchanged by the fix."""
    from specjax.kernels.paged_attention import scatter_slots

    cache = jnp.zeros((8, 4, 2, 8))
    vals = jnp.ones((1, 2, 8))
    f = jax.jit(scatter_slots, donate_argnums=0)
    out = f(cache, vals, jnp.array([5], jnp.int32))
    assert float(out.reshape(32, 2, 8)[5].sum()) == 16 and float(out.sum()) == 16
    out = f(out, vals, jnp.array([-1], jnp.int32))          # slot -1: dropped
    assert float(out.sum()) == 16
    hlo = jax.jit(scatter_slots, donate_argnums=0).lower(cache, vals, jnp.array([5], jnp.int32)) \
        .compile().as_text()
    assert "dynamic-update-slice" not in hlo


def test_time_decode_step_ngram_gpu_uploads_contexts_once():
    """The benchmark times the n-gram GPU adapter in its steady state: contexts go up in
    the untimed first call, each timed call sends one new token per request."""
    prop = build("ngram_gpu", 3)
    eng = Engine(target(), prop, max_model_len=MML, block_size=BS, max_num_seqs=2,
                 options=LoopOptions(batch_buckets=(2,), context_buckets=(MML // BS,)))
    t = eng.diagnostics.time_decode_step(2, 30, iters=5)
    assert t["step_s"] > 0 and t["host_propose_s"] > 0
    assert prop.num_context_uploads == 2
    assert not prop._slots                     # finished: the rows are free again


def test_small_block_pool_admits_requests_as_blocks_free():
    # 12 blocks of 8: two requests at a time at most (each may need 6); the rest wait
    prop = build("ngram", 3)
    out = generate(target(), prop, PROMPTS_A, PARAMS_A, **dict(FIXED, num_blocks=13))
    assert out.token_ids == baseline("A").token_ids


def test_metrics_reach_stat_loggers():
    seen, lines = [], []
    log = SpecDecodingLogging()
    out = generate(target(), build("ngram", 3), PROMPTS_A, PARAMS_A,
                   stat_loggers=[seen.append, log.observe], **FIXED)
    assert len(seen) == out.num_steps
    assert sum(s.num_accepted_tokens for s in seen) == out.spec_stats.num_accepted_tokens
    log.log(lambda fmt, *a: lines.append(fmt % a))
    assert lines and "Mean acceptance length" in lines[0]
    assert out.mean_acceptance_length == pytest.approx(
        1 + out.spec_stats.num_accepted_tokens / out.spec_stats.num_drafts)


def test_synthetic_acceptance_mode():
    """vLLM's benchmarking mode: drafts accepted at configured rates, whatever they are."""
    prop = build("ngram", 3, rejection_sample_method="synthetic",
                 synthetic_acceptance_rates=(1.0, 1.0, 1.0))
    s = generate(target(), prop, PROMPTS_A, PARAMS_A, **FIXED).spec_stats
    assert s.num_draft_tokens > 0 and s.num_accepted_tokens == s.num_draft_tokens
    prop = build("ngram", 3, rejection_sample_method="synthetic",
                 synthetic_acceptance_rates=(0.0, 0.0, 0.0))
    s = generate(target(), prop, PROMPTS_A, PARAMS_A, **FIXED).spec_stats
    assert s.num_draft_tokens > 0 and s.num_accepted_tokens == 0
    # synthetic_acceptance_length runs too (issue 26: it passed validation and the engine then
    # refused it): length 2.0 with k = 3 is vLLM's least-variance schedule [1, 0, 0]
    prop = build("ngram", 3, rejection_sample_method="synthetic", synthetic_acceptance_length=2.0)
    assert prop.config.synthetic_rates == (1.0, 0.0, 0.0)
    s = generate(target(), prop, PROMPTS_A, PARAMS_A, **FIXED).spec_stats
    assert s.num_drafts > 0 and s.num_accepted_tokens == s.num_drafts      # exactly one each
    assert s.num_accepted_tokens_per_pos[1:] == [0, 0]


class _FixedDraft(Proposer):
    """A custom host proposer through the same interface: always drafts the same tokens."""

    def __init__(self, k, tokens):
        self.config = SpeculativeConfig(method="ngram", num_speculative_tokens=k)
        self._feed = Feed(drafts_in="history", num_speculative_tokens=k, lookahead=k + 1)
        self.tokens = tokens
        self.calls = 0

    @property
    def feed(self):
        return self._feed

    def propose_from_history(self, h: TokenHistory) -> DraftOutput:
        self.calls += 1
        assert h.token_ids.shape[1] == MML and len(h.req_ids) == len(h.num_tokens)
        for b, n in enumerate(h.num_tokens):     # histories hold prompt + output so far
            assert n >= h.num_prompt_tokens[b] + len(h.sampled_token_ids[b])
        return DraftOutput.from_lists([self.tokens] * len(h.req_ids), self.config.num_speculative_tokens)


def test_custom_proposer_plugs_in():
    prop = _FixedDraft(3, [1, 2, 3])
    out = generate(target(), prop, PROMPTS_A, PARAMS_A, **FIXED)
    assert out.token_ids == baseline("A").token_ids and prop.calls > 0
    # out-of-vocabulary draft tokens end the draft instead of reaching the target
    prop = _FixedDraft(3, [1, V + 5, 3])
    out = generate(target(), prop, PROMPTS_A, PARAMS_A, **FIXED)
    assert out.token_ids == baseline("A").token_ids
    assert out.spec_stats.num_draft_tokens == out.spec_stats.num_drafts   # one token each


# --- random sampling ------------------------------------------------------------------

N_SAMPLES = 1000
SAMPLE_PROMPT = [7, 1, 30, 12, 7, 1]


def _target_probs(tgt, contexts):
    """Softmax (temperature 1) of the next token after each context (equal lengths), by a
    dense forward independent of the engine."""
    n, length = len(contexts), len(contexts[0])
    blocks = np.arange(1, n + 1).reshape(n, 1)
    md = CommonAttentionMetadata.from_query_lens([length] * n, [length] * n, blocks, block_size=16)
    ids = jnp.asarray(np.concatenate(contexts), jnp.int32)
    pos = jnp.asarray(np.tile(np.arange(length), n), jnp.int32)
    h = jax.jit(lambda p, i, q, kv, m: tgt.model.forward(p, i, q, kv, m)[0])(
        tgt.params, ids, pos, tgt.model.init_kv_caches(n + 1, 16), md)
    last = h[np.arange(1, n + 1) * length - 1]
    return np.asarray(jax.nn.softmax(tgt.model.compute_logits(tgt.params, last), -1), np.float64)


def _chi2_first_verified(result, tgt):
    """Token 1 of each request (the first one that went through verification) against
    ``sum_r p(. | prompt, token 0 of r)``; bins with expected count < 5 are merged."""
    t0 = np.array([o.token_ids[0] for o in result.outputs])
    t1 = np.array([o.token_ids[1] for o in result.outputs])
    uniq = np.unique(t0)
    probs = _target_probs(tgt, [SAMPLE_PROMPT + [int(t)] for t in uniq])
    expected = probs[np.searchsorted(uniq, t0)].sum(0)
    observed = np.bincount(t1, minlength=V).astype(np.float64)
    big = expected >= 5
    obs = np.append(observed[big], observed[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    return stats.chisquare(obs, exp * (obs.sum() / exp.sum())).pvalue   # float rounding


def _sample_run(prop):
    tgt = target(4.0)
    # max_tokens=3: the token after the prefill's is verified against one draft
    sps = [SamplingParams(max_tokens=3, temperature=1.0, seed=i) for i in range(N_SAMPLES)]
    return generate(tgt, prop, [SAMPLE_PROMPT] * N_SAMPLES, sps, max_model_len=16, block_size=BS,
                    options=LoopOptions(query_buckets=(8,), context_buckets=(2,)))


@pytest.mark.parametrize("method", [m for m in ("draft_model", "eagle") if m in METHODS])
def test_random_sampling_matches_target_distribution(method):
    """Chi-square at alpha = 1e-3: the draft model (= the target, drafting its argmax)
    agrees with the target; a random EAGLE head does not. Either way the emitted token is
    distributed as the target's."""
    tgt = target(4.0)
    prop = build(method, 2, tgt, max_model_len=16)
    out = _sample_run(prop)
    s = out.spec_stats
    rate = s.num_accepted_tokens_per_pos[0] / s.num_drafts
    if method == "draft_model":
        assert rate > 0.2          # the greedy draft is the mode of a peaked distribution
    else:
        assert rate < 0.2
    assert _chi2_first_verified(out, tgt) > 1e-3


def test_seeded_requests_reproducible_whatever_the_batch():
    tgt = target(4.0)
    prop = build("ngram", 3, tgt, max_model_len=16)
    sp = SamplingParams(max_tokens=6, temperature=0.8, seed=123)
    kw = dict(max_model_len=16, block_size=BS, num_blocks=9, options=LoopOptions(
        batch_buckets=(4,), query_buckets=(8,), context_buckets=(2,)))
    alone = generate(tgt, prop, [SAMPLE_PROMPT], [sp], **kw).token_ids[0]
    others = [SamplingParams(max_tokens=6, temperature=1.0, seed=s) for s in (1, 2, 3)]
    mixed = generate(tgt, prop, [[4, 4, 4], SAMPLE_PROMPT, [9]], [others[0], sp, others[1]], **kw)
    assert mixed.token_ids[1] == alone
    greedy_mix = generate(tgt, prop, [SAMPLE_PROMPT, [3, 2]], [sp, SamplingParams(max_tokens=4)], **kw)
    assert greedy_mix.token_ids[0] == alone


# --- host metadata ------------------------------------------------------------------


def test_numpy_metadata_builders_match_the_library_constructors():
    from specjax.runtime.batch import attn_metadata_np, spec_metadata_np
    from specjax.metadata import SpecDecodeMetadata

    rng = np.random.default_rng(3)
    for n, b, k in [(3, 4, 3), (1, 1, 1), (4, 8, 5), (0, 2, 2), (2, 2, 0)]:
        drafts = [list(rng.integers(0, V, rng.integers(0, k + 1))) for _ in range(n)]
        q = np.array([len(d) + int(rng.integers(1, 4)) for d in drafts], np.int64)
        s = q + rng.integers(0, 20, n)
        c = 8
        table = np.zeros((b, c), np.int32)
        table[:n] = rng.permutation(64)[: n * c].reshape(n, c)
        t_pad = b * 8
        want = CommonAttentionMetadata.from_query_lens(q, s, table[:n], block_size=4, num_reqs_pad=b,
                                                       num_tokens_pad=t_pad, max_query_len=8)
        got = attn_metadata_np(q, s, table, block_size=4, num_tokens_pad=t_pad, max_query_len=8)
        for f in ("query_start_loc", "seq_lens", "block_table", "slot_mapping", "num_reqs",
                  "num_actual_tokens", "max_seq_len"):
            np.testing.assert_array_equal(getattr(got, f), getattr(want, f), err_msg=f)
        assert (got.max_query_len, got.causal) == (want.max_query_len, want.causal)
        want = SpecDecodeMetadata.from_draft_lists(drafts, np.cumsum(q), max_spec_len=k,
                                                   num_reqs_pad=b, num_drafts_pad=b * k)
        got = spec_metadata_np(drafts, q, num_reqs_pad=b, max_spec_len=k)
        for f in ("draft_token_ids", "num_draft_tokens", "cu_num_draft_tokens",
                  "cu_num_sampled_tokens", "target_logits_indices", "bonus_logits_indices",
                  "logits_indices", "num_reqs"):
            np.testing.assert_array_equal(getattr(got, f), getattr(want, f), err_msg=f)
        assert got.max_spec_len == want.max_spec_len


# --- bad input ------------------------------------------------------------------------


def test_bad_input_raises_before_generation():
    tgt = target()
    prop = build("ngram", 2)
    with pytest.raises(ValueError, match="non-empty"):
        generate(tgt, prop, [], **FIXED)
    with pytest.raises(ValueError, match="non-empty"):
        generate(tgt, prop, [[1, 2], []], **FIXED)
    with pytest.raises(ValueError, match="outside the target's vocabulary"):
        generate(tgt, prop, [[1, V]], **FIXED)
    with pytest.raises(ValueError, match="outside the target's vocabulary"):
        generate(tgt, prop, [[-1, 2]], **FIXED)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1.0)
    with pytest.raises(ValueError, match="max_model_len"):
        generate(tgt, prop, [[1] * MML], **FIXED)
    with pytest.raises(ValueError, match="one per|entries"):
        generate(tgt, prop, [[1], [2]], [SamplingParams()], **FIXED)
    with pytest.raises(ValueError, match="max_model_len"):      # proposer built for another length
        generate(tgt, prop, [[1]], **dict(fixed(context_buckets=None), max_model_len=32))
    if "draft_model" in METHODS:
        other = registry.config_from_hf("llama", dict(GEO, vocab_size=V + 8, num_hidden_layers=1))
        with pytest.raises(ValueError, match="vocab"):
            make_proposer(SpeculativeConfig(method="draft_model", model="d", num_speculative_tokens=2),
                          target=tgt.model, draft=other, draft_params=registry.init_params("llama", other),
                          max_model_len=MML, block_size=BS)
        # built without the target, caught by the loop before generation
        p = make_proposer(SpeculativeConfig(method="draft_model", model="d", num_speculative_tokens=2),
                          draft=other, draft_params=registry.init_params("llama", other),
                          max_model_len=MML, block_size=BS)
        with pytest.raises(ValueError, match="vocabulary"):
            generate(tgt, p, [[1]], **FIXED)


def test_mtp_k_against_the_checkpoints_modules(caplog):
    """vLLM's MTP rules on k against ``num_nextn_predict_layers`` (n): k > n must be a
    multiple of n (the error names both), k < n is allowed, k > 1 logs vLLM's warning."""
    tgt = target()
    dcfg = registry.config_from_hf("mtp", dict(GEO, num_hidden_layers=1, num_nextn_predict_layers=2))
    dparams = registry.init_params("mtp", dcfg, 1)

    def make(k):
        return make_proposer(SpeculativeConfig(method="mtp", num_speculative_tokens=k),
                             target=tgt.model, target_params=tgt.params, draft=dcfg,
                             draft_params=dparams, max_model_len=MML, block_size=BS)

    with pytest.raises(ValueError, match=r"num_speculative_tokens:3 must be divisible by n_predict=2"):
        make(3)
    caplog.clear()
    with caplog.at_level("WARNING"):
        make(1)
    assert "same MTP layer" not in caplog.text
    with caplog.at_level("WARNING"):
        assert make(4).feed.num_speculative_tokens == 4
    assert "same MTP layer" in caplog.text


def test_make_proposer_declarations_and_errors():
    for m in METHODS:
        p = build(m, 1)
        f = p.feed
        assert p.method == m and f.num_speculative_tokens == 1
        assert (f.drafts_in == "history") == (m in ("ngram", "ngram_gpu", "suffix"))
        assert f.aux_layer_ids == (AUX if m in ("eagle3", "dflash", "dspark",
                                                "extract_hidden_states") else ())
        assert f.hidden_states == (m in ("eagle", "eagle3", "medusa", "mtp"))
        assert f.lookahead == 1 + p.max_new_slots + 1
        assert (f.token_tree is not None) == (m in ("eagle", "eagle3"))
    if "eagle" in METHODS:
        p = build("eagle", 2)
        assert p.feed.hidden_states and not p.feed.aux_layer_ids and p.params is not None
        with pytest.raises(ValueError, match="draft"):
            make_proposer(SpeculativeConfig(method="eagle", num_speculative_tokens=2),
                          max_model_len=MML)
    with pytest.raises(ValueError, match="max_model_len"):
        make_proposer(SpeculativeConfig(method="ngram", num_speculative_tokens=2))
    with pytest.raises(TypeError, match="SpeculativeConfig"):
        make_proposer("ngram", max_model_len=MML)
    # a dict is a vLLM speculative_config (SpeculativeConfig.from_vllm)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        make_proposer({"method": "ngram"}, max_model_len=MML)
    assert specjax.make_proposer is make_proposer and specjax.generate is generate


def test_missing_method_module_is_not_implemented(monkeypatch):
    import specjax.proposers as P

    def missing():
        import specjax.proposers.no_such_module  # noqa: F401

    monkeypatch.setitem(P._MODEL_METHODS, "medusa", P.factory.ModelBuilder(missing, False))
    with pytest.raises(NotImplementedError, match="medusa"):
        make_proposer(SpeculativeConfig(method="medusa", num_speculative_tokens=2), max_model_len=MML)


@pytest.mark.skipif("draft_model" not in METHODS, reason="needs the draft-model proposer")
def test_draft_model_parallel_drafting_through_options():
    """Options reach the method's proposer class: parallel drafting with a mask token (the
    target itself drafts all k tokens in one pass; still lossless)."""
    tgt = target()
    cfg = SpeculativeConfig(method="draft_model", model="d", num_speculative_tokens=3,
                            parallel_drafting=True)
    prop = make_proposer(cfg, target=tgt.model, target_params=tgt.params, draft=tgt.model,
                         draft_params=tgt.params, max_model_len=MML, block_size=BS,
                         kernel_backend="xla", parallel_drafting_token_id=V - 1)
    assert prop.max_new_slots == 3      # k - 1 parallel slots + 1 for the draft model
    assert run(prop, "A").token_ids == baseline("A").token_ids
    with pytest.raises(ValueError, match="no option"):
        make_proposer(cfg, target=tgt.model, draft=tgt.model, draft_params=tgt.params,
                      max_model_len=MML, block_size=BS, not_a_field=1)

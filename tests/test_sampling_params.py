"""Every sampling parameter through ``generate`` / ``Engine``, lossless under speculation.

With each logits-processing feature on (penalties, min_p, logit_bias, bad_words,
allowed_token_ids, min_tokens, a user processor, and all of them at once), greedy
speculative decoding emits exactly the tokens of plain greedy decoding with the same
processors: n-gram and EAGLE-3 at k = 3 (and 1, 5), and a proposer that drafts the true
continuation (so drafts are accepted and every processor runs with real drafts in its
context), on the per-step path and in the device-resident loop. Plus: a processor that
changes the argmax changes greedy verification; mixed batches; refusals by name; the
plain program is unchanged when no feature is used.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from specjax.config import SpeculativeConfig
from specjax.engine import Engine, LoopOptions, SamplingParams, generate
from specjax.sampling.logits_processors import ProcessorLimits
from specjax.proposers import DraftOutput, Feed, Proposer, TokenHistory

try:
    from test_engine import (BS, FIXED, METHODS, MML, PROMPTS_A, SAMPLE_PROMPT, V,  # noqa: F401
                             _target_probs, build, fixed, target)
except ImportError:  # tests/ made a package
    from tests.test_engine import (BS, FIXED, METHODS, MML, PROMPTS_A, SAMPLE_PROMPT, V,  # noqa: F401
                                   _target_probs, build, fixed, target)

EOS = 19


def allowed_mask(logits, params, context):
    """A user processor: only tokens < params[0] (an allowed-set mask), and never the token
    just emitted (reads the context, drafts included)."""
    tok, n, _ = context
    v = logits.shape[-1]
    ids = jnp.arange(v)[None, :]
    last = jnp.take_along_axis(tok, jnp.maximum(n - 1, 0)[:, None], axis=1)
    ok = (ids < params[:, :1]) & (ids != last)
    return jnp.where(ok, logits, -jnp.inf)


PROCESSORS = (allowed_mask,)

FEATURES = {
    "penalties": dict(presence_penalty=1.0, frequency_penalty=0.5, repetition_penalty=1.4),
    "min_p": dict(min_p=0.3),
    "logit_bias": dict(logit_bias={5: 4.0, 33: -6.0, 50: 2.5}),
    "bad_words": dict(bad_words=[[33, 31], [2, 60], [54]]),
    "allowed_token_ids": dict(allowed_token_ids=list(range(0, 64, 2))),
    "min_tokens": dict(min_tokens=5),
    "processor": dict(logits_processor=0, logits_processor_params=(40.0,)),
    "all": dict(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2, min_p=0.1,
                logit_bias={5: 3.0}, bad_words=[[33, 31]], allowed_token_ids=list(range(48)),
                min_tokens=5, logits_processor=0, logits_processor_params=(44.0,)),
}
MAXTOK = (12, 6, 14, 10)


def params(feature, mixed=False):
    f = FEATURES[feature]
    sps = [SamplingParams(max_tokens=m, **f) for m in MAXTOK]
    if mixed:    # another feature on one request, nothing on another
        sps[1] = SamplingParams(max_tokens=MAXTOK[1], **FEATURES["logit_bias"])
        sps[2] = SamplingParams(max_tokens=MAXTOK[2])
    return sps


def run(proposer, feature, n=1, mixed=False, **kw):
    return generate(target(), proposer, PROMPTS_A, params(feature, mixed), eos_token_id=EOS,
                    logits_processors=PROCESSORS, **dict(fixed(steps_per_sync=n), **kw))


_plain_cache: dict = {}


def plain(feature, mixed=False):
    key = (feature, mixed)
    if key not in _plain_cache:
        _plain_cache[key] = run(None, feature, mixed=mixed)
    return _plain_cache[key]


class _TrueDrafts(Proposer):
    """A host proposer that drafts the expected continuation (looked up by prompt),
    corrupting its last draft every other call: drafts get accepted AND rejected, so every
    verified position runs the processors with real drafts in its context."""

    def __init__(self, k, expected):
        self.config = SpeculativeConfig(method="ngram", num_speculative_tokens=k)
        self._feed = Feed(drafts_in="history", num_speculative_tokens=k, lookahead=k + 1)
        self.expected = {tuple(p): list(p) + list(o) for p, o in expected}
        self.calls = 0

    @property
    def feed(self):
        return self._feed

    def propose_from_history(self, h: TokenHistory) -> DraftOutput:
        self.calls += 1
        k = self.config.num_speculative_tokens
        lists = []
        for b, n in enumerate(h.num_tokens):
            seq = self.expected[tuple(int(t) for t in h.token_ids[b, : h.num_prompt_tokens[b]])]
            d = seq[int(n): int(n) + k]
            if d and self.calls % 2:
                d[-1] = (d[-1] + 1) % V
            lists.append(d)
        return DraftOutput.from_lists(lists, k)


def _true_drafts(feature, k, mixed=False):
    base = plain(feature, mixed)
    return _TrueDrafts(k, [(p, o.token_ids) for p, o in zip(PROMPTS_A, base.outputs)])


def _same(out, base, what):
    assert out.token_ids == base.token_ids, what
    assert [o.finish_reason for o in out.outputs] == [o.finish_reason for o in base.outputs], what


@pytest.mark.smoke
def test_each_feature_changes_plain_greedy_output():
    """The workload is sensitive to every feature (otherwise the comparisons below prove
    nothing), and the processed outputs obey their constraints."""
    none = generate(target(), None, PROMPTS_A, [SamplingParams(max_tokens=m) for m in MAXTOK],
                    eos_token_id=EOS, **fixed(steps_per_sync=1))
    for f in FEATURES:
        if f == "min_p":    # argmax-invariant (vLLM's MinP): greedy unchanged
            assert plain(f).token_ids == none.token_ids
        else:
            assert plain(f).token_ids != none.token_ids, f
    for o in plain("allowed_token_ids").outputs:
        assert all(t % 2 == 0 for t in o.token_ids)
    for o in plain("processor").outputs:
        assert all(t < 40 for t in o.token_ids)
        assert all(a != b for a, b in zip(o.token_ids, o.token_ids[1:]))
    for o in plain("bad_words").outputs:
        assert 54 not in o.token_ids
        assert all((a, b) not in ((33, 31), (2, 60)) for a, b in zip(o.token_ids, o.token_ids[1:]))
    for o in plain("min_tokens").outputs:
        assert EOS not in o.token_ids[:5]
    assert any(EOS in o.token_ids for o in none.outputs)     # EOS would have come earlier


@pytest.mark.smoke
@pytest.mark.parametrize("feature", list(FEATURES))
def test_greedy_true_drafts_equal_plain(feature):
    """Accepted drafts: position j's context holds drafts[:j] (else the emitted tokens or
    the acceptance differ)."""
    for k in (1, 3):
        prop = _true_drafts(feature, k)
        out = run(prop, feature)
        _same(out, plain(feature), f"{feature} k={k}")
        s = out.spec_stats
        assert s.num_accepted_tokens > 0 and s.num_accepted_tokens < s.num_draft_tokens


@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("method", ["ngram", "eagle3"])
def test_greedy_speculative_equals_plain_k3(method, feature):
    if method not in METHODS:
        pytest.skip(f"{method} unavailable")
    out = run(build(method, 3), feature)
    _same(out, plain(feature), f"{method} {feature}")


@pytest.mark.parametrize("k", [1, 5])
@pytest.mark.parametrize("method", ["ngram", "eagle3"])
def test_greedy_speculative_equals_plain_k1_k5(method, k):
    if method not in METHODS:
        pytest.skip(f"{method} unavailable")
    for feature in ("all", "bad_words", "penalties"):
        _same(run(build(method, k), feature), plain(feature), f"{method} k={k} {feature}")


def test_mixed_batch_and_device_loop_match_per_step():
    """Features mixed across requests (one plain), per-step vs the device-resident loop, for
    plain decoding, EAGLE-3 and the true-draft proposer's per-step path."""
    base = plain("all", mixed=True)
    _same(run(None, "all", n=4, mixed=True), base, "plain device loop")
    if "eagle3" in METHODS:
        prop = build("eagle3", 3)
        _same(run(prop, "all", n=1, mixed=True), base, "eagle3 per-step")
        _same(run(prop, "all", n=4, mixed=True), base, "eagle3 device loop")
    _same(run(_true_drafts("all", 3, mixed=True), "all", mixed=True), base, "true drafts")


@pytest.mark.parametrize("feature", ["penalties", "bad_words", "min_tokens", "processor"])
def test_device_loop_equals_per_step(feature):
    base = plain(feature)
    _same(run(None, feature, n=8), base, f"plain loop {feature}")
    if "eagle3" in METHODS:
        _same(run(build("eagle3", 3), feature, n=8), base, f"eagle3 loop {feature}")


@pytest.mark.slow
@pytest.mark.parametrize("method", [m for m in ("eagle", "dflash", "medusa", "draft_model",
                                                "ngram_gpu", "suffix") if m in METHODS])
def test_greedy_speculative_equals_plain_other_methods(method):
    _same(run(build(method, 3), "all"), plain("all"), method)


# --- seeded random sampling: the device loop and the per-step path --------------------


def test_seeded_sampling_with_processors_same_in_loop_and_per_step():
    sps = [SamplingParams(max_tokens=10, temperature=0.8, seed=i, **FEATURES["all"])
           for i in range(4)]
    kw = dict(eos_token_id=EOS, logits_processors=PROCESSORS)
    a = generate(target(), None, PROMPTS_A, sps, **kw, **fixed(steps_per_sync=1))
    b = generate(target(), None, PROMPTS_A, sps, **kw, **fixed(steps_per_sync=4))
    assert a.token_ids == b.token_ids
    if "eagle3" in METHODS:
        prop = build("eagle3", 3)
        c = generate(target(), prop, PROMPTS_A, sps, **kw, **fixed(steps_per_sync=1))
        d = generate(target(), prop, PROMPTS_A, sps, **kw, **fixed(steps_per_sync=4))
        assert c.token_ids == d.token_ids


# --- random sampling end to end: chi-square against the processed target ----------------

N = 1500


def test_random_sampling_with_processors_matches_processed_target():
    """The token after the prefill's, sampled through verification with a draft (the
    draft model drafts the target's raw argmax, which the penalties move), is distributed
    as the processed target given the first token; power: not as the raw target."""
    from test_logits_processors import oracle_finish, oracle_processors

    tgt = target(2.0)
    f = dict(presence_penalty=1.5, frequency_penalty=0.5, repetition_penalty=2.0,
             logit_bias={7: 4.0, 12: 3.0}, bad_words=[[1, 30]], min_p=0.02)
    sps = [SamplingParams(max_tokens=3, temperature=1.0, seed=i, **f) for i in range(N)]
    prop = build("draft_model", 2, tgt, max_model_len=16) if "draft_model" in METHODS else None
    loop = LoopOptions(steps_per_sync=1, query_buckets=(8,), context_buckets=(2,))
    out = generate(tgt, prop, [SAMPLE_PROMPT] * N, sps, max_model_len=16, block_size=BS,
                   options=loop)
    if prop is not None:
        assert out.spec_stats.num_accepted_tokens > 0
    t0 = np.array([o.token_ids[0] for o in out.outputs])
    t1 = np.array([o.token_ids[1] for o in out.outputs])
    from specjax.sampling.logits_processors import RequestProcessing
    rp = RequestProcessing(**{k: v for k, v in f.items()})
    uniq = np.unique(t0)
    lg = _target_logits(tgt, [SAMPLE_PROMPT + [int(t)] for t in uniq])
    raw = np.stack([_softmax(x) for x in lg])
    proc = np.stack([_softmax(oracle_finish(oracle_processors(x, SAMPLE_PROMPT, [int(t)], rp),
                                            1.0, 0, 1.0, rp.min_p)) for x, t in zip(lg, uniq)])
    idx = np.searchsorted(uniq, t0)
    assert _chi2(t1, proc[idx].sum(0)) > 1e-3
    # power: the raw target is rejected (test_logits_processors' chi-square checks the
    # drafts' place in the context)
    assert _chi2(t1, raw[idx].sum(0)) < 1e-5


def _target_logits(tgt, contexts):
    """The target's raw next-token logits after each context (equal lengths), by a dense
    forward independent of the engine (the penalties are not shift-invariant)."""
    from specjax.attention_metadata import CommonAttentionMetadata

    n, length = len(contexts), len(contexts[0])
    blocks = np.arange(1, n + 1).reshape(n, 1)
    md = CommonAttentionMetadata.from_query_lens([length] * n, [length] * n, blocks, block_size=16)
    ids = jnp.asarray(np.concatenate(contexts), jnp.int32)
    pos = jnp.asarray(np.tile(np.arange(length), n), jnp.int32)
    h = jax.jit(lambda p, i, q, kv, m: tgt.model.forward(p, i, q, kv, m)[0])(
        tgt.params, ids, pos, tgt.model.init_kv_caches(n + 1, 16), md)
    last = h[np.arange(1, n + 1) * length - 1]
    return np.asarray(tgt.model.compute_logits(tgt.params, last), np.float64)


def _softmax(x):
    e = np.exp(x - x[np.isfinite(x)].max())
    return e / e.sum()


def _chi2(samples, expected):
    obs = np.bincount(samples, minlength=len(expected)).astype(np.float64)
    big = expected >= 5
    o = np.append(obs[big], obs[~big].sum())
    e = np.append(expected[big], expected[~big].sum())
    keep = e > 0
    return stats.chisquare(o[keep], e[keep] * o[keep].sum() / e[keep].sum()).pvalue


# --- API ----------------------------------------------------------------------------------


@pytest.mark.smoke
@pytest.mark.parametrize("kw, match", [
    (dict(n=2), "n=2"), (dict(best_of=3), "best_of"), (dict(prompt_logprobs=1), "prompt_logprobs"),
    (dict(structured_outputs={"json": {}}), "structured_outputs"), (dict(stop=["\n"]), "stop"),
    (dict(presence_penalty=3.0), "presence_penalty"), (dict(frequency_penalty="x"), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"), (dict(min_p=1.5), "min_p"),
    (dict(logit_bias=[1, 2]), "logit_bias"), (dict(logit_bias={1: 200.0}), "logit_bias"),
    (dict(bad_words=["bad"]), "bad_words"), (dict(bad_words=[[]]), "bad_words"),
    (dict(allowed_token_ids=[]), "allowed_token_ids"), (dict(min_tokens=-1), "min_tokens"),
    (dict(min_tokens=20, max_tokens=5), "min_tokens"), (dict(logits_processor=-2), "logits_processor"),
    (dict(logits_processor_params="ab"), "logits_processor_params"),
])
def test_sampling_params_refused_by_name(kw, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kw)


@pytest.mark.smoke
def test_engine_refuses_requests_beyond_its_limits_before_work():
    lim = ProcessorLimits(max_logit_bias=2, max_bad_words=1, max_bad_word_len=2,
                          max_allowed_token_ids=3, max_stop_ids=1, num_processor_params=1)
    eng = Engine(target(), None, logits_processors=PROCESSORS, max_num_seqs=4,
                 **fixed(processor_limits=lim))
    bad = [(dict(logit_bias={1: 1.0, 2: 1.0, 3: 1.0}), "max_logit_bias"),
           (dict(logit_bias={V: 1.0}), "vocabulary"),
           (dict(bad_words=[[1], [2]]), "max_bad_words"), (dict(bad_words=[[1, 2, 3]]), "max_bad_word_len"),
           (dict(bad_words=[[V]]), r"bad_words\[0\]"),
           (dict(allowed_token_ids=[1, 2, 3, 4]), "max_allowed_token_ids"),
           (dict(allowed_token_ids=[V + 1]), "allowed_token_ids"),
           (dict(min_tokens=2, stop_token_ids=[3]), "max_stop_ids"),
           (dict(logits_processor=1), "logits_processor=1"),
           (dict(logits_processor=0, logits_processor_params=(1.0, 2.0)), "num_processor_params")]
    for kw, match in bad:
        with pytest.raises(ValueError, match=match):
            eng.generate([[1, 2]], SamplingParams(max_tokens=3, **kw), eos_token_id=5)
    assert eng.num_syncs == 0
    with pytest.raises(ValueError, match="logits_processors"):
        Engine(target(), None, logits_processors=(1,), max_num_seqs=4, **FIXED)
    with pytest.raises(ValueError, match="processor_limits"):
        LoopOptions(processor_limits=(1, 2))


@pytest.mark.smoke
def test_plain_program_unchanged_without_features():
    """No feature used: the batch carries no processor state and the step's lowered program
    is the one of a step built without processors (the plain variant)."""
    from specjax.runtime.step import make_step

    eng = Engine(target(), None, logits_processors=PROCESSORS, max_num_seqs=4, **FIXED)
    eng2 = None
    from specjax.engine.scheduler import _Request
    r = _Request(index=0, req_id="x", prompt=[1, 2, 3], params=SamplingParams(), seed=0,
                 stop_ids=frozenset(), proc=SamplingParams().processing())
    r.row, r.sched = 0, 3
    eng.scheduler.tok_buf[0, :3] = [1, 2, 3]
    assert eng.scheduler.grow(r, 3)
    batch, _, _ = eng.scheduler.build_batch([r])
    assert batch.procs is None
    args = (eng.target.params, None, eng.target_kv, eng.draft_state, batch)
    a = eng.step.lower(*args).as_text()
    b = make_step(target().model, None).lower(*args).as_text()
    assert a == b
    del eng2


# --- tree verification --------------------------------------------------------------------


def _tree_stub(feature, children):
    """test_engine_tree's stub tree proposer, knowing the processed greedy continuations:
    each tree verification accepts some levels and rejects the rest."""
    try:
        from test_engine_tree import TreeStub, full_tree
    except ImportError:
        from tests.test_engine_tree import TreeStub, full_tree
    from specjax.proposers import ModelProposer
    from specjax.token_tree import TokenTree

    rows = [(list(p) + o + [-1] * MML)[:MML] for p, o in zip(PROMPTS_A, plain(feature).token_ids)]
    tree = TokenTree.from_choices(full_tree(children))
    cfg = SpeculativeConfig(method="eagle", num_speculative_tokens=tree.num_nodes,
                            speculative_token_tree=str(list(tree.choices)))

    class Stub(ModelProposer):
        def init_state(self, num_blocks, dtype=None):
            return self.impl.init_state(num_blocks)

    return Stub(cfg, TreeStub(tree, V), jnp.asarray(np.array(rows, np.int32)), vocab_size=V)


@pytest.mark.parametrize("children", [(3, 2, 1), (2, 1, 1, 1, 1, 1)])
@pytest.mark.parametrize("feature", ["all", "bad_words", "penalties", "processor"])
def test_tree_verification_with_processors_equals_plain(feature, children):
    """Tree slot ``1 + j`` sees node j's path as output: per-step and in the device loop."""
    prop = _tree_stub(feature, children)
    for n in (1, 4):
        out = run(prop, feature, n=n, max_num_seqs=4)
        _same(out, plain(feature), f"tree {children} {feature} N={n}")
        assert out.spec_stats.num_accepted_tokens > 0


def test_warmup_compiles_the_processing_variant_then_no_compile():
    from specjax.runtime.decode_loop import loop_cache_size
    from specjax.runtime.step import step_cache_size

    eng = Engine(target(), None, logits_processors=PROCESSORS, max_num_seqs=4,
                 **fixed(steps_per_sync=4))
    eng.warmup([4], [16], all_greedy=(True, False), stop_pads=(1,), logits_processing=(False, True))
    before = step_cache_size() + loop_cache_size()
    sps = params("all", mixed=True)
    sps[3] = SamplingParams(max_tokens=4, temperature=0.7, seed=1, **FEATURES["penalties"])
    eng.generate(PROMPTS_A, sps, eos_token_id=EOS)
    eng.generate(PROMPTS_A, [SamplingParams(max_tokens=4)] * 4)
    assert step_cache_size() + loop_cache_size() == before


def test_docs_sampling_example_runs():
    """docs/sampling.md's user processor, run as written (on a small engine), does what its
    comment says."""
    import pathlib
    import re

    doc = (pathlib.Path(__file__).parent.parent / "docs" / "sampling.md").read_text()
    code = re.search(r"```python\n(import jax.numpy as jnp\n.*?)```", doc, re.S).group(1)
    import specjax

    def small_generate(tgt, prop, prompts, sp, **kw):
        return specjax.generate(tgt, prop, prompts, SamplingParams(
            max_tokens=8, logits_processor=sp.logits_processor,
            logits_processor_params=(30.0,)), max_num_seqs=4, **dict(FIXED, **kw))

    ns = {"target": target(), "proposer": build("ngram", 3), "prompts": PROMPTS_A}
    code = code.replace("specjax.generate(", "small_generate(")
    exec(compile(code, "docs/sampling.md", "exec"), dict(ns, small_generate=small_generate))
    out = small_generate(target(), build("ngram", 3), PROMPTS_A,
                         SamplingParams(logits_processor=0),
                         logits_processors=(ns_fn := _doc_fn(code),))
    for o in out.outputs:
        assert all(t < 30 for t in o.token_ids)
        assert all(a != b for a, b in zip(o.token_ids, o.token_ids[1:]))
    assert callable(ns_fn)


def _doc_fn(code):
    g: dict = {}
    exec(compile(code.split("\nout = ")[0], "docs/sampling.md", "exec"), g)
    return g["allowed_below"]

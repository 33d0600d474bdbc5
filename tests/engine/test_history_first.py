"""``history_first`` (issue 56, "n-gram first"): a history proposer drafts the rows where it
matches, the model chain the others, in one step. Greedy output equals plain decoding; each
row verifies exactly the drafts of the stage that drafted it; sampling keeps the target's
distribution; every combination it cannot serve is refused naming ``history_first``."""

import dataclasses
import types

import numpy as np
import pytest

from specjax import SpeculativeConfig
from specjax.engine import Engine, SamplingParams, generate
from specjax.proposers import make_proposer
from specjax.proposers.history_first import HistoryFirstProposer
from test_engine import (
    BS, FIXED, METHODS, MML, PROMPTS_A, PARAMS_A, _chi2_first_verified, _sample_run,
    baseline, build, fixed, run, target)

NGRAM = dict(history_first="ngram", prompt_lookup_min=2, prompt_lookup_max=3)
SUFFIX = dict(history_first="suffix", suffix_decoding_min_token_prob=0.0)


def _has_arctic() -> bool:
    try:
        import arctic_inference.suffix_decoding  # noqa: F401
    except ImportError:
        return False
    return True


STAGES = [pytest.param(NGRAM, id="ngram"), pytest.param(dict(NGRAM, history_first="ngram_gpu"),
                                                      id="ngram_gpu"),
          pytest.param(SUFFIX, id="suffix", marks=pytest.mark.skipif(
              not _has_arctic(), reason="arctic_inference is not importable"))]


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("method", ("eagle3", "draft_model"))
def test_greedy_output_equals_plain(method, stage):
    prop = build(method, 3, **stage)
    assert isinstance(prop, HistoryFirstProposer)
    assert prop.first_stage.method == stage["history_first"]
    assert prop.feed == build(method, 3).feed           # the fused step is unchanged
    for which in ("A", "B"):
        out, base = run(prop, which), baseline(which)
        assert out.token_ids == base.token_ids, f"{method} + {stage} workload {which}"
        assert [o.finish_reason for o in out.outputs] == [o.finish_reason for o in base.outputs]
    assert prop.first_stage_rows > 0 and prop.model_rows > 0


def test_dspark_behind_an_ngram_stage_equals_plain():
    test_greedy_output_equals_plain("dspark", NGRAM)


def test_rows_verify_the_drafts_of_their_stage():
    """Each alive row's drafts are the n-gram's where it drafted (equal to a standalone
    n-gram proposer on the same history), else the model's; the counters add up."""
    prop = build("eagle3", 3, **NGRAM)
    eng = Engine(target(), prop, max_num_seqs=4, **fixed())
    assert eng.options.steps_per_sync == 1 and not eng.options.overlap
    alone = build("ngram", 3, prompt_lookup_min=2, prompt_lookup_max=3)
    calls, trims = [], []
    redraft, trim = eng.proposer.redraft, eng._trim

    def spy_redraft(hist, drafts):
        got = redraft(hist, drafts)
        calls.append((hist, [list(d) for d in drafts], got))
        return got

    def spy_trim(r, drafts, n):
        trims.append(list(drafts))
        return trim(r, drafts, n)

    eng.proposer.redraft, eng._trim = spy_redraft, spy_trim
    c0 = (prop.first_stage_rows, prop.model_rows)
    out = eng.generate(PROMPTS_A, PARAMS_A)
    assert out.token_ids == baseline("A").token_ids
    chosen, n_first, n_model = [], 0, 0
    for hist, model, got in calls:
        ref = alone.propose_from_history(hist).to_lists()
        for m, r, g in zip(model, ref, got):
            assert g == (r if r else m)
            n_first += bool(r)
            n_model += not r
        chosen += got
    assert trims == chosen                # what the engine trims and verifies next
    assert n_first > 0 and n_model > 0
    assert (prop.first_stage_rows - c0[0], prop.model_rows - c0[1]) == (n_first, n_model)
    c = prop.counts
    assert c.first_stage_rows == prop.first_stage_rows and c.first_stage_tokens >= n_first


TWO = "[(0,), (1,), (0, 0), (1, 0), (0, 0, 0), (1, 0, 0)]"     # two chains of depth 3


@pytest.mark.parametrize("method", ("eagle", "eagle3"))
def test_tree_branch_takes_the_first_stage_chain(method):
    """With a two-branch tree the n-gram chain replaces the second branch's nodes where it
    matches and starts unlike the model's chain (a like first token would be unreachable
    behind branch 0), first stage k = the depth; greedy output equals plain decoding."""
    prop = build(method, 6, speculative_token_tree=TWO, **NGRAM)
    assert prop.branch == (1, 3, 5) and prop.first_stage.num_speculative_tokens == 3
    eng = Engine(target(), prop, max_num_seqs=4, **fixed())
    alone = build("ngram", 3, prompt_lookup_min=2, prompt_lookup_max=3)
    calls, redraft = [], eng.proposer.redraft

    def spy(hist, drafts):
        got = redraft(hist, drafts)
        calls.append((alone.propose_from_history(hist).to_lists(), drafts, got))
        return got

    eng.proposer.redraft = spy
    for prompts, params, which in ((PROMPTS_A, PARAMS_A, "A"),):
        assert eng.generate(prompts, params).token_ids == baseline(which).token_ids
    placed = 0
    for ref, model, got in calls:
        for r, m, g in zip(ref, model, got):
            want = list(m)
            if r and r[0] != m[0]:
                for node, t in zip((1, 3, 5), r):
                    want[node] = t
                placed += 1
            assert len(m) == 6 and g == want
    assert placed > 0 and prop.first_stage_rows == placed


def test_tree_redraft_rules():
    """Row by row: a chain placed on the branch's nodes as far as it goes; a chain whose first
    token is the model's first draft (unreachable behind branch 0) or no chain: the model's."""
    prop = build("eagle3", 6, speculative_token_tree=TWO, **NGRAM)
    prop.first_stage = types.SimpleNamespace(propose_from_history=lambda h: types.SimpleNamespace(
        token_ids=np.array([[7, 8, 9], [1, 2, 0], [4, 4, 4]]), num_drafts=np.array([3, 2, 0])))
    model = [[7, 10, 11, 12, 13, 14], [9, 10, 11, 12, 13, 14], [9, 10, 11, 12, 13, 14]]
    assert prop.redraft(None, model) == [model[0], [9, 1, 11, 2, 13, 14], model[2]]
    assert (prop.first_stage_rows, prop.model_rows) == (1, 2)


def test_finish_requests_reach_the_first_stage():
    prop = build("eagle3", 2, **NGRAM)
    seen = []
    prop.first_stage.finish_requests = lambda ids, docs=None: seen.append((list(ids), docs))
    out = generate(target(), prop, PROMPTS_A[:2], PARAMS_A[:2], **FIXED)
    finished = {r for ids, docs in seen if docs for r in ids}       # as each one finished
    assert len(finished) == 2 and len(seen[-1][0]) == 2              # then all, at the end
    for ids, docs in seen[:-1]:
        for r in ids:
            i = sorted(finished).index(r)                    # ids in prompt order
            assert docs[r] == (len(PROMPTS_A[i]), list(PROMPTS_A[i]) + out.token_ids[i])


@pytest.mark.skipif("draft_model" not in METHODS, reason="draft_model unavailable")
def test_random_sampling_matches_target_distribution():
    tgt = target(4.0)
    prop = build("draft_model", 2, tgt, max_model_len=16, history_first="ngram",
                 prompt_lookup_min=1, prompt_lookup_max=2)
    out = _sample_run(prop)
    assert prop.first_stage_rows > 0 and prop.model_rows > 0
    assert _chi2_first_verified(out, tgt) > 1e-3


def test_from_vllm_dict():
    tgt = target()
    d = {"method": "draft_model", "model": "target-copy", "num_speculative_tokens": 2,
         "history_first": "ngram", "prompt_lookup_max": 4}
    cfg = SpeculativeConfig.from_vllm(d)
    assert (cfg.history_first, cfg.prompt_lookup_min, cfg.prompt_lookup_max) == ("ngram", 4, 4)
    prop = make_proposer(d, target=tgt.model, target_params=tgt.params, draft=tgt.model,
                         draft_params=tgt.params, max_model_len=48, block_size=8)
    assert isinstance(prop, HistoryFirstProposer)
    assert prop.first_stage.impl.min_n == 4
    assert "history_first='ngram'" in repr(prop)


BASE = dict(method="eagle3", model="head", num_speculative_tokens=3)


@pytest.mark.parametrize("kw", [
    dict(history_first="ngramm"), dict(history_first=1), dict(history_first=["ngram"]),
    dict(BASE, method="ngram", model=None, history_first="ngram"),
    dict(BASE, method="extract_hidden_states", model=None, num_speculative_tokens=1,
         history_first="ngram"),
    dict(speculative_token_tree="[(0,), (0, 0), (0, 1)]", num_speculative_tokens=3,
         history_first="ngram"),
    dict(enable_adaptive_verification=True, history_first="suffix"),
    dict(disable_padded_drafter_batch=True, history_first="ngram"),
    dict(history_first="suffix", prompt_lookup_min=3),
    dict(draft_sample_method="probabilistic", history_first="ngram"),
])
def test_refusals_name_history_first(kw):
    with pytest.raises(ValueError, match="history_first"):
        SpeculativeConfig(**dict(BASE, **kw))


def test_chain_tree_and_prompt_lookup_defaults():
    cfg = SpeculativeConfig(**BASE, history_first="ngram_gpu",
                            speculative_token_tree="[(0,), (0, 0), (0, 0, 0)]")
    assert (cfg.prompt_lookup_min, cfg.prompt_lookup_max) == (5, 5)
    cfg = SpeculativeConfig(**dict(BASE, history_first="ngram", prompt_lookup_min=2))
    assert (cfg.prompt_lookup_min, cfg.prompt_lookup_max) == (2, 2)
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        SpeculativeConfig(**BASE, history_first="ngram", prompt_lookup_min=4, prompt_lookup_max=3)


@pytest.mark.parametrize("loop", [dict(steps_per_sync=2), dict(overlap=True)])
def test_device_loop_refused(loop):
    with pytest.raises(ValueError, match="history_first='ngram'"):
        Engine(target(), build("eagle3", 2, **NGRAM), max_num_seqs=4, **fixed(**loop))


@pytest.mark.parametrize("stage", [pytest.param(dict(NGRAM, history_first="ngram_gpu"),
                                                id="ngram_gpu"),
                                   pytest.param(dict(history_first="suffix",
                                                     suffix_backend="device"), id="suffix")])
def test_device_loop_merges_a_device_first_stage(stage):
    """With a device first stage the device loop merges the chains itself (the history's
    where it drafts, the model's elsewhere): greedy output equals plain, and each request
    drafts and accepts, and each stage is counted, exactly as on the per-step path; steps
    whose rows all draft from the history run a one-token model chain (which keeps the
    model's KV: the later model rows draft as on the per-step path)."""
    got = {}
    for n in (4, 1):
        prop = build("eagle3", 3, **stage)
        assert prop.loop_drafter is not None
        eng = Engine(target(), prop, max_num_seqs=4, **fixed(steps_per_sync=n))
        assert eng.options.steps_per_sync == n
        out = eng.generate(PROMPTS_A, PARAMS_A)
        assert out.token_ids == baseline("A").token_ids
        got[n] = ([(o.num_draft_tokens, o.num_accepted_tokens) for o in out.outputs],
                  dataclasses.astuple(prop.counts))
    assert got[4][0] == got[1][0]
    assert got[4][1][:4] == got[1][1][:4]    # the loop's counters too (LoopOutput.stage_counts)
    assert sum(a for _, a in got[4][0]) > 0 and got[4][1][0] > 0     # first-stage rows
    assert got[4][1][4] > 0 and got[1][1][4] == 0                   # short chains: loop only


@dataclasses.dataclass(frozen=True)
class _OracleEveryThird:
    """A device first stage drafting each request's next ``k`` plain-greedy tokens
    (``seqs``: prompt + output per request, found by its first two tokens) in steps where
    the live rows' lengths sum to a multiple of 3."""

    seqs: tuple
    tag: bool          # the two runs' stages differ: each compiles its own loop
    k: int = 3

    def search(self, token_ids, num_tokens, valid):
        import jax.numpy as jnp
        width = max(map(len, self.seqs)) + self.k
        seqs = jnp.asarray([list(q) + [-1] * (width - len(q)) for q in self.seqs], jnp.int32)
        req = jnp.argmax(jnp.all(token_ids[:, None, :2] == seqs[None, :, :2], axis=-1), axis=1)
        cols = jnp.minimum(num_tokens[:, None] + jnp.arange(self.k), width - 1)
        drafts = seqs[req[:, None], cols]
        on = valid & (jnp.sum(jnp.where(valid, num_tokens, 0)) % 3 == 0) & (drafts[:, -1] >= 0)
        return types.SimpleNamespace(token_ids=jnp.where(on[:, None], drafts, -1),
                                     num_drafts=jnp.where(on, self.k, 0))


def _noisy_draft_model(stage: dict):
    """A draft model: the target with noise on its weights (accepts some drafts, not all)."""
    import jax
    tgt = target()
    keys = iter(jax.random.split(jax.random.key(3), 64))
    noisy = jax.tree.map(lambda w: w + 0.3 * w.std() * jax.random.normal(next(keys), w.shape,
                                                                          w.dtype), tgt.params)
    cfg = SpeculativeConfig(method="draft_model", model="target-copy", num_speculative_tokens=3,
                            **stage)
    return make_proposer(cfg, draft=tgt.model, draft_params=noisy, target=tgt.model,
                         target_params=tgt.params, max_model_len=MML, block_size=BS,
                         kernel_backend="xla")


def test_device_loop_short_chain_keeps_the_drafter_level(monkeypatch):
    """Steps drafted wholly by the first stage run a one-token model chain: the model rows
    after them draft and accept exactly as with the full chain every step (a noisy draft
    model: its chain's KV of wrong drafts differs from its first pass's of the right ones)."""
    import importlib
    decode_loop = importlib.import_module("specjax.runtime.decode_loop")
    seqs = tuple(tuple(p + o) for p, o in zip(PROMPTS_A, baseline("A").token_ids))
    got = {}
    for short in (True, False):
        oracle = _OracleEveryThird(seqs, short)
        monkeypatch.setattr(HistoryFirstProposer, "loop_drafter", property(lambda _: oracle))
        if not short:
            monkeypatch.setattr(decode_loop, "drafting", lambda spec, n: spec)
        stage = dict(NGRAM, history_first="ngram_gpu")
        prop = _noisy_draft_model(stage)
        eng = Engine(target(), prop, max_num_seqs=4, **fixed(steps_per_sync=4))
        out = eng.generate(PROMPTS_A, PARAMS_A)
        assert out.token_ids == baseline("A").token_ids
        got[short] = ([(o.num_draft_tokens, o.num_accepted_tokens) for o in out.outputs],
                      dataclasses.astuple(prop.counts))
    assert got[True][0] == got[False][0] and got[True][1][:4] == got[False][1][:4]
    assert got[True][1][4] > 0 and got[False][1][4] == 0 and got[True][1][1] > 0
    assert sum(a for _, a in got[True][0]) > 0


@pytest.mark.parametrize("backend, flags, want", [
    ("cpu", "", True), ("gpu", "", False),
    ("gpu", "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CONDITIONAL", False),
    ("gpu", "--xla_foo=1 --xla_gpu_enable_command_buffer=FUSION,CONDITIONAL,WHILE", True),
    ("gpu", "--xla_gpu_enable_command_buffer=+while,+conditional", True)])
def test_short_chain_only_where_conditionals_stay_on_the_device(backend, flags, want,
                                                                monkeypatch):
    import importlib
    decode_loop = importlib.import_module("specjax.runtime.decode_loop")
    monkeypatch.setattr(decode_loop.jax, "default_backend", lambda: backend)
    monkeypatch.setenv("XLA_FLAGS", flags)
    assert decode_loop.conditionals_on_device() is want

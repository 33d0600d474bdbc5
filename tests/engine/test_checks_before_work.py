"""Checks before work: ``Step``, ``VerifyStep``, ``decode_loop``, ``build_batch`` and
``make_loop_state`` refuse each mistake by name, with its fix, before anything runs (no
compile: ``step_cache_size`` / ``loop_cache_size`` unchanged on a bucket never compiled;
the caches passed in not donated). And unseeded sampling: a sampled row without a seed draws
a fresh one, so two identical unseeded prompts at temperature 1 differ (through
``build_batch`` + ``Step`` and through ``generate``) while seeded ones stay equal."""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.engine import SamplingParams, generate
from specjax.models import registry
from specjax.runtime.batch import build_batch
from specjax.runtime.decode_loop import decode_loop, loop_cache_size, make_loop_state
from specjax.runtime.step import make_step, step_cache_size
from specjax.runtime.verify import make_verify_step

from foreign_target import ForeignGPT, init_params
from test_engine import BS, FIXED, GEO, MML, V, build, target

NB = 1 + 4 * (MML // BS)          # the KV pool: blocks 1 .. NB - 1
PROMPT = [3, 9, 4, 7]


def _batch(tokens=([1, 2, 3, 4], [5, 6]), **kw):
    """A two-request prefill batch in a bucket no other test compiles (3 rows, 5 tokens)."""
    args = dict(num_computed=[0] * len(tokens), num_drafts=[0] * len(tokens),
                block_ids=[[1 + i] for i in range(len(tokens))], block_size=BS, num_reqs_pad=3,
                query_len_pad=5, blocks_per_req_pad=2, max_spec_len=0)
    args.update(kw)
    return build_batch([list(t) for t in tokens], **args)


def _state(**kw):
    args = dict(last_token=[1], num_computed=[3], drafts=[[]], max_tokens=[4], num_output=[1],
                block_ids=[[1]], k=0, num_reqs_pad=3, blocks_per_req_pad=2, query_len_pad=2,
                max_model_len=MML, block_size=BS)
    args.update(kw)
    return make_loop_state(**args)


@contextlib.contextmanager
def nothing_runs(*caches):
    """No step or loop compiled, and no leaf of ``caches`` donated, inside the block."""
    before = step_cache_size(), loop_cache_size()
    yield
    assert (step_cache_size(), loop_cache_size()) == before
    assert not any(x.is_deleted() for c in caches for x in jax.tree.leaves(c))


def _donated():
    """A device array donated to an earlier call."""
    x = jnp.zeros(4)
    jax.jit(lambda a: a + 1, donate_argnums=0)(x)
    assert x.is_deleted()
    return x


# --- reused donated caches ----------------------------------------------------------------


def test_reused_donated_caches_are_named():
    tgt = target()
    step = make_step(tgt.model, build("eagle3", 3))
    kv, st = step.init_caches(NB, BS)
    _, kv2, st2 = step(tgt.params, step.draft_params, kv, st, _batch(max_spec_len=3,
                                                                      num_reqs_pad=2))
    fresh = _batch(max_spec_len=3)
    with nothing_runs(kv2, st2):
        with pytest.raises(ValueError, match="target_kv was donated to an earlier step: pass "
                                             "the target_kv that step returned"):
            step(tgt.params, step.draft_params, kv, st2, fresh)
        with pytest.raises(ValueError, match="draft_state was donated to an earlier step"):
            step(tgt.params, step.draft_params, kv2, st, fresh)
    vs = make_verify_step(None, vocab_size=V)
    b = _batch()
    logits = jnp.zeros((int(np.shape(vs.logits_indices(b))[0]), V))
    with pytest.raises(ValueError, match="kv was donated to an earlier step: pass the kv"):
        vs(None, None, b, logits, kv=_donated())
    with pytest.raises(ValueError, match="draft_state was donated"):
        vs(None, _donated(), b, logits)


def test_decode_loop_refuses_donated_caches_and_state():
    tgt = target()
    step = make_step(tgt.model, None)
    kv, ds = step.init_caches(NB, BS)
    _, kv2, ds2, st2 = decode_loop(step, tgt.params, None, kv, ds, _state(), steps_per_sync=2)
    _, kv3, ds3, st3 = decode_loop(step, tgt.params, None, kv2, ds2, st2, steps_per_sync=2)
    with nothing_runs(kv3, st3):
        with pytest.raises(ValueError, match="target_kv was donated to an earlier step"):
            decode_loop(step, tgt.params, None, kv2, ds3, st3, steps_per_sync=3)
        with pytest.raises(ValueError, match="state was donated to an earlier step: pass the "
                                             "state that step returned"):
            decode_loop(step, tgt.params, None, kv3, ds3, st2, steps_per_sync=3)


# --- draft and target params --------------------------------------------------------------


def test_draft_params_missing_or_mismatched():
    tgt = target()
    step = make_step(tgt.model, build("eagle3", 3))
    kv, st = step.init_caches(NB, BS)
    b = _batch(max_spec_len=3)
    dp = step.draft_params
    first = jax.tree_util.tree_flatten_with_path(dp)[0][0][0]
    top = first[0].key
    missing = {k: v for k, v in dp.items() if k != top}
    leaves, treedef = jax.tree.flatten(dp)
    reshaped = jax.tree.unflatten(treedef, [jnp.zeros(leaves[0].shape + (1,))] + leaves[1:])
    with nothing_runs(kv, st):
        with pytest.raises(ValueError, match=r"draft_params is None .*pass step.draft_params"):
            step(tgt.params, None, kv, st, b)
        with pytest.raises(ValueError, match=rf"draft_params do not match .*missing .*{top}.*"
                                             r"pass step.draft_params"):
            step(tgt.params, missing, kv, st, b)
        with pytest.raises(ValueError, match=r"draft_params do not match .*has shape"):
            step(tgt.params, reshaped, kv, st, b)
    vs = make_verify_step(build("eagle3", 3), vocab_size=V)
    with pytest.raises(ValueError, match=r"draft_params is None .*pass step.draft_params"):
        vs(None, st, b, jnp.zeros((int(np.shape(vs.logits_indices(b))[0]), V)))
    loop_st = _state(k=3, drafts=[[]], query_len_pad=4)
    with nothing_runs(kv, st):
        with pytest.raises(ValueError, match=r"draft_params is None"):
            decode_loop(step, tgt.params, None, kv, st, loop_st, steps_per_sync=2)


def test_target_params_missing_or_of_another_config():
    tgt = target()
    step = make_step(tgt.model, None)
    kv, st = step.init_caches(NB, BS)
    other = registry.init_params("llama", registry.config_from_hf(
        "llama", dict(GEO, num_hidden_layers=1)), 0)
    b = _batch()
    with nothing_runs(kv):
        with pytest.raises(ValueError, match=r"target_params is None: pass the target's params"):
            step(None, None, kv, st, b)
        with pytest.raises(ValueError, match=r"target_params do not match the llama config.*"
                                             r"step.place_target_params"):
            step(other, None, kv, st, b)
        with pytest.raises(ValueError, match=r"target_params is None"):
            decode_loop(step, None, None, kv, st, _state(), steps_per_sync=2)
    # the placed (fused) params and the plain ones both pass
    _, kv, st = step(step.place_target_params(tgt.params), None, kv, st, _batch(num_reqs_pad=2))
    step(tgt.params, None, kv, st, _batch(num_reqs_pad=2))


def test_foreign_target_only_none_params_refused_and_its_pool_known():
    """A foreign target's params are opaque (only None refused); its pool size comes from
    ``init_caches``."""
    step = make_step(ForeignGPT(block_size=BS), None)
    kv, st = step.init_caches(9, BS)
    with nothing_runs(kv):
        with pytest.raises(ValueError, match="target_params is None"):
            step(None, None, kv, st, _batch())
        with pytest.raises(ValueError, match=r"block_table holds block id 9, past the KV pool "
                                             r"of num_blocks=9"):
            step(init_params(0), None, kv, st, _batch(block_ids=[[1], [9]]))
    step(init_params(0), None, kv, st, _batch(block_ids=[[1], [8]]))


# --- block tables -------------------------------------------------------------------------


@pytest.mark.parametrize("make", ["build_batch", "make_loop_state"])
def test_block_ids_null_negative_and_past_the_pool(make):
    def call(block_ids, **kw):
        if make == "build_batch":
            return _batch(block_ids=block_ids, **kw)
        return _state(last_token=[1, 2], num_computed=[3, 3], drafts=[[], []], max_tokens=[4, 4],
                      num_output=[1, 1], block_ids=block_ids, **kw)

    with pytest.raises(ValueError, match=r"block_ids\[0\]\[0\] = 0: block 0 is the null block"):
        call([[0], [2]])
    with pytest.raises(ValueError, match=r"block_ids\[1\]\[1\] = -3: block ids are >= 1"):
        call([[1], [2, -3]])
    with pytest.raises(ValueError, match=r"block_ids\[1\]\[0\] = 5 is past the KV pool "
                                         r"\(num_blocks=5\): hand out ids in 1..4"):
        call([[1], [5]], num_blocks=5)
    with pytest.raises(ValueError, match="num_blocks"):
        call([[1], [2]], num_blocks=1)
    call([[1], [4]], num_blocks=5)


def test_step_and_loop_refuse_a_block_id_past_the_pool():
    tgt = target()
    step = make_step(tgt.model, None)
    kv, st = step.init_caches(NB, BS)
    with nothing_runs(kv):
        with pytest.raises(ValueError, match=rf"batch.attn.block_table holds block id {NB}, "
                                             rf"past the KV pool of num_blocks={NB}"):
            step(tgt.params, None, kv, st, _batch(block_ids=[[1], [NB]]))
        with pytest.raises(ValueError, match=rf"state.block_table holds block id {NB + 3}"):
            decode_loop(step, tgt.params, None, kv, st, _state(block_ids=[[NB + 3]]),
                        steps_per_sync=2)


# --- token ids and seeds --------------------------------------------------------------------


def test_token_ids_outside_the_vocabulary():
    with pytest.raises(ValueError, match=r"token_ids\[1\]\[0\] = -5: token ids are >= 0"):
        _batch(tokens=([1, 2, 3, 4], [-5, 6]))
    with pytest.raises(ValueError, match=rf"token_ids\[0\]\[2\] = {V}: token ids are in "
                                         rf"\[0, vocab_size={V}\)"):
        _batch(tokens=([1, 2, V, 4], [5, 6]), vocab_size=V)
    _batch(tokens=([1, 2, V - 1, 4], [5, 6]), vocab_size=V)
    tgt = target()
    step = make_step(tgt.model, None)
    kv, st = step.init_caches(NB, BS)
    bad = _batch(tokens=([1, 2, V, 4], [5, 6]))           # built without vocab_size
    with nothing_runs(kv):
        with pytest.raises(ValueError, match=rf"batch.input_ids\[2\] = {V} is outside the "
                                             rf"vocabulary \[0, {V}\)"):
            step(tgt.params, None, kv, st, bad)
        vs = make_verify_step(None, vocab_size=V)
        with pytest.raises(ValueError, match=r"batch.input_ids\[2\]"):
            vs(None, None, bad, jnp.zeros((int(np.shape(bad.sdm.logits_indices)[0]), V)))
        with pytest.raises(ValueError, match=rf"state.last_token\[0\] = {V} is outside"):
            decode_loop(step, tgt.params, None, kv, st, _state(last_token=[V]), steps_per_sync=2)


@pytest.mark.parametrize("make", ["build_batch", "make_loop_state"])
def test_seeds_outside_uint32_are_named(make):
    def call(seeds):
        if make == "build_batch":
            return _batch(seeds=seeds, temperature=[1.0, 1.0])
        return _state(last_token=[1, 2], num_computed=[3, 3], drafts=[[], []], max_tokens=[4, 4],
                      num_output=[1, 1], block_ids=[[1], [2]], seeds=seeds,
                      temperature=[1.0, 1.0])

    for seeds, shown in (([1, -1], "-1"), ([1, 2**32], str(2**32)), ([None, -7], "-7")):
        with pytest.raises(ValueError, match=rf"seeds\[1\] = {shown}: a seed is an int in "
                                             rf"\[0, {2**32 - 1}\]"):
            call(seeds)
    with pytest.raises(ValueError, match="seeds must"):
        call([1.5, 2.0])
    out = call([0, 2**32 - 1])
    got = out.seeds if make == "build_batch" else out.sampling.seeds
    assert int(np.asarray(got)[1]) == 2**32 - 1


# --- unseeded sampling ------------------------------------------------------------------------


@pytest.mark.parametrize("make", ["build_batch", "make_loop_state"])
def test_unseeded_sampled_rows_draw_a_fresh_seed_per_call(make):
    def seeds(given):
        if make == "build_batch":
            b = _batch(tokens=([1, 2], [1, 2]), seeds=given, temperature=[1.0, 0.0])
            return np.asarray(b.seeds)
        st = _state(last_token=[1, 2], num_computed=[3, 3], drafts=[[], []], max_tokens=[4, 4],
                    num_output=[1, 1], block_ids=[[1], [2]], seeds=given, temperature=[1.0, 0.0])
        return np.asarray(st.sampling.seeds)

    a, b = seeds(None), seeds(None)
    assert a[0] != b[0]                       # sampled, unseeded: fresh each call
    assert a[1] == b[1] == 0 and a[2] == 0    # greedy and padding rows unaffected
    assert (seeds([7, None]) == [7, 0, 0]).all() and (seeds([7, 9]) == [7, 9, 0]).all()
    c, d = seeds([None, 5]), seeds([None, 5])   # a per-row None: that row fresh, the rest kept
    assert c[0] != d[0] and c[1] == d[1] == 5


def _sample_twice(seeds, steps: int = 8) -> list[list[int]]:
    """Two copies of one prompt sampled at temperature 1 for ``steps`` tokens through
    ``build_batch`` + ``Step`` (plain decoding)."""
    tgt = target()
    step = make_step(tgt.model, None)
    kv, st = step.init_caches(NB, BS)
    seqs, computed = [list(PROMPT), list(PROMPT)], [0, 0]
    for _ in range(steps):
        b = build_batch([s[c:] for s, c in zip(seqs, computed)], num_computed=computed,
                        num_drafts=[0, 0], block_ids=[[1, 2], [3, 4]], block_size=BS,
                        num_reqs_pad=2, query_len_pad=4, blocks_per_req_pad=2, max_spec_len=0,
                        temperature=[1.0, 1.0], seeds=seeds,
                        num_output_tokens=[len(s) - len(PROMPT) for s in seqs],
                        vocab_size=V, num_blocks=NB)
        out, kv, st = step(tgt.params, None, kv, st, b)
        sampled = np.asarray(out.sampled)
        for i in range(2):
            computed[i] = len(seqs[i])
            seqs[i].append(int(sampled[i, 0]))
    return [s[len(PROMPT):] for s in seqs]


def test_identical_unseeded_prompts_differ_through_the_step():
    a, b = _sample_twice(None)
    assert a != b, (a, b)                     # 8 tokens over 64 ids: equal ~never
    a, b = _sample_twice([5, 5])
    assert a == b                             # seeded: reproducible
    assert _sample_twice([5, 5]) == [a, b]


def test_identical_unseeded_prompts_differ_through_generate():
    sp = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    out = generate(target(), None, [PROMPT, PROMPT], sp, **FIXED).token_ids
    assert out[0] != out[1], out
    seeded = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, seed=11)
    out = generate(target(), None, [PROMPT, PROMPT], seeded, **FIXED).token_ids
    assert out[0] == out[1]

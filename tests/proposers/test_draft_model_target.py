"""Drafters on the stack's terms (issue 48): the draft-model proposer over a draft that is any
``specjax.Target`` (tests/support/foreign_target.py's ForeignGPT: its own KV layout and
attention), chain and parallel (PARD) drafting, its KV over the target's block ids, the
drafter's KV bytes per block (and the engine's memory check counting them), and a
``DecoderLM`` draft running a custom attention with specjax's attention contract."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax import LoopOptions, SamplingParams, SpeculativeConfig, TargetModel, make_proposer
from specjax.attention_metadata import CommonAttentionMetadata
from specjax.kernels import paged_attention as attn_lib
from specjax.kernels.paged_attention.reference import paged_attention_xla
from specjax.models import DecoderLM, registry
from specjax.proposers.types import ProposerInputs

from foreign_target import ForeignGPT, full_recompute_greedy, greedy_margin, init_params

BS, MML, N, K = 8, 64, 16, 3
PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [1, 2, 3, 1, 2, 3, 1, 2]]
PARD = 96            # the parallel-drafting (mask) token id: the last of ForeignGPT's 97
LOOPS = {"per_step": LoopOptions(steps_per_sync=1), "device_loop": None}


@functools.lru_cache(maxsize=None)
def target() -> tuple[ForeignGPT, dict]:
    return ForeignGPT(block_size=BS), init_params(0)


@functools.lru_cache(maxsize=None)
def foreign_draft() -> tuple[ForeignGPT, dict]:
    """Another ForeignGPT: one layer, other random weights."""
    return ForeignGPT(block_size=BS, num_layers=1), init_params(7, layers=1)


@functools.lru_cache(maxsize=None)
def llama_draft() -> tuple[object, dict]:
    """A ``DecoderLM`` config and params of the foreign target's vocabulary."""
    cfg = registry.config_from_hf("llama", dict(
        hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
        num_hidden_layers=2, rms_norm_eps=1e-5, vocab_size=ForeignGPT.vocab_size))
    return cfg, registry.init_params("llama", cfg, 3)


@functools.lru_cache(maxsize=None)
def reference() -> list[list[int]]:
    _, params = target()
    refs = [full_recompute_greedy(params, p, N) for p in PROMPTS]
    assert min(greedy_margin(params, p, r) for p, r in zip(PROMPTS, refs)) > 1e-3
    return refs


def spec(parallel: bool = False) -> SpeculativeConfig:
    return SpeculativeConfig(method="draft_model", model="foreign-gpt", num_speculative_tokens=K,
                             parallel_drafting=parallel)


def proposer(draft=None, *, parallel=False, with_target=True, **options):
    tgt, tparams = target()
    model, params = draft or foreign_draft()
    if parallel:
        options.setdefault("parallel_drafting_token_id", PARD)
    extra = dict(target=tgt, target_params=tparams) if with_target else {}
    return make_proposer(spec(parallel), draft=model, draft_params=params, max_model_len=MML,
                         block_size=BS, kernel_backend="xla", **extra, **options)


def generate(prop, options=None, **kw):
    tgt, tparams = target()
    return specjax.generate(TargetModel(tgt, tparams), prop, PROMPTS,
                            SamplingParams(max_tokens=N, ignore_eos=True), max_model_len=MML,
                            block_size=BS, options=options, **kw)


# --- a foreign draft through the engine -------------------------------------------------


@pytest.mark.parametrize("loop", sorted(LOOPS))
def test_a_foreign_draft_decodes_the_full_recompute_greedy_output(loop):
    assert generate(proposer(), LOOPS[loop]).token_ids == reference()


def test_pard_with_a_foreign_draft_decodes_the_full_recompute_greedy_output():
    res = generate(proposer(parallel=True))
    assert res.token_ids == reference()
    assert res.spec_stats.num_draft_tokens > 0


def test_a_draft_identical_to_the_target_accepts_k_at_every_step():
    """Draft = the target (the same object and params), through the step API: after the
    prefill, every verification step accepts all k drafts (k + 1 tokens per step)."""
    tgt, tparams = target()
    prop = proposer((tgt, tparams))
    step = specjax.make_step(tgt, prop)
    n, per_req, steps = len(PROMPTS), MML // BS, 5
    target_kv, draft_state = step.init_caches(1 + n * per_req, BS, params=tparams)
    tp, dp = step.place_target_params(tparams), step.draft_params
    blocks = [list(range(1 + i * per_req, 1 + (i + 1) * per_req)) for i in range(n)]
    tokens, computed, drafts = [list(p) for p in PROMPTS], [0] * n, [[] for _ in range(n)]
    accepted = []
    for _ in range(steps):
        sched = [tokens[i][computed[i]:] + drafts[i] for i in range(n)]
        batch = specjax.build_batch(sched, num_computed=computed,
                                    num_drafts=[len(d) for d in drafts], block_ids=blocks,
                                    block_size=BS, num_reqs_pad=2, query_len_pad=16,
                                    blocks_per_req_pad=per_req, max_spec_len=K)
        out, target_kv, draft_state = step(tp, dp, target_kv, draft_state, batch)
        out = jax.device_get(out)
        accepted.append([int(a) for a in out.num_accepted[:n]])
        for i in range(n):
            new = [int(t) for t in out.sampled[i] if t >= 0]
            computed[i] += len(sched[i]) - (len(drafts[i]) - (len(new) - 1))
            tokens[i] += new
            drafts[i] = out.drafts[i, : out.num_drafts[i]].tolist()
            assert len(drafts[i]) == K
    assert accepted == [[0] * n] + [[K] * n] * (steps - 1)
    assert [toks[len(p): len(p) + N] for p, toks in zip(PROMPTS, tokens)] == reference()


# --- the proposer itself: drafts against the NumPy reference, KV over the block ids --------


def draft_inputs(contexts, nexts, table) -> ProposerInputs:
    """One prefill-and-draft call: request ``i``'s ``contexts[i]`` at positions 0.., its next
    token ``nexts[i]``, its KV blocks ``table[i]`` (two padding rows)."""
    b_pad, t_pad = len(contexts) + 2, 32
    ids = [t for c in contexts for t in c]
    pos = [p for c in contexts for p in range(len(c))]
    lens = [len(c) for c in contexts]
    md = CommonAttentionMetadata.from_query_lens(lens, lens, table, block_size=BS,
                                                 num_reqs_pad=b_pad, num_tokens_pad=t_pad,
                                                 max_query_len=16)
    pad = lambda a, n: jnp.asarray(np.pad(np.asarray(a, np.int32), (0, n - len(a))))  # noqa: E731
    return ProposerInputs(target_token_ids=pad(ids, t_pad), target_positions=pad(pos, t_pad),
                          target_hidden_states=None, aux_hidden_states=None,
                          next_token_ids=pad(nexts, b_pad), token_indices_to_sample=None,
                          num_rejected_tokens=None, attn_metadata=md)


CONTEXTS = ([11, 40, 2, 77, 3, 9, 50, 21, 60, 4, 33], [8, 1, 90, 45, 12])
NEXTS = (17, 64)
TABLE = np.array([[5, 2, 9, 0], [7, 3, 0, 0]], np.int32)   # permuted ids; 0: padding
NUM_BLOCKS = 12


def propose(prop, dtype=jnp.float32):
    state = prop.init_state(NUM_BLOCKS, dtype)
    out, state = prop.impl.propose(prop.params, state, draft_inputs(CONTEXTS, NEXTS, TABLE))
    return np.asarray(out.token_ids), state


@pytest.mark.parametrize("parallel", [False, True], ids=["chain", "pard"])
def test_foreign_draft_drafts_and_kv_match_the_numpy_reference(parallel):
    params = foreign_draft()[1]
    got, state = propose(proposer(parallel=parallel, with_target=False))
    kv = np.asarray(state.kv_caches)             # the draft's own layout [L, 2, slots, nh, hd]
    assert kv.shape[2] == NUM_BLOCKS * BS
    written = set(np.flatnonzero(np.abs(kv).sum(axis=(0, 1, 3, 4))))
    want_slots = set()
    for i, (ctx, nxt) in enumerate(zip(CONTEXTS, NEXTS)):
        seq = list(ctx) + [nxt]
        if parallel:    # one pass over [ctx, next, mask * (k-1)]: the argmax at each new slot
            seq += [PARD] * (K - 1)
            want = [full_recompute_greedy(params, seq[: len(ctx) + 1 + j], 1)[0] for j in range(K)]
            assert greedy_margin(params, seq[: len(ctx) + 1], seq[len(ctx) + 1:] + [0]) > 1e-3
        else:
            want = full_recompute_greedy(params, seq, K)
            assert greedy_margin(params, seq, want) > 1e-3
        assert got[i].tolist() == want, f"request {i}"
        pos = np.arange(len(ctx) + K)           # context, next, and k - 1 drafts or masks
        want_slots |= set((TABLE[i][pos // BS] * BS + pos % BS).tolist())
    assert (got[len(CONTEXTS):] == -1).all()
    # the draft's KV went exactly to the slots the target's block ids name (none in block 0)
    assert written == want_slots


# --- KV bytes per block -----------------------------------------------------------------


def _state_bytes_per_block(prop, dtype) -> int:
    leaves = jax.tree.leaves(prop.init_state(NUM_BLOCKS, dtype))
    total = sum(x.size * x.dtype.itemsize for x in leaves)
    assert total % NUM_BLOCKS == 0
    return total // NUM_BLOCKS


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_kv_bytes_per_block_is_one_block_of_the_drafters_state(dtype):
    foreign = proposer(with_target=False)
    cfg, params = llama_draft()
    llama = proposer((cfg, params), with_target=False)
    for prop in (foreign, llama):
        stated = prop.kv_bytes_per_block(BS, dtype)
        assert stated == _state_bytes_per_block(prop, dtype) > 0
    assert foreign.kv_bytes_per_block(BS, dtype) == foreign_draft()[0].kv_bytes_per_block(BS, dtype)
    # measured from the state's shapes where the impl states nothing (EAGLE-3)
    hcfg = registry.config_from_hf("eagle3", dict(
        hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=4,
        rms_norm_eps=1e-5, vocab_size=97, num_hidden_layers=1, draft_vocab_size=97,
        target_hidden_size=64, eagle_aux_hidden_state_layer_ids=[0, 1]))
    eagle3 = make_proposer(SpeculativeConfig(method="eagle3", num_speculative_tokens=2),
                           target=target()[0], target_params=target()[1], draft=hcfg,
                           draft_params=registry.init_params("eagle3", hcfg, 1),
                           max_model_len=MML, block_size=BS, kernel_backend="xla")
    assert not hasattr(eagle3.impl, "kv_bytes_per_block")
    assert eagle3.kv_bytes_per_block(BS, dtype) == _state_bytes_per_block(eagle3, dtype) > 0
    with pytest.raises(ValueError, match="block_size=4: the proposer was built with block_size=8"):
        eagle3.kv_bytes_per_block(4, dtype)
    ngram = make_proposer({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 2,
                           "prompt_lookup_max": 3}, max_model_len=MML, block_size=BS)
    assert ngram.kv_bytes_per_block(BS, dtype) == 0
    with pytest.raises(ValueError, match="block_size"):
        foreign.kv_bytes_per_block(0, dtype)


def test_the_engines_memory_check_counts_the_drafters_kv(monkeypatch):
    from specjax.engine import checks

    tgt, tparams = target()
    prop = proposer()
    num_blocks = 1 + 8 * (MML // BS)             # the default pool (max_num_seqs=8)
    t_bytes = num_blocks * tgt.kv_bytes_per_block(BS, jnp.float32)
    d_bytes = num_blocks * prop.kv_bytes_per_block(BS, jnp.float32)
    monkeypatch.setattr(checks, "memory_limit_bytes", lambda: (t_bytes + d_bytes // 2, "a test limit"))
    specjax.Engine(TargetModel(tgt, tparams), None, max_model_len=MML, block_size=BS)
    with pytest.raises(ValueError, match="target and drafter KV cache"):
        specjax.Engine(TargetModel(tgt, tparams), prop, max_model_len=MML, block_size=BS)


# --- a custom attention for a DecoderLM draft -------------------------------------------


def reference_attention(q, k, v, cache, md, *, scale):
    """specjax's attention contract from the pure jax.numpy pieces: the KV write, then the
    ``"xla"`` reference."""
    cache = attn_lib.write_kv(cache, k, v, md.slot_mapping)
    return paged_attention_xla(q, cache, md, scale=scale), cache


def wrong_attention(q, k, v, cache, md, *, scale):
    """The contract's shapes, the wrong values: the scores scaled by 1/8 of ``scale``."""
    return reference_attention(q, k, v, cache, md, scale=scale / 8)


def test_a_custom_attention_runs_in_the_draft():
    cfg, params = llama_draft()
    default, _ = propose(proposer((cfg, params), with_target=False))
    custom = proposer((cfg, params), with_target=False, attention=reference_attention)
    assert custom.impl.attention is reference_attention
    assert custom.impl.model.attention is reference_attention
    same, _ = propose(custom)
    wrong, _ = propose(proposer((cfg, params), with_target=False, attention=wrong_attention))
    np.testing.assert_array_equal(same, default)
    assert (wrong[: len(CONTEXTS)] != default[: len(CONTEXTS)]).any()


def test_a_custom_attention_decodes_the_full_recompute_greedy_output():
    """A foreign target verifying a DecoderLM draft that runs the reference attention."""
    res = generate(proposer(llama_draft(), attention=reference_attention))
    assert res.token_ids == reference()


# --- refusals -------------------------------------------------------------------------


def test_a_recurrent_draft_is_refused_by_name():
    model, params = foreign_draft()
    with pytest.raises(ValueError, match="recurrent"):
        proposer((dataclasses.replace(model, recurrent=True), params))


def test_a_draft_missing_a_member_is_refused_by_name():
    model, params = foreign_draft()

    class NoLogits:
        def __getattr__(self, name):
            if name == "compute_logits":
                raise AttributeError(name)
            return getattr(model, name)

    with pytest.raises(ValueError, match="lacks compute_logits"):
        proposer((NoLogits(), params))


def test_bad_attention_arguments_are_refused():
    cfg, params = llama_draft()
    with pytest.raises(ValueError, match="attention must be None .* or a hashable callable"):
        proposer((cfg, params), attention="xla")
    with pytest.raises(ValueError, match="attention= applies to a specjax.models.DecoderLM draft"):
        proposer(attention=reference_attention)
    with pytest.raises(ValueError, match="attention must be None"):
        DecoderLM(cfg, attention=[reference_attention])       # unhashable


def test_a_mesh_with_a_foreign_draft_is_refused():
    from jax.sharding import Mesh

    mesh = Mesh(np.array(jax.devices()[:1]), ("tp",))
    with pytest.raises(ValueError, match="mesh= needs a specjax.models.DecoderLM draft"):
        proposer(mesh=mesh)

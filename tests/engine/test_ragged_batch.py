"""Ragged token batches: ``build_batch(num_tokens_pad=T)`` with ``T`` below ``num_reqs_pad *
query_len_pad`` and not a multiple of ``num_reqs_pad`` gives the same fused steps as the
``B x Q`` padding (plain, n-gram, EAGLE, EAGLE-3 chain / split / tree, draft model, DFlash,
Medusa, extract-hidden-states on the shipped demo models, fp32; two also on the Pallas
attention kernel): the same ``StepOutput`` and KV caches. Plus ``build_batch``'s and
``Bucket``'s checks of the token budget, and a ragged bucket's warm-up."""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import numpy as np
import pytest

import specjax
from specjax import demo_models
from specjax.runtime.batch import build_batch
from specjax.runtime.step import StepBatch
from specjax.runtime.warmup import Bucket, as_bucket, as_buckets, padding_fields
from specjax.token_tree import TokenTree


K, MML, BS = 3, 128, 8
NB = MML // BS                       # blocks per request: the whole context
B, Q = 5, 40                         # rows (4 requests + 1 padding row), per-request bound
TREE = [(0,), (1,), (0, 0), (1, 0), (0, 0, 0), (1, 0, 0)]   # 6 nodes, levels of 2
TEXT = list(b'def gcd(a, b):\n    """Return the greatest common divisor."""\n    while b:\n'
            b'        a, b = b, a % b\n    return a\n\n\ndef lcm(a, b):\n    return a * b // '
            b'gcd(a, b)\n')
PROMPT0 = TEXT[:45]                                    # prefilled in chunks of 8, then 37
PROMPTS = [TEXT[60:70], TEXT[75:87], TEXT[100:109]]    # three requests that then decode
BLOCKS = [list(range(1 + i * NB, 1 + (i + 1) * NB)) for i in range(4)]
METHODS = ["plain", "ngram", "eagle", "eagle3", "eagle3-split", "eagle-tree", "eagle-parallel",
           "draft_model", "draft_model-parallel", "dflash", "medusa", "extract_hidden_states",
           "plain@pallas", "eagle-tree@pallas"]    # @pallas: the attention kernel (interpreted)


class _Target(NamedTuple):
    model: object
    params: dict


@functools.lru_cache(maxsize=None)
def _target() -> _Target:
    from specjax.models import registry

    kind, cfg, params = demo_models.load("target")
    return _Target(registry.make_model(kind, cfg), params)


def _proposer(method: str):
    """The proposer of ``method`` on the demo target (demo drafts where it ships them)."""
    from specjax import make_proposer

    tgt = _target()
    if method == "plain":
        return None
    if method == "ngram":
        return make_proposer({"method": "ngram", "num_speculative_tokens": K,
                              "prompt_lookup_min": 1, "prompt_lookup_max": 3},
                             max_model_len=MML, block_size=BS)
    common = dict(target=tgt.model, target_params=tgt.params, max_model_len=MML, block_size=BS,
                  kernel_backend="xla")
    if method == "extract_hidden_states":
        return make_proposer({"method": method, "num_speculative_tokens": 1},
                             aux_layer_ids=(0, 2), **common)
    name, _, variant = method.partition("-")
    d = {"method": name, "num_speculative_tokens": K, "model": f"demo-{name}"}
    if variant == "tree":
        d.update(num_speculative_tokens=TokenTree.from_choices(TREE).num_nodes,
                 speculative_token_tree=str(TREE))
    if variant == "split":
        d["disable_padded_drafter_batch"] = True
    if variant == "parallel":       # P-EAGLE / PARD: any mask token serves the comparison
        d["parallel_drafting"] = True
        common["parallel_drafting_token_id"] = 0
    return make_proposer(d, draft=demo_models.load(name), **common)      # fp32 params


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def _batch(step, toks, computed, drafts, ragged: bool, *, q=Q, tree=None, discard=None):
    """The step's batch: ``B x q`` token slots, or (``ragged``) the next power of two of
    the scheduled tokens, checked below ``B * q`` and not a multiple of ``B``."""
    t = sum(map(len, toks))
    pad = _pow2(t) if ragged else None
    if ragged:
        assert pad < B * q and pad % B, (pad, B, q)
    return build_batch(toks, num_computed=computed, num_drafts=drafts,
                       block_ids=BLOCKS[: len(toks)], block_size=BS, num_reqs_pad=B,
                       query_len_pad=q, blocks_per_req_pad=NB, max_spec_len=step.k,
                       num_tokens_pad=pad, tree=tree, discard=discard)


def _decode_rows(out, rows, nds, fallback):
    """Per row of ``rows``: its sampled token, then ``nds[i]`` drafts (the step's own
    drafts when it drafted them, else the text's continuation ``fallback[i]``)."""
    toks = []
    for r, nd, alt in zip(rows, nds, fallback):
        acc = int(out.num_accepted[r])
        last = int(out.sampled[r, acc])
        mine = int(out.num_drafts[r]) >= nd
        toks.append([last] + ([int(x) for x in out.drafts[r, :nd]] if mine else list(alt[:nd])))
    return toks


def _run(step, ragged: bool):
    """Three steps from empty caches: (1) a first chunk of 8 prompt tokens (discarded)
    beside three prompts; (2) a 37-token chunk beside three decoding rows with 0, 2 and 3
    drafts (a tree step: none, the engine's chain step); (3) four decoding rows (a tree
    step: a tree batch). Returns ``[(StepOutput, batch)] * 3, target_kv, draft_state``."""
    tgt = _target()
    kv, ds = step.init_caches(1 + 4 * NB, BS, params=tgt.params)
    seen = []

    def run(batch):
        nonlocal kv, ds
        out, kv, ds = step(tgt.params, step.draft_params, kv, ds, batch)
        seen.append((jax.device_get(out), batch))
        return seen[-1][0]

    lens = [len(p) for p in PROMPTS]
    out = run(_batch(step, [PROMPT0[:8]] + PROMPTS, [0] * 4, [0] * 4, ragged,
                     discard=[True, False, False, False]))
    nds = [0, 0, 0] if step.tree is not None else [min(n, step.k) for n in (0, 2, 3)]
    rows = _decode_rows(out, (1, 2, 3), nds, [TEXT[70:], TEXT[87:], TEXT[109:]])
    out = run(_batch(step, [PROMPT0[8:]] + rows, [8] + lens, [0] + nds, ragged))
    computed = [len(PROMPT0)] + [n + 1 + int(out.num_accepted[r]) for r, n in enumerate(lens, 1)]
    fallback = [TEXT[45:], TEXT[71:], TEXT[88:], TEXT[110:]]
    if step.tree is None:
        nds = [min(n, step.k) for n in (3, 1, 0, 2)]
        run(_batch(step, _decode_rows(out, range(4), nds, fallback), computed, nds, ragged))
    else:   # every request one root and a breadth-first prefix of whole levels
        nds = [6, 2, 4, 0]
        run(_batch(step, _decode_rows(out, range(4), nds, fallback), computed, nds, ragged,
                   q=7, tree=step.tree))
    return seen, jax.device_get(kv), jax.device_get(ds)


@pytest.mark.parametrize("method", METHODS)
def test_ragged_steps_equal_the_padded_ones(method):
    from specjax.kernels import default_backend

    method, _, attention = method.partition("@")
    step = specjax.make_step(_target().model, _proposer(method))
    assert (step.tree is not None) == method.endswith("-tree")
    with default_backend(attention or "auto"):
        padded, kv_p, ds_p = _run(step, ragged=False)
        ragged, kv_r, ds_r = _run(step, ragged=True)
    for i, ((op, bp), (orr, br)) in enumerate(zip(padded, ragged)):
        assert np.shape(bp.input_ids)[0] == B * np.asarray(bp.attn.max_query_len)
        assert np.shape(br.input_ids)[0] < np.shape(bp.input_ids)[0]
        assert br.attn.max_query_len == bp.attn.max_query_len
        for f in ("sampled", "drafts", "num_drafts", "num_accepted"):
            np.testing.assert_array_equal(getattr(orr, f), getattr(op, f), err_msg=f"step {i} {f}")
    acc = np.concatenate([o.num_accepted for o, _ in padded])
    nd = np.concatenate([np.asarray(b.sdm.num_draft_tokens) for _, b in padded])
    if method not in ("plain", "ngram", "extract_hidden_states"):   # own drafts: both outcomes
        assert acc.any() and (acc < nd).any(), (acc, nd)
    # the KV caches: equal (float rounding: other matmul shapes), every token's slot written
    written = np.concatenate([np.asarray(b.attn.slot_mapping)[: int(b.attn.num_actual_tokens)]
                              for _, b in ragged])
    for name, got, want in (("target_kv", kv_r, kv_p), ("draft_state", ds_r, ds_p)):
        for path, g, w in zip(jax.tree_util.tree_leaves_with_path(got),
                              jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5, err_msg=f"{name}{path[0]}")
    for leaf in jax.tree.leaves(kv_r):
        flat = np.asarray(leaf).reshape(-1, *np.shape(leaf)[2:])
        assert np.abs(flat[written]).reshape(len(written), -1).max(axis=1).min() > 0


def _prompt_batch(**kw):
    args = dict(num_computed=[0, 5], num_drafts=[0, 2], block_ids=[[1, 2], [3]], block_size=8,
                num_reqs_pad=3, query_len_pad=12, blocks_per_req_pad=2, max_spec_len=2)
    return build_batch([list(range(1, 12)), [7, 8, 9]], **dict(args, **kw))


@pytest.mark.smoke
def test_build_batch_token_budget():
    default = _prompt_batch()
    explicit = _prompt_batch(num_tokens_pad=3 * 12)
    for a, b in zip(jax.tree.leaves(default), jax.tree.leaves(explicit)):
        np.testing.assert_array_equal(a, b)
    b = _prompt_batch(num_tokens_pad=14)              # exactly the 14 scheduled tokens
    for arr in (b.input_ids, b.positions, b.attn.slot_mapping):
        assert np.shape(arr) == (14,)
    np.testing.assert_array_equal(b.input_ids, default.input_ids[:14])
    np.testing.assert_array_equal(b.attn.slot_mapping, default.attn.slot_mapping[:14])
    assert b.attn.max_query_len == 12 and np.shape(b.attn.query_start_loc) == (4,)
    b = _prompt_batch(num_tokens_pad=17)              # padding slots: token 0, slot -1
    np.testing.assert_array_equal(b.input_ids[14:], 0)
    np.testing.assert_array_equal(b.attn.slot_mapping[14:], -1)
    for pad, match in ((13, "num_tokens_pad=13 is below the 14 tokens"),
                       (0, "num_tokens_pad must be an int >= 1"),
                       (2.5, "num_tokens_pad must be an int")):
        with pytest.raises(ValueError, match=match):
            _prompt_batch(num_tokens_pad=pad)
    with pytest.raises(ValueError, match="query_len_pad=10"):   # the per-request bound stays
        _prompt_batch(query_len_pad=10, num_tokens_pad=20)
    e = build_batch([], num_computed=[], num_drafts=[], block_ids=[], block_size=8,
                    num_reqs_pad=2, query_len_pad=4, blocks_per_req_pad=1, max_spec_len=0,
                    num_tokens_pad=3)
    assert np.shape(e.input_ids) == (3,)


@pytest.mark.smoke
def test_bucket_query_len():
    assert Bucket.of(4, 8, 6) == Bucket(4, 32, 6) == as_bucket((4, 32, 6, 8))
    assert Bucket(4, 32, 6).query_len_pad == 8 and not Bucket(4, 32, 6).is_ragged
    rb = as_bucket((3, 64, 5, 40))                    # tokens not a multiple of requests
    assert rb == Bucket(3, 64, 5, 40) and rb.query_len_pad == 40 and rb.is_ragged
    assert as_buckets([(2, 8, 3), Bucket(5, 16, 2, 7)]) == (Bucket(2, 8, 3), Bucket(5, 16, 2, 7))
    for value, exc, match in (
            ((3, 64, 5, 65), ValueError, r"bucket\.query_len=65 is above tokens=64"),
            ((3, 64, 5, -1), ValueError, r"bucket\.query_len must be an int >= 0"),
            ((3, 64, 5, "4"), TypeError, r"bucket\.query_len must be an int"),
            ((3, 64, 5), ValueError, r"bucket\.tokens=64 is not a multiple of requests=3"),
            ((3, 64, 5, 0), ValueError, r"bucket\.tokens=64 is not a multiple of requests=3"),
            ((3, 64), TypeError, r"3- or 4-tuple"),
            ((1, 2, 3, 4, 5), TypeError, r"3- or 4-tuple")):
        with pytest.raises(exc, match=match):
            as_bucket(value)
    with pytest.raises(ValueError, match=r"buckets\[1\]\.query_len=9"):
        as_buckets([(2, 8, 3), (2, 8, 3, 9)])
    # the padding batch of a ragged bucket is build_batch's empty batch with that budget
    want = build_batch([], num_computed=[], num_drafts=[], block_ids=[], block_size=BS,
                       num_reqs_pad=5, query_len_pad=7, blocks_per_req_pad=2, max_spec_len=K,
                       num_tokens_pad=16)
    got = StepBatch(**padding_fields(as_bucket((5, 16, 2, 7)), k=K, block_size=BS),
                    all_greedy=True)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert np.shape(g) == np.shape(w) and np.asarray(g).dtype == np.asarray(w).dtype
        np.testing.assert_array_equal(g, w)


def test_ragged_warmup_then_no_compile(caplog):
    """A ragged bucket warmed by ``Step.warmup``: a real batch of that budget compiles
    nothing; the device loop (decode steps of ``B x Q`` slots) refuses a ragged bucket."""
    import logging

    from specjax.runtime.loop_rows import empty_loop_state
    from specjax.runtime.step import step_cache_size

    tgt = _target()
    step = specjax.make_step(tgt.model, None)
    kv, ds = step.init_caches(1 + 4 * NB, BS, params=tgt.params)
    kv, ds = step.warmup(tgt.params, None, kv, ds, [Bucket(B, 64, NB, Q)], block_size=BS,
                         all_greedy=(True,))
    before = step_cache_size()
    with jax.log_compiles(), caplog.at_level(logging.DEBUG, logger="jax"):
        b = _batch(step, [PROMPT0[:37], PROMPTS[0]], [0, 0], [0, 0], ragged=True)
        out, kv, ds = step(tgt.params, None, kv, ds, b)
        jax.block_until_ready(out)
    assert step_cache_size() == before
    assert not [r for r in caplog.records if r.getMessage().startswith("Compiling")]
    with pytest.raises(ValueError, match=r"bucket\.tokens=64 is not requests \* query_len"):
        empty_loop_state(step, Bucket(B, 64, NB, Q), max_model_len=MML, block_size=BS)

"""The public step's contract: ``build_batch`` (layout against a hand-built reference,
errors naming the argument), ``Step`` (its output fields, refusals before anything runs,
one compile per bucket) and the Feed-based declarations."""

from __future__ import annotations

import warnings

import jax
import numpy as np
import pytest

import specjax
from specjax.runtime.batch import build_batch, trim_drafts
from specjax.runtime.output import StepOutput
from specjax.runtime.step import StepBatch, make_step, step_cache_size
from specjax.token_tree import TokenTree

from test_engine import BS, MML, V, build, target

pytestmark = pytest.mark.smoke




def _batch(token_ids=([9, 1, 2], [6, 7, 8]), **kw):
    args = dict(num_computed=[5, 0], num_drafts=[2, 0], block_ids=[[3, 4], [7]], block_size=4,
                num_reqs_pad=4, query_len_pad=4, blocks_per_req_pad=2, max_spec_len=3)
    args.update(kw)
    return build_batch(list(token_ids), **args)


def test_build_batch_layout():
    b = _batch(temperature=[0.0, 0.5], seeds=[3, 4], num_output_tokens=[2, 0])
    # request 0: token 9 at position 5, drafts 1, 2 at 6, 7; request 1: prompt 6 7 8 at 0..2
    np.testing.assert_array_equal(b.input_ids[:6], [9, 1, 2, 6, 7, 8])
    np.testing.assert_array_equal(b.input_ids[6:], 0)
    np.testing.assert_array_equal(b.positions[:6], [5, 6, 7, 0, 1, 2])
    want_slots = [4 * 4 + 1, 4 * 4 + 2, 4 * 4 + 3, 7 * 4, 7 * 4 + 1, 7 * 4 + 2]  # pos // 4 -> block
    np.testing.assert_array_equal(b.attn.slot_mapping[:6], want_slots)
    np.testing.assert_array_equal(b.attn.slot_mapping[6:], -1)
    np.testing.assert_array_equal(b.attn.seq_lens, [8, 3, 0, 0])
    np.testing.assert_array_equal(b.attn.block_table, [[3, 4], [7, 0], [0, 0], [0, 0]])
    np.testing.assert_array_equal(b.sdm.draft_token_ids[:2], [1, 2])
    np.testing.assert_array_equal(b.backup_next, [9, 8, 0, 0])
    np.testing.assert_array_equal(b.temperature, [0.0, 0.5, 0.0, 0.0])
    np.testing.assert_array_equal(b.seeds, [3, 4, 0, 0])
    np.testing.assert_array_equal(b.counters, [2, 0, 0, 0])
    assert not b.all_greedy and b.block_size == 4 and not b.is_tree
    assert _batch().all_greedy
    # a static field: the pytree's structure differs, its leaves do not
    assert jax.tree.structure(_batch()) != jax.tree.structure(b)


def test_build_batch_tree_positions():
    tree = TokenTree.from_choices([(0,), (1,), (0, 0), (1, 0)])
    b = build_batch([[5, 1, 2, 3, 4]], num_computed=[4], num_drafts=[4], block_ids=[[1, 2, 3]],
                    block_size=4, num_reqs_pad=1, query_len_pad=8, blocks_per_req_pad=3,
                    max_spec_len=4, tree=tree)
    np.testing.assert_array_equal(b.positions[:5], [4, 5, 5, 6, 6])   # root p, node p + depth
    np.testing.assert_array_equal(b.input_ids[:5], [5, 1, 2, 3, 4])
    # KV: node j at logical position p + 1 + j (slots 4 .. 8: blocks 2, 2, 2, 2, 3)
    np.testing.assert_array_equal(b.attn.slot_mapping[:5], [8, 9, 10, 11, 12])
    assert b.is_tree and b.attn.tree_mask == tree.ancestor_mask(with_root=True)
    with pytest.raises(ValueError, match="one uncomputed token"):
        build_batch([[5, 6, 1]], num_computed=[4], num_drafts=[1], block_ids=[[1, 2]],
                    block_size=4, num_reqs_pad=1, query_len_pad=4, blocks_per_req_pad=2,
                    max_spec_len=3, tree=tree)


@pytest.mark.parametrize("kw, needle", [
    (dict(num_reqs_pad=1), "num_reqs_pad=1"),
    (dict(query_len_pad=2), "query_len_pad=2"),
    (dict(num_drafts=[4, 0]), r"num_drafts\[0\]"),
    (dict(num_drafts=[2]), "num_drafts must be 2 ints"),
    (dict(num_computed=[-1, 0]), r"num_computed\[0\]"),
    (dict(block_ids=[[3], [7]]), r"block_ids\[0\] has 1 blocks"),
    (dict(blocks_per_req_pad=1), "blocks_per_req_pad=1"),
    (dict(temperature=[0.0, -1.0]), "temperature"),
    (dict(seeds=[1]), "seeds"),
    (dict(token_ids=[[9, 1, 2], []]), r"token_ids\[1\] is empty"),
])
def test_build_batch_errors_name_the_argument(kw, needle):
    with pytest.raises(ValueError, match=needle):
        _batch(**kw)


def test_trim_drafts():
    assert trim_drafts([1, 2, 3], max_new_tokens=10, kv_room=10, k=3, vocab_size=V) == [1, 2, 3]
    assert trim_drafts([1, 2, 3], max_new_tokens=2, kv_room=10, k=3, vocab_size=V) == [1]
    assert trim_drafts([1, 2, 3], max_new_tokens=1, kv_room=10, k=3, vocab_size=V) == []
    assert trim_drafts([1, V, 3], max_new_tokens=9, kv_room=9, k=3, vocab_size=V) == [1]
    tree = TokenTree.from_choices([(0,), (1,), (0, 0), (1, 0)])
    assert trim_drafts([1, 2, 3, 4], max_new_tokens=2, kv_room=9, k=4, vocab_size=V,
                       tree=tree) == [1, 2]                      # one level
    assert trim_drafts([1, 2, 3, 4], max_new_tokens=9, kv_room=3, k=4, vocab_size=V,
                       tree=tree) == [1, 2, 3]                   # KV room


def test_step_output_and_refusals():
    tgt = target()
    prop = build("eagle3", 3)
    step = make_step(tgt.model, prop)
    assert step.k == 3 and step.feed is prop.feed and step.tree is None
    assert tuple(step.target.aux_layer_ids) == prop.feed.aux_layer_ids
    kv, state = step.init_caches(1 + 4 * (MML // BS), BS)
    batch = build_batch([[1, 2, 3, 4], [5, 6]], num_computed=[0, 0], num_drafts=[0, 0],
                        block_ids=[[1], [2]], block_size=BS, num_reqs_pad=2, query_len_pad=4,
                        blocks_per_req_pad=2, max_spec_len=3)
    before = step_cache_size()
    out, kv, state = step(tgt.params, step.draft_params, kv, state, batch)
    assert isinstance(out, StepOutput) and isinstance(batch, StepBatch)
    out = jax.device_get(out)
    assert out.sampled.shape == (2, 4) and out.drafts.shape == (2, 3)
    assert (out.sampled[:, 0] >= 0).all() and (out.sampled[:, 1:] == -1).all()   # prefill
    np.testing.assert_array_equal(out.num_accepted, 0)
    np.testing.assert_array_equal(out.num_drafts, 3)
    assert out.logprobs is None
    # the same bucket, other real counts: no compile
    batch2 = build_batch([[7, 1, 2, 3]], num_computed=[4], num_drafts=[3], block_ids=[[1, 3]],
                         block_size=BS, num_reqs_pad=2, query_len_pad=4, blocks_per_req_pad=2,
                         max_spec_len=3)
    out, kv, state = step(tgt.params, step.draft_params, kv, state, batch2)
    out = jax.device_get(out)
    assert step_cache_size() == before + 1
    n_acc = int(out.num_accepted[0])
    assert (out.sampled[0, : n_acc + 1] >= 0).all() and (out.sampled[0, n_acc + 1:] == -1).all()
    assert (out.sampled[1] == -1).all() and out.num_accepted[1] == 0 and out.num_drafts[1] == 0
    with pytest.raises(ValueError, match="max_spec_len=2"):
        step(tgt.params, step.draft_params, kv, state, _batch(max_spec_len=2, block_size=BS))
    with pytest.raises(ValueError, match="StepBatch"):
        step(tgt.params, step.draft_params, kv, state, {})
    tree = TokenTree.from_choices([(0,), (1,), (0, 0), (1, 0)])
    tb = build_batch([[5, 1, 2, 3]], num_computed=[4], num_drafts=[3], block_ids=[[1]],
                     block_size=BS, num_reqs_pad=1, query_len_pad=4, blocks_per_req_pad=1,
                     max_spec_len=3, tree=tree)
    with pytest.raises(ValueError, match="tree-verification batch"):
        step(tgt.params, step.draft_params, kv, state, tb)
    with pytest.raises(ValueError, match="block_size=4"):
        step(tgt.params, step.draft_params, kv, state, _batch())
    with pytest.raises(ValueError, match="DecoderLM"):
        make_step(tgt, prop)
    with pytest.raises(ValueError, match="vocabulary"):
        make_step(_other_vocab_target(), prop)


def _other_vocab_target():
    from specjax.models import registry

    from test_engine import GEO
    return registry.make_model("llama", registry.config_from_hf(
        "llama", dict(GEO, num_hidden_layers=1, vocab_size=V + 1)))


def test_public_names_and_feed():
    prop = build("ngram", 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert specjax.make_step is make_step and specjax.build_batch is build_batch
        assert prop.feed.drafts_in == "history" and prop.max_model_len == MML

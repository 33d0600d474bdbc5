"""Recurrent targets (issue 48): a target with state carried across steps runs through its
``accept`` hook (the step rolls each request's state back to the tokens verification kept).
tests/support/recurrent_target.py is a gated linear recurrence written against
``specjax.Target``; its greedy output equals a full-recompute NumPy loop with plain decoding,
n-gram drafts (accepted and rejected), MTP and EAGLE-3 heads, per step and in the device
loop; an ``accept`` that keeps every token breaks the equality; a recurrent target without
``accept`` and tree verification with one are refused by name."""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax import LoopOptions, SamplingParams, SpeculativeConfig, TargetModel, make_proposer
from specjax.attention_metadata import CommonAttentionMetadata
from specjax.models import registry
from specjax.target import check_target, has_accept, has_move_kv

from recurrent_target import (RecurrentLM, full_recompute_greedy, greedy_margin, init_params,
                              reference_logits)

BS, MML, N, SEED = 8, 64, 20, 4
PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [1, 2, 3, 1, 2, 3, 1, 2], [9, 4, 9, 4, 9, 4, 9]]
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2,
         "prompt_lookup_max": 4}
LOOPS = {"per_step": LoopOptions(steps_per_sync=1), "device_loop": None}


@dataclasses.dataclass(frozen=True)
class KeepAll(RecurrentLM):
    """A broken rollback: the state after EVERY token of the step, rejected drafts included."""

    def accept(self, kv, num_kept, attn):
        return kv


@dataclasses.dataclass(frozen=True)
class WithMoveKV(RecurrentLM):
    """A recurrent target that also offers ``move_kv`` (tree verification's other need)."""

    def move_kv(self, kv, src_slots, dst_slots):
        return kv


class _NoAccept:
    """A RecurrentLM's members, ``accept`` left out."""

    def __init__(self):
        self._t = RecurrentLM()

    def __getattr__(self, name):
        if name == "accept":
            raise AttributeError(name)
        return getattr(self._t, name)


@functools.lru_cache(maxsize=None)
def params() -> dict:
    return init_params(SEED)


@functools.lru_cache(maxsize=None)
def reference(max_tokens: tuple[int, ...] = (N,) * 3):
    """The reference's greedy tokens of each prompt (``max_tokens`` of each)."""
    p = params()
    refs = [full_recompute_greedy(p, q, n) for q, n in zip(PROMPTS, max_tokens, strict=True)]
    # no near-ties: the float32 scan and the float64 reference pick the same argmax
    assert min(greedy_margin(p, q, r) for q, r in zip(PROMPTS, refs)) > 1e-3
    return refs


def mtp_proposer(target=None):
    """An MTP-style head without embedding or lm_head: both are the target's own arrays."""
    tgt = target or RecurrentLM()
    dcfg = registry.config_from_hf("mtp", dict(
        hidden_size=tgt.hidden_size, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=4, rms_norm_eps=1e-5, vocab_size=tgt.vocab_size,
        num_hidden_layers=1, num_nextn_predict_layers=1))
    dp = {k: v for k, v in registry.init_params("mtp", dcfg, 1).items()
          if k not in ("embed_tokens", "lm_head")}
    return make_proposer(SpeculativeConfig(method="mtp", num_speculative_tokens=1), target=tgt,
                         target_params=params(), draft=dcfg, draft_params=dp,
                         max_model_len=MML, block_size=BS, kernel_backend="xla")


def eagle3_proposer(tree: list | None = None, target=None):
    """An EAGLE-3 head reading the target's layer inputs 0 and 1 (a chain unless ``tree``)."""
    tgt = target or RecurrentLM()
    hcfg = registry.config_from_hf("eagle3", dict(
        hidden_size=tgt.hidden_size, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=4, rms_norm_eps=1e-5, vocab_size=tgt.vocab_size,
        num_hidden_layers=1, draft_vocab_size=tgt.vocab_size,
        target_hidden_size=tgt.hidden_size, eagle_aux_hidden_state_layer_ids=[0, 1]))
    extra = {} if tree is None else {"speculative_token_tree": str(tree)}
    cfg = SpeculativeConfig(method="eagle3", num_speculative_tokens=3 if tree is None
                            else len(tree), **extra)
    return make_proposer(cfg, target=tgt, target_params=params(), draft=hcfg,
                         draft_params=registry.init_params("eagle3", hcfg, 1),
                         max_model_len=MML, block_size=BS, kernel_backend="xla")


def proposer(method: str):
    if method == "plain":
        return None
    if method in ("ngram", "ngram_gpu"):
        return make_proposer(dict(NGRAM, method=method), max_model_len=MML, block_size=BS)
    return mtp_proposer() if method == "mtp" else eagle3_proposer()


def run(prop, options=None, target=None, max_tokens=(N,) * 3, **kw):
    sp = [SamplingParams(max_tokens=n, ignore_eos=True) for n in max_tokens]
    return specjax.generate(TargetModel(target or RecurrentLM(), params()), prop, PROMPTS, sp,
                            max_model_len=MML, block_size=BS, options=options, **kw)


def test_the_recurrent_target_is_a_target_with_accept():
    tgt = RecurrentLM()
    assert isinstance(tgt, specjax.Target) and tgt.recurrent and not hasattr(tgt, "config")
    assert has_accept(tgt) and not has_move_kv(tgt) and check_target(tgt) is tgt
    assert not has_accept(_NoAccept()) and not has_accept(specjax.models.DecoderLM)


def _batch(rows, num_reqs_pad=3):
    """``(ids, positions, attn)`` for rows ``(tokens, seq_len, blocks)``, one padding row."""
    toks = [t for r in rows for t in r[0]]
    pos = [p for r in rows for p in range(r[1] - len(r[0]), r[1])]
    t_pad = len(toks) + 2
    attn = CommonAttentionMetadata.from_query_lens(
        [len(r[0]) for r in rows], [r[1] for r in rows], [r[2] for r in rows], block_size=BS,
        num_reqs_pad=num_reqs_pad, num_tokens_pad=t_pad)
    pad = lambda x: jnp.asarray(x + [0] * (t_pad - len(x)), jnp.int32)  # noqa: E731
    return pad(toks), pad(pos), attn


@pytest.mark.parametrize("target", [RecurrentLM(), KeepAll()], ids=["accept", "keep_all"])
def test_accept_rolls_the_state_back_to_the_kept_tokens(target):
    """Prefill two requests, verify 4 and 3 tokens keeping 2 and 3, then decode one token:
    its logits are the reference's over prompt + kept + token (not with a broken accept)."""
    p = params()
    p0, p1, d0, d1 = [3, 1, 4, 1, 5, 9], [2, 7, 1, 8, 2], [6, 5, 3, 5], [8, 9, 7]
    kv = target.init_kv_caches(6, BS, jnp.float32)
    for rows, kept in (([(p0, 6, [1, 2]), (p1, 5, [3, 4])], None),
                       ([(d0, 10, [1, 2]), (d1, 8, [3, 4])], [2, 3, 0])):
        ids, pos, attn = _batch(rows)
        _, _, kv = target.forward(p, ids, pos, kv, attn)
        if kept is not None:
            kv = target.accept(kv, jnp.asarray(kept, jnp.int32), attn)
    ids, pos, attn = _batch([([11], 9, [1, 2]), ([12], 9, [3, 4])])
    hidden, aux, _ = target.forward(p, ids, pos, kv, attn)
    got = np.asarray(target.compute_logits(p, hidden[:2]))
    want = np.stack([reference_logits(p, p0 + d0[:2] + [11])[-1],
                     reference_logits(p, p1 + d1 + [12])[-1]])
    assert aux is None
    np.testing.assert_allclose(got[1], want[1], atol=1e-4, rtol=1e-4)   # everything kept
    assert np.allclose(got[0], want[0], atol=1e-4, rtol=1e-4) != isinstance(target, KeepAll)


def test_a_token_at_slot_minus_one_does_not_advance_the_state():
    """What a row the device loop sits out sees: its token dropped (slot -1), its state kept."""
    tgt, p = RecurrentLM(), params()
    kv = tgt.init_kv_caches(6, BS, jnp.float32)
    ids, pos, attn = _batch([([3, 1, 4], 3, [1]), ([2, 7], 2, [3])])
    _, _, kv = tgt.forward(p, ids, pos, kv, attn)
    before = np.asarray(kv["state"])
    ids, pos, attn = _batch([([5], 4, [1]), ([6], 3, [3])])
    attn = dataclasses.replace(attn, slot_mapping=attn.slot_mapping.at[0].set(-1))
    _, _, kv = tgt.forward(p, ids, pos, kv, attn)
    kv = tgt.accept(kv, jnp.asarray([1, 1, 0], jnp.int32), attn)
    after = np.asarray(kv["state"])
    np.testing.assert_array_equal(after[1], before[1])
    assert not np.allclose(after[3], before[3])


@pytest.mark.parametrize("loop", sorted(LOOPS))
@pytest.mark.parametrize("method", ["plain", "ngram", "ngram_gpu", "mtp", "eagle3"])
def test_greedy_equals_full_recompute(method, loop):
    res = run(proposer(method), LOOPS[loop])
    assert res.token_ids == reference()
    if method.startswith("ngram"):   # the prompts repeat: drafts are accepted, and rejected
        s = res.spec_stats
        assert 0 < s.num_accepted_tokens < s.num_draft_tokens


@pytest.mark.parametrize("method", ["plain", "ngram_gpu"])
def test_rows_the_device_loop_sits_out_keep_their_state(method):
    """A fixed-trip device loop with a request waiting: once a row finishes, the others sit
    the remaining iterations out (one token at slot -1 each), which must not advance them."""
    max_tokens = (20, 11, 14)
    res = run(proposer(method), LoopOptions(steps_per_sync=4, early_exit=False),
              max_tokens=max_tokens, max_num_seqs=2)
    assert res.token_ids == reference(max_tokens=max_tokens)


@pytest.mark.parametrize("method", ["ngram", "ngram_gpu"])
def test_an_accept_that_keeps_every_token_breaks_greedy_equality(method):
    res = run(proposer(method), LOOPS["per_step"], target=KeepAll())
    s = res.spec_stats
    assert s.num_accepted_tokens < s.num_draft_tokens      # drafts were rejected ...
    assert res.token_ids != reference()                    # ... and their tokens leaked in


def test_a_recurrent_target_without_accept_is_refused_by_name():
    with pytest.raises(TypeError, match="recurrent.*no accept hook"):
        specjax.make_step(_NoAccept(), None)
    with pytest.raises(ValueError, match="recurrent.*no accept hook"):
        run(None, target=_NoAccept())
    with pytest.raises(ValueError, match="recurrent.*no accept hook"):
        mtp_proposer(target=_NoAccept())


@pytest.mark.parametrize("target", [RecurrentLM(), WithMoveKV()], ids=["no_move_kv", "move_kv"])
def test_tree_verification_with_a_recurrent_target_is_refused(target):
    prop = eagle3_proposer([(0,), (1,), (0, 0), (1, 0)], target=target)
    with pytest.raises(ValueError, match="recurrent"):
        specjax.make_step(target, prop)
    with pytest.raises(ValueError, match="recurrent"):
        run(prop, target=target)

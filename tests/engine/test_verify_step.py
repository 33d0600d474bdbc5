"""``make_verify_step``: verification and drafting without the forward. Run beside the fused
step on the same batches (a host loop over ``build_batch``; the forward and the logits
computed outside, as a stack would), it gives the fused step's tokens, drafts, draft state
and KV: chain (plain, n-gram, EAGLE-3, draft model, a split proposer) and tree (the KV
compacted by ``move_kv``, or by the caller from ``accepted_nodes``). Bad arguments are
refused by name."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.runtime.batch import build_batch
from specjax.runtime.step import make_step
from specjax.runtime.tree import compact_tree_kv
from specjax.runtime.verify import make_verify_step
from specjax.token_tree import TokenTree

from test_engine import BS, MML, METHODS, build, target

PROMPTS = ([3, 9, 4, 3, 9, 4, 3, 9], [5, 1, 7, 7, 2])
NB = 1 + 4 * (MML // BS)
TREE = "[(0,), (1,), (0, 0), (1, 0)]"


def _forward(model):
    """The stack's own forward and logits, one jitted call (outside specjax's step)."""
    @jax.jit
    def run(params, ids, pos, kv, attn, idx):
        hidden, aux, kv = model.forward(params, ids, pos, kv, attn)
        return model.compute_logits(params, hidden[idx]), hidden, aux, kv
    return run


def _close(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(y, np.float32),
                                   rtol=1e-5, atol=1e-5)


def run_both(prop, steps=5, tree=None, caller_compacts=False, prompts=PROMPTS, sampled=False,
             **step_kw):
    """Drive the fused step and the verify step on the same batches; compare every output.
    ``sampled``: seeded requests at temperature 1, each row's draft slot its index (a
    probabilistic drafter). Returns the committed token lists and the number of drafts
    accepted."""
    tgt = target()
    step = make_step(tgt.model, prop, **step_kw)
    tparams = step.place_target_params(tgt.params)
    vs = make_verify_step(prop, vocab_size=tgt.model.vocab_size,
                          move_kv=None if caller_compacts else step.target.move_kv, **step_kw)
    assert vs.k == step.k and vs.tree == step.tree
    kv, state = step.init_caches(NB, BS, max_num_seqs=4 if sampled else None)
    kv2 = jax.tree.map(jnp.copy, kv)
    state2 = jax.tree.map(jnp.copy, state) if state is None or not sampled else \
        vs.init_draft_state(NB, max_num_seqs=4)
    fwd = _forward(step.target)
    seqs = [list(p) for p in prompts]
    computed, drafts, accepted, trees = [0] * len(seqs), [[] for _ in seqs], 0, 0
    blocks = [[1 + 6 * i + j for j in range(MML // BS)] for i in range(len(seqs))]
    for _ in range(steps):
        batch = build_batch([s[c:] + d for s, c, d in zip(seqs, computed, drafts)],
                            num_computed=computed, num_drafts=[len(d) for d in drafts],
                            block_ids=blocks, block_size=BS, num_reqs_pad=4, query_len_pad=16,
                            blocks_per_req_pad=MML // BS, max_spec_len=step.k,
                            tree=tree if all(len(s) - c == 1 for s, c in zip(seqs, computed))
                            else None,    # the prompts prefill as a chain batch
                            **(dict(temperature=[1.0] * len(seqs), seeds=list(range(len(seqs))),
                                    num_output_tokens=[len(s) - len(p) for s, p in
                                                       zip(seqs, prompts)])
                               if sampled else {}))
        if sampled:
            batch = dataclasses.replace(batch, slots=np.array([0, 1, 4, 4][:4], np.int32))
        out, kv, state = step(tparams, step.draft_params, kv, state, batch)
        logits, hidden, aux, kv2 = fwd(tparams, batch.input_ids, batch.positions, kv2, batch.attn,
                                       vs.logits_indices(batch))
        out2, state2, kv_back = vs(vs.draft_params, state2, batch, logits, hidden, aux,
                                   kv=None if caller_compacts else kv2)
        if batch.is_tree:
            trees += 1
            assert out2.accepted_nodes is not None and out.accepted_nodes is None
            if caller_compacts:
                assert kv_back is None
                cad, nq = batch.attn, batch.attn.query_start_loc
                real = np.arange(4) < len(seqs)
                qlen = np.diff(np.asarray(nq))
                kv2 = compact_tree_kv(kv2, cad.block_table,
                                      np.where(real, np.asarray(cad.seq_lens) - qlen, 0),
                                      out2.accepted_nodes, out2.num_accepted, real,
                                      block_size=BS, move_kv=step.target.move_kv)
            else:
                kv2 = kv_back
        else:
            assert out2.accepted_nodes is None
            kv2 = kv_back if kv_back is not None else kv2
        np.testing.assert_array_equal(np.asarray(out2.packed), np.asarray(out.packed))
        _close(kv2, kv)
        _close(state2, state)
        for i, s in enumerate(seqs):
            toks = [int(t) for t in np.asarray(out.sampled[i]) if t >= 0]
            accepted += len(toks) - 1
            computed[i] = len(s) + len(toks) - 1
            s.extend(toks)
            drafts[i] = [int(t) for t in np.asarray(out.drafts[i])[: int(out.num_drafts[i])]]
    assert tree is None or trees >= steps - 1
    return seqs, accepted


def test_plain_ngram_and_split_give_the_fused_steps_outputs():
    run_both(None, steps=3)
    run_both(build("ngram", 3))
    if "eagle3" in METHODS:      # non-padded drafting: the host drops rejected tokens first
        run_both(build("eagle3", 2, disable_padded_drafter_batch=True), steps=3)


@pytest.mark.parametrize("method", [m for m in ("eagle3", "draft_model") if m in METHODS])
def test_model_proposers_give_the_fused_steps_outputs(method):
    _, accepted = run_both(build(method, 3))
    if method == "draft_model":       # the draft IS the target: every draft accepted
        assert accepted >= 3 * 2 * 3


@pytest.mark.parametrize("method", [m for m in ("eagle3", "dspark") if m in METHODS])
def test_sampled_drafts_give_the_fused_steps_outputs(method):
    """``draft_sample_method="probabilistic"``: the draft probabilities kept per request slot
    (``batch.slots``, ``init_draft_state``) verify as in the fused step, token for token."""
    run_both(build(method, 2, draft_sample_method="probabilistic"), sampled=True)
    vs = make_verify_step(build(method, 2, draft_sample_method="probabilistic"),
                          vocab_size=target().model.vocab_size)
    with pytest.raises(ValueError, match="max_num_seqs is required"):
        vs.init_draft_state(NB)


@pytest.mark.parametrize("caller_compacts", [False, True])
def test_tree_verification_gives_the_fused_steps_outputs(caller_compacts):
    """A stub tree proposer that drafts the true continuation on one branch (test_engine_tree):
    accepted nodes off the first path move KV; an EAGLE-3 tree head (random: rejections)."""
    from test_engine_tree import PROMPTS_A, stub

    prop = stub((2, 1))
    _, accepted = run_both(prop, tree=prop.feed.token_tree, caller_compacts=caller_compacts,
                           prompts=PROMPTS_A[:2])
    assert accepted > 0
    if "eagle3" in METHODS and not caller_compacts:
        prop = build("eagle3", TokenTree.from_choices(TREE).num_nodes, speculative_token_tree=TREE)
        run_both(prop, tree=prop.feed.token_tree)


def test_refusals_name_the_argument():
    tgt = target()
    prop = build("eagle3", 3)
    with pytest.raises((TypeError, ValueError), match="vocab_size"):
        make_verify_step(prop, vocab_size=0)
    with pytest.raises(ValueError, match="vocabulary"):
        make_verify_step(prop, vocab_size=tgt.model.vocab_size + 1)
    with pytest.raises(ValueError, match="move_kv"):
        make_verify_step(prop, vocab_size=tgt.model.vocab_size, move_kv=3)
    with pytest.raises(ValueError, match="proposer"):
        make_verify_step("eagle3", vocab_size=tgt.model.vocab_size)
    vs = make_verify_step(prop, vocab_size=tgt.model.vocab_size)
    batch = build_batch([[1, 2, 3]], num_computed=[0], num_drafts=[0], block_ids=[[1]],
                        block_size=BS, num_reqs_pad=2, query_len_pad=4, blocks_per_req_pad=2,
                        max_spec_len=3)
    n = int(np.shape(vs.logits_indices(batch))[0])
    state = prop.init_state(NB)
    v = tgt.model.vocab_size
    h = jnp.zeros((8, 32))
    aux = jnp.zeros((8, 2, 32))
    with pytest.raises(ValueError, match="logits must be"):
        vs(vs.draft_params, state, batch, jnp.zeros((n + 1, v)), h, aux)
    with pytest.raises(ValueError, match="logits must be"):
        vs(vs.draft_params, state, batch, jnp.zeros((n, v - 1)), h, aux)
    with pytest.raises(ValueError, match="hidden="):
        vs(vs.draft_params, state, batch, jnp.zeros((n, v)), None, aux)
    with pytest.raises(ValueError, match="hidden must have one row"):
        vs(vs.draft_params, state, batch, jnp.zeros((n, v)), h[:3], aux)
    with pytest.raises(ValueError, match="max_spec_len"):
        vs(vs.draft_params, state, build_batch(
            [[1, 2, 3]], num_computed=[0], num_drafts=[0], block_ids=[[1]], block_size=BS,
            num_reqs_pad=2, query_len_pad=4, blocks_per_req_pad=2, max_spec_len=2),
           jnp.zeros((n, v)), h, aux)


def test_tree_kv_without_move_kv_is_refused():
    from test_engine_tree import V, stub

    prop = stub((2, 1))
    vs = make_verify_step(prop, vocab_size=V)
    batch = build_batch([[5, 1, 2, 3, 4]], num_computed=[4], num_drafts=[4], block_ids=[[1, 2]],
                        block_size=BS, num_reqs_pad=1, query_len_pad=8, blocks_per_req_pad=2,
                        max_spec_len=4, tree=prop.feed.token_tree)
    n = int(np.shape(vs.logits_indices(batch))[0])
    assert n == 5
    with pytest.raises(ValueError, match="move_kv"):
        vs(vs.draft_params, prop.init_state(NB), batch, jnp.zeros((n, V)), kv=jnp.zeros(3))

"""Draft-model proposer against a naive reference.

The reference runs the same Flax draft LM one request at a time, recomputing the whole
sequence from scratch at every draft step (a fresh dense cache: one block holding the
whole sequence) with a Python loop: the request's accepted context, then the next token,
then greedy continuation, k tokens. No paging, no slot-mapping kernels, no padded batch.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.attention_metadata import CommonAttentionMetadata
from specjax.config import SpeculativeConfig
from specjax.models import registry
from specjax.proposers.types import ProposerInputs
from specjax.proposers.draft_model import DraftModelProposer

try:
    from compile_check import assert_no_recompile
except ImportError:  # tests/ made a package
    from tests.compile_check import assert_no_recompile

GEO = dict(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
           num_hidden_layers=2, rms_norm_eps=1e-5)
V = 80
BS = 4
MAX_BLOCKS = 8
MML = BS * MAX_BLOCKS   # 32: the block table covers max_model_len
NUM_BLOCKS = 40
B_PAD = 4
T_PAD = 64
DENSE = 40              # the reference's one-block cache
PARD = 5                # parallel-drafting (mask) token id


@functools.lru_cache(maxsize=None)
def lm(kind="llama", seed=1):
    cfg = registry.config_from_hf(kind, dict(GEO, vocab_size=V))
    return cfg, registry.make_model(kind, cfg), registry.init_params(kind, cfg, seed)


@functools.lru_cache(maxsize=None)
def _dense_forward(model):
    def f(params, ids, positions, md):
        hidden, _, caches = model.forward(params, ids, positions, model.init_kv_caches(1, DENSE), md)
        return model.compute_logits(params, hidden), caches
    return jax.jit(f)


def dense_forward(model, params, seq):
    """One request's whole sequence from scratch: logits ``[len(seq), V]`` and, per layer,
    its K and V ``[len(seq), n_kv, head_dim]``."""
    n = len(seq)
    assert n <= DENSE
    md = CommonAttentionMetadata.from_query_lens([n], [n], [[0]], block_size=DENSE,
                                                 num_tokens_pad=DENSE, max_query_len=DENSE)
    ids = np.zeros(DENSE, np.int32)
    ids[:n] = seq
    pos = np.zeros(DENSE, np.int32)
    pos[:n] = np.arange(n)
    logits, caches = _dense_forward(model)(params, jnp.asarray(ids), jnp.asarray(pos), md)
    return np.asarray(logits)[:n], [(np.asarray(c.k)[0, :n], np.asarray(c.v)[0, :n]) for c in caches]


def naive_drafts(model, params, ctx_ids, next_tok, k, *, parallel=False):
    """k drafts for one request whose accepted context is ``ctx_ids`` (positions 0..L-1),
    and the K/V of every position the drafter wrote (``L + k`` of them)."""
    seq = [int(t) for t in ctx_ids] + [int(next_tok)]
    if parallel:   # one pass over [ctx, next, mask * (k-1)]: the argmax at each new slot
        logits, kv = dense_forward(model, params, seq + [PARD] * (k - 1))
        return [int(t) for t in np.argmax(logits[len(ctx_ids):], axis=-1)], kv
    out = []
    for _ in range(k):
        logits, kv = dense_forward(model, params, seq)
        out.append(int(np.argmax(logits[-1])))
        seq.append(out[-1])
    return out, kv


def paged_kv(state, table_row, n):
    """Per layer, K and V of positions ``0..n-1`` read back through one block-table row."""
    pos = np.arange(n)
    slots = np.asarray(table_row)[pos // BS] * BS + pos % BS
    out = []
    for c in state.kv_caches:
        k, v = (np.asarray(a).reshape((-1,) + a.shape[2:]) for a in (c.k, c.v))
        out.append((k[slots], v[slots]))
    return out


def _requests(rng, n, *, padded, chunked, lengths=None):
    reqs = []
    for i in range(n):
        L = int(rng.integers(2, 20)) if lengths is None else lengths[i]
        reqs.append(dict(L=L, ids=rng.integers(0, V, L), next=int(rng.integers(0, V)),
                         rej=int(rng.integers(0, 3)) if padded else 0,
                         split=int(rng.integers(1, L)) if chunked else 0))
    table = rng.permutation(NUM_BLOCKS)[: n * MAX_BLOCKS].reshape(n, MAX_BLOCKS)
    return reqs, table


def _inputs(reqs, table, lo_hi, with_rejected, rng):
    """ProposerInputs for each request's tokens [lo, hi) (+ rejected junk in padded mode)."""
    ids, pos, qlens, seqlens, rej = [], [], [], [], []
    for r, (lo, hi) in zip(reqs, lo_hi):
        j = r["rej"] if with_rejected else 0
        ids += list(r["ids"][lo:hi]) + list(rng.integers(0, V, j))
        pos += list(range(lo, hi + j))
        qlens.append(hi - lo + j)
        seqlens.append(hi + j)
        rej.append(j)
    n = len(reqs)
    md = CommonAttentionMetadata.from_query_lens(qlens, seqlens, table[:n], block_size=BS,
                                                 num_reqs_pad=B_PAD, num_tokens_pad=T_PAD,
                                                 max_query_len=32)
    padt = lambda a: jnp.asarray(np.concatenate([np.asarray(a, np.int32), np.zeros(T_PAD - len(a), np.int32)]))  # noqa: E731
    padb = lambda a: jnp.asarray(np.concatenate([np.asarray(a, np.int32), np.zeros(B_PAD - n, np.int32)]))  # noqa: E731
    return ProposerInputs(
        target_token_ids=padt(ids), target_positions=padt(pos), target_hidden_states=None,
        aux_hidden_states=None, next_token_ids=padb([r["next"] for r in reqs]),
        token_indices_to_sample=None, num_rejected_tokens=padb(rej) if with_rejected else None,
        attn_metadata=md)


def _proposer(k, model, *, parallel=False, **kw):
    cfg = SpeculativeConfig(method="draft_model", model="tiny-llama", num_speculative_tokens=k,
                            parallel_drafting=parallel)
    return DraftModelProposer(cfg, model, target_vocab_size=V, block_size=BS, max_model_len=MML,
                              parallel_drafting_token_id=PARD if parallel else None,
                              kernel_backend="xla", **kw)


def _propose_requests(prop, params, reqs, table, *, chunked, padded, rng):
    state = prop.init_state(NUM_BLOCKS)
    if chunked:   # first call on a prefix; its drafts are thrown away, its cache kept
        first = _inputs([dict(r, next=int(r["ids"][r["split"]])) for r in reqs], table,
                        [(0, r["split"]) for r in reqs], False, rng)
        _, state = prop.propose(params, state, first)
    inp = _inputs(reqs, table, [(r["split"], r["L"]) for r in reqs], padded, rng)
    return prop.propose(params, state, inp)


@pytest.mark.smoke
@pytest.mark.parametrize("k, chunked, padded, parallel", [
    (3, False, True, False), (3, True, True, False), (1, False, True, False), (3, True, False, False),
    (3, False, True, True)])
def test_propose_matches_naive_reference(k, chunked, padded, parallel):
    rng = np.random.default_rng([k, chunked, padded, parallel])
    _, model, params = lm()
    prop = _proposer(k, model, parallel=parallel)
    n = 3
    reqs, table = _requests(rng, n, padded=padded, chunked=chunked)
    out, state = _propose_requests(prop, params, reqs, table, chunked=chunked, padded=padded, rng=rng)
    got = np.asarray(out.token_ids)
    assert got.shape == (B_PAD, k) and got.dtype == np.int32
    np.testing.assert_array_equal(out.num_drafts, [k] * n + [0] * (B_PAD - n))
    np.testing.assert_array_equal(got[n:], -1)
    for i, r in enumerate(reqs):
        want, want_kv = naive_drafts(model, params, r["ids"], r["next"], k, parallel=parallel)
        np.testing.assert_array_equal(got[i], want, err_msg=f"request {i}")
        # the draft cache holds the context, the next token and the drafts fed back (or the
        # parallel-drafting slots) at their positions, as a from-scratch pass computes them
        for layer, ((pk, pv), (dk, dv)) in enumerate(zip(paged_kv(state, table[i], r["L"] + k), want_kv)):
            np.testing.assert_allclose(pk, dk, rtol=1e-5, atol=1e-5, err_msg=f"request {i} layer {layer} K")
            np.testing.assert_allclose(pv, dv, rtol=1e-5, atol=1e-5, err_msg=f"request {i} layer {layer} V")


def test_draft_identical_to_target_drafts_its_greedy_continuation():
    """A draft LM equal to the target proposes exactly what the target would accept: one
    teacher-forced target pass over [context, next, drafts] reproduces every draft."""
    rng = np.random.default_rng(11)
    k = 3
    _, target, target_params = lm("llama", 2)
    prop = _proposer(k, target)
    reqs, table = _requests(rng, 4, padded=True, chunked=False)
    out, _ = _propose_requests(prop, target_params, reqs, table, chunked=False, padded=True, rng=rng)
    got = np.asarray(out.token_ids)
    for i, r in enumerate(reqs):
        seq = list(r["ids"]) + [r["next"]] + got[i].tolist()
        greedy = np.argmax(dense_forward(target, target_params, seq)[0], axis=-1)
        np.testing.assert_array_equal(got[i], greedy[r["L"] : r["L"] + k], err_msg=f"request {i}")


def test_request_reaching_max_model_len():
    """A request whose next token sits at max_model_len - 1: its first draft is still exact
    (later steps clamp to position 0 / slot -1, as vLLM's kernel does), and it does not
    disturb the other requests."""
    rng = np.random.default_rng(2)
    k = 3
    _, model, params = lm()
    prop = _proposer(k, model)
    reqs, table = _requests(rng, 2, padded=True, chunked=False, lengths=[MML - 1, 9])
    reqs[0]["rej"] = 0   # the full block table: no room for rejected tokens past max_model_len
    out, _ = _propose_requests(prop, params, reqs, table, chunked=False, padded=True, rng=rng)
    got = np.asarray(out.token_ids)
    assert got[0, 0] == naive_drafts(model, params, reqs[0]["ids"], reqs[0]["next"], 1)[0][0]
    assert (got[0] >= 0).all() and (got[0] < V).all()
    np.testing.assert_array_equal(got[1], naive_drafts(model, params, reqs[1]["ids"], reqs[1]["next"], k)[0])


def test_no_recompile_inside_a_bucket(caplog):
    rng = np.random.default_rng(5)
    _, model, params = lm()
    prop = _proposer(3, model)
    state = prop.init_state(NUM_BLOCKS)

    def run(n):
        nonlocal state
        reqs, table = _requests(rng, n, padded=True, chunked=False)
        out, state = prop.propose(params, state, _inputs(reqs, table, [(0, r["L"]) for r in reqs],
                                                         True, rng))
        return np.asarray(out.token_ids)

    assert_no_recompile(prop.propose, run, (2, 1, 4, 3), caplog)


def _cfg(**kw):
    base = dict(method="draft_model", model="tiny-llama", num_speculative_tokens=2)
    return SpeculativeConfig(**{**base, **kw})


@pytest.mark.parametrize("kwargs, match", [
    (dict(target_vocab_size=96),
     r"draft model's vocab_size \(80\) must equal the target model's vocab_size \(96\)"),
    (dict(config=_cfg(draft_tensor_parallel_size=2), target_tensor_parallel_size=1),
     r"draft_tensor_parallel_size \(2\) must equal the target's tensor_parallel_size \(1\)"),
    (dict(config=_cfg(parallel_drafting=True)), "parallel_drafting_token_id"),
    (dict(config=_cfg(parallel_drafting=True), parallel_drafting_token_id=V),
     "parallel_drafting_token_id must be an int in"),
    (dict(config=SpeculativeConfig(method="eagle", num_speculative_tokens=2)), "method 'draft_model'"),
    (dict(model="llama"), "DecoderLM"),
    (dict(block_size=0), "block_size"),
    (dict(max_model_len=-1), "max_model_len"),
    (dict(target_tensor_parallel_size=0), "target_tensor_parallel_size"),
    (dict(kernel_backend="cuda"), "backend"),
])
def test_construction_errors(kwargs, match):
    _, model, _ = lm()
    args = dict(config=_cfg(), model=model, target_vocab_size=V, block_size=BS, max_model_len=MML)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        DraftModelProposer(**args)


def test_matching_tp_and_padded_batch_required():
    _, model, _ = lm()
    DraftModelProposer(_cfg(draft_tensor_parallel_size=2), model, target_vocab_size=V, block_size=BS,
                       max_model_len=MML, target_tensor_parallel_size=2)
    with pytest.raises(ValueError, match="disable_padded_drafter_batch"):
        _cfg(disable_padded_drafter_batch=True)

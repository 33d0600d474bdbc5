"""EAGLE / EAGLE-3 proposer against a naive reference.

The reference runs the same Flax head one request at a time, recomputing the whole draft
sequence from scratch at every draft step (a fresh dense cache: one block holding the whole
sequence), with a Python loop: no paging, no slot mapping kernels, no padded batch.
"""

import dataclasses
import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.attention_metadata import CommonAttentionMetadata
from specjax.config import SpeculativeConfig
from specjax.models import registry, share_target_weights
from specjax.proposers.types import ProposerInputs
from specjax.proposers.eagle import EagleProposer, prepare_inputs

GEO = dict(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
           rms_norm_eps=1e-5)
V = 80
BS = 4
MAX_BLOCKS = 10       # 40-token context bucket
MML = BS * MAX_BLOCKS
NUM_BLOCKS = 48
B_PAD = 4
T_PAD = 96
DENSE = 64            # the reference's one-block cache


def _target(h, seed=0):
    rng = np.random.default_rng(seed)
    emb = rng.standard_normal((V, h)).astype(np.float32)
    head = (rng.standard_normal((V, h)) / np.sqrt(h)).astype(np.float32)
    return {"embed_tokens": {"embedding": jnp.asarray(emb)}, "lm_head": {"kernel": jnp.asarray(head.T)}}


@functools.lru_cache(maxsize=None)
def head(method):
    if method == "eagle":
        cfg = registry.config_from_hf("eagle", dict(GEO, num_hidden_layers=2, vocab_size=V, bias=True))
    elif method == "mtp":     # MiMo MTP: EAGLE-1's data flow, its own forward
        cfg = registry.config_from_hf("mtp", dict(GEO, num_hidden_layers=1, vocab_size=V))
    else:
        cfg = registry.config_from_hf("eagle3", dict(
            GEO, num_hidden_layers=1, vocab_size=V, draft_vocab_size=40, target_hidden_size=24,
            has_d2t=True, eagle_aux_hidden_state_layer_ids=[1, 3, 5]))
    own = registry.init_params(method, cfg, 3)
    params = share_target_weights(own, _target(cfg.hidden_size), kind=method)
    return cfg, registry.make_model(method, cfg), params


@functools.lru_cache(maxsize=None)
def _dense_forward(model):
    return jax.jit(model.forward)


def naive_drafts(method, model, params, ctx_ids, ctx_hidden, next_tok, k):
    """Draft k tokens for one request whose context (positions 0..L-1) is ``ctx_ids``."""
    fwd = _dense_forward(model)
    ids = list(ctx_ids[1:]) + [int(next_tok)]
    if method == "eagle3":
        hid = list(np.asarray(model.combine_hidden_states(params, jnp.asarray(ctx_hidden))))
    else:
        hid = list(ctx_hidden)
    out = []
    for _ in range(k):
        n = len(ids)
        md = CommonAttentionMetadata.from_query_lens([n], [n], [[0]], block_size=DENSE,
                                                     num_tokens_pad=DENSE, max_query_len=DENSE)
        caches = model.init_kv_caches(1, DENSE)
        pad = lambda a, fill=0: np.concatenate([np.asarray(a), np.full((DENSE - n,) + np.shape(a)[1:], fill, np.asarray(a).dtype)])  # noqa: E731
        h_log, h_next, _ = fwd(params, jnp.asarray(pad(np.array(ids, np.int32))),
                               jnp.asarray(pad(np.arange(n, dtype=np.int32))),
                               jnp.asarray(pad(np.stack(hid).astype(np.float32))), caches, md)
        last = h_log[n - 1 : n]
        if method == "eagle3":
            d = jnp.argmax(model.compute_draft_logits(params, last), -1)
            tok = int(model.draft_to_target_ids(params, d.astype(jnp.int32))[0])
        else:
            tok = int(jnp.argmax(model.compute_logits(params, last), -1)[0])
        out.append(tok)
        ids.append(tok)
        hid.append(np.asarray(h_next[n - 1]))
    return out


def _batch(method, cfg, rng, n_reqs, *, chunked, padded):
    """Requests with contexts; the proposer's target batch holds either the whole context
    (+ rejected junk in padded mode) or, when ``chunked``, a first call on a prefix and a
    second call on the rest."""
    width = 3 * 24 if method == "eagle3" else cfg.hidden_size
    reqs = []
    for _ in range(n_reqs):
        L = int(rng.integers(2, 20))
        reqs.append(dict(
            L=L, ids=rng.integers(0, V, L), hid=rng.standard_normal((L, width)).astype(np.float32),
            next=int(rng.integers(0, V)), rej=int(rng.integers(0, 3)) if padded else 0,
            split=int(rng.integers(1, L)) if chunked else 0))
    table = rng.permutation(NUM_BLOCKS)[: n_reqs * MAX_BLOCKS].reshape(n_reqs, MAX_BLOCKS)
    return reqs, table


def _inputs(method, reqs, table, lo_hi, with_rejected, rng, *, b_pad=B_PAD, t_pad=T_PAD):
    """ProposerInputs for each request's tokens [lo, hi) (+ rejected junk)."""
    ids, pos, hid, qlens, seqlens, sample, rej = [], [], [], [], [], [], []
    t = 0
    for r, (lo, hi) in zip(reqs, lo_hi):
        j = r["rej"] if with_rejected else 0
        width = r["hid"].shape[1]
        ids += list(r["ids"][lo:hi]) + list(rng.integers(0, V, j))
        pos += list(range(lo, hi + j))
        hid += list(r["hid"][lo:hi]) + list(rng.standard_normal((j, width)).astype(np.float32))
        qlens.append(hi - lo + j)
        seqlens.append(hi + j)
        sample.append(t + hi - lo - 1)
        rej.append(j)
        t += hi - lo + j
    n = len(reqs)
    md = CommonAttentionMetadata.from_query_lens(qlens, seqlens, table[:n], block_size=BS,
                                                 num_reqs_pad=b_pad, num_tokens_pad=t_pad,
                                                 max_query_len=32)
    padt = lambda a: np.concatenate([np.asarray(a), np.zeros((t_pad - len(a),) + np.shape(a)[1:], np.asarray(a).dtype)])  # noqa: E731
    padb = lambda a: np.concatenate([np.asarray(a, np.int32), np.zeros(b_pad - n, np.int32)])  # noqa: E731
    h = padt(np.stack(hid))
    return ProposerInputs(
        target_token_ids=jnp.asarray(padt(np.array(ids, np.int32))),
        target_positions=jnp.asarray(padt(np.array(pos, np.int32))),
        target_hidden_states=None if method == "eagle3" else jnp.asarray(h),
        aux_hidden_states=jnp.asarray(h.reshape(t_pad, 3, -1)) if method == "eagle3" else None,
        next_token_ids=jnp.asarray(padb([r["next"] for r in reqs])),
        token_indices_to_sample=jnp.asarray(padb(sample)) if with_rejected else None,
        num_rejected_tokens=jnp.asarray(padb(rej)) if with_rejected else None,
        attn_metadata=md)


@pytest.mark.smoke
@pytest.mark.parametrize("method", ["eagle", "eagle3", "mtp"])
@pytest.mark.parametrize("k, chunked, padded", [(3, False, True), (3, True, True), (1, False, False),
                                                (4, True, False)])
def test_propose_matches_naive_reference(method, k, chunked, padded):
    rng = np.random.default_rng(zlib.crc32(repr((method, k, chunked, padded)).encode()))
    cfg, model, params = head(method)
    prop = EagleProposer(SpeculativeConfig(method=method, num_speculative_tokens=k), model,
                         block_size=BS, max_model_len=MML, kernel_backend="xla")
    n = 3
    reqs, table = _batch(method, cfg, rng, n, chunked=chunked, padded=padded)
    state = prop.init_state(NUM_BLOCKS)
    if chunked:   # first call on a prefix; its drafts are thrown away, its cache kept
        first = _inputs(method, [dict(r, next=int(r["ids"][r["split"]])) for r in reqs], table,
                        [(0, r["split"]) for r in reqs], False, rng)
        _, state = prop.propose(params, state, first)
    inp = _inputs(method, reqs, table, [(r["split"], r["L"]) for r in reqs], padded, rng)
    out, state = prop.propose(params, state, inp)
    got = np.asarray(out.token_ids)
    np.testing.assert_array_equal(out.num_drafts, [k] * n + [0] * (B_PAD - n))
    np.testing.assert_array_equal(got[n:], -1)
    for i, r in enumerate(reqs):
        want = naive_drafts(method, model, params, r["ids"], r["hid"], r["next"], k)
        np.testing.assert_array_equal(got[i], want, err_msg=f"request {i}")


def test_no_recompile_inside_a_bucket():
    rng = np.random.default_rng(5)
    cfg, model, params = head("eagle")
    prop = EagleProposer(SpeculativeConfig(method="eagle", num_speculative_tokens=2), model,
                         block_size=BS, max_model_len=MML, kernel_backend="xla")
    state = prop.init_state(NUM_BLOCKS)
    before = prop.propose._cache_size()
    for n in (1, 3, 2, 4):
        reqs, table = _batch("eagle", cfg, rng, n, chunked=False, padded=True)
        _, state = prop.propose(params, state, _inputs("eagle", reqs, table,
                                                       [(0, r["L"]) for r in reqs], True, rng))
    assert prop.propose._cache_size() - before == 1


def test_prepare_inputs_non_padded():
    md = CommonAttentionMetadata.from_query_lens([4, 1, 3], [10, 5, 3], [[0, 1, 2], [3, 4, 5], [6, 7, 8]],
                                                 block_size=4, num_reqs_pad=4, num_tokens_pad=10)
    # request 0: 3 drafts, 2 sampled -> 2 rejected; request 1: no drafts; request 2: 2 drafts all taken
    new, idx = prepare_inputs(md, [[5, 6], [7], [1, 2, 3]], [3, 0, 2])
    np.testing.assert_array_equal(new.query_start_loc, [0, 2, 3, 6, 6])
    np.testing.assert_array_equal(new.seq_lens, [8, 5, 3, 0])
    np.testing.assert_array_equal(idx[:6], [0, 1, 4, 5, 6, 7])
    np.testing.assert_array_equal(np.asarray(new.slot_mapping)[:6], np.asarray(md.slot_mapping)[[0, 1, 4, 5, 6, 7]])
    assert int(new.num_actual_tokens) == 6
    with pytest.raises(ValueError, match="request 0"):   # 5 sampled tokens for 3 drafts
        prepare_inputs(md, [[5, 6, 7, 8, 9], [7], [1]], [3, 0, 2])
    with pytest.raises(ValueError, match="one entry per request"):
        prepare_inputs(md, [[1]], [0])


def test_padded_prep_kernels_feed_propose():
    """The padded-mode helpers give the indices the reference loop expects."""
    cfg, model, params = head("eagle")
    prop = EagleProposer(SpeculativeConfig(method="eagle", num_speculative_tokens=2), model,
                         block_size=BS, max_model_len=MML, kernel_backend="xla")
    from specjax.metadata import SpecDecodeMetadata
    sdm = SpecDecodeMetadata.from_draft_lists([[1, 2], [3, 4]], [3, 6], num_reqs_pad=B_PAD,
                                              max_spec_len=2)
    md = CommonAttentionMetadata.from_query_lens([3, 3], [8, 3], [[0, 1, 2], [3, 4, 5]], block_size=4,
                                                 num_reqs_pad=B_PAD, num_tokens_pad=8)
    sampled = jnp.asarray([[1, 9, -1], [3, 4, 7], [0, 0, 0], [0, 0, 0]], jnp.int32)
    nxt, valid = prop.prepare_next_token_ids_padded(sampled, jnp.zeros(B_PAD, bool),
                                                    jnp.asarray([5, 6, 0, 0]), vocab_size=V,
                                                    num_reqs=md.num_reqs)
    np.testing.assert_array_equal(nxt[:2], [9, 7])
    np.testing.assert_array_equal(valid[:2], [2, 3])
    idx, rej = prop.prepare_inputs_padded(sdm, valid, md)
    np.testing.assert_array_equal(idx[:2], [1, 5])
    np.testing.assert_array_equal(rej[:2], [1, 0])


@pytest.mark.parametrize("method", ["eagle3", "mtp"])
@pytest.mark.parametrize("c", [1, 2])
def test_chain_len_drafts_the_reference_prefix(method, c):
    """``chain_len=c`` (the device loop's K): the naive reference's first ``c`` drafts, -1
    after, ``num_drafts`` c; ``with_chain_len`` caches its copy and refuses what has no chain."""
    from specjax.proposers.common import with_chain_len

    k = 4
    rng = np.random.default_rng(7 + c)
    cfg, model, params = head(method)
    full = EagleProposer(SpeculativeConfig(method=method, num_speculative_tokens=k), model,
                         block_size=BS, max_model_len=MML, kernel_backend="xla")
    prop = with_chain_len(full, c)
    assert prop.chain_len == c and with_chain_len(full, c) is prop and with_chain_len(full, k) is full
    reqs, table = _batch(method, cfg, rng, 3, chunked=False, padded=True)
    out, _ = prop.propose(params, prop.init_state(NUM_BLOCKS),
                          _inputs(method, reqs, table, [(0, r["L"]) for r in reqs], True, rng))
    got = np.asarray(out.token_ids)
    assert got.shape == (B_PAD, k)
    np.testing.assert_array_equal(out.num_drafts, [c] * 3 + [0] * (B_PAD - 3))
    np.testing.assert_array_equal(got[:, c:], -1)
    for i, r in enumerate(reqs):
        want = naive_drafts(method, model, params, r["ids"], r["hid"], r["next"], k)
        np.testing.assert_array_equal(got[i, :c], want[:c], err_msg=f"request {i}")
    if method == "eagle3":
        par = SpeculativeConfig(method=method, num_speculative_tokens=k, parallel_drafting=True)
        par = dataclasses.replace(full, config=par, parallel_drafting_token_id=0)
        assert with_chain_len(par, 2) is None
        with pytest.raises(ValueError, match="chain_len applies to chain drafting only"):
            dataclasses.replace(par, chain_len=2)
    with pytest.raises(ValueError, match="chain_len"):
        dataclasses.replace(full, chain_len=5)


@pytest.mark.parametrize("kwargs, match", [
    (dict(config=SpeculativeConfig(method="ngram", num_speculative_tokens=2)), "method"),
    (dict(config=SpeculativeConfig(method="eagle", num_speculative_tokens=2, parallel_drafting=True)),
     "parallel_drafting"),
    (dict(config=SpeculativeConfig(method="eagle", num_speculative_tokens=3,
                                   speculative_token_tree="[(0,), (1,)]")), "num_speculative_tokens"),
    (dict(block_size=0), "block_size"),
    (dict(max_model_len=-1), "max_model_len"),
    (dict(kernel_backend="cuda"), "backend"),
    (dict(config=SpeculativeConfig(method="eagle3", num_speculative_tokens=2)), "Eagle3Head"),
])
def test_construction_errors(kwargs, match):
    _, model, _ = head("eagle")
    args = dict(config=SpeculativeConfig(method="eagle", num_speculative_tokens=2), model=model,
                block_size=BS, max_model_len=MML)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        EagleProposer(**args)


@pytest.mark.smoke
@pytest.mark.parametrize("method", ["eagle", "eagle3", "mtp"])
def test_single_row_batch(method):
    """B_pad = 1: the chain's single-token steps run on one row (each matmul through
    ``models.params.two_row_matmul``); the drafts are the reference's and no KV outside the
    request's table row is written."""
    rng = np.random.default_rng(21)
    cfg, model, params = head(method)
    prop = EagleProposer(SpeculativeConfig(method=method, num_speculative_tokens=3), model,
                         block_size=BS, max_model_len=MML, kernel_backend="xla")
    reqs, table = _batch(method, cfg, rng, 1, chunked=False, padded=True)
    state = prop.init_state(NUM_BLOCKS)
    state = state._replace(kv_caches=[c._replace(k=c.k + 1.0, v=c.v - 1.0) for c in state.kv_caches])
    before = [np.asarray(c.k) for c in state.kv_caches]
    out, state = prop.propose(params, state, _inputs(method, reqs, table, [(0, reqs[0]["L"])], True,
                                                     rng, b_pad=1))
    assert out.token_ids.shape == (1, 3)
    want = naive_drafts(method, model, params, reqs[0]["ids"], reqs[0]["hid"], reqs[0]["next"], 3)
    np.testing.assert_array_equal(out.token_ids[0], want)
    others = np.setdiff1d(np.arange(NUM_BLOCKS), table[0])
    for b, c in zip(before, state.kv_caches):
        np.testing.assert_array_equal(np.asarray(c.k)[others], b[others])

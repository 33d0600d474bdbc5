"""EAGLE / EAGLE-3 tree drafting against a naive reference, and tree attention.

The reference drafts the tree recursively, one request at a time: for every node it
recomputes the whole draft sequence from scratch (context, root, then the node's path)
in a fresh dense cache with plain causal attention, and takes the top-c tokens with a
stable NumPy sort. No paging, no tree mask, no batching: a node sees exactly its context
and its ancestors because nothing else is in its sequence.
"""

import zlib

import jax.numpy as jnp
import numpy as np
import pytest

from specjax.attention_metadata import CommonAttentionMetadata
from specjax.config import SpeculativeConfig
from specjax.kernels.paged_attention import KVCache, paged_attention
from specjax.proposers.eagle import EagleProposer
from specjax.token_tree import TokenTree
from test_proposers_eagle import (B_PAD, BS, DENSE, NUM_BLOCKS, V, _batch, _dense_forward,
                                        _inputs, head)

TREES = {
    "wide": "[(0,), (1,), (2,)]",
    "2x2": "[(0,), (1,), (0, 0), (0, 1), (1, 0), (1, 1)]",
    "2-1-2": "[(0,), (1,), (0, 0), (1, 0), (0, 0, 0), (0, 0, 1), (1, 0, 0), (1, 0, 1)]",
    "1-3-1": "[(0,), (0, 0), (0, 1), (0, 2), (0, 0, 0), (0, 1, 0), (0, 2, 0)]",
}


def _top_np(logits, c):
    return list(np.argsort(-np.asarray(logits, np.float64), kind="stable")[:c])


def naive_tree(method, model, params, ctx_ids, ctx_hidden, next_tok, tree: TokenTree,
               max_levels=None):
    """Drafts of every node (tree order) of the first ``max_levels`` levels; -2 elsewhere."""
    fwd = _dense_forward(model)
    ids0 = [int(t) for t in ctx_ids[1:]] + [int(next_tok)]
    if method == "eagle3":
        hid0 = list(np.asarray(model.combine_hidden_states(params, jnp.asarray(ctx_hidden))))
    else:
        hid0 = list(ctx_hidden)

    def run(ids, hid):
        n = len(ids)
        md = CommonAttentionMetadata.from_query_lens([n], [n], [[0]], block_size=DENSE,
                                                     num_tokens_pad=DENSE, max_query_len=DENSE)
        pad = lambda a: np.concatenate([np.asarray(a), np.zeros((DENSE - n,) + np.shape(a)[1:], np.asarray(a).dtype)])  # noqa: E731
        h_log, h_next, _ = fwd(params, jnp.asarray(pad(np.array(ids, np.int32))),
                               jnp.asarray(pad(np.arange(n, dtype=np.int32))),
                               jnp.asarray(pad(np.stack(hid).astype(np.float32))),
                               model.init_kv_caches(1, DENSE), md)
        return h_log[n - 1 : n], np.asarray(h_next[n - 1])

    def top(h, c):
        if method == "eagle3":
            d = _top_np(model.compute_draft_logits(params, h)[0], c)
            return [int(x) for x in model.draft_to_target_ids(params, jnp.asarray(d, jnp.int32))]
        return [int(x) for x in _top_np(model.compute_logits(params, h)[0], c)]

    levels = tree.depth if max_levels is None else max_levels
    out = {}
    # frontier: (node choice tuple, ids, hidden inputs) whose children are drafted next
    frontier = [((), ids0, hid0)]
    for lvl in range(levels):
        c = tree.children_per_level[lvl]
        nxt = []
        for choice, ids, hid in frontier:
            h_log, h_next = run(ids, hid)
            for rank, tok in enumerate(top(h_log, c)):
                node = choice + (rank,)
                out[node] = tok
                nxt.append((node, ids + [tok], hid + [h_next]))
        frontier = nxt
    return [out.get(c, -2) for c in tree.choices]


def _proposer(method, tree, mml, k=None):
    cfg, model, params = head(method)
    t = TokenTree.from_choices(tree)
    prop = EagleProposer(SpeculativeConfig(method=method, num_speculative_tokens=k or t.num_nodes,
                                           speculative_token_tree=tree),
                         model, block_size=BS, max_model_len=mml, kernel_backend="xla")
    return cfg, model, params, prop, t


@pytest.mark.smoke
@pytest.mark.parametrize("method, tree, padded", [
    ("eagle", "wide", True), ("eagle", "2x2", False), ("eagle", "2-1-2", True),
    ("eagle3", "1-3-1", False), ("eagle3", "2-1-2", True),
])
def test_tree_matches_naive_reference(method, tree, padded):
    rng = np.random.default_rng(zlib.crc32(repr((method, tree, padded)).encode()))
    cfg, model, params, prop, t = _proposer(method, TREES[tree], mml=40)
    n = 3
    reqs, table = _batch(method, cfg, rng, n, chunked=False, padded=padded)
    state = prop.init_state(NUM_BLOCKS)
    out, state = prop.propose(params, state, _inputs(method, reqs, table,
                                                     [(0, r["L"]) for r in reqs], padded, rng))
    got = np.asarray(out.token_ids)
    assert got.shape == (B_PAD, t.num_nodes)
    np.testing.assert_array_equal(out.num_drafts, [t.num_nodes] * n + [0] * (B_PAD - n))
    np.testing.assert_array_equal(got[n:], -1)
    for i, r in enumerate(reqs):
        want = naive_tree(method, model, params, r["ids"], r["hid"], r["next"], t)
        np.testing.assert_array_equal(got[i], want, err_msg=f"request {i}")


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_tree_near_max_model_len(method):
    """Requests whose root sits just below / at / past the point where a level no longer
    fits: the levels that fit match the reference, no KV is written past max_model_len."""
    tree = TREES["2-1-2"]
    t = TokenTree.from_choices(tree)
    mml = 22
    cfg, model, params, prop, _ = _proposer(method, tree, mml)
    rng = np.random.default_rng(11)
    width = 3 * 24 if method == "eagle3" else cfg.hidden_size
    # root position p = L - 1; level lvl runs iff p + cu[lvl] < mml (cu = 2, 4, 8)
    lengths = [mml - 4, mml - 3, mml - 1]
    reqs = [dict(L=L, ids=rng.integers(0, V, L), hid=rng.standard_normal((L, width)).astype(np.float32),
                 next=int(rng.integers(0, V)), rej=0, split=0) for L in lengths]
    table = rng.permutation(NUM_BLOCKS)[: 3 * 10].reshape(3, 10)
    state = prop.init_state(NUM_BLOCKS)
    before = [np.asarray(c.k).copy() for c in state.kv_caches]
    out, state = prop.propose(params, state, _inputs(method, reqs, table,
                                                     [(0, r["L"]) for r in reqs], False, rng))
    got = np.asarray(out.token_ids)
    for i, r in enumerate(reqs):
        p = r["L"] - 1
        levels = 1 + sum(p + cu < mml for cu in t.cu_level_sizes[:-1])
        want = naive_tree(method, model, params, r["ids"], r["hid"], r["next"], t, levels)
        m = t.cu_level_sizes[levels - 1]
        np.testing.assert_array_equal(got[i, :m], want[:m], err_msg=f"request {i}")
        assert ((got[i] >= 0) & (got[i] < V)).all()
    # Nothing written at logical positions >= mml of any request.
    after = [np.asarray(c.k) for c in state.kv_caches]
    for r in range(3):
        for pos in range(mml, BS * table.shape[1]):
            blk, off = table[r, pos // BS], pos % BS
            for b, a in zip(before, after):
                np.testing.assert_array_equal(a[blk, off], b[blk, off], err_msg=f"req {r} pos {pos}")


def test_chain_tree_takes_the_chain_path():
    """A chain given as a tree is chain drafting (same drafts as the default config)."""
    rng = np.random.default_rng(3)
    cfg, model, params = head("eagle")
    chain = EagleProposer(SpeculativeConfig(method="eagle", num_speculative_tokens=3), model,
                          block_size=BS, max_model_len=40, kernel_backend="xla")
    tree = EagleProposer(SpeculativeConfig(method="eagle", num_speculative_tokens=3,
                                           speculative_token_tree="[(0,), (0, 0), (0, 0, 0)]"),
                         model, block_size=BS, max_model_len=40, kernel_backend="xla")
    assert tree.token_tree.is_chain
    reqs, table = _batch("eagle", cfg, rng, 2, chunked=False, padded=True)
    inp = _inputs("eagle", reqs, table, [(0, r["L"]) for r in reqs], True, rng)
    a, _ = chain.propose(params, chain.init_state(NUM_BLOCKS), inp)
    b, _ = tree.propose(params, tree.init_state(NUM_BLOCKS), inp)
    np.testing.assert_array_equal(a.token_ids, b.token_ids)


def test_tree_no_recompile_inside_a_bucket():
    rng = np.random.default_rng(8)
    cfg, model, params, prop, _ = _proposer("eagle", TREES["2x2"], 40)
    state = prop.init_state(NUM_BLOCKS)
    before = prop.propose._cache_size()
    for n in (1, 3, 2):
        reqs, table = _batch("eagle", cfg, rng, n, chunked=False, padded=True)
        _, state = prop.propose(params, state, _inputs("eagle", reqs, table,
                                                       [(0, r["L"]) for r in reqs], True, rng))
    assert prop.propose._cache_size() - before == 1


def test_tree_construction_errors():
    _, model, _ = head("eagle")
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        EagleProposer(SpeculativeConfig(method="eagle", num_speculative_tokens=2,
                                        speculative_token_tree=TREES["2x2"]),
                      model, block_size=BS, max_model_len=40)


def test_token_tree_structure():
    t = TokenTree.from_choices(TREES["2-1-2"])
    assert t.num_nodes == 8 and t.depth == 3
    assert t.parents == (-1, -1, 0, 1, 2, 2, 3, 3)
    assert t.level_sizes == (2, 2, 4) and t.cu_level_sizes == (2, 4, 8)
    assert t.children_per_level == (2, 1, 2)
    assert t.path_to(5) == (0, 2, 5)
    m = np.array(t.ancestor_mask())
    for i in range(8):
        assert set(np.flatnonzero(m[i])) == set(t.path_to(i))
    r = np.array(t.ancestor_mask(with_root=True))
    assert r.shape == (9, 9) and r[:, 0].all() and (r[1:, 1:] == m).all() and r[0].sum() == 1
    assert TokenTree.chain(3).is_chain and not t.is_chain
    import specjax
    assert specjax.TokenTree is TokenTree


def test_tree_attention_against_brute_force():
    """``tree_mask`` in ``paged_attention``: each query sees the keys before its request's
    query block plus the keys of its ancestors in the block (NumPy softmax over exactly
    those keys)."""
    rng = np.random.default_rng(0)
    bs, nb, nkv, nh, hd = 4, 16, 2, 4, 8
    k = rng.standard_normal((nb, bs, nkv, hd)).astype(np.float32)
    v = rng.standard_normal((nb, bs, nkv, hd)).astype(np.float32)
    t = TokenTree.from_choices(TREES["1-3-1"])
    mask = t.ancestor_mask()
    qlens, seqs, tables = [7, 0, 5], [13, 0, 5], [[3, 9, 1, 4], [0, 0, 0, 0], [2, 7, 8, 5]]
    md = CommonAttentionMetadata.from_query_lens(qlens, seqs, tables, block_size=bs, num_reqs_pad=4,
                                                 num_tokens_pad=14, max_query_len=7)
    md = md.replace(tree_mask=mask)
    q = rng.standard_normal((14, nh, hd)).astype(np.float32)
    got = np.asarray(paged_attention(jnp.asarray(q), KVCache(jnp.asarray(k), jnp.asarray(v)), md,
                                     scale=0.35))
    kf, vf = k.reshape(-1, nkv, hd), v.reshape(-1, nkv, hd)
    want = np.zeros_like(q)
    tok = 0
    for ql, s, tab in zip(qlens, seqs, tables):
        for i in range(ql):
            keys = [c for c in range(s) if c < s - ql or mask[i][c - (s - ql)]]
            slots = [tab[c // bs] * bs + c % bs for c in keys]
            for h in range(nh):
                sc = kf[slots, h // 2] @ q[tok, h] * 0.35
                p = np.exp(sc - sc.max())
                want[tok, h] = (p / p.sum()) @ vf[slots, h // 2]
            tok += 1
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert not got[tok:].any()

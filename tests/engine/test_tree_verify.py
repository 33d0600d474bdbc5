"""Tree verification (``specjax.sampling``). Greedy (``tree_greedy_verify``) against a
brute-force NumPy oracle that enumerates every root-to-node path, and against the chain
sampler (``rejection_sample``) on chain trees. Random (``tree_rejection_sample``,
temperature > 0): the emitted sequences, over many keys, against their exact distribution
(every root-to-stop path enumerated in NumPy) by chi-square; a chain tree gives the chain
sampler's tokens; greedy rows of a mixed batch stay greedy."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from specjax.metadata import SpecDecodeMetadata
from specjax.sampling import (SamplingMetadata, rejection_sample, tree_greedy_verify,
                             tree_rejection_sample)
from specjax.token_tree import TokenTree


def random_tree(rng, max_depth=4, max_children=3, max_nodes=40) -> TokenTree:
    """A valid speculative tree (``from_choices`` checks it): ``c_l`` children for every
    node of level ``l - 1``, ``c_l`` random."""
    depth = int(rng.integers(1, max_depth + 1))
    levels, prev = [], [()]
    for _ in range(depth):
        c = int(rng.integers(1, max_children + 1))
        cur = [p + (i,) for p in prev for i in range(c)]
        if len(cur) + sum(map(len, levels)) > max_nodes:
            break
        levels.append(cur)
        prev = cur
    return TokenTree.from_choices([n for lv in levels for n in lv])


def irregular_tree(rng, n_nodes=12) -> TokenTree:
    """Any ancestor-closed node set sorted breadth-first (not top-k per level; the
    verifier does not need the config's regularity)."""
    nodes = {(0,)}
    while len(nodes) < n_nodes:
        cands = sorted(nodes) + [()]
        parent = cands[int(rng.integers(len(cands)))]
        kids = [n for n in nodes if len(n) == len(parent) + 1 and n[:-1] == parent]
        nodes.add(parent + (len(kids),))
    return TokenTree(tuple(sorted(nodes, key=lambda t: (len(t), t))))


def oracle(tree: TokenTree, tgt, drafts, nd):
    """Every path from the root to a present node; a path is accepted when each node's
    draft equals the target's argmax at its parent (slot 0 for the root); the longest
    accepted path wins (unique when sibling drafts differ)."""
    best = ()
    for j in range(nd):
        path = tree.path_to(j)
        slots = [0] + [1 + a for a in path[:-1]]
        if all(drafts[a] == tgt[s] for a, s in zip(path, slots)) and len(path) > len(best):
            best = path
    last = 1 + best[-1] if best else 0
    return [int(drafts[a]) for a in best] + [int(tgt[last])], list(best)


def engineered_batch(rng, tree, b, vocab=6):
    """Drafts distinct among siblings; the target follows a random path for a random
    number of levels (then random; a small vocabulary adds accidental matches)."""
    n = tree.num_nodes
    drafts = np.zeros((b, n), np.int32)
    for r in range(b):
        for j in range(n):     # distinct among siblings: rank among them + random offset
            sib = [i for i in range(n) if tree.parents[i] == tree.parents[j]]
            drafts[r, j] = sib.index(j) + int(rng.integers(0, 2)) * len(sib)
        for p in set(tree.parents):
            sib = [i for i in range(n) if tree.parents[i] == p]
            assert len(set(drafts[r, sib])) == len(sib)
    tgt = rng.integers(0, 2 * vocab, (b, n + 1)).astype(np.int32)
    nd = rng.integers(0, n + 1, b).astype(np.int32)
    nd[rng.random(b) < 0.5] = n
    for r in range(b):
        leaf = int(rng.integers(n))
        path = tree.path_to(leaf)
        a = int(rng.integers(0, len(path) + 1))
        for i in range(a):
            tgt[r, 0 if i == 0 else 1 + path[i - 1]] = drafts[r, path[i]]
    return tgt, drafts, nd




@functools.lru_cache(maxsize=None)
def _verify(tree: TokenTree):
    return jax.jit(functools.partial(tree_greedy_verify, tree=tree))


def check(tree, tgt, drafts, nd, num_reqs):
    out, nodes, n_acc = (np.asarray(x) for x in _verify(tree)(
        jnp.asarray(tgt), jnp.asarray(drafts), jnp.asarray(nd), num_reqs=jnp.int32(num_reqs)))
    b, depth = tgt.shape[0], tree.depth
    assert out.shape == (b, depth + 1) and nodes.shape == (b, depth) and n_acc.shape == (b,)
    assert out.dtype == nodes.dtype == n_acc.dtype == np.int32
    for r in range(b):
        if r >= num_reqs:     # padding rows: nothing
            assert (out[r] == -1).all() and (nodes[r] == -1).all() and n_acc[r] == 0
            continue
        want, path = oracle(tree, tgt[r], drafts[r], int(nd[r]))
        np.testing.assert_array_equal(out[r], want + [-1] * (depth + 1 - len(want)), err_msg=f"row {r}")
        np.testing.assert_array_equal(nodes[r], path + [-1] * (depth - len(path)))
        assert n_acc[r] == len(path)
    return n_acc[:num_reqs]


@pytest.mark.parametrize("seed", range(3))
def test_random_trees_match_oracle(seed):
    rng = np.random.default_rng(seed)
    seen = set()
    for i in range(5):
        tree = random_tree(rng) if i % 3 else irregular_tree(rng, int(rng.integers(2, 16)))
        b = int(rng.integers(1, 9))
        num_reqs = int(rng.integers(0, b + 1)) if i % 2 else b
        tgt, drafts, nd = engineered_batch(rng, tree, b)
        seen.update(check(tree, tgt, drafts, nd, num_reqs).tolist())
    assert len(seen) >= 3          # accepted at several depths


def test_all_and_none_accepted():
    rng = np.random.default_rng(11)
    tree = TokenTree.from_choices([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1),
                                   (0, 0, 0), (0, 1, 0), (1, 0, 0), (1, 1, 0), (2, 0, 0), (2, 1, 0)])
    assert tree.children_per_level == (3, 2, 1)
    n, b = tree.num_nodes, 4
    drafts = np.tile(np.arange(n, dtype=np.int32) % 3 + 10 * np.array(tree.depths), (b, 1))
    for leaf in range(9, 15):                      # every full-depth path accepted
        path = tree.path_to(leaf)
        tgt = np.full((b, n + 1), 50, np.int32)
        tgt[:, 0] = drafts[0, path[0]]
        for a, c in zip(path[:-1], path[1:]):
            tgt[:, 1 + a] = drafts[0, c]
        tgt[:, 1 + leaf] = 7                       # bonus
        n_acc = check(tree, tgt, drafts, np.full(b, n, np.int32), b)
        assert (n_acc == 3).all()
        out = np.asarray(_verify(tree)(tgt, drafts)[0])
        assert out[0].tolist() == [int(drafts[0, a]) for a in path] + [7]
    tgt = np.full((b, n + 1), 50, np.int32)         # nothing accepted: the root's argmax
    out, nodes, n_acc = (np.asarray(x) for x in _verify(tree)(tgt, drafts))
    assert (out[:, 0] == 50).all() and (out[:, 1:] == -1).all() and (nodes == -1).all()
    assert (n_acc == 0).all()
    # a truncated tree (breadth-first prefix): the level-3 nodes are absent
    tgt, _, _ = engineered_batch(rng, tree, b)
    check(tree, tgt, drafts, np.full(b, 9, np.int32), b - 1)


def test_duplicate_sibling_drafts_take_the_first_in_tree_order():
    tree = TokenTree.from_choices([(0,), (1,), (0, 0), (1, 0)])
    drafts = np.array([[5, 5, 1, 2]], np.int32)     # both children of the root draft 5
    tgt = np.array([[5, 2, 2, 9, 8]], np.int32)      # (1,)'s child would match, (0,)'s not
    out, nodes, n_acc = (np.asarray(x) for x in _verify(tree)(tgt, drafts))
    assert out.tolist() == [[5, 2, -1]] and nodes.tolist() == [[0, -1]] and n_acc.tolist() == [1]


@pytest.mark.parametrize("k", [1, 4])
def test_chain_tree_equals_chain_rejection_sampler(k):
    rng = np.random.default_rng(k)
    tree = TokenTree.chain(k)
    b, vocab = 8, 5
    for _ in range(4):
        tgt, drafts, nd = engineered_batch(rng, tree, b, vocab=vocab)
        num_reqs = int(rng.integers(1, b + 1))
        check(tree, tgt, drafts, nd, num_reqs)
        lists = [drafts[r, : nd[r]].tolist() for r in range(num_reqs)]
        meta = SpecDecodeMetadata.from_draft_lists(lists, num_reqs_pad=b, num_drafts_pad=b * k,
                                                   max_spec_len=k)
        v = 2 * vocab
        logits = np.zeros((b * k + b, v), np.float32)
        tli, bli = np.asarray(meta.target_logits_indices), np.asarray(meta.bonus_logits_indices)
        flat = 0
        for r in range(num_reqs):
            for j in range(int(nd[r])):
                logits[tli[flat], tgt[r, j]] = 1.0
                flat += 1
            logits[bli[r], tgt[r, nd[r]]] = 1.0
        chain = np.asarray(rejection_sample(meta, None, jnp.asarray(logits),
                                            SamplingMetadata.create(np.zeros(b))))
        tree_out = np.asarray(_verify(tree)(tgt, drafts, nd, num_reqs=num_reqs)[0])
        np.testing.assert_array_equal(tree_out, chain)


def test_tree_rejection_sample_greedy_rows_are_tree_greedy_verify():
    tree = TokenTree(((0,), (1,), (0, 0)))
    rng = np.random.default_rng(0)
    b = 6
    logits = jnp.asarray(rng.normal(size=(b, 4, 9)), jnp.float32)
    drafts = jnp.asarray(rng.integers(0, 9, (b, 3)), jnp.int32)
    drafts = drafts.at[:, 0].set(jnp.argmax(logits[:, 0], -1))    # some acceptances
    nd = jnp.asarray([3, 3, 1, 0, 2, 3], jnp.int32)
    sample = jax.jit(functools.partial(tree_rejection_sample, tree=tree))
    ref = _verify(tree)(jnp.argmax(logits, -1), drafts, nd, num_reqs=5)
    out = sample(logits, drafts, nd, SamplingMetadata.create(np.zeros(b)), num_reqs=5)
    for a, r in zip(out, ref):
        np.testing.assert_array_equal(a, r)
    temps = np.array([0.0, 1.0, 0.0, 0.7, 0.0, 0.0])            # mixed batch
    mixed = sample(logits, drafts, nd, SamplingMetadata.create(temps), num_reqs=5)
    g = temps == 0
    for a, r in zip(mixed, ref):
        np.testing.assert_array_equal(np.asarray(a)[g], np.asarray(r)[g])
    assert (np.asarray(mixed[0])[5] == -1).all() and int(mixed[2][5]) == 0    # padding row
    with pytest.raises(ValueError, match="N=3"):
        tree_greedy_verify(jnp.zeros((2, 3), jnp.int32), drafts, tree=tree)


# --- random (temperature > 0) tree verification --------------------------------------


def processed_probs(logits, temperature, top_k, top_p):
    """NumPy ``softmax(_process(...))`` of ``[..., V]`` logits (float64)."""
    x = np.asarray(logits, np.float64) / temperature
    v = x.shape[-1]
    srt = -np.sort(-x, axis=-1)
    if 0 < top_k < v:
        x = np.where(x < srt[..., top_k - 1 : top_k], -np.inf, x)
    p = np.exp(x - x.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    if top_p < 1:
        order = np.argsort(-p, axis=-1, kind="stable")
        ps = np.take_along_axis(p, order, -1)
        before = np.cumsum(ps, -1) - ps
        keep_sorted = (before < top_p) | (np.arange(v) == 0)
        thr = np.take_along_axis(ps, keep_sorted.sum(-1, keepdims=True) - 1, -1)
        p = np.where(p < thr, 0.0, p)
        p /= p.sum(-1, keepdims=True)
    return p


def exact_outcomes(tree: TokenTree, probs, drafts, nd) -> dict:
    """Every sequence the verifier can emit, with its probability under the target: each
    token ~ ``p`` at the current node; a token that is a present child's draft moves there,
    any other token ends the sequence (recovered, or bonus at a node without children)."""
    out = {}

    def walk(node, prefix, prob):
        kids = {int(drafts[j]): j for j in range(nd) if tree.parents[j] == node}
        for t, pt in enumerate(probs[node + 1]):
            if pt > 0:
                if t in kids:
                    walk(kids[t], prefix + (t,), prob * pt)
                else:
                    out[prefix + (t,)] = prob * pt

    walk(-1, (), 1.0)
    return out


def chi2_sequences(rows, expected: dict) -> float:
    """p-value of the emitted sequences (``[B, depth+1]`` rows, -1 padded) against
    ``expected``; bins expecting < 5 are merged. Asserts no impossible sequence."""
    counts = {}
    for r in np.asarray(rows):
        key = tuple(int(t) for t in r if t != -1)
        counts[key] = counts.get(key, 0) + 1
    bad = [k for k in counts if k not in expected]
    assert not bad, f"impossible sequences emitted: {bad[:5]}"
    n = len(rows)
    keys = sorted(expected)
    exp = np.array([expected[k] for k in keys]) * n
    obs = np.array([counts.get(k, 0) for k in keys], np.float64)
    big = exp >= 5
    if (~big).any():
        obs = np.append(obs[big], obs[~big].sum())
        exp = np.append(exp[big], exp[~big].sum())
    return stats.chisquare(obs, exp * (obs.sum() / exp.sum())).pvalue


TREE_32 = TokenTree.from_choices([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)])


def random_case(seed, tree, vocab=6, scale=1.5):
    """Per-node target logits and drafts distinct among siblings; the root's children
    draft its two likeliest tokens and one other (frequent acceptances, some rejections)."""
    rng = np.random.default_rng(seed)
    n = tree.num_nodes
    logits = (rng.normal(size=(n + 1, vocab)) * scale).astype(np.float32)
    drafts = np.zeros(n, np.int32)
    for p in (-1,) + tuple(range(n)):
        kids = [j for j in range(n) if tree.parents[j] == p]
        if not kids:
            continue
        order = np.argsort(-logits[p + 1])
        pick = list(order[:2]) + list(rng.permutation(order[2:]))
        drafts[kids] = np.array(pick[: len(kids)], np.int32)
    return logits, drafts


@functools.lru_cache(maxsize=None)
def _sample(tree: TokenTree):
    return jax.jit(functools.partial(tree_rejection_sample, tree=tree))


N_ROWS = 20000


@pytest.mark.parametrize("temperature,top_k,top_p,nd", [
    (1.0, 0, 1.0, 9), (0.7, 3, 1.0, 9), (1.3, 0, 0.8, 9), (1.0, 0, 1.0, 5)])
def test_random_tree_verification_is_lossless(temperature, top_k, top_p, nd):
    """Chi-square (alpha 1e-3) of the emitted sequences against their exact distribution
    for a tree branching at the root and below; with top-k / top-p (drafts the target
    cannot emit) and a truncated tree (nodes 5.. absent: (1,) and (2,) are leaves)."""
    tree = TREE_32
    logits, drafts = random_case(int(temperature * 10) + top_k + nd, tree)
    probs = processed_probs(logits, temperature, top_k, top_p)
    expected = exact_outcomes(tree, probs, drafts, nd)
    assert abs(sum(expected.values()) - 1) < 1e-9
    b = N_ROWS
    sm = SamplingMetadata.create(np.full(b, temperature), np.full(b, top_k), np.full(b, top_p),
                                 seeds=np.arange(b) + 1000 * nd)
    out, nodes, n_acc = (np.asarray(x) for x in _sample(tree)(
        jnp.asarray(np.broadcast_to(logits, (b,) + logits.shape)),
        jnp.asarray(np.broadcast_to(drafts, (b, tree.num_nodes))),
        jnp.full((b,), nd, jnp.int32), sm))
    assert chi2_sequences(out, expected) > 1e-3
    # accepted nodes: a path of present nodes whose drafts are the emitted tokens
    seen = set(np.unique(n_acc).tolist())
    assert seen <= {0, 1, 2} and 2 in seen
    for r in range(200):
        path = [int(a) for a in nodes[r] if a >= 0]
        assert len(path) == n_acc[r] and all(a < nd for a in path)
        if path:
            assert tuple(path) == tree.path_to(path[-1])
        assert [int(drafts[a]) for a in path] == out[r, : len(path)].tolist()
    # acceptance is what the rule gives: P(first token accepted) = p_root(drafted children)
    kids = drafts[[j for j in range(nd) if tree.parents[j] == -1]]
    p_acc = probs[0, kids].sum()
    assert abs((n_acc > 0).mean() - p_acc) < 4 * np.sqrt(p_acc * (1 - p_acc) / b) + 1e-9


@pytest.mark.parametrize("k", [1, 3])
def test_random_chain_tree_equals_chain_rejection_sampler(k):
    """A chain tree at temperature > 0: the chain sampler's tokens for the same keys (same
    key streams), and both distributed as the target (chi-square)."""
    tree = TokenTree.chain(k)
    logits, drafts = random_case(k, tree, scale=1.0)
    drafts = np.argsort(-logits[:k], axis=1)[:, 1].astype(np.int32)   # second likeliest
    b = N_ROWS // 2
    temps = np.full(b, 0.9, np.float32)
    temps[::7] = 0.0                                                  # a few greedy rows
    sm = SamplingMetadata.create(temps, seeds=np.arange(b))
    nd = np.full(b, k, np.int32)
    nd[::5] = np.arange(len(nd[::5])) % (k + 1)                       # some shorter chains
    out, _, _ = (np.asarray(x) for x in _sample(tree)(
        jnp.asarray(np.broadcast_to(logits, (b,) + logits.shape)),
        jnp.asarray(np.broadcast_to(drafts, (b, k))), jnp.asarray(nd), sm))
    meta = SpecDecodeMetadata.from_draft_lists([drafts[: nd[r]].tolist() for r in range(b)],
                                               num_reqs_pad=b, num_drafts_pad=b * k, max_spec_len=k)
    lg = np.zeros((b * k + b, logits.shape[1]), np.float32)
    tli, bli = np.asarray(meta.target_logits_indices), np.asarray(meta.bonus_logits_indices)
    flat = 0
    for r in range(b):
        lg[tli[flat : flat + nd[r]]] = logits[: nd[r]]
        flat += nd[r]
        lg[bli[r]] = logits[nd[r]]
    chain = np.asarray(rejection_sample(meta, None, jnp.asarray(lg), sm))
    np.testing.assert_array_equal(out, chain)
    full = (temps > 0) & (nd == k)
    probs = processed_probs(logits, 0.9, 0, 1.0)
    assert chi2_sequences(out[full], exact_outcomes(tree, probs, drafts, k)) > 1e-3
    assert chi2_sequences(chain[full], exact_outcomes(tree, probs, drafts, k)) > 1e-3

"""Tree verification of EAGLE / EAGLE-3 ``speculative_token_tree`` drafts (vLLM verifies
every draft as a chain): greedy (``tree_greedy_verify``) and lossless multi-draft rejection
sampling (``tree_rejection_sample``); a chain tree is exactly the chain rule.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.sampling.metadata import (_STREAM_ACCEPT, _STREAM_BONUS, _STREAM_RECOVER,
                                       GREEDY_TEMPERATURE, PLACEHOLDER_TOKEN_ID, SamplingMetadata,
                                       _keys, _post, _pre)

def tree_greedy_verify(target_token_ids: jax.Array, draft_token_ids: jax.Array,
                       num_drafts: jax.Array | None = None, *, tree, num_reqs=None
                       ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Greedy verification of a static token ``tree`` (traceable): from the root, the first
    child whose draft equals the target's argmax is accepted, until none does.

    ``target_token_ids [B, 1 + N]`` int32: the target argmax per slot (0: the root, ``1 +
    j``: node ``j``); ``draft_token_ids [B, N]`` int32 in tree order; ``num_drafts [B]``
    (None: all): nodes ``j >= num_drafts[b]`` absent; ``num_reqs``: rows past it are
    padding. Returns int32 ``(output [B, depth + 1], accepted_nodes [B, depth],
    num_accepted [B])``: accepted drafts then the bonus / recovered token, the accepted
    node indices, their count; -1 / 0 after and on padding rows.
    """
    n, depth = tree.num_nodes, tree.depth
    tgt = jnp.asarray(target_token_ids).astype(jnp.int32)
    drafts = jnp.asarray(draft_token_ids).astype(jnp.int32)
    b = tgt.shape[0]
    if tgt.shape != (b, n + 1) or drafts.shape != (b, n):
        raise ValueError(f"target_token_ids must be [B, 1+N] and draft_token_ids [B, N] with "
                         f"N={n} tree nodes; got {tgt.shape} and {drafts.shape}")
    rows = jnp.arange(b, dtype=jnp.int32)
    real = jnp.ones((b,), bool) if num_reqs is None else rows < num_reqs
    nd = jnp.full((b,), n, jnp.int32) if num_drafts is None else jnp.asarray(num_drafts, jnp.int32)
    parents = tree.parents
    cur = jnp.full((b,), -1, jnp.int32)                # current node, -1 = the root
    alive = real
    accepted = []
    start = 0
    for size in tree.level_sizes:                      # static: one small step per level
        nodes = jnp.arange(start, start + size, dtype=jnp.int32)
        par = jnp.asarray(parents[start : start + size], jnp.int32)
        at_cur = jnp.take_along_axis(tgt, (cur + 1)[:, None], axis=1)       # [B, 1]
        match = ((par[None, :] == cur[:, None]) & (drafts[:, start : start + size] == at_cur)
                 & (nodes[None, :] < nd[:, None]) & alive[:, None])          # [B, size]
        hit = match.any(axis=1)
        first = nodes[jnp.argmax(match, axis=1)]
        alive = alive & hit
        cur = jnp.where(alive, first, cur)
        accepted.append(jnp.where(alive, first, -1))
        start += size
    acc_nodes = jnp.stack(accepted, axis=1)            # [B, depth]
    n_acc = (acc_nodes >= 0).sum(axis=1).astype(jnp.int32)
    acc_tokens = jnp.take_along_axis(drafts, jnp.maximum(acc_nodes, 0), axis=1)
    bonus = jnp.take_along_axis(tgt, (cur + 1)[:, None], axis=1)[:, 0]
    jj = jnp.arange(depth + 1, dtype=jnp.int32)[None, :]
    ext = jnp.concatenate([acc_tokens, jnp.zeros((b, 1), jnp.int32)], axis=1)
    out = jnp.where(jj < n_acc[:, None], ext, PLACEHOLDER_TOKEN_ID)
    out = jnp.where(jj == n_acc[:, None], bonus[:, None], out)
    out = jnp.where(real[:, None], out, PLACEHOLDER_TOKEN_ID)
    return out, acc_nodes, jnp.where(real, n_acc, 0)


def _tree_children(tree) -> tuple[tuple[tuple[int, ...], ...], tuple[int, ...]]:
    """Static ``(kids, max_kids)``: ``kids[1 + i]`` node ``i``'s children (``kids[0]`` the
    root's), -1 padded; ``max_kids[l]`` the most children of a level-``l`` node."""
    n = tree.num_nodes
    kids = [[] for _ in range(n + 1)]
    for j, p in enumerate(tree.parents):
        kids[p + 1].append(j)
    level_of = (0,) + tree.depths                      # level of slot 1 + i (root 0)
    max_kids = [0] * (tree.depth + 1)
    for s, ks in enumerate(kids):
        max_kids[level_of[s]] = max(max_kids[level_of[s]], len(ks))
    width = max(max_kids)
    table = tuple(tuple(ks + [-1] * (width - len(ks))) for ks in kids)
    return table, tuple(max_kids)


def _tree_prefix(draft_token_ids: jax.Array, tree, v: int):
    """Tree verification: slot 0 (the root) has no prefix; slot ``1 + j`` the drafted tokens
    of node ``j``'s path from level 1 down to ``j`` (``[B, 1 + N, depth]``, ``[B, 1 + N]``)."""
    n, depth = tree.num_nodes, tree.depth
    paths = [[]]
    for j in range(n):
        p = tree.parents[j]
        paths.append((paths[p + 1] if p >= 0 else []) + [j])
    table = jnp.asarray([pp + [0] * (depth - len(pp)) for pp in paths], jnp.int32)
    lens = jnp.asarray([len(pp) for pp in paths], jnp.int32)
    d = jnp.clip(jnp.asarray(draft_token_ids).astype(jnp.int32), 0, v - 1)
    b = d.shape[0]
    tok = d[:, table]                                   # [B, 1 + N, depth]
    return tok, jnp.broadcast_to(lens[None, :], (b, n + 1))


def tree_rejection_sample(target_logits: jax.Array, draft_token_ids: jax.Array,
                          num_drafts: jax.Array | None, sampling: SamplingMetadata, *, tree,
                          num_reqs=None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Verify tree drafts from the target's logits ``[B, 1 + N, V]``; other arguments and
    outputs as ``tree_greedy_verify``. Greedy rows: its argmax walk; random rows: lossless
    multi-draft rejection sampling with ``rejection_sample``'s keys, so a chain tree gives
    chain verification's tokens (docs/sampling.md, "Tree verification").
    """
    n, depth = tree.num_nodes, tree.depth
    logits = target_logits.astype(jnp.float32)
    if sampling.procs is not None:     # slot 1 + j sees node j's path (its drafts) as output
        logits = _pre(logits, sampling, *_tree_prefix(draft_token_ids, tree, logits.shape[-1]))
    tgt = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    greedy = tree_greedy_verify(tgt, draft_token_ids, num_drafts, tree=tree, num_reqs=num_reqs)
    if sampling.all_greedy:
        return greedy
    drafts = jnp.asarray(draft_token_ids).astype(jnp.int32)
    b, v = logits.shape[0], logits.shape[-1]
    rows = jnp.arange(b, dtype=jnp.int32)
    real = jnp.ones((b,), bool) if num_reqs is None else rows < num_reqs
    nd = jnp.full((b,), n, jnp.int32) if num_drafts is None else jnp.asarray(num_drafts, jnp.int32)
    probs = jax.nn.softmax(_post(logits, sampling), axis=-1)
    u = jax.vmap(lambda kk: jax.random.uniform(kk, (n,)))(_keys(sampling.keys, _STREAM_ACCEPT, 0))
    kids, max_kids = _tree_children(tree)
    kids = jnp.asarray(kids, jnp.int32)                # [1 + N, W]
    safe = jnp.clip(drafts, 0, v - 1)
    vocab = jnp.arange(v, dtype=jnp.int32)[None, :]

    cur = jnp.full((b,), -1, jnp.int32)                # current node, -1 = the root
    walking = real                                      # still descending
    rejected = jnp.zeros((b,), bool)                    # stopped: every child rejected
    resid = jnp.zeros((b, v), jnp.float32)              # residual at the stop (rejected rows)
    level = jnp.zeros((b,), jnp.int32)                  # level of the final node
    accepted = []
    for lv in range(depth):                             # static: the tree's levels
        r = jnp.take_along_axis(probs, (cur + 1)[:, None, None], axis=1)[:, 0]   # [B, V]
        any_rej = jnp.zeros((b,), bool)
        present = jnp.zeros((b,), bool)
        hit = jnp.full((b,), -1, jnp.int32)
        for c in range(max_kids[lv]):                   # static: children tried in order
            j = kids[cur + 1, c]                        # [B], -1 past the node's children
            jc = jnp.maximum(j, 0)
            try_ = walking & (hit < 0) & (j >= 0) & (jc < nd)
            tok = jnp.take_along_axis(safe, jc[:, None], axis=1)[:, 0]
            rc = jnp.take_along_axis(r, tok[:, None], axis=1)[:, 0]
            total = jnp.where(any_rej, r.sum(axis=1), 1.0)
            uj = jnp.take_along_axis(u, jc[:, None], axis=1)[:, 0]
            acc = try_ & ((uj * total < rc) | (rc >= total))
            rej = try_ & ~acc
            hit = jnp.where(acc, j, hit)
            r = jnp.where(rej[:, None] & (vocab == tok[:, None]), 0.0, r)
            any_rej = any_rej | rej
            present = present | try_
        stop_rej = walking & present & (hit < 0)
        resid = jnp.where(stop_rej[:, None], r, resid)
        rejected = rejected | stop_rej
        level = jnp.where(walking & ~(hit >= 0), lv, level)
        walking = walking & (hit >= 0)
        cur = jnp.where(walking, hit, cur)
        accepted.append(jnp.where(walking, hit, -1))
    level = jnp.where(walking, depth, level)
    acc_nodes = jnp.stack(accepted, axis=1)             # [B, depth]
    n_acc = (acc_nodes >= 0).sum(axis=1).astype(jnp.int32)

    # the final token: recovered (residual, key RECOVER level) or bonus (p at cur, BONUS 0)
    rec_base = jax.vmap(lambda kk: jax.random.fold_in(kk, _STREAM_RECOVER))(
        jax.random.wrap_key_data(sampling.keys))
    rec_keys = jax.vmap(jax.random.fold_in)(rec_base, level)      # as _keys(.., RECOVER, level)
    q_rec = jax.vmap(lambda kk: jax.random.exponential(kk, (v,)))(rec_keys)
    q_bonus = jax.vmap(lambda kk: jax.random.exponential(kk, (v,)))(
        _keys(sampling.keys, _STREAM_BONUS, 0))
    p_cur = jnp.take_along_axis(probs, (cur + 1)[:, None, None], axis=1)[:, 0]
    last = jnp.where(rejected, jnp.argmax(resid / q_rec, axis=-1),
                     jnp.argmax(p_cur / q_bonus, axis=-1)).astype(jnp.int32)

    acc_tokens = jnp.take_along_axis(drafts, jnp.maximum(acc_nodes, 0), axis=1)
    jj = jnp.arange(depth + 1, dtype=jnp.int32)[None, :]
    ext = jnp.concatenate([acc_tokens, jnp.zeros((b, 1), jnp.int32)], axis=1)
    out = jnp.where(jj < n_acc[:, None], ext, PLACEHOLDER_TOKEN_ID)
    out = jnp.where(jj == n_acc[:, None], last[:, None], out)
    out = jnp.where(real[:, None], out, PLACEHOLDER_TOKEN_ID)
    n_acc = jnp.where(real, n_acc, 0)

    g = (sampling.temperature == GREEDY_TEMPERATURE)
    return (jnp.where(g[:, None], greedy[0], out), jnp.where(g[:, None], greedy[1], acc_nodes),
            jnp.where(g, greedy[2], n_acc))

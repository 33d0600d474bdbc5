"""Tree verification (EAGLE / EAGLE-3 ``speculative_token_tree``; specjax's own: vLLM
v0.20 verifies every draft as a chain).

``tree_greedy_verify`` walks the tree from the root on the target's argmax;
``tree_rejection_sample`` verifies from logits, greedy rows as ``tree_greedy_verify`` and
random rows (temperature > 0) by multi-draft rejection sampling of the certain drafts level
by level (siblings tried in tree order against the residual left by the rejected ones;
recovered token from the final residual, bonus token at a node without drafted children):
lossless, and a chain tree is exactly the chain rule.
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
    """Greedy verification of a token tree (traceable; the tree is static).

    Walk from the root: at the current node (the root first) the target's argmax is
    compared with the drafted tokens of the node's children, in tree order; the first
    child that matches is accepted and the walk continues from it, otherwise it stops.
    (Drafts of one level are distinct in a top-k tree, so at most one child matches;
    otherwise the first in tree order wins.) The emitted tokens are the accepted drafts,
    then the target's argmax at the last accepted node (the bonus / recovered token).

    Args:
      target_token_ids: ``[B, 1 + N] int32``, the target's argmax at every query slot of
        the verification pass: slot 0 is the root (the last committed token), slot
        ``1 + j`` is node ``j``.
      draft_token_ids: ``[B, N] int32``, the drafted token of each node, in tree order
        (``tree.choices``).
      num_drafts: ``[B] int32`` or None (all ``N``): nodes ``j >= num_drafts[b]`` are
        absent. A prefix of the breadth-first node order holds every ancestor of its
        nodes, so any prefix is a valid (truncated) tree; 0 verifies the root only.
      tree: a ``specjax.token_tree.TokenTree`` (static).
      num_reqs: 0-d int or None (every row real): rows ``>= num_reqs`` are padding.

    Returns:
      ``(output, accepted_nodes, num_accepted)``:

      * ``output [B, depth + 1] int32``: as ``rejection_sample`` (the chain version):
        accepted drafts, then the target's argmax at the last accepted node; -1 after. A
        real row without drafts gives just the root's argmax; padding rows are all -1.
      * ``accepted_nodes [B, depth] int32``: the accepted node indices, level 1 first;
        -1 after the last (and on padding rows).
      * ``num_accepted [B] int32`` (0 on padding rows).

    A chain tree (``TokenTree.chain(k)``) gives exactly ``rejection_sample``'s greedy
    output.
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
    """Static: ``(kids, max_kids)``: ``kids[1 + i]`` the children of node ``i`` in tree
    order (``kids[0]`` the root's), padded with -1 to the widest; ``max_kids[l]`` the most
    children of any node of level ``l`` (the root is level 0)."""
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
    """Verify tree drafts from the target's logits ``[B, 1 + N, V]`` (slot 0 the root,
    slot ``1 + j`` node ``j``); same arguments (``draft_token_ids [B, N]``, ``num_drafts``,
    ``tree``, ``num_reqs``) and outputs as ``tree_greedy_verify``.

    Greedy rows (temperature 0) are ``tree_greedy_verify`` of the argmax. Random rows use
    multi-draft rejection sampling for certain drafts (a tree proposer drafts point masses,
    distinct among siblings): at the current node (the root first) let ``r = p``, the
    target's processed distribution (``_process``: temperature, top-k, top-p) at the
    node's slot; its present children ``c_1, c_2, ...`` (nodes ``< num_drafts``) are tried
    in tree order: ``c_j`` is accepted when ``u_j * sum(r) < r(c_j)`` (``u_j`` uniform,
    one per node; ``sum(r)`` is taken as 1 before any rejection) or when ``c_j`` holds all
    of ``r``'s mass (float rounding), otherwise
    ``r(c_j) = 0`` and the next child is tried. An accepted child becomes the current
    node; when every child is rejected the walk emits a token sampled from the residual
    ``r`` (the recovered token) and stops; at a node without present children it emits a
    token sampled from ``p`` there (the bonus token). Each emitted token is then
    distributed exactly as the target's ``p`` (lossless); a chain tree is vLLM's rule for
    ``draft_probs=None``.

    Randomness (per request, from ``sampling.keys[r]`` only, as ``rejection_sample``):
    ``u_j`` is element ``j`` of ``uniform(_keys(keys, ACCEPT, 0), (N,))``; the recovered
    token at a node of level ``l`` (root 0) uses ``exponential(_keys(keys, RECOVER, l),
    (V,))`` and the bonus token ``exponential(_keys(keys, BONUS, 0), (V,))``, both with
    the exponential trick (``argmax r / q``). These are the keys ``rejection_sample`` uses
    for draft position / accepted count ``l``, so a chain tree of ``k`` nodes gives the
    same tokens as chain verification with ``max_spec_len = k``.
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

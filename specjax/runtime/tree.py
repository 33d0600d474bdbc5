"""Tree verification's traceable pieces: the accepted nodes' KV compaction
(:func:`compact_tree_kv`) and the chain-shaped batch the proposer drafts from after a tree
step (:func:`tree_chain_inputs`)."""

from __future__ import annotations

import jax.numpy as jnp

from specjax.attention_metadata import CommonAttentionMetadata
from specjax.token_tree import TokenTree

__all__ = ["compact_tree_kv", "tree_chain_inputs", "token_slots"]


def token_slots(block_table, rows, pos, block_size: int):
    """Flat KV slot of logical position ``pos`` of request ``rows`` (same shapes)."""
    c = block_table.shape[1]
    blk = block_table[rows, jnp.clip(pos // block_size, 0, c - 1)]
    return blk * block_size + pos % block_size


def compact_tree_kv(kv_caches, block_table, root_pos, accepted_nodes, num_accepted, real, *,
                    block_size: int, move_kv=None):
    """Move the accepted nodes' KV to where the accepted tokens now sit (traceable).

    Node ``j``'s K / V was written at logical position ``p + 1 + j`` (``p = root_pos``); after
    accepting nodes ``a_1..a_m`` (one per level) position ``p + 1 + a_i`` is copied to ``p + i``
    in every ``[num_blocks, block_size, ...]`` leaf of ``kv_caches``, through ``block_table``.
    Sources are gathered before any write; entries already in place, past ``num_accepted`` or
    on rows not ``real`` write nothing. ``move_kv``: the target's (default: specjax's
    paged layout, ``kv_cache.move_slots``)."""
    from specjax.kernels.paged_attention.kv_cache import move_slots

    b, depth = accepted_nodes.shape
    i = jnp.arange(1, depth + 1, dtype=jnp.int32)[None, :]
    move = real[:, None] & (i <= num_accepted[:, None]) & (accepted_nodes + 1 != i)
    rows = jnp.broadcast_to(jnp.arange(b, dtype=jnp.int32)[:, None], (b, depth))
    src = token_slots(block_table, rows, root_pos[:, None] + 1 + jnp.maximum(accepted_nodes, 0), block_size)
    dst = token_slots(block_table, rows, root_pos[:, None] + i, block_size)
    src = jnp.where(move, src, 0).reshape(-1)
    dst = jnp.where(move, dst, -1).reshape(-1)
    return (move_kv or move_slots)(kv_caches, src, dst)


def tree_chain_inputs(input_ids, cad: CommonAttentionMetadata, accepted_nodes, num_accepted, *,
                      tree: TokenTree, block_size: int, padded: bool = True):
    """The proposer's chain-shaped batch after a tree verification (traceable).

    Request ``r``'s block ``[root, node 0 .. node n_r-1]`` (root at ``p = seq_len - query_len``)
    becomes ``[root, a_1, .., a_m]`` (its accepted nodes, their KV moved to ``p + i``), plus, in
    padded mode, ``D_r - m`` rejected slots (``D_r``: its deepest node's depth) as chain
    drafting leaves them. Returns ``(token_ids [T], positions [T], src [T], attn_metadata,
    token_indices_to_sample [B], num_rejected_tokens [B])``; ``src`` indexes the verified
    batch; the last two are None in non-padded mode."""
    depth = tree.depth
    t_pad = input_ids.shape[0]
    qsl = cad.query_start_loc
    bp = qsl.shape[0] - 1
    qlen = qsl[1:] - qsl[:-1]
    real = jnp.arange(bp, dtype=jnp.int32) < cad.num_reqs
    n_nodes = jnp.where(real, qlen - 1, 0)
    d_r = jnp.asarray((0,) + tree.depths, jnp.int32)[n_nodes]   # a prefix's last node is deepest
    m = jnp.where(real, num_accepted, 0)
    length = jnp.where(real, 1 + (d_r if padded else m), 0)
    qsl_c = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(length).astype(jnp.int32)])
    p = jnp.where(real, cad.seq_lens - qlen, 0)
    t = jnp.arange(t_pad, dtype=jnp.int32)
    r_t = jnp.minimum(jnp.sum(qsl_c[None, 1:] <= t[:, None], axis=1, dtype=jnp.int32), bp - 1)
    i_t = t - qsl_c[r_t]
    valid = t < qsl_c[-1]
    node = accepted_nodes[r_t, jnp.clip(i_t - 1, 0, depth - 1)]
    off = jnp.where(i_t == 0, 0, jnp.where(i_t <= m[r_t], node + 1, i_t))
    src = jnp.clip(jnp.where(valid, qsl[r_t] + off, 0), 0, t_pad - 1)
    pos = jnp.where(valid, p[r_t] + i_t, 0)
    slots = jnp.where(valid, token_slots(cad.block_table, r_t, pos, block_size), -1)
    seq = jnp.where(real, p + length, 0)
    md = cad.replace(query_start_loc=qsl_c, seq_lens=seq, slot_mapping=slots.astype(jnp.int32),
                     num_actual_tokens=qsl_c[-1], max_seq_len=jnp.max(seq).astype(jnp.int32),
                     causal=True, tree_mask=None)
    ids = jnp.where(valid, input_ids[src], 0)
    if not padded:
        return ids, pos, src, md, None, None
    tis = jnp.where(real, qsl_c[:-1] + m, 0)
    nrej = jnp.where(real, d_r - m, 0)
    return ids, pos, src, md, tis, nrej

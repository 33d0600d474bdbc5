"""Tree drafting (vLLM ``SpecDecodeBaseProposer.propose_tree``), for EAGLE / EAGLE-3: one
forward per level over every node so far under tree attention, the top ``c`` tokens of
each newest node as its children; levels unrolled at trace time. Node ``j``'s KV sits at
``p + 1 + j`` on every level (vLLM's differ; docs/integration.md, "How the device
proposers draft").
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from specjax.attention_metadata import CommonAttentionMetadata
from specjax.constants import PADDING_SLOT_ID
from specjax.token_tree import TokenTree

_I32 = jnp.int32

#: ``top(params, hidden [M, H], c) -> [M, c] int32``: the ``c`` best tokens (target ids)
#: of each row, best first; ``c == 1`` is the greedy argmax.
TopFn = Callable[[Any, jax.Array, int], jax.Array]
#: ``forward(params, ids [T], positions [T], hidden [T, H], caches, md)
#:  -> (hidden for logits [T, H], hidden for the next step [T, H], caches)``.
ForwardFn = Callable[..., tuple[jax.Array, jax.Array, Any]]


def tree_drafts(tree: TokenTree, forward: ForwardFn, top: TopFn, params: Any,
                logits_hidden: jax.Array, next_hidden: jax.Array, positions: jax.Array,
                seq_lens: jax.Array, cad: CommonAttentionMetadata, caches: Any, *,
                block_size: int, max_model_len: int) -> tuple[jax.Array, Any]:
    """Draft every node of the static ``tree`` for each request.

    ``forward`` / ``top``: the head's forward and top-k selection; ``logits_hidden`` /
    ``next_hidden [B, H]``: first-pass outputs at each sampled index; ``positions [B]``: the
    root's position ``p``; ``seq_lens [B]``: context length through the root; ``cad``: the
    first pass's metadata; ``caches``: the draft KV caches after it. Returns ``(drafts [B,
    num_nodes] int32 in tree order, caches)``.
    """
    b = positions.shape[0]
    n_reqs = cad.num_reqs
    table = cad.block_table
    width = table.shape[1]
    mask = tree.ancestor_mask()
    sizes, cu, children = tree.level_sizes, tree.cu_level_sizes, tree.children_per_level
    rows = jnp.arange(b, dtype=_I32)

    level = top(params, logits_hidden, children[0]).reshape(b, sizes[0])
    drafts = [level]
    # Per node: token, hidden input (parent's output), depth; grown level by level.
    ids = level
    hid = jnp.repeat(next_hidden[:, None, :], sizes[0], axis=1)
    depth = jnp.ones((sizes[0],), _I32)
    for lvl in range(tree.depth - 1):
        n = cu[lvl]
        exceeds = positions + n >= max_model_len                               # [B]
        pos = jnp.where(exceeds[:, None], 0, positions[:, None] + depth[None, :])
        logical = positions[:, None] + 1 + jnp.arange(n, dtype=_I32)[None, :]    # [B, n]
        blk = jnp.clip(logical // block_size, 0, width - 1)
        slots = table[rows[:, None], blk] * block_size + logical % block_size
        real = (rows < n_reqs)[:, None]
        slots = jnp.where(exceeds[:, None] | ~real, PADDING_SLOT_ID, slots)
        md = cad.replace(
            query_start_loc=jnp.minimum(jnp.arange(b + 1, dtype=_I32), n_reqs) * n,
            seq_lens=jnp.where(rows < n_reqs, jnp.where(exceeds, 1, seq_lens + n), 0),
            slot_mapping=slots.reshape(-1).astype(_I32),
            num_actual_tokens=(n_reqs * n).astype(_I32),
            max_seq_len=jnp.minimum(cad.max_seq_len + n, max_model_len).astype(_I32),
            max_query_len=n, causal=True, tree_mask=tuple(r[:n] for r in mask[:n]))
        h_log, h_next, caches = forward(params, ids.reshape(-1).astype(_I32), pos.reshape(-1),
                                        hid.reshape(b * n, -1), caches, md)
        newest = sizes[lvl]
        h_log = h_log.reshape(b, n, -1)[:, n - newest:]
        h_next = h_next.reshape(b, n, -1)[:, n - newest:]
        c = children[lvl + 1]
        level = top(params, h_log.reshape(b * newest, -1), c).reshape(b, newest * c)
        drafts.append(level)
        ids = jnp.concatenate([ids, level], axis=1)
        hid = jnp.concatenate([hid, jnp.repeat(h_next, c, axis=1)], axis=1)
        depth = jnp.concatenate([depth, jnp.full((newest * c,), lvl + 2, _I32)])
    return jnp.concatenate(drafts, axis=1).astype(_I32), caches

"""The paged KV-cache write: values scattered into ``[num_blocks, block_size, ...]`` caches
at flat slots (:func:`scatter_slots`)."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.lax import optimization_barrier


class KVCache(NamedTuple):
    """One layer's paged cache: ``k``, ``v``: ``[num_blocks, block_size, num_kv_heads, head_dim]``."""

    k: jax.Array
    v: jax.Array


def scatter_slots(cache: jax.Array, values: jax.Array, slot_mapping: jax.Array) -> jax.Array:
    """Write ``values [T, ...]`` into ``cache [num_blocks, block_size, ...]`` at flat slots.

    Slots < 0 are dropped (mapped out of range and scattered with ``mode="drop"``; a
    negative index would otherwise wrap around to the end).
    """
    nb, bs = cache.shape[:2]
    flat = cache.reshape((nb * bs,) + cache.shape[2:])
    idx = jnp.where(slot_mapping < 0, nb * bs, slot_mapping)
    if values.shape[0] == 1:
        # XLA rewrites a one-row scatter into a dynamic-update-slice, after which the
        # compiled step copies the whole (donated) cache every call; a second, dropped row
        # keeps it an in-place scatter (tests/engine/test_engine.py counts the copies).
        values = jnp.concatenate([values, values], axis=0)
        idx = jnp.concatenate([idx, jnp.full((1,), nb * bs, idx.dtype)])
    flat = flat.at[idx].set(values.astype(cache.dtype), mode="drop")
    return flat.reshape(cache.shape)


def move_slots(caches, src_slots: jax.Array, dst_slots: jax.Array):
    """Copy flat slot ``src_slots[i]`` to ``dst_slots[i]`` (< 0: nothing) in every
    ``[num_blocks, block_size, ...]`` leaf of ``caches``, all sources gathered first."""

    def copy(cache):
        flat = cache.reshape((cache.shape[0] * cache.shape[1],) + cache.shape[2:])
        # The barrier keeps the gather out of the scatter's fusion: a scatter whose updates
        # read its own operand cannot run in place, and XLA:GPU would copy every K and V
        # cache whole each tree step.
        return scatter_slots(cache, optimization_barrier(flat[src_slots]), dst_slots)

    return jax.tree.map(copy, caches)

"""The paged KV-cache write: values scattered into ``[num_blocks, block_size, ...]`` caches
at flat slots (:func:`scatter_slots`)."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


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

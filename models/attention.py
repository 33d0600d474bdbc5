"""Paged KV cache and attention over ragged batches (pure jax.numpy reference).

This module is the one place a faster kernel (Pallas / Triton paged attention) plugs in:
models call only :func:`write_kv` and :func:`paged_attention` (or :func:`attend`, both).

Cache layout, per layer: ``KVCache(k, v)``, each ``[num_blocks, block_size, num_kv_heads,
head_dim]``. Token ``t`` is written at flat slot ``slot_mapping[t]`` (=
``block * block_size + offset``); slot ``-1`` (``PADDING_SLOT_ID``) is dropped.

Attention semantics (vLLM): request ``r`` owns query tokens ``query_start_loc[r] ..
query_start_loc[r+1]-1`` and keys at positions ``0 .. seq_lens[r]-1``, read through
``block_table[r]``. Causal: query ``i`` of a request of query length ``q`` sits at position
``seq_len - q + i`` and sees keys at positions ``<=`` it. Non-causal: every query sees
every key of its request. Tokens past ``query_start_loc[-1]`` (padding) get zeros.

Memory: K/V are gathered per request up to the block table's width (``[B_pad,
max_blocks * block_size]``), so the block table's width is the static context bucket:
callers pass a table sliced to the bucket they need. Queries are laid out per request
up to ``attn_metadata.max_query_len`` (static).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from specjax.attention import CommonAttentionMetadata


class KVCache(NamedTuple):
    """One layer's paged cache: ``k``, ``v``: ``[num_blocks, block_size, num_kv_heads, head_dim]``."""

    k: jax.Array
    v: jax.Array


def init_kv_caches(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                   head_dim: int, dtype=jnp.float32) -> list[KVCache]:
    """Zero caches for ``num_layers`` layers."""
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return [KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(num_layers)]


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
        # keeps it an in-place scatter (tests/test_engine.py counts the copies).
        values = jnp.concatenate([values, values], axis=0)
        idx = jnp.concatenate([idx, jnp.full((1,), nb * bs, idx.dtype)])
    flat = flat.at[idx].set(values.astype(cache.dtype), mode="drop")
    return flat.reshape(cache.shape)


def write_kv(cache: KVCache, k: jax.Array, v: jax.Array, slot_mapping: jax.Array) -> KVCache:
    """``k``, ``v``: ``[T, num_kv_heads, head_dim]``; ``slot_mapping``: ``[T] int32``."""
    return KVCache(scatter_slots(cache.k, k, slot_mapping), scatter_slots(cache.v, v, slot_mapping))


def paged_attention(q: jax.Array, cache: KVCache, md: CommonAttentionMetadata, *,
                    scale: float) -> jax.Array:
    """Attention of ``q [T, num_heads, head_dim]`` over the paged cache -> ``[T, num_heads, head_dim]``.

    GQA: query head ``h`` reads kv head ``h // (num_heads // num_kv_heads)``. Scores and
    softmax in float32; the output has ``q.dtype``.
    """
    t_pad, nh, hd = q.shape
    nb, bs, nkv, _ = cache.k.shape
    group = nh // nkv
    b_pad = md.query_start_loc.shape[0] - 1
    qmax = max(int(md.max_query_len), 1)
    max_blocks = md.block_table.shape[1]
    ctx = max_blocks * bs

    qsl = md.query_start_loc
    qlen = qsl[1:] - qsl[:-1]                                   # [B]
    seq = md.seq_lens                                           # [B]

    # queries laid out per request: [B, Q, nkv, G, hd]
    qi = jnp.arange(qmax, dtype=jnp.int32)
    tok = jnp.clip(qsl[:-1, None] + qi[None, :], 0, t_pad - 1)
    q_valid = qi[None, :] < qlen[:, None]                       # [B, Q]
    qr = q[tok].reshape(b_pad, qmax, nkv, group, hd)

    # K/V of each request: [B, C, nkv, hd]
    table = jnp.clip(md.block_table, 0, nb - 1)
    kr = cache.k[table].reshape(b_pad, ctx, nkv, hd)
    vr = cache.v[table].reshape(b_pad, ctx, nkv, hd)

    kj = jnp.arange(ctx, dtype=jnp.int32)
    mask = q_valid[:, :, None] & (kj[None, None, :] < seq[:, None, None])
    if md.causal:
        qpos = seq[:, None] - qlen[:, None] + qi[None, :]       # [B, Q]
        mask = mask & (kj[None, None, :] <= qpos[:, :, None])

    s = jnp.einsum("bqkgd,bckd->bkgqc", qr, kr, preferred_element_type=jnp.float32) * scale
    s = jnp.where(mask[:, None, None], s, jnp.finfo(jnp.float32).min)
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("bkgqc,bckd->bqkgd", p.astype(vr.dtype), vr,
                   preferred_element_type=jnp.float32)          # [B, Q, nkv, G, hd]
    o = o.reshape(b_pad, qmax, nh, hd)

    # back to token order
    t = jnp.arange(t_pad, dtype=jnp.int32)
    # request of token t = number of request ends <= t (B_pad is small: a compare beats a search)
    r_t = jnp.minimum(jnp.sum(qsl[None, 1:] <= t[:, None], axis=1, dtype=jnp.int32), b_pad - 1)
    i_t = jnp.clip(t - qsl[r_t], 0, qmax - 1)
    out = o[r_t, i_t]
    valid = t < qsl[-1]
    return jnp.where(valid[:, None, None], out, 0).astype(q.dtype)


def attend(q: jax.Array, k: jax.Array, v: jax.Array, cache: KVCache,
           md: CommonAttentionMetadata, *, scale: float) -> tuple[jax.Array, KVCache]:
    """Write this step's ``k``/``v`` through ``md.slot_mapping``, then attend over the cache."""
    cache = write_kv(cache, k, v, md.slot_mapping)
    return paged_attention(q, cache, md, scale=scale), cache

"""The pure jax.numpy reference of paged attention (the ``"xla"`` backend): the
specification the kernels are tested against, and the CPU path.

Two forms of one computation: the dense form materialises each request's ``[heads, Q, C]``
scores (decode-sized programs); the tiled form (:func:`paged_attention_tiled`) loops over
query tiles and key chunks with an online softmax, so its memory is bounded whatever the
prompt length. :func:`paged_attention_xla` picks the tiled form statically when the dense
scores would pass :data:`TILED_MIN_SCORE_BYTES`. Both read one mask function
(:func:`attention_mask`) of (query index, key position)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from specjax.attention_metadata import CommonAttentionMetadata
from specjax.kernels.paged_attention.kv_cache import KVCache

#: Dense float32 scores ``[B, num_heads, max_query_len, context]`` above this many bytes run
#: the tiled form: smaller programs (decode and verify steps of a moderate batch x context)
#: are the dense form's, unchanged; long prefills stay bounded.
TILED_MIN_SCORE_BYTES = 32 << 20
#: The tiled form's default tiles: float32 scores ``[B, num_heads, tile_q, chunk_k]`` of at
#: most this many bytes (its peak temporaries are a few times this).
TILE_SCORE_BYTES = 16 << 20
#: Upper bounds of the default ``tile_q`` / ``chunk_k`` (keys) of the tiled form.
MAX_TILE_Q, MAX_CHUNK_K = 512, 2048

_NEG = float(np.finfo(np.float32).min)


def dense_score_bytes(b_pad: int, num_heads: int, max_query_len: int, context: int) -> int:
    """Bytes of the dense form's float32 scores ``[B, num_heads, max_query_len, context]``."""
    return 4 * b_pad * num_heads * max(max_query_len, 1) * context


def tile_sizes(b_pad: int, num_heads: int, max_query_len: int, context: int,
               block_size: int) -> tuple[int, int]:
    """Default ``(tile_q, chunk_k)`` of the tiled form: the largest power-of-two query tile
    (<= :data:`MAX_TILE_Q`) and block-multiple key chunk (<= :data:`MAX_CHUNK_K`) whose
    float32 scores fit :data:`TILE_SCORE_BYTES`, halving the larger of the two."""
    tq = min(1 << (max(max_query_len, 1) - 1).bit_length(), MAX_TILE_Q)
    ck = min(-(-context // block_size) * block_size, max(MAX_CHUNK_K, block_size))
    while 4 * b_pad * num_heads * tq * ck > TILE_SCORE_BYTES and (tq > 1 or ck > block_size):
        if ck > block_size and (ck >= tq or tq == 1):
            ck = max(block_size, -(-(ck // 2) // block_size) * block_size)
        else:
            tq //= 2
    return tq, ck


def attention_mask(qi: jax.Array, kj: jax.Array, q_valid: jax.Array, qlen: jax.Array,
                   seq: jax.Array, md: CommonAttentionMetadata,
                   window: int | None = None) -> jax.Array:
    """``[B, Q, C]`` bools: query ``qi[i]`` (index in its request) of request ``b`` sees the
    key at position ``kj[j]`` (the package docstring's rules: ragged, causal, tree, padding;
    ``window``: only keys ``kj > qpos - window``, ``qpos = seq - qlen + qi``).

    ``qi [Q]``, ``kj [C]`` int32; ``q_valid [B, Q]``; ``qlen``, ``seq [B]``: the one place
    both forms mask."""
    mask = q_valid[:, :, None] & (kj[None, None, :] < seq[:, None, None])
    if window is not None:
        qpos = seq[:, None] - qlen[:, None] + qi[None, :]       # [B, Q]
        mask = mask & (kj[None, None, :] > qpos[:, :, None] - window)
    if md.tree_mask is not None:
        tm = jnp.asarray(np.asarray(md.tree_mask, dtype=bool))   # [Qt, Qt]
        qt = tm.shape[0]
        rel = kj[None, :] - (seq - qlen)[:, None]                # [B, C]: index in the block
        allowed = tm[jnp.clip(qi, 0, qt - 1)[None, :, None],
                     jnp.clip(rel, 0, qt - 1)[:, None, :]]           # [B, Q, C]
        mask = mask & ((rel < 0)[:, None, :] | ((rel < qt)[:, None, :] & allowed))
    elif md.causal:
        qpos = seq[:, None] - qlen[:, None] + qi[None, :]       # [B, Q]
        mask = mask & (kj[None, None, :] <= qpos[:, :, None])
    return mask


def paged_attention_xla(q: jax.Array, cache: KVCache, md: CommonAttentionMetadata, *,
                        scale: float, sliding_window: int | None = None,
                        sinks: jax.Array | None = None, tiled: bool | None = None,
                        tile_q: int | None = None, chunk_k: int | None = None) -> jax.Array:
    """The pure jax.numpy reference of :func:`paged_attention` (the ``"xla"`` backend).

    ``sliding_window``: keys ``kpos > qpos - window`` only; ``sinks [num_heads]``: one
    extra logit per head in each softmax, with no value (gpt-oss). ``tiled``: None picks the tiled form when :func:`dense_score_bytes` passes
    :data:`TILED_MIN_SCORE_BYTES` (static shapes), True / False forces a form; ``tile_q``,
    ``chunk_k``: the tiled form's tiles (None: :func:`tile_sizes`)."""
    nh, bs = q.shape[1], cache.k.shape[1]
    b_pad = md.query_start_loc.shape[0] - 1
    ctx = md.block_table.shape[1] * bs
    if tiled is None:
        tiled = dense_score_bytes(b_pad, nh, int(md.max_query_len), ctx) > TILED_MIN_SCORE_BYTES
    if tiled:
        return paged_attention_tiled(q, cache, md, scale=scale, sliding_window=sliding_window,
                                     sinks=sinks, tile_q=tile_q, chunk_k=chunk_k)
    return _dense(q, cache, md, scale, sliding_window, sinks)


def _dense(q: jax.Array, cache: KVCache, md: CommonAttentionMetadata, scale: float,
           window: int | None = None, sinks: jax.Array | None = None) -> jax.Array:
    """The dense form: ``[B, nkv, G*Q, C]`` scores, each request's whole context gathered."""
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

    # K/V of each request, kv-head major: [B, nkv, C, hd], so both dots below are plain
    # batched GEMMs over (request, kv head) with the head dim minor in q and K (gathered as
    # [B, C, nkv, hd], XLA:CPU would copy K transposed element by element in every layer).
    table = jnp.clip(md.block_table, 0, nb - 1)
    kr = jnp.swapaxes(cache.k[table].reshape(b_pad, ctx, nkv, hd), 1, 2)
    vr = jnp.swapaxes(cache.v[table].reshape(b_pad, ctx, nkv, hd), 1, 2)
    # the queries of each (request, kv head): its G heads x Q tokens as rows, [B, nkv, G*Q, hd]
    qh = jnp.transpose(qr, (0, 2, 3, 1, 4)).reshape(b_pad, nkv, group * qmax, hd)

    kj = jnp.arange(ctx, dtype=jnp.int32)
    mask = attention_mask(qi, kj, q_valid, qlen, seq, md, window)

    s = _product("bkxd,bkcd->bkxc", qh, kr) * scale             # [B, nkv, G*Q, C]
    s = s.reshape(b_pad, nkv, group, qmax, ctx)                 # [B, nkv, G, Q, C]
    s = jnp.where(mask[:, None, None], s, jnp.finfo(jnp.float32).min)
    if sinks is None:
        p = jax.nn.softmax(s, axis=-1)
    else:               # softmax over [scores, sink], the sink column dropped
        sk = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(1, nkv, group, 1, 1),
                              (b_pad, nkv, group, qmax, 1))
        p = jax.nn.softmax(jnp.concatenate([s, sk], axis=-1), axis=-1)[..., :ctx]
        p = jnp.where(mask[:, None, None], p, 0.0)
    p = p.reshape(b_pad, nkv, group * qmax, ctx)
    o = _product("bkxc,bkcd->bkxd", p.astype(vr.dtype), vr)  # [B, nkv, G*Q, hd]
    o = jnp.transpose(o.reshape(b_pad, nkv, group, qmax, hd), (0, 3, 1, 2, 4))
    o = o.reshape(b_pad, qmax, nh, hd)

    # back to token order
    t = jnp.arange(t_pad, dtype=jnp.int32)
    # request of token t = number of request ends <= t (B_pad is small: a compare beats a search)
    r_t = jnp.minimum(jnp.sum(qsl[None, 1:] <= t[:, None], axis=1, dtype=jnp.int32), b_pad - 1)
    i_t = jnp.clip(t - qsl[r_t], 0, qmax - 1)
    out = o[r_t, i_t]
    valid = t < qsl[-1]
    return jnp.where(valid[:, None, None], out, 0).astype(q.dtype)


def paged_attention_tiled(q: jax.Array, cache: KVCache, md: CommonAttentionMetadata, *,
                          scale: float, sliding_window: int | None = None,
                          sinks: jax.Array | None = None, tile_q: int | None = None,
                          chunk_k: int | None = None) -> jax.Array:
    """:func:`paged_attention_xla` in bounded memory: a loop over query tiles of ``tile_q``
    queries per request, each a loop over key chunks of ``chunk_k`` keys (rounded up to whole
    cache blocks) gathered from the block table, with an online softmax (running max and sum
    in float32). No array larger than ``[B, num_heads, tile_q, chunk_k]`` scores or the
    ``[T, num_heads, head_dim]`` output exists; each tile stops at the last key its queries
    see (causal: half the work of the dense form on a prompt). Summation order differs from
    the dense form (float rounding). ``tile_q``, ``chunk_k`` None: :func:`tile_sizes`;
    ValueError when one is not a positive int. ``sliding_window``, ``sinks``: as
    :func:`paged_attention_xla`'s (a window skips the chunks before it)."""
    t_pad, nh, hd = q.shape
    nb, bs, nkv, _ = cache.k.shape
    g = nh // nkv
    b = md.query_start_loc.shape[0] - 1
    qmax = max(int(md.max_query_len), 1)
    width = md.block_table.shape[1]
    dq, dk = tile_sizes(b, nh, qmax, width * bs, bs)
    tq, ck = (dq if tile_q is None else tile_q), (dk if chunk_k is None else chunk_k)
    for name, v in (("tile_q", tq), ("chunk_k", ck)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    tq = min(int(tq), qmax)
    cb = min(-(-int(ck) // bs), width)                          # blocks per key chunk
    ck, n_chunks = cb * bs, -(-width // cb)
    table = jnp.clip(md.block_table, 0, nb - 1)
    table = jnp.pad(table, ((0, 0), (0, n_chunks * cb - width)))
    qsl = md.query_start_loc
    qlen = qsl[1:] - qsl[:-1]                                   # [B]
    seq = md.seq_lens                                           # [B]
    sees_all = md.tree_mask is not None or not md.causal

    def tile(i, out):
        qi = i * tq + jnp.arange(tq, dtype=jnp.int32)           # [tq]: index in the request
        q_valid = qi[None, :] < qlen[:, None]                   # [B, tq]
        tok = qsl[:-1, None] + qi[None, :]                      # [B, tq]
        qt = q[jnp.clip(tok, 0, t_pad - 1)].reshape(b, tq, nkv, g, hd)
        qt = jnp.transpose(qt, (0, 2, 3, 1, 4))                 # [B, nkv, G, tq, hd]
        # keys the tile's queries see end before kend: the chunks past it are skipped
        last = jnp.minimum(qlen, (i + 1) * tq)
        kend = seq if sees_all else seq - qlen + last
        kend = jnp.where(last > i * tq, jnp.minimum(kend, seq), 0)
        n = jnp.minimum((jnp.max(kend) + ck - 1) // ck, n_chunks)
        c0 = jnp.int32(0)
        if sliding_window is not None:      # chunks wholly before every window: skipped
            kbeg = jnp.where(q_valid[:, 0], seq - qlen + i * tq - sliding_window + 1, 1 << 30)
            c0 = jnp.minimum(jnp.maximum(jnp.min(kbeg), 0) // ck, n)

        def chunk(c, carry):
            m, l, acc = carry
            blocks = jax.lax.dynamic_slice_in_dim(table, c * cb, cb, axis=1)   # [B, cb]
            kc = jnp.swapaxes(cache.k[blocks].reshape(b, ck, nkv, hd), 1, 2)  # [B, nkv, ck, hd]
            vc = jnp.swapaxes(cache.v[blocks].reshape(b, ck, nkv, hd), 1, 2)
            kj = c * ck + jnp.arange(ck, dtype=jnp.int32)
            mask = attention_mask(qi, kj, q_valid, qlen, seq, md,
                                  sliding_window)[:, None, None]
            s = jnp.einsum("bkgqd,bkcd->bkgqc", qt, kc,
                           preferred_element_type=jnp.float32) * scale
            s = jnp.where(mask, s, _NEG)                        # [B, nkv, G, tq, ck]
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))
            p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
            alpha = jnp.exp(m - m_new)
            l = alpha * l + jnp.sum(p, axis=-1)
            pv = jnp.einsum("bkgqc,bkcd->bkgqd", p.astype(vc.dtype), vc,
                            preferred_element_type=jnp.float32)
            return m_new, l, alpha[..., None] * acc + pv

        stats = jnp.full((b, nkv, g, tq), _NEG, jnp.float32)
        init = (stats, jnp.zeros_like(stats), jnp.zeros((b, nkv, g, tq, hd), jnp.float32))
        m, l, acc = jax.lax.fori_loop(c0, n, chunk, init)
        if sinks is not None:               # the sink joins the denominator only
            sk = sinks.astype(jnp.float32).reshape(1, nkv, g, 1)
            m_f = jnp.maximum(m, sk)
            c = jnp.exp(m - m_f)
            acc, l = acc * c[..., None], l * c + jnp.exp(sk - m_f)
        o = _finish(l, acc)                                     # [B, nkv, G, tq, hd]
        o = jnp.transpose(o, (0, 3, 1, 2, 4)).reshape(b * tq, nh, hd)
        dst = jnp.where(q_valid, tok, t_pad).reshape(b * tq)    # invalid rows: dropped
        return out.at[dst].set(o.astype(out.dtype), mode="drop")

    n_tiles = (jnp.max(qlen) + tq - 1) // tq
    return jax.lax.fori_loop(0, n_tiles, tile, jnp.zeros(q.shape, q.dtype))


def _finish(l: jax.Array, acc: jax.Array) -> jax.Array:
    """The online softmax's output ``acc / l`` (0 where a row saw no key)."""
    return jnp.where(l[..., None] > 0, acc / jnp.where(l > 0, l, 1.0)[..., None], 0.0)


# The two batched products, ``[B, nkv, x, *]`` rows with x = G * Q (query heads per kv head
# times queries per request). On a CPU, when every request has one query and its kv head
# serves at most two query heads (x <= 2: a decoding step, a drafter's later passes),
# they take their row operand transposed ([B, nkv, *, x]): XLA:CPU then runs them with its
# own dot instead of YNNPACK, whose fixed cost per call dominates products this small
# (docs/performance.md). The choice is made per platform when the program is lowered; the
# GPU program is unchanged. Both forms compute the same sums (summation order aside).
_CPU_TRANSPOSED_MAX_ROWS = 2


def _product(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
    """``jnp.einsum(spec, a, b)`` in float32, ``spec`` a ``"bkx?,bk??->bkx?"`` batched
    product with the rows ``x`` third in ``a``; on a CPU at ``x <= 2`` with ``a``'s last
    two axes swapped (``"bk?x,..."``: the same sums, XLA:CPU's own dot)."""
    lhs, rest = spec.split(",")

    def rows(a, b):
        return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)

    def transposed(a, b):
        return jnp.einsum(f"{lhs[:2]}{lhs[3]}{lhs[2]},{rest}", jnp.swapaxes(a, 2, 3), b,
                          preferred_element_type=jnp.float32)

    if a.shape[2] > _CPU_TRANSPOSED_MAX_ROWS:
        return rows(a, b)
    return jax.lax.platform_dependent(a, b, cpu=transposed, default=rows)

"""Paged attention as plain Triton kernels, called through jax-triton (GPU only).

The algorithm, grid and numerics of the Pallas kernel (:mod:`.pallas`) in Triton's own
language; no fused cache write. Tree masks are one int32 bitmask per query row; addresses
are int64. A sliding window masks keys ``<= qpos - window`` and skips the tiles before every
row's window; sink logits ride in the tree-bits buffer (float32 bits after the rows), so the
plain launch keeps its operands, and join split 0's partial result (counted once by the
merge). :func:`launch_plan` (pure Python) gives each kernel's grid and constexprs, so a
test can launch them under Triton's interpreter on CPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import triton
import triton.language as tl

from specjax.kernels.paged_attention import limits as _pk
from specjax.kernels import _jt

_NEG = tl.constexpr(_pk.NEG)
_INT32_MAX = tl.constexpr(int(np.iinfo(np.int32).max))


@triton.jit
def visible(mask, kk, qpos, first, bits, CAUSAL: tl.constexpr, TREE: tl.constexpr,
            WINDOW: tl.constexpr):
    """``mask [R, K]`` and the rule of :func:`.flash.visible` for keys at ``kk [K]`` and
    queries at ``qpos [R]`` (``first``: the request's first query position; ``bits [R]``:
    the rows' tree bitmasks, with ``TREE`` rows)."""
    if TREE > 0:
        rel = kk - first  # index in the query block
        relc = tl.minimum(tl.maximum(rel, 0), TREE - 1)
        seen = (bits[:, None] >> relc[None, :]) & 1
        mask = mask & ((rel < 0)[None, :] | ((rel < TREE)[None, :] & (seen != 0)))
    elif CAUSAL:
        mask = mask & (kk[None, :] <= qpos[:, None])
    if WINDOW > 0:
        mask = mask & (kk[None, :] > qpos[:, None] - WINDOW)
    return mask


@triton.jit
def softmax_step(acc, m_i, l_i, sc, mask, v, MASKED: tl.constexpr):
    """One key tile of the online softmax (float32): scores ``sc [R, K]`` where ``mask``
    (unless not ``MASKED``), values ``v [K, HD]``. A row that sees no key keeps zeros."""
    if MASKED:
        sc = tl.where(mask, sc, _NEG)
    m_new = tl.maximum(m_i, tl.max(sc, axis=1))
    corr = tl.exp(m_i - m_new)
    p = tl.exp(sc - m_new[:, None])
    if MASKED:
        p = tl.where(mask, p, 0.0)
    l_i = corr * l_i + tl.sum(p, axis=1)
    acc = corr[:, None] * acc + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return acc, m_new, l_i


@triton.jit
def add_sink(acc, m_i, l_i, sink, use):
    """The sink logits ``sink [R]`` joined to the softmax's denominator where ``use``."""
    m_f = tl.maximum(m_i, tl.where(use, sink, _NEG))
    c = tl.exp(m_i - m_f)
    return acc * c[:, None], m_f, l_i * c + tl.where(use, tl.exp(tl.minimum(sink - m_f, 0.0)), 0.0)


@triton.jit
def _attention_kernel(
    qsl_ptr,  # [B + 1] query_start_loc
    seq_ptr,  # [B] seq_lens
    bt_ptr,  # [B, MAX_BLOCKS] block_table
    tree_ptr,  # [max(TREE, 1) (+ NH with SINKS_AT)] int32: tree bitmasks, then sinks' bits
    q_ptr,  # [NUM_TOKENS, NH, HD]
    k_ptr,  # [NUM_BLOCKS, BLOCK_SIZE, NKV, HD]
    v_ptr,  # [NUM_BLOCKS, BLOCK_SIZE, NKV, HD]
    o_ptr,  # [B, NKV, NUM_SPLITS, ROWS, HD] float32, unnormalized
    m_ptr,  # [B, NKV, NUM_SPLITS, ROWS] float32 running max
    l_ptr,  # [B, NKV, NUM_SPLITS, ROWS] float32 running sum
    SCALE: tl.constexpr,
    NH: tl.constexpr,
    NKV: tl.constexpr,
    HD: tl.constexpr,
    GROUP: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    MAX_BLOCKS: tl.constexpr,
    NUM_BLOCKS: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    NUM_TOKENS: tl.constexpr,
    CAUSAL: tl.constexpr,
    TREE: tl.constexpr,  # tree rows, 0 without a tree mask
    WINDOW: tl.constexpr,  # sliding window, 0 without one
    SINKS_AT: tl.constexpr,  # sinks' float32 bits at tree_ptr[SINKS_AT + head]; 0: none
):
    r = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    start = tl.load(qsl_ptr + r)
    qlen = tl.load(qsl_ptr + r + 1) - start
    seq = tl.load(seq_ptr + r)

    m_idx = tl.arange(0, ROWS)
    qi = m_idx // GROUP  # query index in the request
    row_ok = qi < qlen
    tok = tl.minimum(start + qi, NUM_TOKENS - 1)
    head = h * GROUP + m_idx % GROUP
    col = tl.arange(0, HD)
    q_off = (tok * NH + head).to(tl.int64) * HD
    q = tl.load(q_ptr + q_off[:, None] + col[None, :], mask=row_ok[:, None], other=0.0)
    qpos = seq - qlen + qi  # position of each row's query
    bits = qi
    if TREE > 0:
        # the reference clamps the query index to the mask's last row
        bits = tl.load(tree_ptr + tl.minimum(qi, TREE - 1))

    n_tiles = tl.where(qlen > 0, tl.cdiv(seq, BLOCK_K), 0)
    if WINDOW > 0:  # the splits share the tiles from the first row's window on
        t0 = tl.minimum(tl.maximum(seq - qlen - WINDOW + 1, 0) // BLOCK_K, n_tiles)
        per = tl.cdiv(n_tiles - t0, NUM_SPLITS)
        lo = tl.minimum(t0 + s * per, n_tiles)
    else:
        per = tl.cdiv(n_tiles, NUM_SPLITS)
        lo = tl.minimum(s * per, n_tiles)
    hi = tl.minimum(lo + per, n_tiles)
    kk0 = tl.arange(0, BLOCK_K)
    acc = tl.zeros((ROWS, HD), tl.float32)
    m_i = tl.full((ROWS,), _NEG, tl.float32)
    l_i = tl.zeros((ROWS,), tl.float32)
    for t in range(lo, hi):
        kk = t * BLOCK_K + kk0  # key positions
        kv_ok = kk < seq
        page = tl.load(bt_ptr + r * MAX_BLOCKS + tl.minimum(kk // BLOCK_SIZE, MAX_BLOCKS - 1))
        page = tl.minimum(tl.maximum(page, 0), NUM_BLOCKS - 1)
        kv_off = ((page.to(tl.int64) * BLOCK_SIZE + kk % BLOCK_SIZE) * NKV + h) * HD
        k = tl.load(k_ptr + kv_off[:, None] + col[None, :], mask=kv_ok[:, None], other=0.0)
        v = tl.load(v_ptr + kv_off[:, None] + col[None, :], mask=kv_ok[:, None], other=0.0)
        sc = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision="ieee") * SCALE
        mask = visible(row_ok[:, None] & kv_ok[None, :], kk, qpos, seq - qlen, bits, CAUSAL,
                       TREE, WINDOW)
        acc, m_i, l_i = softmax_step(acc, m_i, l_i, sc, mask, v, True)
    if SINKS_AT > 0:  # split 0 carries the sink: the merge then counts it once
        sink = tl.load(tree_ptr + SINKS_AT + head).to(tl.float32, bitcast=True)
        acc, m_i, l_i = add_sink(acc, m_i, l_i, sink, s == 0)
    row = ((r * NKV + h) * NUM_SPLITS + s) * ROWS + m_idx
    tl.store(o_ptr + row.to(tl.int64)[:, None] * HD + col[None, :], acc)
    tl.store(m_ptr + row, m_i)
    tl.store(l_ptr + row, l_i)


@triton.jit
def _merge_kernel(
    qsl_ptr,  # [B + 1]
    o_ptr,  # [B, NKV, NUM_SPLITS, ROWS, HD]
    m_ptr,  # [B, NKV, NUM_SPLITS, ROWS]
    l_ptr,  # [B, NKV, NUM_SPLITS, ROWS]
    out_ptr,  # [NUM_TOKENS, NH, HD]
    B: tl.constexpr,
    B2: tl.constexpr,
    NH: tl.constexpr,
    NKV: tl.constexpr,
    HD: tl.constexpr,
    GROUP: tl.constexpr,
    G2: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    S2: tl.constexpr,
    ROWS: tl.constexpr,
    QMAX: tl.constexpr,
):
    """Program ``(t, h)``: token ``t``'s query heads of kv head ``h``: the request ``r`` with
    ``qsl[r] <= t < qsl[r + 1]``, query ``i``; merges the splits of rows ``i * GROUP + g``,
    normalizes and writes ``out[t, h * GROUP + g]``; zeros past ``qsl[B]``."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    bi = tl.arange(0, B2)
    ends = tl.load(qsl_ptr + tl.minimum(bi + 1, B), mask=bi < B, other=_INT32_MAX)
    r = tl.minimum(tl.sum((ends <= t).to(tl.int32), axis=0), B - 1)
    i = tl.minimum(tl.maximum(t - tl.load(qsl_ptr + r), 0), QMAX - 1)
    valid = t < tl.load(qsl_ptr + B)

    g = tl.arange(0, G2)
    g_ok = g < GROUP
    row = tl.minimum(i * GROUP + g, ROWS - 1)
    sp = tl.arange(0, S2)
    ok = (sp < NUM_SPLITS)[:, None] & g_ok[None, :]  # [S2, G2]
    idx = ((r * NKV + h) * NUM_SPLITS + tl.minimum(sp, NUM_SPLITS - 1))[:, None] * ROWS + row[None, :]
    m = tl.load(m_ptr + idx, mask=ok, other=_NEG)
    l = tl.load(l_ptr + idx, mask=ok, other=0.0)
    col = tl.arange(0, HD)
    o = tl.load(o_ptr + idx.to(tl.int64)[:, :, None] * HD + col[None, None, :],
                mask=ok[:, :, None], other=0.0)  # [S2, G2, HD]
    w = tl.exp(m - tl.max(m, axis=0)[None, :])
    acc = tl.sum(o * w[:, :, None], axis=0)  # [G2, HD]
    den = tl.sum(l * w, axis=0)
    out = acc / tl.where(den > 0, den, 1.0)[:, None]
    out = tl.where(valid, out, 0.0)
    dst = (t * NH + h * GROUP + g).to(tl.int64)[:, None] * HD + col[None, :]
    tl.store(out_ptr + dst, out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None])


def launch_plan(q_shape, cache_shape, block_table_shape, *, scale: float, max_query_len: int,
                causal: bool = True, tree_mask=None, block_k: int | None = None,
                num_splits: int | None = None, num_warps: int | None = None,
                dtype=None, sliding_window: int | None = None, sinks: bool = False) -> dict:
    """Grids, constexprs and output shapes of both kernels for these static shapes (raises
    ValueError for shapes the kernel does not take). ``q_shape [T, NH, HD]``,
    ``cache_shape [NUM_BLOCKS, BLOCK_SIZE, NKV, HD]``, ``block_table_shape [B, MAX_BLOCKS]``;
    ``sinks``: whether :func:`aux_buffer` appends sink logits to ``tree_bits``."""
    t_pad, nh, hd = q_shape
    nb, bs, nkv, hd_k = cache_shape
    b_pad, max_blocks = block_table_shape
    if hd_k != hd:
        raise ValueError(f"cache head_dim {hd_k} does not match q {q_shape}")
    if sliding_window is not None and int(sliding_window) < 1:
        raise ValueError(f"sliding_window={sliding_window} must be None or >= 1")
    group, rows, block_k, num_splits, num_warps = _pk.kernel_config(
        "triton", num_heads=nh, num_kv_heads=nkv, head_dim=hd, block_size=bs,
        max_blocks=max_blocks, batch=b_pad, max_query_len=max_query_len, tree_mask=tree_mask,
        dtype=dtype, block_k=block_k, num_splits=num_splits, num_warps=num_warps)
    tree_rows = 0 if tree_mask is None else len(tree_mask)
    attention = dict(
        grid=(b_pad, nkv, num_splits), num_warps=num_warps,
        meta=dict(SCALE=float(scale), NH=nh, NKV=nkv, HD=hd, GROUP=group, ROWS=rows,
                  BLOCK_K=block_k, BLOCK_SIZE=bs, MAX_BLOCKS=max_blocks, NUM_BLOCKS=nb,
                  NUM_SPLITS=num_splits, NUM_TOKENS=t_pad, CAUSAL=bool(causal), TREE=tree_rows,
                  WINDOW=int(sliding_window or 0), SINKS_AT=max(tree_rows, 1) if sinks else 0),
        out_shapes=[(b_pad, nkv, num_splits, rows, hd), (b_pad, nkv, num_splits, rows),
                    (b_pad, nkv, num_splits, rows)])
    merge = dict(
        grid=(t_pad, nkv), num_warps=4,
        meta=dict(B=b_pad, B2=_pk.pow2_at_least(b_pad), NH=nh, NKV=nkv, HD=hd, GROUP=group,
                  G2=_pk.pow2_at_least(group), NUM_SPLITS=num_splits,
                  S2=_pk.pow2_at_least(num_splits), ROWS=rows, QMAX=max(int(max_query_len), 1)))
    tree = np.asarray(_pk.tree_bits(tree_mask) if tree_mask is not None else (0,), np.int32)
    return dict(attention=attention, merge=merge, tree_bits=tree)


def aux_buffer(tree_bits, sinks):
    """The kernel's ``tree_ptr`` operand: ``tree_bits`` (int32), then (``sinks [NH]`` not
    None) the sinks' float32 bits as int32. Works on NumPy and JAX arrays alike."""
    if sinks is None:
        return tree_bits
    xp = np if isinstance(sinks, np.ndarray) else jnp
    bits = (sinks.astype(np.float32).view(np.int32) if xp is np
            else jax.lax.bitcast_convert_type(sinks.astype(jnp.float32), jnp.int32))
    return xp.concatenate([xp.asarray(tree_bits, np.int32), bits])


_STATIC = ("scale", "max_query_len", "causal", "tree_mask", "sliding_window", "block_k",
           "num_splits", "num_warps", "num_stages")


@functools.partial(jax.jit, static_argnames=_STATIC)
def paged_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
                    query_start_loc: jax.Array, seq_lens: jax.Array, block_table: jax.Array,
                    sinks: jax.Array | None = None, *,
                    scale: float, max_query_len: int, causal: bool = True,
                    tree_mask: tuple[tuple[bool, ...], ...] | None = None,
                    sliding_window: int | None = None,
                    block_k: int | None = None, num_splits: int | None = None,
                    num_warps: int | None = None, num_stages: int = 2) -> jax.Array:
    """Attention of ``q [T, num_heads, head_dim]`` over the paged cache -> ``[T, num_heads,
    head_dim]`` in ``q.dtype``: :func:`specjax.kernels.paged_attention.pallas.paged_attention`
    (same arguments and knobs, same semantics: ``sinks``, ``sliding_window`` too) as two
    Triton kernels. Needs a GPU."""
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"k_cache {k_cache.shape} and v_cache {v_cache.shape} differ")
    t_pad, nh, hd = q.shape
    if sinks is not None and sinks.shape != (nh,):
        raise ValueError(f"sinks {sinks.shape} must be [num_heads] = [{nh}]")
    plan = launch_plan(q.shape, k_cache.shape, block_table.shape, scale=scale,
                       max_query_len=max_query_len, causal=causal, tree_mask=tree_mask,
                       block_k=block_k, num_splits=num_splits, num_warps=num_warps,
                       dtype=q.dtype, sliding_window=sliding_window, sinks=sinks is not None)
    if block_table.shape[0] == 0 or t_pad == 0:
        return jnp.zeros(q.shape, q.dtype)
    # the first dot in the promoted dtype (as the reference's einsum), the second in the
    # cache dtype (the reference casts the probabilities to it)
    q_in = q.astype(jnp.promote_types(q.dtype, k_cache.dtype))
    qsl = query_start_loc.astype(jnp.int32)
    a = plan["attention"]
    o, m, l = _jt.triton_call(
        qsl, seq_lens.astype(jnp.int32), block_table.astype(jnp.int32),
        aux_buffer(jnp.asarray(plan["tree_bits"]), sinks), q_in, k_cache, v_cache,
        kernel=_attention_kernel,
        out_shape=[jax.ShapeDtypeStruct(s, jnp.float32) for s in a["out_shapes"]],
        grid=a["grid"], num_warps=a["num_warps"], num_stages=num_stages,
        name=f"triton_paged_attention_r{a['meta']['ROWS']}_s{a['meta']['NUM_SPLITS']}",
        **a["meta"])
    mg = plan["merge"]
    (out,) = _jt.triton_call(
        qsl, o, m, l, kernel=_merge_kernel,
        out_shape=[jax.ShapeDtypeStruct((t_pad, nh, hd), q.dtype)], grid=mg["grid"],
        num_warps=mg["num_warps"], name=f"triton_paged_attention_merge_s{a['meta']['NUM_SPLITS']}",
        **mg["meta"])
    return out

"""Flash attention over the paged cache for queries of any length as a plain Triton kernel,
called through jax-triton (GPU only): the twin of :mod:`.flash` (same grid, tiles, masks
and numerics). Tree bits and sink logits ride in one int32 buffer as in :mod:`.triton`;
tokens past ``query_start_loc[-1]`` are zeroed after the launch. :func:`launch_plan` (pure
Python) lets a test launch the kernel under Triton's interpreter on CPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from specjax.kernels import _jt
from specjax.kernels.paged_attention import flash as _flash
from specjax.kernels.paged_attention import limits as _pk
from specjax.kernels.paged_attention.triton import add_sink, aux_buffer, softmax_step, visible

_NEG = tl.constexpr(_pk.NEG)


@triton.jit
def _key_block(acc, m_i, l_i, q, qpos, bits, s, r, h, seq, first, col, bt_ptr, k_ptr, v_ptr,
               SCALE: tl.constexpr, NKV: tl.constexpr, HD: tl.constexpr,
               BLOCK_K: tl.constexpr, BLOCK_SIZE: tl.constexpr, MAX_BLOCKS: tl.constexpr,
               NUM_BLOCKS: tl.constexpr, CAUSAL: tl.constexpr, TREE: tl.constexpr,
               WINDOW: tl.constexpr, MASKED: tl.constexpr):
    """One key block ``s`` of the online softmax; ``MASKED``: apply :func:`.flash.visible`
    (blocks every row sees in full skip it)."""
    kk = s * BLOCK_K + tl.arange(0, BLOCK_K)  # key positions
    page = tl.load(bt_ptr + r * MAX_BLOCKS + tl.minimum(kk // BLOCK_SIZE, MAX_BLOCKS - 1))
    page = tl.minimum(tl.maximum(page, 0), NUM_BLOCKS - 1)
    kv_off = ((page.to(tl.int64) * BLOCK_SIZE + kk % BLOCK_SIZE) * NKV + h) * HD
    if MASKED:  # keys past seq read zeros: unread slots may hold anything, NaN too
        kv_ok = kk < seq
        k = tl.load(k_ptr + kv_off[:, None] + col[None, :], mask=kv_ok[:, None], other=0.0)
        v = tl.load(v_ptr + kv_off[:, None] + col[None, :], mask=kv_ok[:, None], other=0.0)
    else:
        k = tl.load(k_ptr + kv_off[:, None] + col[None, :])
        v = tl.load(v_ptr + kv_off[:, None] + col[None, :])
    sc = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision="ieee") * SCALE
    ok = kk[None, :] >= 0
    if MASKED:
        ok = visible(kv_ok[None, :], kk, qpos, first, bits, CAUSAL, TREE, WINDOW)
    return softmax_step(acc, m_i, l_i, sc, ok, v, MASKED)


@triton.jit
def _flash_kernel(
    prog_ptr,  # [2, P] int32: each program's (request or -1, first query index)
    qsl_ptr,  # [B + 1] query_start_loc
    seq_ptr,  # [B] seq_lens
    bt_ptr,  # [B, MAX_BLOCKS] block_table
    tree_ptr,  # [max(TREE, 1) (+ NH with SINKS_AT)] int32: tree bitmasks, then sinks' bits
    q_ptr,  # [NUM_TOKENS, NH, HD]
    k_ptr,  # [NUM_BLOCKS, BLOCK_SIZE, NKV, HD]
    v_ptr,  # [NUM_BLOCKS, BLOCK_SIZE, NKV, HD]
    o_ptr,  # [NUM_TOKENS, NH, HD]: this program's tokens written, the rest untouched
    SCALE: tl.constexpr,
    NH: tl.constexpr,
    NKV: tl.constexpr,
    HD: tl.constexpr,
    GROUP: tl.constexpr,
    ROWS: tl.constexpr,
    TQ: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    MAX_BLOCKS: tl.constexpr,
    NUM_BLOCKS: tl.constexpr,
    NUM_TOKENS: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr,
    CAUSAL: tl.constexpr,
    TREE: tl.constexpr,  # tree rows, 0 without a tree mask
    WINDOW: tl.constexpr,  # sliding window, 0 without one
    SINKS_AT: tl.constexpr,  # sinks' float32 bits at tree_ptr[SINKS_AT + head]; 0: none
):
    p = tl.program_id(0)
    h = tl.program_id(1)
    r_raw = tl.load(prog_ptr + p)
    i0 = tl.load(prog_ptr + NUM_PROGRAMS + p)
    r = tl.maximum(r_raw, 0)
    start = tl.load(qsl_ptr + r)
    qlen = tl.load(qsl_ptr + r + 1) - start
    seq = tl.load(seq_ptr + r)
    n_q = tl.where(r_raw >= 0, tl.minimum(tl.maximum(qlen - i0, 0), TQ), 0)  # tile's tokens

    m_idx = tl.arange(0, ROWS)
    t = m_idx // GROUP
    row_ok = t < n_q
    qi = i0 + tl.minimum(t, tl.maximum(n_q - 1, 0))
    tok = tl.minimum(tl.maximum(start + qi, 0), NUM_TOKENS - 1)
    head = h * GROUP + m_idx % GROUP
    col = tl.arange(0, HD)
    q_off = (tok * NH + head).to(tl.int64) * HD
    q = tl.load(q_ptr + q_off[:, None] + col[None, :])
    first = seq - qlen
    qpos = first + qi
    bits = qi
    if TREE > 0:  # the reference clamps the query index to the mask's last row
        bits = tl.load(tree_ptr + tl.minimum(qi, TREE - 1))

    # key blocks: [s_lo, s_hi) holds every key a row sees; [u_lo, u_hi) every key every row sees
    pos_lo = first + i0
    pos_hi = first + i0 + n_q - 1
    k_hi = seq
    full_hi = seq
    if TREE > 0:
        full_hi = first
    elif CAUSAL:
        k_hi = tl.minimum(seq, pos_hi + 1)
        full_hi = tl.minimum(seq, pos_lo + 1)
    if WINDOW > 0:
        k_lo = tl.maximum(pos_lo - WINDOW + 1, 0)
        full_lo = tl.maximum(pos_hi - WINDOW + 1, 0)
    else:
        k_lo = 0
        full_lo = 0
    s_lo = tl.where(n_q > 0, k_lo // BLOCK_K, 0)
    s_hi = tl.where(n_q > 0, tl.cdiv(k_hi, BLOCK_K), 0)
    u_lo = tl.minimum(tl.maximum(tl.cdiv(full_lo, BLOCK_K), s_lo), s_hi)
    u_hi = tl.minimum(tl.maximum(full_hi // BLOCK_K, u_lo), s_hi)
    n_front = u_lo - s_lo

    acc = tl.zeros((ROWS, HD), tl.float32)
    m_i = tl.full((ROWS,), _NEG, tl.float32)
    l_i = tl.zeros((ROWS,), tl.float32)
    for s in range(u_lo, u_hi):
        acc, m_i, l_i = _key_block(acc, m_i, l_i, q, qpos, bits, s, r, h, seq, first, col,
                                   bt_ptr, k_ptr, v_ptr, SCALE, NKV, HD, BLOCK_K, BLOCK_SIZE,
                                   MAX_BLOCKS, NUM_BLOCKS, CAUSAL, TREE, WINDOW, False)
    for i in range(0, n_front + s_hi - u_hi):
        s = tl.where(i < n_front, s_lo + i, u_hi + i - n_front)
        acc, m_i, l_i = _key_block(acc, m_i, l_i, q, qpos, bits, s, r, h, seq, first, col,
                                   bt_ptr, k_ptr, v_ptr, SCALE, NKV, HD, BLOCK_K, BLOCK_SIZE,
                                   MAX_BLOCKS, NUM_BLOCKS, CAUSAL, TREE, WINDOW, True)
    if SINKS_AT > 0:  # softmax over [scores, sink]: the sink adds to the denominator only
        sink = tl.load(tree_ptr + SINKS_AT + head).to(tl.float32, bitcast=True)
        acc, m_i, l_i = add_sink(acc, m_i, l_i, sink, True)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(o_ptr + q_off[:, None] + col[None, :], out.to(o_ptr.dtype.element_ty),
             mask=row_ok[:, None])


def launch_plan(q_shape, cache_shape, block_table_shape, *, scale: float, max_query_len: int,
                causal: bool = True, tree_mask=None, sliding_window: int | None = None,
                sinks: bool = False, rows: int | None = None, block_k: int | None = None,
                num_warps: int | None = None, num_stages: int | None = None,
                dtype=None) -> dict:
    """Grid, constexprs, ``num_warps``, ``num_stages``, query tile ``tq`` and tree bits for
    these shapes (``q [T, NH, HD]``, cache ``[NUM_BLOCKS, BLOCK_SIZE, NKV, HD]``, table ``[B,
    MAX_BLOCKS]``; :func:`.flash.flash_config`'s defaults, ``dtype`` the operands');
    ValueError as :func:`.flash.paged_attention`."""
    t_pad, nh, hd = q_shape
    nb, bs, nkv, hd_k = cache_shape
    b_pad, max_blocks = block_table_shape
    if hd_k != hd:
        raise ValueError(f"cache head_dim {hd_k} does not match q {q_shape}")
    reason = _flash.unsupported_reason(num_heads=nh, num_kv_heads=nkv, head_dim=hd,
                                       tree_mask=tree_mask, dtype=dtype)
    if reason:
        raise ValueError(f"paged flash attention (triton): unsupported shapes: {reason}")
    if sliding_window is not None and int(sliding_window) < 1:
        raise ValueError(f"sliding_window={sliding_window} must be None or >= 1")
    group = nh // nkv
    rows, block_k, num_warps, num_stages = _flash.flash_config(
        head_dim=hd, group=group, max_query_len=max_query_len, rows=rows, block_k=block_k,
        num_warps=num_warps, num_stages=num_stages, num_kv_heads=nkv,
        itemsize=2 if dtype is None else jnp.dtype(dtype).itemsize)
    tq = rows // group
    num_programs = _pk.cdiv(t_pad, tq) + b_pad      # each request adds at most one partial tile
    tree_rows = 0 if tree_mask is None else len(tree_mask)
    return dict(
        grid=(num_programs, nkv), num_warps=num_warps, num_stages=num_stages, tq=tq,
        tree_bits=tuple(_pk.tree_bits(tree_mask)) if tree_mask is not None else (0,),
        meta=dict(SCALE=float(scale), NH=nh, NKV=nkv, HD=hd, GROUP=group, ROWS=rows, TQ=tq,
                  BLOCK_K=block_k, BLOCK_SIZE=bs, MAX_BLOCKS=max_blocks, NUM_BLOCKS=nb,
                  NUM_TOKENS=t_pad, NUM_PROGRAMS=num_programs, CAUSAL=bool(causal),
                  TREE=tree_rows, WINDOW=int(sliding_window or 0),
                  SINKS_AT=max(tree_rows, 1) if sinks else 0))


_STATIC = ("scale", "max_query_len", "causal", "tree_mask", "sliding_window", "rows",
           "block_k", "num_warps", "num_stages")


@functools.partial(jax.jit, static_argnames=_STATIC)
def paged_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
                    query_start_loc: jax.Array, seq_lens: jax.Array, block_table: jax.Array,
                    sinks: jax.Array | None = None, *, scale: float, max_query_len: int,
                    causal: bool = True, tree_mask: tuple[tuple[bool, ...], ...] | None = None,
                    sliding_window: int | None = None, rows: int | None = None,
                    block_k: int | None = None, num_warps: int | None = None,
                    num_stages: int | None = None) -> jax.Array:
    """:func:`specjax.kernels.paged_attention.flash.paged_attention` (same arguments, knobs
    and semantics, no ``interpret``) as one Triton kernel. Needs a GPU and jax-triton."""
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"k_cache {k_cache.shape} and v_cache {v_cache.shape} differ")
    t_pad, nh, hd = q.shape
    if sinks is not None and sinks.shape != (nh,):
        raise ValueError(f"sinks {sinks.shape} must be [num_heads] = [{nh}]")
    plan = launch_plan(q.shape, k_cache.shape, block_table.shape, scale=scale,
                       max_query_len=max_query_len, causal=causal, tree_mask=tree_mask,
                       sliding_window=sliding_window, sinks=sinks is not None, rows=rows,
                       block_k=block_k, num_warps=num_warps, num_stages=num_stages,
                       dtype=jnp.promote_types(q.dtype, k_cache.dtype))
    b_pad = query_start_loc.shape[0] - 1
    if b_pad == 0 or t_pad == 0:
        return jnp.zeros(q.shape, q.dtype)
    qsl = query_start_loc.astype(jnp.int32)
    # the first product in the promoted dtype (as the reference's einsum), the second in
    # the cache dtype (the reference casts the probabilities to it)
    q_in = q.astype(jnp.promote_types(q.dtype, k_cache.dtype))
    (out,) = _jt.triton_call(
        _flash._programs(qsl, plan["tq"], plan["grid"][0]), qsl, seq_lens.astype(jnp.int32),
        block_table.astype(jnp.int32),
        aux_buffer(jnp.asarray(plan["tree_bits"], jnp.int32), sinks), q_in, k_cache, v_cache,
        kernel=_flash_kernel, out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype)],
        grid=plan["grid"], num_warps=plan["num_warps"], num_stages=plan["num_stages"],
        name=f"triton_paged_flash_attention_r{plan['meta']['ROWS']}_k{plan['meta']['BLOCK_K']}",
        **plan["meta"])
    # tokens past query_start_loc[-1] (no program writes them) are zeros
    written = jnp.arange(t_pad, dtype=jnp.int32) < qsl[-1]
    return jnp.where(written[:, None, None], out, jnp.zeros((), q.dtype))

"""Flash attention over the paged cache for queries of any length: a Pallas kernel in the
generic API, lowered through Triton on the GPU (interpret mode off it).

The function of :func:`specjax.kernels.paged_attention.paged_attention` for any mix of
prefill chunks, decode rows and draft rows (chains, trees) in one launch. Grid ``(P,
num_kv_heads)`` over query tiles flattened across requests: tile ``p`` is ``tq = rows //
G`` consecutive query tokens of one request times the ``G`` query heads of kv head ``h``
(``rows`` rows, token major). It walks only the key blocks its rows can see, through the
block table, with an online softmax in float32 (blocks every row sees in full skip the
mask), and stores only its own tokens: no ``[Q, C]`` array, ``rows x block_k`` scores a
program. :func:`visible` is the one mask (padding, causal or tree, a sliding window);
per-head sink logits join the softmax's denominator in the epilogue.

Not Mosaic GPU: its tensor-core products take float32 only as TF32 and cannot contract a
float32 V over its rows (MN-major), so float32 KV could not match the reference's IEEE
products. Not bit-identical to the reference (summation order). Unsupported shapes raise
ValueError (:func:`unsupported_reason`); the tile defaults are :func:`flash_config`'s.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from specjax import _compat
from specjax.kernels.paged_attention.limits import (
    MAX_ROWS, MAX_TREE, NEG, cdiv, num_rows, pow2_at_least, tree_bits)

pltr, PLTR_MISSING = _compat.pallas_triton()

#: Largest query tile (rows = tokens x G) a program may hold.
MAX_FLASH_ROWS = 256
#: One wave of programs (the swept GPUs' multiprocessors): fewer default tiles halve the rows.
WAVE = 132
_DTYPES = ("float32", "bfloat16", "float16")


def takes_over(num_heads: int, num_kv_heads: int, max_query_len: int) -> bool:
    """Whether ``backend="pallas"`` runs this kernel instead of ``pallas.py``'s: the decode
    kernel's one tile per request (``max_query_len x G`` rows) would exceed ``MAX_ROWS``."""
    return num_rows(max_query_len, max(num_heads // max(num_kv_heads, 1), 1)) > MAX_ROWS


def unsupported_reason(*, num_heads: int, num_kv_heads: int, head_dim: int, tree_mask=None,
                       dtype=None) -> str | None:
    """Why this kernel cannot take these shapes, or ``None`` if it can."""
    if num_kv_heads <= 0 or num_heads % num_kv_heads:
        return f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}"
    if head_dim < 16 or head_dim & (head_dim - 1):
        return f"head_dim={head_dim} is not a power of two >= 16"
    if num_heads // num_kv_heads > MAX_FLASH_ROWS // 2:
        return f"GQA group {num_heads // num_kv_heads} > {MAX_FLASH_ROWS // 2}"
    if tree_mask is not None and len(tree_mask) > MAX_TREE:
        return f"tree_mask has {len(tree_mask)} rows (> {MAX_TREE})"
    if dtype is not None and jnp.dtype(dtype).name not in _DTYPES:
        return f"dtype {jnp.dtype(dtype)} is not float32, bfloat16 or float16"
    return None


def flash_config(*, head_dim: int, group: int, max_query_len: int, rows: int | None = None,
                 block_k: int | None = None, num_warps: int | None = None,
                 num_stages: int | None = None, itemsize: int = 2, num_kv_heads: int = 1
                 ) -> tuple[int, int, int, int]:
    """``(rows, block_k, num_warps, num_stages)`` with defaults filled in: ``rows`` 128 (64
    above head_dim 128 or below one :data:`WAVE` of the longest request's 128-row tiles x
    ``num_kv_heads``), no more than ``max_query_len x G`` needs; ``block_k`` 64 (32 above
    head_dim 128); ``num_warps`` 4 for 16-bit operands (``itemsize``) in up to 128 rows at
    head_dim <= 128, else 8 from 128 x 128 accumulators, else 4; ``num_stages`` 3 for 16-bit
    operands up to head_dim 128, else 2. The 16-bit head_dim <= 128 choices won the tile sweep of
    ``benchmarks/flash_tiles.py``. ValueError for a ``rows`` / ``block_k`` that is not a power
    of two >= 16 (``rows`` >= G, <= 256) or ``num_stages`` < 1."""
    if rows is None:
        lone = cdiv(int(max_query_len) * group, 128) * num_kv_heads < WAVE   # under one wave
        top = 128 if head_dim <= 128 and not lone else 64
        rows = min(top, pow2_at_least(max(int(max_query_len), 1) * group, 16))
        rows = max(rows, pow2_at_least(group, 16))
    if rows < 16 or rows & (rows - 1) or rows < group or rows > MAX_FLASH_ROWS:
        raise ValueError(f"rows={rows} must be a power of two in [max(16, G={group}), "
                         f"{MAX_FLASH_ROWS}]")
    block_k = (64 if head_dim <= 128 else 32) if block_k is None else int(block_k)
    if block_k < 16 or block_k & (block_k - 1):
        raise ValueError(f"block_k={block_k} must be a power of two >= 16")
    if num_warps is None:       # the sweep's shapes; elsewhere 8 from 128 x 128 accumulators
        swept = rows <= 128 and head_dim <= 128 and itemsize <= 2
        num_warps = 8 if not swept and rows * head_dim >= 128 * 128 else 4
    if num_stages is None:
        num_stages = 3 if itemsize <= 2 and head_dim <= 128 else 2
    if int(num_stages) < 1:
        raise ValueError(f"num_stages={num_stages} must be >= 1")
    return rows, block_k, num_warps, int(num_stages)


def visible(qpos, kpos, *, seq, first, causal: bool, bits=None, tree_len: int = 0,
            window: int | None = None):
    """The mask: whether the query at cache position ``qpos`` sees the key at ``kpos`` (int
    arrays that broadcast; ``seq`` its request's length, ``first = seq - query_len`` its
    first query's position). Keys past ``seq`` are padding. ``bits`` (the row's tree bits,
    bit ``j``: sees block query ``j``) replaces the causal rule with the tree's; ``window``
    keeps keys ``kpos > qpos - window`` (a sliding window, on any of the three)."""
    ok = kpos < seq
    if bits is not None:
        rel = kpos - first
        seen = lax.shift_right_logical(bits, jnp.clip(rel, 0, tree_len - 1)) & 1
        ok = ok & ((rel < 0) | ((rel < tree_len) & (seen != 0)))
    elif causal:
        ok = ok & (kpos <= qpos)
    if window is not None:
        ok = ok & (kpos > qpos - window)
    return ok


def _kernel(prog_ref, qsl_ref, seq_ref, bt_ref, q_ref, k_ref, v_ref, *refs, scale: float,
            group: int, rows: int, tq: int, block_k: int, block_size: int, max_blocks: int,
            num_blocks: int, num_tokens: int, causal: bool, tree: tuple[int, ...] | None,
            window: int | None, has_sinks: bool, precision):
    """Program ``(p, h)``: tile ``prog[:, p] = (request, first query index)`` (request -1:
    no tile) of kv head ``h``. ``refs``: ``sinks`` (with ``has_sinks``), the zeros the
    output is aliased to, the output ``[T, num_heads, head_dim]`` (whole arrays)."""
    sink_ref = refs[0] if has_sinks else None
    out_ref = refs[-1]
    p = pl.program_id(0)
    h = pl.program_id(1)
    r_raw = prog_ref[0, p]
    i0 = prog_ref[1, p]
    r = jnp.maximum(r_raw, 0)
    start = qsl_ref[r]
    qlen = qsl_ref[r + 1] - start
    seq = seq_ref[r]
    n_q = jnp.where(r_raw >= 0, jnp.clip(qlen - i0, 0, tq), 0)    # this tile's tokens

    m_idx = jnp.arange(rows, dtype=jnp.int32)
    # rows past the tile's tokens repeat its last token (same head): same values, same
    # stores, so no store needs a mask (interpret mode's masked store races otherwise)
    t = jnp.minimum(jnp.minimum(lax.div(m_idx, jnp.int32(group)), tq - 1),
                    jnp.maximum(n_q - 1, 0))
    qi = i0 + t
    tok = jnp.clip(start + qi, 0, num_tokens - 1)
    head = h * group + lax.rem(m_idx, jnp.int32(group))
    hd = q_ref.shape[-1]
    col = jnp.arange(hd, dtype=jnp.int32)[None, :]
    q = pltr.load(q_ref.at[tok[:, None], head[:, None], col])            # [rows, hd]
    first = seq - qlen
    qpos = first + qi
    bits = None
    if tree is not None:
        bits = jnp.full((rows,), tree[-1], jnp.int32)   # the reference clamps to the last row
        for i, b in enumerate(tree[:-1]):
            bits = jnp.where(qi == i, jnp.int32(b), bits)
    mask = functools.partial(visible, seq=seq, first=first, causal=causal,
                             bits=None if bits is None else bits[:, None],
                             tree_len=0 if tree is None else len(tree), window=window)

    # key blocks: [s_lo, s_hi) holds every key a row sees; [u_lo, u_hi) every key every row sees
    pos_lo, pos_hi = first + i0, first + i0 + n_q - 1
    k_hi = jnp.minimum(seq, pos_hi + 1) if causal and tree is None else seq
    full_hi = (first if tree is not None else jnp.minimum(seq, pos_lo + 1) if causal
               else seq)
    k_lo = 0 if window is None else jnp.maximum(pos_lo - window + 1, 0)
    full_lo = 0 if window is None else jnp.maximum(pos_hi - window + 1, 0)
    s_lo = jnp.where(n_q > 0, lax.div(k_lo, jnp.int32(block_k)), 0)
    s_hi = jnp.where(n_q > 0, cdiv(k_hi, block_k), 0)
    u_lo = jnp.clip(cdiv(full_lo, block_k), s_lo, s_hi)
    u_hi = jnp.clip(lax.div(full_hi, jnp.int32(block_k)), u_lo, s_hi)
    n_front = u_lo - s_lo
    kk0 = jnp.arange(block_k, dtype=jnp.int32)

    def body(i, carry, masked: bool):
        acc, m_prev, l_prev = carry
        s = jnp.where(i < n_front, s_lo + i, u_hi + i - n_front) if masked else i
        kk = s * block_k + kk0                                      # [BK] key positions
        page = bt_ref[r, jnp.minimum(lax.div(kk, jnp.int32(block_size)), max_blocks - 1)]
        page = jnp.clip(page, 0, num_blocks - 1)
        off = lax.rem(kk, jnp.int32(block_size))
        idx = k_ref.at[page[:, None], off[:, None], h, col]
        vdx = v_ref.at[page[:, None], off[:, None], h, col]
        if masked:      # keys past seq read zeros: unread slots may hold anything, NaN too
            kv_ok = (kk < seq)[:, None]
            k, v = pltr.load(idx, mask=kv_ok, other=0), pltr.load(vdx, mask=kv_ok, other=0)
        else:
            k, v = pltr.load(idx), pltr.load(vdx)
        sc = lax.dot_general(q, k.astype(q.dtype), (((1,), (1,)), ((), ())),
                             precision=precision, preferred_element_type=jnp.float32) * scale
        if masked:
            ok = mask(qpos[:, None], kk[None, :])
            sc = jnp.where(ok, sc, NEG)
        m_new = jnp.maximum(m_prev, jnp.max(sc, axis=1))
        corr = jnp.exp(m_prev - m_new)
        pr = jnp.exp(sc - m_new[:, None])
        if masked:      # a row that sees no key at all gets zeros, not exp(NEG - NEG) = 1s
            pr = jnp.where(ok, pr, 0.0)
        l_new = corr * l_prev + jnp.sum(pr, axis=1)
        pv = lax.dot_general(pr.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                             precision=precision, preferred_element_type=jnp.float32)
        return corr[:, None] * acc + pv, m_new, l_new

    carry = (jnp.zeros((rows, hd), jnp.float32), jnp.full((rows,), NEG, jnp.float32),
             jnp.zeros((rows,), jnp.float32))
    carry = lax.fori_loop(u_lo, u_hi, functools.partial(body, masked=False), carry)
    acc, m, l = lax.fori_loop(0, n_front + s_hi - u_hi, functools.partial(body, masked=True),
                              carry)
    if has_sinks:       # softmax over [scores, sink]: the sink adds to the denominator only
        sink = pltr.load(sink_ref.at[head]).astype(jnp.float32)
        m_f = jnp.maximum(m, sink)
        c = jnp.exp(m - m_f)
        acc = acc * c[:, None]
        l = l * c + jnp.exp(sink - m_f)
    out = (acc / jnp.where(l > 0, l, 1.0)[:, None]).astype(out_ref.dtype)

    def store():
        pltr.store(out_ref.at[tok[:, None], head[:, None], col], out)

    lax.cond(n_q > 0, store, lambda: None)


def _programs(query_start_loc, tq: int, num_programs: int):
    """``[2, P]`` int32: each program's ``(request, first query index)``, request -1 past
    the last tile; the last tiles (the most keys under a causal mask) first."""
    qsl = query_start_loc.astype(jnp.int32)
    b = qsl.shape[0] - 1
    ntile = cdiv(jnp.maximum(qsl[1:] - qsl[:-1], 0), tq)
    cum = jnp.cumsum(ntile)
    p = jnp.arange(num_programs - 1, -1, -1, dtype=jnp.int32)
    # unrolled: the default "scan" is a while loop, a host sync per step on the GPU
    r = jnp.searchsorted(cum, p, side="right", method="scan_unrolled").astype(jnp.int32)
    rc = jnp.minimum(r, b - 1)
    i0 = (p - (cum[rc] - ntile[rc])) * tq
    return jnp.stack([jnp.where(r < b, r, -1), jnp.where(r < b, i0, 0)]).astype(jnp.int32)


_STATIC = ("scale", "max_query_len", "causal", "tree_mask", "sliding_window", "rows",
           "block_k", "num_warps", "num_stages", "interpret")


@functools.partial(jax.jit, static_argnames=_STATIC)
def paged_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
                    query_start_loc: jax.Array, seq_lens: jax.Array, block_table: jax.Array,
                    sinks: jax.Array | None = None, *, scale: float, max_query_len: int,
                    causal: bool = True, tree_mask: tuple[tuple[bool, ...], ...] | None = None,
                    sliding_window: int | None = None, rows: int | None = None,
                    block_k: int | None = None, num_warps: int | None = None,
                    num_stages: int | None = None, interpret: bool | None = None) -> jax.Array:
    """Attention of ``q [T, num_heads, head_dim]`` over the paged cache -> ``[T, num_heads,
    head_dim]`` in ``q.dtype`` (the package's specification), any query lengths.
    ``sinks [num_heads]`` (float): one extra logit per head in each softmax, no value.
    Static: ``max_query_len`` (sizes the default tile), ``tree_mask`` (``Q x Q`` bools),
    ``sliding_window`` (keys ``> qpos - window``), :func:`flash_config`'s knobs,
    ``num_stages``, ``interpret`` (default: off the GPU). ValueError for shapes the kernel
    cannot take."""
    if pltr is None:
        raise ValueError(f"the Pallas flash-attention kernel is unavailable: {PLTR_MISSING}")
    t_pad, nh, hd = q.shape
    nb, bs, nkv, hd_k = k_cache.shape
    if v_cache.shape != k_cache.shape or hd_k != hd:
        raise ValueError(f"cache shapes {k_cache.shape}, {v_cache.shape} do not fit q {q.shape}")
    reason = unsupported_reason(num_heads=nh, num_kv_heads=nkv, head_dim=hd,
                                tree_mask=tree_mask, dtype=q.dtype)
    if reason:
        raise ValueError(f"paged flash attention: unsupported shapes: {reason}")
    if sliding_window is not None and int(sliding_window) < 1:
        raise ValueError(f"sliding_window={sliding_window} must be None or >= 1")
    if sinks is not None and sinks.shape != (nh,):
        raise ValueError(f"sinks {sinks.shape} must be [num_heads] = [{nh}]")
    group = nh // nkv
    rows, block_k, num_warps, num_stages = flash_config(
        head_dim=hd, group=group, rows=rows, max_query_len=max_query_len, block_k=block_k,
        num_warps=num_warps, num_stages=num_stages, num_kv_heads=nkv,
        itemsize=jnp.dtype(jnp.promote_types(q.dtype, k_cache.dtype)).itemsize)
    b_pad = query_start_loc.shape[0] - 1
    if b_pad == 0 or t_pad == 0:
        return jnp.zeros((t_pad, nh, hd), q.dtype)
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    tq = rows // group
    num_programs = cdiv(t_pad, tq) + b_pad       # each request adds at most one partial tile
    kernel = functools.partial(
        _kernel, scale=float(scale), group=group, rows=rows, tq=tq, block_k=block_k,
        block_size=bs, max_blocks=block_table.shape[1], num_blocks=nb, num_tokens=t_pad,
        causal=bool(causal), tree=None if tree_mask is None else tree_bits(tree_mask),
        window=None if sliding_window is None else int(sliding_window),
        has_sinks=sinks is not None, precision=lax.Precision.HIGHEST)
    # the first product in the promoted dtype (as the reference's einsum), the second in
    # the cache dtype (the reference casts the probabilities to it)
    args = [_programs(query_start_loc, tq, num_programs), query_start_loc.astype(jnp.int32),
            seq_lens.astype(jnp.int32), block_table.astype(jnp.int32),
            q.astype(jnp.promote_types(q.dtype, k_cache.dtype)), k_cache, v_cache]
    if sinks is not None:
        args.append(sinks.astype(jnp.float32))
    # tokens past query_start_loc[-1] keep the zeros the output is aliased to
    args.append(jnp.zeros((t_pad, nh, hd), q.dtype))
    return pl.pallas_call(
        kernel,
        grid=(num_programs, nkv),
        out_specs=pl.no_block_spec,
        out_shape=jax.ShapeDtypeStruct((t_pad, nh, hd), q.dtype),
        input_output_aliases={len(args) - 1: 0},
        compiler_params=pltr.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"paged_flash_attention_r{rows}_k{block_k}",
    )(*args)

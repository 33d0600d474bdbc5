"""The grouped matmul as a Pallas kernel in the generic API, lowered through Triton on the
GPU (interpret mode off it).

Grid ``(P, N / block_n, split_k)`` over row tiles: tile ``p`` is ``block_m`` consecutive rows
of one group, then tiles of zeros for the rows past the last group (``P = ceil(M / block_m) +
E`` bounds their count; programs past the last tile store nothing). A program walks its
``K / split_k`` share of K in ``block_k`` steps, loading its group's ``[block_k, block_n]``
weight blocks through the group index (no gathered copy of the weights), accumulates in
float32 and stores its rows; rows past a tile's end repeat its last row, so every store is
unmasked. Every row is stored: no
zero-filled buffer is aliased in (XLA kept one per layer live at once in a layer stack).
``split_k > 1``: float32 partials per share, summed after (more programs at decode).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from specjax import _compat
from specjax.kernels.paged_attention.limits import cdiv, pow2_at_least

pltr, PLTR_MISSING = _compat.pallas_triton()


def unsupported_reason(k: int, n: int) -> str | None:
    """Why the kernel cannot take ``[M, k] x [E, k, n]``, or ``None`` if it can."""
    bad = [f"{name}={d}" for name, d in (("K", k), ("N", n)) if d % 16]
    return f"{' and '.join(bad)} not a multiple of 16" if bad else None


def _block(dim: int, cap: int) -> int:
    """The largest power of two <= ``cap`` dividing ``dim`` (ValueError below 16)."""
    b = cap
    while b >= 16 and dim % b:
        b //= 2
    if b < 16:
        raise ValueError(f"dimension {dim} is not a multiple of 16")
    return b


def tiles(*, m: int, k: int, n: int, groups: int, block_m: int | None = None,
          block_n: int | None = None, block_k: int | None = None) -> tuple[int, int, int]:
    """``(block_m, block_n, block_k)`` with defaults filled in: ``block_m`` the rows an average
    group holds, as a power of two in [16, 64]; ``block_n`` / ``block_k`` the largest power of
    two up to 128 / 64 dividing N / K. ValueError for a K or N that is not a multiple of 16
    or a ``block_m`` that is not a power of two >= 16."""
    if block_m is None:
        block_m = min(64, pow2_at_least(cdiv(max(m, 1), max(groups, 1)), 16))
    if block_m < 16 or block_m & (block_m - 1):
        raise ValueError(f"block_m={block_m} must be a power of two >= 16")
    block_n = _block(n, 128) if block_n is None else int(block_n)
    block_k = _block(k, 64) if block_k is None else int(block_k)
    for name, b, dim in (("block_n", block_n, n), ("block_k", block_k, k)):
        if b < 16 or b & (b - 1) or dim % b:
            raise ValueError(f"{name}={b} must be a power of two >= 16 dividing {dim}")
    return block_m, block_n, block_k


def _programs(group_sizes, block_m: int, num_programs: int, num_rows: int):
    """``[3, P]`` int32: each program's ``(group, first row of the tile, rows it stores)``;
    group -1 for a tile of the zero rows past the last group (``sum(group_sizes)`` to
    ``num_rows``), rows 0 past the last tile."""
    sizes = jnp.maximum(group_sizes.astype(jnp.int32), 0)
    e = sizes.shape[0]
    ntile = cdiv(sizes, block_m)
    cum = jnp.cumsum(ntile)
    starts = jnp.cumsum(sizes) - sizes
    total = jnp.minimum(jnp.sum(sizes), num_rows)
    p = jnp.arange(num_programs, dtype=jnp.int32)
    # unrolled: the default "scan" is a while loop, a host sync per step on the GPU
    g = jnp.searchsorted(cum, p, side="right", method="scan_unrolled").astype(jnp.int32)
    gc = jnp.minimum(g, e - 1)
    ok = g < e
    i0 = jnp.where(ok, (p - (cum[gc] - ntile[gc])) * block_m, (p - cum[e - 1]) * block_m)
    start = jnp.where(ok, starts[gc], total)
    rows = jnp.clip(jnp.where(ok, sizes[gc], num_rows - total) - i0, 0, block_m)
    return jnp.stack([jnp.where(ok, g, -1), start + i0, rows]).astype(jnp.int32)


def _kernel(prog_ref, lhs_ref, rhs_ref, out_ref, *, block_m: int, block_n: int,
            block_k: int, num_rows: int, split_k: int, precision):
    """Program ``(p, j, s)``: tile ``prog[:, p]``, columns ``[j * block_n, ...)``, share s."""
    p = pl.program_id(0)
    j = pl.program_id(1)
    s0 = pl.program_id(2)
    g_raw = prog_ref[0, p]
    g = jnp.maximum(g_raw, 0)
    first = prog_ref[1, p]
    n_rows = prog_ref[2, p]
    m_idx = jnp.minimum(jnp.arange(block_m, dtype=jnp.int32), jnp.maximum(n_rows - 1, 0))
    row = jnp.clip(first + m_idx, 0, num_rows - 1)
    col = j * block_n + jnp.arange(block_n, dtype=jnp.int32)
    kk0 = jnp.arange(block_k, dtype=jnp.int32)

    k_steps = lhs_ref.shape[1] // block_k // split_k

    def body(s, acc):
        kk = (s0 * k_steps + s) * block_k + kk0
        a = pltr.load(lhs_ref.at[row[:, None], kk[None, :]])            # [BM, BK]
        w = pltr.load(rhs_ref.at[g, kk[:, None], col[None, :]])         # [BK, BN]
        return acc + lax.dot_general(a, w.astype(a.dtype), (((1,), (0,)), ((), ())),
                                     precision=precision, preferred_element_type=jnp.float32)

    in_group = jnp.minimum(n_rows, 1) * jnp.minimum(g_raw + 1, 1)     # (int32 bounds)
    acc = lax.fori_loop(0, in_group * k_steps, body, jnp.zeros((block_m, block_n), jnp.float32))

    def store():
        at = (row[:, None], col[None, :]) if split_k == 1 else (s0, row[:, None], col[None, :])
        pltr.store(out_ref.at[at], acc.astype(out_ref.dtype))

    lax.cond(n_rows > 0, store, lambda: None)


@functools.partial(jax.jit, static_argnames=("block_m", "block_n", "block_k", "split_k",
                                             "num_warps", "num_stages", "interpret"))
def grouped_matmul(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *,
                   block_m: int | None = None, block_n: int | None = None,
                   block_k: int | None = None, split_k: int = 1, num_warps: int = 4,
                   num_stages: int = 3, interpret: bool | None = None) -> jax.Array:
    """:func:`specjax.kernels.grouped_matmul.grouped_matmul` (rows past the groups: zeros);
    tile sizes as :func:`tiles`; ``split_k`` shares of K summed in float32; ``interpret``
    defaults to off the GPU. ValueError for shapes the kernel cannot take, a ``split_k``
    that does not divide K's ``block_k`` steps, or a missing Pallas-Triton."""
    if pltr is None:
        raise ValueError(f"the Pallas grouped-matmul kernel is unavailable: {PLTR_MISSING}")
    m, k = lhs.shape
    e, _, n = rhs.shape
    block_m, block_n, block_k = tiles(m=m, k=k, n=n, groups=e, block_m=block_m,
                                      block_n=block_n, block_k=block_k)
    if split_k < 1 or (k // block_k) % split_k:
        raise ValueError(f"split_k={split_k} must be >= 1 and divide K / block_k = "
                         f"{k // block_k}")
    dtype = jnp.promote_types(lhs.dtype, rhs.dtype)
    if m == 0 or e == 0:
        return jnp.zeros((m, n), dtype)
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    num_programs = cdiv(m, block_m) + e   # each group and the zero rows add <= 1 partial tile
    kernel = functools.partial(_kernel, block_m=block_m, block_n=block_n, block_k=block_k,
                               num_rows=m, split_k=split_k, precision=lax.Precision.HIGHEST)
    out = pl.pallas_call(
        kernel,
        grid=(num_programs, n // block_n, split_k),
        out_specs=pl.no_block_spec,
        out_shape=jax.ShapeDtypeStruct((m, n) if split_k == 1 else (split_k, m, n),
                                       dtype if split_k == 1 else jnp.float32),
        compiler_params=pltr.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"grouped_matmul_m{block_m}_n{block_n}_k{block_k}_s{split_k}",
    )(_programs(group_sizes, block_m, num_programs, m), lhs.astype(dtype), rhs)
    return out if split_k == 1 else jnp.sum(out, axis=0).astype(dtype)


def _pair_kernel(rows_ref, groups_ref, lhs_ref, rhs_ref, *refs, block_n: int, block_k: int,
                 split_k: int, glu, precision):
    """Program ``(p, j, s)`` of :func:`pair_matmul`: pair p, output columns ``[j * block_n,
    ...)``, K share s; its row repeated ``PAIR_ROWS`` times for Triton's dot."""
    out_ref = refs[-1]
    p = pl.program_id(0)
    j = pl.program_id(1)
    s0 = pl.program_id(2)
    g_raw = groups_ref[p]
    valid = jnp.logical_and(g_raw >= 0, g_raw < rhs_ref.shape[0]).astype(jnp.int32)
    g = jnp.clip(g_raw, 0, rhs_ref.shape[0] - 1)
    row = jnp.clip(rows_ref[p], 0, lhs_ref.shape[0] - 1)
    rows = jnp.full((PAIR_ROWS,), row, jnp.int32)
    col = j * block_n + jnp.arange(block_n, dtype=jnp.int32)
    width = block_n if glu is None else 2 * block_n      # gate and up: one contiguous tile
    wcol = j * width + jnp.arange(width, dtype=jnp.int32)
    kk0 = jnp.arange(block_k, dtype=jnp.int32)
    k_steps = lhs_ref.shape[1] // block_k // split_k

    def body(s, acc):
        kk = (s0 * k_steps + s) * block_k + kk0
        a = pltr.load(lhs_ref.at[rows[:, None], kk[None, :]])           # [16, BK]
        w = pltr.load(rhs_ref.at[g, kk[:, None], wcol[None, :]]).astype(a.dtype)  # [BK, W]
        return acc + lax.dot_general(a, w, (((1,), (0,)), ((), ())), precision=precision,
                                     preferred_element_type=jnp.float32)

    acc = lax.fori_loop(0, valid * k_steps, body, jnp.zeros((PAIR_ROWS, width), jnp.float32))
    if glu is not None:
        if len(refs) == 2:                                   # the bias, zero for no group
            acc = acc + valid.astype(jnp.float32) * pltr.load(
                refs[0].at[g, wcol]).astype(jnp.float32)[None, :]
        pairs = acc.reshape(PAIR_ROWS, block_n, 2)           # (gate, up) interleaved
        lane = jnp.arange(2, dtype=jnp.int32).reshape(1, 1, 2)
        acc = glu(*(jnp.sum(jnp.where(lane == i, pairs, 0.0), axis=2) for i in (0, 1)))
    out_rows = jnp.full((PAIR_ROWS,), p, jnp.int32)
    at = (out_rows[:, None], col[None, :]) if split_k == 1 else (s0, out_rows[:, None],
                                                                  col[None, :])
    pltr.store(out_ref.at[at], acc.astype(out_ref.dtype))


#: Rows a pair program computes (its one row repeated): the smallest tile Triton's dot takes.
PAIR_ROWS = 16


@functools.partial(jax.jit, static_argnames=("glu", "block_n", "block_k", "split_k",
                                             "num_warps", "num_stages", "interpret"))
def pair_matmul(lhs: jax.Array, rhs: jax.Array, rows: jax.Array, groups: jax.Array,
                bias: jax.Array | None = None, *, glu=None, block_n: int | None = None,
                block_k: int | None = None, split_k: int = 1, num_warps: int = 4,
                num_stages: int = 3, interpret: bool | None = None) -> jax.Array:
    """``out[p] = lhs[rows[p]] @ rhs[groups[p]]`` (``lhs [T, K]``, ``rhs [E, K, N]``, ``rows``
    / ``groups [P]``; a group outside ``[0, E)``: zeros, before any ``glu``) -> ``[P, N]``, one
    program per (pair, column tile, K share), nothing sorted first: for decode's few pairs (a
    group's weights read once per pair naming it). ``glu`` (elementwise ``(gate, up) -> out``
    in float32): ``out[p, c] = glu(y[2c] + bias[g, 2c], y[2c + 1] + bias[g, 2c + 1])`` of ``y
    = lhs[rows[p]] @ rhs[g]`` -> ``[P, N / 2]``, the activation in the kernel's epilogue
    (``bias [E, N]`` optional; only with ``glu``). Tiles as :func:`tiles`, ``block_n`` up to 64; ``split_k``
    shares of K summed in float32 (more programs for few pairs; with ``glu``, the activation
    after the sum). ValueError as :func:`grouped_matmul`, or for a ``bias`` without ``glu``."""
    if pltr is None:
        raise ValueError(f"the Pallas grouped-matmul kernel is unavailable: {PLTR_MISSING}")
    if bias is not None and glu is None:
        raise ValueError("pair_matmul: bias is taken only with glu")
    t, k = lhs.shape
    e, _, n = rhs.shape
    n_out = n if glu is None else n // 2
    _, block_n, block_k = tiles(m=1, k=k, n=n_out, groups=1, block_m=16,
                                block_n=_block(n_out, 64) if block_n is None else block_n,
                                block_k=block_k)
    if split_k < 1 or (k // block_k) % split_k:
        raise ValueError(f"split_k={split_k} must be >= 1 and divide K / block_k = "
                         f"{k // block_k}")
    dtype = jnp.promote_types(lhs.dtype, rhs.dtype)
    num_pairs = rows.shape[0]
    if num_pairs == 0 or t == 0:
        return jnp.zeros((num_pairs, n_out), dtype)
    if glu is not None and split_k > 1:             # the activation after the shares' sum
        y = pair_matmul(lhs, rhs, rows, groups, block_k=block_k, split_k=split_k,
                        num_warps=num_warps, num_stages=num_stages, interpret=interpret)
        y = y.astype(jnp.float32)
        if bias is not None:
            ok = ((groups >= 0) & (groups < e))[:, None]
            y = y + jnp.where(ok, bias[jnp.clip(groups, 0, e - 1)].astype(jnp.float32), 0)
        return glu(y[:, 0::2], y[:, 1::2]).astype(dtype)
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    kernel = functools.partial(_pair_kernel, block_n=block_n, block_k=block_k, split_k=split_k,
                               glu=glu, precision=lax.Precision.HIGHEST)
    out = pl.pallas_call(
        kernel,
        grid=(num_pairs, n_out // block_n, split_k),
        out_specs=pl.no_block_spec,
        out_shape=jax.ShapeDtypeStruct((num_pairs, n_out) if split_k == 1 else
                                       (split_k, num_pairs, n_out),
                                       dtype if split_k == 1 else jnp.float32),
        compiler_params=pltr.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"pair_matmul_n{block_n}_k{block_k}_s{split_k}" + ("_glu" if glu else ""),
    )(rows.astype(jnp.int32), groups.astype(jnp.int32), lhs.astype(dtype), rhs,
      *(() if bias is None else (bias,)))
    return out if split_k == 1 else jnp.sum(out, axis=0).astype(dtype)

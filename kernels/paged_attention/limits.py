"""Limits and static configuration shared by the paged-attention kernels (``pallas.py``,
``triton.py``): the shapes they take, the row tile, the context splits, the fused write."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

#: Masked scores; finite so that ``max - max`` of a fully masked tile is 0, not NaN.
NEG = -0.7 * float(np.finfo(np.float32).max)
#: Largest row tile (``max_query_len * G`` rounded up): the float32 accumulator is
#: ``ROWS x head_dim`` registers per program.
MAX_ROWS = 128
#: Largest tree: one int32 bitmask per query row.
MAX_TREE = 31
#: Keys per inner step of a program, unless ``block_k`` says otherwise.
DEFAULT_BLOCK_K = 64
#: Cap on the context splits per request.
MAX_SPLITS = 16
#: Streaming multiprocessors assumed when the device does not say.
DEFAULT_NUM_SMS = 132
#: Programs per SM the default context split aims for: attention alone, and the kernel that
#: also writes the step's K/V (chosen by measurement: docs/performance.md).
PROGRAMS_PER_SM = 3
FUSED_WRITE_PROGRAMS_PER_SM = 1


def pow2_at_least(n: int, lo: int = 1) -> int:
    return max(lo, 1 << max(int(n) - 1, 0).bit_length())


def cdiv(a, b):
    return (a + b - 1) // b


def num_rows(max_query_len: int, group: int) -> int:
    """Rows of one program's query tile: ``max_query_len * group`` as a power of two >= 16."""
    return pow2_at_least(max(int(max_query_len), 1) * group, 16)


def unsupported_reason(*, num_heads: int, num_kv_heads: int, head_dim: int, max_query_len: int,
                       tree_mask=None, dtype=None) -> str | None:
    """Why the kernel cannot take these shapes, or ``None`` if it can."""
    if num_kv_heads <= 0 or num_heads % num_kv_heads:
        return f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}"
    if head_dim < 16 or head_dim & (head_dim - 1):
        return f"head_dim={head_dim} is not a power of two >= 16"
    rows = num_rows(max_query_len, num_heads // num_kv_heads)
    if rows > MAX_ROWS:
        return (f"max_query_len={max_query_len} x group={num_heads // num_kv_heads} needs "
                f"{rows} rows per program (> {MAX_ROWS})")
    if tree_mask is not None and len(tree_mask) > MAX_TREE:
        return f"tree_mask has {len(tree_mask)} rows (> {MAX_TREE})"
    if dtype is not None and jnp.dtype(dtype) not in (jnp.dtype(jnp.float32),
                                                      jnp.dtype(jnp.bfloat16),
                                                      jnp.dtype(jnp.float16)):
        return f"dtype {jnp.dtype(dtype)} is not float32, bfloat16 or float16"
    return None


def _num_sms() -> int:
    try:
        dev = jax.devices()[0]
        if dev.platform == "gpu":
            return int(getattr(dev, "core_count", DEFAULT_NUM_SMS) or DEFAULT_NUM_SMS)
    except Exception:  # pragma: no cover - no device info
        pass
    return DEFAULT_NUM_SMS


def default_num_splits(batch: int, num_kv_heads: int, max_tiles: int,
                       num_sms: int | None = None, *, fused_write: bool = False) -> int:
    """Context splits per request: the smallest power of two that gives every SM of the GPU
    ``PROGRAMS_PER_SM`` programs (``FUSED_WRITE_PROGRAMS_PER_SM`` for the kernel that also
    writes the step's K/V: ``fused_write``), i.e. ``batch * num_kv_heads * splits >=
    programs_per_sm * num_sms``, at most ``MAX_SPLITS`` and at most half the tiles of a
    full-width request (at least two tiles a split at capacity).
    """
    per_sm = FUSED_WRITE_PROGRAMS_PER_SM if fused_write else PROGRAMS_PER_SM
    target = per_sm * (num_sms or _num_sms())
    cap = max(1, min(MAX_SPLITS, max_tiles // 2))
    s = 1
    while batch * num_kv_heads * s < target and s * 2 <= cap:
        s *= 2
    return s


def fused_write_pays(num_requests: int, num_kv_heads: int, context: int, *,
                     block_k: int | None = None, num_sms: int | None = None) -> bool:
    """``attend(..., fused_kv_write="auto")``'s rule: fuse the write when
    :func:`default_num_splits` splits each request's context (``context`` keys of block
    table, ``num_requests`` rows) over several programs of the fused kernel; each then walks
    few tiles, so the two scatter kernels saved outweigh its extra work."""
    return default_num_splits(max(int(num_requests), 1), num_kv_heads,
                              cdiv(int(context), block_k or DEFAULT_BLOCK_K), num_sms,
                              fused_write=True) > 1


def kernel_config(who: str, *, num_heads: int, num_kv_heads: int, head_dim: int,
                  block_size: int, max_blocks: int, batch: int, max_query_len: int, tree_mask,
                  dtype, block_k: int | None, num_splits: int | None,
                  num_warps: int | None, fused_write: bool = False
                  ) -> tuple[int, int, int, int, int]:
    """The static configuration shared by this kernel and its Triton twin
    (``triton.py``): ``(group, rows, block_k, num_splits,
    num_warps)`` with the defaults filled in (``block_k`` 32 above head_dim 128: float32 K/V
    tiles of 64 x 256 would pass a GPU's 227 KiB of shared memory a block at 128 rows); ValueError (naming
    ``who``'s kernel and the argument) for shapes or knobs the kernels do not take."""
    reason = unsupported_reason(num_heads=num_heads, num_kv_heads=num_kv_heads,
                                head_dim=head_dim, max_query_len=max_query_len,
                                tree_mask=tree_mask, dtype=dtype)
    if reason:
        raise ValueError(f"paged_attention ({who}): unsupported shapes: {reason}")
    group = num_heads // num_kv_heads
    rows = num_rows(max_query_len, group)
    if block_k is None:
        block_k = DEFAULT_BLOCK_K if head_dim <= 128 else DEFAULT_BLOCK_K // 2
    block_k = int(block_k)
    if block_k < 16 or block_k & (block_k - 1):
        raise ValueError(f"block_k={block_k} must be a power of two >= 16")
    if num_splits is None:
        num_splits = default_num_splits(max(batch, 1), num_kv_heads,
                                        cdiv(max_blocks * block_size, block_k),
                                        fused_write=fused_write)
    if num_splits < 1:
        raise ValueError(f"num_splits={num_splits} must be >= 1")
    if num_warps is None:
        num_warps = 4 if rows <= 32 else 8
    return group, rows, block_k, num_splits, num_warps


def tree_bits(tree_mask) -> tuple[int, ...]:
    """Row ``i`` of the mask as an int: bit ``j`` set iff query ``i`` sees block query ``j``."""
    return tuple(sum(1 << j for j, x in enumerate(row) if x) for row in tree_mask)

"""Triton helpers: JAX's integer semantics inside a kernel (floor division, a jnp gather's
wrap-once-then-clamp indexing), so the Triton kernels agree with the XLA reference bit for
bit and never read out of bounds."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def floor_divmod(x, d: tl.constexpr):
    """``(x // d, x % d)`` with Python/jnp floor semantics, for a positive constexpr ``d``."""
    q = x // d
    r = x - q * d
    neg = r < 0
    return tl.where(neg, q - 1, q), tl.where(neg, r + d, r)


@triton.jit
def jnp_index(i, n: tl.constexpr):
    """Index ``i`` into an axis of length ``n`` the way a jnp gather does: wrap once, clamp."""
    i = tl.where(i < 0, i + n, i)
    return tl.minimum(tl.maximum(i, 0), n - 1)


@triton.jit
def slot_of(block_row_ptr, pos, mask, NB: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """``block_row[min(pos // BLOCK_SIZE, NB - 1)] * BLOCK_SIZE + pos % BLOCK_SIZE``."""
    blk, off = floor_divmod(pos, BLOCK_SIZE)
    blk = jnp_index(tl.minimum(blk, NB - 1), NB)
    block_id = tl.load(block_row_ptr + blk, mask=mask, other=0)
    return block_id * BLOCK_SIZE + off

"""Helpers shared by the XLA backends of the index ops (``kernels/<op>/xla.py``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


_I32 = jnp.int32
_BIG = jnp.iinfo(jnp.int32).max


def _owner(starts: jax.Array, idx: jax.Array, num_reqs: jax.Array):
    """Row owning each index, for rows laid out back to back from ``starts``.

    ``starts``: ``[R]`` non-decreasing start of each row (rows >= num_reqs ignored);
    ``idx``: ``[N]``. Returns the row ``[N]`` (clipped to [0, R-1]) and whether the index
    lies before the first start (``False`` means it belongs to some real row, subject to
    the caller's end check).
    """
    r = starts.shape[0]
    real = jnp.arange(r, dtype=_I32) < num_reqs
    keyed = jnp.where(real, starts, _BIG)
    # "scan_unrolled": a fixed unrolled bisection; the default "scan" is a while loop, which
    # on GPU costs a device->host predicate sync per iteration.
    row = jnp.searchsorted(keyed, idx, side="right", method="scan_unrolled").astype(_I32) - 1
    return jnp.clip(row, 0, max(r - 1, 0)), row >= 0


def _slot(block_table: jax.Array, row: jax.Array, pos: jax.Array, block_size: int) -> jax.Array:
    nb = block_table.shape[1]
    blk = jnp.minimum(pos // block_size, nb - 1)
    return block_table[row, blk] * block_size + pos % block_size

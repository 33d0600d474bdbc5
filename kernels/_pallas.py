"""Shared pieces of the Mosaic GPU (Pallas) index kernels: ``plgpu.kernel`` over a 1-D grid
of programs named ``"blk"``, each writing one chunk of ``LANES = 128`` output elements with
full-width vector stores (no masked store: outputs are allocated in whole chunks and sliced).
Data-dependent addresses are scalar loads merged into the lane vector with a select. Off
the GPU the kernels run in GPU interpret mode, one host callback per ref access.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from specjax import _compat

#: ``jax.experimental.pallas.mosaic_gpu``, or None (with the reason) on a JAX that cannot
#: run these kernels: importing this package still works, :func:`run_kernel` raises, and
#: ``specjax.kernels.resolve_backend("pallas")`` refuses up front.
plgpu, MOSAIC_GPU_MISSING = _compat.pallas_mosaic_gpu()

# Imported for its side effect: it defines a config option that is part of every jit cache
# key. Interpret mode imports it lazily during the first kernel call, which would otherwise
# make the first jitted op miss its cache once.
try:
    from jax.experimental.pallas import fuser as _fuser  # noqa: F401,E402
except ImportError:  # pragma: no cover - a JAX without it has no such option either
    pass

#: Lanes of one chunk: one element per thread of a warpgroup.
LANES = 128
I32 = jnp.int32
#: Larger than every int32 index the kernels compare against (a "no lane" sentinel).
BIG = jnp.iinfo(jnp.int32).max


def interpret_params():
    """GPU interpret mode off the GPU, compiled Mosaic GPU on it."""
    return _compat.interpret_gpu_params()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def run_kernel(body: Callable, out_type, num_programs: int, name: str):
    """``plgpu.kernel`` with a 1-D grid of ``num_programs`` programs named ``"blk"``."""
    if plgpu is None:
        raise ValueError(f"the Pallas index kernels are unavailable: {MOSAIC_GPU_MISSING}")
    return plgpu.kernel(
        body,
        out_type=out_type,
        grid=(num_programs,),
        grid_names=("blk",),
        # Warpgroup semantics (the Mosaic GPU default) infers layouts of values and loop carries
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=_compat.mosaic_gpu_warpgroup_semantics()),
        interpret=interpret_params(),
        kernel_name=name,
    )


def program_id():
    """Index of this program (``lax.axis_index``: ``pl.program_id`` interprets as 0)."""
    return lax.axis_index("blk")


def lanes():
    """``[LANES] int32`` iota in the strided warpgroup layout (lane i holds i)."""
    return _compat.mosaic_gpu_strided_iota(I32, LANES)


def full(value, dtype=I32):
    """A ``[LANES]`` vector of ``value``, in the strided layout like every loop carry."""
    return lanes() * 0 + jnp.asarray(value, dtype)


def extract(vec, i):
    """Lane ``i`` of a ``[LANES] int32`` vector as a scalar (a warpgroup reduction)."""
    return jnp.sum(jnp.where(lanes() == i, vec, 0))


def chunk(start):
    """``pl.ds(start, LANES)``: the slice of one chunk."""
    return pl.ds(start, LANES)


def num_real(n_ref, rows: int):
    """``num_reqs`` read from its ``[1]`` ref, clipped to ``[0, rows]``."""
    return jnp.clip(n_ref[0], 0, rows)


def count_le(key: Callable, n, bound):
    """Number of ``r`` in ``[0, n)`` with ``key(r) <= bound``, for non-decreasing keys.

    A binary search of scalar loads (``key`` reads a ref): ``bit_length(n)`` probes.
    """

    def cond(state):
        lo, hi = state
        return lo < hi

    def body(state):
        lo, hi = state
        mid = lax.div(lo + hi, 2)
        ok = key(mid) <= bound
        return jnp.where(ok, mid + 1, lo), jnp.where(ok, hi, mid)

    lo, _ = lax.while_loop(cond, body, (jnp.int32(0), n))
    return lo


def pad_rows(x: jax.Array, rows: int, before: int = 0) -> jax.Array:
    """``x`` padded with zeros along axis 0 to ``rows`` rows, ``before`` of them in front."""
    after = rows - before - x.shape[0]
    if before == 0 and after == 0:
        return x
    widths = [(before, after)] + [(0, 0)] * (x.ndim - 1)
    return jnp.pad(x, widths)


def head(x: jax.Array, n: int) -> jax.Array:
    """The first ``n`` rows of ``x`` (no op when it has exactly ``n``)."""
    return x if x.shape[0] == n else x[:n]


def as_mask(x: jax.Array) -> jax.Array:
    """Kernel-side masks are int8 (Mosaic GPU cannot vector-store i1); bool for callers."""
    return x.astype(jnp.bool_)

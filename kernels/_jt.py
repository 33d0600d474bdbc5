"""The one place specjax calls jax-triton.

Written against jax-triton 0.3.1 (the last release that runs with triton 3.6). A move to
0.4 touches only this file: there ``out_shape`` is called ``out_type``, aliased buffers are
no longer repeated among the outputs, and ``zeroed_outputs`` / ``num_stages`` change.

Convention for every call site: positional ``args`` are device arrays only (so nothing
dynamic is ever baked into a compiled kernel by accident; jax-triton turns Python
scalars into static kernel arguments), and every static value is a ``tl.constexpr``
passed through ``metaparams``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def pow2_block(n: int, lo: int, hi: int) -> int:
    """A power-of-two block size: the next power of two >= n, clipped to [lo, hi]."""
    p = 1 << max(int(n) - 1, 0).bit_length()
    return max(lo, min(p, hi))


def triton_call(
    *args: jax.Array,
    kernel: Any,
    out_shape: Sequence[jax.ShapeDtypeStruct],
    grid: int | tuple[int, ...],
    num_warps: int = 4,
    num_stages: int = 1,
    name: str = "",
    **metaparams: Any,
) -> list[jax.Array]:
    """Launch ``kernel`` once over ``grid``; returns one fresh array per ``out_shape``.

    Output pointers follow the inputs in the kernel's signature, then the constexpr
    ``metaparams`` by name. Every output element must be written by the kernel.
    ``num_stages``: 1 (the default) for the latency-bound index kernels, more for kernels
    with a loop whose loads Triton should pipeline (paged attention).
    """
    for i, a in enumerate(args):
        if isinstance(a, (bool, int, float, np.generic)) or a is None:
            raise TypeError(
                f"triton_call argument {i} is a Python/NumPy scalar or None ({a!r}); pass "
                "dynamic values as device arrays and static ones as constexpr metaparams")
    import jax_triton as jt  # lazy: jax-triton 0.3.1 refuses to import without a GPU

    outs = jt.triton_call(
        *args,
        kernel=kernel,
        out_shape=list(out_shape),
        grid=grid,
        num_warps=num_warps,
        num_stages=num_stages,
        name=name,
        **metaparams,
    )
    return list(outs)

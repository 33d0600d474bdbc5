"""The one place specjax calls jax-triton (written against jax-triton 0.3.1).

Every call site passes device arrays only as positional ``args`` (jax-triton would bake a
Python scalar into the kernel) and every static value as a ``tl.constexpr`` through
``metaparams``.
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
    """Launch ``kernel`` once over ``grid``; one fresh array per ``out_shape``, every element
    of which the kernel must write. Output pointers follow the inputs in the kernel's
    signature, then the constexpr ``metaparams`` by name. ``num_stages`` > 1 pipelines the
    loads of a loop (paged attention)."""
    for i, a in enumerate(args):
        if isinstance(a, (bool, int, float, np.generic)) or a is None:
            raise TypeError(
                f"triton_call argument {i} is a Python/NumPy scalar or None ({a!r}); pass "
                "dynamic values as device arrays and static ones as constexpr metaparams")
    import jax_triton as jt  # lazy: jax-triton 0.3.1 refuses to import without a GPU
    # jax-triton 0.4 renames out_shape to out_type, stops repeating aliased buffers among
    # the outputs and changes zeroed_outputs / num_stages: only this call would change.

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

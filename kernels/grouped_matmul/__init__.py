"""The grouped matmul of a mixture-of-experts layer: rows sorted by group, one weight matrix
a group (``jax.lax.ragged_dot``'s contract); ``backend=``: :mod:`~specjax.kernels.backend`.

``"xla"`` is ``jax.lax.ragged_dot``; ``"pallas"`` is :mod:`.pallas`'s kernel, which reads
each group's weights only for the row tiles that group holds (XLA's GPU rewrite of
``ragged_dot`` multiplies every row by every group's weights under a mask: E times a dense
layer's FLOPs, all E groups' weights read, and an ``[M, E, K]`` temporary). ``"auto"``: the
process default, else ``"pallas"`` on a GPU with Pallas-Triton and ``"xla"`` elsewhere or
for shapes the kernel does not take (K or N not a multiple of 16: a fine tensor split). A
process default of ``"triton"`` means the Pallas kernel (it lowers through Triton); a call
naming ``"triton"`` is a ValueError (there is no hand-written Triton version).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.kernels import backend as _backend

__all__ = ["grouped_matmul", "pair_matmul", "resolve_grouped_backend"]


def resolve_grouped_backend(backend: str = "auto") -> str:
    """``"xla"`` or ``"pallas"``: what :func:`grouped_matmul` runs for ``backend`` under the
    process default. ValueError naming ``backend`` for an unknown value or ``"triton"``."""
    backend = _backend.check_backend(backend)
    if backend == "triton":
        raise ValueError("backend='triton': grouped_matmul has no Triton version; use 'xla' "
                         "or 'pallas' (which lowers through Triton)")
    if backend == "auto":
        backend = _backend.get_default_backend()
    if backend == "auto":
        from specjax.kernels.grouped_matmul import pallas

        return "pallas" if jax.default_backend() == "gpu" and pallas.pltr is not None else "xla"
    return "pallas" if backend == "triton" else backend


def grouped_matmul(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *,
                   backend: str = "auto") -> jax.Array:
    """``out[i] = lhs[i] @ rhs[g(i)]`` for ``lhs [M, K]`` whose rows are sorted by group,
    ``rhs [E, K, N]`` and ``group_sizes [E]`` int (group g owns the ``group_sizes[g]`` rows
    after those of groups < g) -> ``[M, N]`` in the promoted dtype of ``lhs`` and ``rhs``.
    Rows past ``sum(group_sizes)`` are zeros on ``"pallas"`` and unspecified on ``"xla"``.
    ValueError naming the argument for mismatched shapes."""
    if lhs.ndim != 2 or rhs.ndim != 3 or group_sizes.ndim != 1:
        raise ValueError(f"lhs {lhs.shape} / rhs {rhs.shape} / group_sizes {group_sizes.shape} "
                         "must be [M, K] / [E, K, N] / [E]")
    if rhs.shape[1] != lhs.shape[1] or group_sizes.shape[0] != rhs.shape[0]:
        raise ValueError(f"lhs {lhs.shape}, rhs {rhs.shape} and group_sizes "
                         f"{group_sizes.shape} do not fit [M, K], [E, K, N], [E]")
    which = resolve_grouped_backend(backend)
    if which == "pallas" and backend == "auto":
        from specjax.kernels.grouped_matmul import pallas

        if pallas.unsupported_reason(lhs.shape[1], rhs.shape[2]) is not None:
            which = "xla"                   # (a named "pallas" raises instead)
    if which == "xla":
        return jax.lax.ragged_dot(lhs, rhs, group_sizes.astype(jnp.int32))
    from specjax.kernels.grouped_matmul import pallas

    return pallas.grouped_matmul(lhs, rhs, group_sizes)


def pair_matmul(lhs: jax.Array, rhs: jax.Array, rows: jax.Array, groups: jax.Array,
                bias: jax.Array | None = None, *, glu=None) -> jax.Array:
    """:func:`.pallas.pair_matmul` (Pallas only; the XLA path is the sorted :func:`grouped_matmul`)."""
    from specjax.kernels.grouped_matmul import pallas

    return pallas.pair_matmul(lhs, rhs, rows, groups, bias, glu=glu)

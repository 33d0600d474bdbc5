"""One host-to-device transfer per step: a pytree of host arrays sent as one int32 buffer.

A step's inputs (``StepBatch``) are some 25 small NumPy arrays; passed as they are, each is
copied to the device separately, at a host cost per copy. :func:`pack` concatenates them
(4-byte dtypes reinterpreted as int32, bools widened) into one array with a static,
hashable :class:`Layout`; :func:`unpack`, traced in the jit, slices and bit-casts them back,
exactly. The layout depends only on tree structure, shapes and dtypes: fixed buckets keep
a fixed set of compiled programs."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

_WORD = np.dtype(np.int32)
#: dtypes carried bit for bit in int32 words (bool is widened to one word per element)
PACKABLE = frozenset(np.dtype(d).str for d in (np.int32, np.uint32, np.float32, np.bool_))


class Layout(NamedTuple):
    """Static description of a packed pytree: its treedef and, per leaf, ``(dtype str,
    shape, offset, size)`` in words."""

    treedef: Any
    leaves: tuple[tuple[str, tuple[int, ...], int, int], ...]


def packable(tree: Any) -> bool:
    """Whether every leaf of ``tree`` is a host value (NumPy array / scalar or a Python
    number) of a dtype :func:`pack` carries exactly (int32, uint32, float32, bool)."""
    for x in jax.tree_util.tree_leaves(tree):
        if isinstance(x, jax.Array) or not isinstance(x, (np.ndarray, np.generic, int, float, bool)):
            return False
        if isinstance(x, (np.ndarray, np.generic)) and x.dtype.str not in PACKABLE:
            return False
        if isinstance(x, int) and not isinstance(x, bool) and not -2**31 <= x < 2**31:
            return False
    return True


def _host(x) -> np.ndarray:
    if isinstance(x, bool):
        return np.asarray(x, np.bool_)
    if isinstance(x, int):
        return np.asarray(x, np.int32)
    if isinstance(x, float):
        return np.asarray(x, np.float32)
    return np.asarray(x)


def pack(tree: Any) -> tuple[np.ndarray, Layout]:
    """``(words [N] int32, layout)`` for a :func:`packable` ``tree``."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    parts, meta, off = [], [], 0
    for x in leaves:
        a = _host(x)
        dt = a.dtype.str
        flat = a.reshape(-1)
        w = flat.astype(_WORD) if a.dtype == np.bool_ else np.ascontiguousarray(flat).view(_WORD)
        parts.append(w)
        meta.append((dt, tuple(a.shape), off, int(w.size)))
        off += int(w.size)
    words = np.concatenate(parts) if parts else np.zeros(0, _WORD)
    return words, Layout(treedef, tuple(meta))


def unpack(words: jax.Array, layout: Layout) -> Any:
    """The pytree :func:`pack` packed, from ``words`` (traceable; exact)."""
    out = []
    for dt, shape, off, size in layout.leaves:
        seg = jax.lax.slice_in_dim(words, off, off + size).reshape(shape)
        dtype = np.dtype(dt)
        if dtype == np.bool_:
            seg = seg != 0
        elif dtype != _WORD:
            seg = jax.lax.bitcast_convert_type(seg, jnp.dtype(dtype))
        out.append(seg)
    return jax.tree_util.tree_unflatten(layout.treedef, out)

"""Argument checks of the index ops: index arrays become int32 ``jax.Array``, masks bool,
``num_reqs`` a 0-d int32 array; shapes, dtypes and static values only, so they run on
tracers before anything launches."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specjax.constants import check_index_range  # noqa: F401  (re-exported for the ops)


def dtype_of(x: Any) -> np.dtype:
    return np.dtype(x.dtype) if hasattr(x, "dtype") else np.asarray(x).dtype


def index_array(name: str, x: Any, ndim: int) -> jax.Array:
    dt = dtype_of(x)
    if not np.issubdtype(dt, np.integer):
        raise ValueError(f"{name} must be an integer array (int32 preferred), got dtype {dt}")
    shape = np.shape(x)
    if len(shape) != ndim:
        raise ValueError(f"{name} must have rank {ndim}, got shape {tuple(shape)}")
    if dt.itemsize > 4 or dt == np.uint32:
        # a wider integer array would wrap silently in the int32 cast below: check its
        # values when they are known (a tracer of a wider dtype exists only under x64)
        if isinstance(x, jax.core.Tracer):
            raise ValueError(f"{name} must be int32 inside a traced function, got dtype {dt}")
        v = np.asarray(x)
        if v.size and (v.min() < np.iinfo(np.int32).min or v.max() > np.iinfo(np.int32).max):
            raise ValueError(f"{name} ({dt}) holds values outside int32 "
                             f"[{np.iinfo(np.int32).min}, {np.iinfo(np.int32).max}]: min "
                             f"{int(v.min())}, max {int(v.max())}; every kernel index is int32")
    return jnp.asarray(x, dtype=jnp.int32)


def bool_array(name: str, x: Any, ndim: int) -> jax.Array:
    dt = dtype_of(x)
    if dt != np.bool_:
        raise ValueError(f"{name} must be a bool array, got dtype {dt}")
    shape = np.shape(x)
    if len(shape) != ndim:
        raise ValueError(f"{name} must have rank {ndim}, got shape {tuple(shape)}")
    return jnp.asarray(x, dtype=jnp.bool_)


def num_reqs(num_reqs: Any, rows: int) -> jax.Array:
    if num_reqs is None:
        return jnp.asarray(rows, dtype=jnp.int32)
    dt = dtype_of(num_reqs)
    if not np.issubdtype(dt, np.integer) or np.ndim(num_reqs) != 0:
        raise ValueError(
            f"num_reqs must be None or a 0-d integer array (a device scalar), got "
            f"dtype {dt} with shape {tuple(np.shape(num_reqs))}"
        )
    if not isinstance(num_reqs, jax.core.Tracer):
        n = int(num_reqs)
        if not 0 <= n <= rows:
            raise ValueError(f"num_reqs={n} must be in [0, {rows}] (the padded row count)")
    return jnp.asarray(num_reqs, dtype=jnp.int32)


def positive_int(name: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or int(v) <= 0:
        raise ValueError(f"{name} must be a positive int, got {v!r}")
    return int(v)


def nonneg_int(name: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or int(v) < 0:
        raise ValueError(f"{name} must be a non-negative int, got {v!r}")
    return int(v)


def as_int(name: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise ValueError(f"{name} must be an int, got {v!r}")
    return int(v)


def same_len(what: str, **arrays: Any) -> None:
    lens = {k: np.shape(v)[0] for k, v in arrays.items()}
    if len(set(lens.values())) > 1:
        raise ValueError(f"{what}: leading dimensions disagree: {lens}")

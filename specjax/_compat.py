"""Every JAX API specjax uses that differs across the supported JAX range, in one place.

Supported: jax / jaxlib 0.10.2 through 0.12.x (``pyproject.toml``). Every other module
imports the version-sensitive pieces from here; nothing else tests ``jax.__version__``.
Each shim detects the feature (attribute, signature), not the version number. What
differs across the range: docs/install.md.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import warnings
from typing import Any, Callable

import jax


def _parse(version: str) -> tuple[int, ...]:
    """``"0.12.0.1"`` -> ``(0, 12, 0, 1)``; stops at the first part that is not a number
    (``"0.11.0.dev20250101"`` -> ``(0, 11, 0)``, ``"0.11.1rc1"`` -> ``(0, 11, 1)``)."""
    out = []
    for part in version.split("."):
        digits = part[:len(part) - len(part.lstrip("0123456789"))]
        if not digits:
            break
        out.append(int(digits))
        if digits != part:
            break
    return tuple(out)


#: The running JAX, e.g. ``(0, 12, 0, 1)``; for messages and tests only.
JAX_VERSION = _parse(jax.__version__)
#: The range pyproject pins and CI tests (oldest and newest): ``[MIN, END)``.
MIN_JAX = (0, 10, 2)
END_JAX = (0, 13)


def jax_in_supported_range() -> bool:
    return MIN_JAX <= JAX_VERSION < END_JAX


# ---------------------------------------------------------------------------------------
# shard_map


@functools.cache
def _shard_map_impl() -> tuple[Callable, str]:
    """``(shard_map, name of its "check" keyword)``."""
    fn = getattr(jax, "shard_map", None)
    if fn is not None:
        params = inspect.signature(fn).parameters
        return fn, ("check_vma" if "check_vma" in params else "check_rep")
    from jax.experimental.shard_map import shard_map as fn  # pragma: no cover - JAX < 0.7

    return fn, "check_rep"  # pragma: no cover


def shard_map(f: Callable, *, mesh, in_specs, out_specs, axis_names=frozenset(),
              check_vma: bool = True) -> Callable:
    """``jax.shard_map`` with the keywords of 0.10.2-0.12 (``check_vma``, ``axis_names``)."""
    fn, check = _shard_map_impl()
    kw: dict[str, Any] = {check: check_vma}
    if axis_names:
        kw["axis_names"] = set(axis_names)
    return fn(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, **kw)


def get_abstract_mesh():
    """The context's abstract mesh (``jax.sharding.get_abstract_mesh``), or None."""
    get = getattr(jax.sharding, "get_abstract_mesh", None)
    return get() if get is not None else None


def use_mesh(mesh):
    """``mesh`` as the context mesh (``jax.set_mesh`` as a context manager); None: no-op."""
    if mesh is None:
        return contextlib.nullcontext()
    return (getattr(jax, "set_mesh", None) or jax.sharding.use_mesh)(mesh)


# ---------------------------------------------------------------------------------------
# custom_partitioning with Shardy, config options, shardings


def custom_partitioning_shardy(fn: Callable, *, static_argnums, partition: Callable,
                               sharding_rule: Callable) -> Callable:
    """``custom_partitioning(fn)`` with ``partition`` and a Shardy ``sharding_rule``."""
    from jax.experimental.custom_partitioning import custom_partitioning

    cp = custom_partitioning(fn, static_argnums=static_argnums)
    cp.def_partition(partition, sharding_rule=sharding_rule)
    return cp


def enum_config_state(name: str, values, default: str, help: str):
    """A JAX config option that keys ``jax.jit``'s cache (``jax._src.config.enum_state``;
    the one already registered under ``name`` if any), or None without that private API."""
    try:
        from jax._src import config as jax_config

        if name in jax_config.config_states:
            return jax_config.config_states[name]
        return jax_config.enum_state(name, list(values), default, help=help,
                                     include_in_jit_key=True, include_in_trace_context=True)
    except Exception:  # pragma: no cover - a JAX without enum_state / its keywords
        return None


def replicated_like(sharding, mesh):
    """A fully replicated sharding of the same kind as ``sharding`` over the same devices."""
    from jax.sharding import NamedSharding, PartitionSpec

    if isinstance(sharding, NamedSharding):
        return NamedSharding(mesh, PartitionSpec())
    from jax._src.sharding_impls import GSPMDSharding

    return GSPMDSharding.get_replicated(sharding._device_assignment)


# ---------------------------------------------------------------------------------------
# Pallas


@functools.cache
def pallas_mosaic_gpu() -> tuple[Any, str]:
    """``(jax.experimental.pallas.mosaic_gpu, "")``, or ``(None, why)`` when this JAX cannot
    run the Mosaic GPU Pallas kernels (the ``"pallas"`` index-kernel backend)."""
    try:
        from jax.experimental.mosaic import gpu as mgpu  # noqa: F401
        from jax.experimental.pallas import mosaic_gpu as plgpu

        for attr in ("kernel", "CompilerParams", "broadcasted_iota", "Layout"):
            getattr(plgpu, attr)
        mgpu.LoweringSemantics.Warpgroup  # noqa: B018
        _interpret_gpu_params_cls()
    except Exception as e:  # ImportError, AttributeError
        return None, (f"JAX {jax.__version__} has no usable Pallas Mosaic GPU "
                      f"({type(e).__name__}: {e})")
    return plgpu, ""


def mosaic_gpu_warpgroup_semantics():
    """``jax.experimental.mosaic.gpu.LoweringSemantics.Warpgroup``."""
    from jax.experimental.mosaic import gpu as mgpu

    return mgpu.LoweringSemantics.Warpgroup


@functools.cache
def _interpret_gpu_params_cls():
    from jax.experimental.pallas import mosaic_gpu as plgpu

    cls = getattr(plgpu, "InterpretGPUParams", None)       # public from JAX 0.11.2
    if cls is None:                                        # 0.10.2, 0.11.0: private only
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams as cls
    return cls


def interpret_gpu_params():
    """Mosaic GPU interpret mode (``plgpu.InterpretGPUParams()``) off the GPU; None (compile
    for the GPU) on it."""
    if jax.default_backend() != "gpu":
        return _interpret_gpu_params_cls()()
    return None


def mosaic_gpu_strided_iota(dtype, n: int):
    """``[n]`` iota (lane i holds i) in Mosaic GPU's strided warpgroup layout when compiled
    for the GPU; a plain ``lax.broadcasted_iota`` in interpret mode, where the layout is a
    no-op (and JAX < 0.11.2's interpreter has no ``layout_cast`` rule)."""
    if jax.default_backend() != "gpu":
        return jax.lax.broadcasted_iota(dtype, (n,), 0)
    from jax.experimental.pallas import mosaic_gpu as plgpu

    return plgpu.broadcasted_iota(dtype, (n,), 0,
                                  layout=plgpu.Layout.WG_STRIDED((n,), vec_size=1))


@functools.cache
def pallas_triton() -> tuple[Any, str]:
    """``(jax.experimental.pallas.triton, "")``, the backend that lowers the Pallas
    paged-attention kernel on the GPU, or ``(None, why)`` when this JAX has none."""
    try:
        from jax.experimental.pallas import triton as pltr

        pltr.CompilerParams  # noqa: B018
    except Exception as e:
        return None, (f"JAX {jax.__version__} has no Pallas Triton backend "
                      f"({type(e).__name__}: {e})")
    return pltr, ""


def pallas_triton_compiler_params(**kw):
    """``pltr.CompilerParams(**kw)`` (the Pallas Triton backend's compiler parameters)."""
    pltr, why = pallas_triton()
    if pltr is None:
        raise ValueError(why)
    return pltr.CompilerParams(**kw)


# ---------------------------------------------------------------------------------------
# jax-triton


@functools.cache
def jax_triton_available() -> tuple[bool, str]:
    """Whether the ``"triton"`` backends can run: an NVIDIA GPU and an importable jax-triton
    + triton (``specjax[gpu]``)."""
    if jax.default_backend() not in ("gpu", "cuda"):
        return False, f"no NVIDIA GPU: jax.default_backend() is {jax.default_backend()!r}"
    try:
        import jax_triton  # noqa: F401
        import triton  # noqa: F401
    except Exception as e:  # ImportError, or jax-triton's own GPU check
        return False, f"jax-triton is not importable ({e}); install specjax[gpu]"
    return True, ""


_warned: set[str] = set()


def warn_once(key: str, message: str) -> None:
    """One ``UserWarning`` per ``key`` per process."""
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, UserWarning, stacklevel=3)

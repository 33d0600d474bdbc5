"""Which backend a kernel runs on: ``backend=`` per call, a process default, ``auto``.

Every op of :mod:`specjax.kernels` takes ``backend="auto" | "xla" | "pallas" | "triton"``.
Precedence, highest first: (1) the call's ``backend=`` when it names a backend; (2) the
process default when not ``"auto"``: :func:`default_backend` (a context manager),
:func:`set_default_backend`, else ``SPECJAX_KERNEL_BACKEND`` (read at import); (3) the op's
``auto`` rule: XLA for the index ops, for paged attention a kernel on the GPU for
decode-shaped steps and XLA elsewhere. A named backend that cannot run here is a ValueError
naming it. The default is read at trace time and is a JAX config option
(``jax.config.specjax_kernel_backend``), part of ``jax.jit``'s cache key.
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

import jax

from specjax import _compat

BACKENDS = ("auto", "xla", "pallas", "triton")
_OPTION = "specjax_kernel_backend"
_ENV = "SPECJAX_KERNEL_BACKEND"

# "auto" for the index ops, per platform: XLA everywhere (they are launch-bound and XLA fuses
# them into the step: docs/performance.md), a backend every supported JAX has.
_AUTO = {"cpu": "xla", "gpu": "xla", "cuda": "xla", "rocm": "xla", "tpu": "xla"}


def check_backend(backend, what: str = "backend") -> str:
    """``backend`` when it is one of :data:`BACKENDS`, else ValueError naming ``what``."""
    if backend not in BACKENDS:
        raise ValueError(f"{what}={backend!r} is not one of {BACKENDS}")
    return backend


def _env_default() -> str:
    return check_backend(os.environ.get(_ENV, "auto"), _ENV)


_STATE = _compat.enum_config_state(
    _OPTION, BACKENDS, "auto",
    help="process-wide default backend of specjax.kernels ops called with backend='auto': "
         "auto | xla | pallas | triton (trace-time static; environment variable "
         "SPECJAX_KERNEL_BACKEND)")
# JAX reads a config option's environment variable (its name upper-cased) itself; checked
# here too, so a bad value names the variable and the allowed values at import.
_fallback = [_env_default()]


def get_default_backend() -> str:
    """The process default (``"auto"`` unless set), as read at trace time."""
    return _STATE.value if _STATE is not None else _fallback[0]


def set_default_backend(backend: str) -> None:
    """Set the process default for every op called with ``backend="auto"``."""
    check_backend(backend)
    if _STATE is not None:
        jax.config.update(_OPTION, backend)
    else:  # pragma: no cover - a JAX without the config-state API
        _fallback[0] = backend


@contextlib.contextmanager
def default_backend(backend: str) -> Iterator[None]:
    """Context manager: ``backend`` is the default for the functions traced inside."""
    check_backend(backend)
    if _STATE is not None:
        with _STATE(backend):
            yield
    else:  # pragma: no cover
        prev, _fallback[0] = _fallback[0], backend
        try:
            yield
        finally:
            _fallback[0] = prev


def _platform() -> str:
    return jax.default_backend()


def _triton_available() -> tuple[bool, str]:
    """An NVIDIA GPU and an importable jax-triton (:func:`specjax._compat.jax_triton_available`)."""
    return _compat.jax_triton_available()


def resolve_backend(backend: str = "auto") -> str:
    """The concrete backend (``"xla"``, ``"pallas"`` or ``"triton"``) an index op runs on
    for ``backend`` under the process default; ValueError naming it
    when it is unknown or cannot run on this JAX / machine (``"triton"`` without a GPU or
    jax-triton, ``"pallas"`` without a usable Pallas Mosaic GPU)."""
    backend = check_backend(backend)
    if backend == "auto":
        backend = get_default_backend()
        if backend == "auto":
            return _AUTO.get(_platform(), "xla")
    if backend == "triton":
        ok, why = _triton_available()
        if not ok:
            raise ValueError(f"backend='triton' is unavailable: {why}")
    if backend == "pallas":
        plgpu, why = _compat.pallas_mosaic_gpu()
        if plgpu is None:
            raise ValueError(f"backend='pallas' is unavailable: {why}")
    return backend


def op_module(package: str, backend: str):
    """The ``xla`` / ``pallas`` / ``triton`` module of one op family (``package``: its
    import path), imported on first use (the Triton ones import triton)."""
    import importlib

    return importlib.import_module(f"{package}.{backend}")

"""Paged attention, one op: the KV-cache write and attention over ragged batches.

The public op (this file: backend choice and the entry points) with everything it runs,
side by side: ``reference.py`` (pure jax.numpy), ``pallas.py`` and ``triton.py`` (the
kernels), ``limits.py`` (the shapes the kernels take, shared), ``partition.py`` (the
SPMD rule) and ``kv_cache.py`` (the cache write). Models call only :func:`write_kv` and
:func:`paged_attention` (or :func:`attend`, both).

Cache layout, per layer: ``KVCache(k, v)``, each ``[num_blocks, block_size, num_kv_heads,
head_dim]``. Token ``t`` is written at flat slot ``slot_mapping[t]`` (=
``block * block_size + offset``); slot ``-1`` (``PADDING_SLOT_ID``) is dropped.

Attention semantics (vLLM): request ``r`` owns query tokens ``query_start_loc[r] ..
query_start_loc[r+1]-1`` and keys at positions ``0 .. seq_lens[r]-1``, read through
``block_table[r]``. Causal: query ``i`` of a request of query length ``q`` sits at position
``seq_len - q + i`` and sees keys at positions ``<=`` it. Non-causal: every query sees
every key of its request. Tree attention (``md.tree_mask``, static ``Q x Q``): query
``i`` sees every key before its request's query block and the key of query ``j`` of the
block iff ``tree_mask[i][j]``. Tokens past ``query_start_loc[-1]`` (padding) get zeros.

Memory: K/V are gathered per request up to the block table's width (``[B_pad,
max_blocks * block_size]``), so the block table's width is the static context bucket:
callers pass a table sliced to the bucket they need. Queries are laid out per request
up to ``attn_metadata.max_query_len`` (static).

Backends. :func:`paged_attention` runs one of three implementations of the same function,
side by side in this folder:

- ``"xla"``: the pure jax.numpy reference (``reference.py``, :func:`paged_attention_xla`).
- ``"pallas"``: ``pallas.py``, a Pallas kernel lowered through Triton that reads only each
  request's live pages (online softmax, split-K for small batches); interpret mode off the
  GPU. Not bit-identical: float32 results agree with the reference to ~1e-6 relative,
  bfloat16 to bfloat16 rounding (tests/kernels/test_paged_attention.py holds them to 2e-5 / 2e-2).
  Shapes it cannot take (``limits.py``, :func:`unsupported_reason`: head_dim not a power of
  two >= 16, ``max_query_len * group > 128`` rows, trees over 31 nodes) fall back to
  ``"xla"``.
- ``"triton"``: ``triton.py``, the same kernel written in Triton's own language and called
  through jax-triton (GPU only; JAX deprecates the Pallas Triton backend the ``"pallas"``
  kernel is lowered through). Same limits and fallbacks; the step's K/V are written by two
  scatters first (the fused write is Pallas-only).
- ``"auto"``: a kernel when JAX's default backend is the GPU, ``max_query_len <=
  AUTO_MAX_QUERY_LEN`` (the decode-shaped steps the kernel is built for) and the shapes are
  supported; else ``"xla"``. On CPU this is always ``"xla"``. The kernel is ``"pallas"``
  where this JAX has the Pallas Triton backend (every JAX in the supported range,
  0.10.2-0.12, has it), else ``"triton"`` when jax-triton is installed, else ``"xla"`` with
  one warning naming the cost (:func:`auto_kernel_backend`).

Choosing. Per call, ``paged_attention(..., backend=)`` / ``attend(..., backend=)``; else the
process default of every kernel (:mod:`specjax.kernels.backend`: ``SPECJAX_KERNEL_BACKEND``,
``specjax.kernels.default_backend(...)``, ``specjax.kernels.set_default_backend``). The
older attention-only names, ``SPECJAX_ATTENTION_BACKEND``, :func:`set_attention_backend`,
:func:`attention_backend` and :func:`get_attention_backend`, keep working and take
precedence over the process default for attention (an alias scoped to this op). Every
choice is **trace-time static** and part of ``jax.jit``'s cache key.

Several devices: the kernels are called through ``custom_partitioning``
(``partition.py``), which keeps the kv-head split of tensor parallelism with no collective.

On the ``"pallas"`` backend :func:`attend` writes the step's K/V inside the attention kernel
instead of two scatters where that pays (small batches; ``SPECJAX_FUSED_KV_WRITE=auto|0|1``,
see :data:`FUSED_KV_WRITE`), elsewhere with one cache-write kernel (:data:`KV_WRITE_KERNEL`).
The KV-cache write itself is ``kv_cache.py`` (:func:`scatter_slots`).
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

import jax
import jax.numpy as jnp

from specjax import _compat
from specjax.attention_metadata import CommonAttentionMetadata
from specjax.kernels import backend as _backend
from specjax.kernels.paged_attention import partition as _part
from specjax.kernels.paged_attention.kv_cache import KVCache, scatter_slots
from specjax.kernels.paged_attention.limits import fused_write_pays, unsupported_reason
from specjax.kernels.paged_attention.reference import paged_attention_xla

ATTENTION_BACKENDS = ("auto", "xla", "pallas", "triton")
FUSED_KV_WRITE_MODES = ("auto", "0", "1")
#: Whether :func:`attend` on the ``"pallas"`` backend writes the new K/V inside the attention
#: kernel (trace-time; environment variable ``SPECJAX_FUSED_KV_WRITE``, read at import):
#: ``"1"`` always, ``"0"`` never (two scatters, then the kernel), ``"auto"`` (default) when
#: :func:`~specjax.kernels.paged_attention.limits.fused_write_pays` says so -- the kernel
#: splits each request's context over several programs (small batches). On the H200 the
#: fused write took 1-5% off the B = 1 / 8 propose and cost 4-16% at B = 64
#: (benchmarks/RESULTS.md, "The cache write inside the attention kernel"); at B = 32 the
#: kernel alone, split in two, beat it (fourteenth session).
FUSED_KV_WRITE = os.environ.get("SPECJAX_FUSED_KV_WRITE", "auto")
if FUSED_KV_WRITE not in FUSED_KV_WRITE_MODES:
    raise ValueError(f"SPECJAX_FUSED_KV_WRITE must be one of {FUSED_KV_WRITE_MODES}, "
                     f"got {FUSED_KV_WRITE!r}")
#: Whether :func:`attend` on the ``"pallas"`` backend, where it does not fuse the write,
#: stores the step's K/V with one kernel (:func:`specjax.kernels.paged_attention.pallas.write_kv`,
#: ``"1"``, the default) or two XLA scatters (``"0"``); environment variable
#: ``SPECJAX_KV_WRITE_KERNEL``, read at import (benchmarks/RESULTS.md, sixteenth session).
KV_WRITE_KERNEL = os.environ.get("SPECJAX_KV_WRITE_KERNEL", "1")
if KV_WRITE_KERNEL not in ("0", "1"):
    raise ValueError(f"SPECJAX_KV_WRITE_KERNEL must be one of ('0', '1'), got {KV_WRITE_KERNEL!r}")
#: ``"auto"`` picks the Pallas kernel only up to this ``max_query_len`` (decode-shaped steps).
AUTO_MAX_QUERY_LEN = 16
_OPTION = "specjax_attention_backend"
_ENV = "SPECJAX_ATTENTION_BACKEND"


def _make_backend_state():
    """A JAX config option (so the choice keys ``jax.jit``'s cache), or None when this JAX
    has no such private API (then a plain holder: the choice is read at trace time only)."""
    return _compat.enum_config_state(
        _OPTION, ATTENTION_BACKENDS, "auto",
        help="paged attention backend of specjax.kernels.paged_attention (an alias scoped to "
             "attention, over SPECJAX_KERNEL_BACKEND): auto | xla | pallas | triton "
             "(trace-time static; environment variable SPECJAX_ATTENTION_BACKEND)")


def _check_backend(backend) -> str:
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend must be one of {ATTENTION_BACKENDS}, got {backend!r}")
    return backend


_STATE = _make_backend_state()
_fallback_backend = [_check_backend(os.environ.get(_ENV, "auto"))] if _STATE is None else None


def get_attention_backend() -> str:
    """The attention-scoped setting (``"auto"``, ``"xla"``, ``"pallas"`` or ``"triton"``), as
    read at trace time; ``"auto"`` defers to the process default of every kernel."""
    return _STATE.value if _STATE is not None else _fallback_backend[0]


def set_attention_backend(backend: str) -> None:
    """Set the paged-attention backend for the process (over
    :func:`specjax.kernels.set_default_backend`, which sets every kernel's default):
    ``"auto"``, ``"xla"``, ``"pallas"`` or ``"triton"``.

    Trace-time static: functions traced afterwards use it (jitted callers retrace).
    """
    _check_backend(backend)
    if _STATE is not None:
        jax.config.update(_OPTION, backend)
    else:  # pragma: no cover
        _fallback_backend[0] = backend


@contextlib.contextmanager
def attention_backend(backend: str) -> Iterator[None]:
    """Context manager: use ``backend`` for the functions traced inside the block."""
    _check_backend(backend)
    if _STATE is not None:
        with _STATE(backend):
            yield
    else:  # pragma: no cover
        prev, _fallback_backend[0] = _fallback_backend[0], backend
        try:
            yield
        finally:
            _fallback_backend[0] = prev


def resolve_attention_backend(q_shape, cache_shape, md: CommonAttentionMetadata, dtype=None,
                              backend: str | None = None) -> str:
    """The backend ``"xla"``, ``"pallas"`` or ``"triton"`` that :func:`paged_attention` uses
    for these static shapes: ``backend`` when it names one, else the attention setting
    (:func:`get_attention_backend`) when not ``"auto"``, else the process default
    (:func:`specjax.kernels.get_default_backend`), else the ``"auto"`` rule. ``"triton"``
    needs an NVIDIA GPU and jax-triton (ValueError naming what is missing otherwise)."""
    backend = _check_backend("auto" if backend is None else backend)
    if backend == "auto":
        backend = get_attention_backend()
    if backend == "auto":
        backend = _backend.get_default_backend()
    if backend == "xla":
        return "xla"
    _, nh, hd = q_shape
    reason = unsupported_reason(num_heads=nh, num_kv_heads=cache_shape[2], head_dim=hd,
                                max_query_len=md.max_query_len, tree_mask=md.tree_mask,
                                dtype=dtype)
    if reason is not None:
        return "xla"
    if backend == "triton":
        ok, why = _compat.jax_triton_available()
        if not ok:
            raise ValueError(f"attention backend 'triton' is unavailable: {why}; use 'pallas' "
                             "(interpret mode off the GPU), 'xla' or 'auto'")
    if backend == "pallas":
        pltr, why = _compat.pallas_triton()
        if pltr is None:
            raise ValueError(f"attention backend 'pallas' is unavailable: {why}; use 'triton' "
                             "(GPU, jax-triton), 'xla' or 'auto'")
    if backend in ("pallas", "triton"):
        return backend
    if _platform() != "gpu" or md.max_query_len > AUTO_MAX_QUERY_LEN:
        return "xla"
    return auto_kernel_backend()


def _platform() -> str:
    return jax.default_backend()


#: What ``"auto"`` gives up on the GPU when it has to use the XLA reference (measured on the
#: H200, benchmarks/RESULTS.md, "Pallas paged attention").
XLA_FALLBACK_COST = ("the XLA reference gathers each request's whole context bucket: an "
                     "8B-shaped EAGLE-3 propose at B=64 took 2.42 ms instead of 1.14 ms with "
                     "the Pallas kernel on an H200 (2.1x), attention alone 6x slower")


def auto_kernel_backend() -> str:
    """The attention kernel ``"auto"`` uses on the GPU: ``"pallas"`` where this JAX has the
    Pallas Triton backend, else ``"triton"`` when jax-triton is importable, else ``"xla"``
    with one :class:`UserWarning` per process naming the cost."""
    pltr, why_pallas = _compat.pallas_triton()
    if pltr is not None:
        return "pallas"
    ok, why_triton = _compat.jax_triton_available()
    if ok:
        return "triton"
    _compat.warn_once(
        "attention-auto-xla",
        f"specjax: paged attention falls back to the XLA reference on the GPU ({why_pallas}; "
        f"{why_triton}): {XLA_FALLBACK_COST}. Install specjax[gpu] (jax-triton) or a JAX "
        "with the Pallas Triton backend.")
    return "xla"


def init_kv_caches(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                   head_dim: int, dtype=jnp.float32) -> list[KVCache]:
    """Zero caches for ``num_layers`` layers."""
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return [KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(num_layers)]


def write_kv(cache: KVCache, k: jax.Array, v: jax.Array, slot_mapping: jax.Array) -> KVCache:
    """``k``, ``v``: ``[T, num_kv_heads, head_dim]``; ``slot_mapping``: ``[T] int32``."""
    return KVCache(scatter_slots(cache.k, k, slot_mapping), scatter_slots(cache.v, v, slot_mapping))


def paged_attention(q: jax.Array, cache: KVCache, md: CommonAttentionMetadata, *,
                    scale: float, backend: str | None = None) -> jax.Array:
    """Attention of ``q [T, num_heads, head_dim]`` over the paged cache -> ``[T, num_heads, head_dim]``.

    GQA: query head ``h`` reads kv head ``h // (num_heads // num_kv_heads)``. Scores and
    softmax in float32; the output has ``q.dtype``. Runs the backend chosen by
    :func:`resolve_attention_backend` for ``backend`` (None: the configured choice; see the
    module docstring).
    """
    backend = resolve_attention_backend(q.shape, cache.k.shape, md, q.dtype, backend)
    if backend != "xla":
        args = (q, cache.k, cache.v, md.query_start_loc, md.seq_lens, md.block_table)
        static = _part.static(backend, md, scale)
        if jax.device_count() > 1:
            return _part.partitioned(False)(static, *args)
        return _part.kernel_attention(static, *args)
    return paged_attention_xla(q, cache, md, scale=scale)


def attend(q: jax.Array, k: jax.Array, v: jax.Array, cache: KVCache,
           md: CommonAttentionMetadata, *, scale: float,
           backend: str | None = None) -> tuple[jax.Array, KVCache]:
    """Write this step's ``k``/``v`` through ``md.slot_mapping``, then attend over the cache.

    On the ``"pallas"`` backend, when ``q``, ``k``, ``v`` and the cache share one dtype and
    :data:`FUSED_KV_WRITE` allows it (``"auto"``: small batches, see
    :func:`~specjax.kernels.paged_attention.limits.fused_write_pays`), both happen in one
    kernel (:func:`specjax.kernels.paged_attention.pallas.paged_attention_write`: the two
    scatter kernels go away), which assumes vLLM's metadata: no request reads a slot that
    another request's token writes in the same call. Otherwise the pallas backend writes
    with one kernel (:func:`specjax.kernels.paged_attention.pallas.write_kv`, on one device
    and rows of a power-of-two ``num_kv_heads * head_dim``; :data:`KV_WRITE_KERNEL`), then
    attends; every other backend (``"triton"``, ``"xla"``) writes with two scatters.

    One token (``T == 1``): XLA rewrites the K / V projections (``[1, H] @ [H, kv * hd]``)
    as a multiply + reduce and fuses that into the consumer, the ``q|k|v`` concatenation
    of the fused write or the cache scatter, where it runs as one serial 4096-long loop per
    output element: 36.8 of the 41.8 ms of an 8B-shaped step on the H200
    (benchmarks/RESULTS.md). An optimization barrier on ``k`` and ``v`` keeps the
    projections their own (reduction) kernels; programs of two or more tokens are unchanged.
    """
    if q.shape[0] == 1:
        k, v = jax.lax.optimization_barrier((k, v))
    pallas = resolve_attention_backend(q.shape, cache.k.shape, md, q.dtype, backend) == "pallas"
    if (FUSED_KV_WRITE != "0" and pallas
            and q.dtype == k.dtype == v.dtype == cache.k.dtype == cache.v.dtype):
        _, bs, nkv, _ = cache.k.shape
        if FUSED_KV_WRITE == "1" or fused_write_pays(
                md.query_start_loc.shape[0] - 1, nkv, md.block_table.shape[1] * bs):
            return _attend_fused(q, k, v, cache, md, scale)
    one_kernel = pallas and KV_WRITE_KERNEL == "1" and jax.device_count() == 1
    if one_kernel:
        from specjax.kernels.paged_attention import pallas as _pallas
        one_kernel = _pallas.write_kv_supported(cache.k.shape, cache.k.dtype, k.dtype, v.dtype)
    cache = (KVCache(*_pallas.write_kv(cache.k, cache.v, k, v, md.slot_mapping)) if one_kernel
             else write_kv(cache, k, v, md.slot_mapping))
    return paged_attention(q, cache, md, scale=scale, backend=backend), cache


def _attend_fused(q, k, v, cache: KVCache, md: CommonAttentionMetadata, scale: float):
    args = (q, k, v, cache.k, cache.v, md.slot_mapping, md.query_start_loc, md.seq_lens,
            md.block_table)
    static = _part.static("pallas", md, scale)
    if jax.device_count() > 1:
        out, kc, vc = _part.partitioned(True)(static, *args)
    else:
        out, kc, vc = _part.pallas_attention_write(static, *args)
    return out, KVCache(kc, vc)


# JAX config states kept in the trace context (Pallas' fuser flag, defined when the Pallas
# kernels are imported) must exist before a caller's first trace: imported during it, they
# change the context and the second call of every jitted step or propose compiles again.
try:
    import specjax.kernels._pallas  # noqa: E402,F401
    import specjax.kernels.paged_attention.pallas  # noqa: E402,F401
except ImportError:   # a JAX without Mosaic GPU: the kernels fall back to XLA
    pass

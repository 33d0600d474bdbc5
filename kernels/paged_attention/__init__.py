"""Paged attention: the KV-cache write and attention over ragged batches (vLLM's semantics).

Cache, per layer: ``KVCache(k, v)``, each ``[num_blocks, block_size, num_kv_heads,
head_dim]``; token ``t`` is written at flat slot ``slot_mapping[t]`` (``block * block_size +
offset``), slot ``-1`` dropped. Request ``r`` owns query tokens ``query_start_loc[r] ..
query_start_loc[r+1]-1`` and keys ``0 .. seq_lens[r]-1``, read through ``block_table[r]``.
Causal: query ``i`` of a request of query length ``q`` sits at position ``seq_len - q + i``
and sees keys at positions ``<=`` it. Non-causal: every key of its request. Tree
(``md.tree_mask``, static ``Q x Q``): query ``i`` sees every key before its request's query
block and the key of query ``j`` of the block iff ``tree_mask[i][j]``. Tokens past
``query_start_loc[-1]`` get zeros. The block table's width and ``md.max_query_len`` are static.

Backends, one function: ``"xla"`` (``reference.py``: the specification, the CPU path),
``"pallas"`` (``pallas.py``; interpret mode off the GPU; past its ``MAX_ROWS`` query rows,
``flash.py``'s kernel for queries of any length) and ``"triton"`` (``triton.py``, past its
rows ``triton_flash.py``; GPU only),
the kernels equal to the reference up to float rounding; shapes they cannot take
(``limits.py``) run ``"xla"``. ``"auto"``: a kernel on the GPU for ``max_query_len <=
AUTO_MAX_QUERY_LEN`` (:func:`auto_kernel_backend`), ``flash.py``'s kernel (``"pallas"``;
without the Pallas Triton backend its twin, ``"triton"``) past the decode kernel's rows,
else ``"xla"``. Chosen per call
(``backend=``), else by :mod:`specjax.kernels.backend`'s process default, at trace time.
On several devices the kernels run through ``partition.py``, split by kv heads.
"""

from __future__ import annotations

from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from specjax import _compat
from specjax.attention_metadata import CommonAttentionMetadata
from specjax.checks import ArgumentTypeError
from specjax.kernels import backend as _backend
from specjax.kernels.paged_attention import partition as _part
from specjax.kernels.paged_attention.kv_cache import KVCache, scatter_slots
from specjax.kernels.paged_attention.limits import fused_write_pays, unsupported_reason
from specjax.kernels.paged_attention.reference import paged_attention_xla

ATTENTION_BACKENDS = ("auto", "xla", "pallas", "triton")
#: ``"auto"`` picks a kernel only up to this ``max_query_len`` (decode-shaped steps).
AUTO_MAX_QUERY_LEN = 16


def _check_backend(backend) -> str:
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend must be one of {ATTENTION_BACKENDS}, got {backend!r}")
    return backend


def resolve_attention_backend(q_shape, cache_shape, md: CommonAttentionMetadata, dtype=None,
                              backend: str | None = None) -> str:
    """The backend (``"xla"``, ``"pallas"`` or ``"triton"``) :func:`paged_attention` runs for
    these static shapes: ``backend`` when it names one, else the process default
    (:func:`specjax.kernels.get_default_backend`), else the ``"auto"`` rule. ValueError when
    a named kernel cannot run here (``"triton"`` without a GPU and jax-triton)."""
    backend = _check_backend("auto" if backend is None else backend)
    if backend == "auto":
        backend = _backend.get_default_backend()
    if backend == "xla":
        return "xla"
    _, nh, hd = q_shape
    reason = unsupported_reason(num_heads=nh, num_kv_heads=cache_shape[2], head_dim=hd,
                                max_query_len=md.max_query_len, tree_mask=md.tree_mask,
                                dtype=dtype)
    if reason is not None and not _flash_takes(q_shape, cache_shape, md, dtype):
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
    if _platform() != "gpu":
        return "xla"
    if md.max_query_len > AUTO_MAX_QUERY_LEN:     # prefill: the flash kernel where it takes over
        return (_flash_backend() if _flash_takes(q_shape, cache_shape, md, dtype) else "xla")
    return auto_kernel_backend()


def _flash_backend() -> str:
    """Who runs the flash kernel under ``"auto"``: ``flash.py`` where this JAX has the
    Pallas Triton backend, else its jax-triton twin, else the XLA reference."""
    if _compat.pallas_triton()[0] is not None:
        return "pallas"
    return "triton" if _compat.jax_triton_available()[0] else "xla"


def _platform() -> str:
    return jax.default_backend()


def _flash_takes(q_shape, cache_shape, md: CommonAttentionMetadata, dtype) -> bool:
    """Whether a kernel backend runs its flash kernel (``flash.py``, ``triton_flash.py``):
    the decode kernel's tile would exceed ``MAX_ROWS`` rows and the flash kernel takes the
    shapes."""
    from specjax.kernels.paged_attention import flash

    _, nh, hd = q_shape
    return (flash.takes_over(nh, cache_shape[2], md.max_query_len)
            and flash.unsupported_reason(num_heads=nh, num_kv_heads=cache_shape[2],
                                         head_dim=hd, tree_mask=md.tree_mask,
                                         dtype=dtype) is None)


#: What ``"auto"`` gives up on the GPU without a kernel (named in its warning).
XLA_FALLBACK_COST = ("the XLA reference gathers each request's whole context bucket: an "
                     "8B-shaped EAGLE-3 propose at B=64 runs 2.1x slower than with the Pallas "
                     "kernel, attention alone 6x (docs/performance.md)")


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
                    scale: float, backend: str | None = None, sliding_window: int | None = None,
                    sinks: jax.Array | None = None) -> jax.Array:
    """Attention of ``q [T, num_heads, head_dim]`` over the paged cache -> ``[T, num_heads,
    head_dim]`` in ``q.dtype`` (module docstring). GQA: query head ``h`` reads kv head ``h //
    (num_heads // num_kv_heads)``; scores and softmax in float32. ``backend``: see
    :func:`resolve_attention_backend` (None is ``"auto"``). ``sliding_window`` (static int
    >= 1): the query at cache position ``p`` sees keys ``> p - window`` only (HF's
    ``sliding_window``: the query and ``window - 1`` keys before it); ``sinks [num_heads]``
    float: one extra logit per head in each softmax, with no value (gpt-oss's ``sinks``).
    ValueError names a bad ``sliding_window`` or ``sinks`` shape."""
    sliding_window = check_window_sinks(sliding_window, sinks, q.shape[1])
    backend = resolve_attention_backend(q.shape, cache.k.shape, md, q.dtype, backend)
    if backend != "xla" and (sliding_window is not None or sinks is not None):
        return _window_sinks_kernel(q, cache, md, scale, sliding_window, sinks, backend)
    if backend != "xla":
        args = (q, cache.k, cache.v, md.query_start_loc, md.seq_lens, md.block_table)
        static = _part.static(backend, md, scale)
        if jax.device_count() > 1:
            return _part.partitioned(False)(static, *args)
        return _part.kernel_attention(static, *args)
    return paged_attention_xla(q, cache, md, scale=scale, sliding_window=sliding_window,
                               sinks=sinks)


def check_window_sinks(sliding_window, sinks, num_heads: int) -> int | None:
    """``sliding_window`` as an int (None stays None) after checking it and ``sinks``'s
    shape; ValueError naming the argument."""
    if sliding_window is not None:
        if isinstance(sliding_window, bool) or not isinstance(sliding_window, (int, np.integer)) \
                or sliding_window < 1:
            raise ValueError(f"sliding_window must be None or an int >= 1, got {sliding_window!r}")
        sliding_window = int(sliding_window)
    if sinks is not None and tuple(sinks.shape) != (num_heads,):
        raise ValueError(f"sinks must have shape [num_heads] = [{num_heads}], got "
                         f"{tuple(sinks.shape)}")
    return sliding_window


def _window_sinks_kernel(q, cache: KVCache, md: CommonAttentionMetadata, scale: float,
                         window: int | None, sinks, backend: str) -> jax.Array:
    """A sliding window or sinks on kernel ``backend``, routed as without them
    (:func:`~.partition.kernel_attention`: each backend's decode kernel, its flash kernel
    past the decode kernel's rows); on several devices through ``partition.py``, the
    sinks split with the query heads."""
    args = (q, cache.k, cache.v, md.query_start_loc, md.seq_lens, md.block_table)
    args += () if sinks is None else (sinks.astype(jnp.float32),)
    static = _part.static(backend, md, scale, window)
    if jax.device_count() > 1:
        return _part.partitioned(False, sinks is not None)(static, *args)
    return _part.kernel_attention(static, *args)


def attend(q: jax.Array, k: jax.Array, v: jax.Array, cache: KVCache,
           md: CommonAttentionMetadata, *, scale: float, backend: str | None = None,
           fused_kv_write: bool | str = "auto", kv_write_kernel: bool = True,
           sliding_window: int | None = None,
           sinks: jax.Array | None = None) -> tuple[jax.Array, KVCache]:
    """Write ``k``, ``v [T, num_kv_heads, head_dim]`` at ``md.slot_mapping``, then
    :func:`paged_attention` (``sliding_window``, ``sinks``: its); returns ``(out [T,
    num_heads, head_dim], cache)``.

    On the ``"pallas"`` backend (one dtype throughout) ``fused_kv_write=True`` writes inside
    the attention kernel (assuming no request reads a slot another request writes in the
    call, as in vLLM's metadata), ``"auto"`` where :func:`~.limits.fused_write_pays`;
    unfused, ``kv_write_kernel=True`` writes with one kernel on one device instead of two
    scatters. ValueError names a bad argument. ``T == 1``: an optimization barrier keeps
    the K / V projections out of the write's fusion (a serial loop per element there).
    """
    fused_kv_write, kv_write_kernel = _check_write_options(fused_kv_write, kv_write_kernel)
    if q.shape[0] == 1:
        k, v = jax.lax.optimization_barrier((k, v))
    pallas = resolve_attention_backend(q.shape, cache.k.shape, md, q.dtype, backend) == "pallas"
    if (fused_kv_write is not False and pallas
            and not _flash_takes(q.shape, cache.k.shape, md, q.dtype)
            and q.dtype == k.dtype == v.dtype == cache.k.dtype == cache.v.dtype):
        _, bs, nkv, _ = cache.k.shape
        if fused_kv_write is True or fused_write_pays(
                md.query_start_loc.shape[0] - 1, nkv, md.block_table.shape[1] * bs):
            return _attend_fused(q, k, v, cache, md, scale,
                                 check_window_sinks(sliding_window, sinks, q.shape[1]), sinks)
    one_kernel = pallas and kv_write_kernel and jax.device_count() == 1
    if one_kernel:
        from specjax.kernels.paged_attention import pallas as _pallas
        one_kernel = _pallas.write_kv_supported(cache.k.shape, cache.k.dtype, k.dtype, v.dtype)
    cache = (KVCache(*_pallas.write_kv(cache.k, cache.v, k, v, md.slot_mapping)) if one_kernel
             else write_kv(cache, k, v, md.slot_mapping))
    return paged_attention(q, cache, md, scale=scale, backend=backend,
                           sliding_window=sliding_window, sinks=sinks), cache


class AttentionFn(Protocol):
    """The attention a model layer calls; :func:`attend` is the default, a stack may pass its
    own kernel (``attention=`` of ``DecoderLM`` / the draft-model proposer).

    ``fn(q, k, v, cache, md, *, scale) -> (out, cache)``: ``q [T, num_heads, head_dim]``,
    ``k``, ``v [T, num_kv_heads, head_dim]`` (RoPE applied), ``cache`` the layer's
    ``KVCache`` (``k``, ``v`` each ``[num_blocks, block_size, num_kv_heads, head_dim]``),
    ``md`` a ``CommonAttentionMetadata``, ``scale`` the scores' factor. Write ``k``, ``v`` at
    ``md.slot_mapping`` (-1 dropped), then attend as the module docstring says (causal,
    non-causal or ``md.tree_mask``); ``out [T, num_heads, head_dim]`` in ``q.dtype`` and the
    updated cache. Traced inside the jitted step; it must be hashable (a static field of the
    model, so a module-level function or a frozen object, not a fresh lambda per call).
    A layer with a sliding window or attention sinks also passes ``sliding_window=`` (int)
    and / or ``sinks=`` (``[num_heads]`` float), as :func:`paged_attention` means them;
    layers without them never pass these keywords."""

    def __call__(self, q: jax.Array, k: jax.Array, v: jax.Array, cache: KVCache,
                 md: CommonAttentionMetadata, *, scale: float) -> tuple[jax.Array, KVCache]: ...


def check_attention(attention: Any, name: str = "attention") -> Any:
    """``attention`` when None or a hashable callable (:class:`AttentionFn`); else
    ``ArgumentTypeError`` naming ``name``."""
    if attention is None:
        return None
    try:
        hash(attention)
        ok = callable(attention)
    except TypeError:       # unhashable
        ok = False
    if not ok:
        raise ArgumentTypeError(
            f"{name} must be None (specjax's attention backends) or a hashable callable "
            f"fn(q, k, v, cache, md, *, scale) -> (out, cache) "
            f"(specjax.kernels.paged_attention.AttentionFn), got {type(attention).__name__}")
    return attention


def _check_write_options(fused_kv_write, kv_write_kernel) -> tuple[bool | str, bool]:
    if isinstance(fused_kv_write, np.bool_):
        fused_kv_write = bool(fused_kv_write)
    if not (isinstance(fused_kv_write, bool)
            or (isinstance(fused_kv_write, str) and fused_kv_write == "auto")):
        raise ValueError(f"fused_kv_write must be 'auto', True or False, got {fused_kv_write!r}")
    if not isinstance(kv_write_kernel, (bool, np.bool_)):
        raise ValueError(f"kv_write_kernel must be True or False, got {kv_write_kernel!r}")
    return fused_kv_write, bool(kv_write_kernel)


def _attend_fused(q, k, v, cache: KVCache, md: CommonAttentionMetadata, scale: float,
                  window: int | None = None, sinks=None):
    args = (q, k, v, cache.k, cache.v, md.slot_mapping, md.query_start_loc, md.seq_lens,
            md.block_table)
    args += () if sinks is None else (sinks.astype(jnp.float32),)
    static = _part.static("pallas", md, scale, window)
    if jax.device_count() > 1:
        out, kc, vc = _part.partitioned(True, sinks is not None)(static, *args)
    else:
        out, kc, vc = _part.pallas_attention_write(static, *args)
    return out, KVCache(kc, vc)


# JAX config states kept in the trace context (Pallas' fuser flag, defined when the Pallas
# kernels are imported) must exist before a caller's first trace: imported during it, they
# change the context and the second call of every jitted step or propose compiles again.
try:
    import specjax.kernels._pallas  # noqa: E402,F401
    import specjax.kernels.paged_attention.pallas  # noqa: E402,F401
    import specjax.kernels.paged_attention.flash  # noqa: E402,F401
except ImportError:   # a JAX without Mosaic GPU: the kernels fall back to XLA
    pass

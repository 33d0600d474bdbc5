"""Paged KV cache and attention over ragged batches (pure jax.numpy reference).

This module is the one place a faster kernel (Pallas / Triton paged attention) plugs in:
models call only :func:`write_kv` and :func:`paged_attention` (or :func:`attend`, both).

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

Backends. :func:`paged_attention` runs one of three implementations of the same function:

- ``"xla"``: the pure jax.numpy reference below (:func:`paged_attention_xla`).
- ``"pallas"``: :func:`specjax.kernels.pallas.paged_attention.paged_attention`, a Pallas
  kernel lowered through Triton that reads only each request's live pages (online softmax,
  split-K for small batches); interpret mode off the GPU. Not bit-identical: float32 results
  agree to ~1e-6, bfloat16 to bfloat16 rounding (see that module). Shapes it cannot take
  (:func:`~specjax.kernels.pallas.paged_attention.unsupported_reason`: head_dim not a power
  of two >= 16, ``max_query_len * group > 128`` rows, trees over 31 nodes) fall back to
  ``"xla"``.
- ``"triton"``: :func:`specjax.kernels.triton.paged_attention`, the same kernel written in
  Triton's own language and called through jax-triton (GPU only; JAX deprecates the Pallas
  Triton backend the ``"pallas"`` kernel is lowered through). Same fallbacks to ``"xla"``;
  the step's K/V are written by two scatters first (the fused write is Pallas-only).
- ``"auto"`` (default): a kernel when JAX's default backend is the GPU,
  ``max_query_len <= AUTO_MAX_QUERY_LEN`` (the decode-shaped steps the kernel is built for)
  and the shapes are supported; else ``"xla"``. On CPU this is always ``"xla"``. The kernel
  is ``"pallas"`` where this JAX has the Pallas Triton backend (every JAX in the supported
  range, 0.10.2-0.12, has it), else ``"triton"`` when jax-triton is installed, else
  ``"xla"`` with one warning naming the cost (:func:`auto_kernel_backend`).

Several devices. When the process sees more than one device the kernel (``"pallas"`` or
``"triton"``) is called through ``jax.experimental.custom_partitioning``
(:func:`_partitioned`), with a Shardy rule
that lets the kv-head dimension be sharded (``q [T, (kv_heads group), hd]`` with the caches
``[blocks, block_size, kv_heads, hd]``) and nothing else: under tensor parallelism
(:mod:`specjax.sharding`, caches ``P(None, None, "tp", None)``) each device runs the kernel
on its own heads and its own cache shard, with no collective; replicated caches run it whole
on every device; inside a ``jax.shard_map`` (data parallelism) it is inlined. Without it,
XLA's partitioner cannot split the kernel's custom call and would gather the whole cache.

On the ``"pallas"`` backend :func:`attend` writes the step's K/V inside the attention kernel
instead of two scatters where that pays (small batches; ``SPECJAX_FUSED_KV_WRITE=auto|0|1``,
see :data:`FUSED_KV_WRITE`).

Choose with :func:`set_attention_backend` (global), :func:`attention_backend` (a context
manager) or the environment variable ``SPECJAX_ATTENTION_BACKEND`` (read at import). The
choice is **trace-time static**: it is read when a function that calls
:func:`paged_attention` is traced. It is a JAX configuration option
(``jax.config.specjax_attention_backend``) that is part of the ``jax.jit`` cache key, so
changing it makes jitted callers retrace instead of silently reusing the other backend's
compilation.
"""

from __future__ import annotations

import contextlib
import functools
import os
from typing import Iterator, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from specjax import _compat
from specjax.attention import CommonAttentionMetadata
from specjax.kernels.kv_cache import scatter_slots  # noqa: F401  (re-exported: the cache write)

ATTENTION_BACKENDS = ("auto", "xla", "pallas", "triton")
FUSED_KV_WRITE_MODES = ("auto", "0", "1")
#: Whether :func:`attend` on the ``"pallas"`` backend writes the new K/V inside the attention
#: kernel (trace-time; environment variable ``SPECJAX_FUSED_KV_WRITE``, read at import):
#: ``"1"`` always, ``"0"`` never (two scatters, then the kernel), ``"auto"`` (default) when
#: :func:`~specjax.kernels.pallas.paged_attention.fused_write_pays` says so -- the kernel
#: splits each request's context over several programs (small batches). On the H200 the
#: fused write took 1-5% off the B = 1 / 8 propose and cost 4-16% at B = 64
#: (benchmarks/RESULTS.md, "The cache write inside the attention kernel").
FUSED_KV_WRITE = os.environ.get("SPECJAX_FUSED_KV_WRITE", "auto")
if FUSED_KV_WRITE not in FUSED_KV_WRITE_MODES:
    raise ValueError(f"SPECJAX_FUSED_KV_WRITE must be one of {FUSED_KV_WRITE_MODES}, "
                     f"got {FUSED_KV_WRITE!r}")
#: ``"auto"`` picks the Pallas kernel only up to this ``max_query_len`` (decode-shaped steps).
AUTO_MAX_QUERY_LEN = 16
_OPTION = "specjax_attention_backend"
_ENV = "SPECJAX_ATTENTION_BACKEND"


def _make_backend_state():
    """A JAX config option (so the choice keys ``jax.jit``'s cache), or None when this JAX
    has no such private API (then a plain holder: the choice is read at trace time only)."""
    return _compat.enum_config_state(
        _OPTION, ATTENTION_BACKENDS, "auto",
        help="paged attention backend of specjax.models.attention: auto | xla | pallas | triton "
             "(trace-time static; environment variable SPECJAX_ATTENTION_BACKEND)")


def _check_backend(backend) -> str:
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend must be one of {ATTENTION_BACKENDS}, got {backend!r}")
    return backend


_STATE = _make_backend_state()
_fallback_backend = [_check_backend(os.environ.get(_ENV, "auto"))] if _STATE is None else None


def get_attention_backend() -> str:
    """The configured backend (``"auto"``, ``"xla"``, ``"pallas"`` or ``"triton"``), as read at
    trace time."""
    return _STATE.value if _STATE is not None else _fallback_backend[0]


def set_attention_backend(backend: str) -> None:
    """Set the paged-attention backend globally: ``"auto"``, ``"xla"``, ``"pallas"`` or
    ``"triton"``.

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
    for these static shapes under the configured (or given) backend choice. ``"triton"``
    needs an NVIDIA GPU and jax-triton (ValueError naming what is missing otherwise)."""
    backend = _check_backend(get_attention_backend() if backend is None else backend)
    if backend == "xla":
        return "xla"
    from specjax.kernels.pallas.paged_attention import unsupported_reason

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


class KVCache(NamedTuple):
    """One layer's paged cache: ``k``, ``v``: ``[num_blocks, block_size, num_kv_heads, head_dim]``."""

    k: jax.Array
    v: jax.Array


def init_kv_caches(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                   head_dim: int, dtype=jnp.float32) -> list[KVCache]:
    """Zero caches for ``num_layers`` layers."""
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return [KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(num_layers)]


def write_kv(cache: KVCache, k: jax.Array, v: jax.Array, slot_mapping: jax.Array) -> KVCache:
    """``k``, ``v``: ``[T, num_kv_heads, head_dim]``; ``slot_mapping``: ``[T] int32``."""
    return KVCache(scatter_slots(cache.k, k, slot_mapping), scatter_slots(cache.v, v, slot_mapping))


def paged_attention(q: jax.Array, cache: KVCache, md: CommonAttentionMetadata, *,
                    scale: float) -> jax.Array:
    """Attention of ``q [T, num_heads, head_dim]`` over the paged cache -> ``[T, num_heads, head_dim]``.

    GQA: query head ``h`` reads kv head ``h // (num_heads // num_kv_heads)``. Scores and
    softmax in float32; the output has ``q.dtype``. Runs the backend chosen by
    :func:`resolve_attention_backend` (see the module docstring).
    """
    backend = resolve_attention_backend(q.shape, cache.k.shape, md, q.dtype)
    if backend != "xla":
        args = (q, cache.k, cache.v, md.query_start_loc, md.seq_lens, md.block_table)
        static = _static(backend, md, scale)
        if jax.device_count() > 1:
            return _partitioned(False)(static, *args)
        return _kernel_attention(static, *args)
    return paged_attention_xla(q, cache, md, scale=scale)


def paged_attention_xla(q: jax.Array, cache: KVCache, md: CommonAttentionMetadata, *,
                        scale: float) -> jax.Array:
    """The pure jax.numpy reference of :func:`paged_attention` (the ``"xla"`` backend)."""
    t_pad, nh, hd = q.shape
    nb, bs, nkv, _ = cache.k.shape
    group = nh // nkv
    b_pad = md.query_start_loc.shape[0] - 1
    qmax = max(int(md.max_query_len), 1)
    max_blocks = md.block_table.shape[1]
    ctx = max_blocks * bs

    qsl = md.query_start_loc
    qlen = qsl[1:] - qsl[:-1]                                   # [B]
    seq = md.seq_lens                                           # [B]

    # queries laid out per request: [B, Q, nkv, G, hd]
    qi = jnp.arange(qmax, dtype=jnp.int32)
    tok = jnp.clip(qsl[:-1, None] + qi[None, :], 0, t_pad - 1)
    q_valid = qi[None, :] < qlen[:, None]                       # [B, Q]
    qr = q[tok].reshape(b_pad, qmax, nkv, group, hd)

    # K/V of each request: [B, C, nkv, hd]
    table = jnp.clip(md.block_table, 0, nb - 1)
    kr = cache.k[table].reshape(b_pad, ctx, nkv, hd)
    vr = cache.v[table].reshape(b_pad, ctx, nkv, hd)

    kj = jnp.arange(ctx, dtype=jnp.int32)
    mask = q_valid[:, :, None] & (kj[None, None, :] < seq[:, None, None])
    if md.tree_mask is not None:
        tm = jnp.asarray(np.asarray(md.tree_mask, dtype=bool))   # [Qt, Qt]
        qt = tm.shape[0]
        rel = kj[None, :] - (seq - qlen)[:, None]                # [B, C]: index in the block
        allowed = tm[jnp.clip(qi, 0, qt - 1)[None, :, None],
                     jnp.clip(rel, 0, qt - 1)[:, None, :]]           # [B, Q, C]
        mask = mask & ((rel < 0)[:, None, :] | ((rel < qt)[:, None, :] & allowed))
    elif md.causal:
        qpos = seq[:, None] - qlen[:, None] + qi[None, :]       # [B, Q]
        mask = mask & (kj[None, None, :] <= qpos[:, :, None])

    s = jnp.einsum("bqkgd,bckd->bkgqc", qr, kr, preferred_element_type=jnp.float32) * scale
    s = jnp.where(mask[:, None, None], s, jnp.finfo(jnp.float32).min)
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("bkgqc,bckd->bqkgd", p.astype(vr.dtype), vr,
                   preferred_element_type=jnp.float32)          # [B, Q, nkv, G, hd]
    o = o.reshape(b_pad, qmax, nh, hd)

    # back to token order
    t = jnp.arange(t_pad, dtype=jnp.int32)
    # request of token t = number of request ends <= t (B_pad is small: a compare beats a search)
    r_t = jnp.minimum(jnp.sum(qsl[None, 1:] <= t[:, None], axis=1, dtype=jnp.int32), b_pad - 1)
    i_t = jnp.clip(t - qsl[r_t], 0, qmax - 1)
    out = o[r_t, i_t]
    valid = t < qsl[-1]
    return jnp.where(valid[:, None, None], out, 0).astype(q.dtype)


def attend(q: jax.Array, k: jax.Array, v: jax.Array, cache: KVCache,
           md: CommonAttentionMetadata, *, scale: float) -> tuple[jax.Array, KVCache]:
    """Write this step's ``k``/``v`` through ``md.slot_mapping``, then attend over the cache.

    On the ``"pallas"`` backend, when ``q``, ``k``, ``v`` and the cache share one dtype and
    :data:`FUSED_KV_WRITE` allows it (``"auto"``: small batches, see
    :func:`~specjax.kernels.pallas.paged_attention.fused_write_pays`), both happen in one
    kernel (:func:`specjax.kernels.pallas.paged_attention.paged_attention_write`: the two
    scatter kernels go away), which assumes vLLM's metadata: no request reads a slot that
    another request's token writes in the same call. Every other backend (``"triton"``,
    ``"xla"``) writes with two scatters, then attends.

    One token (``T == 1``): XLA rewrites the K / V projections (``[1, H] @ [H, kv * hd]``)
    as a multiply + reduce and fuses that into the consumer, the ``q|k|v`` concatenation
    of the fused write or the cache scatter, where it runs as one serial 4096-long loop per
    output element: 36.8 of the 41.8 ms of an 8B-shaped step on the H200
    (benchmarks/RESULTS.md). An optimization barrier on ``k`` and ``v`` keeps the
    projections their own (reduction) kernels; programs of two or more tokens are unchanged.
    """
    if q.shape[0] == 1:
        k, v = jax.lax.optimization_barrier((k, v))
    if (FUSED_KV_WRITE != "0" and q.dtype == k.dtype == v.dtype == cache.k.dtype == cache.v.dtype
            and resolve_attention_backend(q.shape, cache.k.shape, md, q.dtype) == "pallas"):
        from specjax.kernels.pallas import paged_attention as pk

        _, bs, nkv, _ = cache.k.shape
        if FUSED_KV_WRITE == "1" or pk.fused_write_pays(
                md.query_start_loc.shape[0] - 1, nkv, md.block_table.shape[1] * bs):
            return _attend_fused(q, k, v, cache, md, scale)
    cache = write_kv(cache, k, v, md.slot_mapping)
    return paged_attention(q, cache, md, scale=scale), cache


def _attend_fused(q, k, v, cache: KVCache, md: CommonAttentionMetadata, scale: float):
    args = (q, k, v, cache.k, cache.v, md.slot_mapping, md.query_start_loc, md.seq_lens,
            md.block_table)
    static = _static("pallas", md, scale)
    if jax.device_count() > 1:
        out, kc, vc = _partitioned(True)(static, *args)
    else:
        out, kc, vc = _pallas_attention_write(static, *args)
    return out, KVCache(kc, vc)


# ----------------------------------------------------------------------------------------
# the kernels under SPMD partitioning (several devices)


def _static(backend: str, md: CommonAttentionMetadata, scale) -> tuple:
    """The kernel backend and its static keywords, hashable: ``(backend, ((name, value),
    ...))``."""
    return backend, (("scale", float(scale)), ("max_query_len", int(md.max_query_len)),
                     ("causal", bool(md.causal)), ("tree_mask", md.tree_mask))


def _kernel_attention(static, q, k_cache, v_cache, qsl, seq_lens, block_table):
    """The attention kernel of backend ``static[0]`` (``"pallas"`` or ``"triton"``)."""
    backend, kw = static
    if backend == "triton":
        from specjax.kernels.triton import paged_attention as kernel
    else:
        from specjax.kernels.pallas.paged_attention import paged_attention as kernel
    return kernel(q, k_cache, v_cache, qsl, seq_lens, block_table, **dict(kw))


def _pallas_attention_write(static, q, k, v, k_cache, v_cache, slot_mapping, qsl, seq_lens,
                            block_table):
    from specjax.kernels.pallas.paged_attention import paged_attention_write

    out, (kc, vc) = paged_attention_write(
        jnp.concatenate([q, k, v], axis=1), k_cache, v_cache, slot_mapping, qsl, seq_lens,
        block_table, **dict(static[1]))
    return out, kc, vc


#: Shardy factors: t tokens, h = (k g) query heads, k kv heads, d head_dim, n / s cache
#: blocks / block offsets, a / r / c query_start_loc / requests / table width. Only ``k``
#: (and with it the query heads, kv-head major) may stay sharded.
_RULES = {
    False: "t H d, n s k d, n s k d, a, r, r c -> t H d",
    True: "t H d, t k d, t k d, n s k d, n s k d, t, a, r, r c -> t H d, n s k d, n s k d",
}


def _sharding_rule(write: bool):
    def rule(static, mesh, operand_types, result_types):
        group = operand_types[0].shape[1] // operand_types[3 if write else 1].shape[2]
        text = _RULES[write].replace("H", "(k g)" if group > 1 else "k")
        # Shardy wants the special factors in order of first appearance
        order = list(dict.fromkeys(text.replace("(", " ").replace(")", " ").replace(",", " ")
                                   .replace("->", " ").split()))
        replicated = tuple(f for f in order if f != "k")
        return text, dict(need_replication_factors=replicated, **({"g": group} if group > 1 else {}))
    return rule


#: Per operand / result of the partitioned call: the dimension that holds (kv) heads, or
#: ``None`` (int metadata, slot mapping: replicated).
_HEAD_DIMS = {
    False: ((1, 2, 2, None, None, None), (1,)),
    True: ((1, 1, 1, 2, 2, None, None, None, None), (1, 2, 2)),
}


def _head_tiles(sharding, ndim: int, head_dim: int | None) -> int | None:
    """How many shards ``sharding`` splits the head dimension into (1: replicated), or
    ``None`` when it splits any other dimension."""
    hlo = sharding._to_xla_hlo_sharding(ndim)
    if hlo.is_replicated():
        return 1
    if not hlo.is_tiled():
        return None
    dims = list(hlo.tile_assignment_dimensions())[:ndim]     # the rest: replication subgroups
    tiles = dims[head_dim] if head_dim is not None else 1
    others = [d for i, d in enumerate(dims) if i != head_dim]
    return tiles if all(d == 1 for d in others) else None


def _replicated(sharding, mesh):
    return _compat.replicated_like(sharding, mesh)


def _partition(write: bool):
    """Run the kernel per shard on the shardings Shardy chose under :data:`_RULES` (the
    kv-head split, or replicated). Anything else -- which the rule's replication factors
    should rule out -- falls back to running the whole call on every device."""
    def partition(static, mesh, arg_shapes, result_shape):
        results = tuple(result_shape) if write else (result_shape,)
        arrays = tuple(arg_shapes) + results
        head_dims = _HEAD_DIMS[write][0] + _HEAD_DIMS[write][1]
        tiles = [_head_tiles(x.sharding, len(x.shape), d) for x, d in zip(arrays, head_dims)]
        split = {t for t, d in zip(tiles, head_dims) if d is not None}
        consistent = (None not in tiles and len(split) == 1
                      and all(t == 1 for t, d in zip(tiles, head_dims) if d is None))
        arg_sh = [x.sharding for x in arg_shapes]
        out_sh = [x.sharding for x in results]
        if not consistent:
            rep = _replicated(arg_sh[0], mesh)
            arg_sh, out_sh = [rep] * len(arg_sh), [rep] * len(out_sh)
        impl = functools.partial(_pallas_attention_write if write else _kernel_attention, static)
        return mesh, impl, tuple(out_sh) if write else out_sh[0], tuple(arg_sh)
    return partition


@functools.cache
def _partitioned(write: bool):
    """:func:`_kernel_attention` (``write``: :func:`_pallas_attention_write`) as a
    ``custom_partitioning`` function: split by kv heads, never gathered."""
    return _compat.custom_partitioning_shardy(
        _pallas_attention_write if write else _kernel_attention, static_argnums=(0,),
        partition=_partition(write), sharding_rule=_sharding_rule(write))


# JAX config states kept in the trace context (Pallas' fuser flag, defined when the Pallas
# kernels are imported) must exist before a caller's first trace: imported during it, they
# change the context and the second call of every jitted step or propose compiles again.
try:
    import specjax.kernels.pallas  # noqa: E402,F401
except ImportError:   # a JAX without Mosaic GPU: the kernels fall back to XLA
    pass

"""Greedy draft selection over a vocabulary that may be sharded: argmax and top-k.

With ``use_local_argmax_reduction`` and a mesh whose ``vocab_axis`` shards the logits, each
device reduces its shard to ``(value, index)`` pairs and only those are gathered (vLLM's
local argmax reduction); results equal ``jnp.argmax`` / ``lax.top_k``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from specjax import _compat

_I32 = jnp.int32




def check_vocab_sharding(proposer: Any, vocab_size: int, what: str = "vocab_size") -> None:
    """``ValueError`` unless ``mesh`` is None or a ``Mesh`` and, with
    ``config.use_local_argmax_reduction``, ``vocab_axis`` is one of its axes whose size
    divides ``vocab_size`` (the logits' width, named ``what`` in the message)."""
    mesh, axis = getattr(proposer, "mesh", None), getattr(proposer, "vocab_axis", None)
    if mesh is None:
        return
    if not isinstance(mesh, Mesh):
        raise ValueError(f"mesh must be None or a jax.sharding.Mesh, got {type(mesh).__name__}")
    if not proposer.config.use_local_argmax_reduction:
        return
    if not isinstance(axis, str) or axis not in mesh.axis_names:
        raise ValueError(f"vocab_axis must be one of the mesh's axis names {tuple(mesh.axis_names)} "
                         f"(use_local_argmax_reduction=True), got {axis!r}")
    shards = mesh.shape[axis]
    if vocab_size % shards:
        raise ValueError(
            f"use_local_argmax_reduction=True: {what} ({vocab_size}) must be divisible by the "
            f"number of shards of mesh axis {axis!r} ({shards}) to shard the vocabulary evenly")


def greedy_argmax(logits: jax.Array, *, mesh: Mesh | None = None, vocab_axis: str | None = None,
                  local_reduction: bool = False) -> jax.Array:
    """``argmax(logits [..., V], axis=-1)`` as ``[...] int32``, identical to ``jnp.argmax``
    (ties and NaN: the smallest index). With ``local_reduction`` and a multi-device
    ``vocab_axis`` each shard takes its own argmax and only ``(value, index)`` pairs are
    reduced (vLLM's ``get_top_tokens``). ``ValueError`` if the axis size does not divide V.
    """
    if _vocab_shards(logits.shape[-1], mesh, vocab_axis, local_reduction) == 1:
        return jnp.argmax(logits, axis=-1).astype(_I32)

    def local(x):
        idx = jnp.argmax(x, axis=-1).astype(_I32)
        val = jnp.take_along_axis(x, idx[..., None], axis=-1)[..., 0]
        gidx = idx + jax.lax.axis_index(vocab_axis).astype(_I32) * x.shape[-1]
        # jnp.argmax ranks NaN above everything: a shard with a NaN wins over any value.
        nan = jnp.isnan(val)
        any_nan = jax.lax.pmax(nan.astype(_I32), vocab_axis) > 0
        best = jax.lax.pmax(jnp.where(nan, -jnp.inf, val), vocab_axis)
        holds = jnp.where(any_nan, nan, val == best)
        return jax.lax.pmin(jnp.where(holds, gidx, jnp.iinfo(np.int32).max), vocab_axis)

    spec = PartitionSpec(*([None] * (logits.ndim - 1)), vocab_axis)
    return _vocab_shard_map(local, mesh, vocab_axis, spec)(logits)


def _vocab_shards(vocab: int, mesh: Mesh | None, vocab_axis: str | None,
                  local_reduction: bool) -> int:
    """Shards of the vocabulary the local reduction runs over (1: no reduction)."""
    if not local_reduction or mesh is None:
        return 1
    if vocab_axis not in mesh.axis_names:
        raise ValueError(f"vocab_axis must be one of the mesh's axis names {tuple(mesh.axis_names)}, "
                         f"got {vocab_axis!r}")
    shards = mesh.shape[vocab_axis]
    if shards > 1 and vocab % shards:
        raise ValueError(f"the logits' vocabulary ({vocab}) must be divisible by the number of "
                         f"shards of mesh axis {vocab_axis!r} ({shards})")
    return shards


def _vocab_shard_map(fn, mesh: Mesh, vocab_axis: str, spec: PartitionSpec, **kw):
    """``jax.shard_map`` of ``fn`` over ``vocab_axis`` (inputs ``spec``, output replicated);
    inside an outer ``shard_map`` (``DataParallel``) it maps the context's mesh."""
    ctx = _compat.get_abstract_mesh()
    if getattr(ctx, "manual_axes", ()) and vocab_axis in ctx.axis_names:
        return _compat.shard_map(fn, mesh=ctx, in_specs=spec, out_specs=PartitionSpec(),
                                 axis_names={vocab_axis}, **kw)
    return _compat.shard_map(fn, mesh=mesh, in_specs=spec, out_specs=PartitionSpec(), **kw)


def greedy_top_k(logits: jax.Array, c: int, *, mesh: Mesh | None = None,
                 vocab_axis: str | None = None, local_reduction: bool = False) -> jax.Array:
    """``jax.lax.top_k(logits [..., V], c)[1]`` as ``[..., c] int32``, identical to
    ``lax.top_k`` (ties: the smaller index first). With ``local_reduction`` and a
    multi-device ``vocab_axis`` each shard takes its top-``min(c, V / shards)`` and only
    those candidates are all-gathered and merged. ``ValueError`` unless the axis size
    divides V and ``1 <= c <= V``.
    """
    vocab = logits.shape[-1]
    if not isinstance(c, (int, np.integer)) or isinstance(c, bool) or not 1 <= c <= vocab:
        raise ValueError(f"c must be an int in [1, {vocab}] (the logits' vocabulary), got {c!r}")
    c = int(c)
    shards = _vocab_shards(vocab, mesh, vocab_axis, local_reduction)
    if shards == 1:
        return jax.lax.top_k(logits, c)[1].astype(_I32)
    k = min(c, vocab // shards)     # c > shard width: the whole shard is a candidate

    def local(x):
        # candidates laid out shard by shard in increasing global index among equals, so the
        # merging top_k breaks ties as it would on the full row
        val, idx = jax.lax.top_k(x, k)
        gidx = idx.astype(_I32) + jax.lax.axis_index(vocab_axis).astype(_I32) * x.shape[-1]
        vals = jax.lax.all_gather(val, vocab_axis, axis=val.ndim - 1, tiled=True)
        gidxs = jax.lax.all_gather(gidx, vocab_axis, axis=gidx.ndim - 1, tiled=True)
        pos = jax.lax.top_k(vals, c)[1]
        return jnp.take_along_axis(gidxs, pos, axis=-1)

    spec = PartitionSpec(*([None] * (logits.ndim - 1)), vocab_axis)
    # every shard merges the same gathered candidates, so the result is replicated; the
    # varying-manual-axes check cannot tell (all_gather's output is typed as varying)
    return _vocab_shard_map(local, mesh, vocab_axis, spec, check_vma=False)(logits)


def proposer_argmax(proposer: Any, logits: jax.Array) -> jax.Array:
    """``greedy_argmax`` with the proposer's ``mesh`` / ``vocab_axis`` / local reduction."""
    return greedy_argmax(logits, mesh=getattr(proposer, "mesh", None),
                         vocab_axis=getattr(proposer, "vocab_axis", None),
                         local_reduction=proposer.config.use_local_argmax_reduction)


def proposer_top_k(proposer: Any, logits: jax.Array, c: int) -> jax.Array:
    """``greedy_top_k`` with the proposer's ``mesh`` / ``vocab_axis`` / local reduction."""
    return greedy_top_k(logits, c, mesh=getattr(proposer, "mesh", None),
                        vocab_axis=getattr(proposer, "vocab_axis", None),
                        local_reduction=proposer.config.use_local_argmax_reduction)

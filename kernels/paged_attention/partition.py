"""How the paged-attention kernels are called, on one device and under SPMD partitioning:
on several devices through ``custom_partitioning`` (:func:`partitioned`) with a Shardy rule
that lets only the kv-head dimension be sharded, so each tensor-parallel device attends over
its own heads and cache shard with no collective (XLA alone would gather the whole cache).
"""

from __future__ import annotations

import functools

import jax.numpy as jnp

from specjax import _compat
from specjax.attention_metadata import CommonAttentionMetadata




def static(backend: str, md: CommonAttentionMetadata, scale, window: int | None = None
           ) -> tuple:
    """The kernel backend and its static keywords, hashable: ``(backend, ((name, value),
    ...))``; ``window`` adds ``sliding_window``."""
    kw = (("scale", float(scale)), ("max_query_len", int(md.max_query_len)),
          ("causal", bool(md.causal)), ("tree_mask", md.tree_mask))
    return backend, kw + ((("sliding_window", int(window)),) if window is not None else ())


def kernel_attention(static, q, k_cache, v_cache, qsl, seq_lens, block_table, *sinks):
    """The attention kernel of backend ``static[0]`` (``"pallas"`` or ``"triton"``; past
    the decode kernel's rows, ``flash.py``'s or its Triton twin ``triton_flash.py``'s);
    ``sinks``: none or one ``[num_heads]`` array."""
    backend, kw = static
    from specjax.kernels.paged_attention.flash import takes_over

    long = takes_over(q.shape[1], k_cache.shape[2], dict(kw)["max_query_len"])
    if backend == "triton" and long:
        from specjax.kernels.paged_attention.triton_flash import paged_attention as kernel
    elif backend == "triton":
        from specjax.kernels.paged_attention.triton import paged_attention as kernel
    elif long:
        from specjax.kernels.paged_attention.flash import paged_attention as kernel
    else:
        from specjax.kernels.paged_attention.pallas import paged_attention as kernel
    return kernel(q, k_cache, v_cache, qsl, seq_lens, block_table, *sinks, **dict(kw))


def pallas_attention_write(static, q, k, v, k_cache, v_cache, slot_mapping, qsl, seq_lens,
                            block_table, *sinks):
    from specjax.kernels.paged_attention.pallas import paged_attention_write

    out, (kc, vc) = paged_attention_write(
        jnp.concatenate([q, k, v], axis=1), k_cache, v_cache, slot_mapping, qsl, seq_lens,
        block_table, *sinks, **dict(static[1]))
    return out, kc, vc


#: Shardy factors: t tokens, h = (k g) query heads, k kv heads, d head_dim, n / s cache
#: blocks / block offsets, a / r / c query_start_loc / requests / table width. Only ``k``
#: (and with it the query heads, kv-head major) may stay sharded. Sinks (``[num_heads]``),
#: when given, follow the last operand as ``H``.
_RULES = {
    False: "t H d, n s k d, n s k d, a, r, r c -> t H d",
    True: "t H d, t k d, t k d, n s k d, n s k d, t, a, r, r c -> t H d, n s k d, n s k d",
}


def _rule_text(write: bool, sinks: bool) -> str:
    ins, outs = _RULES[write].split(" -> ")
    return f"{ins}, H -> {outs}" if sinks else _RULES[write]


def _sharding_rule(write: bool, sinks: bool = False):
    def rule(static, mesh, operand_types, result_types):
        group = operand_types[0].shape[1] // operand_types[3 if write else 1].shape[2]
        text = _rule_text(write, sinks).replace("H", "(k g)" if group > 1 else "k")
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


def _heads_like(sharding, mesh):
    """A ``[num_heads]`` array's sharding split as the query heads (dimension 1) of
    ``sharding``, or ``None`` when that is not a ``NamedSharding``."""
    from jax.sharding import NamedSharding, PartitionSpec

    if not isinstance(sharding, NamedSharding):
        return None
    return NamedSharding(mesh, PartitionSpec((tuple(sharding.spec) + (None, None))[1]))


def _partition(write: bool, sinks: bool = False):
    """Run the kernel per shard on the shardings Shardy chose under :data:`_RULES` (the
    kv-head split, or replicated). Anything else -- which the rule's replication factors
    should rule out -- falls back to running the whole call on every device."""
    def partition(static, mesh, arg_shapes, result_shape):
        results = tuple(result_shape) if write else (result_shape,)
        arrays = tuple(arg_shapes) + results
        head_dims = _HEAD_DIMS[write][0] + ((0,) if sinks else ()) + _HEAD_DIMS[write][1]
        tiles = [_head_tiles(x.sharding, len(x.shape), d) for x, d in zip(arrays, head_dims)]
        arg_sh = [x.sharding for x in arg_shapes]
        out_sh = [x.sharding for x in results]
        last = len(arg_shapes) - 1
        if sinks and tiles[last] == 1 and tiles[0] not in (None, 1):
            # replicated sinks (a replicated parameter): each device slices its heads' own
            like = _heads_like(arg_sh[0], mesh)
            if like is not None:
                tiles[last], arg_sh[last] = tiles[0], like
        split = {t for t, d in zip(tiles, head_dims) if d is not None}
        consistent = (None not in tiles and len(split) == 1
                      and all(t == 1 for t, d in zip(tiles, head_dims) if d is None))
        if not consistent:
            rep = _replicated(arg_sh[0], mesh)
            arg_sh, out_sh = [rep] * len(arg_sh), [rep] * len(out_sh)
        impl = functools.partial(pallas_attention_write if write else kernel_attention, static)
        return mesh, impl, tuple(out_sh) if write else out_sh[0], tuple(arg_sh)
    return partition


@functools.cache
def partitioned(write: bool, sinks: bool = False):
    """:func:`kernel_attention` (``write``: :func:`pallas_attention_write`) as a
    ``custom_partitioning`` function: split by kv heads, never gathered; ``sinks``: it takes
    a trailing ``sinks [num_heads]``, split with the query heads."""
    return _compat.custom_partitioning_shardy(
        pallas_attention_write if write else kernel_attention, static_argnums=(0,),
        partition=_partition(write, sinks), sharding_rule=_sharding_rule(write, sinks))

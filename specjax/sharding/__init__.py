"""Multi-device proposers: tensor-parallel shardings of draft params / proposer state, and
data parallelism over requests.

Tensor parallelism (Megatron style over a ``"tp"`` axis): :func:`param_shardings` /
:func:`state_shardings` place params and state, or :func:`tensor_parallel` also sets the
proposer's ``mesh`` / ``vocab_axis``; XLA inserts the collectives. With fewer kv heads than
shards the attention block and its caches stay replicated (splitting q/o alone makes XLA
all-gather the cache every step). An indivisible dimension or an unknown params entry
raises ``ValueError`` naming it. MoE experts: E over an ``"ep"`` axis, each expert's FFN
width over ``"tp"``. :class:`DataParallel`: one proposer per device of a ``"dp"`` axis.
Rules table and usage: docs/multi_gpu.md.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from specjax import _compat
from specjax.kernels.paged_attention import KVCache
from specjax.models.config import ModelConfig
from specjax.models.moe import EP_AXIS

__all__ = [
    "TP_AXIS", "DP_AXIS", "EP_AXIS", "param_specs", "param_shardings", "state_specs",
    "state_shardings", "tensor_parallel", "DataParallel",
]

TP_AXIS = "tp"
DP_AXIS = "dp"

_NORMS = ("input_layernorm", "post_attention_layernorm", "hidden_norm", "norm", "q_norm", "k_norm",
          "token_layernorm", "hidden_layernorm", "final_layernorm",
          "pre_feedforward_layernorm", "post_feedforward_layernorm")

#: DSpark's Markov and confidence heads (models/dspark.py): their leaves, all replicated.
_DSPARK_HEADS = {
    "markov_head": (("markov_w1", "embedding"), ("markov_w2", "kernel"), ("gate_proj", "kernel"),
                    ("gate_proj", "bias"), ("joint_proj", "kernel"), ("joint_proj", "bias")),
    "confidence_head": (("proj", "kernel"), ("proj", "bias")),
}


def _axis_size(mesh: Any, axis: str) -> int:
    if not isinstance(axis, str) or axis not in mesh.axis_names:
        raise ValueError(f"axis must be one of the mesh's axis names {tuple(mesh.axis_names)}, "
                         f"got {axis!r}")
    return int(mesh.shape[axis])


def _check_size(axis_size: Any) -> int:
    if isinstance(axis_size, bool) or not isinstance(axis_size, (int, np.integer)) or axis_size < 1:
        raise ValueError(f"axis_size must be a positive int, got {axis_size!r}")
    return int(axis_size)


def _key(k: Any) -> Any:
    """A path entry as a plain key: DictKey / SequenceKey / GetAttrKey unwrapped; digit
    strings (orbax restores) as ints."""
    for attr in ("key", "idx", "name"):
        if hasattr(k, attr):
            k = getattr(k, attr)
            break
    return int(k) if isinstance(k, str) and k.isdigit() else k


def _dotted(path: tuple) -> str:
    return ".".join(str(p) for p in path)


class _Rules:
    """The Megatron rules for one ``ModelConfig`` and axis size (docs/multi_gpu.md)."""

    def __init__(self, config: ModelConfig, n: int, axis: str, shard_embedding: bool,
                 ep: int | None = None):
        if not isinstance(config, ModelConfig):
            raise ValueError(f"config must be a specjax ModelConfig (proposer.model.config), "
                             f"got {type(config).__name__}")
        if ep is not None and axis == EP_AXIS:
            raise ValueError(f"axis {axis!r} is the expert axis; tensor parallelism needs "
                             "another axis of the mesh")
        self.c, self.n, self.axis, self.shard_embedding = config, n, axis, bool(shard_embedding)
        self.ep = None if ep is None else _check_size(ep)
        nkv = config.num_key_value_heads
        self.kv_sharded = bool(nkv) and nkv % n == 0

    def _need(self, name: str, what: str, value: int) -> None:
        if value % self.n:
            raise ValueError(
                f"cannot shard parameter {name!r} over mesh axis {self.axis!r} of size {self.n}: "
                f"{what} ({value}) is not divisible by {self.n}")

    def _dim(self, name: str, shape: tuple, dim: int, what: str) -> None:
        if len(shape) <= dim:
            raise ValueError(f"parameter {name!r} has shape {shape}, expected at least {dim + 1} dims")
        self._need(name, f"{what}: dimension {dim} of shape {shape}", shape[dim])

    def experts(self, name: str, last: Any, shape: tuple) -> P:
        """Stacked experts: dim 0 over ``"ep"`` (with ``ep``), the FFN width over ``axis``."""
        ffn = {"gate_up": 2, "down": 1, "gate_up_bias": 1}.get(last)
        if ffn is None and last != "down_bias":
            raise ValueError(f"unknown params entry {name!r} (experts hold 'gate_up', 'down', "
                             "'gate_up_bias', 'down_bias')")
        e = None
        if self.ep is not None:
            e = EP_AXIS
            if not shape or shape[0] % self.ep:
                raise ValueError(f"cannot shard parameter {name!r} over mesh axis {EP_AXIS!r} of "
                                 f"size {self.ep}: number of experts: dimension 0 of shape "
                                 f"{shape} is not divisible by {self.ep}")
        if ffn is None:
            return P(e)
        self._dim(name, shape, ffn, "expert FFN width")
        if last != "down" and shape[ffn] % (2 * self.n):   # whole gate/up pairs per shard
            raise ValueError(f"cannot shard parameter {name!r} over mesh axis {self.axis!r} of "
                             f"size {self.n}: expert FFN width: dimension {ffn} of shape "
                             f"{shape} (interleaved gate/up pairs) is not divisible by "
                             f"2 x {self.n}")
        return P(e, *([None] * (ffn - 1)), self.axis, *([None] * (len(shape) - ffn - 1)))

    def spec(self, path: tuple, shape: tuple) -> P:
        a, c, name = self.axis, self.c, _dotted(path)
        last = path[-1]
        parent = path[-2] if len(path) >= 2 else None
        top = path[0]
        if len(path) >= 3 and path[-3] == "mlp" and parent in ("gate", "router"):
            return P()           # MoE router: replicated
        if parent == "experts":
            return self.experts(name, last, shape)
        col = {"kernel": P(None, a), "bias": P(a)}
        if top in ("d2t", "token_map", "mask_hidden"):
            return P()
        if top in _DSPARK_HEADS:     # replicated as in vLLM: no all-reduce per Markov step
            if path[1:] not in _DSPARK_HEADS[top]:
                raise ValueError(f"unknown params entry {name!r} (a DSpark {top} holds "
                                 f"{', '.join('.'.join(p) for p in _DSPARK_HEADS[top])})")
            return P()
        if top == "embed_tokens":
            if last != "embedding":
                raise ValueError(f"unknown params entry {name!r} (embed_tokens holds 'embedding')")
            if not self.shard_embedding:
                return P()
            self._dim(name, shape, 0, "vocab size")
            return P(a, None)
        if top in ("lm_head", "lm_heads"):
            if last == "kernel":
                self._dim(name, shape, 1, "vocab size")
                return P(None, a)
            if last == "embedding":          # a tied / shared embedding used as the head
                self._dim(name, shape, 0, "vocab size")
                return P(a, None)
            if last == "bias":
                self._dim(name, shape, 0, "vocab size")
                return P(a)
            raise ValueError(f"unknown params entry {name!r} (an lm_head holds 'kernel', "
                             "'bias' or 'embedding')")
        if top in ("fc", "input_proj", "input_norm", "fc_norm", "blocks") or (
                parent in _NORMS and last == "weight"):
            return P()
        if parent in ("qkv_proj", "gate_up_proj"):
            raise ValueError(f"params entry {name!r} is a fused projection "
                             "(specjax.models.fuse_projections), which the tensor-parallel rules "
                             "do not split (they shard q, k and v by head); pass the checkpoint "
                             "layout: specjax.models.unfuse_projections(params, config)")
        if parent == "self_attn" and last == "sinks":      # gpt-oss: one per query head
            if not self.kv_sharded:
                return P()
            self._need(name, "num_attention_heads", c.num_attention_heads)
            self._dim(name, shape, 0, "q heads")
            return P(a)
        if parent in ("q_proj", "k_proj", "v_proj", "o_proj") and last in ("kernel", "bias"):
            if not self.kv_sharded:
                # Fewer kv heads than shards: the whole attention block stays replicated.
                # Splitting only q/o makes XLA split each layer's cache write by kv head
                # and all-gather the whole cache after every chain step (seen in the HLO).
                return P()
            if parent == "q_proj":
                self._need(name, "num_attention_heads", c.num_attention_heads)
                self._dim(name, shape, len(shape) - 1, "q heads x head_dim")
                return col[last]
            if parent == "o_proj":
                if last == "bias":
                    return P()
                self._need(name, "num_attention_heads", c.num_attention_heads)
                self._dim(name, shape, 0, "q heads x head_dim")
                return P(a, None)
            self._dim(name, shape, len(shape) - 1, "kv heads x head_dim")
            return col[last]
        if parent in ("gate_proj", "up_proj") and last in ("kernel", "bias"):
            self._need(name, "intermediate_size", c.intermediate_size)
            self._dim(name, shape, len(shape) - 1, "intermediate size")
            return col[last]
        if parent == "down_proj" and last in ("kernel", "bias"):
            if last == "bias":
                return P()
            self._need(name, "intermediate_size", c.intermediate_size)
            self._dim(name, shape, 0, "intermediate size")
            return P(a, None)
        raise ValueError(f"no tensor-parallel rule for params entry {name!r} (shape {shape}); "
                         "specjax.sharding knows the Llama / EAGLE / EAGLE-3 / DFlash / DSpark / "
                         "Medusa / MTP / Qwen3-MoE / gpt-oss params trees")


def param_specs(params: Mapping, config: ModelConfig, axis_size: int, *, axis: str = TP_AXIS,
                shard_embedding: bool = False, ep_size: int | None = None) -> Any:
    """``PartitionSpec`` of every params leaf (same tree as ``params``, leaves arrays or
    ``ShapeDtypeStruct``) for ``axis_size`` shards of mesh axis ``axis``; head counts and
    sizes are checked against ``config`` (``proposer.model.config``). ``shard_embedding``
    also splits ``embed_tokens`` over the vocabulary (default replicated: only looked-up
    rows are read). ``ep_size``: the ``"ep"`` axis' size, which MoE experts are split over
    too (None: no such axis). Raises ``ValueError`` naming the parameter for an indivisible
    dimension or an unknown params entry."""
    rules = _Rules(config, _check_size(axis_size), axis, shard_embedding, ep_size)
    return jax.tree_util.tree_map_with_path(
        lambda p, x: rules.spec(tuple(_key(k) for k in p), tuple(x.shape)), params)


def param_shardings(params: Mapping, mesh: Mesh, config: ModelConfig, *, axis: str = TP_AXIS,
                    shard_embedding: bool = False) -> Any:
    """``NamedSharding`` of every params leaf over ``mesh`` (see :func:`param_specs`); an
    ``"ep"`` axis splits the experts (a mesh of ``"ep"`` alone: nothing else is split); other
    mesh axes (e.g. ``"dp"``) replicate. ``jax.device_put(params, param_shardings(...))``."""
    ep = int(mesh.shape[EP_AXIS]) if EP_AXIS in mesh.axis_names else None
    alone = ep is not None and axis not in mesh.axis_names
    specs = param_specs(params, config, 1 if alone else _axis_size(mesh, axis), axis=axis,
                        shard_embedding=shard_embedding, ep_size=ep)
    if alone:
        specs = jax.tree.map(lambda s: P(*(None if d == axis else d for d in s)), specs,
                             is_leaf=lambda x: isinstance(x, P))
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                        is_leaf=lambda x: isinstance(x, P))


def _is_cache(x: Any) -> bool:
    return isinstance(x, KVCache)


def state_specs(state: Any, axis_size: int, *, axis: str = TP_AXIS) -> Any:
    """``PartitionSpec`` of every leaf of a (possibly abstract) proposer state: ``KVCache``
    leaves ``[num_blocks, block_size, n_kv, head_dim]`` over kv heads when ``n_kv`` divides
    by ``axis_size``, everything else replicated."""
    n = _check_size(axis_size)

    def cache_spec(c: KVCache) -> KVCache:
        def one(x):
            if len(x.shape) != 4:
                raise ValueError(f"KV cache leaves must be [num_blocks, block_size, n_kv, head_dim], "
                                 f"got shape {tuple(x.shape)}")
            return P(None, None, axis, None) if x.shape[2] % n == 0 else P()
        return KVCache(one(c.k), one(c.v))

    return jax.tree.map(lambda x: cache_spec(x) if _is_cache(x) else P(), state, is_leaf=_is_cache)


def state_shardings(state: Any, mesh: Mesh, *, axis: str = TP_AXIS) -> Any:
    """``NamedSharding`` of every leaf of a proposer state over ``mesh`` (:func:`state_specs`)."""
    specs = state_specs(state, _axis_size(mesh, axis), axis=axis)
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


def tensor_parallel(proposer: Any, params: Mapping, state: Any, mesh: Mesh, *, axis: str = TP_AXIS,
                    local_argmax: bool = True, shard_embedding: bool = False
                    ) -> tuple[Any, dict, Any]:
    """``(proposer, params, state)`` ready for tensor-parallel drafting over ``mesh[axis]``:
    params and state placed (not donated) with :func:`param_shardings` /
    :func:`state_shardings`; a copy of the proposer (one with ``mesh`` / ``vocab_axis``
    fields, else ``ValueError``) with ``mesh=mesh, vocab_axis=axis`` and
    ``config.use_local_argmax_reduction=local_argmax``."""
    fields = {f.name for f in dataclasses.fields(proposer)} if dataclasses.is_dataclass(proposer) else set()
    if not {"mesh", "vocab_axis", "config", "model"} <= fields:
        raise ValueError(f"tensor_parallel needs a proposer with mesh / vocab_axis options (EAGLE, "
                         f"EAGLE-3, DFlash, draft model), got {type(proposer).__name__}; place "
                         "other params with param_shardings / state_shardings")
    cfg = dataclasses.replace(proposer.config, use_local_argmax_reduction=bool(local_argmax))
    prop = dataclasses.replace(proposer, config=cfg, mesh=mesh, vocab_axis=axis)
    ps = param_shardings(params, mesh, proposer.model.config, axis=axis,
                         shard_embedding=shard_embedding)
    return prop, jax.device_put(params, ps), jax.device_put(state, state_shardings(state, mesh, axis=axis))


# ---------------------------------------------------------------------------------------
# data parallelism over requests


@dataclasses.dataclass(frozen=True)
class DataParallel:
    """Data-parallel drafting: the ``n = mesh.shape[axis]`` devices of ``axis`` each run
    ``proposer.propose`` on their own batch and state; params are replicated.

    Per-shard states and inputs travel stacked as ``[n, ...]`` leaves (:meth:`stack` /
    :meth:`unstack`), one shape bucket for all; ``propose(params, states, inputs) ->
    (outputs, states)`` donates the states. DP x TP: a proposer from
    :func:`tensor_parallel` on the same mesh (another mesh: ``ValueError``).
    """

    proposer: Any
    mesh: Mesh
    axis: str = DP_AXIS

    def __post_init__(self) -> None:
        if not isinstance(self.mesh, Mesh):
            raise ValueError(f"mesh must be a jax.sharding.Mesh, got {type(self.mesh).__name__}")
        _axis_size(self.mesh, self.axis)
        pmesh = getattr(self.proposer, "mesh", None)
        if pmesh is not None:
            if pmesh != self.mesh:
                raise ValueError("DataParallel's proposer must have mesh=None (each shard drafts "
                                 "alone) or the DataParallel mesh itself (DP x TP, from "
                                 "tensor_parallel on that mesh); got another mesh")
            if getattr(self.proposer, "vocab_axis", None) == self.axis:
                raise ValueError(f"the proposer's vocab_axis is the data-parallel axis "
                                 f"{self.axis!r}: tensor parallelism needs another axis of the mesh")

    def _tp_axis(self) -> str | None:
        return (getattr(self.proposer, "vocab_axis", None)
                if getattr(self.proposer, "mesh", None) is not None else None)

    @property
    def size(self) -> int:
        return int(self.mesh.shape[self.axis])

    def stack(self, trees: Sequence[Any]) -> Any:
        """``n`` per-shard pytrees of one structure (static fields equal) -> one pytree of
        ``[n, ...]`` leaves sharded over ``axis``."""
        trees = list(trees)
        if len(trees) != self.size:
            raise ValueError(f"stack needs one pytree per shard of axis {self.axis!r} "
                             f"({self.size}), got {len(trees)}")
        structs = {jax.tree.structure(t) for t in trees}
        if len(structs) != 1:
            raise ValueError("the per-shard pytrees differ in structure or static fields "
                             "(use one shape bucket for every shard)")
        stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *trees)
        tp = self._tp_axis()
        if tp is None:
            return jax.device_put(stacked, NamedSharding(self.mesh, P(self.axis)))
        specs = state_specs(trees[0], _axis_size(self.mesh, tp), axis=tp)
        return jax.device_put(stacked, jax.tree.map(
            lambda s: NamedSharding(self.mesh, P(self.axis, *s)), specs,
            is_leaf=lambda x: isinstance(x, P)))

    def unstack(self, tree: Any) -> list[Any]:
        """Inverse of :meth:`stack` (each shard's pytree, as host-visible arrays)."""
        return [jax.tree.map(lambda x, i=i: x[i], tree) for i in range(self.size)]

    @functools.partial(jax.jit, static_argnums=0, donate_argnums=2)
    def propose(self, params: Mapping, states: Any, inputs: Any) -> tuple[Any, Any]:
        spec = P(self.axis)

        def local(params, states, inputs):
            squeeze = functools.partial(jax.tree.map, lambda x: x[0])
            out, st = type(self.proposer).propose(self.proposer, params, squeeze(states),
                                                  squeeze(inputs))
            expand = functools.partial(jax.tree.map, lambda x: x[None])
            return expand(out), expand(st)

        return _compat.shard_map(local, mesh=self.mesh, in_specs=(P(), spec, spec),
                                 out_specs=(spec, spec), axis_names={self.axis},
                                 check_vma=False)(params, states, inputs)

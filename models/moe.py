"""Sparse mixture-of-experts blocks: top-k routing and the experts as one grouped GEMM.

Routers: :func:`softmax_top_k` (Qwen3-MoE), :func:`top_k_softmax` (gpt-oss).
:func:`grouped_experts` runs the T*k (token, expert) pairs sorted by expert as one
:func:`specjax.kernels.grouped_matmul.grouped_matmul` per projection (``jax.lax.ragged_dot``
or the Pallas kernel, by the kernels' backend rule; up to :data:`PAIR_MAX_PAIRS` pairs the Pallas
path runs one program per pair, unsorted), with no per-token or per-expert loop. Experts are
stacked: ``gate_up [E, H, 2I]`` with gate and up columns interleaved (gpt-oss's layout, so a
contiguous split of the last axis keeps each gate with its up) and ``down [E, I, H]``.
Under a context mesh (``jax.set_mesh``) with ``"ep"`` / ``"tp"`` axes, :class:`Experts` runs
each shard's experts in a ``shard_map`` and sums the partial outputs (docs/multi_gpu.md).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from specjax import _compat
from specjax.kernels.grouped_matmul import grouped_matmul, pair_matmul, resolve_grouped_backend
from specjax.models.layers import linear

__all__ = ["EP_AXIS", "PAIR_MAX_PAIRS", "softmax_top_k", "top_k_softmax", "swiglu", "grouped_experts",
           "sharded_experts", "Experts", "SparseMoeBlock"]

#: Mesh axes of the experts' split: E over ``"ep"``, each expert's FFN width over ``"tp"``.
EP_AXIS, TP_AXIS = "ep", "tp"


def softmax_top_k(logits: jax.Array, top_k: int, norm_topk_prob: bool):
    """Softmax over all E in float32, then the top k (renormalised when ``norm_topk_prob``):
    ``logits [T, E]`` -> ``(weights [T, k] f32, experts [T, k] int32)``."""
    weights, experts = jax.lax.top_k(jax.nn.softmax(logits.astype(jnp.float32), axis=-1), top_k)
    if norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts


def top_k_softmax(logits: jax.Array, top_k: int):
    """The top k raw logits, then a softmax over those k only (gpt-oss's router)."""
    top, experts = jax.lax.top_k(logits.astype(jnp.float32), top_k)
    return jax.nn.softmax(top, axis=-1), experts


def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """``silu(gate) * up``, elementwise: the experts' gated activation (a ``glu``)."""
    return jax.nn.silu(gate) * up


#: (token, expert) pairs up to which the Pallas path runs :func:`pair_matmul` (one program
#: per pair, nothing sorted) rather than the sorted grouped matmul: at decode its routing
#: kernels cost more than the GEMMs, and few pairs name one expert twice.
PAIR_MAX_PAIRS = 16


def _pairwise(backend: str, *shapes) -> bool:
    """Whether ``backend``'s grouped matmul is the Pallas kernel and takes every ``(K, N)``."""
    if resolve_grouped_backend(backend) != "pallas":
        return False
    from specjax.kernels.grouped_matmul import pallas

    return all(pallas.unsupported_reason(int(a), int(b)) is None for a, b in shapes)


def grouped_experts(x: jax.Array, weights: jax.Array, experts: jax.Array, gate_up: jax.Array,
                    down: jax.Array, glu: Callable[[jax.Array, jax.Array], jax.Array] = swiglu, *,
                    gate_up_bias: jax.Array | None = None, down_bias: jax.Array | None = None,
                    backend: str = "auto") -> jax.Array:
    """``sum_j weights[t, j] * expert_{experts[t, j]}(x[t])``: ``x [T, H]``, ``weights`` /
    ``experts [T, k]``, biases ``gate_up_bias [E, 2I]`` / ``down_bias [E, H]``; ``glu``: the
    elementwise ``(gate, up) -> [N, I]`` of ``gate_up``'s even and odd columns (a hashable
    function: on the pair path it runs in the kernel's epilogue, in float32); ``backend``: the
    grouped matmul's. Ids outside ``[0, E)`` (another shard's) add nothing."""
    t, k = experts.shape
    e = gate_up.shape[0]
    flat = experts.reshape(-1)                                                  # [T*k]
    local = (flat >= 0) & (flat < e)
    if t * k <= PAIR_MAX_PAIRS and _pairwise(backend, (x.shape[1], gate_up.shape[2]),
                                             down.shape[1:]):
        pair = jnp.arange(t * k, dtype=jnp.int32)
        act = pair_matmul(x, gate_up.astype(x.dtype), pair // k, flat, gate_up_bias, glu=glu)
        y = pair_matmul(act, down.astype(x.dtype), pair, flat)                     # [T*k, H]
        if down_bias is not None:
            y = y + down_bias.astype(x.dtype)[jnp.clip(flat, 0, e - 1)]
        w = jnp.where(local, weights.reshape(-1).astype(jnp.float32), 0)[:, None]
        return jnp.sum((y.astype(jnp.float32) * w).reshape(t, k, -1), axis=1).astype(x.dtype)
    order = jnp.argsort(jnp.where(local, flat, e), stable=True)                 # others last
    token = order // k
    pair_expert = jnp.clip(flat[order], 0, e - 1)
    sizes = jnp.bincount(jnp.where(local, flat, e), length=e + 1)[:e].astype(jnp.int32)
    gu = grouped_matmul(x[token], gate_up.astype(x.dtype), sizes, backend=backend)  # [T*k, 2I]
    if gate_up_bias is not None:
        gu = gu + gate_up_bias.astype(x.dtype)[pair_expert]
    y = grouped_matmul(glu(gu[:, 0::2], gu[:, 1::2]), down.astype(x.dtype), sizes,
                       backend=backend)                                          # [T*k, H]
    if down_bias is not None:
        y = y + down_bias.astype(x.dtype)[pair_expert]
    w = weights.reshape(-1)[order].astype(x.dtype)[:, None]
    y = jnp.where(local[order][:, None], y * w, 0)       # rows past the groups: unspecified
    return jnp.zeros((t, x.shape[1]), x.dtype).at[token].add(y)


def _expert_axes():
    """``(mesh, ep, tp)``: the context mesh and its automatic ``"ep"`` / ``"tp"`` axes of
    size > 1 (None where absent or manual)."""
    mesh = _compat.get_abstract_mesh()
    names = getattr(mesh, "axis_names", None) or ()
    manual = getattr(mesh, "manual_axes", None) or ()
    return mesh, *(a if a in names and a not in manual and mesh.shape[a] > 1 else None
                   for a in (EP_AXIS, TP_AXIS))


def sharded_experts(x: jax.Array, weights: jax.Array, experts: jax.Array, gate_up: jax.Array,
                    down: jax.Array, glu: Callable[[jax.Array, jax.Array], jax.Array] = swiglu,
                    backend: str = "auto", **biases) -> jax.Array:
    """:func:`grouped_experts` in a ``shard_map`` over the context mesh's ``"ep"`` (E / n
    experts a shard, ids minus its offset) and ``"tp"`` (I / n of each expert's FFN; the
    ``down_bias`` added by shard 0) axes, partial outputs ``psum``-ed; without them plain.
    ValueError naming the size that does not divide."""
    mesh, ep, tp = _expert_axes()
    if ep is None and tp is None:
        return grouped_experts(x, weights, experts, gate_up, down, glu, backend=backend,
                               **biases)
    e, inter = gate_up.shape[0], down.shape[1]
    for axis, what, size in ((ep, "experts", e), (tp, "expert FFN width", inter)):
        if axis is not None and size % mesh.shape[axis]:
            raise ValueError(f"cannot split {what} ({size}) over mesh axis {axis!r} of size "
                             f"{mesh.shape[axis]}")
    biases = {k: v for k, v in biases.items() if v is not None}

    def local(x, weights, experts, gate_up, down, biases):
        if ep is not None:
            experts = experts - jax.lax.axis_index(ep).astype(experts.dtype) * gate_up.shape[0]
        if tp is not None and "down_bias" in biases:
            first = jax.lax.axis_index(tp) == 0
            biases = dict(biases, down_bias=jnp.where(first, biases["down_bias"], 0))
        y = grouped_experts(x, weights, experts, gate_up, down, glu, backend=backend,
                            **biases)
        return jax.lax.psum(y, tuple(a for a in (ep, tp) if a is not None))

    specs = {"gate_up_bias": P(ep, tp), "down_bias": P(ep)}
    return _compat.shard_map(
        local, mesh=mesh, in_specs=(P(), P(), P(), P(ep, None, tp), P(ep, tp, None),
                                    {k: specs[k] for k in biases}),
        out_specs=P(), axis_names={a for a in (ep, tp) if a is not None})(
        x, weights, experts, gate_up, down, biases)


class Experts(nnx.Module):
    """E stacked experts: ``gate_up [E, H, 2I]`` (interleaved), ``down [E, I, H]`` and, with
    ``bias``, ``gate_up_bias [E, 2I]`` / ``down_bias [E, H]``."""

    def __init__(self, hidden: int, inter: int, num_experts: int, bias: bool):
        self.gate_up = nnx.Param(jnp.zeros((num_experts, hidden, 2 * inter), jnp.float32))
        self.down = nnx.Param(jnp.zeros((num_experts, inter, hidden), jnp.float32))
        if bias:
            self.gate_up_bias = nnx.Param(jnp.zeros((num_experts, 2 * inter), jnp.float32))
            self.down_bias = nnx.Param(jnp.zeros((num_experts, hidden), jnp.float32))
        self.bias = bias

    def __call__(self, x: jax.Array, weights: jax.Array, experts: jax.Array,
                 glu: Callable[[jax.Array, jax.Array], jax.Array] = swiglu) -> jax.Array:
        """:func:`sharded_experts` with these weights."""
        biases = (dict(gate_up_bias=self.gate_up_bias[...], down_bias=self.down_bias[...])
                  if self.bias else {})
        return sharded_experts(x, weights, experts, self.gate_up[...], self.down[...],
                               glu, **biases)


class SparseMoeBlock(nnx.Module):
    """Qwen3-MoE's ``Qwen3MoeSparseMoeBlock``: router ``gate`` (``[H, E]``, no bias),
    :func:`softmax_top_k`, SwiGLU :class:`Experts` of width I."""

    def __init__(self, hidden: int, inter: int, num_experts: int, top_k: int,
                 norm_topk_prob: bool, rngs: nnx.Rngs):
        self.gate = linear(hidden, num_experts, False, rngs)
        self.experts = Experts(hidden, inter, num_experts, False)
        self.top_k, self.norm_topk_prob = int(top_k), bool(norm_topk_prob)

    def __call__(self, x: jax.Array) -> jax.Array:
        """``x [T, H]`` -> ``[T, H]``."""
        logits = jnp.matmul(x, self.gate.kernel[...].astype(x.dtype),   # f32 accumulated and
                            preferred_element_type=jnp.float32)          # kept, no f32 copies
        weights, experts = softmax_top_k(logits, self.top_k, self.norm_topk_prob)
        return self.experts(x, weights, experts)

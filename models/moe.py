"""Sparse mixture-of-experts SwiGLU block (Qwen3-MoE's ``Qwen3MoeSparseMoeBlock``).

``x [T, H]`` -> ``[T, H]``: router ``gate`` (``[H, E]``, no bias), softmax over all E in
float32, top-k (renormalised over the k when ``norm_topk_prob``), output
``sum_j w_j * expert_{e_j}(x)`` with SwiGLU experts of width I. The experts run as one
grouped GEMM (``jax.lax.ragged_dot``) over the T*k (token, expert) pairs sorted by
expert: no per-token or per-expert loop, so a step costs the same for any routing.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.models.layers import MLP, linear
from specjax.models.params import is_fused_kernel

__all__ = ["SparseMoeBlock", "sparse_moe"]


def sparse_moe(x: jax.Array, router: jax.Array, w_gate_up: jax.Array, w_down: jax.Array,
               top_k: int, norm_topk_prob: bool) -> jax.Array:
    """``x [T, H]``, ``router [H, E]``, ``w_gate_up [E, H, 2I]`` (gate columns then up),
    ``w_down [E, I, H]`` -> ``[T, H]`` in ``x``'s dtype."""
    t, e = x.shape[0], router.shape[1]
    logits = x.astype(jnp.float32) @ router.astype(jnp.float32)
    weights, experts = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), top_k)    # [T, k]
    if norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    flat = experts.reshape(-1)                                                  # [T*k]
    order = jnp.argsort(flat, stable=True)
    token = order // top_k
    sizes = jnp.bincount(flat, length=e).astype(jnp.int32)
    gu = jax.lax.ragged_dot(x[token], w_gate_up.astype(x.dtype), sizes)         # [T*k, 2I]
    inter = w_gate_up.shape[-1] // 2
    act = jax.nn.silu(gu[:, :inter]) * gu[:, inter:]
    y = jax.lax.ragged_dot(act, w_down.astype(x.dtype), sizes)                  # [T*k, H]
    y = y * weights.reshape(-1)[order].astype(x.dtype)[:, None]
    return jnp.zeros((t, x.shape[1]), x.dtype).at[token].add(y)


class SparseMoeBlock(nnx.Module):
    """``gate`` (the router) and ``experts.{e}`` (SwiGLU :class:`MLP` s, the checkpoint's
    per-expert tensors), stacked to ``[E, H, 2I]`` / ``[E, I, H]`` for :func:`sparse_moe`."""

    def __init__(self, hidden: int, inter: int, num_experts: int, top_k: int,
                 norm_topk_prob: bool, rngs: nnx.Rngs):
        self.gate = linear(hidden, num_experts, False, rngs)
        self.experts = nnx.List([MLP(hidden, inter, False, rngs) for _ in range(num_experts)])
        self.top_k, self.norm_topk_prob = int(top_k), bool(norm_topk_prob)

    def __call__(self, x: jax.Array) -> jax.Array:
        """``x [T, H]`` -> ``[T, H]``."""
        if is_fused_kernel(self.experts[0].up_proj):     # gate_up_proj (fuse_projections)
            gu = jnp.stack([m.gate_proj.kernel[...] for m in self.experts])
        else:
            gu = jnp.stack([jnp.concatenate([m.gate_proj.kernel[...], m.up_proj.kernel[...]], 1)
                            for m in self.experts])
        down = jnp.stack([m.down_proj.kernel[...] for m in self.experts])
        return sparse_moe(x, self.gate.kernel[...], gu, down, self.top_k, self.norm_topk_prob)

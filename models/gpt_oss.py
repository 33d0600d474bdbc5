"""gpt-oss decoder LM (``GptOssForCausalLM``): the target model, or a draft of the same vocabulary.

Llama's pre-norm layers with q/k/v/o biases, per-head attention sinks, sliding windows on the
``layer_types`` sliding layers and YaRN RoPE (its attention factor scales cos and sin); every
MLP is a biased top-k router over clamped-SwiGLU experts; RMSNorm multiplies its weight in
float32 before the cast. Aux state k is ``h_k``, the input of layer k, as in :mod:`llama`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.models.config import ModelConfig
from specjax.models.layers import Attention, DecoderLayer, linear
from specjax.models.llama import DecoderBody, DecoderLM, tensor_table as llama_table
from specjax.models.moe import Experts, top_k_softmax
from specjax.models.tensors import Entry

__all__ = ["GptOssLM", "GptOssRMSNorm", "GptOssMLP", "clamped_swiglu", "SWIGLU_ALPHA",
           "tensor_table"]

#: The sigmoid slope of gpt-oss's gate (fixed in transformers and vLLM).
SWIGLU_ALPHA = 1.702


class GptOssRMSNorm(nnx.Module):
    """``cast(w * x * rsqrt(mean(x^2) + eps))``: the weight multiplies in float32."""

    def __init__(self, dim: int, eps: float):
        self.weight = nnx.Param(jnp.ones((dim,), jnp.float32))
        self.eps = float(eps)

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (self.weight[...].astype(jnp.float32) * y).astype(x.dtype)


def clamped_swiglu(gate: jax.Array, up: jax.Array, limit: float) -> jax.Array:
    """``(up + 1) * gate * sigmoid(1.702 gate)`` with ``gate <= limit``, ``|up| <= limit``
    (``limit`` 0: unclamped), elementwise (the experts' ``glu``)."""
    if limit:
        gate = jnp.minimum(gate, limit)
        up = jnp.clip(up, -limit, limit)
    return (up + 1) * (gate * jax.nn.sigmoid(gate * SWIGLU_ALPHA))


@functools.lru_cache(maxsize=None)
def _clamped_glu(limit: float):
    """:func:`clamped_swiglu` at ``limit``, one object per limit (a kernel's static argument)."""
    return functools.partial(clamped_swiglu, limit=limit)


class GptOssMLP(nnx.Module):
    """``router`` (``[H, E]`` + bias), :func:`top_k_softmax`, biased :class:`Experts`."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        h, e = cfg.hidden_size, cfg.num_experts
        self.router = linear(h, e, True, rngs)
        self.experts = Experts(h, cfg.moe_intermediate_size, e, True)
        self.top_k, self.limit = int(cfg.num_experts_per_tok), float(cfg.swiglu_limit)

    def __call__(self, x: jax.Array) -> jax.Array:
        """``x [T, H]`` -> ``[T, H]``."""
        weights, experts = top_k_softmax(self.router(x), self.top_k)
        return self.experts(x, weights, experts,
                            _clamped_glu(self.limit))


class GptOssLayer(DecoderLayer):
    """A pre-norm layer (``DecoderLayer.__call__``) with gpt-oss norms and MLP."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, *, layer: int):
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = GptOssRMSNorm(h, eps)
        self.self_attn = Attention(cfg, h, rngs, layer=layer)
        self.post_attention_layernorm = GptOssRMSNorm(h, eps)
        self.mlp = GptOssMLP(cfg, rngs)


class GptOssBody(DecoderBody):
    """``layers.{i}`` (GptOssLayer) and the final ``norm``."""

    layer_class = GptOssLayer
    norm_class = GptOssRMSNorm


@dataclasses.dataclass(frozen=True)
class GptOssLM(DecoderLM):
    """Static runner of a ``gpt_oss`` decoder LM; :class:`DecoderLM` with the gpt-oss body."""

    body_class = GptOssBody


def expert_entries(prefix: str, path: tuple, c: ModelConfig) -> list[Entry]:
    """Router and stacked experts in transformers' layout (``gate_up_proj [E, H, 2I]``
    interleaved, ``down_proj [E, I, H]``: already the params layout)."""
    h, i, n = c.hidden_size, c.moe_intermediate_size, c.num_experts
    m, x = path + ("mlp",), path + ("mlp", "experts")
    pre = f"{prefix}mlp."
    return [Entry(f"{pre}router.weight", m + ("router", "kernel"), (n, h), "linear"),
            Entry(f"{pre}router.bias", m + ("router", "bias"), (n,), "copy"),
            Entry(f"{pre}experts.gate_up_proj", x + ("gate_up",), (n, h, 2 * i), "copy"),
            Entry(f"{pre}experts.gate_up_proj_bias", x + ("gate_up_bias",), (n, 2 * i), "copy"),
            Entry(f"{pre}experts.down_proj", x + ("down",), (n, i, h), "copy"),
            Entry(f"{pre}experts.down_proj_bias", x + ("down_bias",), (n, h), "copy")]


def tensor_table(c: ModelConfig) -> list[Entry]:
    """The canonical tensors of a gpt-oss decoder (transformers' names, experts bf16
    dequantized)."""
    return llama_table(c, expert_entries, lambda i: True)

"""Building blocks shared by every model: RMSNorm, SwiGLU MLP, GQA attention, decoder layer,
the paged-cache mixin.

Flax NNX modules. Weights are ``nnx.Param``; linear kernels are ``[in, out]`` (the
transpose of PyTorch's ``[out, in]``). The paged attention itself lives in
:mod:`specjax.kernels.paged_attention`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.attention_metadata import CommonAttentionMetadata
from specjax.kernels import paged_attention as attn_lib
from specjax.kernels.paged_attention import KVCache
from specjax.models.config import ModelConfig
from specjax.models.params import is_fused_kernel, split_fused, two_row_matmul
from specjax.models.rope import apply_rope


class PagedCache:
    """Mixin of every runner with one paged K/V cache per layer of its ``config``
    (``num_hidden_layers``, ``num_key_value_heads``, ``head_dim``)."""

    config: ModelConfig

    def init_kv_caches(self, num_blocks: int, block_size: int, dtype=jnp.float32) -> list[KVCache]:
        c = self.config
        return attn_lib.init_kv_caches(c.num_hidden_layers, num_blocks, block_size,
                                       c.num_key_value_heads, c.head_dim, dtype)


class Linear(nnx.Linear):
    """``nnx.Linear`` (same parameters), its matmul on at least two rows
    (:func:`specjax.models.params.two_row_matmul`: a one-row matmul takes XLA's slow path)."""

    def __call__(self, inputs: jax.Array, *args, **kwargs) -> jax.Array:
        call = super().__call__
        return two_row_matmul(lambda x: call(x, *args, **kwargs), inputs)


def linear(in_features: int, out_features: int, bias: bool, rngs: nnx.Rngs) -> nnx.Linear:
    return Linear(in_features, out_features, use_bias=bias, rngs=rngs)


class RMSNorm(nnx.Module):
    """HF RMSNorm: ``weight * (x * rsqrt(mean(x^2) + eps))``, the normalization in float32."""

    def __init__(self, dim: int, eps: float):
        self.weight = nnx.Param(jnp.ones((dim,), jnp.float32))
        self.eps = float(eps)

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.weight[...], self.eps)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (weight * y.astype(x.dtype)).astype(x.dtype)


class MLP(nnx.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``; ``gelu_tanh=True``: GELU-tanh in place of
    silu (Gemma's ``gelu_pytorch_tanh``)."""

    def __init__(self, hidden: int, inter: int, bias: bool, rngs: nnx.Rngs, *,
                 gelu_tanh: bool = False):
        self.gate_proj = linear(hidden, inter, bias, rngs)
        self.up_proj = linear(hidden, inter, bias, rngs)
        self.down_proj = linear(inter, hidden, bias, rngs)
        self.inter = inter
        self.gelu_tanh = gelu_tanh

    def __call__(self, x: jax.Array) -> jax.Array:
        if is_fused_kernel(self.up_proj):            # gate_up_proj (params.fuse_projections)
            gate, up = split_fused(self.gate_proj(x), (self.inter,) * 2)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        act = jax.nn.gelu(gate, approximate=True) if self.gelu_tanh else jax.nn.silu(gate)
        return self.down_proj(act * up)


class Attention(nnx.Module):
    """GQA self-attention over the paged cache; q/k/v read ``in_features``-wide inputs.
    ``layer``: its index, for ``cfg.layer_window``; ``cfg.attention_sinks``: a ``sinks``
    parameter, one logit per query head."""

    def __init__(self, cfg: ModelConfig, in_features: int, rngs: nnx.Rngs, *, layer: int = 0,
                 norm=None):
        """``norm``: the q/k norm class (None: :class:`RMSNorm`; Gemma's ``(1 + w)`` form)."""
        nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = linear(in_features, nh * hd, cfg.qkv_bias, rngs)
        self.k_proj = linear(in_features, nkv * hd, cfg.qkv_bias, rngs)
        self.v_proj = linear(in_features, nkv * hd, cfg.qkv_bias, rngs)
        self.o_proj = linear(nh * hd, cfg.hidden_size, cfg.o_bias, rngs)
        if cfg.qk_norm:
            self.q_norm = (norm or RMSNorm)(hd, cfg.rms_norm_eps)
            self.k_norm = (norm or RMSNorm)(hd, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.sinks = nnx.Param(jnp.zeros((nh,), jnp.float32)) if cfg.attention_sinks else None
        self.window = cfg.layer_window(layer)
        self.scale = float((cfg.query_pre_attn_scalar or hd) ** -0.5)
        self.num_heads, self.num_kv_heads, self.head_dim = nh, nkv, hd

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, cache: KVCache,
                 md: CommonAttentionMetadata, attention=None) -> tuple[jax.Array, KVCache]:
        """``attention``: an ``attn_lib.AttentionFn`` (None: ``attn_lib.attend``)."""
        t, hd = x.shape[0], self.head_dim
        if is_fused_kernel(self.k_proj):             # qkv_proj (params.fuse_projections)
            q, k, v = split_fused(self.q_proj(x), (self.num_heads * hd, self.num_kv_heads * hd,
                                                   self.num_kv_heads * hd))
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.reshape(t, self.num_heads, hd)
        k = k.reshape(t, self.num_kv_heads, hd)
        v = v.reshape(t, self.num_kv_heads, hd)
        if self.q_norm is not None:
            q = self.q_norm(q)
            k = self.k_norm(k)
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)
        attend = attn_lib.attend if attention is None else attention
        o, cache = attend(q, k, v, cache, md, scale=self.scale, **self.extras())
        return self.o_proj(o.reshape(t, self.num_heads * self.head_dim)), cache


    def extras(self) -> dict:
        """The window / sinks keywords of this layer's attention call (none when unused,
        so an ``AttentionFn`` without them keeps working)."""
        kw = {}
        if self.window is not None:
            kw["sliding_window"] = self.window
        if self.sinks is not None:
            kw["sinks"] = self.sinks[...]
        return kw


class DecoderLayer(nnx.Module):
    """Pre-norm Llama/Qwen layer. ``input_norm=False``: EAGLE-1 layer 0 (no input norm)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, *, input_norm: bool = True,
                 layer: int = 0):
        h = cfg.hidden_size
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps) if input_norm else None
        self.self_attn = Attention(cfg, h, rngs, layer=layer)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.mlp = MLP(h, cfg.intermediate_size, cfg.mlp_bias, rngs)

    def __call__(self, h: jax.Array, cos, sin, cache: KVCache, md: CommonAttentionMetadata,
                 attention=None) -> tuple[jax.Array, KVCache]:
        """``h [T, H]``: the residual stream in; returns the stream out. ``attention``: as
        :class:`Attention`'s."""
        x = h if self.input_layernorm is None else self.input_layernorm(h)
        a, cache = self.self_attn(x, cos, sin, cache, md, attention)
        h = h + a
        h = h + self.mlp(self.post_attention_layernorm(h))
        return h, cache

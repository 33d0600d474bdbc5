"""Gemma 3 text decoder LM (``Gemma3ForCausalLM``; the text part of
``Gemma3ForConditionalGeneration``): the target model, or a draft of the same vocabulary.

``h_0 = embed(ids) * sqrt(H)`` (the scale cast to the embedding dtype); layer k (four
"sandwich" norms, all ``x * rsqrt(mean(x^2) + eps) * (1 + w)`` in float32):
``h += post_attn_norm(attn(input_norm(h)))``; ``h += post_ff_norm(mlp(pre_ff_norm(h)))``
with a GELU-tanh MLP, q/k norms, scale ``query_pre_attn_scalar^-0.5``; sliding layers use
their window and RoPE base ``rope_local_base_freq``, full layers ``rope_theta`` with
``rope_scaling``. ``logits = c * tanh(embed^T norm(h_L) / c)`` (``final_logit_softcapping``
c; none when 0). Aux state k is ``h_k``, the input of layer k, as in :mod:`llama`.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.attention_metadata import CommonAttentionMetadata
from specjax.kernels.paged_attention import KVCache
from specjax.models import params as mp, rope
from specjax.models.config import ModelConfig
from specjax.models.layers import MLP, Attention
from specjax.models.llama import DecoderBody, DecoderLM
from specjax.models.tensors import Entry, layer_entries

__all__ = ["Gemma3LM", "GemmaRMSNorm", "tensor_table"]


class GemmaRMSNorm(nnx.Module):
    """Gemma RMSNorm: ``cast(x * rsqrt(mean(x^2) + eps) * (1 + w))``, all in float32."""

    def __init__(self, dim: int, eps: float):
        self.weight = nnx.Param(jnp.zeros((dim,), jnp.float32))
        self.eps = float(eps)

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (y * (1.0 + self.weight[...].astype(jnp.float32))).astype(x.dtype)


class Gemma3Layer(nnx.Module):
    """One Gemma 3 decoder layer (sandwich norms); ``sliding``: it uses the local RoPE."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, *, layer: int):
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.self_attn = Attention(cfg, h, rngs, layer=layer, norm=GemmaRMSNorm)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.mlp = MLP(h, cfg.intermediate_size, cfg.mlp_bias, rngs, gelu_tanh=True)
        self.sliding = cfg.layer_window(layer) is not None

    def __call__(self, h: jax.Array, cos, sin, cache: KVCache, md: CommonAttentionMetadata,
                 attention=None) -> tuple[jax.Array, KVCache]:
        """``h [T, H]`` -> the residual stream out and the layer's cache."""
        a, cache = self.self_attn(self.input_layernorm(h), cos, sin, cache, md, attention)
        h = h + self.post_attention_layernorm(a)
        h = h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))
        return h, cache


class Gemma3Body(DecoderBody):
    """``layers.{i}`` (Gemma3Layer) and the final ``norm``."""

    layer_class = Gemma3Layer
    norm_class = GemmaRMSNorm


@dataclasses.dataclass(frozen=True)
class Gemma3LM(DecoderLM):
    """Static runner of a ``gemma3`` decoder LM; the :class:`DecoderLM` members (Target
    protocol, KV layout, ``with_aux_layers``) with Gemma's forward and logits."""

    def forward(self, params: dict, input_ids: jax.Array, positions: jax.Array,
                kv_caches: list[KVCache], attn_metadata: CommonAttentionMetadata):
        """As :meth:`DecoderLM.forward`: ``(hidden [T_pad, H] post-norm, aux or None,
        kv_caches)``."""
        cfg = self.config
        body = mp.merge(Gemma3Body, (cfg,), params)
        qsl = attn_metadata.query_start_loc
        full = rope.cos_sin_for(cfg, positions, qsl)
        local = full
        if any(layer.sliding for layer in body.layers):
            local = rope.cos_sin_for(cfg.replace(rope_theta=cfg.rope_local_base_freq or
                                                 cfg.rope_theta, rope_scaling=None), positions, qsl)
        emb = mp.embed(params, input_ids)
        h = emb * jnp.asarray(math.sqrt(cfg.hidden_size), jnp.float32).astype(emb.dtype)
        aux, caches = [], []
        for i, layer in enumerate(body.layers):
            if i in self.aux_layer_ids:
                aux.append(h)
            cos, sin = local if layer.sliding else full
            h, c = layer(h, cos, sin, kv_caches[i], attn_metadata, self.attention)
            caches.append(c)
        hidden = body.norm(h)
        return hidden, (jnp.stack(aux, axis=1) if aux else None), caches

    def compute_logits(self, params: dict, hidden: jax.Array) -> jax.Array:
        """``hidden [N, H]`` -> ``[N, V]`` float32, soft-capped when
        ``final_logit_softcapping`` is set."""
        logits = super().compute_logits(params, hidden)
        cap = self.config.final_logit_softcapping
        if cap:
            logits = jnp.float32(cap) * jnp.tanh(logits / jnp.float32(cap))
        return logits


def tensor_table(c: ModelConfig) -> list[Entry]:
    """The canonical tensors of a Gemma 3 text decoder (``Gemma3ForCausalLM`` names)."""
    h, v = c.hidden_size, c.vocab_size
    e = [Entry("model.embed_tokens.weight", ("embed_tokens", "embedding"), (v, h), "copy")]
    for i in range(c.num_hidden_layers):
        pre = f"model.layers.{i}."
        e += layer_entries(pre, ("layers", i), c, in_features=h)
        e += [Entry(f"{pre}{n}.weight", ("layers", i, n, "weight"), (h,), "copy")
              for n in ("pre_feedforward_layernorm", "post_feedforward_layernorm")]
    e.append(Entry("model.norm.weight", ("norm", "weight"), (h,), "copy"))
    if c.tie_word_embeddings:
        e.append(Entry("lm_head.weight", None, (v, h), "linear", required=False))
    else:
        e.append(Entry("lm_head.weight", ("lm_head", "kernel"), (v, h), "linear"))
    return e

"""DFlash block-diffusion head (z-lab ``DFlashDraftModel``; vLLM ``qwen3_dflash.py``).

Context: ``ctx = hidden_norm(fc(cat(aux states)))`` for the newly accepted tokens; each
layer's K/V of the context (``k_norm`` + RoPE on K) are computed for all layers at once and
written into the layers' paged caches (:meth:`precompute_and_store_context_kv`). Then one
forward over the query block ``[bonus, mask, ..., mask]`` (embedded by the target): each
block query sees the cached context keys and the block keys, per layer within its sliding
window (``config.layer_window``) and causally or not (``config.layer_causal``); default
non-causal. Final ``norm``; the target lm_head (or the head's own over a reduced vocab) on
the mask slots.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.attention_metadata import CommonAttentionMetadata
from specjax.models import params as mp, rope
from specjax.kernels.paged_attention import KVCache, check_attention, write_kv
from specjax.models.config import ModelConfig
from specjax.models.layers import DecoderLayer, PagedCache, RMSNorm, linear, rms_norm


class DFlashBody(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        fc_in = cfg.num_aux * (cfg.target_hidden_size or cfg.hidden_size)
        self.fc = linear(fc_in, cfg.hidden_size, False, rngs)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nnx.List([DecoderLayer(cfg, rngs, layer=i)
                                  for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


@dataclasses.dataclass(frozen=True)
class DFlashHead(PagedCache):
    config: ModelConfig
    #: every layer's attention (a hashable ``specjax.kernels.paged_attention.AttentionFn``
    #: honouring ``md.causal``); None: specjax's backends
    attention: Any = None

    def __post_init__(self):
        check_attention(self.attention)

    def combine_hidden_states(self, params: dict, aux_hidden_states: jax.Array) -> jax.Array:
        """``[T, n_aux, Ht]`` or ``[T, n_aux * Ht]`` -> ``fc`` output ``[T, H]`` (no norm yet)."""
        x = aux_hidden_states
        if x.ndim == 3:
            x = x.reshape(x.shape[0], -1)
        return mp.merge(DFlashBody, (self.config,), params).fc(x)

    def precompute_and_store_context_kv(self, params: dict, context_states: jax.Array,
                                        positions: jax.Array, slot_mapping: jax.Array,
                                        kv_caches: list[KVCache]) -> list[KVCache]:
        """Write every layer's context K/V: ``context_states [Tc, H]`` (the ``fc`` output),
        ``positions``/``slot_mapping [Tc] int32`` (slot -1 dropped)."""
        c = self.config
        nl, nkv, hd = c.num_hidden_layers, c.num_key_value_heads, c.head_dim
        layers = mp.normalize_keys(params)["layers"]
        ctx = rms_norm(context_states, params["hidden_norm"]["weight"], c.rms_norm_eps)
        cos, sin = rope.cos_sin_for(c, positions)     # no request boundaries: per position
        tc = context_states.shape[0]
        caches = []
        # Layer by layer, K and V as separate products: no per-call copy of stacked or
        # concatenated weights, and each product keeps a tensor-parallel split of its kernel
        # (concatenating k/v split along their sharded axis would move weight slices between
        # devices every call).
        for i in range(nl):
            a = layers[i]["self_attn"]
            if "qkv_proj" in a:        # fused (mp.fuse_projections): its k and v columns
                nq = c.num_attention_heads * hd
                kv = ctx @ a["qkv_proj"]["kernel"][:, nq:]
                if c.qkv_bias:
                    kv = kv + a["qkv_proj"]["bias"][nq:]
                k, v = kv[:, : nkv * hd], kv[:, nkv * hd:]
            else:
                k = ctx @ a["k_proj"]["kernel"]
                v = ctx @ a["v_proj"]["kernel"]
                if c.qkv_bias:
                    k, v = k + a["k_proj"]["bias"], v + a["v_proj"]["bias"]
            k, v = k.reshape(tc, nkv, hd), v.reshape(tc, nkv, hd)
            if c.qk_norm:
                k = rms_norm(k, a["k_norm"]["weight"], c.rms_norm_eps)
            caches.append(write_kv(kv_caches[i], rope.apply_rope(k, cos, sin), v, slot_mapping))
        return caches

    def forward(self, params: dict, input_ids: jax.Array, positions: jax.Array,
                kv_caches: list[KVCache], attn_metadata: CommonAttentionMetadata):
        """Query blocks ``input_ids``/``positions [T] int32`` (metadata whose ``seq_lens``
        count context + block; its ``causal`` is replaced by each layer's
        ``config.layer_causal(i)``) -> ``(hidden [T, H] post-norm, kv_caches)``."""
        cfg = self.config
        body = mp.merge(DFlashBody, (cfg,), params)
        cos, sin = rope.cos_sin_for(cfg, positions, attn_metadata.query_start_loc)
        h = mp.embed(params, input_ids)
        caches = []
        for i, layer in enumerate(body.layers):
            md = attn_metadata.replace(causal=cfg.layer_causal(i))
            h, c = layer(h, cos, sin, kv_caches[i], md, self.attention)
            caches.append(c)
        return body.norm(h), caches

    def compute_logits(self, params: dict, hidden: jax.Array) -> jax.Array:
        """``[N, H]`` -> ``[N, V]`` float32 (own reduced-vocab head: scattered via ``d2t``)."""
        logits = mp.lm_head_logits(mp.need(params, "lm_head", "the target's lm_head"), hidden)
        if "d2t" not in params:
            return logits
        ids = jnp.arange(logits.shape[-1], dtype=jnp.int32)
        return mp.scatter_vocab(logits, ids + params["d2t"][ids], self.config.vocab_size)


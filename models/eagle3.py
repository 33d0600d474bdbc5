"""EAGLE-3 head (SafeAILab ``midlayer`` / speculators ``layers.0``; vLLM ``llama_eagle3.py``).

``g = fc(cat(aux states))`` once per target step (optionally ``input_norm`` / ``fc_norm.{i}``
first); later draft steps feed the head's own output (pre-norm, or normed with
``norm_output``). First layer: attention over ``cat(input_layernorm(embed(x)),
hidden_norm(g))`` (2H wide), residual ``g`` (``hidden_norm(g)`` with
``norm_before_residual``), then the usual MLP; further layers are ordinary. ``out =
norm(pre)``; logits over the draft vocab, ``target id = draft id + d2t[draft id]``. A
P-EAGLE ``params["mask_hidden"]`` (``n_aux * Ht`` values, outside the NNX body) gives the
parallel-drafting slots' hidden input through ``fc`` (zeros without it).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.attention_metadata import CommonAttentionMetadata
from specjax.models import params as mp, rope
from specjax.kernels.paged_attention import KVCache, check_attention
from specjax.models.config import ModelConfig
from specjax.models.eagle import mask_hidden_values, without_mask_hidden
from specjax.models.layers import MLP, Attention, DecoderLayer, PagedCache, RMSNorm, linear
from specjax.models.tensors import Entry, layer_entries


class Eagle3FirstLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        h = cfg.hidden_size
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, 2 * h, rngs)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.mlp = MLP(h, cfg.intermediate_size, cfg.mlp_bias, rngs)
        self.norm_before_residual = bool(cfg.norm_before_residual)

    def __call__(self, e, g, cos, sin, cache: KVCache, md: CommonAttentionMetadata,
                 attention=None):
        e = self.input_layernorm(e)
        hn = self.hidden_norm(g)
        residual = hn if self.norm_before_residual else g
        a, cache = self.self_attn(jnp.concatenate([e, hn], axis=-1), cos, sin, cache, md,
                                  attention)
        h = residual + a
        h = h + self.mlp(self.post_attention_layernorm(h))
        return h, cache


class Eagle3Body(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        ht = cfg.target_hidden_size or cfg.hidden_size
        fc_in = cfg.num_aux * ht
        if cfg.norm_before_fc:
            self.input_norm = RMSNorm(fc_in, cfg.rms_norm_eps)
        if cfg.fc_norm:
            self.fc_norm = nnx.List([RMSNorm(ht, cfg.rms_norm_eps) for _ in range(cfg.num_aux)])
        self.fc = linear(fc_in, cfg.hidden_size, False, rngs)
        self.layers = nnx.List([Eagle3FirstLayer(cfg, rngs)]
                               + [DecoderLayer(cfg, rngs, layer=i)
                                  for i in range(1, cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def combine(self, cfg: ModelConfig, x: jax.Array) -> jax.Array:
        """``[T, n_aux * Ht]`` -> ``g [T, H]``: the pre-fc norms of ``cfg``, then ``fc``."""
        if cfg.norm_before_fc:
            x = self.input_norm(x)
        if cfg.fc_norm:
            parts = jnp.split(x, cfg.num_aux, axis=-1)
            x = jnp.concatenate([n(p) for n, p in zip(self.fc_norm, parts)], axis=-1)
        return self.fc(x)


@dataclasses.dataclass(frozen=True)
class Eagle3Head(PagedCache):
    config: ModelConfig
    #: every layer's attention (a hashable ``specjax.kernels.paged_attention.AttentionFn``, a
    #: stack's own kernel); None: specjax's backends
    attention: Any = None

    def __post_init__(self):
        check_attention(self.attention)

    def _body(self, params):
        return mp.merge(Eagle3Body, (self.config,), without_mask_hidden(params))

    def parallel_drafting_hidden_state(self, params: dict, dtype=jnp.float32) -> jax.Array:
        """``[H]``: the parallel-drafting slots' hidden input, ``combine_hidden_states`` of
        ``params["mask_hidden"]``, or zeros; ValueError when it does not hold ``n_aux * Ht``
        values."""
        c = self.config
        ht = c.target_hidden_size or c.hidden_size
        if "mask_hidden" not in params:
            return jnp.zeros((c.hidden_size,), dtype)
        flat = mask_hidden_values(params, c.num_aux * ht,
                                  f"fc input size: {c.num_aux} aux states x {ht}", dtype)
        return self.combine_hidden_states(params, flat[None, :])[0].astype(dtype)

    def combine_hidden_states(self, params: dict, aux_hidden_states: jax.Array) -> jax.Array:
        """``[T, n_aux, Ht]`` or ``[T, n_aux * Ht]`` (low -> high layer) -> ``g [T, H]``."""
        x = aux_hidden_states
        if x.ndim == 3:
            x = x.reshape(x.shape[0], -1)
        return self._body(params).combine(self.config, x)

    def forward(self, params: dict, input_ids: jax.Array, positions: jax.Array,
                hidden_states: jax.Array, kv_caches: list[KVCache],
                attn_metadata: CommonAttentionMetadata):
        """``hidden_states [T, H]`` (``g``, or the previous step's recycled hidden; an
        ``n_aux * Ht`` wide input goes through the pre-fc norms and ``fc`` first) ->
        ``(normed [T, H], recycled [T, H], kv_caches)``: the recycled hidden is the
        pre-norm output, or ``normed`` with ``config.norm_output`` (vLLM v0.33)."""
        cfg = self.config
        body = self._body(params)
        if hidden_states.shape[-1] != cfg.hidden_size or hidden_states.ndim == 3:
            x = hidden_states.reshape(hidden_states.shape[0], -1)
            hidden_states = body.combine(cfg, x)
        cos, sin = rope.cos_sin_for(cfg, positions, attn_metadata.query_start_loc)
        e = mp.embed(params, input_ids)
        caches = []
        h, c = body.layers[0](e, hidden_states.astype(e.dtype), cos, sin, kv_caches[0],
                              attn_metadata, self.attention)
        caches.append(c)
        for i in range(1, len(body.layers)):
            h, c = body.layers[i](h, cos, sin, kv_caches[i], attn_metadata, self.attention)
            caches.append(c)
        normed = body.norm(h)
        return normed, normed if cfg.norm_output else h, caches

    def compute_draft_logits(self, params: dict, hidden: jax.Array) -> jax.Array:
        """``normed [N, H]`` -> ``[N, Vd]`` float32 over the draft vocabulary."""
        return mp.lm_head_logits(mp.need(params, "lm_head", "the draft lm_head"), hidden)

    def draft_to_target_ids(self, params: dict, draft_ids: jax.Array) -> jax.Array:
        """Draft-vocab ids -> target ids (``id + d2t[id]``; identity without ``d2t``)."""
        if "d2t" not in params:
            return draft_ids
        return draft_ids + params["d2t"][draft_ids]

    def compute_logits(self, params: dict, hidden: jax.Array) -> jax.Array:
        """``normed [N, H]`` -> ``[N, V]`` float32 over the target vocab (vLLM): draft logits
        scattered to their target ids, ``-inf`` elsewhere."""
        logits = self.compute_draft_logits(params, hidden)
        if "d2t" not in params:
            return logits
        ids = self.draft_to_target_ids(params, jnp.arange(logits.shape[-1], dtype=jnp.int32))
        return mp.scatter_vocab(logits, ids, self.config.vocab_size)



# --- canonical tensors (models/CANONICAL.md) ----------------------------------------


def tensor_table(c: ModelConfig) -> list[Entry]:
    """The canonical tensors of an EAGLE-3 head, and of a DFlash head (the same layout
    plus ``hidden_norm``, no ``hidden_norm`` in its first layer and an optional lm_head)."""
    kind, h, v, vd = c.kind, c.hidden_size, c.vocab_size, c.draft_vocab_size
    ht = c.target_hidden_size or h
    fc_in = c.num_aux * ht
    e = [Entry("fc.weight", ("fc", "kernel"), (h, fc_in), "linear")]
    if kind == "eagle3" and c.norm_before_fc:
        e.append(Entry("input_norm.weight", ("input_norm", "weight"), (fc_in,), "copy"))
    if kind == "eagle3" and c.fc_norm:
        e += [Entry(f"fc_norm.{i}.weight", ("fc_norm", i, "weight"), (ht,), "copy")
              for i in range(c.num_aux)]
    if kind == "dflash":
        e.append(Entry("hidden_norm.weight", ("hidden_norm", "weight"), (h,), "copy"))
    for i in range(c.num_hidden_layers):
        first3 = kind == "eagle3" and i == 0
        e += layer_entries(f"layers.{i}.", ("layers", i), c, in_features=2 * h if first3 else h,
                           hidden_norm=first3)
    e.append(Entry("norm.weight", ("norm", "weight"), (h,), "copy"))
    e.append(Entry("embed_tokens.weight", ("embed_tokens", "embedding"), (v, h), "copy",
                   required=False, flag="has_embed_tokens"))
    if kind == "eagle3":
        e.append(Entry("lm_head.weight", ("lm_head", "kernel"), (vd, h), "linear"))
    else:
        e.append(Entry("lm_head.weight", ("lm_head", "kernel"), (vd, h), "linear",
                       required=False, flag="has_lm_head"))
    e.append(Entry("d2t", ("d2t",), (vd,), "int", required=False, flag="has_d2t"))
    return e

"""EAGLE-1/2 head (SafeAILab; vLLM ``llama_eagle.py``).

``z = fc(cat(embed(x_{t+1}), h_t))``, then decoder layers (layer 0 without input norm),
**no final norm**: the output feeds the target's lm_head and is the next step's hidden
input. Embedding and lm_head: the head's own when they differ from the target's, else the
target's (``share_target_weights``). A P-EAGLE ``params["mask_hidden"]`` (``H`` values,
outside the NNX body) is the parallel-drafting slots' hidden input (zeros without it).
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
from specjax.models.layers import DecoderLayer, PagedCache, linear
from specjax.models.tensors import Entry, layer_entries


#: The top-level params entry of a P-EAGLE checkpoint's parallel-drafting hidden state.
MASK_HIDDEN = "mask_hidden"


def without_mask_hidden(params: dict) -> dict:
    """``params`` without its ``mask_hidden`` entry (not part of a head's NNX body)."""
    if MASK_HIDDEN not in params:
        return params
    return {k: v for k, v in params.items() if k != MASK_HIDDEN}


def mask_hidden_values(params: dict, size: int, what: str, dtype=jnp.float32) -> jax.Array:
    """``params["mask_hidden"]`` flattened to ``[size]`` (any shape holding ``size`` values:
    ``[size]``, ``[1, size]``, ``[1, 1, size]``), zeros without it; ValueError naming
    ``what`` when the size differs."""
    mask = params.get(MASK_HIDDEN) if hasattr(params, "get") else None
    if mask is None:
        return jnp.zeros((size,), dtype)
    got = 1
    for d in mask.shape:
        got *= int(d)
    if got != size:
        raise ValueError(f'params["mask_hidden"] has shape {tuple(mask.shape)}; the head needs '
                         f"{size} values ({what})")
    return jnp.reshape(mask, (size,)).astype(dtype)


class EagleBody(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        h = cfg.hidden_size
        self.fc = linear(2 * h, h, cfg.fc_bias, rngs)
        self.layers = nnx.List([DecoderLayer(cfg, rngs, input_norm=i > 0)
                                for i in range(cfg.num_hidden_layers)])


@dataclasses.dataclass(frozen=True)
class EagleHead(PagedCache):
    config: ModelConfig
    #: every layer's attention (a hashable ``specjax.kernels.paged_attention.AttentionFn``, a
    #: stack's own kernel); None: specjax's backends
    attention: Any = None

    def __post_init__(self):
        check_attention(self.attention)

    def forward(self, params: dict, input_ids: jax.Array, positions: jax.Array,
                hidden_states: jax.Array, kv_caches: list[KVCache],
                attn_metadata: CommonAttentionMetadata):
        """``input_ids``/``positions [T] int32``, ``hidden_states [T, H]`` (target post-norm
        hidden, or this head's previous output) -> ``(out [T, H], out [T, H], kv_caches)``:
        vLLM's ``(hidden for logits, hidden for the next step)``, the same array here."""
        cfg = self.config
        body = mp.merge(EagleBody, (cfg,), without_mask_hidden(params))
        cos, sin = rope.cos_sin_for(cfg, positions, attn_metadata.query_start_loc)
        e = mp.embed(params, input_ids)
        h = body.fc(jnp.concatenate([e, hidden_states.astype(e.dtype)], axis=-1))
        caches = []
        for i, layer in enumerate(body.layers):
            h, c = layer(h, cos, sin, kv_caches[i], attn_metadata, self.attention)
            caches.append(c)
        return h, h, caches

    def parallel_drafting_hidden_state(self, params: dict, dtype=jnp.float32) -> jax.Array:
        """``[H]``: the parallel-drafting slots' hidden input, ``params["mask_hidden"]`` or
        zeros; ValueError when it does not hold ``H`` values."""
        h = self.config.hidden_size
        return mask_hidden_values(params, h, "hidden_size", dtype)

    def compute_logits(self, params: dict, hidden: jax.Array) -> jax.Array:
        """``[N, H]`` -> ``[N, V]`` float32 through the (target's) lm_head."""
        return mp.lm_head_logits(mp.need(params, "lm_head", "the target's lm_head"), hidden)



# --- canonical tensors (models/CANONICAL.md) ----------------------------------------


def tensor_table(c: ModelConfig) -> list[Entry]:
    """The canonical tensors of an EAGLE-1 head (embedding and lm_head optional)."""
    h, v = c.hidden_size, c.vocab_size
    e = [Entry("fc.weight", ("fc", "kernel"), (h, 2 * h), "linear")]
    if c.fc_bias:
        e.append(Entry("fc.bias", ("fc", "bias"), (h,), "copy"))
    for i in range(c.num_hidden_layers):
        e += layer_entries(f"layers.{i}.", ("layers", i), c, in_features=h, input_norm=i > 0)
    e.append(Entry("embed_tokens.weight", ("embed_tokens", "embedding"), (v, h), "copy",
                   required=False, flag="has_embed_tokens"))
    e.append(Entry("lm_head.weight", ("lm_head", "kernel"), (v, h), "linear",
                   required=False, flag="has_lm_head"))
    return e

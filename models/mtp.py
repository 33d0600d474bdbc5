"""MiMo MTP head (vLLM ``mimo_mtp.py``, ``MiMoMultiTokenPredictorLayer``).

One module of a MiMo checkpoint (``model.mtp_layers.0.*``). A draft row at position ``p``
with token ``t`` and incoming hidden ``h``: ``e = embed(t)`` (zero where ``p == 0``),
``x = input_proj(cat(hidden_layernorm(h), token_layernorm(e)))`` (**hidden first**, unlike
DeepSeek's MTP), a Qwen2 decoder block, ``o = final_layernorm(s)``. ``o`` feeds the
target's lm_head and is the next step's hidden input. Embedding and lm_head are always the
target's. vLLM drafts every step with module 0; ``config.n_predict`` records the
checkpoint's module count.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.attention_metadata import CommonAttentionMetadata
from specjax.kernels.paged_attention import KVCache, check_attention
from specjax.models import params as mp, rope
from specjax.models.config import ModelConfig
from specjax.models.layers import DecoderLayer, PagedCache, RMSNorm, linear
from specjax.models.tensors import Entry, layer_entries

#: The canonical names of one module's own norms and projection (no prefix).
TOKEN_NORM, HIDDEN_NORM, INPUT_PROJ, FINAL_NORM = (
    "token_layernorm", "hidden_layernorm", "input_proj", "final_layernorm")


class MTPBody(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.token_layernorm = RMSNorm(h, eps)
        self.hidden_layernorm = RMSNorm(h, eps)
        self.input_proj = linear(2 * h, h, False, rngs)
        self.layers = nnx.List([DecoderLayer(cfg, rngs, layer=i)
                                  for i in range(cfg.num_hidden_layers)])
        self.final_layernorm = RMSNorm(h, eps)


@dataclasses.dataclass(frozen=True)
class MTPHead(PagedCache):
    config: ModelConfig
    #: every layer's attention (a hashable ``specjax.kernels.paged_attention.AttentionFn``, a
    #: stack's own kernel); None: specjax's backends
    attention: Any = None

    def __post_init__(self):
        check_attention(self.attention)

    def forward(self, params: dict, input_ids: jax.Array, positions: jax.Array,
                hidden_states: jax.Array, kv_caches: list[KVCache],
                attn_metadata: CommonAttentionMetadata):
        """``input_ids``/``positions [T] int32``, ``hidden_states [T, H]`` (the target's
        final post-norm hidden, or this head's previous output) -> ``(o [T, H], o [T, H],
        kv_caches)``: vLLM's (hidden for logits, hidden for the next step), one tensor."""
        cfg = self.config
        body = mp.merge(MTPBody, (cfg,), params)
        cos, sin = rope.cos_sin_for(cfg, positions, attn_metadata.query_start_loc)
        e = mp.embed(params, input_ids)
        e = jnp.where((positions == 0)[:, None], jnp.zeros_like(e), e)
        h = hidden_states.astype(e.dtype)
        x = body.input_proj(jnp.concatenate([body.hidden_layernorm(h), body.token_layernorm(e)],
                                            axis=-1))
        caches = []
        for i, layer in enumerate(body.layers):
            x, c = layer(x, cos, sin, kv_caches[i], attn_metadata, self.attention)
            caches.append(c)
        o = body.final_layernorm(x)
        return o, o, caches

    def compute_logits(self, params: dict, hidden: jax.Array) -> jax.Array:
        """``[N, H]`` -> ``[N, V]`` float32 through the target's lm_head."""
        return mp.lm_head_logits(mp.need(params, "lm_head", "the target's lm_head"), hidden)



# --- canonical tensors (models/CANONICAL.md) ----------------------------------------


def tensor_table(c: ModelConfig) -> list[Entry]:
    """The canonical tensors of one MiMo MTP module: the checkpoint's
    ``model.mtp_layers.{i}.`` names without that prefix, the decoder block's under
    ``layers.0.``. No embedding or lm_head: both are the target's."""
    h = c.hidden_size
    e = [Entry(f"{TOKEN_NORM}.weight", (TOKEN_NORM, "weight"), (h,), "copy"),
         Entry(f"{HIDDEN_NORM}.weight", (HIDDEN_NORM, "weight"), (h,), "copy"),
         Entry(f"{INPUT_PROJ}.weight", (INPUT_PROJ, "kernel"), (h, 2 * h), "linear")]
    for i in range(c.num_hidden_layers):
        e += layer_entries(f"layers.{i}.", ("layers", i), c, in_features=h)
    e.append(Entry(f"{FINAL_NORM}.weight", (FINAL_NORM, "weight"), (h,), "copy"))
    return e

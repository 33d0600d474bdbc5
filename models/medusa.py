"""Medusa heads (FasterDecoding Medusa-1 / vLLM ``medusa.py`` layout).

Head k: ``z = h_t``; per ResBlock ``z = z + SiLU(W z + b)`` (bias optional); logits
``lm_heads[k](z)`` (or one shared ``lm_head``), times ``logit_scale``; with a
``token_map`` the truncated-vocab logits are scattered into ``-inf`` of the full vocab.
Head k proposes the token at position t + 2 + k.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.models import base
from specjax.models.config import ModelConfig
from specjax.models.layers import linear


class MedusaBlock(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.layers = nnx.List([linear(cfg.hidden_size, cfg.hidden_size, cfg.fc_bias, rngs)
                                for _ in range(cfg.num_hidden_layers)])

    def __call__(self, z: jax.Array) -> jax.Array:
        for lin in self.layers:
            z = z + jax.nn.silu(lin(z))
        return z


class MedusaBody(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.blocks = nnx.List([MedusaBlock(cfg, rngs) for _ in range(cfg.num_heads)])


@dataclasses.dataclass(frozen=True)
class MedusaHeads:
    config: ModelConfig

    def forward(self, params: dict, hidden_states: jax.Array) -> jax.Array:
        """Target post-norm ``hidden_states [T, H]`` -> ``[num_heads, T, H]``."""
        body = base.merge(MedusaBody, (self.config,), params)
        return jnp.stack([blk(hidden_states) for blk in body.blocks])

    def compute_logits(self, params: dict, hidden: jax.Array) -> jax.Array:
        """``[num_heads, N, H]`` -> ``[num_heads, N, V]`` float32."""
        c = self.config
        p = base.normalize_keys(params)
        heads = ([p["lm_head"]] * c.num_heads if "lm_head" in p
                 else [p["lm_heads"][k] for k in range(c.num_heads)])
        logits = jnp.stack([base.lm_head_logits(heads[k], hidden[k]) for k in range(c.num_heads)])
        if c.logit_scale != 1.0:
            logits = logits * c.logit_scale
        if "token_map" in p:
            logits = base.scatter_vocab(logits, p["token_map"], c.vocab_size)
        return logits

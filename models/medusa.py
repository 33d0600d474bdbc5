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

from specjax.models import params as mp
from specjax.models.config import ModelConfig
from specjax.models.layers import linear
from specjax.models.tensors import Entry


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
        body = mp.merge(MedusaBody, (self.config,), params)
        return jnp.stack([blk(hidden_states) for blk in body.blocks])

    def compute_logits(self, params: dict, hidden: jax.Array) -> jax.Array:
        """``[num_heads, N, H]`` -> ``[num_heads, N, V]`` float32."""
        c = self.config
        p = mp.normalize_keys(params)
        heads = ([p["lm_head"]] * c.num_heads if "lm_head" in p
                 else [p["lm_heads"][k] for k in range(c.num_heads)])
        logits = jnp.stack([mp.lm_head_logits(heads[k], hidden[k]) for k in range(c.num_heads)])
        if c.logit_scale != 1.0:
            logits = logits * c.logit_scale
        if "token_map" in p:
            logits = mp.scatter_vocab(logits, p["token_map"], c.vocab_size)
        return logits


# --- canonical tensors (models/CANONICAL.md) ----------------------------------------


def tensor_table(c: ModelConfig) -> list[Entry]:
    """The canonical tensors of Medusa heads (vLLM layout: ``blocks.*``, ``lm_heads.*`` or
    one ``lm_head`` with ``original_lm_head``, optional ``token_map``)."""
    h, vt = c.hidden_size, c.truncated_vocab_size or c.vocab_size
    e: list[Entry] = []
    for k in range(c.num_heads):
        for l in range(c.num_hidden_layers):
            p = ("blocks", k, "layers", l)
            e.append(Entry(f"blocks.{k}.layers.{l}.weight", p + ("kernel",), (h, h), "linear"))
            if c.fc_bias:
                e.append(Entry(f"blocks.{k}.layers.{l}.bias", p + ("bias",), (h,), "copy"))
    if c.original_lm_head:
        e.append(Entry("lm_head.weight", ("lm_head", "kernel"), (vt, h), "linear"))
    else:
        for k in range(c.num_heads):
            e.append(Entry(f"lm_heads.{k}.weight", ("lm_heads", k, "kernel"), (vt, h), "linear"))
    e.append(Entry("token_map", ("token_map",), (vt,), "int", required=False, flag="has_token_map"))
    return e

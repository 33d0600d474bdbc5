"""Llama-family decoder LM (Llama incl. llama3 RoPE scaling, Qwen2 q/k/v bias, Qwen3 q/k
norms): the target model, or a draft model of the same vocabulary.

``h_0 = embed(ids)``; layer k: ``h_{k+1} = h_k + attn(norm(h_k)); += mlp(norm(.))``;
``hidden = norm(h_L)``; ``logits = lm_head(hidden)`` (the embedding when tied). The aux
state at layer id ``k`` is ``h_k``, the *input* of layer k (vLLM's meaning).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.attention_metadata import CommonAttentionMetadata
from specjax.models import params as mp, rope
from specjax.kernels.paged_attention import KVCache, check_attention
from specjax.kernels.paged_attention.kv_cache import move_slots
from specjax.models.config import ModelConfig
from specjax.models.layers import DecoderLayer, PagedCache, RMSNorm
from specjax.models.tensors import Entry, layer_entries


class DecoderBody(nnx.Module):
    """``layers.{i}`` (``layer_class``) and the final ``norm`` (``norm_class``); embedding
    and head are handled by the runner. A family subclasses it naming its two classes."""

    layer_class: ClassVar[type] = DecoderLayer
    norm_class: ClassVar[type] = RMSNorm

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.layers = nnx.List([self.layer_class(cfg, rngs, layer=i)
                                for i in range(cfg.num_hidden_layers)])
        self.norm = self.norm_class(cfg.hidden_size, cfg.rms_norm_eps)


def check_aux_ids(aux_layer_ids, num_layers: int) -> tuple[int, ...]:
    ids = tuple(int(i) for i in (aux_layer_ids or ()))
    if any(not 0 <= i < num_layers for i in ids) or list(ids) != sorted(set(ids)):
        raise ValueError(
            f"aux_layer_ids must be strictly increasing layer ids in [0, {num_layers}) "
            f"(the input of layer k), got {ids}"
        )
    return ids


@dataclasses.dataclass(frozen=True)
class DecoderLM(PagedCache):
    """Static runner of a ``llama`` / ``qwen2`` / ``qwen3`` decoder LM (hashable).
    ``aux_layer_ids``: layers whose *input* ``forward`` also returns (empty: ``aux`` None).
    ``attention``: every layer's attention, a hashable
    ``specjax.kernels.paged_attention.AttentionFn`` (a stack's own kernel); None:
    specjax's backends (``attend``)."""

    config: ModelConfig
    aux_layer_ids: tuple[int, ...] = ()
    attention: Any = None
    #: The NNX body ``forward`` merges the params into (``layers.{i}`` and ``norm``).
    body_class: ClassVar[type] = DecoderBody

    def __post_init__(self):
        object.__setattr__(self, "aux_layer_ids",
                           check_aux_ids(self.aux_layer_ids, self.config.num_hidden_layers))
        check_attention(self.attention)

    # -- the specjax.Target protocol (specjax/target.py) ----------------------------
    recurrent = False

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    def with_aux_layers(self, ids) -> "DecoderLM":
        return dataclasses.replace(self, aux_layer_ids=tuple(ids))

    def kv_bytes_per_block(self, block_size: int, dtype) -> int:
        """K and V of every layer for one block of ``block_size`` tokens."""
        c = self.config
        return (2 * c.num_hidden_layers * block_size * c.num_key_value_heads * c.head_dim
                * jnp.dtype(dtype).itemsize)

    def shared_weights(self, params: dict) -> dict:
        """``embed_tokens`` and ``lm_head`` of ``params`` (a tied head: the embedding)."""
        emb = params.get("embed_tokens") or {}
        head = params.get("lm_head") or ({"embedding": emb["embedding"]} if emb else {})
        return {"embed_tokens": emb, "lm_head": head}

    def move_kv(self, kv_caches: list[KVCache], src_slots: jax.Array, dst_slots: jax.Array):
        return move_slots(kv_caches, src_slots, dst_slots)

    def forward(self, params: dict, input_ids: jax.Array, positions: jax.Array,
                kv_caches: list[KVCache], attn_metadata: CommonAttentionMetadata):
        """One step over a ragged batch: ``input_ids``, ``positions [T_pad] int32``, one
        ``KVCache`` per layer -> ``(hidden [T_pad, H] post-norm, aux [T_pad, n_aux, H] or
        None, kv_caches)``."""
        cfg = self.config
        body = mp.merge(self.body_class, (cfg,), params)
        cos, sin = rope.cos_sin_for(cfg, positions, attn_metadata.query_start_loc)
        h = mp.embed(params, input_ids)
        aux, caches = [], []
        for i, layer in enumerate(body.layers):
            if i in self.aux_layer_ids:
                aux.append(h)
            h, c = layer(h, cos, sin, kv_caches[i], attn_metadata, self.attention)
            caches.append(c)
        hidden = body.norm(h)
        return hidden, (jnp.stack(aux, axis=1) if aux else None), caches

    def compute_logits(self, params: dict, hidden: jax.Array) -> jax.Array:
        """``hidden [N, H]`` -> ``[N, V]`` float32 (tied: the embedding is the head)."""
        head = params.get("lm_head") or {"embedding": mp.embed_table(params)}
        return mp.lm_head_logits(head, hidden)



# --- canonical tensors (models/CANONICAL.md) ----------------------------------------


def tensor_table(c: ModelConfig, sparse_mlp=None, sparse=None) -> list[Entry]:
    """The canonical tensors of a Llama / Qwen2 / Qwen3 decoder (HF names); layer i's MLP
    entries replaced by ``sparse_mlp(prefix, path, c)`` where ``sparse(i)`` (MoE families)."""
    h, v = c.hidden_size, c.vocab_size
    e = [Entry("model.embed_tokens.weight", ("embed_tokens", "embedding"), (v, h), "copy")]
    for i in range(c.num_hidden_layers):
        pre, path = f"model.layers.{i}.", ("layers", i)
        layer = layer_entries(pre, path, c, in_features=h)
        if sparse_mlp is not None and sparse(i):
            layer = [x for x in layer if not x.key.startswith(f"{pre}mlp.")]
            layer += sparse_mlp(pre, path, c)
        e += layer
    e.append(Entry("model.norm.weight", ("norm", "weight"), (h,), "copy"))
    if c.tie_word_embeddings:
        e.append(Entry("lm_head.weight", None, (v, h), "linear", required=False))
    else:
        e.append(Entry("lm_head.weight", ("lm_head", "kernel"), (v, h), "linear"))
    return e

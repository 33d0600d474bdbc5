"""Qwen3-MoE decoder LM (``Qwen3MoeForCausalLM``): the target model, or a draft of the same
vocabulary.

Qwen3's layers (q/k norms, explicit ``head_dim``) with the MLP of layer i the sparse
:class:`~specjax.models.moe.SparseMoeBlock` when ``config.layer_sparse(i)`` (transformers'
rule: not in ``mlp_only_layers``, ``num_experts > 0``, ``(i + 1) % decoder_sparse_step ==
0``), else a dense SwiGLU of ``intermediate_size``. Aux state k is ``h_k``, as in :mod:`llama`.
"""

from __future__ import annotations

import dataclasses

from flax import nnx

from specjax.models.config import ModelConfig
from specjax.models.layers import DecoderLayer
from specjax.models.llama import DecoderBody, DecoderLM, tensor_table as llama_table
from specjax.models.moe import SparseMoeBlock
from specjax.models.tensors import Entry

__all__ = ["Qwen3MoeLM", "tensor_table"]


class Qwen3MoeLayer(DecoderLayer):
    """A Qwen3 pre-norm layer whose ``mlp`` is the sparse block on sparse layers."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, *, layer: int):
        super().__init__(cfg, rngs, layer=layer)
        if cfg.layer_sparse(layer):
            self.mlp = SparseMoeBlock(cfg.hidden_size, cfg.moe_intermediate_size,
                                      cfg.num_experts, cfg.num_experts_per_tok,
                                      cfg.norm_topk_prob, rngs)


class Qwen3MoeBody(DecoderBody):
    """``layers.{i}`` (Qwen3MoeLayer) and the final ``norm``."""

    layer_class = Qwen3MoeLayer


@dataclasses.dataclass(frozen=True)
class Qwen3MoeLM(DecoderLM):
    """Static runner of a ``qwen3_moe`` decoder LM; the :class:`DecoderLM` members with the
    MoE body."""

    body_class = Qwen3MoeBody


def expert_entries(prefix: str, path: tuple, c: ModelConfig) -> list[Entry]:
    """A sparse layer's router ``mlp.gate`` and stacked experts in transformers 5's layout
    (``gate_up_proj [E, 2I, H]``, gate rows first; ``down_proj [E, H, I]``); the converter
    stacks the Hub's per-expert tensors into it."""
    h, i, n = c.hidden_size, c.moe_intermediate_size, c.num_experts
    m = path + ("mlp",)
    return [Entry(f"{prefix}mlp.gate.weight", m + ("gate", "kernel"), (n, h), "linear"),
            Entry(f"{prefix}mlp.experts.gate_up_proj", m + ("experts", "gate_up"), (n, 2 * i, h),
                  "experts_gate_up"),
            Entry(f"{prefix}mlp.experts.down_proj", m + ("experts", "down"), (n, h, i), "experts")]


def tensor_table(c: ModelConfig) -> list[Entry]:
    """The canonical tensors of a Qwen3-MoE decoder (the Hub checkpoints' names)."""
    return llama_table(c, expert_entries, c.layer_sparse)

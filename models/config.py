"""``ModelConfig``: the static description of every model kind (frozen, hashable).

One flat dataclass for every kind, hashable so a model built from it can be a static
``jax.jit`` argument; built by :func:`specjax.models.registry.config_from_hf`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

#: Kinds with weights (the canonical checkpoint forms of models/CANONICAL.md).
KINDS = ("llama", "qwen2", "qwen3", "mistral", "ministral", "gemma3", "qwen3_moe", "gpt_oss",
         "eagle", "eagle3", "dflash", "medusa", "mtp", "dspark")

#: Kinds that are a plain decoder LM (target or draft model).
DECODER_KINDS = ("llama", "qwen2", "qwen3", "mistral", "ministral", "gemma3", "qwen3_moe",
                 "gpt_oss")

#: Attention kinds of ``layer_types`` (HF's names).
LAYER_TYPES = ("full_attention", "sliding_attention")

#: RoPE scaling types implemented (``rope_scaling.rope_type``; None means plain RoPE).
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "dynamic")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Static configuration of one model kind (field meanings: docs/models.md).

    Decoder fields carry HF names (``qkv_bias``, ``qk_norm``: Qwen2 / Qwen3); head fields
    are unused (default) outside their kind. ``rope_scaling`` is a sorted ``(key, value)``
    tuple or None; ``aux_layer_ids`` are vLLM's (the *input* of each target layer), None
    for EAGLE-3's default ``(2, L//2, L-3)``. ``has_*`` say which optional tensors the
    params hold (None: not known, treated as False). Raises ValueError for an unknown kind
    or inconsistent geometry.
    """

    kind: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int = 0
    num_hidden_layers: int = 0
    num_attention_heads: int = 0
    num_key_value_heads: int = 0
    head_dim: int = 0
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    # heads
    fc_bias: bool = False
    draft_vocab_size: int = 0
    target_hidden_size: int = 0
    norm_before_residual: bool = False
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_output: bool = False
    aux_layer_ids: tuple[int, ...] | None = None
    block_size: int = 0
    mask_token_id: int = -1
    causal: bool = False
    num_heads: int = 0
    truncated_vocab_size: int = 0
    original_lm_head: bool = False
    logit_scale: float = 1.0
    n_predict: int = 0
    # optional tensors
    has_embed_tokens: bool | None = None
    has_lm_head: bool | None = None
    has_d2t: bool | None = None
    has_token_map: bool | None = None
    # attention pattern
    sliding_window: int = 0
    layer_types: tuple[str, ...] | None = None
    attention_sinks: bool = False
    # Gemma 3 (0: unused): attention scale query_pre_attn_scalar^-0.5 (0: head_dim^-0.5),
    # sliding layers' RoPE base, logits = c * tanh(logits / c)
    query_pre_attn_scalar: float = 0.0
    rope_local_base_freq: float = 0.0
    final_logit_softcapping: float = 0.0
    #: DFlash: each layer's causality when the layers differ (None: ``causal`` for all)
    causal_layers: tuple[bool, ...] | None = None
    # Qwen3-MoE (num_experts 0: dense): layer i sparse iff ``layer_sparse(i)``
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    #: gpt-oss experts' clamped SwiGLU limit (0: unclamped)
    swiglu_limit: float = 0.0
    # DSpark (kind "dspark": a DFlash head + a rank-r Markov head, models/dspark.py)
    markov_rank: int = 0
    markov_head_type: str = "vanilla"
    enable_confidence_head: bool = False
    confidence_head_with_markov: bool = False
    sample_from_anchor: bool = True

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        for name in ("vocab_size", "hidden_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)}")
        if self.kind == "medusa":
            if self.num_heads <= 0:
                raise ValueError(f"num_heads must be a positive integer, got {self.num_heads}")
            return
        for name in ("intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        rt = self.rope_type
        if rt not in ROPE_TYPES:
            raise ValueError(f"rope_scaling.rope_type must be one of {ROPE_TYPES}, got {rt!r}")
        if rt == "longrope":
            for key in ("short_factor", "long_factor"):
                n = len(self.rope_scaling_dict.get(key) or ())
                if n != self.head_dim // 2:
                    raise ValueError(f"rope_scaling.{key} must hold head_dim/2={self.head_dim // 2} "
                                     f"numbers, got {n}")
        if self.sliding_window < 0:
            raise ValueError(f"sliding_window must be >= 0 (0: none), got {self.sliding_window}")
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_hidden_layers or any(
                    t not in LAYER_TYPES for t in self.layer_types):
                raise ValueError(f"layer_types must hold num_hidden_layers="
                                 f"{self.num_hidden_layers} entries of {LAYER_TYPES}, got "
                                 f"{self.layer_types}")
            if "sliding_attention" in self.layer_types and self.sliding_window <= 0:
                raise ValueError("layer_types has sliding_attention layers but sliding_window "
                                 f"is {self.sliding_window}")
        if self.causal_layers is not None and len(self.causal_layers) != self.num_hidden_layers:
            raise ValueError(f"causal_layers must hold num_hidden_layers={self.num_hidden_layers} "
                             f"bools, got {self.causal_layers}")
        for name in ("query_pre_attn_scalar", "rope_local_base_freq", "final_logit_softcapping",
                     "swiglu_limit"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0: unused), got {getattr(self, name)}")
        if self.kind in ("dflash", "dspark") and 0 < self.sliding_window < self.block_size and any(
                self.layer_window(i) and not self.layer_causal(i)
                for i in range(self.num_hidden_layers)):
            raise ValueError(f"sliding_window={self.sliding_window} < block_size="
                             f"{self.block_size} on a non-causal DFlash layer: vLLM's window "
                             "there is symmetric (window - 1 keys each side); specjax limits "
                             "only the left side, the same only for windows >= the block")
        if self.num_experts and not (0 < self.num_experts_per_tok <= self.num_experts
                                     and self.moe_intermediate_size > 0
                                     and self.decoder_sparse_step > 0):
            raise ValueError(f"MoE config needs 0 < num_experts_per_tok <= num_experts="
                             f"{self.num_experts}, moe_intermediate_size > 0 and "
                             f"decoder_sparse_step > 0")
        if self.kind == "dspark" and (self.markov_rank <= 0 or self.markov_head_type
                                      not in ("vanilla", "gated", "rnn")):
            raise ValueError(f"a DSpark head needs markov_rank > 0 (got {self.markov_rank}) and "
                             "markov_head_type 'vanilla', 'gated' or 'rnn' (got "
                             f"{self.markov_head_type!r})")
        if self.kind in ("eagle3", "dflash", "dspark") and self.draft_vocab_size <= 0:
            raise ValueError(f"draft_vocab_size must be positive, got {self.draft_vocab_size}")

    # -- derived -------------------------------------------------------------------

    @property
    def rope_scaling_dict(self) -> dict[str, Any] | None:
        return None if self.rope_scaling is None else dict(self.rope_scaling)

    @property
    def rope_type(self) -> str:
        d = self.rope_scaling_dict
        if not d:
            return "default"
        return str(d.get("rope_type", d.get("type", "default")))

    def layer_window(self, layer: int) -> int | None:
        """Layer ``layer``'s sliding window in keys (HF: the query and ``window - 1`` keys
        before it), or None for full attention: ``layer_types`` when given, else every
        layer when ``sliding_window`` is set (Mistral)."""
        if self.sliding_window <= 0:
            return None
        if self.layer_types is not None and self.layer_types[layer] != "sliding_attention":
            return None
        return self.sliding_window

    def layer_sparse(self, layer: int) -> bool:
        """Whether layer ``layer``'s MLP is the sparse MoE block (transformers' rule)."""
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    def layer_causal(self, layer: int) -> bool:
        """Whether layer ``layer`` attends causally (``causal_layers``, else ``causal``)."""
        return self.causal if self.causal_layers is None else bool(self.causal_layers[layer])

    @property
    def num_aux(self) -> int:
        """Number of target hidden states concatenated into ``fc`` (EAGLE-3, DFlash)."""
        return 3 if self.aux_layer_ids is None else len(self.aux_layer_ids)

    @property
    def reduced_vocab(self) -> bool:
        return self.draft_vocab_size not in (0, self.vocab_size)

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)


def eagle3_default_aux_layer_ids(num_target_layers: int) -> tuple[int, int, int]:
    """vLLM's default EAGLE-3 aux layers ``(2, L//2, L-3)`` (inputs of those layers)."""
    n = int(num_target_layers)
    return (2, n // 2, n - 3)

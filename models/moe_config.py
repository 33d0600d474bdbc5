"""Qwen3-MoE config keys (transformers ``Qwen3MoeConfig``) <-> ``ModelConfig`` fields, as
``hf_config`` reads and writes them; structure specjax does not run is refused by name."""

from __future__ import annotations

from typing import Any, Mapping

from specjax.checks import ArgumentError, ArgumentTypeError, check_int, show
from specjax.models.config import ModelConfig

#: Keys of MoE structure other than Qwen3-MoE's (shared experts, grouped routing...):
#: refused when set to anything but their neutral value.
_REFUSED = {"shared_expert_intermediate_size": (0, None), "n_shared_experts": (0, None),
            "num_shared_experts": (0, None), "n_group": (1, None), "topk_group": (1, None),
            "first_k_dense_replace": (0, None), "routed_scaling_factor": (1, 1.0, None),
            "scoring_func": ("softmax", None), "topk_method": ("greedy", None)}


def moe_fields(hf: Mapping, n_layers: int) -> dict[str, Any]:
    """The MoE ``ModelConfig`` fields of a ``qwen3_moe`` config (``num_local_experts``
    aliases ``num_experts``; ``router_aux_loss_coef`` is training-only, ignored).
    Raises naming the key: a refused structure key, a bad value."""
    for key, neutral in _REFUSED.items():
        if hf.get(key) not in neutral:
            raise ArgumentError(f"config {key}={show(hf.get(key))} is not supported (specjax "
                                "runs Qwen3-MoE's routed experts only)")
    e = hf.get("num_experts", hf.get("num_local_experts", 0))
    e = check_int("config num_experts", e, 0, 1 << 16)
    mlp_only = hf.get("mlp_only_layers") or []
    if not isinstance(mlp_only, (list, tuple)):
        raise ArgumentTypeError(f"config mlp_only_layers must be a list, got {show(mlp_only)}")
    norm = hf.get("norm_topk_prob", False)
    if not isinstance(norm, bool):
        raise ArgumentTypeError(f"config norm_topk_prob must be true or false, got {show(norm)}")
    return dict(
        num_experts=e,
        num_experts_per_tok=check_int("config num_experts_per_tok",
                                      hf.get("num_experts_per_tok", 0), 0, max(e, 1)),
        moe_intermediate_size=check_int("config moe_intermediate_size",
                                        hf.get("moe_intermediate_size", 0), 0, 1 << 20),
        norm_topk_prob=norm,
        decoder_sparse_step=check_int("config decoder_sparse_step",
                                      hf.get("decoder_sparse_step", 1), 1, 1 << 16),
        mlp_only_layers=tuple(sorted({check_int("config mlp_only_layers[]", i, 0, n_layers - 1)
                                      for i in mlp_only})),
    )


def moe_dict(c: ModelConfig) -> dict[str, Any]:
    """The inverse of :func:`moe_fields` (``config.json`` keys)."""
    return dict(num_experts=c.num_experts, num_experts_per_tok=c.num_experts_per_tok,
                moe_intermediate_size=c.moe_intermediate_size, norm_topk_prob=c.norm_topk_prob,
                decoder_sparse_step=c.decoder_sparse_step, mlp_only_layers=list(c.mlp_only_layers))

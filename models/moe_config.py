"""Qwen3-MoE and gpt-oss config keys (transformers ``Qwen3MoeConfig``, ``GptOssConfig``) <->
``ModelConfig`` fields, as ``hf_config`` reads and writes them; structure specjax does not
run is refused by name."""

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


#: transformers v5 ``GptOssConfig`` class defaults for keys a ``gpt_oss`` config may omit.
GPT_OSS_DEFAULTS = dict(vocab_size=201088, hidden_size=2880, intermediate_size=2880,
                        num_hidden_layers=36, num_attention_heads=64, num_key_value_heads=8,
                        head_dim=64, num_local_experts=128, num_experts_per_tok=4,
                        sliding_window=128, max_position_embeddings=131072, rms_norm_eps=1e-5,
                        tie_word_embeddings=False, attention_bias=True)
#: The expert activation's limit and slope, fixed in transformers' ``GptOssExperts`` and
#: vLLM's ``swigluoai``: a config asking for others is refused.
SWIGLU_LIMIT, SWIGLU_ALPHA = 7.0, 1.702


def gpt_oss_fields(hf: Mapping) -> tuple[dict, dict[str, Any]]:
    """A ``gpt_oss`` config -> ``(hf with GptOssConfig's defaults, MoE fields)``: every
    layer sparse, ``intermediate_size`` the expert width, sinks on, layer i sliding iff i is
    even when ``layer_types`` is absent. Raises naming the key (see :func:`moe_fields`)."""
    hf = dict(hf)
    if hf.get("num_experts") is not None:                   # GptOssConfig's attribute_map
        hf.setdefault("num_local_experts", hf["num_experts"])
    for k, v in GPT_OSS_DEFAULTS.items():
        hf.setdefault(k, v)
    for key, neutral in dict(_REFUSED, mlp_only_layers=(None, [], ()),
                             decoder_sparse_step=(None, 1)).items():
        if hf.get(key) not in neutral:
            raise ArgumentError(f"config {key}={show(hf.get(key))} is not supported (gpt-oss: "
                                "routed experts with a biased top-k router on every layer)")
    for a, b in (("num_experts_per_tok", "experts_per_token"), ("num_local_experts", "num_experts"),
                 ("intermediate_size", "moe_intermediate_size")):
        if hf.get(b) is not None and hf[b] != hf[a]:
            raise ArgumentError(f"config {b}={show(hf[b])} differs from {a}={show(hf[a])} "
                                f"(transformers reads {a})")
    for key, fixed in (("swiglu_limit", SWIGLU_LIMIT), ("swiglu_alpha", SWIGLU_ALPHA)):
        if hf.get(key) is not None and hf[key] != fixed:
            raise ArgumentError(f"config {key}={show(hf[key])} is not supported: transformers "
                                f"and vLLM fix it at {fixed}")
    if hf.get("layer_types") is None:
        n = check_int("config num_hidden_layers", hf["num_hidden_layers"], 1, 1 << 16)
        hf["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention"
                             for i in range(n)]
    e = check_int("config num_local_experts", hf["num_local_experts"], 1, 1 << 16)
    return hf, dict(
        num_experts=e,
        num_experts_per_tok=check_int("config num_experts_per_tok", hf["num_experts_per_tok"],
                                      1, e),
        moe_intermediate_size=check_int("config intermediate_size", hf["intermediate_size"],
                                        1, 1 << 20),
        swiglu_limit=SWIGLU_LIMIT, attention_sinks=True)


def gpt_oss_dict(c: ModelConfig) -> dict[str, Any]:
    """The inverse of :func:`gpt_oss_fields` (``config.json`` keys, GptOssConfig's names)."""
    d = dict(num_local_experts=c.num_experts, num_experts_per_tok=c.num_experts_per_tok,
             swiglu_limit=c.swiglu_limit, sliding_window=c.sliding_window or None,
             layer_types=list(c.layer_types or ["full_attention"] * c.num_hidden_layers))
    if c.rope_scaling is None:                   # absent: GptOssConfig's YaRN
        d["rope_scaling"] = {"rope_type": "default"}
    return d

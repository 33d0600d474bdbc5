"""HF gpt-oss (``GptOssForCausalLM``): read the Hub's MXFP4 experts (dequantized to bf16,
one layer's tensor at a time) or a bf16 checkpoint; write the bf16 layout."""

from __future__ import annotations

import re

from specjax.converters import mxfp4
from specjax.converters.errors import CheckpointError, clip, listing
from specjax.converters.format_common import (
    Format,
    Probe,
    Tensors,
    _decoder_fields,
    _drop_inv_freq,
    _drop_tied_head,
    _hf_fields,
)

_ARCH = "GptOssForCausalLM"
_PACKED = re.compile(r"(.*)_(blocks|scales)")
_EXPERTS = re.compile(r"model\.layers\.\d+\.mlp\.experts\.(gate_up_proj|down_proj)")


def detect(p: Probe) -> bool:
    # a gpt_oss model_type alone may also be an EAGLE-3 head's (GptOssForCausalLMEagle3)
    return _ARCH in p.archs or (p.config.get("model_type") == "gpt_oss"
                                and not any("Eagle" in a for a in p.archs))


def _quantization(cfg: dict, notes: list[str]) -> None:
    # pipeline.check_not_quantized let only mxfp4 through; the tensors decide the rest
    q = cfg.pop("quantization_config", None)
    if q is None:
        return
    method = q.get("quant_method") if isinstance(q, dict) else q
    if method != "mxfp4" or not isinstance(q, dict):
        raise CheckpointError(f"config.json: quantization_config.quant_method="
                              f"{clip(method, 40)!r}: gpt-oss is read unquantized or MXFP4")
    keep = q.get("modules_to_not_convert")
    if keep is not None and not (isinstance(keep, list) and all(isinstance(m, str) for m in keep)):
        raise CheckpointError("config.json: quantization_config.modules_to_not_convert must "
                              f"be a list of module names, got {clip(repr(keep), 60)}")
    notes.append("quantization_config mxfp4: the MXFP4 experts are dequantized to bf16 "
                 "(exact, as transformers' Mxfp4Config(dequantize=True)); config dropped")


def _dequantize(tensors: Tensors, notes: list[str]) -> Tensors:
    # mlp.experts.{gate_up,down}_proj_{blocks,scales} pairs -> the lazily dequantized
    # canonical tensors; a half pair, packed tensors elsewhere or twice-stored experts raise
    pairs: dict[str, dict] = {}
    out: Tensors = {}
    for k, v in tensors.items():
        m = _PACKED.fullmatch(k)
        if m:
            pairs.setdefault(m[1], {})[m[2]] = v
        else:
            out[k] = v
    for base, p in sorted(pairs.items()):
        if not _EXPERTS.fullmatch(base):
            raise CheckpointError(f"{base}_{next(iter(p))}: an MXFP4 tensor outside the "
                                  "experts; specjax dequantizes mlp.experts.* only")
        if len(p) != 2:
            have, lack = ("blocks", "scales") if "blocks" in p else ("scales", "blocks")
            raise CheckpointError(f"{base}_{have}: MXFP4 without {base}_{lack}")
        if base in out:
            raise CheckpointError(f"{base}: stored both dequantized and as MXFP4 "
                                  f"({base}_blocks)")
        out[base] = mxfp4.experts_ref(p["blocks"], p["scales"], base)
    if pairs:
        notes.append(f"dequantized {len(pairs)} MXFP4 expert tensors (*_blocks + *_scales) "
                     "to bf16, one at a time")
    return out


def read(cfg: dict, tensors: Tensors, notes: list[str]) -> tuple[dict, Tensors]:
    """GptOssConfig's defaults for omitted keys (RoPE: θ 150000, YaRN x32); the MoE keys
    are read by ``config_from_hf("gpt_oss")``."""
    from specjax.models import hf_config, moe_config  # noqa: PLC0415 (imports jax)

    cfg = dict(cfg)
    _quantization(cfg, notes)
    for a, b in (("num_experts_per_tok", "experts_per_token"),
                 ("num_local_experts", "num_experts")):
        if cfg.get(a) is None and cfg.get(b) is not None:
            cfg[a] = cfg[b]
    omitted = [k for k in moe_config.GPT_OSS_DEFAULTS if cfg.get(k) is None]
    params = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else {}
    if cfg.get("rope_theta") is None and params.get("rope_theta") is None:
        cfg["rope_theta"] = 150000.0
        omitted.append("rope_theta")
    if cfg.get("rope_scaling") is None and not params.get("rope_type"):
        cfg["rope_scaling"] = dict(hf_config.GPT_OSS_ROPE)
        omitted.append("rope_scaling (YaRN x32)")
    cfg.update({k: v for k, v in moe_config.GPT_OSS_DEFAULTS.items() if cfg.get(k) is None})
    if omitted:
        notes.append(f"GptOssConfig defaults for {listing(omitted)}")
    cfg = _decoder_fields(cfg, notes)
    cfg["model_type"] = "gpt_oss"
    tensors = _dequantize(_drop_inv_freq(tensors, notes), notes)
    tensors = _drop_tied_head(cfg, tensors, notes)
    return cfg, tensors


def write(c, t, torch_dtype):
    """``GptOssForCausalLM`` config.json (no quantization_config) and the bf16 layout, the
    keys of transformers' state dict."""
    from specjax.models.moe_config import gpt_oss_dict  # noqa: PLC0415

    layer_types = list(c.layer_types or [
        "sliding_attention" if c.layer_window(i) else "full_attention"
        for i in range(c.num_hidden_layers)])
    cfg = {"architectures": [_ARCH], "model_type": "gpt_oss", **_hf_fields(c), **gpt_oss_dict(c),
           "intermediate_size": c.moe_intermediate_size,
           "experts_per_token": c.num_experts_per_tok, "layer_types": layer_types,
           "attention_bias": True, "router_aux_loss_coef": 0.9, "output_router_logits": False,
           "tie_word_embeddings": c.tie_word_embeddings, "torch_dtype": torch_dtype}
    return cfg, {"model.safetensors": t}


FORMATS = (
    Format("gpt_oss", "gpt_oss", "HF GptOssForCausalLM (model.* keys; MXFP4 experts "
           "dequantized to bf16, or bf16)", detect, read, write),
)

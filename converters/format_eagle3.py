"""EAGLE-3, SafeAILab and speculators (vLLM ``llama_eagle3.py``): read and write."""

from __future__ import annotations

import warnings

from specjax.converters.errors import CheckpointError
from specjax.converters.format_common import (
    _HF_ARCH,
    Format,
    Probe,
    Tensors,
    _decoder_fields,
    _drop,
    _drop_inv_freq,
    _flatten_speculators,
    _hf_fields,
    _PARALLEL_TOKEN_FIELDS,
    _int32_map,
    _rename_prefixes,
    _speculators_config,
    _strip_prefix,
    _with_t2d,
)
from specjax.converters import format_dflash, format_medusa


def _eagle3_fields(cfg: dict, flat: dict, notes: list[str], *, speculators: bool = False) -> dict:
    # ``cfg`` is config.json as found (flat for SafeAILab, the outer speculators config).
    flat["draft_vocab_size"] = cfg.get("draft_vocab_size") or flat["vocab_size"]
    flat["target_hidden_size"] = cfg.get("target_hidden_size") or flat["hidden_size"]
    # vLLM v0.20: the model code defaults it to False, the speculators eagle3 config updater
    # (transformers_utils/configs/speculators/algos.py, update_eagle3) to True.
    default = speculators
    if "norm_before_residual" not in cfg:
        notes.append(f"norm_before_residual absent; using {default} (vLLM v0.20's default for "
                     f"{'a speculators' if speculators else 'a SafeAILab'} config)")
    flat["norm_before_residual"] = bool(cfg.get("norm_before_residual", default))
    _aux_layer_ids(cfg, flat, notes)
    # speculators: the outer config holds them; truncated_vocab_size is checked by
    # config_from_hf against draft_vocab_size
    for f in _PARALLEL_TOKEN_FIELDS[1:] + ("truncated_vocab_size",):
        if cfg.get(f) is not None and flat.get(f) is None:
            flat[f] = cfg[f]
    if speculators:     # vLLM 0.33+'s speculators updater copies these norm options
        for f in ("norm_before_fc", "fc_norm", "norm_output"):
            if cfg.get(f) is not None:
                flat[f] = cfg[f]
    return flat


def _aux_layer_ids(cfg: dict, flat: dict, notes: list[str]) -> None:
    """Store the aux layers as input-of-layer ids (top level): the nested
    ``eagle_config`` list (SpecForge / ModelOpt: output of layer i) becomes ``i + 1``, with
    a warning where vLLM 0.34 would tap differently (docs/vllm_config.md, "Aux-layer ids")."""
    from specjax.models import hf_config  # noqa: PLC0415 (specjax.models imports jax)

    try:
        ids, warning = hf_config.eagle3_aux_layer_ids(cfg)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"config: {e}") from None
    flat["eagle_aux_hidden_state_layer_ids"] = list(ids) if ids is not None else None
    if warning is not None:
        notes.append(warning)
        warnings.warn(warning, stacklevel=3)


def _eagle3_tensors(tensors: Tensors, notes: list[str]) -> Tensors:
    tensors = _drop_inv_freq(_strip_prefix(tensors, "model.", notes), notes)
    tensors = _rename_prefixes(tensors, {"midlayer.": "layers.0."}, notes)
    tensors = _drop(tensors, lambda k: k == "t2d", "vLLM ignores it; d2t carries the map",
                    notes)
    tensors = _drop(tensors, lambda k: k.startswith(("verifier_lm_head.", "verifier_norm.")),
                    "verifier weights, reloaded from the target", notes)
    _int32_map(tensors, "d2t", notes)
    return tensors


def _refuse_unsupported_heads(cfg: dict) -> None:
    """Published EAGLE-3 heads whose draft layer specjax does not implement, refused by
    name (docs/heads.md): a MoE draft layer and an MLA draft layer."""
    archs = [str(a) for a in cfg.get("architectures") or ()]
    if "GptOssForCausalLMEagle3" in archs or any(
            cfg.get(k) for k in ("num_local_experts", "num_experts", "experts_per_token")):
        raise CheckpointError(
            f"config: architectures={archs} with num_local_experts="
            f"{cfg.get('num_local_experts', cfg.get('num_experts'))}: an EAGLE-3 head with a "
            "MoE draft layer (SpecForge gpt-oss-20B-eagle3 / -moe) is not supported by "
            "specjax (MoE layers are not implemented; vLLM 0.34 does not register it either)")
    if any("Deepseek" in a for a in archs) or cfg.get("kv_lora_rank") is not None:
        raise CheckpointError(
            f"config: architectures={archs}: an EAGLE-3 head with an MLA draft layer "
            "(Eagle3DeepseekV2/V3ForCausalLM; kv_lora_rank, q_lora_rank) is not supported by "
            "specjax (MLA attention is not implemented)")


def _gpt_oss_rope(cfg: dict, notes: list[str]) -> dict:
    """A ``model_type: gpt_oss`` head without RoPE keys (SpecForge gpt-oss-20B-eagle3-dense)
    gets transformers v5's GptOssConfig defaults, theta 150000 with YaRN x32, as vLLM 0.34
    runs it (``hf_config.GPT_OSS_ROPE``); refused by name where specjax lacks them."""
    rope_keys = ("rope_theta", "rope_scaling", "rope_parameters")
    if cfg.get("model_type") != "gpt_oss" or any(cfg.get(k) is not None for k in rope_keys):
        return cfg
    from specjax.models import hf_config  # noqa: PLC0415 (specjax.models imports jax)

    rope = getattr(hf_config, "GPT_OSS_ROPE", None)
    if rope is None:
        raise CheckpointError(
            "config: model_type='gpt_oss' without rope_theta / rope_scaling / rope_parameters "
            "is refused: transformers v5 (vLLM 0.34) fills GptOssConfig's defaults, theta "
            "150000 with YaRN x32, which specjax does not implement")
    msg = ("model_type 'gpt_oss' without RoPE keys: transformers v5 GptOssConfig defaults "
           "(rope_theta 150000, YaRN x32), as vLLM 0.34 runs the head; whether its trainer "
           "used them is unconfirmed (add the RoPE keys to the config to choose)")
    notes.append(msg)
    warnings.warn(msg, stacklevel=3)
    return {**cfg, "rope_theta": 150000.0, "rope_scaling": dict(rope)}


def read(cfg: dict, tensors: Tensors, notes: list[str]):
    _refuse_unsupported_heads(cfg)
    cfg = _gpt_oss_rope(cfg, notes)
    flat = _decoder_fields(cfg, notes)
    return _eagle3_fields(cfg, flat, notes), _eagle3_tensors(tensors, notes)


def read_speculators(cfg: dict, tensors: Tensors, notes: list[str]):
    _refuse_unsupported_heads({**(cfg.get("transformer_layer_config") or {}), **cfg})
    flat = _decoder_fields(_gpt_oss_rope(_flatten_speculators(cfg, "config"), notes), notes,
                           where="config.transformer_layer_config")
    return _eagle3_fields(cfg, flat, notes, speculators=True), _eagle3_tensors(tensors, notes)


def _eagle3_common(c) -> dict:
    return {"draft_vocab_size": c.draft_vocab_size,
            "norm_before_residual": c.norm_before_residual,
            "fc_norm": c.fc_norm, "norm_output": c.norm_output}


def write(c, t, torch_dtype):
    if c.num_hidden_layers != 1:
        raise ValueError(f"format 'eagle3' (SafeAILab) has exactly one decoder layer "
                         f"(midlayer); config has num_hidden_layers={c.num_hidden_layers} "
                         "(use format 'eagle3-speculators')")
    if c.qk_norm:
        raise ValueError("format 'eagle3' (SafeAILab) has Llama layers without q/k norms; "
                         "config has qk_norm=True (use format 'eagle3-speculators')")
    # head_dim only where it differs from H / nH (SpecForge's explicit key; vLLM reads it,
    # SafeAILab's own code assumes H / nH), so a round trip keeps it.
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
           **_hf_fields(c, head_dim=c.head_dim * c.num_attention_heads != c.hidden_size,
                        rope_type_key=True), **_eagle3_common(c),
           "norm_before_fc": c.norm_before_fc, "tie_word_embeddings": False,
           "torch_dtype": torch_dtype}
    if c.qkv_bias:
        cfg["qkv_bias"] = True
    if c.target_hidden_size and c.target_hidden_size != c.hidden_size:
        cfg["target_hidden_size"] = c.target_hidden_size
    if c.aux_layer_ids is not None:
        # Not a SafeAILab field: vLLM reads the aux layers (input of layer k) from it.
        cfg["eagle_aux_hidden_state_layer_ids"] = list(c.aux_layer_ids)
    t = {("midlayer." + k[len("layers.0."):] if k.startswith("layers.0.") else k): v
         for k, v in t.items()}
    return cfg, {"model.safetensors": _with_t2d(t, c)}


def write_speculators(c, t, torch_dtype):
    mt = "qwen3" if c.qk_norm else "llama"
    tlc = {"model_type": mt, **_hf_fields(c), "attention_bias": c.qkv_bias,
           "tie_word_embeddings": False}
    if mt == "llama":
        tlc.update(mlp_bias=c.mlp_bias, pretraining_tp=1)
    ths = c.target_hidden_size
    cfg = {"architectures": ["Eagle3DraftModel"], "speculators_model_type": "eagle3",
           **_eagle3_common(c),
           "target_hidden_size": ths if ths and ths != c.hidden_size else None,
           "eagle_aux_hidden_state_layer_ids": (list(c.aux_layer_ids)
                                                if c.aux_layer_ids is not None else None),
           "embed_requires_grad": False, "norm_before_fc": c.norm_before_fc,
           "tie_word_embeddings": False,
           "dtype": torch_dtype,
           "speculators_config": _speculators_config("eagle3", 3, _HF_ARCH[mt]),
           "transformer_layer_config": tlc}
    return cfg, {"model.safetensors": _with_t2d(dict(t), c)}


def detect(p: Probe) -> bool:
    """SafeAILab EAGLE-3: ``midlayer.*`` keys (no DFlash ``hidden_norm``), or an ``fc`` with
    a sign of EAGLE-3 (draft vocabulary, ``d2t``, ``hidden_norm``, an Eagle3 architecture)."""
    if any(k.startswith("midlayer.") for k in p.keys) and "hidden_norm.weight" not in p.keys:
        return True
    return ("fc.weight" in p.keys
            and (p.config.get("draft_vocab_size") is not None or "d2t" in p.keys
                 or "layers.0.hidden_norm.weight" in p.keys
                 or any("Eagle3" in a for a in p.archs))
            and not format_dflash.detect(p) and not format_medusa.detect(p)
            and not format_medusa.detect_vllm(p))


def detect_speculators(p: Probe) -> bool:
    return p.spec_type == "eagle3"


FORMATS = (
    Format("eagle3", "eagle3", "EAGLE-3, SafeAILab (fc [H,3Ht], midlayer.*, d2t)", detect,
           read, write),
    Format("eagle3-speculators", "eagle3",
           "EAGLE-3, speculators (layers.0.*, transformer_layer_config)", detect_speculators,
           read_speculators, write_speculators),
)

"""EAGLE-3, SafeAILab and speculators (vLLM ``llama_eagle3.py``): read and write."""

from __future__ import annotations

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
    _reject_true,
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
    ids = cfg.get("eagle_aux_hidden_state_layer_ids")
    flat["eagle_aux_hidden_state_layer_ids"] = list(ids) if ids is not None else None
    for f in _PARALLEL_TOKEN_FIELDS[1:]:    # speculators: the outer config holds them
        if cfg.get(f) is not None and flat.get(f) is None:
            flat[f] = cfg[f]
    if speculators:     # vLLM v0.33's speculators updater copies these two norm options
        for f in ("fc_norm", "norm_output"):
            if cfg.get(f) is not None:
                flat[f] = cfg[f]
    return flat


def _eagle3_tensors(tensors: Tensors, notes: list[str]) -> Tensors:
    tensors = _drop_inv_freq(_strip_prefix(tensors, "model.", notes), notes)
    tensors = _rename_prefixes(tensors, {"midlayer.": "layers.0."}, notes)
    tensors = _drop(tensors, lambda k: k == "t2d", "vLLM ignores it; d2t carries the map",
                    notes)
    tensors = _drop(tensors, lambda k: k.startswith(("verifier_lm_head.", "verifier_norm.")),
                    "verifier weights, reloaded from the target", notes)
    _int32_map(tensors, "d2t", notes)
    return tensors


def read(cfg: dict, tensors: Tensors, notes: list[str]):
    flat = _decoder_fields(cfg, notes)
    return _eagle3_fields(cfg, flat, notes), _eagle3_tensors(tensors, notes)


def read_speculators(cfg: dict, tensors: Tensors, notes: list[str]):
    _reject_true(cfg, ("norm_before_fc",), "config",
                 " in a speculators config: vLLM's speculators loader drops the key and skips "
                 "input_norm.weight, running the head without the norm its weights expect")
    flat = _decoder_fields(_flatten_speculators(cfg, "config"), notes,
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
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
           **_hf_fields(c, head_dim=False, rope_type_key=True), **_eagle3_common(c),
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
    if c.norm_before_fc:
        raise ValueError("format 'eagle3-speculators' cannot carry norm_before_fc=True (vLLM's "
                         "speculators loader drops it and skips input_norm.weight); use format "
                         "'eagle3'")
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
           "embed_requires_grad": False, "norm_before_fc": False, "tie_word_embeddings": False,
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

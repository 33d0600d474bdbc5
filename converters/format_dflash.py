"""DFlash, z-lab and speculators (vLLM ``qwen3_dflash.py``): read and write."""

from __future__ import annotations

from specjax.converters.errors import CheckpointError
from specjax.converters.format_common import (
    Format,
    Probe,
    Tensors,
    _decoder_fields,
    _drop,
    _drop_inv_freq,
    _flatten_speculators,
    _hf_fields,
    _int32_map,
    _reject_true,
    _rename_prefixes,
    _speculators_config,
    _strip_prefix,
    _with_t2d,
)


def zlab_default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """z-lab's default ``target_layer_ids`` (z-lab meaning: output of layer id)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [int(round(start + i * (end - start) / (num_draft_layers - 1)))
            for i in range(num_draft_layers)]


#: ``dflash_config`` keys of a layer's attention, resolved by ``config_from_hf``.
_ATTN_KEYS = ("use_swa", "swa_window_size", "causal", "attention_sink_bias",
              "attention_value_scale")
_SINK, _CANON_SINK = ".self_attn.attention_sink_bias", ".self_attn.sinks"


def _dflash_common(flat: dict, where: str) -> None:
    if flat.get("target_hidden_size") is None:
        flat["target_hidden_size"] = flat["hidden_size"]
    if flat.get("draft_vocab_size") is None:
        flat["draft_vocab_size"] = flat["vocab_size"]


def _dflash_tensors(tensors: Tensors, notes: list[str]) -> Tensors:
    tensors = _drop_inv_freq(_strip_prefix(tensors, "model.", notes), notes)
    # vLLM's qwen3_dflash weight mapper.
    tensors = _rename_prefixes(tensors, {"midlayer.": "layers.0.", "encoder.fc.": "fc.",
                                         "encoder.output_norm_enc.": "hidden_norm."}, notes)
    tensors = _drop(tensors, lambda k: k == "t2d", "vLLM ignores it; d2t carries the map",
                    notes)
    tensors = _drop(tensors, lambda k: k.startswith(("verifier_lm_head.", "verifier_norm.")),
                    "verifier weights, reloaded from the target", notes)
    _int32_map(tensors, "d2t", notes)
    if any(k.endswith(_SINK) for k in tensors):
        notes.append("renamed self_attn.attention_sink_bias to self_attn.sinks")
        tensors = {(k[:-len(_SINK)] + _CANON_SINK if k.endswith(_SINK) else k): v
                   for k, v in tensors.items()}
    return tensors


def _sink_names(t: dict) -> dict:
    """Canonical ``self_attn.sinks`` back to DFlash's ``self_attn.attention_sink_bias``."""
    return {(k[:-len(_CANON_SINK)] + _SINK if k.endswith(_CANON_SINK) else k): v
            for k, v in t.items()}


#: Keys of DFlash2 and DSpark heads (docs/heads.md): refused by name.
_DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
_DSPARK_KEYS = ("markov_rank", "markov_head_type", "enable_confidence_head", "num_anchors")


def _refuse_variants(cfg: dict) -> None:
    archs = [str(a) for a in cfg.get("architectures") or ()]
    dcfg = cfg.get("dflash_config") if isinstance(cfg.get("dflash_config"), dict) else {}
    scfg = cfg.get("dspark_config") if isinstance(cfg.get("dspark_config"), dict) else {}
    if "DFlash2DraftModel" in archs or any(k in dcfg for k in _DFLASH2_KEYS):
        raise CheckpointError(f"config: architectures={archs}: a DFlash2 head (dflash_config "
                              f"{', '.join(k for k in _DFLASH2_KEYS if k in dcfg) or 'keys'}: "
                              "convolution and selector) is not supported by specjax")
    found = [k for k in _DSPARK_KEYS if k in cfg or k in dcfg or k in scfg]
    if found or any("DSpark" in a for a in archs):
        raise CheckpointError(f"config: architectures={archs}: a DSpark head ({', '.join(found)}"
                              ": Markov and confidence heads), not DFlash: convert it with "
                              "--format dspark")


def read(cfg: dict, tensors: Tensors, notes: list[str]):
    _refuse_variants(cfg)
    flat = _decoder_fields(cfg, notes)
    dcfg = cfg.get("dflash_config") or {}
    if dcfg.get("use_aux_hidden_state") is False:
        raise CheckpointError("config.dflash_config: use_aux_hidden_state=false is not "
                              "supported")
    block_size = cfg.get("block_size") or dcfg.get("block_size")
    if not isinstance(block_size, int):
        raise CheckpointError("config: no block_size (looked at the top level and in "
                              "dflash_config)")
    mask = dcfg.get("mask_token_id", cfg.get("mask_token_id"))
    if not isinstance(mask, int):
        raise CheckpointError("config: dflash_config.mask_token_id is missing")
    ids = dcfg.get("target_layer_ids", cfg.get("target_layer_ids"))
    if ids is None:
        L = cfg.get("num_target_layers")
        if not isinstance(L, int):
            raise CheckpointError("config: neither dflash_config.target_layer_ids nor "
                                  "num_target_layers is set")
        ids = zlab_default_target_layer_ids(L, flat["num_hidden_layers"])
        notes.append(f"target_layer_ids absent; z-lab default for {L} target layers: {ids}")
    aux = [int(i) + 1 for i in ids]
    notes.append(f"aux layer ids: z-lab target_layer_ids {list(ids)} + 1 -> {aux} "
                 "(input of layer k, vLLM's meaning)")
    for k in ("dflash_config", "auto_map", "causal", "sliding_window_non_causal"):
        if flat.pop(k, None) is not None and k not in ("dflash_config", "auto_map"):
            notes.append(f"config: {k} ignored (vLLM does not read it in a z-lab DFlash config)")
    flat.update(block_size=block_size, mask_token_id=mask, aux_hidden_state_layer_ids=aux,
                dflash_config={k: dcfg[k] for k in _ATTN_KEYS if k in dcfg})
    _dflash_common(flat, "config")
    return flat, _dflash_tensors(tensors, notes)


def _swnc(cfg: dict) -> bool:
    v = cfg.get("sliding_window_non_causal", True)
    if not isinstance(v, bool):
        raise CheckpointError(f"config: sliding_window_non_causal must be true or false, got {v!r}")
    return v


def read_speculators(cfg: dict, tensors: Tensors, notes: list[str]):
    where = "config.transformer_layer_config"
    flat = _decoder_fields(_flatten_speculators(cfg, "config"), notes, where=where)
    _reject_true(cfg, ("sample_from_anchor",), "config")
    aux = cfg.get("aux_hidden_state_layer_ids")
    mask = cfg.get("mask_token_id")
    block_size = cfg.get("block_size")
    for field, v in (("aux_hidden_state_layer_ids", aux), ("mask_token_id", mask),
                     ("block_size", block_size)):
        if v is None:
            raise CheckpointError(f"config: {field} is missing")
    flat.update(block_size=int(block_size), mask_token_id=int(mask),
                aux_hidden_state_layer_ids=[int(i) for i in aux],
                draft_vocab_size=cfg.get("draft_vocab_size"),
                target_hidden_size=cfg.get("target_hidden_size"),
                # vLLM's speculators reader: dflash_config.causal = not this (default true)
                dflash_config={"causal": not _swnc(cfg)})
    _dflash_common(flat, where)
    return flat, _dflash_tensors(tensors, notes)


def _dflash_decoder(c) -> dict:
    """Qwen3Config fields; sliding layers in ``layer_types`` with ``use_sliding_window``
    (transformers drops ``sliding_window`` without it)."""
    win = c.sliding_window
    return {"model_type": "qwen3", **_hf_fields(c), "attention_bias": c.qkv_bias,
            "layer_types": ["sliding_attention" if c.layer_window(i) else "full_attention"
                            for i in range(c.num_hidden_layers)],
            "use_sliding_window": bool(win), "sliding_window": win or None,
            "max_window_layers": 0 if win else c.num_hidden_layers,
            "tie_word_embeddings": False}


def _explicit_causal(c) -> bool:
    """Whether vLLM's default ("causal iff sliding") would not give ``c``'s causality."""
    if c.causal_layers is not None:
        return False
    return c.causal or any(c.layer_window(i) for i in range(c.num_hidden_layers))


def write(c, t, torch_dtype):
    # z-lab target_layer_ids mean "output of layer id" = vLLM aux id (input of layer k) - 1.
    dcfg = {"mask_token_id": c.mask_token_id,
            "target_layer_ids": [int(i) - 1 for i in c.aux_layer_ids]}
    cfg = {"architectures": ["DFlashDraftModel"],
           "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
           **_dflash_decoder(c), "block_size": c.block_size, "dflash_config": dcfg,
           "torch_dtype": torch_dtype}
    if _explicit_causal(c):
        dcfg["causal"] = c.causal
        cfg["is_causal"] = c.causal  # what z-lab's attention reads
    if c.sliding_window:
        dcfg["swa_window_size"] = c.sliding_window
    if c.attention_sinks:
        dcfg["attention_sink_bias"] = True
    if c.target_hidden_size and c.target_hidden_size != c.hidden_size:
        cfg["target_hidden_size"] = c.target_hidden_size
    if c.draft_vocab_size != c.vocab_size:
        cfg["draft_vocab_size"] = c.draft_vocab_size
    return cfg, {"model.safetensors": _with_t2d(_sink_names(t), c)}


def write_speculators(c, t, torch_dtype):
    if c.causal_layers is not None:
        raise CheckpointError(f"format 'dflash-speculators' has one causality for every layer "
                              f"(sliding_window_non_causal); causal_layers={c.causal_layers}: "
                              "write format 'dflash'")
    tlc = _dflash_decoder(c)
    if c.causal:
        tlc["is_causal"] = True
    if c.attention_sinks:
        tlc["add_swa_attention_sink_bias"] = True
    ths = c.target_hidden_size
    cfg = {"architectures": ["DFlashSpeculator"], "speculators_model_type": "dflash",
           "draft_vocab_size": c.draft_vocab_size, "block_size": c.block_size,
           "target_hidden_size": ths if ths and ths != c.hidden_size else None,
           "aux_hidden_state_layer_ids": list(c.aux_layer_ids),
           "mask_token_id": c.mask_token_id, "sliding_window_non_causal": not c.causal,
           "projector_type": "dflash", "tie_word_embeddings": False, "dtype": torch_dtype,
           "speculators_config": _speculators_config("dflash", max(c.block_size - 1, 1),
                                                     "Qwen3ForCausalLM"),
           "transformer_layer_config": tlc}
    return cfg, {"model.safetensors": _with_t2d(_sink_names(t), c)}


def detect(p: Probe) -> bool:
    # DFlash2 / DSpark too, so that their reader refuses them by name
    return ("DFlashDraftModel" in p.archs or "dflash_config" in p.config
            or "dspark_config" in p.config
            or any(a in ("DFlash2DraftModel", "DSparkDraftModel", "Qwen3DSparkModel")
                   for a in p.archs)
            or ("hidden_norm.weight" in p.keys and "fc.weight" in p.keys))


def detect_speculators(p: Probe) -> bool:
    return p.spec_type == "dflash"


FORMATS = (
    Format("dflash", "dflash", "DFlash, z-lab (fc, hidden_norm, dflash_config; ids + 1)",
           detect, read, write),
    Format("dflash-speculators", "dflash",
           "DFlash, speculators (transformer_layer_config, aux ids as given)",
           detect_speculators, read_speculators, write_speculators),
)

"""HF Gemma 3 text (``Gemma3ForCausalLM``; the language model of a
``Gemma3ForConditionalGeneration`` checkpoint): read and write."""

from __future__ import annotations

import copy

from specjax.converters.errors import CheckpointError
from specjax.converters.format_common import (Format, Probe, Tensors, _drop, _drop_inv_freq,
                                              _drop_tied_head)

_ARCHS = ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration")
#: Where a ConditionalGeneration checkpoint keeps the language model (transformers 4,
#: transformers 5), renamed to the ``Gemma3ForCausalLM`` keys.
_RENAMES = (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
            ("model.language_model.", "model."))
_VISION = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
           "model.multi_modal_projector.")


def detect(p: Probe) -> bool:
    if any(a in _ARCHS for a in p.archs):
        return True
    return p.config.get("model_type") in ("gemma3_text", "gemma3")


def read(cfg: dict, tensors: Tensors, notes: list[str]) -> tuple[dict, Tensors]:
    """A ConditionalGeneration config's ``text_config`` is lifted (its ``torch_dtype`` and
    ``tie_word_embeddings`` kept); vision tensors are dropped; the language model's keys
    become ``model.*`` / ``lm_head.weight``. The Gemma keys are read by
    ``config_from_hf("gemma3", ...)`` (class defaults for omitted ones)."""
    cfg = copy.deepcopy(cfg)
    if cfg.get("model_type") == "gemma3" or "text_config" in cfg:
        text = cfg.get("text_config")
        if not isinstance(text, dict):
            raise CheckpointError("config.json: text_config must be an object (the Gemma 3 "
                                  f"language model's config), got {type(text).__name__}")
        lifted = copy.deepcopy(text)
        for k in ("torch_dtype", "dtype", "tie_word_embeddings"):
            if k in cfg and k not in lifted:
                lifted[k] = cfg[k]
        notes.append("Gemma3ForConditionalGeneration: converting the language model "
                     "(config.json text_config)")
        cfg = lifted
    cfg["model_type"] = "gemma3_text"
    cfg.setdefault("tie_word_embeddings", True)
    tensors = _drop(tensors, lambda k: k.startswith(_VISION),
                    "the vision tower and projector; specjax runs the text model", notes)
    out: Tensors = {}
    for k, v in tensors.items():
        new = next((rep + k[len(old):] for old, rep in _RENAMES if k.startswith(old)), k)
        if new in out:
            raise CheckpointError(f"tensors {k!r} and another key both map to {new!r}")
        out[new] = v
    if out.keys() != tensors.keys():
        notes.append("renamed the language model's keys to model.* / lm_head.weight")
    out = _drop_inv_freq(out, notes)
    out = _drop_tied_head(cfg, out, notes)
    return cfg, out


def write(c, t, torch_dtype):
    """``Gemma3ForCausalLM`` config.json (transformers-4 keys, explicit ``layer_types``)."""
    cfg = {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
        "vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size, "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim,
        "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": c.max_position_embeddings,
        "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
        "rope_scaling": dict(c.rope_scaling) if c.rope_scaling else None,
        "rope_local_base_freq": c.rope_local_base_freq or c.rope_theta,
        "query_pre_attn_scalar": c.query_pre_attn_scalar or c.head_dim,
        "sliding_window": c.sliding_window or None,
        "layer_types": [("sliding_attention" if c.layer_window(i) else "full_attention")
                        for i in range(c.num_hidden_layers)],
        "final_logit_softcapping": c.final_logit_softcapping or None,
        "attn_logit_softcapping": None, "attention_bias": c.qkv_bias,
        "tie_word_embeddings": c.tie_word_embeddings, "torch_dtype": torch_dtype,
    }
    return cfg, {"model.safetensors": t}


FORMATS = (
    Format("gemma3", "gemma3", "HF Gemma3ForCausalLM (model.* keys, sandwich norms), or the "
           "language model of a Gemma3ForConditionalGeneration checkpoint", detect, read, write),
)

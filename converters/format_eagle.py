"""EAGLE-1/2, SafeAILab (vLLM ``llama_eagle.py``): read and write."""

from __future__ import annotations

from specjax.converters.format_common import (
    Format,
    Probe,
    Tensors,
    _decoder_fields,
    _drop_inv_freq,
    _hf_fields,
    _strip_prefix,
)


def read(cfg: dict, tensors: Tensors, notes: list[str]):
    cfg = _decoder_fields(cfg, notes)
    tensors = _drop_inv_freq(_strip_prefix(tensors, "model.", notes), notes)
    has_bias = "fc.bias" in tensors
    if "bias" not in cfg:
        # SafeAILab defaults bias to true when absent; follow what the file holds.
        cfg["bias"] = has_bias
    cfg["bias"] = bool(cfg["bias"])
    return cfg, tensors


def write(c, t, torch_dtype):
    # SafeAILab cnets1.py: head_dim = H / nH (no field), q/k/v bias only via ``qkv_bias``,
    # o_proj and the MLP without bias, fc bias from ``bias``.
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
           **_hf_fields(c, head_dim=False, rope_type_key=True),
           "bias": c.fc_bias, "pretraining_tp": 1, "tie_word_embeddings": False,
           "torch_dtype": torch_dtype}
    if c.qkv_bias:
        cfg["qkv_bias"] = True
    return cfg, {"model.safetensors": t}


def detect(p: Probe) -> bool:
    return "fc.weight" in p.keys  # evaluated after every EAGLE-3 / DFlash / Medusa check


FORMATS = (Format("eagle", "eagle", "EAGLE-1/2, SafeAILab (fc [H,2H], layers.*)", detect,
                  read, write),)

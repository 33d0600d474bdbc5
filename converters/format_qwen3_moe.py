"""HF Qwen3-MoE (``Qwen3MoeForCausalLM``): read the Hub layout (per-expert
``mlp.experts.{e}.{gate,up,down}_proj.weight``, stacked here) or transformers 5's stacked one
(the canonical form), write the Hub's."""

from __future__ import annotations

import re

import numpy as np

from specjax.converters.errors import CheckpointError
from specjax.converters.format_common import (
    Format,
    Probe,
    Tensors,
    _decoder_fields,
    _drop_inv_freq,
    _drop_tied_head,
    _hf_fields,
)
from specjax.converters.tensor_ref import TensorRef

_ARCH = "Qwen3MoeForCausalLM"


def detect(p: Probe) -> bool:
    return _ARCH in p.archs or p.config.get("model_type") == "qwen3_moe"


_PER_EXPERT = re.compile(r"(.*\.mlp\.experts\.)(\d+)\.(gate_proj|up_proj|down_proj)\.weight")


def _stack_experts(tensors: Tensors, notes: list[str]) -> Tensors:
    """The Hub's per-expert tensors -> the canonical stacked ``gate_up_proj [E, 2I, H]`` /
    ``down_proj [E, H, I]`` (lazy, a layer at a time); CheckpointError naming a bad layer."""
    groups: dict[str, dict[int, dict[str, TensorRef]]] = {}
    out: Tensors = {}
    for k, v in tensors.items():
        m = _PER_EXPERT.fullmatch(k)
        if m:
            groups.setdefault(m[1], {}).setdefault(int(m[2]), {})[m[3]] = v
        else:
            out[k] = v
    for base, experts in groups.items():
        if f"{base}gate_up_proj" in out or f"{base}down_proj" in out:
            raise CheckpointError(f"{base}*: both fused and per-expert expert tensors")
        n = len(experts)
        if sorted(experts) != list(range(n)):
            missing = sorted(set(range(max(experts) + 1)) - set(experts))
            raise CheckpointError(f"{base}{{e}}: expert {missing[0]} is missing")
        for e, parts in experts.items():
            if set(parts) != {"gate_proj", "up_proj", "down_proj"}:
                raise CheckpointError(f"{base}{e}: needs gate_proj, up_proj and down_proj "
                                      f"weights, has {sorted(parts)}")
        first = experts[0]
        for e, parts in experts.items():
            for name, v in parts.items():
                if v.shape != first[name].shape or len(v.shape) != 2:
                    raise CheckpointError(f"{base}{e}.{name}.weight has shape {list(v.shape)}, "
                                          f"expert 0's is {list(first[name].shape)}")
        inter, hidden = first["gate_proj"].shape
        dtype = first["gate_proj"].dtype
        gate_up = [(experts[e]["gate_proj"], experts[e]["up_proj"]) for e in range(n)]
        down = [experts[e]["down_proj"] for e in range(n)]
        out[f"{base}gate_up_proj"] = TensorRef(
            (n, 2 * inter, hidden), dtype, source=f"{base}{{0..{n - 1}}}.gate_proj/up_proj",
            loader=lambda g=gate_up: np.stack([np.concatenate([a.load(), b.load()]) for a, b in g]))
        out[f"{base}down_proj"] = TensorRef(
            (n,) + first["down_proj"].shape, first["down_proj"].dtype,
            source=f"{base}{{0..{n - 1}}}.down_proj",
            loader=lambda d=down: np.stack([a.load() for a in d]))
    if groups:
        notes.append("stacked the per-expert mlp.experts.{e}.* tensors into "
                     "mlp.experts.gate_up_proj / down_proj")
    return out


def read(cfg: dict, tensors: Tensors, notes: list[str]) -> tuple[dict, Tensors]:
    """Decoder fields as Qwen3's; the MoE keys are read by ``config_from_hf("qwen3_moe")``."""
    cfg = _decoder_fields(cfg, notes)
    cfg["model_type"] = "qwen3_moe"
    cfg.setdefault("attention_bias", False)
    tensors = _stack_experts(_drop_inv_freq(tensors, notes), notes)
    tensors = _drop_tied_head(cfg, tensors, notes)
    return cfg, tensors


def write(c, t, torch_dtype):
    """``Qwen3MoeForCausalLM`` config.json (transformers-4 keys); the Hub tensor layout."""
    from specjax.models.moe_config import moe_dict

    cfg = {"architectures": [_ARCH], "model_type": "qwen3_moe", **_hf_fields(c),
           "attention_bias": c.qkv_bias, "use_sliding_window": False, "sliding_window": None,
           **moe_dict(c), "router_aux_loss_coef": 0.0, "output_router_logits": False,
           "tie_word_embeddings": c.tie_word_embeddings, "torch_dtype": torch_dtype}
    return cfg, {"model.safetensors": _per_expert(c, t)}


def _per_expert(c, t: dict) -> dict:
    """Canonical stacked experts -> the Hub's per-expert tensors (what every loader reads)."""
    out = {}
    for k, a in t.items():
        if k.endswith(".mlp.experts.gate_up_proj"):
            base, i = k[: -len("gate_up_proj")], a.shape[1] // 2
            for e in range(a.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = np.ascontiguousarray(a[e, :i])
                out[f"{base}{e}.up_proj.weight"] = np.ascontiguousarray(a[e, i:])
        elif k.endswith(".mlp.experts.down_proj"):
            for e in range(a.shape[0]):
                out[f"{k[: -len('down_proj')]}{e}.down_proj.weight"] = np.ascontiguousarray(a[e])
        else:
            out[k] = a
    return out


FORMATS = (
    Format("qwen3_moe", "qwen3_moe", "HF Qwen3MoeForCausalLM (model.* keys, per-expert or "
           "transformers-5 fused experts)", detect, read, write),
)

"""HF Qwen3-MoE (``Qwen3MoeForCausalLM``): read the Hub layout (per-expert
``mlp.experts.{e}.{gate,up,down}_proj.weight``) or transformers 5's fused one, write the Hub's."""

from __future__ import annotations

from specjax.converters.errors import CheckpointError
from specjax.converters.format_common import (
    Format,
    Probe,
    Tensors,
    _decoder_fields,
    _drop,
    _drop_inv_freq,
    _hf_fields,
)

_ARCH = "Qwen3MoeForCausalLM"


def detect(p: Probe) -> bool:
    return _ARCH in p.archs or p.config.get("model_type") == "qwen3_moe"


def _split_fused(tensors: Tensors, notes: list[str]) -> Tensors:
    """transformers 5's ``mlp.experts.gate_up_proj [E, 2I, H]`` (gate rows first) and
    ``mlp.experts.down_proj [E, H, I]`` -> the per-expert Hub keys (lazy slices)."""
    out: Tensors = {}
    fused = False
    for k, v in tensors.items():
        if k.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            if len(v.shape) != 3 or (k.endswith("gate_up_proj") and v.shape[1] % 2):
                raise CheckpointError(f"{k}: expected [experts, 2*I, H] / [experts, H, I], "
                                      f"got {list(v.shape)}")
            fused, base = True, k[: k.rindex(".") + 1]
            e, rows, cols = v.shape
            parts = ((("gate_proj", 0), ("up_proj", rows // 2)) if k.endswith("gate_up_proj")
                     else (("down_proj", 0),))
            n = rows // 2 if k.endswith("gate_up_proj") else rows
            for j in range(e):
                for name, lo in parts:
                    out[f"{base}{j}.{name}.weight"] = v.map(
                        lambda a, j=j, lo=lo, n=n: a[j, lo:lo + n].copy(), shape=(n, cols))
        else:
            out[k] = v
    if fused:
        both = sorted(k for k in out if k in tensors and ".mlp.experts." in k)
        if both:
            raise CheckpointError(f"both fused and per-expert expert tensors, e.g. {both[0]}")
        notes.append("split transformers 5's fused mlp.experts.gate_up_proj / down_proj into "
                     "per-expert tensors")
    return out


def read(cfg: dict, tensors: Tensors, notes: list[str]) -> tuple[dict, Tensors]:
    """Decoder fields as Qwen3's; the MoE keys are read by ``config_from_hf("qwen3_moe")``."""
    cfg = _decoder_fields(cfg, notes)
    cfg["model_type"] = "qwen3_moe"
    cfg.setdefault("attention_bias", False)
    tensors = _split_fused(_drop_inv_freq(tensors, notes), notes)
    if cfg["tie_word_embeddings"]:
        tensors = _drop(tensors, lambda k: k == "lm_head.weight",
                        "tie_word_embeddings: the head is model.embed_tokens", notes)
    return cfg, tensors


def write(c, t, torch_dtype):
    """``Qwen3MoeForCausalLM`` config.json (transformers-4 keys); the Hub tensor layout."""
    from specjax.models.moe_config import moe_dict

    cfg = {"architectures": [_ARCH], "model_type": "qwen3_moe", **_hf_fields(c),
           "attention_bias": c.qkv_bias, "use_sliding_window": False, "sliding_window": None,
           **moe_dict(c), "router_aux_loss_coef": 0.0, "output_router_logits": False,
           "tie_word_embeddings": c.tie_word_embeddings, "torch_dtype": torch_dtype}
    return cfg, {"model.safetensors": t}


FORMATS = (
    Format("qwen3_moe", "qwen3_moe", "HF Qwen3MoeForCausalLM (model.* keys, per-expert or "
           "transformers-5 fused experts)", detect, read, write),
)

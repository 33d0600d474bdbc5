"""HF decoders in transformers' ``*ForCausalLM`` layout (Llama, Qwen2, Qwen3, Mistral, Ministral)."""

from __future__ import annotations

from specjax.converters.format_common import (
    _HF_ARCH,
    Format,
    Probe,
    Tensors,
    _decoder_fields,
    _drop_inv_freq,
    _drop_tied_head,
    _hf_fields,
)

_HF_ARCHS = {v: k for k, v in _HF_ARCH.items()}


def read(kind: str):
    def normalize(cfg: dict, tensors: Tensors, notes: list[str]):
        mt = cfg.get("model_type")
        if mt is not None and mt != kind:
            notes.append(f"config model_type is {mt!r}; converting as {kind}")
        cfg = _decoder_fields(cfg, notes)
        cfg["model_type"] = kind
        if kind == "qwen2":
            cfg["attention_bias"] = True  # Qwen2 q/k/v always carry a bias; o_proj none
        else:
            cfg.setdefault("attention_bias", False)
        tensors = _drop_inv_freq(tensors, notes)
        if (tensors and not any(k.startswith("model.") for k in tensors)
                and "embed_tokens.weight" in tensors):
            notes.append("added the 'model.' prefix (a bare-decoder checkpoint)")
            tensors = {k if k == "lm_head.weight" else "model." + k: v
                       for k, v in tensors.items()}
        tensors = _drop_tied_head(cfg, tensors, notes)
        return cfg, tensors
    return normalize


def write(kind: str):
    def write(c, t, torch_dtype):
        cfg = {"architectures": [_HF_ARCH[kind]], "model_type": kind, **_hf_fields(c),
               "tie_word_embeddings": c.tie_word_embeddings, "torch_dtype": torch_dtype}
        layer_types = list(c.layer_types or [
            "sliding_attention" if c.layer_window(i) else "full_attention"
            for i in range(c.num_hidden_layers)])
        if kind == "llama":
            cfg.update(attention_bias=c.qkv_bias, mlp_bias=c.mlp_bias, pretraining_tp=1)
        elif kind in ("mistral", "ministral"):
            cfg.update(sliding_window=c.sliding_window or None)
            if kind == "ministral" or c.layer_types is not None:
                cfg["layer_types"] = layer_types
        else:  # Qwen2 always has q/k/v bias (no field); Qwen3 has attention_bias
            if kind == "qwen3":
                cfg["attention_bias"] = c.qkv_bias
            first = layer_types.index("sliding_attention") if c.sliding_window else None
            cfg.update(use_sliding_window=bool(c.sliding_window),
                       sliding_window=c.sliding_window or None,
                       max_window_layers=c.num_hidden_layers if first is None else first,
                       layer_types=layer_types)
        return cfg, {"model.safetensors": t}
    return write


def hf_kind(p: Probe) -> str | None:
    """The HF decoder kind named by the first known architecture, else by model_type."""
    for a in p.archs:
        if a in _HF_ARCHS:
            return _HF_ARCHS[a]
    mt = p.config.get("model_type")
    return mt if mt in _HF_ARCH else None


def detect(kind: str):
    return lambda p: hf_kind(p) == kind


FORMATS = (
    Format("llama", "llama", "HF LlamaForCausalLM (model.* keys)", detect("llama"),
           read("llama"), write("llama")),
    Format("qwen2", "qwen2", "HF Qwen2ForCausalLM (model.* keys, q/k/v bias)", detect("qwen2"),
           read("qwen2"), write("qwen2")),
    Format("qwen3", "qwen3", "HF Qwen3ForCausalLM (model.* keys, q/k norms)", detect("qwen3"),
           read("qwen3"), write("qwen3")),
    Format("mistral", "mistral", "HF MistralForCausalLM (model.* keys, a sliding window on "
           "every layer)", detect("mistral"), read("mistral"), write("mistral")),
    Format("ministral", "ministral", "HF MinistralForCausalLM (model.* keys, per-layer "
           "sliding windows from layer_types)", detect("ministral"), read("ministral"),
           write("ministral")),
)

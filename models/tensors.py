"""The tensor-table vocabulary every model file's ``tensor_table`` is written in:
:class:`Entry` (one canonical tensor: its name, place in the params dict, PyTorch-layout
shape and conversion) and :func:`layer_entries` (one Llama-style decoder layer). The
tables themselves live with their models (``llama.py``, ``eagle.py``, ``eagle3.py`` (EAGLE-3
and DFlash), ``medusa.py``); ``registry.tensor_table`` picks one by kind."""

from __future__ import annotations

import dataclasses

from specjax.models.config import ModelConfig

__all__ = ["Entry", "layer_entries"]


@dataclasses.dataclass(frozen=True)
class Entry:
    """One canonical tensor. ``path`` None: accepted but not kept (vLLM ignores it)."""

    key: str
    path: tuple | None
    shape: tuple[int, ...]          # PyTorch layout
    conv: str   # "linear" (transpose) | "copy" | "int" | "experts" ([E, out, in] -> [E, in, out])
    #             | "experts_gate_up" ([E, 2I, H] gate then up -> [E, H, 2I] interleaved)
    required: bool = True
    flag: str | None = None         # presence flag of an optional tensor


def layer_entries(prefix: str, path: tuple, c: ModelConfig, *, in_features: int, input_norm: bool = True,
           hidden_norm: bool = False) -> list[Entry]:
    h, i = c.hidden_size, c.intermediate_size
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    out: list[Entry] = []

    def lin(name, p, o, n, bias):
        out.append(Entry(f"{prefix}{name}.weight", path + p + ("kernel",), (o, n), "linear"))
        if bias:
            out.append(Entry(f"{prefix}{name}.bias", path + p + ("bias",), (o,), "copy"))

    for name, o in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
        lin(f"self_attn.{name}", ("self_attn", name), o, in_features, c.qkv_bias)
    lin("self_attn.o_proj", ("self_attn", "o_proj"), h, q, c.o_bias)
    if c.attention_sinks:
        out.append(Entry(f"{prefix}self_attn.sinks", path + ("self_attn", "sinks"),
                         (c.num_attention_heads,), "copy"))
    if c.qk_norm:
        for name in ("q_norm", "k_norm"):
            out.append(Entry(f"{prefix}self_attn.{name}.weight", path + ("self_attn", name, "weight"),
                             (c.head_dim,), "copy"))
    lin("mlp.gate_proj", ("mlp", "gate_proj"), i, h, c.mlp_bias)
    lin("mlp.up_proj", ("mlp", "up_proj"), i, h, c.mlp_bias)
    lin("mlp.down_proj", ("mlp", "down_proj"), h, i, c.mlp_bias)
    norms = ["post_attention_layernorm"] + (["input_layernorm"] if input_norm else [])
    norms += ["hidden_norm"] if hidden_norm else []
    for name in norms:
        out.append(Entry(f"{prefix}{name}.weight", path + (name, "weight"), (h,), "copy"))
    return out

"""Xiaomi MiMo (vLLM ``mimo.py``, ``mimo_mtp.py``): the Qwen2 target and its
multi-token-prediction (MTP) head, read and written.

``mimo`` (kind ``qwen2``): the target, every ``model.mtp_layers.*`` tensor dropped.
``mimo-mtp`` (kind ``mtp``): MTP module 0 only, renamed to the canonical names; auto-detected
only for a head-only export (a full checkpoint detects as ``mimo``). Details:
docs/converters.md, "Formats".
"""

from __future__ import annotations

import re

from specjax.converters import format_hf
from specjax.converters.errors import CheckpointError, listing
from specjax.converters.format_common import (
    Format,
    Probe,
    Tensors,
    _decoder_fields,
    _drop,
    _drop_inv_freq,
    _hf_fields,
)

ARCH = "MiMoForCausalLM"
#: The key prefix of MTP module ``i`` in a MiMo checkpoint.
MTP_PREFIX = "model.mtp_layers."
#: One module's own tensors (no prefix; the same names in the canonical ``mtp`` form).
OWN = ("token_layernorm.weight", "hidden_layernorm.weight", "input_proj.weight",
       "final_layernorm.weight")
#: One module's decoder block (no prefix; canonical names under ``layers.0.``): Qwen2,
#: q/k/v with bias, o without.
BLOCK = ("input_layernorm.weight", "post_attention_layernorm.weight",
         "self_attn.q_proj.weight", "self_attn.q_proj.bias", "self_attn.k_proj.weight",
         "self_attn.k_proj.bias", "self_attn.v_proj.weight", "self_attn.v_proj.bias",
         "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
         "mlp.down_proj.weight")
_MODULE = re.compile(r"^model\.mtp_layers\.(\d+)\.")


def is_mimo(p: Probe) -> bool:
    """``MiMoForCausalLM`` among the architectures, or ``model_type`` mimo without any."""
    return ARCH in p.archs or (not p.archs and p.config.get("model_type") == "mimo")


def _modules(tensors) -> list[int]:
    return sorted({int(m[1]) for k in tensors if (m := _MODULE.match(k))})


# -- mimo: the target --------------------------------------------------------------------------

_read_qwen2 = format_hf.read("qwen2")
_write_qwen2 = format_hf.write("qwen2")


def read(cfg: dict, tensors: Tensors, notes: list[str]):
    tensors = _drop(tensors, lambda k: k.startswith(MTP_PREFIX),
                    "the MTP modules; vLLM's MiMoForCausalLM drops them from the target, "
                    "--format mimo-mtp converts module 0 as the draft head", notes)
    return _read_qwen2(cfg, tensors, notes)


def write(c, t, torch_dtype):
    cfg, files = _write_qwen2(c, t, torch_dtype)
    cfg.update(architectures=[ARCH], model_type="mimo", num_nextn_predict_layers=0)
    return cfg, files


def detect(p: Probe) -> bool:
    return is_mimo(p)  # evaluated after mimo-mtp (a head-only export)


# -- mimo-mtp: the MTP head ----------------------------------------------------------------------

def _module_count(cfg: dict, found: list[int], notes: list[str]) -> int:
    """``num_nextn_predict_layers``, checked against the modules ``0 .. n-1`` in the weights
    (their count when the config has no such field)."""
    n = cfg.get("num_nextn_predict_layers")
    have = (f"model.mtp_layers.{{{', '.join(map(str, found))}}}.* ({len(found)} modules)"
            if found else "no model.mtp_layers.* tensors")
    if n is None:
        if not found:
            raise CheckpointError("weights: no model.mtp_layers.0.* tensors and no "
                                  "num_nextn_predict_layers in config.json: not a MiMo "
                                  "checkpoint with MTP modules (format 'mimo-mtp')")
        n = len(found)
        notes.append(f"config has no num_nextn_predict_layers; using the {n} MTP modules found")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise CheckpointError(f"config: num_nextn_predict_layers={n!r} must be a positive int "
                              f"(the number of MTP modules; the weights hold {have})")
    if found != list(range(n)):
        raise CheckpointError(f"config: num_nextn_predict_layers={n} disagrees with the weights, "
                              f"which hold {have} (allowed: modules 0..{n - 1})")
    return n


def read_mtp(cfg: dict, tensors: Tensors, notes: list[str]):
    cfg = _decoder_fields(cfg, notes)
    if cfg.get("use_sliding_window"):
        raise CheckpointError("config: use_sliding_window=true is not supported")
    n = _module_count(cfg, _modules(tensors), notes)
    trunk = cfg["num_hidden_layers"]
    tensors = _drop_inv_freq(tensors, notes)
    head = MTP_PREFIX + "0."
    need = [head + k for k in OWN + BLOCK]
    missing = [k for k in need if k not in tensors]
    if missing:
        raise CheckpointError(f"weights: missing MTP head tensor(s) {listing(missing)} (module "
                              f"0 must hold the {len(need)} tensors {OWN[0]}, {OWN[1]}, "
                              f"{OWN[2]}, {OWN[3]} and a Qwen2 decoder block with q/k/v bias)")
    extra = sorted(k for k in tensors if k.startswith(head) and k not in need)
    if extra:
        raise CheckpointError(f"weights: unknown MTP module-0 tensors {listing(extra)} "
                              f"(allowed: {', '.join(OWN + BLOCK)})")
    tensors = _drop(tensors, lambda k: k.startswith(MTP_PREFIX) and not k.startswith(head),
                    "MTP modules 1.. are not kept: vLLM's V1 runner drafts every step with "
                    "module 0, never passing spec_step_idx", notes)
    tensors = _drop(tensors, lambda k: k.startswith("model.layers.") or k == "model.norm.weight",
                    f"the target's {trunk}-layer decoder; --format mimo converts it", notes)
    tensors = _drop(tensors, lambda k: k in ("model.embed_tokens.weight", "lm_head.weight"),
                    "the head uses the target's embedding and lm_head", notes)
    out = {}
    for k, v in tensors.items():
        if k.startswith(head):
            name = k[len(head):]
            k = name if name in OWN else "layers.0." + name
        out[k] = v
    notes.append(f"renamed model.mtp_layers.0.* -> the canonical mtp names ({len(need)} tensors; "
                 "the decoder block under layers.0.)")
    cfg.update(model_type="mimo_mtp", architectures=["MiMoMTPModel"], num_hidden_layers=1,
               num_nextn_predict_layers=n, attention_bias=True, qkv_bias=True, o_bias=False,
               tie_word_embeddings=False)
    return cfg, out


def write_mtp(c, t, torch_dtype):
    if c.num_hidden_layers != 1:
        raise ValueError(f"format 'mimo-mtp' writes one MTP module with one decoder block: "
                         f"num_hidden_layers={c.num_hidden_layers} cannot be written (allowed: 1)")
    if c.n_predict != 1:
        raise ValueError(f"format 'mimo-mtp' writes MTP module 0 only: n_predict="
                         f"{c.n_predict} (num_nextn_predict_layers) cannot be written (allowed: "
                         "1; config.replace(n_predict=1) exports the module alone)")
    cfg = {"architectures": [ARCH], "model_type": "mimo", **_hf_fields(c),
           "num_hidden_layers": 0, "num_nextn_predict_layers": 1, "tie_word_embeddings": False,
           "use_sliding_window": False, "sliding_window": None, "max_window_layers": 0,
           "torch_dtype": torch_dtype}
    tensors = {}
    for k, a in t.items():
        name = k[len("layers.0."):] if k.startswith("layers.0.") else k
        tensors[MTP_PREFIX + "0." + name] = a
    return cfg, {"model.safetensors": tensors}


def detect_mtp(p: Probe) -> bool:
    """A head-only export: MTP modules and no decoder layers."""
    return (any(k.startswith(MTP_PREFIX) for k in p.keys)
            and not any(k.startswith("model.layers.") for k in p.keys))


FORMATS = (
    Format("mimo-mtp", "mtp", "MiMo MTP head: model.mtp_layers.0.* (module 0) of a MiMo "
           "checkpoint", detect_mtp, read_mtp, write_mtp),
    Format("mimo", "qwen2", "MiMoForCausalLM target (Qwen2; model.mtp_layers.* dropped)",
           detect, read, write),
)

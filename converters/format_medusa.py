"""Medusa, FasterDecoding Medusa-1 and vLLM (vLLM ``medusa.py``): read and write."""

from __future__ import annotations

import copy
import re

import numpy as np

from specjax.converters.errors import CheckpointError
from specjax.converters.format_common import (
    Format,
    Probe,
    Tensors,
    _drop,
    _int32_map,
    _rename_prefixes,
    _strip_prefix,
)


_MEDUSA1_KEY = re.compile(r"^(\d+)\.(\d+)\.(linear\.weight|linear\.bias|weight)$")


def read(cfg: dict, tensors: Tensors, notes: list[str]):
    """``medusa_lm_head.pt``: ``{h}.{l}.linear.{weight,bias}`` and ``{h}.{L}.weight``."""
    tensors = _strip_prefix(tensors, "medusa_head.", notes)
    parsed, others = {}, {}
    for k, v in tensors.items():
        m = _MEDUSA1_KEY.match(k)
        if m:
            parsed[(int(m[1]), int(m[2]), m[3])] = v
        else:
            others[k] = v  # kept as is: the tensor check names them as unknown
    heads = sorted({h for h, _, _ in parsed})
    if not heads:
        raise CheckpointError("no Medusa head tensors ({h}.{l}.linear.weight / {h}.{L}.weight)")
    if heads != list(range(len(heads))):
        raise CheckpointError(f"Medusa head indices {heads} are not 0..{len(heads) - 1}")
    out: Tensors = dict(others)
    layers_per_head, repeated = set(), 0
    for h in heads:
        lm = [l for (hh, l, w) in parsed if hh == h and w == "weight"]
        if len(lm) != 1:
            raise CheckpointError(f"Medusa head {h}: expected one lm head '{h}.L.weight', "
                                  f"found {[f'{h}.{l}.weight' for l in lm]}")
        L = lm[0]
        layers_per_head.add(L)
        out[f"lm_heads.{h}.weight"] = parsed[(h, L, "weight")]
        for (hh, l, w), v in parsed.items():
            if hh == h and l > L:
                out[f"{h}.{l}.{w}"] = v  # beyond the head: unknown
        for l in range(L):
            for w in ("weight", "bias"):
                src = parsed.get((h, l, f"linear.{w}"))
                if src is None and (h, 0, f"linear.{w}") in parsed and l > 0:
                    # [ResBlock] * n: one module under every index; repeat its weight.
                    src = parsed[(h, 0, f"linear.{w}")]
                    repeated += 1
                if src is not None:
                    out[f"blocks.{h}.layers.{l}.{w}"] = src
    if len(layers_per_head) != 1:
        raise CheckpointError(f"Medusa heads have different layer counts {sorted(layers_per_head)}")
    (L,) = layers_per_head
    if repeated:
        notes.append(f"repeated the shared ResBlock weight of each head ({repeated} tensors; "
                     "the reference builds [ResBlock] * n)")
    n_cfg = cfg.get("medusa_num_heads")
    if n_cfg is not None and n_cfg != len(heads):
        notes.append(f"config says medusa_num_heads={n_cfg}; the file has {len(heads)} heads "
                     "(counted from the keys, as the reference loader does)")
    if cfg.get("medusa_num_layers") not in (None, L):
        notes.append(f"config says medusa_num_layers={cfg['medusa_num_layers']}; "
                     f"the file has {L}")
    lm0 = out["lm_heads.0.weight"]
    hidden = cfg.get("hidden_size") or (lm0.shape[1] if len(lm0.shape) == 2 else None)
    vocab = cfg.get("vocab_size") or (lm0.shape[0] if len(lm0.shape) == 2 else None)
    flat = {
        "model_type": "medusa", "architectures": ["MedusaModel"],
        "hidden_size": hidden, "vocab_size": vocab,
        "num_heads": len(heads), "num_hidden_layers": L,
        "medusa_fc_bias": any(w == "linear.bias" for _, _, w in parsed),
        "original_lm_head": False, "truncated_vocab_size": None,
    }
    for k in ("base_model_name_or_path", "torch_dtype", "dtype"):
        if k in cfg:
            flat[k] = cfg[k]
    return flat, out


_BLOCK_KEY = re.compile(r"^blocks\.(\d+)\.")


def read_vllm(cfg: dict, tensors: Tensors, notes: list[str]):
    flat = copy.deepcopy(cfg)
    # vLLM's MedusaConfig: any "num..heads" key is num_heads, any "num..layers" key is
    # num_hidden_layers (so medusa_num_heads / medusa_num_layers work).
    for k in list(flat):
        if "num" in k and "heads" in k and k != "num_heads":
            flat.setdefault("num_heads", flat.pop(k))
        elif "num" in k and "layers" in k and k != "num_hidden_layers":
            flat.setdefault("num_hidden_layers", flat.pop(k))
    tensors = _rename_prefixes(tensors, {"medusa_heads.": ""}, notes)
    heads = sorted({int(m[1]) for k in tensors if (m := _BLOCK_KEY.match(k))})
    if heads and heads != list(range(len(heads))):
        raise CheckpointError(f"Medusa block indices {heads} are not 0..{len(heads) - 1}")
    if flat.get("num_heads") not in (None, len(heads)):
        notes.append(f"config says num_heads={flat['num_heads']}; the file has "
                     f"{len(heads)} heads (counted from the keys)")
    flat["num_heads"] = len(heads)
    for field in ("hidden_size", "vocab_size", "num_hidden_layers"):
        if not isinstance(flat.get(field), int):
            raise CheckpointError(f"config: field {field!r} is missing or not an int")
    flat.setdefault("medusa_fc_bias", False)
    flat["original_lm_head"] = bool(flat.get("original_lm_head", False))
    if flat["original_lm_head"] and "lm_head.weight" not in tensors \
            and "lm_heads.0.weight" in tensors:
        tensors = dict(tensors)
        tensors["lm_head.weight"] = tensors.pop("lm_heads.0.weight")
        notes.append("original_lm_head: lm_heads.0.weight -> lm_head.weight")
    vocab = flat["vocab_size"]
    truncated = flat.get("truncated_vocab_size") or vocab
    if truncated < vocab:
        if "token_map" not in tensors:
            raise CheckpointError(f"config: truncated_vocab_size={truncated} < "
                                  f"vocab_size={vocab} needs a token_map tensor (missing)")
        _int32_map(tensors, "token_map", notes)
        for k in list(tensors):
            ref = tensors[k]
            if (k == "lm_head.weight" or k.startswith("lm_heads.")) and len(ref.shape) == 2 \
                    and ref.shape[0] > truncated:
                tm = tensors["token_map"]
                tensors[k] = ref.map(lambda w, tm=tm: w[tm.load()],
                                     shape=(tm.shape[0], ref.shape[1]))
                notes.append(f"{k}: rows selected by token_map ({ref.shape[0]} -> "
                             f"{tm.shape[0]})")
        flat["truncated_vocab_size"] = truncated
    else:
        tensors = _drop(tensors, lambda k: k == "token_map",
                        "truncated_vocab_size is not below vocab_size (vLLM ignores it too)",
                        notes)
        flat["truncated_vocab_size"] = None
    flat["model_type"] = "medusa"
    return flat, tensors


def write(c, t, torch_dtype):
    vllm_only = [f"{f}={v!r}" for f, v, ok in (
        ("fc_bias", c.fc_bias, c.fc_bias or c.num_hidden_layers == 0),
        ("original_lm_head", c.original_lm_head, not c.original_lm_head),
        ("truncated_vocab_size", c.truncated_vocab_size,
         c.truncated_vocab_size in (0, c.vocab_size)),
        ("has_token_map", c.has_token_map, not c.has_token_map),
        ("logit_scale", c.logit_scale, c.logit_scale == 1.0)) if not ok]
    if vllm_only:
        raise ValueError("format 'medusa' (FasterDecoding Medusa-1: ResBlocks with bias, one "
                         "full-vocab lm head per head) cannot express "
                         f"{', '.join(vllm_only)} (use format 'medusa-vllm')")
    L = c.num_hidden_layers
    out = {}
    for h in range(c.num_heads):
        for l in range(L):
            for w in ("weight", "bias"):
                a = t[f"blocks.{h}.layers.{l}.{w}"]
                if l and not np.array_equal(a.view(np.uint8), t[f"blocks.{h}.layers.0.{w}"]
                                            .view(np.uint8)):
                    raise ValueError(
                        f"format 'medusa' (FasterDecoding Medusa-1) shares one ResBlock across "
                        f"the {L} layers of a head ([ResBlock] * n), but head {h} has "
                        f"different {w}s in layers 0 and {l} (use format 'medusa-vllm')")
                out[f"{h}.{l}.linear.{w}"] = a
        out[f"{h}.{L}.weight"] = t[f"lm_heads.{h}.weight"]
    cfg = {"medusa_num_heads": c.num_heads, "medusa_num_layers": L,
           "hidden_size": c.hidden_size, "vocab_size": c.vocab_size}
    return cfg, {"medusa_lm_head.safetensors": out}


def write_vllm(c, t, torch_dtype):
    cfg = {"architectures": ["MedusaModel"], "model_type": "medusa",
           "hidden_size": c.hidden_size, "vocab_size": c.vocab_size,
           "num_heads": c.num_heads, "num_hidden_layers": c.num_hidden_layers,
           "medusa_fc_bias": c.fc_bias, "original_lm_head": c.original_lm_head,
           "logit_scale": c.logit_scale, "torch_dtype": torch_dtype}
    if c.truncated_vocab_size:
        cfg["truncated_vocab_size"] = c.truncated_vocab_size
    t = dict(t)
    if "lm_head.weight" in t:  # vLLM files keep the shared head as lm_heads.0.weight
        t["lm_heads.0.weight"] = t.pop("lm_head.weight")
    return cfg, {"model.safetensors": t}


def detect(p: Probe) -> bool:
    return (any(f.endswith("medusa_lm_head.pt") for f in p.files)
            or any(_MEDUSA1_KEY.match(k.removeprefix("medusa_head.")) for k in p.keys))


def detect_vllm(p: Probe) -> bool:
    return (p.config.get("model_type") == "medusa" or "MedusaModel" in p.archs
            or any(k.removeprefix("medusa_heads.").startswith(("blocks.", "lm_heads."))
                   for k in p.keys))


FORMATS = (
    Format("medusa", "medusa", "Medusa-1, FasterDecoding (medusa_lm_head.pt)", detect, read,
           write),
    Format("medusa-vllm", "medusa", "Medusa, vLLM (blocks.*, lm_heads.*, token_map)",
           detect_vllm, read_vllm, write_vllm),
)

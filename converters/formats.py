"""One normalizer per upstream format: ``(config.json, tensors)`` -> the canonical
``(kind, hf_config, tensors)`` of ``models/CANONICAL.md``; plus format auto-detection.

Facts per format: ``research/checkpoint_formats.md`` (section numbers below refer to it).
Normalizers rename, drop and derive tensors lazily (no weight bytes are read here) and
record each non-obvious step in ``notes`` for the conversion summary.

Parallel drafting (P-EAGLE): an EAGLE / EAGLE-3 checkpoint may carry ``mask_hidden``, the
hidden input of the parallel-drafting slots (``[1, 1, n_aux * Ht]`` / ``[1, fc_input_size]``
for EAGLE-3, ``H`` values for EAGLE-1). It lies outside the canonical tensor table: it is
moved to :attr:`Normalized.extra_params` (flattened, size checked), which the pipeline puts
into the params as the top-level entry ``params["mask_hidden"]``. The parallel-drafting
(mask) token id of a draft config is read by :func:`parallel_drafting_token_id`.
"""

from __future__ import annotations

import copy
import dataclasses
import re
from typing import Callable

import numpy as np

from specjax.converters.errors import CheckpointError, FormatDetectionError
from specjax.converters.tensor_ref import TensorRef

Tensors = dict[str, TensorRef]


@dataclasses.dataclass
class Normalized:
    """``tensors``: the canonical tensors (``models/CANONICAL.md``). ``extra_params``:
    top-level params entries outside the canonical tensor table, already in their params
    shape (``mask_hidden`` of a P-EAGLE checkpoint)."""

    kind: str
    format: str
    hf_config: dict
    tensors: Tensors
    notes: list[str] = dataclasses.field(default_factory=list)
    extra_params: Tensors = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Format:
    name: str
    kind: str
    description: str
    normalize: Callable[[dict, Tensors, list[str]], tuple[dict, Tensors]]


# -- shared helpers ----------------------------------------------------------------------

def _decoder_fields(cfg: dict, notes: list[str], *, where: str = "config") -> dict:
    """The HF decoder fields every kind reads, with HF's defaults filled in: rope
    (``rope_theta`` / ``rope_scaling``, also from transformers-v5 ``rope_parameters``),
    ``head_dim`` (default H/nH), ``num_key_value_heads`` (default nH), ``rms_norm_eps``,
    ``tie_word_embeddings``."""
    cfg = copy.deepcopy(cfg)
    for field in ("hidden_size", "num_attention_heads", "num_hidden_layers",
                  "intermediate_size", "vocab_size"):
        if not isinstance(cfg.get(field), int):
            raise CheckpointError(f"{where}: field {field!r} is missing or not an int "
                                  f"(got {cfg.get(field)!r})")
    params = cfg.get("rope_parameters")
    theta, scaling = cfg.get("rope_theta"), cfg.get("rope_scaling")
    if isinstance(params, dict):
        if theta is None:
            theta = params.get("rope_theta")
        if scaling is None and params.get("rope_type", "default") != "default":
            scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    if isinstance(scaling, dict):
        scaling = dict(scaling)
        if "rope_type" not in scaling and "type" in scaling:
            scaling["rope_type"] = scaling["type"]
        if scaling.get("rope_type") == "default":
            scaling = None
    if theta is None:
        theta = 10000.0
        notes.append(f"{where}: no rope_theta; using HF's default 10000")
    cfg["rope_theta"] = float(theta)
    cfg["rope_scaling"] = scaling or None
    if cfg.get("is_neox_style", True) is False:
        raise CheckpointError(f"{where}: is_neox_style=false (interleaved RoPE) is not "
                              "supported; specjax uses the rotate-half layout")
    if cfg.get("head_dim") is None:
        cfg["head_dim"] = cfg["hidden_size"] // cfg["num_attention_heads"]
    if cfg.get("num_key_value_heads") is None:
        cfg["num_key_value_heads"] = cfg["num_attention_heads"]
    cfg.setdefault("rms_norm_eps", 1e-6)
    cfg.setdefault("hidden_act", "silu")
    if cfg["hidden_act"] not in ("silu", "swish"):
        raise CheckpointError(f"{where}: hidden_act={cfg['hidden_act']!r} is not supported "
                              "(allowed: 'silu')")
    if cfg.get("tie_word_embeddings") is None:
        cfg["tie_word_embeddings"] = False
    return cfg


def _strip_prefix(tensors: Tensors, prefix: str, notes: list[str]) -> Tensors:
    if tensors and all(k.startswith(prefix) for k in tensors):
        notes.append(f"stripped the {prefix!r} prefix from every key")
        return {k[len(prefix):]: v for k, v in tensors.items()}
    return tensors


def _rename_prefixes(tensors: Tensors, renames: dict[str, str], notes: list[str]) -> Tensors:
    out, counts = {}, {}
    for k, v in tensors.items():
        new = k
        for old, rep in renames.items():
            if k.startswith(old):
                new = rep + k[len(old):]
                counts[old] = counts.get(old, 0) + 1
                break
        if new in out:
            raise CheckpointError(f"tensors {k!r} and another key both map to {new!r}")
        out[new] = v
    for old, n in counts.items():
        notes.append(f"renamed {old}* -> {renames[old]}* ({n} tensors)")
    return out


def _drop(tensors: Tensors, pred: Callable[[str], bool], why: str, notes: list[str]) -> Tensors:
    dropped = sorted(k for k in tensors if pred(k))
    if dropped:
        notes.append(f"dropped {', '.join(dropped[:4])}{' ...' if len(dropped) > 4 else ''} "
                     f"({len(dropped)} tensors; {why})")
    return {k: v for k, v in tensors.items() if k not in dropped}


def _int32_map(tensors: Tensors, key: str, notes: list[str]) -> None:
    """``d2t`` / ``token_map`` are int64 on disk; JAX runs without x64, so store int32."""
    ref = tensors.get(key)
    if ref is None or ref.dtype == np.int32:
        return
    if not np.issubdtype(ref.dtype, np.integer):
        raise CheckpointError(f"{key}: expected an integer tensor, found {ref.dtype}")

    def to_int32(a, key=key):
        if a.size and (a.max() > np.iinfo(np.int32).max or a.min() < np.iinfo(np.int32).min):
            raise CheckpointError(f"{key}: values do not fit in int32")
        return a.astype(np.int32)

    tensors[key] = ref.map(to_int32, dtype=np.int32)
    notes.append(f"{key}: {ref.dtype} -> int32")


def _drop_inv_freq(tensors: Tensors, notes: list[str]) -> Tensors:
    return _drop(tensors, lambda k: k.endswith("rotary_emb.inv_freq"),
                 "RoPE frequencies are recomputed from the config", notes)


def _flatten_speculators(cfg: dict, where: str) -> dict:
    """speculators nests the decoder config in ``transformer_layer_config``; lift it."""
    inner = cfg.get("transformer_layer_config")
    if not isinstance(inner, dict):
        raise CheckpointError(f"{where}: speculators config without a "
                              "transformer_layer_config object")
    return copy.deepcopy(inner)


def _reject_true(cfg: dict, fields: tuple[str, ...], where: str, what: str = "") -> None:
    for f in fields:
        if cfg.get(f):
            raise CheckpointError(f"{where}: {f}={cfg[f]!r} is not supported by specjax{what}")


# -- Llama / Qwen2 / Qwen3 (section 5) --------------------------------------------------

def _hf_normalizer(kind: str):
    def normalize(cfg: dict, tensors: Tensors, notes: list[str]):
        mt = cfg.get("model_type")
        if mt is not None and mt != kind:
            notes.append(f"config model_type is {mt!r}; converting as {kind}")
        cfg = _decoder_fields(cfg, notes)
        cfg["model_type"] = kind
        if kind == "qwen2":
            if cfg.get("use_sliding_window"):
                raise CheckpointError("config: use_sliding_window=true is not supported")
            cfg["attention_bias"] = True  # Qwen2 q/k/v always carry a bias; o_proj none
        else:
            cfg.setdefault("attention_bias", False)
        tensors = _drop_inv_freq(tensors, notes)
        if (tensors and not any(k.startswith("model.") for k in tensors)
                and "embed_tokens.weight" in tensors):
            notes.append("added the 'model.' prefix (a bare-decoder checkpoint)")
            tensors = {k if k == "lm_head.weight" else "model." + k: v
                       for k, v in tensors.items()}
        if cfg["tie_word_embeddings"]:
            tensors = _drop(tensors, lambda k: k == "lm_head.weight",
                            "tie_word_embeddings: the head is model.embed_tokens", notes)
        return cfg, tensors
    return normalize


# -- EAGLE-1/2, SafeAILab (section 1) ---------------------------------------------------

def _eagle(cfg: dict, tensors: Tensors, notes: list[str]):
    cfg = _decoder_fields(cfg, notes)
    tensors = _drop_inv_freq(_strip_prefix(tensors, "model.", notes), notes)
    has_bias = "fc.bias" in tensors
    if "bias" not in cfg:
        # SafeAILab defaults bias to true when absent; follow what the file holds.
        cfg["bias"] = has_bias
    cfg["bias"] = bool(cfg["bias"])
    return cfg, tensors


# -- EAGLE-3 (section 2) ------------------------------------------------------------------

def _eagle3_fields(cfg: dict, flat: dict, notes: list[str]) -> dict:
    # ``cfg`` is config.json as found (flat for SafeAILab, the outer speculators config).
    flat["draft_vocab_size"] = cfg.get("draft_vocab_size") or flat["vocab_size"]
    flat["target_hidden_size"] = cfg.get("target_hidden_size") or flat["hidden_size"]
    if "norm_before_residual" not in cfg:
        notes.append("norm_before_residual absent; using False")
    flat["norm_before_residual"] = bool(cfg.get("norm_before_residual", False))
    ids = cfg.get("eagle_aux_hidden_state_layer_ids")
    flat["eagle_aux_hidden_state_layer_ids"] = list(ids) if ids is not None else None
    for f in _PARALLEL_TOKEN_FIELDS[1:]:    # speculators: the outer config holds them
        if cfg.get(f) is not None and flat.get(f) is None:
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


def _eagle3(cfg: dict, tensors: Tensors, notes: list[str]):
    flat = _decoder_fields(cfg, notes)
    return _eagle3_fields(cfg, flat, notes), _eagle3_tensors(tensors, notes)


def _eagle3_speculators(cfg: dict, tensors: Tensors, notes: list[str]):
    _reject_true(cfg, ("norm_before_fc", "fc_norm"), "config",
                 " (newer speculators EAGLE-3 option)")
    flat = _decoder_fields(_flatten_speculators(cfg, "config"), notes,
                           where="config.transformer_layer_config")
    return _eagle3_fields(cfg, flat, notes), _eagle3_tensors(tensors, notes)


# -- DFlash (section 3) -------------------------------------------------------------------

def zlab_default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """z-lab's default ``target_layer_ids`` (z-lab meaning: output of layer id)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [int(round(start + i * (end - start) / (num_draft_layers - 1)))
            for i in range(num_draft_layers)]


def _dflash_common(flat: dict, where: str) -> None:
    types = flat.get("layer_types")
    if types and any(t != "full_attention" for t in types):
        raise CheckpointError(f"{where}: layer_types={types!r}: sliding-window DFlash layers "
                              "are not supported (allowed: all 'full_attention')")
    if flat.get("use_sliding_window"):
        raise CheckpointError(f"{where}: use_sliding_window=true is not supported")
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
    return tensors


def _dflash(cfg: dict, tensors: Tensors, notes: list[str]):
    flat = _decoder_fields(cfg, notes)
    dcfg = cfg.get("dflash_config") or {}
    _reject_true(dcfg, ("use_swa", "attention_sink_bias"), "config.dflash_config")
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
    causal = dcfg.get("causal", cfg.get("is_causal", False))
    for k in ("dflash_config", "auto_map"):
        flat.pop(k, None)
    flat.update(block_size=block_size, mask_token_id=mask, aux_hidden_state_layer_ids=aux,
                causal=bool(causal))
    _dflash_common(flat, "config")
    return flat, _dflash_tensors(tensors, notes)


def _dflash_speculators(cfg: dict, tensors: Tensors, notes: list[str]):
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
                causal=bool(flat.get("is_causal", False)))
    _dflash_common(flat, where)
    return flat, _dflash_tensors(tensors, notes)


# -- Medusa (section 4) -------------------------------------------------------------------

_MEDUSA1_KEY = re.compile(r"^(\d+)\.(\d+)\.(linear\.weight|linear\.bias|weight)$")


def _medusa_fasterdecoding(cfg: dict, tensors: Tensors, notes: list[str]):
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


def _medusa_vllm(cfg: dict, tensors: Tensors, notes: list[str]):
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


# -- parallel drafting (P-EAGLE) -------------------------------------------------------------

#: Where vLLM looks for the parallel-drafting (mask) token of a draft config, in order.
_PARALLEL_TOKEN_FIELDS = ("dflash_config.mask_token_id", "pard_token", "ptd_token_id")


def parallel_drafting_token_id(hf_config: dict | None) -> int | None:
    """The draft's parallel-drafting (mask) token id as vLLM finds it in the draft config:
    ``dflash_config.mask_token_id``, else ``pard_token``, else ``ptd_token_id``; None when
    none is set. A value that is not an integer raises :class:`CheckpointError`."""
    cfg = hf_config or {}
    dcfg = cfg.get("dflash_config") if isinstance(cfg.get("dflash_config"), dict) else {}
    for field, v in zip(_PARALLEL_TOKEN_FIELDS, (dcfg.get("mask_token_id"), cfg.get("pard_token"),
                                                cfg.get("ptd_token_id"))):
        if v is None:
            continue
        if isinstance(v, str) and v.strip().isdigit():
            v = int(v)
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
            raise CheckpointError(f"config: {field}={v!r} must be a non-negative integer token id")
        return int(v)
    return None


def _mask_hidden_size(kind: str, cfg: dict) -> tuple[int, str]:
    """Values ``mask_hidden`` must hold for a normalized ``cfg`` of ``kind``, and how."""
    if kind == "eagle3":
        ids = cfg.get("eagle_aux_hidden_state_layer_ids")
        n_aux = 3 if ids is None else len(ids)
        ht = cfg.get("target_hidden_size") or cfg["hidden_size"]
        return n_aux * ht, f"fc input size = {n_aux} aux states x target_hidden_size {ht}"
    return cfg["hidden_size"], "hidden_size"


def _take_mask_hidden(kind: str, cfg: dict, tensors: Tensors, notes: list[str]) -> Tensors:
    """Move a P-EAGLE ``mask_hidden`` tensor out of ``tensors``, flattened to ``[size]``."""
    ref = tensors.pop("mask_hidden", None)
    if ref is None:
        return {}
    size, what = _mask_hidden_size(kind, cfg)
    if ref.size != size:
        raise CheckpointError(f"mask_hidden has shape {list(ref.shape)} ({ref.size} values); the "
                              f"{kind} head needs {size} values ({what}), e.g. shape [1, 1, {size}]")
    if not np.issubdtype(ref.dtype, np.floating) and ref.dtype.name != "bfloat16":
        raise CheckpointError(f"mask_hidden: expected a float tensor, found {ref.dtype}")
    notes.append(f"mask_hidden {list(ref.shape)} -> params['mask_hidden'] [{size}] "
                 "(the parallel-drafting hidden state)")
    return {"mask_hidden": ref.map(lambda a: a.reshape(-1), shape=(size,))}


# -- the table -----------------------------------------------------------------------------

FORMATS: dict[str, Format] = {f.name: f for f in (
    Format("llama", "llama", "HF LlamaForCausalLM (model.* keys)", _hf_normalizer("llama")),
    Format("qwen2", "qwen2", "HF Qwen2ForCausalLM (model.* keys, q/k/v bias)",
           _hf_normalizer("qwen2")),
    Format("qwen3", "qwen3", "HF Qwen3ForCausalLM (model.* keys, q/k norms)",
           _hf_normalizer("qwen3")),
    Format("eagle", "eagle", "EAGLE-1/2, SafeAILab (fc [H,2H], layers.*)", _eagle),
    Format("eagle3", "eagle3", "EAGLE-3, SafeAILab (fc [H,3Ht], midlayer.*, d2t)", _eagle3),
    Format("eagle3-speculators", "eagle3",
           "EAGLE-3, speculators (layers.0.*, transformer_layer_config)", _eagle3_speculators),
    Format("dflash", "dflash", "DFlash, z-lab (fc, hidden_norm, dflash_config; ids + 1)",
           _dflash),
    Format("dflash-speculators", "dflash",
           "DFlash, speculators (transformer_layer_config, aux ids as given)",
           _dflash_speculators),
    Format("medusa", "medusa", "Medusa-1, FasterDecoding (medusa_lm_head.pt)",
           _medusa_fasterdecoding),
    Format("medusa-vllm", "medusa", "Medusa, vLLM (blocks.*, lm_heads.*, token_map)",
           _medusa_vllm),
)}


def check_format_name(fmt: str) -> None:
    """FormatDetectionError naming the allowed formats unless ``fmt`` is a key of
    :data:`FORMATS`."""
    if fmt not in FORMATS:
        raise FormatDetectionError(f"unknown format {fmt!r} (allowed: {', '.join(FORMATS)})")


def normalize(fmt: str, config: dict, tensors: Tensors) -> Normalized:
    """Normalize a checkpoint read in format ``fmt`` (a key of :data:`FORMATS`)."""
    check_format_name(fmt)
    f = FORMATS[fmt]
    notes: list[str] = []
    cfg, out = f.normalize(dict(config or {}), dict(tensors), notes)
    extra = _take_mask_hidden(f.kind, cfg, out, notes) if f.kind in ("eagle", "eagle3") else {}
    return Normalized(f.kind, fmt, cfg, out, notes, extra)


# -- detection --------------------------------------------------------------------------

_HF_ARCHS = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
             "Qwen3ForCausalLM": "qwen3"}


def detect_format(config: dict, tensors: Tensors, files: list[str] = ()) -> str:
    """The format of a checkpoint, from config.json fields, the key names and file names."""
    config = config or {}
    keys = set(tensors)
    archs = config.get("architectures") or []
    spec_type = config.get("speculators_model_type")
    if spec_type is None and "transformer_layer_config" in config:
        spec_type = config.get("model_type")
    if spec_type == "eagle3":
        return "eagle3-speculators"
    if spec_type == "dflash":
        return "dflash-speculators"
    if spec_type is not None:
        raise FormatDetectionError(f"speculators model type {spec_type!r} is not supported "
                                   "(allowed: eagle3, dflash)")
    if any(k.startswith("midlayer.") for k in keys) and "hidden_norm.weight" not in keys:
        return "eagle3"
    if ("DFlashDraftModel" in archs or "dflash_config" in config
            or ("hidden_norm.weight" in keys and "fc.weight" in keys)):
        return "dflash"
    if (any(f.endswith("medusa_lm_head.pt") for f in files)
            or any(_MEDUSA1_KEY.match(k.removeprefix("medusa_head.")) for k in keys)):
        return "medusa"
    if (config.get("model_type") == "medusa" or "MedusaModel" in archs
            or any(k.removeprefix("medusa_heads.").startswith(("blocks.", "lm_heads."))
                   for k in keys)):
        return "medusa-vllm"
    if "fc.weight" in keys:
        if (config.get("draft_vocab_size") is not None or "d2t" in keys
                or "layers.0.hidden_norm.weight" in keys
                or any("Eagle3" in a for a in archs)):
            return "eagle3"
        return "eagle"
    for a in archs:
        if a in _HF_ARCHS:
            return _HF_ARCHS[a]
    if config.get("model_type") in ("llama", "qwen2", "qwen3"):
        return config["model_type"]
    if any(k.startswith("model.layers.") for k in keys):
        raise FormatDetectionError(
            f"an HF decoder checkpoint of unsupported model_type "
            f"{config.get('model_type')!r} / architectures {archs!r} (allowed: llama, qwen2, "
            "qwen3); pass --format to force one")
    raise FormatDetectionError(
        "cannot tell the checkpoint format from config.json and the tensor names; pass "
        f"--format (allowed: {', '.join(FORMATS)})")

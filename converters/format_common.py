"""What the format modules share: the :class:`Format` record, :class:`Normalized`, the
detection :class:`Probe`, and the readers' and writers' config and tensor helpers."""

from __future__ import annotations

import copy
import dataclasses
import math
from typing import Any, Callable

import numpy as np

from specjax.converters.errors import CheckpointError, short
from specjax.converters.tensor_ref import TensorRef

Tensors = dict[str, TensorRef]
#: A reader: ``(config.json, tensors, notes) -> (normalized hf_config, canonical tensors)``.
Reader = Callable[[dict, Tensors, list[str]], tuple[dict, Tensors]]
#: On-disk files of a writer: file name -> {key: array}.
Files = dict[str, dict[str, np.ndarray]]
#: A writer: ``(ModelConfig, canonical tensors, torch_dtype) -> (config.json, files)``.
Writer = Callable[[Any, dict, str], tuple[dict, Files]]


@dataclasses.dataclass
class Normalized:
    """``tensors``: the canonical tensors (``models/CANONICAL.md``). ``extra_params``:
    top-level params entries outside that table, in their params shape (``mask_hidden``)."""

    kind: str
    format: str
    hf_config: dict
    tensors: Tensors
    notes: list[str] = dataclasses.field(default_factory=list)
    extra_params: Tensors = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Probe:
    """What format detection looks at: config.json, the tensor names, the file names."""

    config: dict
    keys: frozenset
    files: tuple
    archs: tuple
    spec_type: Any

    @staticmethod
    def of(config: dict, keys, files) -> "Probe":
        config = config or {}
        spec_type = config.get("speculators_model_type")
        if spec_type is None and "transformer_layer_config" in config:
            spec_type = config.get("model_type")
        return Probe(config, frozenset(keys), tuple(files),
                     tuple(config.get("architectures") or ()), spec_type)


@dataclasses.dataclass(frozen=True)
class Format:
    """One checkpoint format: ``detect(probe)`` (evaluated in
    ``formats.DETECTION_ORDER``), ``read`` (config.json + tensors -> canonical) and
    ``write`` (its inverse, used by ``export_checkpoint``)."""

    name: str
    kind: str
    description: str
    detect: Callable[[Probe], bool]
    read: Reader
    write: Writer

    @property
    def normalize(self) -> Reader:  # the name before the read / write split
        return self.read


def registry():
    from specjax.models import registry as r  # noqa: PLC0415 (imports jax)
    return r


#: Where vLLM looks for the parallel-drafting (mask) token of a draft config, in order.
PARALLEL_TOKEN_FIELDS = ("dflash_config.mask_token_id", "pard_token", "ptd_token_id")
_PARALLEL_TOKEN_FIELDS = PARALLEL_TOKEN_FIELDS


# -- reading -----------------------------------------------------------------------------------

def _key(where: str, key: str) -> str:
    """``config.json: <key>`` for a key of the config object ``where`` ("config" is
    config.json's top level; "config.a.b" its nested object ``a.b``)."""
    inner = where.partition(".")[2] if where.startswith("config") else where
    return f"config.json: {inner + '.' if inner else ''}{key}"


def _decoder_fields(cfg: dict, notes: list[str], *, where: str = "config") -> dict:
    """The HF decoder fields every kind reads, HF's defaults filled in (rope also from
    transformers-v5 ``rope_parameters``)."""
    cfg = copy.deepcopy(cfg)
    # num_hidden_layers may be 0 (an MTP-only draft such as MiMo's keeps its layers apart)
    for field, lo in (("hidden_size", 1), ("num_attention_heads", 1), ("num_hidden_layers", 0),
                      ("intermediate_size", 1), ("vocab_size", 1)):
        v = cfg.get(field)
        if not isinstance(v, int) or isinstance(v, bool) or v < lo:
            got = "missing" if field not in cfg else short(v)
            raise CheckpointError(f"{_key(where, field)} must be an int >= {lo}, got {got}")
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
    if (not isinstance(theta, (int, float)) or isinstance(theta, bool)
            or not math.isfinite(theta) or theta <= 0):
        raise CheckpointError(f"{_key(where, 'rope_theta')} must be a finite number > 0, "
                              f"got {short(theta)}")
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


def _drop_tied_head(cfg: dict, tensors: Tensors, notes: list[str]) -> Tensors:
    """A decoder's ``lm_head.weight`` dropped when ``tie_word_embeddings`` (the head is the
    embedding)."""
    if not cfg["tie_word_embeddings"]:
        return tensors
    return _drop(tensors, lambda k: k == "lm_head.weight",
                 "tie_word_embeddings: the head is model.embed_tokens", notes)


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


# -- writing -----------------------------------------------------------------------------------

_HF_ARCH = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
            "mistral": "MistralForCausalLM", "ministral": "MinistralForCausalLM"}


def _hf_fields(c, *, head_dim: bool = True, rope_type_key: bool = False) -> dict:
    """The HF decoder fields of ``c`` (LlamaConfig / Qwen*Config names)."""
    d = registry().config_to_dict(c)
    out = {
        "vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size, "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "hidden_act": "silu", "max_position_embeddings": c.max_position_embeddings,
        "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
        "rope_scaling": d["rope_scaling"],
        "attention_dropout": 0.0, "initializer_range": 0.02, "use_cache": True,
    }
    if head_dim:
        out["head_dim"] = c.head_dim
    if rope_type_key and out["rope_scaling"]:
        # transformers < 4.45 (SafeAILab's code) reads rope_scaling["type"].
        out["rope_scaling"] = {**out["rope_scaling"], "type": out["rope_scaling"]["rope_type"]}
    return out


def _speculators_config(algorithm: str, tokens: int, verifier_arch: str) -> dict:
    return {
        "algorithm": algorithm,
        "default_proposal_method": "greedy",
        "proposal_methods": [{"accept_tolerance": 0.0, "proposal_type": "greedy",
                              "speculative_tokens": tokens, "verifier_accept_k": 1}],
        "verifier": {"architectures": [verifier_arch], "name_or_path": None},
    }


def _t2d(d2t: np.ndarray, vocab: int) -> np.ndarray:
    """SafeAILab's ``t2d`` [V] bool: True where a target id is in the draft vocab."""
    t2d = np.zeros(vocab, dtype=np.bool_)
    t2d[np.arange(d2t.shape[0]) + d2t] = True
    return t2d


def _with_t2d(t: dict, c) -> dict:
    if "d2t" in t:
        t["t2d"] = _t2d(t["d2t"], c.vocab_size)
    return t

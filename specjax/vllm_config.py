"""A vLLM ``speculative_config`` dict -> ``SpeculativeConfig``: vLLM's names and values;
unimplemented fields accepted only at vLLM's default, unknown keys refused; ``method``
detected from the draft when absent. Every difference: docs/vllm_config.md.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Mapping

from specjax.checks import ArgumentError, ArgumentTypeError, show

logger = logging.getLogger(__name__)

__all__ = ["from_vllm", "detect_method", "VLLM_DEFAULT_ONLY"]

#: vLLM fields specjax does not implement -> the values accepted (vLLM's default first).
VLLM_DEFAULT_ONLY: dict[str, tuple[Any, ...]] = {
    # v0.20
    "quantization": (None,), "moe_backend": (None,), "revision": (None,),
    "code_revision": (None,), "draft_load_config": (None,), "tensor_parallel_size": (None,),
    "target_model_config": (None,), "target_parallel_config": (None,),
    "draft_model_config": (None,), "draft_parallel_config": (None,),
    "hf_config_override": (None, {}),
    # vLLM v0.33 additions (vllm/config/speculative.py)
    "attention_backend": (None, "auto"), "kv_cache_dtype": (None, "auto"),
    "index_share_for_mtp_iteration": (None,), "disable_eagle_block_drop": (False,),
    "disable_lookahead_block_hashes": (False,), "draft_lm_head_quantization": (None,),
    "use_heterogeneous_vocab": (False,),
    "xpress_topc": (None,), "fly_window_size": (None,),
    "fly_entropy_threshold": (0.3,), "fly_entropy_top_k": (3,),
}

_HEAD_ARCH = (("eagle3", "eagle3"), ("dflash", "dflash"), ("medusa", "medusa"),
              ("eagle", "eagle"))


def _is_dspark(cfg: Mapping[str, Any]) -> bool:
    """A DSpark config: a DSpark architecture, ``dspark_config``, or ``markov_rank`` /
    ``projector_type: dspark`` at the top level or in ``dflash_config`` (its DFlash keys then
    name no other method)."""
    dcfg = cfg.get("dflash_config")
    dcfg = dcfg if isinstance(dcfg, Mapping) else {}
    archs = cfg.get("architectures")
    return (isinstance(archs, list) and any("dspark" in str(a).lower() for a in archs)) \
        or isinstance(cfg.get("dspark_config"), Mapping) or any(
            d.get("markov_rank") is not None or d.get("projector_type") == "dspark"
            for d in (cfg, dcfg))


def _from_config(cfg: Mapping[str, Any]) -> set[str]:
    """Methods the draft's own config names (empty: it says nothing)."""
    found: set[str] = set()
    spec = cfg.get("speculators_config")
    if isinstance(spec, Mapping) and isinstance(spec.get("algorithm"), str):
        alg = spec["algorithm"].lower()
        found.add({"peagle": "eagle3"}.get(alg, alg))
    if isinstance(cfg.get("speculators_model_type"), str):
        found.add(cfg["speculators_model_type"].lower())
    kind = cfg.get("specjax_kind")
    if isinstance(kind, str):
        from specjax.hf import DRAFT_KIND_METHODS

        found.add(DRAFT_KIND_METHODS.get(kind, kind))
    archs = cfg.get("architectures")
    if isinstance(archs, list) and archs and archs[0] == "MiMoForCausalLM":
        found.add("mtp")      # vLLM's MiMo rule: on architectures[0], its MTP modules draft
    elif isinstance(archs, list):
        for a in archs:
            low = str(a).lower()
            for key, method in _HEAD_ARCH:
                if key in low:
                    found.add(method)
                    break
    mt = cfg.get("model_type")
    if isinstance(mt, str):
        low = mt.lower()
        if low in ("eagle", "eagle3", "dflash", "medusa"):
            found.add(low)
        elif low == "mlp_speculator":
            found.add(low)
        elif low == "mtp" or low.endswith("_mtp"):     # vLLM's MTPModelTypes -> "mtp"
            found.add("mtp")
    if _is_dspark(cfg):
        found.add("dspark")
    elif isinstance(cfg.get("dflash_config"), Mapping):
        found.add("dflash")
    return found


def _from_tensors(model: str) -> str | None:
    """The method of the checkpoint's format (``specjax.converters``' detection from config
    and tensor names), or None."""
    from specjax.converters.errors import CheckpointError
    from specjax.converters.formats import FORMATS, detect_format
    from specjax.converters.readers import read_checkpoint
    from specjax.hf import DRAFT_KIND_METHODS

    if (Path(model) / "specjax.json").is_file():
        return None
    try:
        ck = read_checkpoint(model)
        fmt = detect_format(ck.config, ck.tensors, ck.files)
    except (CheckpointError, ValueError, OSError):
        return None
    return DRAFT_KIND_METHODS.get(FORMATS[fmt].kind)


def detect_method(model: str, config: Mapping[str, Any] | None = None) -> str:
    """The method of the draft at ``model`` (its config read when ``config`` is None)."""
    is_dir = Path(model).is_dir()
    if config is None and is_dir:
        from specjax.hf import read_checkpoint_config

        config = read_checkpoint_config(model)
    found = _from_config(config or {})
    by_tensors = _from_tensors(model) if is_dir else None
    if "mtp" in found and by_tensors == "draft_model":
        by_tensors = None     # a whole MiMo checkpoint: its trunk reads as a decoder, its MTP drafts
    if by_tensors is not None and found and by_tensors not in found:
        found.add(by_tensors)
    if len(found) > 1:
        raise ArgumentError(f"model={show(model)}: its config and tensors name several methods "
                            f"{sorted(found)}; set method explicitly")
    if found:
        return found.pop()
    if by_tensors is not None:
        return by_tensors
    low = model.lower()          # vLLM v0.20's fallback, in its order
    if "eagle-" in low:
        return "eagle"
    if "eagle3" in low:
        return "eagle3"
    if "dflash" in low:
        return "dflash"
    if "dspark" in low:          # vLLM 0.34: after dflash
        return "dspark"
    return "draft_model"


def from_vllm(d: Mapping[str, Any], fields: tuple[str, ...], **overrides: Any) -> dict:
    """``SpeculativeConfig`` keyword arguments (``fields``: its field names) of a vLLM
    ``speculative_config`` dict, ``overrides`` applied on top under the same rules."""
    if not isinstance(d, Mapping):
        raise ArgumentTypeError(f"speculative_config must be a dict, got {show(d)}")
    d = {**d, **overrides}
    bad = [k for k in d if not isinstance(k, str)]
    if bad:
        raise ArgumentTypeError(f"speculative_config keys must be str, got {show(bad)}")
    own = set(fields)
    unknown = sorted(set(d) - own - set(VLLM_DEFAULT_ONLY))
    if unknown:
        raise ArgumentError(f"speculative_config: unknown key(s) {show(unknown, 200)}; known: "
                            f"{show(sorted(own | set(VLLM_DEFAULT_ONLY)), 1200)}")
    for key, allowed in VLLM_DEFAULT_ONLY.items():
        if key in d and not any(d[key] == a and type(d[key]) is type(a) for a in allowed):
            raise ArgumentError(f"speculative_config {key}={show(d[key])} is not implemented by "
                                f"specjax; only vLLM's default {show(allowed[0])} is accepted")
    kw = {k: v for k, v in d.items() if k in own}
    if kw.get("rejection_sample_method") == "standard":
        # v0.33's name of the default: the ratio test with q = 1 for greedy drafts, which is
        # v0.20's "strict" on the V1 runner (no draft probabilities); "block" / "fly" stay refused
        kw["rejection_sample_method"] = "strict"
    if isinstance(kw.get("synthetic_acceptance_rates"), list):
        kw["synthetic_acceptance_rates"] = tuple(kw["synthetic_acceptance_rates"])
    model, method = kw.get("model"), kw.get("method")
    if model is not None and not isinstance(model, str):
        raise ArgumentTypeError(f"speculative_config model must be a path str, got {show(model)}")
    if method is not None and not isinstance(method, str):
        raise ArgumentTypeError(f"speculative_config method must be a str, got {show(method)}")
    if model is not None and model not in ("ngram", "[ngram]"):
        cfg = None
        if Path(model).is_dir():
            from specjax.hf import read_checkpoint_config

            cfg = read_checkpoint_config(model)
        elif model.startswith(("/", ".", "~")):
            raise FileNotFoundError(f"speculative_config model={show(model)}: no such directory "
                                    "(a local path; specjax downloads nothing)")
        if method is None:
            kw["method"] = detect_method(model, cfg)
            logger.info("speculative_config: method %r detected for model %r", kw["method"], model)
        elif cfg is not None and method in ("eagle", "eagle3", "dflash", "dspark", "medusa",
                                            "mtp", "draft_model"):
            found = _from_config(cfg)
            if not (method == "mtp" and "mtp" in found):
                found |= {_from_tensors(model)} - {None}
            if found and method not in found:
                raise ArgumentError(f"speculative_config method={method!r} but model={show(model)} "
                                    f"is a {sorted(found)[0]!r} checkpoint by its config")
    if kw.get("method") == "mtp" or str(kw.get("method") or "").endswith("_mtp"):
        _mtp_default_k(kw)
    return kw


def _mtp_default_k(kw: dict) -> None:
    """vLLM's MTP default k: the checkpoint's ``num_nextn_predict_layers`` (1 when absent)."""
    model = kw.get("model")
    if kw.get("num_speculative_tokens") is not None or model is None or not Path(model).is_dir():
        return
    from specjax.hf import read_checkpoint_config

    cfg = read_checkpoint_config(model)
    inner = cfg.get("config") if isinstance(cfg.get("config"), Mapping) else {}
    n = cfg.get("num_nextn_predict_layers", inner.get("num_nextn_predict_layers", 1))
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ArgumentError(f"model={show(model)}: config num_nextn_predict_layers={show(n)} must "
                            "be an int >= 1 (the number of MTP modules)")
    kw["num_speculative_tokens"] = n
    logger.info("speculative_config: num_speculative_tokens defaults to n_predict=%d (mtp)", n)

"""DSpark config keys (vLLM 0.34 ``Qwen3DSparkModel``) <-> ``ModelConfig``'s DSpark fields;
top-level keys first, then ``dspark_config``, then ``dflash_config``."""

from __future__ import annotations

from typing import Any, Mapping

from specjax.checks import ArgumentTypeError, check_int, show

HEAD_TYPES = ("vanilla", "gated", "rnn")
_KEYS = ("markov_rank", "markov_head_type", "enable_confidence_head",
         "confidence_head_with_markov", "sample_from_anchor")


def _lookup(hf: Mapping, key: str) -> Any:
    for d in (hf, hf.get("dspark_config"), hf.get("dflash_config")):
        if isinstance(d, Mapping) and d.get(key) is not None:
            return d[key]
    return None


def prepare(hf: Mapping) -> dict:
    """``hf`` with DSpark's aliases of DFlash keys filled in (``dspark_block_size``,
    ``dspark_noise_token_id``), for the DFlash parse."""
    hf = dict(hf)
    if hf.get("block_size") is None and hf.get("dspark_block_size") is not None:
        hf["block_size"] = hf["dspark_block_size"]
    dcfg = hf.get("dflash_config") if isinstance(hf.get("dflash_config"), Mapping) else {}
    if hf.get("mask_token_id") is None and dcfg.get("mask_token_id") is None \
            and hf.get("dspark_noise_token_id") is not None:
        hf["mask_token_id"] = hf["dspark_noise_token_id"]
    return hf


def fields(hf: Mapping) -> dict[str, Any]:
    """The DSpark ``ModelConfig`` fields of a config dict; ``markov_rank`` is required."""
    r = _lookup(hf, "markov_rank")
    if r is None:
        raise ValueError("config markov_rank is required for a DSpark head (top level, "
                         "dspark_config or dflash_config)")
    out: dict[str, Any] = dict(markov_rank=check_int("config markov_rank", r, 1, 1 << 16))
    t = _lookup(hf, "markov_head_type")
    if t is not None and t not in HEAD_TYPES:
        raise ValueError(f"config markov_head_type={show(t)}; allowed: {HEAD_TYPES}")
    out["markov_head_type"] = t or "vanilla"
    for key, default in (("enable_confidence_head", False), ("confidence_head_with_markov", False),
                         ("sample_from_anchor", True)):
        v = _lookup(hf, key)
        if v is not None and not isinstance(v, bool):
            raise ArgumentTypeError(f"config {key} must be true or false, got {show(v)}")
        out[key] = default if v is None else v
    return out


def to_dict(c: Any) -> dict[str, Any]:
    """The top-level keys :func:`fields` reads back."""
    return {k: getattr(c, k) for k in _KEYS}


def reset(c: Any) -> dict[str, Any]:
    """``ModelConfig.replace`` arguments turning a DSpark config into its DFlash backbone's."""
    return dict(kind="dflash", markov_rank=0, markov_head_type="vanilla",
                enable_confidence_head=False, confidence_head_with_markov=False,
                sample_from_anchor=True)

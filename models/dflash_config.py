"""DFlash per-layer attention keys (vLLM 0.34 ``qwen3_dflash.py``) <-> ``ModelConfig``:
sliding windows, causality and attention sinks, as ``hf_config`` reads and writes them."""

from __future__ import annotations

from typing import Any, Mapping

from specjax.checks import ArgumentError, ArgumentTypeError, check_int, show
from specjax.models.config import ModelConfig


def _flag(hf: Mapping, key: str, where: str = "") -> bool | None:
    v = hf.get(key)
    if v is not None and not isinstance(v, bool):
        raise ArgumentTypeError(f"config {where}{key} must be true or false, got {show(v)}")
    return v


def attention_fields(hf: Mapping, dcfg: Mapping, n: int, speculators: bool,
                     win: int | None, lt: tuple[str, ...] | None) -> dict[str, Any]:
    """A DFlash draft's per-layer attention as vLLM's ``qwen3_dflash.py`` resolves it
    (``_resolve_layer_attention``, ``_dflash_layer_causal``; Qwen2/Qwen3 configs first
    drop ``sliding_window`` without ``use_sliding_window`` and fill ``layer_types``, as
    transformers does; speculators' ``sliding_window_non_causal`` defaults to true) ->
    ModelConfig fields; ``win``, ``lt``: the checked ``sliding_window``, ``layer_types``.
    Raises naming the key: a sliding layer with no window, a non-bool flag,
    ``attention_value_scale`` other than 1."""
    for where, d in (("dflash_config.", dcfg), ("", hf)):
        vs = d.get("attention_value_scale")
        if vs is not None and vs != 1:
            raise ValueError(f"config {where}attention_value_scale={show(vs)}: scaling V is not "
                             "implemented for DFlash (1 or null only)")
    use_swa = bool(_flag(dcfg, "use_swa", "dflash_config."))
    if hf.get("model_type", "qwen3") in ("qwen2", "qwen3"):
        if not _flag(hf, "use_sliding_window"):
            win = None
        elif "sliding_window" not in hf:
            win = 4096                                   # Qwen3Config's default
        if lt is None:
            mwl = hf.get("max_window_layers")
            mwl = check_int("config max_window_layers", 28 if mwl is None else mwl, 0, 1 << 20)
            lt = tuple("sliding_attention" if win is not None and i >= mwl else "full_attention"
                       for i in range(n))
    swa = dcfg.get("swa_window_size")
    if swa is not None:
        win = check_int("config dflash_config.swa_window_size", swa, 1, 1 << 30)
    any_sliding = lt is not None and "sliding_attention" in lt
    sliding = (tuple(t == "sliding_attention" for t in lt) if lt is not None and not
               (use_swa and not any_sliding) else (use_swa,) * n)
    if any(sliding) and win is None:
        why = "dflash_config.use_swa" if use_swa and not any_sliding else "layer_types"
        raise ArgumentError(f"config {why} makes DFlash layers sliding but no window is set "
                            "(dflash_config.swa_window_size, or sliding_window with "
                            "use_sliding_window for a Qwen config)")
    # causality: is_causal > causal (specjax's key) > dflash_config.causal >
    # speculators' sliding_window_non_causal > "causal iff layer_types says sliding"
    causal = _flag(hf, "is_causal")
    order = [("causal", hf, False), ("causal", dcfg, False)]
    if speculators:
        swnc = hf.get("sliding_window_non_causal")
        hf = dict(hf, sliding_window_non_causal=True if swnc is None else swnc)
        order.append(("sliding_window_non_causal", hf, True))
    for key, d, neg in order:
        if causal is None:
            v = _flag(d, key, "dflash_config." if d is dcfg else "")
            causal = None if v is None else v != neg
    layers = ((causal,) * n if causal is not None else (False,) * n if lt is None else
              tuple(t == "sliding_attention" for t in lt))
    sinks = _flag(dcfg, "attention_sink_bias", "dflash_config.")
    if sinks is None:
        sinks = _flag(hf, "add_swa_attention_sink_bias")
    return dict(sliding_window=win if any(sliding) else 0,
                layer_types=None if all(sliding) or not any(sliding) else
                tuple("sliding_attention" if x else "full_attention" for x in sliding),
                causal=layers[0], causal_layers=None if len(set(layers)) == 1 else layers,
                attention_sinks=bool(sinks))


def attention_dict(c: ModelConfig) -> dict[str, Any]:
    """The keys :func:`attention_fields` reads back into ``c``'s attention fields."""
    d: dict[str, Any] = {}
    dc: dict[str, Any] = {"attention_sink_bias": c.attention_sinks}
    if c.sliding_window:
        dc["swa_window_size"] = c.sliding_window
        dc["use_swa"] = c.layer_types is None
    if c.causal_layers is None:
        d["is_causal"] = c.causal
    elif c.causal_layers != tuple(c.layer_window(i) is not None
                                  for i in range(c.num_hidden_layers)):
        raise ValueError("causal_layers must be uniform or causal exactly on the sliding "
                         f"layers to be written as a DFlash config, got {c.causal_layers}")
    d["dflash_config"] = dc
    return d

"""HF config dict -> ``ModelConfig`` (:func:`config_from_hf`) and back
(:func:`config_to_dict`): the config half of models/CANONICAL.md.

Every field is type-checked and bounded (``specjax.checks``); an attention variant that
is not implemented (a sliding window shorter than ``max_position_embeddings``) is refused
by name.
"""

from __future__ import annotations

import warnings
from typing import Any, Mapping

from specjax.checks import ArgumentError, ArgumentTypeError, check_int, check_number, show
from specjax.models import dflash_config, dspark_config, moe_config
from specjax.models.config import DECODER_KINDS, KINDS, LAYER_TYPES, ModelConfig, ROPE_TYPES

__all__ = ["config_from_hf", "config_to_dict", "MAX_LAYERS", "MAX_DIM"]

#: Bounds on a config's sizes (a 100000-layer config is a typo or an attack, not a model).
MAX_LAYERS = 4096
MAX_DIM = 1 << 20
MAX_VOCAB = 1 << 24

_PRESENCE = ("has_embed_tokens", "has_lm_head", "has_d2t", "has_token_map")
#: vLLM's EAGLE-3 norm options (``llama_eagle3.py``; docs/models.md, ModelConfig fields).
EAGLE3_NORM_FLAGS = ("norm_before_fc", "fc_norm", "norm_output")


def _eagle3_norm_flags(hf: Mapping) -> dict:
    """The EAGLE-3 norm options as vLLM 0.33+ reads them (``eagle_config.norm_before_fc``
    overriding the top-level key; the speculators updater copies ``norm_before_fc``, so a
    speculators head with it, RedHatAI gpt-oss-20b, runs with ``input_norm``)."""
    ec = _eagle_config(hf)
    out = {f: _bool(hf, f, False) for f in EAGLE3_NORM_FLAGS}
    if ec and "norm_before_fc" in ec:
        out["norm_before_fc"] = _bool(ec, "norm_before_fc", False)
    if ec and ec.get("use_aux_hidden_state") is False:
        raise ValueError("config eagle_config.use_aux_hidden_state=false is not supported "
                         "(specjax's EAGLE-3 head always reads the aux hidden states)")
    return out


def _eagle_config(hf: Mapping) -> Mapping:
    ec = hf.get("eagle_config")
    if ec is not None and not isinstance(ec, Mapping):
        raise ArgumentTypeError(f"config eagle_config must be an object, got {show(ec)}")
    return ec or {}


def eagle3_aux_layer_ids(hf: Mapping) -> tuple[tuple[int, ...] | None, str | None]:
    """An EAGLE-3 config's aux layers as specjax stores them (the *input* of each target
    layer), and a warning or None (docs/vllm_config.md, "Aux-layer ids"). The top-level
    ``eagle_aux_hidden_state_layer_ids`` (speculators / vLLM) is input-of-layer already;
    the nested ``eagle_config.eagle_aux_hidden_state_layer_ids`` (SpecForge, SGLang,
    ModelOpt) means "the output of layer i", the input of layer ``i + 1``. vLLM 0.34 does
    not tap the nested list (only sizes ``fc`` by it): the warning names both taps."""
    top = hf.get("eagle_aux_hidden_state_layer_ids")
    if top is not None:
        return _aux_ids(top), None
    nested = _eagle_config(hf).get("eagle_aux_hidden_state_layer_ids")
    if nested is None:
        return None, None
    ids = tuple(i + 1 for i in _aux_ids(nested))
    warning = (f"eagle_config.eagle_aux_hidden_state_layer_ids={list(nested)} (output of each "
               f"layer, SpecForge/SGLang/ModelOpt) -> specjax taps the inputs of layers "
               f"{list(ids)}; vLLM 0.34 does not read the nested list for tapping and would "
               f"tap its default (2, L//2, L-3) instead (e.g. L=24: [2, 12, 21])")
    return ids, warning


def _check_truncated_vocab(kind: str, hf: Mapping, vocab: int, draft_vocab: int) -> None:
    """``truncated_vocab_size`` (older vLLM EAGLE code: a truncated ``lm_head`` over the
    first ids via ``token_map``). vLLM 0.34 stores it but no model reads it; the draft vocab
    comes from ``draft_vocab_size`` and ``d2t``. Accepted when it says the same thing (no
    truncation, or equal to the draft vocab), refused by name otherwise."""
    tv = hf.get("truncated_vocab_size")
    if tv is None:
        return
    tv = check_int("config truncated_vocab_size", tv, 1, MAX_VOCAB)
    if tv in (vocab, draft_vocab):
        return
    raise ValueError(f"config truncated_vocab_size={tv} is refused for a {kind!r} head: it "
                     f"differs from draft_vocab_size={draft_vocab} and vocab_size={vocab}; vLLM "
                     "0.34 ignores the key and sizes the draft vocabulary by draft_vocab_size "
                     "and d2t, so the two engines would disagree on the head's vocabulary")


# ---------------------------------------------------------------------------------------
# config


def _get(hf: Mapping, *names, default=None):
    for n in names:
        if n in hf and hf[n] is not None:
            return hf[n]
    return default


def _int(hf: Mapping, name: str, lo: int = 1, hi: int = MAX_DIM, *alts: str, default: Any = None,
         why: str = "") -> int:
    """The config's integer ``name`` (or the first of ``alts`` present) in ``[lo, hi]``;
    a missing required key is a KeyError-like ValueError naming it."""
    v = _get(hf, name, *alts, default=default)
    if v is None:
        raise ArgumentError(f"config key {name!r} is missing (an int in [{lo}, {hi}])")
    if isinstance(v, float) and v.is_integer():
        v = int(v)                                   # 4096.0 in a hand-edited config.json
    return check_int(f"config {name}", v, lo, hi, why=why)


def _float(hf: Mapping, name: str, default: float, lo: float | None = None) -> float:
    v = _get(hf, name, default=default)
    return check_number(f"config {name}", v, lo)


def _bool(hf: Mapping, name: str, default: bool) -> bool:
    v = hf.get(name, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ArgumentTypeError(f"config {name} must be true or false, got {show(v)}")
    return v


def _freeze(v):
    if isinstance(v, dict):
        return tuple(sorted((k, _freeze(x)) for k, x in v.items()))
    if isinstance(v, (list, tuple)):
        return tuple(_freeze(x) for x in v)
    return v


def _thaw(v):
    if isinstance(v, tuple) and v and all(isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str) for x in v):
        return {k: _thaw(x) for k, x in v}
    if isinstance(v, tuple):
        return [_thaw(x) for x in v]
    return v


#: transformers v5 ``GptOssConfig`` RoPE when a ``gpt_oss`` config has no rope keys.
GPT_OSS_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "truncate": False, "original_max_position_embeddings": 4096}


def _rope(kind: str, hf: Mapping) -> tuple[float, tuple | None]:
    """``(rope_theta, frozen rope_scaling or None)`` from ``rope_theta`` + ``rope_scaling``
    (``type`` or ``rope_type``) or transformers-v5 ``rope_parameters``; a ``gpt_oss``
    kind or ``model_type`` without either gets θ 150000 and YaRN (``GPT_OSS_ROPE``), as
    transformers v5's ``GptOssConfig``. M-RoPE is refused by name."""
    params = hf.get("rope_parameters") or {}
    if not isinstance(params, Mapping):
        raise ArgumentTypeError(f"config rope_parameters must be an object, got {show(params)}")
    gpt_oss = hf.get("model_type") == "gpt_oss" or kind == "gpt_oss"
    theta = _get(hf, "rope_theta", default=params.get("rope_theta"))
    if theta is None:
        theta = 1e6 if kind == "dflash" else 150000.0 if gpt_oss else 10000.0
    theta = check_number("config rope_theta", theta, 1e-6)
    scaling = hf.get("rope_scaling")
    if scaling is None and params:
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    if scaling is None and gpt_oss:
        scaling = dict(GPT_OSS_ROPE)
    if scaling is not None and not isinstance(scaling, Mapping):
        raise ArgumentTypeError(f"config rope_scaling must be null or an object, got {show(scaling)}")
    if scaling:
        scaling = dict(scaling)
        if "rope_type" not in scaling and "type" in scaling:
            scaling["rope_type"] = scaling.pop("type")
        scaling.pop("type", None)
        rtype = scaling.get("rope_type", "default")
        if rtype == "mrope" or scaling.get("mrope_section") is not None:
            raise ValueError(f"config rope_scaling: M-RoPE (rope_type {rtype!r}, mrope_section) is "
                             "not implemented by specjax")
        if rtype not in ROPE_TYPES:
            raise ValueError(f"rope_scaling.rope_type must be one of {ROPE_TYPES}, got {rtype!r}")
        if rtype == "default":
            scaling = None
        else:
            if rtype in ("llama3", "yarn", "longrope"):   # transformers' standardize_rope_params
                scaling.setdefault("original_max_position_embeddings", _get(
                    hf, "original_max_position_embeddings", "max_position_embeddings", default=2048))
            _check_rope_scaling(rtype, scaling)
    return float(theta), (_freeze(scaling) if scaling else None)


#: Keys each implemented ``rope_type`` needs (transformers' ``_validate_*_rope_parameters``).
_ROPE_KEYS = {"linear": ("factor",),
              "dynamic": ("factor",),
              "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                         "original_max_position_embeddings"),
              "yarn": ("factor", "original_max_position_embeddings"),
              "longrope": ("short_factor", "long_factor", "original_max_position_embeddings")}
#: Optional numeric keys (None: transformers' default).
_ROPE_OPTIONAL = {"yarn": ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim"),
                  "longrope": ("attention_factor", "factor")}


def _check_rope_scaling(rtype: str, scaling: Mapping) -> None:
    for key in _ROPE_KEYS.get(rtype, ()):
        if key not in scaling or scaling[key] is None:
            raise ArgumentError(f"config rope_scaling: rope_type {rtype!r} needs {key!r} "
                                f"(keys: {', '.join(_ROPE_KEYS[rtype])}), got {show(dict(scaling), 200)}")
        if key.endswith("_factor") and rtype == "longrope":
            v = scaling[key]
            if isinstance(v, (str, bytes)) or not isinstance(v, (list, tuple)):
                raise ArgumentTypeError(f"config rope_scaling.{key} must be a list of numbers, "
                                        f"got {show(v)}")
            for x in v:
                check_number(f"config rope_scaling.{key}[]", x, 1e-6)
            continue
        lo = 1 if key == "original_max_position_embeddings" else 1e-6
        check_number(f"config rope_scaling.{key}", scaling[key], lo)
    for key in _ROPE_OPTIONAL.get(rtype, ()):
        if scaling.get(key) is not None:
            check_number(f"config rope_scaling.{key}", scaling[key], 0.0)
    if rtype == "yarn" and not isinstance(scaling.get("truncate", True), bool):
        raise ArgumentTypeError(f"config rope_scaling.truncate must be true or false, got "
                                f"{show(scaling['truncate'])}")


#: Kinds whose sliding windows specjax runs (the rest refuse a binding window by name).
WINDOW_KINDS = ("mistral", "ministral", "gemma3", "qwen2", "qwen3", "eagle3", "gpt_oss")


def _window_int(hf: Mapping, key: str = "sliding_window") -> int | None:
    win = hf.get(key)
    if win is not None and not (isinstance(win, int) and not isinstance(win, bool) and win >= 1):
        raise ArgumentTypeError(f"config {key} must be null or an int >= 1, got {show(win)}")
    return win


def _layer_types(hf: Mapping, n_layers: int) -> tuple[str, ...] | None:
    """``layer_types`` checked (one of :data:`LAYER_TYPES` per layer), or None."""
    lt = hf.get("layer_types")
    if lt is None:
        return None
    if not isinstance(lt, (list, tuple)) or len(lt) != n_layers or any(
            t not in LAYER_TYPES for t in lt):
        raise ArgumentTypeError(f"config layer_types must list num_hidden_layers={n_layers} "
                                f"entries of {LAYER_TYPES}, got {show(lt)}")
    return tuple(lt)


def _window(kind: str, hf: Mapping, n_layers: int) -> tuple[int, tuple[str, ...] | None]:
    """``(sliding_window, layer_types)`` as transformers applies them to ``kind``:
    Mistral: a set window on every layer unless ``layer_types`` says otherwise; Ministral:
    ``layer_types`` (default: every layer sliding when a window is set); Qwen2 / Qwen3: only
    with ``use_sliding_window``, on layers ``>= max_window_layers`` unless ``layer_types``
    is given; EAGLE-3 heads (vLLM ``llama.py``): head layer ``j`` slides iff
    ``layer_types[j]`` says so (the list may be the target's, longer), a bare window is
    ignored. Gemma 3 is read by its own reader."""
    flag = hf.get("use_sliding_window")
    if flag is not None and not isinstance(flag, bool):
        raise ArgumentTypeError(f"config use_sliding_window must be true or false, got {show(flag)}")
    win = _window_int(hf)
    if kind == "eagle3":
        lt = hf.get("layer_types")
        if lt is None:
            return 0, None
        if not isinstance(lt, (list, tuple)) or len(lt) < n_layers:
            raise ArgumentTypeError(f"config layer_types must list at least num_hidden_layers="
                                    f"{n_layers} entries, got {show(lt)}")
        if "sliding_attention" not in lt[:n_layers]:
            return 0, None
        hf = {"layer_types": list(lt[:n_layers])}
    lt = _layer_types(hf, n_layers)
    if kind in ("qwen2", "qwen3"):
        if not flag:
            return 0, None
        if win is None:
            raise ArgumentError("config use_sliding_window=true needs sliding_window (an int)")
        if lt is None:
            mwl = check_int("config max_window_layers", hf.get("max_window_layers", n_layers),
                            0, MAX_LAYERS)
            lt = tuple("sliding_attention" if i >= mwl else "full_attention"
                       for i in range(n_layers))
    if win is None:
        if lt is not None and "sliding_attention" in lt:
            raise ArgumentError("config layer_types has sliding_attention layers but "
                                "sliding_window is null")
        return 0, None
    return win, lt


def _check_window(hf: Mapping, n_layers: int) -> None:
    """Refuse, naming the key, a sliding window that can bind in a kind outside
    :data:`WINDOW_KINDS` (shorter than ``max_position_embeddings``, or a sliding layer in
    ``layer_types``); a window with ``use_sliding_window: false`` is ignored."""
    n_pos = _get(hf, "max_position_embeddings", default=2048)
    flag = hf.get("use_sliding_window")
    if flag is not None and not isinstance(flag, bool):
        raise ArgumentTypeError(f"config use_sliding_window must be true or false, got {show(flag)}")
    win = _window_int(hf)
    lt = _layer_types(hf, n_layers) or ()
    if "sliding_attention" in lt:
        raise ValueError(f"layer_types must all be 'full_attention' for this kind, got "
                         f"{show(sorted(set(lt)))}")
    if "use_sliding_window" in hf and not flag:
        return
    if flag and win is None:
        raise ArgumentError("config use_sliding_window=true needs sliding_window (an int)")
    if win is not None and isinstance(n_pos, int) and win < n_pos:
        flagged = "use_sliding_window=true with " if flag else ""
        raise ArgumentError(f"config {flagged}sliding_window={win} (< max_position_embeddings="
                            f"{n_pos}): "
                            "sliding-window attention is not implemented for this kind; a "
                            "Mistral checkpoint converts with --format mistral")


#: transformers' ``Gemma3TextConfig`` defaults for keys a hub config may omit (a
#: ``Gemma3ForConditionalGeneration`` ``text_config`` often lists only the sizes).
GEMMA3_DEFAULTS = dict(vocab_size=262208, hidden_size=2304, intermediate_size=9216,
                       num_hidden_layers=26, num_attention_heads=8, num_key_value_heads=4,
                       head_dim=256, max_position_embeddings=131072, rms_norm_eps=1e-6,
                       tie_word_embeddings=True, query_pre_attn_scalar=256, sliding_window=4096,
                       rope_theta=1e6, rope_local_base_freq=1e4)


def _gemma3(hf: Mapping) -> tuple[dict, dict]:
    """A Gemma 3 text config (``gemma3_text``, or ``gemma3``'s ``text_config``) ->
    ``(hf normalized for config_from_hf, Gemma fields)``: ``hidden_activation``,
    ``rope_parameters`` per layer type (or ``rope_theta`` + ``rope_scaling`` for full
    layers, ``rope_local_base_freq`` for sliding ones), ``layer_types`` (or
    ``sliding_window_pattern``: layer i slides iff ``(i + 1) % pattern != 0``). Refuses
    ``attn_logit_softcapping`` and ``use_bidirectional_attention`` by name."""
    if hf.get("model_type") == "gemma3" or "text_config" in hf:
        text = hf.get("text_config") or {}
        if not isinstance(text, Mapping):
            raise ArgumentTypeError(f"config text_config must be an object, got {show(text)}")
        hf = {**{k: v for k, v in hf.items() if k in _PRESENCE}, **text}
    hf = dict(hf)
    for k, v in GEMMA3_DEFAULTS.items():
        hf.setdefault(k, v)
    if hf.get("attn_logit_softcapping") is not None:
        raise ValueError(f"config attn_logit_softcapping={show(hf['attn_logit_softcapping'])} is "
                         "not supported (specjax's attention has no logit soft-capping; Gemma 3 "
                         "configs set it to null)")
    if hf.get("use_bidirectional_attention"):
        raise ValueError("config use_bidirectional_attention=true is not supported (a causal "
                         "target only)")
    act = hf.pop("hidden_activation", None) or hf.get("hidden_act") or "gelu_pytorch_tanh"
    hf["hidden_act"] = act
    rp = hf.pop("rope_parameters", None)
    local = hf.get("rope_local_base_freq")
    if rp is not None:
        if not isinstance(rp, Mapping) or not all(
                isinstance(rp.get(t, {}), Mapping) for t in ("full_attention", "sliding_attention")):
            raise ArgumentTypeError("config rope_parameters must map full_attention / "
                                    f"sliding_attention to objects, got {show(rp)}")
        full, slide = dict(rp.get("full_attention") or {}), dict(rp.get("sliding_attention") or {})
        if slide.get("rope_type", slide.get("type", "default")) != "default":
            raise ValueError("config rope_parameters.sliding_attention must be default RoPE, got "
                             f"{show(slide)}")
        hf["rope_theta"] = full.pop("rope_theta", hf["rope_theta"])
        local = slide.get("rope_theta", local)
        hf["rope_scaling"] = full or None
    if hf.get("layer_types") is None:
        if hf.get("sliding_window") is None:
            hf.pop("layer_types", None)
        else:
            pat = check_int("config sliding_window_pattern", _get(
                hf, "sliding_window_pattern", "_sliding_window_pattern", default=6), 1, MAX_LAYERS)
            n = _int(hf, "num_hidden_layers", 1, MAX_LAYERS)
            hf["layer_types"] = ["sliding_attention" if (i + 1) % pat else "full_attention"
                                 for i in range(n)]
    cap = hf.get("final_logit_softcapping")
    hf["qk_norm"] = True
    return hf, dict(
        query_pre_attn_scalar=float(check_number("config query_pre_attn_scalar",
                                                 hf["query_pre_attn_scalar"], 1e-6)),
        rope_local_base_freq=float(check_number("config rope_local_base_freq", local, 1e-6)),
        final_logit_softcapping=0.0 if cap is None else float(
            check_number("config final_logit_softcapping", cap, 1e-6)))


def _aux_ids(v) -> tuple[int, ...] | None:
    if v is None:
        return None
    if isinstance(v, (str, bytes)) or not isinstance(v, (list, tuple)):
        raise ArgumentTypeError(f"config aux layer ids must be a list of ints, got {show(v)}")
    return tuple(check_int("config aux layer id", i, 0, MAX_LAYERS) for i in v)


def config_from_hf(kind: str, hf_config: Mapping[str, Any]) -> ModelConfig:
    """Normalized HF config dict (CANONICAL.md) -> frozen ``ModelConfig``.

    Also accepts the raw variants it can normalize unambiguously: speculators'
    nested ``transformer_layer_config``, transformers-v5 ``rope_parameters``, z-lab
    ``dflash_config`` (``target_layer_ids`` + 1), Medusa ``medusa_num_heads``. Unsupported
    features raise ValueError naming the field.
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if not isinstance(hf_config, Mapping):
        raise ArgumentTypeError(f"hf_config must be a dict (config.json's object), got "
                                f"{show(hf_config)}")
    if kind == "dspark":      # a DFlash backbone + the Markov / confidence heads
        base = config_from_hf("dflash", dspark_config.prepare(hf_config))
        return base.replace(kind="dspark", **dspark_config.fields(hf_config))
    hf = dict(hf_config)
    speculators = "speculators_config" in hf or "speculators_model_type" in hf
    nested = hf.get("transformer_layer_config")
    if isinstance(nested, Mapping):
        for k, v in nested.items():
            hf.setdefault(k, v)

    if kind == "medusa":
        if "num_heads" not in hf:
            for k in list(hf):
                if "num" in k and "heads" in k:
                    hf["num_heads"] = hf[k]
        if "num_hidden_layers" not in hf:
            for k in list(hf):
                if "num" in k and "layers" in k:
                    hf["num_hidden_layers"] = hf[k]
        return ModelConfig(
            kind=kind,
            vocab_size=_int(hf, "vocab_size", 1, MAX_VOCAB),
            hidden_size=_int(hf, "hidden_size"),
            num_heads=_int(hf, "num_heads", 1, 64),
            num_hidden_layers=_int(hf, "num_hidden_layers", 1, MAX_LAYERS, default=1),
            fc_bias=_bool(hf, "medusa_fc_bias", False),
            truncated_vocab_size=_int(hf, "truncated_vocab_size", 0, MAX_VOCAB, default=0),
            original_lm_head=_bool(hf, "original_lm_head", False),
            logit_scale=_float(hf, "logit_scale", 1.0),
            has_token_map=hf.get("has_token_map"),
        )

    gemma: dict[str, Any] = {}
    if kind == "gemma3":
        hf, gemma = _gemma3(hf)
    elif kind == "gpt_oss":                  # GptOssConfig's defaults; its MoE fields
        hf, gemma = moe_config.gpt_oss_fields(hf)
    want_act = "gelu_pytorch_tanh" if kind == "gemma3" else "silu"
    act = hf.get("hidden_act", want_act)
    if act != want_act:
        raise ValueError(f"hidden_act must be {want_act!r} for a {kind!r} config, got {show(act)}")
    if not hf.get("is_neox_style", True):
        raise ValueError("is_neox_style must be true (specjax implements rotate-half RoPE only)")
    rp = hf.get("rope_parameters")
    for where, d in (("", hf), ("rope_parameters.", rp if isinstance(rp, Mapping) else {})):
        f = d.get("partial_rotary_factor", 1.0)
        if f != 1.0:
            raise ValueError(f"config {where}partial_rotary_factor must be 1.0 (specjax rotates "
                             f"the whole head), got {show(f)}")
    dcfg = hf.get("dflash_config") or {}
    if not isinstance(dcfg, Mapping):
        raise ArgumentTypeError(f"config dflash_config must be an object, got {show(dcfg)}")
    n_layers = _int(hf, "num_hidden_layers", 1, MAX_LAYERS,
                    why=f"specjax's limit is {MAX_LAYERS} layers")
    window, layer_types = 0, None
    if kind in WINDOW_KINDS:
        window, layer_types = _window(kind, hf, n_layers)
    elif kind != "dflash":
        _check_window(hf, n_layers)
    if (kind != "dflash" and (dcfg.get("use_swa") or dcfg.get("attention_sink_bias"))) \
            or hf.get("attention_sink_bias"):
        raise ValueError("dflash_config.use_swa / attention_sink_bias must be false outside a "
                         "DFlash head; a top-level attention_sink_bias is not read (DFlash: "
                         "dflash_config.attention_sink_bias)")
    if kind != "eagle3":
        for f in EAGLE3_NORM_FLAGS:
            if hf.get(f):
                raise ValueError(f"{f} must be false for a {kind!r} config (an EAGLE-3 option)")

    h = _int(hf, "hidden_size")
    nh = _int(hf, "num_attention_heads", 1, 4096)
    nkv = _int(hf, "num_key_value_heads", 1, 4096, default=nh)
    theta, scaling = _rope(kind, hf)
    attention_bias = _bool(hf, "attention_bias", False)
    qkv_bias = _bool(hf, "qkv_bias", kind in ("qwen2", "mtp") or attention_bias)
    o_bias = _bool(hf, "o_bias", False if kind in ("qwen2", "eagle", "mtp") else attention_bias)
    qk_norm = _bool(hf, "qk_norm", kind in ("qwen3", "qwen3_moe", "dflash")
                    or (kind == "eagle3" and hf.get("model_type") == "qwen3"))
    vocab = _int(hf, "vocab_size", 1, MAX_VOCAB)
    if _get(hf, "head_dim") is None and h % nh:
        raise ArgumentError(f"config hidden_size={h} is not a multiple of num_attention_heads={nh} "
                            "and no head_dim is given")
    fields: dict[str, Any] = dict(
        kind=kind,
        vocab_size=vocab,
        hidden_size=h,
        intermediate_size=_int(hf, "intermediate_size"),
        num_hidden_layers=n_layers,
        num_attention_heads=nh,
        num_key_value_heads=nkv,
        head_dim=_int(hf, "head_dim", 2, 1 << 14, default=h // nh),
        rms_norm_eps=check_number("config rms_norm_eps", _get(hf, "rms_norm_eps", default=1e-6),
                                  0.0, 1.0),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=_int(hf, "max_position_embeddings", 1, 1 << 30, default=2048),
        tie_word_embeddings=_bool(hf, "tie_word_embeddings", False) if kind in DECODER_KINDS else False,
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        mlp_bias=_bool(hf, "mlp_bias", False),
        qk_norm=qk_norm,
        sliding_window=window,
        layer_types=layer_types,
    )
    if kind == "eagle":
        fields["fc_bias"] = _bool(hf, "bias", True)
    elif kind == "mtp":
        fields["n_predict"] = _int(hf, "num_nextn_predict_layers", 1, MAX_LAYERS, default=1)
    elif kind == "eagle3":
        aux_ids, aux_warning = eagle3_aux_layer_ids(hf)
        if aux_warning is not None:
            warnings.warn(aux_warning, stacklevel=2)
        fields.update(
            draft_vocab_size=_int(hf, "draft_vocab_size", 1, MAX_VOCAB, default=vocab),
            target_hidden_size=_int(hf, "target_hidden_size", default=h),
            # vLLM v0.20: the speculators eagle3 updater defaults it to True, the model to False
            norm_before_residual=_bool(hf, "norm_before_residual", speculators),
            aux_layer_ids=aux_ids,
            **_eagle3_norm_flags(hf),
        )
    elif kind == "dflash":
        ids = _get(hf, "aux_hidden_state_layer_ids", "eagle_aux_hidden_state_layer_ids")
        if ids is None and dcfg.get("target_layer_ids") is not None:
            ids = [int(i) + 1 for i in _aux_ids(dcfg["target_layer_ids"]) or ()]
        if ids is None and hf.get("num_target_layers") is not None:
            nt, nd = _int(hf, "num_target_layers", 1, MAX_LAYERS), fields["num_hidden_layers"]
            z = [nt // 2] if nd == 1 else [int(round(1 + i * (nt - 4) / (nd - 1))) for i in range(nd)]
            ids = [i + 1 for i in z]
        if ids is None:
            raise ValueError("aux_hidden_state_layer_ids is required for dflash "
                             "(or dflash_config.target_layer_ids / num_target_layers)")
        fields.update(dflash_config.attention_fields(hf, dcfg, n_layers, speculators,
                                                     _window_int(hf), _layer_types(hf, n_layers)))
        fields.update(
            draft_vocab_size=_int(hf, "draft_vocab_size", 1, MAX_VOCAB, default=vocab),
            target_hidden_size=_int(hf, "target_hidden_size", default=h),
            aux_layer_ids=_aux_ids(ids),
            block_size=check_int("config block_size",
                                 _get(hf, "block_size", default=dcfg.get("block_size", 0)) or 0,
                                 0, 4096),
            mask_token_id=check_int("config mask_token_id", _get(
                hf, "mask_token_id", default=dcfg.get("mask_token_id", -1)), -1, MAX_VOCAB),
        )
    if kind in ("eagle", "eagle3", "dflash"):
        _check_truncated_vocab(kind, hf, vocab, fields.get("draft_vocab_size", vocab))
    fields.update(gemma)
    if kind == "qwen3_moe":
        fields.update(moe_config.moe_fields(hf, n_layers))
    for f in _PRESENCE:
        if hf.get(f) is not None:
            fields[f] = bool(hf[f])
    return ModelConfig(**fields)


def config_to_dict(config: ModelConfig) -> dict[str, Any]:
    """JSON-able dict; ``config_from_hf(config.kind, config_to_dict(config)) == config``."""
    c = config
    if c.kind == "dspark":
        return dict(config_to_dict(c.replace(**dspark_config.reset(c))),
                    **dspark_config.to_dict(c))
    d: dict[str, Any] = {"vocab_size": c.vocab_size, "hidden_size": c.hidden_size}
    if c.kind == "medusa":
        d.update(num_heads=c.num_heads, num_hidden_layers=c.num_hidden_layers,
                 medusa_fc_bias=c.fc_bias, original_lm_head=c.original_lm_head,
                 logit_scale=c.logit_scale)
        if c.truncated_vocab_size:
            d["truncated_vocab_size"] = c.truncated_vocab_size
    else:
        d.update(
            intermediate_size=c.intermediate_size, num_hidden_layers=c.num_hidden_layers,
            num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
            head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta,
            rope_scaling=_thaw(c.rope_scaling) if c.rope_scaling else None,
            max_position_embeddings=c.max_position_embeddings,
            tie_word_embeddings=c.tie_word_embeddings, qkv_bias=c.qkv_bias, o_bias=c.o_bias,
            attention_bias=c.qkv_bias or c.o_bias, mlp_bias=c.mlp_bias, qk_norm=c.qk_norm,
            hidden_act="silu",
        )
        if c.kind == "gemma3":
            d.update(hidden_act="gelu_pytorch_tanh", sliding_window=c.sliding_window or None,
                     query_pre_attn_scalar=c.query_pre_attn_scalar,
                     rope_local_base_freq=c.rope_local_base_freq,
                     final_logit_softcapping=c.final_logit_softcapping or None)
        elif c.sliding_window and c.kind != "dflash":
            d["sliding_window"] = c.sliding_window
            if c.kind in ("qwen2", "qwen3"):
                d["use_sliding_window"] = True
        if c.layer_types is not None:
            d["layer_types"] = list(c.layer_types)
        if c.kind == "eagle":
            d["bias"] = c.fc_bias
        elif c.kind == "mtp":
            d["num_nextn_predict_layers"] = c.n_predict
        elif c.kind == "qwen3_moe":
            d.update(moe_config.moe_dict(c))
        elif c.kind == "gpt_oss":
            d.update(moe_config.gpt_oss_dict(c))
        elif c.kind == "eagle3":
            d.update(draft_vocab_size=c.draft_vocab_size, target_hidden_size=c.target_hidden_size,
                     norm_before_residual=c.norm_before_residual,
                     **{f: getattr(c, f) for f in EAGLE3_NORM_FLAGS},
                     eagle_aux_hidden_state_layer_ids=(list(c.aux_layer_ids)
                                                       if c.aux_layer_ids is not None else None))
        elif c.kind == "dflash":
            d.update(draft_vocab_size=c.draft_vocab_size, target_hidden_size=c.target_hidden_size,
                     aux_hidden_state_layer_ids=list(c.aux_layer_ids), block_size=c.block_size,
                     mask_token_id=c.mask_token_id)
            d.update(dflash_config.attention_dict(c))
    for f in _PRESENCE:
        if getattr(c, f) is not None:
            d[f] = getattr(c, f)
    return d


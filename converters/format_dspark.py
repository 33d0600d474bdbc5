"""DSpark, DeepSpec and SpecForge configs (vLLM 0.34 ``qwen3_dspark.py``): read and write.

Three config styles flatten to one canonical ``dspark`` config (``models/CANONICAL.md``):
DeepSpec's ``Qwen3DSparkModel`` with every key at the top level; SpecForge's
``DSparkDraftModel`` with the DSpark keys nested in ``dflash_config``; SpecForge's qwen3.6
style with the mask / target ids in ``dflash_config`` and the Markov / confidence keys in
``dspark_config``. A key given in two places with two values is refused. Tensors: DFlash's
(``format_dflash``) plus ``markov_head.*`` and ``confidence_head.proj.*``; an rnn head's
``autoregressive_head.joint_proj.*`` (Mistral-Large-4's name) or bare ``joint_proj.*`` is
renamed ``markov_head.joint_proj.*``. Tensors the config gives no use to: a gated / rnn
projection under another ``markov_head_type`` is refused (it changes the drafts); a
confidence head under ``enable_confidence_head`` false is dropped with a note, as vLLM drops
it (it never changes the drafts). The writer emits vLLM 0.34's top-level layout.
"""

from __future__ import annotations

from specjax.converters.errors import CheckpointError, short
from specjax.converters.format_common import (
    Format,
    Probe,
    Tensors,
    _decoder_fields,
    _drop,
    _rename_prefixes,
    _with_t2d,
)
from specjax.converters.format_dflash import (
    _ATTN_KEYS,
    _dflash_common,
    _dflash_decoder,
    _dflash_tensors,
    _explicit_causal,
    _sink_names,
)

HEAD_TYPES = ("vanilla", "gated", "rnn")
ARCHS = ("Qwen3DSparkModel", "DSparkDraftModel")
#: DSpark keys -> vLLM's default (read at the top level, then dspark_config, dflash_config).
_KEYS = {"markov_rank": None, "markov_head_type": "vanilla", "enable_confidence_head": False,
         "confidence_head_with_markov": False, "sample_from_anchor": True}
#: Training-side keys (not read by vLLM): ignored with a note.
_TRAINING = ("confidence_head_alpha", "num_anchors", "num_target_layers")
#: Keys that change the drafts in ways specjax does not implement: refused by name.
_REFUSED = {"dspark_draft_topk": "top-k Markov evaluation read from the checkpoint (give it as "
                                 "SpeculativeConfig(dspark_draft_topk=...), which vLLM also reads)",
            "dspark_draft_input": "per-slot mask embeddings (Mistral-Large-4)",
            "dspark_head_type": "Mistral-Large-4's head key (write markov_head_type)"}
#: The extra Markov projection of each head type (models/dspark.py).
_EXTRA = {"gated": "gate_proj", "rnn": "joint_proj"}
_CONF = "confidence_head.proj."


def _sections(cfg: dict) -> list[tuple[str, dict]]:
    out = [("", cfg)]
    for name in ("dspark_config", "dflash_config"):
        d = cfg.get(name)
        if d is not None and not isinstance(d, dict):
            raise CheckpointError(f"config: {name} must be an object, got {short(d)}")
        out.append((name + ".", d or {}))
    return out


def _lookup(cfg: dict, key: str, order: tuple[str, ...] = ("", "dspark_config.",
                                                              "dflash_config.")):
    """``(value, where)`` of ``key`` in the config sections ``order``; two different values
    in two sections are refused."""
    found = [(w, d[key]) for w, d in _sections(cfg) if w in order and d.get(key) is not None]
    found.sort(key=lambda x: order.index(x[0]))
    if len({repr(v) for _, v in found}) > 1:
        raise CheckpointError("config: " + " and ".join(f"{w}{key}={short(v)}" for w, v in found)
                              + " disagree; a DSpark config gives each key once")
    return (found[0][1], found[0][0] + key) if found else (None, key)


def _int(v, where: str, lo: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise CheckpointError(f"config: {where}={short(v)} must be an int >= {lo}")
    return v


def _dspark_fields(cfg: dict) -> dict:
    out = {}
    for key, default in _KEYS.items():
        v, where = _lookup(cfg, key)
        if key == "markov_rank":
            if v is None:
                raise CheckpointError("config: markov_rank is missing (looked at the top level, "
                                      "dspark_config and dflash_config); a DSpark head needs the "
                                      "rank r of markov_head.markov_w1 [V, r]")
            v = _int(v, where, 1)
        elif key == "markov_head_type" and v is not None and v not in HEAD_TYPES:
            raise CheckpointError(f"config: {where}={short(v)} is not a DSpark head type "
                                  f"specjax implements (allowed: {', '.join(HEAD_TYPES)})")
        elif default in (True, False) and v is not None and not isinstance(v, bool):
            raise CheckpointError(f"config: {where} must be true or false, got {short(v)}")
        out[key] = default if v is None else v
    return out


def _checks(cfg: dict, notes: list[str]) -> None:
    """Refuse what changes the numerics; note the training-side keys ignored."""
    archs = [str(a) for a in cfg.get("architectures") or ()]
    if "transformer_layer_config" in cfg or "speculators_model_type" in cfg:
        raise CheckpointError("config: a speculators DSpark config (transformer_layer_config) "
                              "is not supported; DeepSpec's and SpecForge's layouts are")
    proj, where = _lookup(cfg, "projector_type", ("dflash_config.", ""))
    if proj is not None and proj != "dspark":
        raise CheckpointError(f"config: {where}={short(proj)}; a DSpark draft "
                              f"(architectures={archs}) has projector_type 'dspark'")
    for key, what in _REFUSED.items():
        v, w = _lookup(cfg, key)
        if v is not None:
            raise CheckpointError(f"config: {w}={short(v)}: {what} is not supported by specjax")
    scale, w = _lookup(cfg, "logit_scale")
    if scale is not None and scale != 1:
        raise CheckpointError(f"config: {w}={short(scale)}: specjax's DSpark head has "
                              "logit_scale 1 (a scaled head is not supported)")
    mode, w = _lookup(cfg, "attention_mode")
    if mode not in (None, "gqa", "mha"):
        raise CheckpointError(f"config: {w}={short(mode)}: only standard attention (gqa / mha, "
                              "the heads of num_key_value_heads) is supported; an MLA draft is not")
    for key in ("attention_mode",) + _TRAINING:
        v, w = _lookup(cfg, key)
        if v is not None:
            notes.append(f"config: {w} ignored (a training-side key; vLLM does not read it)")
    known = set(_KEYS) | set(_REFUSED) | set(_TRAINING) | {"logit_scale", "attention_mode"}
    for k in sorted(set(cfg.get("dspark_config") or {}) - known):
        notes.append(f"config: dspark_config.{k} ignored (not a key vLLM or specjax reads)")


def _ids(cfg: dict, notes: list[str]) -> list[int]:
    """Aux ids in vLLM's order: ``eagle_aux_hidden_state_layer_ids`` as given, else
    ``dflash_config.target_layer_ids`` / ``dspark_target_layer_ids`` / ``target_layer_ids``
    (output-of-layer ids) + 1."""
    dcfg = cfg.get("dflash_config") or {}
    for where, v, shift in (("eagle_aux_hidden_state_layer_ids",
                             cfg.get("eagle_aux_hidden_state_layer_ids"), 0),
                            ("dflash_config.target_layer_ids", dcfg.get("target_layer_ids"), 1),
                            ("dspark_target_layer_ids", cfg.get("dspark_target_layer_ids"), 1),
                            ("target_layer_ids", cfg.get("target_layer_ids"), 1)):
        if v is None:
            continue
        if not isinstance(v, list) or not v or not all(
                isinstance(i, int) and not isinstance(i, bool) for i in v):
            raise CheckpointError(f"config: {where}={short(v)} must be a list of ints")
        aux = [i + shift for i in v]
        notes.append(f"aux layer ids: {where} {v}" + (f" + 1 -> {aux} (input of layer k, "
                                                      "vLLM's meaning)" if shift else ""))
        return aux
    raise CheckpointError("config: no target layer ids (looked at "
                          "eagle_aux_hidden_state_layer_ids, dflash_config.target_layer_ids, "
                          "dspark_target_layer_ids, target_layer_ids)")


def _mask(cfg: dict) -> int:
    """vLLM's ``get_parallel_drafting_token_id`` order."""
    dcfg = cfg.get("dflash_config") or {}
    for where, v in (("dflash_config.mask_token_id", dcfg.get("mask_token_id")),
                     ("mask_token_id", cfg.get("mask_token_id")),
                     ("dspark_noise_token_id", cfg.get("dspark_noise_token_id")),
                     ("pard_token", cfg.get("pard_token")),
                     ("ptd_token_id", cfg.get("ptd_token_id"))):
        if v is not None:
            return _int(v, where, 0)
    raise CheckpointError("config: no mask token (looked at dflash_config.mask_token_id, "
                          "mask_token_id, dspark_noise_token_id, pard_token, ptd_token_id)")


def _block_size(cfg: dict, notes: list[str]) -> int:
    dcfg = cfg.get("dflash_config") or {}
    for where, v in (("block_size", cfg.get("block_size")),
                     ("dspark_block_size", cfg.get("dspark_block_size")),
                     ("dflash_config.block_size", dcfg.get("block_size"))):
        if v is not None:
            return _int(v, where, 1)
    notes.append("config: no block_size (vLLM's default k only); set num_speculative_tokens")
    return 0


def _head_tensors(f: dict, h: int, tensors: Tensors, notes: list[str]) -> Tensors:
    """Rename the rnn projection; refuse another head type's projection; drop an unused
    confidence head; check the confidence input width against ``confidence_head_with_markov``."""
    tensors = _rename_prefixes(tensors, {"mtp_dspark.autoregressive_head.": "markov_head.",
                                         "autoregressive_head.": "markov_head.",
                                         "joint_proj.": "markov_head.joint_proj."}, notes)
    for kind, name in _EXTRA.items():
        keys = sorted(k for k in tensors if k.startswith(f"markov_head.{name}."))
        if keys and f["markov_head_type"] != kind:
            raise CheckpointError(f"tensor {keys[0]!r} is a {kind} Markov head's, but config "
                                  f"markov_head_type={f['markov_head_type']!r}; set "
                                  f"markov_head_type={kind!r}")
    if not f["enable_confidence_head"]:
        return _drop(tensors, lambda k: k.startswith(_CONF), "config enable_confidence_head "
                     "is false; vLLM drops the confidence head too", notes)
    w = tensors.get(_CONF + "weight")
    r = f["markov_rank"]
    want = (1, h + r) if f["confidence_head_with_markov"] else (1, h)
    if w is not None and tuple(w.shape) != want:
        raise CheckpointError(
            f"tensor {_CONF}weight has shape {list(w.shape)}, but config "
            f"confidence_head_with_markov={str(f['confidence_head_with_markov']).lower()} "
            f"needs {list(want)} ([1, H{' + r' if want[1] != h else ''}], H={h}, r={r})")
    return tensors


def read(cfg: dict, tensors: Tensors, notes: list[str]):
    _checks(cfg, notes)
    f = _dspark_fields(cfg)
    flat = _decoder_fields(cfg, notes)
    dcfg = cfg.get("dflash_config") or {}
    if dcfg.get("use_aux_hidden_state") is False:
        raise CheckpointError("config.dflash_config: use_aux_hidden_state=false is not "
                              "supported")
    aux, mask, block = _ids(cfg, notes), _mask(cfg), _block_size(cfg, notes)
    drop = ("dspark_config", "auto_map", "projector_type", "dspark_block_size",
            "dspark_noise_token_id", "dspark_target_layer_ids", "target_layer_ids",
            "eagle_aux_hidden_state_layer_ids", "pard_token", "ptd_token_id", "logit_scale")
    for k in drop + _TRAINING + ("attention_mode",):
        flat.pop(k, None)
    for k in ("causal", "sliding_window_non_causal"):
        if flat.pop(k, None) is not None:
            notes.append(f"config: {k} ignored (vLLM does not read it in a DSpark config)")
    flat.update(f, block_size=block, mask_token_id=mask, aux_hidden_state_layer_ids=aux,
                dflash_config={k: dcfg[k] for k in _ATTN_KEYS if k in dcfg})
    _dflash_common(flat, "config")
    return flat, _head_tensors(f, flat["hidden_size"], _dflash_tensors(tensors, notes), notes)


def write(c, t, torch_dtype):
    """vLLM 0.34's layout: ``Qwen3DSparkModel``, DSpark keys at the top level (DeepSpec's
    style), ``target_layer_ids`` = aux ids - 1; DFlash's attention keys in ``dflash_config``."""
    cfg = {"architectures": ["Qwen3DSparkModel"], **_dflash_decoder(c),
           "mask_token_id": c.mask_token_id,
           "target_layer_ids": [int(i) - 1 for i in c.aux_layer_ids],
           **{k: getattr(c, k) for k in _KEYS}, "torch_dtype": torch_dtype}
    if c.block_size:
        cfg["block_size"] = c.block_size
    dcfg = {}
    if _explicit_causal(c):
        dcfg["causal"] = c.causal
        cfg["is_causal"] = c.causal
    if c.sliding_window:
        dcfg["swa_window_size"] = c.sliding_window
    if c.attention_sinks:
        dcfg["attention_sink_bias"] = True
    if dcfg:
        cfg["dflash_config"] = dcfg
    if c.target_hidden_size and c.target_hidden_size != c.hidden_size:
        cfg["target_hidden_size"] = c.target_hidden_size
    if c.draft_vocab_size != c.vocab_size:
        cfg["draft_vocab_size"] = c.draft_vocab_size
    return cfg, {"model.safetensors": _with_t2d(_sink_names(t), c)}


def detect(p: Probe) -> bool:
    """A DSpark architecture, a ``dspark_config``, ``markov_rank`` (top level or in
    ``dflash_config``) or a ``markov_head.*`` tensor."""
    dcfg = p.config.get("dflash_config")
    dcfg = dcfg if isinstance(dcfg, dict) else {}
    return (any(a in ARCHS for a in p.archs) or "dspark_config" in p.config
            or "markov_rank" in p.config or "markov_rank" in dcfg
            or dcfg.get("projector_type") == "dspark"
            or any(k.removeprefix("model.").startswith("markov_head.") for k in p.keys))


FORMATS = (
    Format("dspark", "dspark", "DSpark, DeepSpec / SpecForge (DFlash + markov_head, "
           "confidence_head; ids + 1)", detect, read, write),
)

"""The checkpoint formats: one :class:`Format` record per format, plus auto-detection.

Each family's readers and writers live in one ``format_*`` module. Readers turn
``(config.json, tensors)`` into the canonical ``(kind, hf_config, tensors)`` of
``models/CANONICAL.md`` lazily (no weight bytes read), noting each non-obvious step in
``notes``; writers (``export_checkpoint``) do the inverse. A P-EAGLE ``mask_hidden`` is
moved to :attr:`Normalized.extra_params`, flattened (docs/converters.md, "Formats").
"""

from __future__ import annotations

import numpy as np

from specjax.converters import (
    format_dflash,
    format_dspark,
    format_eagle,
    format_eagle3,
    format_gemma3,
    format_gpt_oss,
    format_hf,
    format_medusa,
    format_mimo,
    format_qwen3_moe,
)
from specjax.converters.errors import CheckpointError, FormatDetectionError
from specjax.converters.format_common import (  # noqa: F401 (re-exported)
    _PARALLEL_TOKEN_FIELDS,
    Format,
    Normalized,
    Probe,
    Tensors,
)
from specjax.converters.format_dflash import zlab_default_target_layer_ids  # noqa: F401 (re-exported)

# -- parallel drafting (P-EAGLE) -------------------------------------------------------------

def parallel_drafting_token_id(hf_config: dict | None) -> int | None:
    """The draft config's parallel-drafting token id, looked up as vLLM does:
    ``dflash_config.mask_token_id``, ``pard_token``, ``ptd_token_id``; None when none is
    set. A non-integer raises :class:`CheckpointError`."""
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
    format_hf.FORMATS + format_gemma3.FORMATS + format_qwen3_moe.FORMATS + format_gpt_oss.FORMATS
    + format_mimo.FORMATS
    + format_eagle.FORMATS + format_eagle3.FORMATS
    + format_dflash.FORMATS + format_dspark.FORMATS + format_medusa.FORMATS)}
#: The order ``detect_format`` asks the formats in (the first that recognises a
#: checkpoint wins): speculators configs, then key patterns from the most specific. A MiMo
#: checkpoint: ``mimo-mtp`` for a head-only export (MTP modules, no decoder layers), else
#: ``mimo`` (the target; ``--format mimo-mtp`` takes its head), before the plain decoders.
#: ``dspark`` before ``eagle3`` / ``dflash``, whose key rules a DSpark head also meets.
DETECTION_ORDER = ("eagle3-speculators", "dflash-speculators", "dspark", "eagle3", "dflash",
                   "medusa", "medusa-vllm", "eagle", "mimo-mtp", "mimo", "llama", "qwen2",
                   "qwen3_moe", "gpt_oss", "qwen3", "mistral", "ministral", "gemma3")
assert sorted(DETECTION_ORDER) == sorted(FORMATS)


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
    cfg, out = f.read(dict(config or {}), dict(tensors), notes)
    extra = _take_mask_hidden(f.kind, cfg, out, notes) if f.kind in ("eagle", "eagle3") else {}
    return Normalized(f.kind, fmt, cfg, out, notes, extra)


# -- detection --------------------------------------------------------------------------

def detect_format(config: dict, tensors: Tensors, files: list[str] = ()) -> str:
    """The format of a checkpoint, from config.json fields, the key names and file names:
    the first format of :data:`DETECTION_ORDER` whose ``detect`` recognises it."""
    p = Probe.of(config, tensors, files)
    if p.spec_type is not None and p.spec_type not in ("eagle3", "dflash"):
        raise FormatDetectionError(f"speculators model type {p.spec_type!r} is not supported "
                                   "(allowed: eagle3, dflash)")
    for name in DETECTION_ORDER:
        if FORMATS[name].detect(p):
            return name
    if any(k.startswith("model.layers.") for k in p.keys):
        raise FormatDetectionError(
            f"an HF decoder checkpoint of unsupported model_type "
            f"{p.config.get('model_type')!r} / architectures {list(p.archs)!r} (allowed: "
            "llama, qwen2, qwen3, qwen3_moe, gpt_oss, mistral, ministral, gemma3, "
            "MiMoForCausalLM); pass --format to force one")
    raise FormatDetectionError(
        "cannot tell the checkpoint format from config.json and the tensor names; pass "
        f"--format (allowed: {', '.join(FORMATS)})")

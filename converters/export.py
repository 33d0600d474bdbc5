"""Export trained params to the upstream checkpoint layouts: the inverse of the converters.

Each format's writer lives beside its reader in ``converters/format_*.py``; this module
checks the arguments, reads the layout back in memory (it must be detected as the same format
and normalize back to the same config) and writes it atomically. Formats, P-EAGLE
``mask_hidden`` and ``pard_token``: docs/converters.md, "Exporting".
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Callable, Mapping

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file as _save_file

from specjax.converters.destination import (
    check_destination,
    destination_in_use,
    sigterm_raises,
    write_dir_atomically,
)
from specjax.converters.format_common import Files, Writer
from specjax.converters.formats import FORMATS, detect_format, normalize
from specjax.converters.pipeline import PARALLEL_TOKEN_KINDS
from specjax.converters.tensor_ref import TensorRef

__all__ = ["export_checkpoint", "EXPORT_FORMATS", "EXPORT_DTYPES"]

#: Export dtypes: name -> (NumPy dtype, the config's ``torch_dtype`` string).
EXPORT_DTYPES = {
    "bf16": (np.dtype(ml_dtypes.bfloat16), "bfloat16"),
    "fp16": (np.dtype(np.float16), "float16"),
    "fp32": (np.dtype(np.float32), "float32"),
}
#: Integer maps: int32 in specjax, int64 on disk (as upstream stores them).
_INT_MAPS = ("d2t", "token_map")
#: safetensors metadata that transformers' loader checks for.
_ST_METADATA = {"format": "pt"}



def _registry():
    from specjax.models import registry  # noqa: PLC0415 (imports jax)
    return registry


#: Formats that carry a P-EAGLE ``mask_hidden``: format -> (weights file, on-disk shape of
#: ``size`` values). The key is ``mask_hidden`` (top level, no prefix) in each.
_MASK_HIDDEN_LAYOUT: dict[str, tuple[str, Callable[[int], tuple[int, ...]]]] = {
    "eagle": ("model.safetensors", lambda n: (1, n)),
    "eagle3": ("model.safetensors", lambda n: (1, 1, n)),
    "eagle3-speculators": ("model.safetensors", lambda n: (1, 1, n)),
}
#: Draft-config fields holding the parallel-drafting token (``formats.parallel_drafting_token_id``).
_TOKEN_FIELDS = ("pard_token", "ptd_token_id")

#: Format name -> its writer (``FORMATS[name].write``).
EXPORT_FORMATS: dict[str, Writer] = {name: f.write for name, f in FORMATS.items()}


# -- validation -------------------------------------------------------------------------------

def _format_kind(fmt: str) -> str:
    return FORMATS[fmt].kind


def _check_args(kind, config, fmt, dtype, overwrite, extra_config) -> None:
    registry = _registry()
    if kind not in registry.KINDS:
        raise ValueError(f"kind {kind!r} is not supported (allowed: {', '.join(registry.KINDS)})")
    if not isinstance(config, registry.ModelConfig):
        raise TypeError(f"config must be a ModelConfig, got {type(config).__name__}")
    if config.kind != kind:
        raise ValueError(f"kind {kind!r} does not match config.kind {config.kind!r}")
    if fmt not in EXPORT_FORMATS:
        raise ValueError(f"format {fmt!r} is not an export format (allowed: "
                         f"{', '.join(EXPORT_FORMATS)})")
    if _format_kind(fmt) != kind:
        ok = [f for f in EXPORT_FORMATS if _format_kind(f) == kind]
        raise ValueError(f"format {fmt!r} is for kind {_format_kind(fmt)!r}, not {kind!r} "
                         f"(formats for {kind}: {', '.join(ok)})")
    if not isinstance(dtype, str) or dtype not in EXPORT_DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported (allowed: "
                         f"{', '.join(EXPORT_DTYPES)})")
    if not isinstance(overwrite, bool):
        raise TypeError(f"overwrite must be a bool, got {overwrite!r}")
    if extra_config is not None:
        if not isinstance(extra_config, Mapping):
            raise TypeError(f"extra_config must be a dict, got {type(extra_config).__name__}")
        try:
            json.dumps(extra_config, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise ValueError(f"extra_config is not JSON-serializable ({e})") from None


def _check_mask_hidden(kind, config, fmt, mask) -> None:
    """A ``mask_hidden`` entry must be ``registry.mask_hidden_abstract``'s flat float vector,
    and ``fmt`` must be able to carry it."""
    registry = _registry()
    name = f"params[{registry.MASK_HIDDEN!r}]"
    if fmt not in _MASK_HIDDEN_LAYOUT:
        raise ValueError(f"{name} (a P-EAGLE parallel-drafting hidden state) cannot be written "
                         f"in format {fmt!r} (formats that carry mask_hidden: "
                         f"{', '.join(_MASK_HIDDEN_LAYOUT)})")
    want = registry.mask_hidden_abstract(kind, config)
    shape = tuple(int(d) for d in np.shape(mask))
    if shape != want.shape:
        size = int(np.prod(shape, dtype=np.int64))
        hint = (f"; reshape it to {want.shape}" if size == want.shape[0] else
                f" ({size} values)")
        what = ("hidden_size" if kind == "eagle" else
                f"fc input size = {config.num_aux} aux states x target_hidden_size "
                f"{config.target_hidden_size or config.hidden_size}")
        raise ValueError(f"{name} has shape {shape}; the {kind} head needs shape "
                         f"{want.shape} ({what}){hint}")
    dt = np.dtype(getattr(mask, "dtype", np.asarray(mask).dtype))
    if not (np.issubdtype(dt, np.floating) or dt == np.dtype(ml_dtypes.bfloat16)):
        raise ValueError(f"{name} has dtype {dt}, expected a float dtype")


def _check_params(kind, config, params, fmt) -> None:
    """``params`` must have the structure of ``abstract_params(kind, config)`` (shared
    ``embed_tokens`` / ``lm_head`` entries the head does not own are allowed and skipped),
    plus, optionally, a ``mask_hidden`` entry (:func:`_check_mask_hidden`)."""
    registry = _registry()
    if not isinstance(params, Mapping):
        raise TypeError(f"params must be a dict, got {type(params).__name__}")
    if registry.MASK_HIDDEN in params:
        _check_mask_hidden(kind, config, fmt, params[registry.MASK_HIDDEN])
        params = {k: v for k, v in params.items() if k != registry.MASK_HIDDEN}
    want = registry._leaf_paths(registry.abstract_params(kind, config))
    got = registry._leaf_paths(params)
    owned_roots = {p[0] for p in want}
    missing = sorted(registry._dotted(p) for p in want if p not in got)
    unexpected = sorted(registry._dotted(p) for p in got if p not in want
                        and not (p and p[0] in registry._SHARED and p[0] not in owned_roots))
    if missing or unexpected:
        parts = ([f"missing keys: {', '.join(missing)}"] if missing else []) + \
                ([f"unexpected keys: {', '.join(unexpected)}"] if unexpected else [])
        raise ValueError(f"params do not have the structure of abstract_params({kind!r}, "
                         f"config): {'; '.join(parts)}")


def _comparable(c) -> dict:
    """``config_to_dict`` without the optional-tensor flags (compared through the params
    structure instead) and with equivalent spellings made equal."""
    registry = _registry()
    d = registry.config_to_dict(c)
    for f in ("has_embed_tokens", "has_lm_head", "has_d2t", "has_token_map"):
        d.pop(f, None)
    if c.kind in ("eagle3", "dflash", "dspark") and not d.get("target_hidden_size"):
        d["target_hidden_size"] = c.hidden_size  # 0 means "= hidden_size"
    if c.kind == "medusa" and d.get("truncated_vocab_size") in (0, c.vocab_size):
        d.pop("truncated_vocab_size", None)  # 0 or vocab_size: no truncation
    return d


def _read_back(fmt: str, kind: str, config, cfg_json: dict, files: Files,
               extra_params: Mapping[str, tuple[int, ...]] | None = None) -> None:
    """Run the converters on the layout (in memory): it must be detected as ``fmt`` and
    normalize back to ``config`` (parallel-drafting token included) with the same params
    structure, and the entries outside the tensor table (``mask_hidden``) with the shapes
    ``extra_params`` names."""
    from specjax.converters.pipeline import make_config, validate  # noqa: PLC0415

    registry = _registry()
    refs = {k: TensorRef.from_array(a, f"{name}:{k}") for name, ts in files.items()
            for k, a in ts.items()}
    where = f"format {fmt!r} cannot express this {kind} config"
    try:
        detected = detect_format(cfg_json, refs, list(files))
        if detected != fmt:
            raise ValueError(f"the layout written would be detected as {detected!r}")
        norm = normalize(fmt, cfg_json, refs)
        back = make_config(kind, norm.hf_config, norm.tensors)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    a, b = _comparable(config), _comparable(back)
    diff = [f"{k}={a.get(k)!r} (would load back as {b.get(k)!r})"
            for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
    if kind in PARALLEL_TOKEN_KINDS and config.mask_token_id >= 0 \
            and back.mask_token_id != config.mask_token_id:
        diff.append(f"mask_token_id={config.mask_token_id!r} (the parallel-drafting token; "
                    f"would load back as {back.mask_token_id!r})")
    if diff:
        raise ValueError(f"{where}: {', '.join(diff)}")
    got = {k: tuple(v.shape) for k, v in norm.extra_params.items()}
    want = dict(extra_params or {})
    if got != want:
        raise ValueError(f"{where}: params entries outside the tensor table would load back as "
                         f"{got or 'none'} instead of {want or 'none'}")
    try:
        validate(kind, back, norm.tensors)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    sa = set(registry._leaf_paths(registry.abstract_params(kind, config)))
    sb = set(registry._leaf_paths(registry.abstract_params(kind, back)))
    if sa != sb:
        raise ValueError(f"{where}: params {sorted(map(registry._dotted, sa ^ sb))} would not "
                         "load back")


def _merge(base: dict, extra: Mapping) -> dict:
    """``extra`` merged into ``base`` (nested dicts merged key by key; anything else replaced)."""
    out = dict(base)
    for k, v in extra.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


# -- the entry point --------------------------------------------------------------------------

def export_checkpoint(kind: str, config, params, out_dir, *, format: str, dtype: str = "bf16",
                      overwrite: bool = False, extra_config: dict | None = None) -> Path:
    """Write ``params`` of ``kind`` in the upstream layout ``format`` into ``out_dir``.

    ``format``: a key of :data:`EXPORT_FORMATS` for ``kind``. ``dtype``: ``"bf16"``,
    ``"fp16"`` or ``"fp32"`` for every float tensor (integer maps are int64, ``t2d`` bool).
    ``extra_config``: merged into config.json (nested dicts merged). ``params`` may hold a
    P-EAGLE ``mask_hidden`` for the EAGLE-1 / EAGLE-3 formats. ``out_dir`` must not exist or
    be an empty directory unless ``overwrite``; the rules of
    :mod:`specjax.converters.destination` apply. Raises ValueError / TypeError, before
    anything is written, for a bad argument or a config the format cannot express; a failure
    leaves ``out_dir`` untouched. Returns the absolute ``out_dir``.
    """
    _check_args(kind, config, format, dtype, overwrite, extra_config)
    out_dir = check_destination(out_dir, force=overwrite, replaceable=_any_directory,
                                force_flag="overwrite=True")
    _check_params(kind, config, params, format)
    registry = _registry()
    np_dtype, torch_dtype = EXPORT_DTYPES[dtype]
    mask = params.get(registry.MASK_HIDDEN)
    if mask is not None:
        params = {k: v for k, v in params.items() if k != registry.MASK_HIDDEN}
    tensors = {}
    for k, a in registry.tensors_from_params(kind, config, params).items():
        tensors[k] = a.astype(np.int64) if k in _INT_MAPS else a.astype(np_dtype)
    cfg_json, files = EXPORT_FORMATS[format](config, tensors, torch_dtype)
    extra_params = {}
    if mask is not None:
        fname, shape = _MASK_HIDDEN_LAYOUT[format]
        a = np.asarray(mask).astype(np_dtype)
        files[fname] = {**files[fname], registry.MASK_HIDDEN: a.reshape(shape(a.size))}
        extra_params[registry.MASK_HIDDEN] = (a.size,)
    cfg_json = _merge(cfg_json, _parallel_token(kind, config, extra_config))
    if extra_config:
        cfg_json = _merge(cfg_json, extra_config)
    _read_back(format, kind, config, cfg_json, files, extra_params)
    text = json.dumps(cfg_json, indent=2, sort_keys=True, allow_nan=False) + "\n"
    _write_atomically(out_dir, text, files, overwrite)
    return out_dir


def _parallel_token(kind, config, extra_config) -> dict:
    """``{"pard_token": id}`` for a head / draft LM whose config has a parallel-drafting
    token (``mask_token_id >= 0``), unless ``extra_config`` names a token field itself."""
    if kind not in PARALLEL_TOKEN_KINDS or config.mask_token_id < 0:
        return {}
    extra = extra_config or {}
    dcfg = extra.get("dflash_config")
    if any(f in extra for f in _TOKEN_FIELDS) or (isinstance(dcfg, Mapping)
                                                  and "mask_token_id" in dcfg):
        return {}
    return {"pard_token": int(config.mask_token_id)}


def _any_directory(_path: Path) -> None:
    """``overwrite=True`` replaces any directory that the destination rules allow."""
    return None


def _write_atomically(out_dir: Path, config_text: str, files: Files, overwrite: bool) -> None:
    def fill(new: Path) -> None:  # made with the umask's permissions, as are the files
        (new / "config.json").write_text(config_text)
        for name, tensors in files.items():
            _save_file(tensors, str(new / name), metadata=dict(_ST_METADATA))

    def replace(path: Path) -> bool:
        return path.is_dir() and not path.is_symlink() and \
            destination_in_use(path, overwrite, _any_directory, "overwrite=True") is None

    with sigterm_raises():
        write_dir_atomically(out_dir, fill, replace=replace, what="the export")

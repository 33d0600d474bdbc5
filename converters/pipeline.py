"""Read -> normalize -> validate -> build params -> save (orbax), and load back.

Output directory layout (``specjax-convert SRC DST``)::

    DST/specjax.json   kind, format, normalized hf_config, config, dtype, notes (and
                       ``extra_params``: name -> shape of params entries outside the
                       tensor table, e.g. a P-EAGLE ``mask_hidden``)
    DST/params/        the params pytree, written by orbax's StandardCheckpointer

The directory appears only when complete: everything is written to a staging directory
beside ``DST`` and renamed at the end; a failed or interrupted run removes it
(:mod:`specjax.converters.destination`: the destination rules and the staging).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Callable

import ml_dtypes
import numpy as np

from specjax.converters.destination import (
    Log,
    check_destination,
    destination_in_use,
    held_signals,
    sigterm_raises,
    write_dir_atomically,
)
from specjax.converters.errors import (
    CheckpointError,
    TensorMismatchError,
)
from specjax.converters.formats import (
    FORMATS,
    Normalized,
    check_format_name,
    detect_format,
    normalize,
    parallel_drafting_token_id,
)
from specjax.converters.readers import Checkpoint, read_checkpoint

METADATA_FILE = "specjax.json"
PARAMS_DIR = "params"
METADATA_VERSION = 1

DTYPES = {
    "bf16": ml_dtypes.bfloat16, "bfloat16": ml_dtypes.bfloat16,
    "fp16": np.float16, "float16": np.float16, "half": np.float16,
    "fp32": np.float32, "float32": np.float32, "float": np.float32,
}
#: Canonical keys holding integer id maps; every other tensor holds floats.
INT_MAP_KEYS = frozenset({"d2t", "token_map"})
#: Top-level params entries outside the canonical tensor table (``Normalized.extra_params``).
EXTRA_PARAM_KEYS = ("mask_hidden",)
#: Progress callback: ``(done, total, key)``.
Progress = Callable[[int, int, str], None]


def parse_dtype(dtype) -> np.dtype | None:
    """``None``, a name (``bf16``, ``fp16``, ``fp32`` and their long names) or a dtype ->
    a NumPy dtype among bfloat16 / float16 / float32 (ValueError otherwise)."""
    if dtype is None:
        return None
    if isinstance(dtype, str):
        if dtype.lower() not in DTYPES:
            raise ValueError(f"dtype {dtype!r} is not supported (allowed: bf16, fp16, fp32)")
        return np.dtype(DTYPES[dtype.lower()])
    dt = np.dtype(dtype)
    if dt not in (np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16), np.dtype(np.float32)):
        raise ValueError(f"dtype {dt} is not supported (allowed: bf16, fp16, fp32)")
    return dt


def dtype_name(dt: np.dtype) -> str:
    return {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}[np.dtype(dt).name]


def is_float(dt) -> bool:
    dt = np.dtype(dt)
    return dt.kind == "f" or dt == np.dtype(ml_dtypes.bfloat16)


def _registry():
    from specjax.models import registry  # noqa: PLC0415 (models import jax/flax)
    return registry


@dataclasses.dataclass
class Prepared:
    """A checkpoint read, normalized, validated and turned into params (nothing saved)."""

    kind: str
    format: str
    hf_config: dict
    config: Any
    params: Any
    dtype: np.dtype
    notes: list[str]
    files: list[str]
    n_tensors: int
    n_values: int
    source: str


# -- steps --------------------------------------------------------------------------------

def read_and_normalize(src, format: str | None = None) -> tuple[Checkpoint, Normalized]:
    """Read ``src`` and normalize it (``format`` auto-detected when None)."""
    ckpt = read_checkpoint(src)
    fmt = format or detect_format(ckpt.config, ckpt.tensors, ckpt.files)
    norm = normalize(fmt, ckpt.config, ckpt.tensors)
    norm.notes[:0] = ckpt.notes
    return ckpt, norm


def validate(kind: str, config, tensors: dict, source: str = "") -> None:
    """Compare ``tensors`` (key -> anything with ``.shape`` and ``.dtype``) with
    ``registry.expected_tensors``; raise :class:`TensorMismatchError` naming every unknown,
    missing (required), mis-shaped and mis-typed key."""
    expected = _registry().expected_tensors(kind, config)
    unknown = [k for k in tensors if k not in expected]
    missing = [k for k, (_, required) in expected.items() if required and k not in tensors]
    mis_shaped = {k: (tuple(tensors[k].shape), tuple(shape))
                  for k, (shape, _) in expected.items()
                  if k in tensors and tuple(tensors[k].shape) != tuple(shape)}
    mis_typed = {}
    for k, t in tensors.items():
        if k in expected and hasattr(t, "dtype"):
            want_int = k in INT_MAP_KEYS
            if want_int != np.issubdtype(np.dtype(t.dtype), np.integer) or \
                    (not want_int and not is_float(t.dtype)):
                mis_typed[k] = (str(np.dtype(t.dtype)), "integer" if want_int else "float")
    if unknown or missing or mis_shaped or mis_typed:
        raise TensorMismatchError(kind, unknown, missing, mis_shaped, source, mis_typed)


def default_dtype(tensors: dict, hf_config: dict) -> np.dtype:
    """The checkpoint's own float dtype: the one all float tensors share, else the config's
    ``torch_dtype`` / ``dtype``, else float32."""
    floats = {np.dtype(t.dtype) for t in tensors.values() if is_float(t.dtype)}
    if len(floats) == 1:
        dt = floats.pop()
        if dt in (np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16), np.dtype(np.float32)):
            return dt
    name = hf_config.get("torch_dtype") or hf_config.get("dtype")
    if isinstance(name, str) and name.lower() in DTYPES:
        return np.dtype(DTYPES[name.lower()])
    return np.dtype(np.float32)


#: Kinds whose ``config.mask_token_id`` is filled from the draft config's parallel-drafting
#: token (``formats.parallel_drafting_token_id``); DFlash reads its own ``mask_token_id``.
PARALLEL_TOKEN_KINDS = frozenset({"eagle", "eagle3", "llama", "qwen2", "qwen3"})


def with_parallel_drafting_token(kind: str, config, hf_config: dict):
    """``config`` with ``mask_token_id`` set to the draft config's parallel-drafting token
    (vLLM: ``dflash_config.mask_token_id``, ``pard_token``, ``ptd_token_id``) for EAGLE /
    EAGLE-3 heads and draft LMs; unchanged when the config names none."""
    if kind not in PARALLEL_TOKEN_KINDS:
        return config
    tok = parallel_drafting_token_id(hf_config)
    return config if tok is None else config.replace(mask_token_id=tok)


def make_config(kind: str, hf_config: dict, tensors: dict):
    """``registry.config_from_hf``, with the optional-tensor flags (``has_embed_tokens``,
    ``has_d2t``...) set from the canonical tensor names present, and the parallel-drafting
    token in ``mask_token_id`` (:func:`with_parallel_drafting_token`)."""
    registry = _registry()
    config = registry.config_with_tensors(kind, registry.config_from_hf(kind, hf_config), tensors)
    return with_parallel_drafting_token(kind, config, hf_config)


def prepare(src, *, format: str | None = None, dtype=None,
            progress: Progress | None = None) -> Prepared:
    """Read, normalize, validate and build params. Nothing is written anywhere."""
    dtype = parse_dtype(dtype)
    ckpt, norm = read_and_normalize(src, format)
    registry = _registry()
    try:
        config = make_config(norm.kind, norm.hf_config, norm.tensors)
    except CheckpointError:
        raise
    except (ValueError, TypeError, KeyError) as e:
        raise CheckpointError(f"{ckpt.path}: invalid {norm.kind} config ({e})") from None
    validate(norm.kind, config, norm.tensors, str(ckpt.path))
    if dtype is None:
        dtype = default_dtype(norm.tensors, norm.hf_config)
    arrays, n_values, total = {}, 0, len(norm.tensors) + len(norm.extra_params)
    for i, key in enumerate(sorted(norm.tensors)):
        a = norm.tensors[key].load()
        if is_float(a.dtype) and a.dtype != dtype:
            a = a.astype(dtype)
        arrays[key] = a
        n_values += a.size
        if progress is not None:
            progress(i + 1, total, key)
    params = registry.params_from_tensors(norm.kind, config, arrays, dtype)
    del arrays
    if norm.extra_params:
        import jax.numpy as jnp  # noqa: PLC0415

        for i, key in enumerate(sorted(norm.extra_params), start=len(norm.tensors)):
            a = norm.extra_params[key].load()
            if not is_float(a.dtype):
                raise CheckpointError(f"{ckpt.path}: {key}: expected a float tensor, found {a.dtype}")
            params[key] = jnp.asarray(a.astype(dtype))
            n_values += a.size
            if progress is not None:
                progress(i + 1, total, key)
    return Prepared(norm.kind, norm.format, norm.hf_config, config, params, np.dtype(dtype),
                    norm.notes, ckpt.files, total, n_values, str(ckpt.path))


def save_prepared(prep: Prepared, out_dir: Path, log: Log | None = None) -> None:
    """Write ``prep`` into the (new, empty) directory ``out_dir``."""
    log = log or _log_warning
    import orbax.checkpoint as ocp  # noqa: PLC0415

    out_dir = Path(out_dir).absolute()
    ckptr = ocp.StandardCheckpointer()
    # orbax commits in background threads: SIGINT / SIGTERM wait for the commit (the
    # staging directory is then removed whole), and a failure waits for it too.
    with held_signals(log, doing="the orbax commit"):
        try:
            ckptr.save(out_dir / PARAMS_DIR, prep.params)
        finally:
            try:
                ckptr.wait_until_finished()
            finally:
                ckptr.close()
    meta = {
        "specjax_checkpoint_version": METADATA_VERSION,
        "kind": prep.kind,
        "format": prep.format,
        "dtype": dtype_name(prep.dtype),
        "hf_config": prep.hf_config,
        "config": _registry().config_to_dict(prep.config),
        "source": prep.source,
        "source_files": [os.path.basename(f) for f in prep.files],
        "num_tensors": prep.n_tensors,
        "num_values": prep.n_values,
        "notes": prep.notes,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    extra = _extra_param_shapes(prep.params)
    if extra:
        meta["extra_params"] = extra
    (out_dir / METADATA_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")


@dataclasses.dataclass
class Summary:
    kind: str
    format: str
    dtype: str
    n_tensors: int
    n_values: int
    notes: list[str]
    dst: str
    seconds: float

    def text(self) -> str:
        lines = [f"converted {self.n_tensors} tensors ({self.n_values:,} values) from format "
                 f"{self.format!r} to a {self.kind} model in {self.dtype} "
                 f"({self.seconds:.1f}s)", f"  -> {self.dst}"]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def previous_output_reason(path: Path) -> str | None:
    """None when the directory ``path`` is a previous ``specjax-convert`` output (just
    ``specjax.json``, written by specjax, and ``params/``), which ``force`` may replace;
    else what makes it something else."""
    entries = sorted(e.name for e in path.iterdir())
    others = [e for e in entries if e not in (METADATA_FILE, PARAMS_DIR)]
    if others:
        return f"it holds {', '.join(others[:5])}{', ...' if len(others) > 5 else ''}"
    try:
        meta = json.loads((path / METADATA_FILE).read_text())
    except (OSError, ValueError):
        return f"it has no readable {METADATA_FILE}"
    if not isinstance(meta, dict) or "specjax_checkpoint_version" not in meta:
        return f"its {METADATA_FILE} was not written by specjax"
    return None


def _log_warning(msg: str) -> None:
    logging.getLogger("specjax.converters").warning("%s", msg)


def convert(src, dst, *, format: str | None = None, dtype=None, force: bool = False,
            progress: Progress | None = None, log: Log | None = None) -> Summary:
    """Convert the checkpoint at ``src`` into ``dst`` (orbax params + ``specjax.json``).

    ``dst`` follows the destination rules of :mod:`specjax.converters.destination`, checked
    before anything is read: it must be new or an empty directory, or with ``force`` a
    previous specjax output; never SRC, inside it or containing it, the current or home
    directory, or a symbolic link. The output is staged beside ``dst`` and renamed into
    place at the end, so a failed or interrupted run (Ctrl-C, SIGTERM) leaves nothing at
    ``dst`` or beside it, and with ``force`` the old ``dst`` untouched. ``log`` gets notes
    (stale staging directories of killed runs removed, a signal held); default: the
    ``specjax.converters`` logger.
    """
    t0 = time.perf_counter()
    log = log or _log_warning
    parse_dtype(dtype)
    if format is not None:
        check_format_name(format)
    dst = check_destination(dst, src=src, force=force, replaceable=previous_output_reason)
    result: list[Prepared] = []

    def fill(out_dir: Path) -> None:
        prep = prepare(src, format=format, dtype=dtype, progress=progress)
        save_prepared(prep, out_dir, log)
        result.append(prep)

    def replace(path: Path) -> bool:
        return path.is_dir() and not path.is_symlink() and \
            destination_in_use(path, force, previous_output_reason) is None

    with sigterm_raises():
        write_dir_atomically(dst, fill, replace=replace, what="the conversion", log=log)
    prep = result[0]
    return Summary(prep.kind, prep.format, dtype_name(prep.dtype), prep.n_tensors,
                   prep.n_values, prep.notes, str(dst), time.perf_counter() - t0)


# -- loading --------------------------------------------------------------------------------

def is_converted(path) -> bool:
    return (Path(path) / METADATA_FILE).is_file()


def load_pretrained(path, dtype=None, *, format: str | None = None):
    """``(kind, config, params)`` from a ``specjax-convert`` output directory, or straight
    from an original checkpoint (HF layout, EAGLE, Medusa, DFlash...; ``format``
    auto-detected when None). ``dtype`` (bf16 / fp16 / fp32) casts the float params;
    None keeps the stored (or checkpoint) dtype."""
    dt = parse_dtype(dtype)
    path = Path(path).absolute()
    if not is_converted(path):
        prep = prepare(path, format=format, dtype=dt)
        return prep.kind, prep.config, prep.params
    import orbax.checkpoint as ocp  # noqa: PLC0415

    meta = json.loads((path / METADATA_FILE).read_text())
    if meta.get("specjax_checkpoint_version") != METADATA_VERSION:
        raise CheckpointError(f"{path}/{METADATA_FILE}: unsupported version "
                              f"{meta.get('specjax_checkpoint_version')!r}")
    kind = meta["kind"]
    config = config_from_metadata(meta)
    stored = parse_dtype(meta["dtype"])
    target = _restore_target(path, kind, config, dt or stored, meta.get("extra_params") or {})
    ckptr = ocp.StandardCheckpointer()
    try:
        params = ckptr.restore(path / PARAMS_DIR, target)
    finally:
        ckptr.close()
    return kind, config, params


def _restore_target(path: Path, kind: str, config, dtype, extra: dict) -> dict:
    """The abstract params orbax restores into: the registry's structure, plus the entries
    ``extra`` (``specjax.json``'s ``extra_params``: name -> shape) names, whose shapes must
    be what the registry says (CheckpointError, before anything is read, otherwise)."""
    registry = _registry()
    unknown = sorted(set(extra) - set(EXTRA_PARAM_KEYS))
    if unknown:
        raise CheckpointError(f"{path}/{METADATA_FILE}: unknown extra_params {unknown} (this "
                              f"version of specjax knows {list(EXTRA_PARAM_KEYS)})")
    try:
        target = registry.abstract_params(kind, config, dtype,
                                          mask_hidden=registry.MASK_HIDDEN in extra)
    except ValueError as e:
        raise CheckpointError(f"{path}/{METADATA_FILE}: extra_params: {e}") from None
    for name, shape in extra.items():
        if tuple(int(d) for d in shape) != tuple(target[name].shape):
            raise CheckpointError(f"{path}/{METADATA_FILE}: extra_params[{name!r}] has shape "
                                  f"{list(shape)}; the {kind} config needs "
                                  f"{list(target[name].shape)}")
    return target


def config_from_metadata(meta: dict):
    """The saved ``config_to_dict`` output (it round-trips through ``config_from_hf`` and
    carries the optional-tensor flags that decide the params structure), with the
    parallel-drafting token of the saved ``hf_config`` (``with_parallel_drafting_token``)."""
    config = _registry().config_from_hf(meta["kind"], meta["config"])
    return with_parallel_drafting_token(meta["kind"], config, meta.get("hf_config") or {})


def _extra_param_shapes(params) -> dict[str, list[int]]:
    """Params entries outside the tensor table (:data:`EXTRA_PARAM_KEYS`) present in
    ``params``: name -> shape, recorded in ``specjax.json`` so that a load can rebuild the
    restore target."""
    if not isinstance(params, dict):
        return {}
    return {k: [int(d) for d in np.shape(params[k])] for k in EXTRA_PARAM_KEYS if k in params}


def supported_formats() -> dict[str, str]:
    return {name: f"{f.kind}: {f.description}" for name, f in FORMATS.items()}

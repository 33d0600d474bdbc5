"""Read -> normalize -> validate -> build params -> save (orbax), and load back.

The output directory (``specjax.json``, ``params/``, the carried tokenizer files) is
described in :mod:`specjax.converters.store`; it is staged and renamed into place
(:mod:`specjax.converters.destination`).
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import json
import logging
import os
import re
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
from specjax.converters import store
from specjax.converters.errors import (
    CheckpointError,
    CorruptOutputError,
    FormatDetectionError,
    NonFiniteError,
    TensorMismatchError,
    clip,
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

METADATA_FILE = store.METADATA_FILE
PARAMS_DIR = store.PARAMS_DIR
METADATA_VERSION = store.METADATA_VERSION

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
    """A checkpoint read, normalized and validated. ``params``: the built pytree
    (:func:`prepare`), or None for a streamed conversion (:func:`plan`), whose lazily loaded
    canonical tensors are in ``tensors`` / ``extra``."""

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
    tensors: dict = dataclasses.field(default_factory=dict, repr=False)
    extra: dict = dataclasses.field(default_factory=dict, repr=False)
    allow_nonfinite: bool = False
    progress: Progress | None = dataclasses.field(default=None, repr=False)
    piece_bytes: int = store.PIECE_BYTES
    #: ``specjax.json``'s ``carried_files``: the tokenizer / generation files copied
    #: into the output (name -> size, sha256)
    carried: dict = dataclasses.field(default_factory=dict, repr=False)


# -- steps --------------------------------------------------------------------------------

def read_and_normalize(src, format: str | None = None) -> tuple[Checkpoint, Normalized]:
    """Read ``src`` and normalize it (``format`` auto-detected when None)."""
    ckpt = read_checkpoint(src)
    if format is None and not ckpt.config:
        where = ckpt.path if ckpt.path.is_dir() else ckpt.path.parent
        if not (where / "config.json").is_file() and not any(
                f.endswith("medusa_lm_head.pt") for f in ckpt.files):
            raise CheckpointError(f"{where}: no config.json beside the weights (the model's "
                                  "hyper-parameters come from it)")
    fmt = format
    if fmt is None:
        try:
            fmt = detect_format(ckpt.config, ckpt.tensors, ckpt.files)
        except FormatDetectionError:
            check_not_quantized(ckpt.config, ckpt.path)
            raise
    check_not_quantized(ckpt.config, ckpt.path, fmt)
    try:
        norm = normalize(fmt, ckpt.config, ckpt.tensors)
    except CheckpointError:
        raise
    except (ValueError, TypeError, KeyError, AttributeError, ArithmeticError) as e:
        raise CheckpointError(f"{ckpt.path}: invalid config.json for format {fmt!r} "
                              f"({type(e).__name__}: {clip(e, 200)})") from None
    norm.notes[:0] = ckpt.notes
    return ckpt, norm


def check_not_quantized(hf_config: dict, where, fmt: str | None = None) -> None:
    """CheckpointError naming ``quantization_config.quant_method`` (top level or under
    ``text_config``; FP8, AWQ, GPTQ...: their packed tensors are no weights), except format
    ``fmt`` ``gpt_oss``'s top-level ``mxfp4``, whose reader dequantizes the experts."""
    for prefix, cfg in (("", hf_config), ("text_config.", (hf_config or {}).get("text_config"))):
        q = cfg.get("quantization_config") if isinstance(cfg, dict) else None
        if q is not None:
            method = q.get("quant_method", "unknown") if isinstance(q, dict) else q
            if method == "mxfp4" and not prefix and fmt == "gpt_oss":
                continue
            raise CheckpointError(
                f"{where}: config {prefix}quantization_config.quant_method={clip(method, 40)!r}: "
                "quantized checkpoints are not supported; convert the unquantized (bf16 / "
                "fp16 / fp32) release")


def validate(kind: str, config, tensors: dict, source: str = "") -> None:
    """Compare ``tensors`` (key -> anything with ``.shape`` and ``.dtype``) with
    ``registry.expected_tensors``: :class:`TensorMismatchError` naming every bad key."""
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


_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def check_layer_count(hf_config: dict, tensors: dict, source: str) -> None:
    """Refuse a config whose ``num_hidden_layers`` exceeds the layers in the file, before
    the (per-layer) tensor table is built."""
    n = hf_config.get("num_hidden_layers")
    if not isinstance(n, int) or isinstance(n, bool):
        return
    present = {int(m[1]) for k in tensors if (m := _LAYER.search(k))}
    if n > len(present) + 1 and n > max(present, default=-1) + 1:
        have = f"layers 0..{max(present)}" if present else "no layers"
        raise CheckpointError(f"{source}: config.json says num_hidden_layers={n}, but the "
                              f"weights hold {have} ({len(present)} layers)")


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
PARALLEL_TOKEN_KINDS = frozenset({"eagle", "eagle3", "llama", "qwen2", "qwen3", "mistral",
                                  "ministral", "gemma3", "qwen3_moe", "gpt_oss"})


def with_parallel_drafting_token(kind: str, config, hf_config: dict):
    """``config`` with ``mask_token_id`` set to the draft config's parallel-drafting token
    (``pard_token``...) for :data:`PARALLEL_TOKEN_KINDS`; unchanged when it names none."""
    if kind not in PARALLEL_TOKEN_KINDS:
        return config
    tok = parallel_drafting_token_id(hf_config)
    return config if tok is None else config.replace(mask_token_id=tok)


def make_config(kind: str, hf_config: dict, tensors: dict):
    """``registry.config_from_hf`` with the optional-tensor flags set from the tensors
    present and the parallel-drafting token in ``mask_token_id``."""
    registry = _registry()
    config = registry.config_with_tensors(kind, registry.config_from_hf(kind, hf_config), tensors)
    return with_parallel_drafting_token(kind, config, hf_config)


def plan(src, *, format: str | None = None, dtype=None, allow_nonfinite: bool = False,
         progress: Progress | None = None) -> Prepared:
    """Read, normalize and validate ``src``; no weight bytes are read (``params`` None)."""
    dtype = parse_dtype(dtype)
    ckpt, norm = read_and_normalize(src, format)
    check_layer_count(norm.hf_config, norm.tensors, str(ckpt.path))
    try:
        config = make_config(norm.kind, norm.hf_config, norm.tensors)
    except CheckpointError:
        raise
    except (ValueError, TypeError, KeyError, AttributeError, ArithmeticError,
            OverflowError) as e:
        raise CheckpointError(f"{ckpt.path}: invalid {norm.kind} config "
                              f"({type(e).__name__}: {clip(e, 200)})") from None
    validate(norm.kind, config, norm.tensors, str(ckpt.path))
    for key, ref in norm.extra_params.items():
        if not is_float(ref.dtype):
            raise CheckpointError(f"{ckpt.path}: {key}: expected a float tensor, found {ref.dtype}")
    if dtype is None:
        dtype = default_dtype(norm.tensors, norm.hf_config)
    refs = list(norm.tensors.values()) + list(norm.extra_params.values())
    return Prepared(norm.kind, norm.format, norm.hf_config, config, None, np.dtype(dtype),
                    norm.notes, ckpt.files, len(refs), sum(r.size for r in refs),
                    str(ckpt.path), norm.tensors, norm.extra_params, allow_nonfinite, progress)


def prepare(src, *, format: str | None = None, dtype=None, allow_nonfinite: bool = False,
            progress: Progress | None = None) -> Prepared:
    """Read, normalize, validate and build params (``jax.Array`` leaves); writes nothing."""
    import jax.numpy as jnp  # noqa: PLC0415

    prep = plan(src, format=format, dtype=dtype, allow_nonfinite=allow_nonfinite)
    leaves, done = {}, 0
    for path, load, _nbytes, key in leaf_items(prep):
        if path is not None:
            leaves[path] = jnp.asarray(load())
        done += 1
        if progress is not None:
            progress(done, prep.n_tensors, key)
    prep.params = store.unflatten(leaves)
    return prep


def leaf_items(prep: Prepared):
    """``(params path, load, nbytes, key)`` for every canonical tensor (path and load None
    for a tensor the model does not keep)."""
    registry = _registry()
    config = prep.config
    for x in registry.tensor_table(prep.kind, config):
        ref = prep.tensors.get(x.key)
        if ref is None:
            if x.required or (x.flag and getattr(config, x.flag)):
                raise CheckpointError(f"{prep.source}: missing tensor {x.key!r}")
            continue
        if x.flag and getattr(config, x.flag) is False:
            raise CheckpointError(f"{prep.source}: tensor {x.key!r} is present but the config "
                                  f"sets {x.flag}=False")
        if x.path is None:   # accepted, not kept (vLLM ignores it too)
            yield None, None, 0, x.key
            continue
        out = np.dtype(np.int32) if x.conv == "int" else prep.dtype
        yield (x.path, functools.partial(convert_tensor, prep, ref, x.key, x.shape, x.conv),
               ref.size * out.itemsize, x.key)
    for key in sorted(prep.extra):
        ref = prep.extra[key]
        yield ((key,), functools.partial(convert_tensor, prep, ref, key, ref.shape, "copy"),
               ref.size * prep.dtype.itemsize, key)


def convert_tensor(prep: Prepared, ref, key: str, shape: tuple, conv: str) -> np.ndarray:
    """Load ``ref`` and turn it into its params leaf: integer maps -> int32 (``d2t``
    bounds-checked against the target vocabulary), floats -> ``prep.dtype`` (NaN / Inf /
    overflow refused unless ``allow_nonfinite``), linear weights transposed to [in, out]."""
    a = ref.load()
    where = f"{prep.source}: tensor {key!r} ({ref.source})"
    if tuple(a.shape) != tuple(shape):
        raise CheckpointError(f"{where}: shape {list(a.shape)}, expected {list(shape)}")
    if conv == "int":
        if not np.issubdtype(a.dtype, np.integer):
            raise CheckpointError(f"{where}: expected an integer tensor, found {a.dtype}")
        if a.size and (a.min() < np.iinfo(np.int32).min or a.max() > np.iinfo(np.int32).max):
            raise CheckpointError(f"{where}: values do not fit in int32")
        a = np.ascontiguousarray(a, dtype=np.int32)
        if key == "d2t":
            check_d2t(a, prep.config.vocab_size, where)
        return a
    if not is_float(a.dtype):
        raise CheckpointError(f"{where}: expected a float tensor, found {a.dtype}")
    if not prep.allow_nonfinite:
        check_finite(a, where)
    with np.errstate(over="ignore", invalid="ignore"):
        cast = a.astype(prep.dtype, copy=False)
    if not prep.allow_nonfinite and cast.dtype != a.dtype:
        check_finite(cast, where, f" after the cast to {dtype_name(prep.dtype)} (overflow)")
    if conv != "linear":
        return _registry().to_param(cast, conv)
    if cast.dtype.itemsize == 2:  # a bit copy: NumPy transposes its own 16-bit ints faster
        return np.ascontiguousarray(cast.view(np.uint16).T).view(cast.dtype)
    return np.ascontiguousarray(cast.T)


def check_finite(a: np.ndarray, where: str, how: str = "", chunk: int = 2**24) -> None:
    """:class:`NonFiniteError` naming ``where`` when ``a`` holds NaN or Inf."""
    flat = a.reshape(-1)
    for i in range(0, flat.size, chunk):
        ok = np.isfinite(flat[i: i + chunk])
        if not ok.all():
            j = i + int(np.argmin(ok))
            bad = int(ok.size - np.count_nonzero(ok))
            raise NonFiniteError(f"{where}: {bad}+ NaN/Inf values{how} (first at flat index "
                                 f"{j}: {flat[j]}); pass allow_nonfinite=True "
                                 "(--allow-nonfinite) to convert it anyway")


def check_d2t(d2t: np.ndarray, vocab: int, where: str) -> None:
    """EAGLE-3 / DFlash ``d2t``: draft id ``i`` -> target id ``i + d2t[i]``, which must lie
    in ``[0, vocab)``."""
    target = np.arange(d2t.size, dtype=np.int64) + d2t.astype(np.int64)
    bad = np.flatnonzero((target < 0) | (target >= vocab))
    if bad.size:
        i = int(bad[0])
        raise CheckpointError(f"{where}: maps {bad.size} draft ids outside the target "
                              f"vocabulary [0, {vocab}) (first: draft id {i} -> {int(target[i])})")


def save_prepared(prep: Prepared, out_dir: Path, log: Log | None = None) -> None:
    """Write ``prep`` into the new directory ``out_dir``: the params in parts of about
    ``prep.piece_bytes``, then ``specjax.json``."""
    log = log or _log_warning
    out_dir = Path(out_dir).absolute()
    if prep.params is not None:
        items = [(p, functools.partial(np.asarray, v), int(np.size(v)) * np.dtype(v.dtype).itemsize,
                  store.leaf_name(p)) for p, v in store.flatten(prep.params).items()]
    else:
        items = leaf_items(prep)
    done = [0]
    total = prep.n_tensors

    def kept():
        for item in items:
            if item[0] is None:
                written([item[3]])
            else:
                yield item

    def groups():
        for g in store.pieces(kept(), prep.piece_bytes):
            yield [store.leaf_record(path, load(), key) for path, load, _n, key in g]

    def written(keys):
        for k in keys:
            done[0] += 1
            if prep.progress is not None:
                prep.progress(done[0], total, k)

    parts, arrays = store.save_parts(
        out_dir, groups(), held=lambda: held_signals(log, doing="the orbax commit"),
        progress=written)
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
        "parts": parts,
        "arrays": arrays,
    }
    extra = {k: v["shape"] for k, v in arrays.items() if k in EXTRA_PARAM_KEYS}
    if extra:
        meta["extra_params"] = extra
    if prep.carried:
        meta["carried_files"] = prep.carried
    try:
        (out_dir / METADATA_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise CheckpointError(f"{out_dir / METADATA_FILE}: no space left on the device") \
                from None
        raise


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
    carried: list[str] = dataclasses.field(default_factory=list)

    def text(self) -> str:
        lines = [f"converted {self.n_tensors} tensors ({self.n_values:,} values) from format "
                 f"{self.format!r} to a {self.kind} model in {self.dtype} "
                 f"({self.seconds:.1f}s)", f"  -> {self.dst}"]
        if self.carried:
            lines.append(f"  with {', '.join(self.carried)}")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def previous_output_reason(path: Path) -> str | None:
    """None when the directory ``path`` is a previous ``specjax-convert`` output, which
    ``force`` may replace; else what makes it something else."""
    entries = sorted(e.name for e in path.iterdir())
    try:
        meta = json.loads((path / METADATA_FILE).read_text())
    except (OSError, ValueError):
        meta = None
    carried = meta.get("carried_files") if isinstance(meta, dict) else None
    carried = [n for n in carried if n in store.CARRIED_FILES] if isinstance(carried, dict) \
        else []
    others = [e for e in entries if e not in (METADATA_FILE, PARAMS_DIR, *carried)]
    if others:
        return f"it holds {', '.join(others[:5])}{', ...' if len(others) > 5 else ''}"
    if meta is None:
        return f"it has no readable {METADATA_FILE}"
    if not isinstance(meta, dict) or "specjax_checkpoint_version" not in meta:
        return f"its {METADATA_FILE} was not written by specjax"
    return None


def _log_warning(msg: str) -> None:
    logging.getLogger("specjax.converters").warning("%s", msg)


def convert(src, dst, *, format: str | None = None, dtype=None, force: bool = False,
            progress: Progress | None = None, log: Log | None = None,
            allow_nonfinite: bool = False, piece_bytes: int | None = None) -> Summary:
    """Convert the checkpoint at ``src`` into ``dst`` (orbax params + ``specjax.json``).

    ``dst`` must be new or an empty directory, or with ``force`` a previous specjax output
    (:mod:`specjax.converters.destination`, checked before anything is read); a failed or
    interrupted run leaves it untouched. SRC's tokenizer files are checked
    (:func:`store.carried_sources`) and copied. Tensors stream in parts of about
    ``piece_bytes``; NaN / Inf raise :class:`NonFiniteError` unless ``allow_nonfinite``.
    ``progress(done, total, key)`` is called per tensor written; ``log`` gets notes
    (default: the ``specjax.converters`` logger). Raises :class:`CheckpointError`.
    """
    t0 = time.perf_counter()
    log = log or _log_warning
    parse_dtype(dtype)
    if format is not None:
        check_format_name(format)
    if piece_bytes is not None and (not isinstance(piece_bytes, int) or piece_bytes <= 0):
        raise ValueError(f"piece_bytes must be a positive int, got {piece_bytes!r}")
    dst = check_destination(dst, src=src, force=force, replaceable=previous_output_reason)
    sources = store.carried_sources(src)
    result: list[Prepared] = []

    def fill(out_dir: Path) -> None:
        prep = plan(src, format=format, dtype=dtype, allow_nonfinite=allow_nonfinite,
                    progress=progress)
        if piece_bytes is not None:
            prep.piece_bytes = piece_bytes
        prep.carried = store.copy_carried(sources, out_dir, src)
        save_prepared(prep, out_dir, log)
        result.append(prep)

    def replace(path: Path) -> bool:
        return path.is_dir() and not path.is_symlink() and \
            destination_in_use(path, force, previous_output_reason) is None

    with sigterm_raises():
        write_dir_atomically(dst, fill, replace=replace, what="the conversion", log=log)
    prep = result[0]
    return Summary(prep.kind, prep.format, dtype_name(prep.dtype), prep.n_tensors,
                   prep.n_values, prep.notes, str(dst), time.perf_counter() - t0,
                   list(sources))


# -- loading --------------------------------------------------------------------------------

def is_converted(path) -> bool:
    return (Path(path) / METADATA_FILE).is_file()


def load_pretrained(path, dtype=None, *, format: str | None = None, verify: bool = True,
                    allow_nonfinite: bool = False):
    """``Pretrained(kind, config, params)`` from a ``specjax-convert`` output directory or
    an original checkpoint (``format`` auto-detected when None). ``dtype`` (bf16 / fp16 /
    fp32) casts the float params; None keeps the stored dtype. A converted directory is
    checked (``verify``: checksums and hashes too); damage raises
    :class:`CorruptOutputError` naming the file and key."""
    dt = parse_dtype(dtype)
    path = Path(path).absolute()
    if not is_converted(path):
        if (path / PARAMS_DIR).is_dir():
            raise CheckpointError(
                f"{path}: not a converted specjax checkpoint: {METADATA_FILE} is missing (it "
                f"records the model's kind, config and arrays, and {PARAMS_DIR}/ cannot be read "
                "without it); run specjax-convert on the original checkpoint again")
        prep = prepare(path, format=format, dtype=dt, allow_nonfinite=allow_nonfinite)
        return _registry().Pretrained(prep.kind, prep.config, prep.params)
    meta = store.read_metadata(path)
    store.verify_carried(path, meta, verify=verify)
    where = path / METADATA_FILE
    kind = meta["kind"]
    try:
        config = config_from_metadata(meta)
    except CheckpointError:
        raise
    except (ValueError, TypeError, KeyError, AttributeError, ZeroDivisionError) as e:
        raise CorruptOutputError(f"{where}: key 'config' does not describe a {kind!r} model "
                                 f"({type(e).__name__}: {clip(e, 200)})") from None
    stored = parse_dtype(meta["dtype"])
    try:
        target = _restore_target(path, kind, config, stored, meta.get("extra_params") or {})
        params = store.restore(path, meta, target, verify=verify)
    except CheckpointError:
        _config_matches_arrays(where, meta)   # name the edited config key, when one is to blame
        raise
    if dt is not None and dt != stored:
        import jax  # noqa: PLC0415

        params = jax.tree.map(lambda a: a.astype(dt) if is_float(a.dtype) else a, params)
    return _registry().Pretrained(kind, config, params)


def _restore_target(path: Path, kind: str, config, dtype, extra: dict) -> dict:
    """The abstract params orbax restores into, with the ``extra_params`` entries
    (name -> shape; CheckpointError when a shape differs from the registry's)."""
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


def _config_matches_arrays(where: Path, meta: dict) -> None:
    # CorruptOutputError naming the config key (hidden_size, num_hidden_layers,
    # intermediate_size) that disagrees with the recorded arrays (a config edited after the
    # conversion). Called once the load has failed; silent when no such key is to blame.
    config, arrays = meta.get("config"), meta.get("arrays")
    if not isinstance(config, dict) or not isinstance(arrays, dict):
        return

    def shape(suffix: str):
        for name in sorted(arrays):
            rec = arrays[name]
            if name.endswith(suffix) and isinstance(rec, dict) and \
                    isinstance(rec.get("shape"), list) and rec["shape"]:
                return name, rec["shape"]
        return None, None

    def refuse(key, value, name, shp, why):
        raise CorruptOutputError(
            f"{where}: config {key}={value!r} but the checkpoint's {name} is {list(shp)}: "
            f"{why} (the config was edited after the conversion; restore {key}, or run "
            "specjax-convert on the original checkpoint again)")

    hidden = config.get("hidden_size")
    name, shp = shape("embed_tokens/embedding")
    if isinstance(hidden, int) and name is not None and shp[-1] != hidden:
        refuse("hidden_size", hidden, name, shp, f"its last dimension is {shp[-1]}")
    layers = config.get("num_hidden_layers")
    found = {int(m.group(1)) for n in arrays if (m := re.match(r"layers/(\d+)/", n))}
    if isinstance(layers, int) and found and len(found) != layers:
        # the per-layer arrays decide it: a model keeps one layers/N/ per decoder layer
        raise CorruptOutputError(
            f"{where}: config num_hidden_layers={layers!r} but the checkpoint holds "
            f"{len(found)} decoder layers (layers/0 .. layers/{max(found)}) (the config was "
            "edited after the conversion; restore num_hidden_layers, or run specjax-convert "
            "on the original checkpoint again)")
    inter = config.get("intermediate_size")
    name, shp = shape("mlp/up_proj/kernel")
    if isinstance(inter, int) and name is not None and shp[-1] != inter:
        refuse("intermediate_size", inter, name, shp, f"its last dimension is {shp[-1]}")


def config_from_metadata(meta: dict):
    """The saved ``config``, with the parallel-drafting token of the saved ``hf_config``."""
    config = _registry().config_from_hf(meta["kind"], meta["config"])
    return with_parallel_drafting_token(meta["kind"], config, meta.get("hf_config") or {})


def _extra_param_shapes(params) -> dict[str, list[int]]:
    """Params entries outside the tensor table (:data:`EXTRA_PARAM_KEYS`): name -> shape."""
    if not isinstance(params, dict):
        return {}
    return {k: [int(d) for d in np.shape(params[k])] for k in EXTRA_PARAM_KEYS if k in params}


def supported_formats() -> dict[str, str]:
    return {name: f"{f.kind}: {f.description}" for name, f in FORMATS.items()}

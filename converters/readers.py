"""Find and read checkpoint files: safetensors (single or sharded), PyTorch ``.bin`` /
``.pt`` zip archives (single or sharded), ``medusa_lm_head.pt``; plus ``config.json``.

Everything returns :class:`TensorRef` (shape and dtype from the header; bytes on demand).
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

from specjax.converters.errors import CheckpointError, clip, listing, short
from specjax.converters.tensor_ref import TensorRef
from specjax.converters.torch_pickle import read_torch_file

SAFETENSORS_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8,
    "U64": np.uint64, "U32": np.uint32, "U16": np.uint16, "U8": np.uint8, "BOOL": np.bool_,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
}
#: A safetensors header longer than this is refused.
MAX_HEADER_BYTES = 100 * 2**20
#: ``config.json`` / a shard index longer than this is refused.
MAX_JSON_BYTES = 64 * 2**20
#: Files beside the weights that are known and deliberately not read.
IGNORED_EXTRA_FILES = ("mask_embedding.pt",)
#: Trainer state saved beside weights (pickles of arbitrary objects): never read.
TRAINER_FILES = ("training_args.bin", "optimizer.pt", "optimizer.bin", "scheduler.pt",
                 "scaler.pt")


@dataclasses.dataclass
class Checkpoint:
    """What is on disk: ``config`` (config.json, or ``{}``), lazily loaded ``tensors``, the
    weight ``files`` read, and ``notes`` for the summary."""

    path: Path
    config: dict
    tensors: dict[str, TensorRef]
    files: list[str]
    notes: list[str] = dataclasses.field(default_factory=list)


# -- safetensors -----------------------------------------------------------------------

def _st_entry(path: str, key: str, info) -> tuple[np.dtype, tuple[int, ...], int, int]:
    """``(dtype, shape, begin, end)`` of one safetensors header entry, type-checked."""
    where = f"{path}: tensor {short(key)}"
    if not isinstance(info, dict):
        raise CheckpointError(f"{where}: header entry is a {type(info).__name__}, not an object")
    dt, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dt, str) or dt not in SAFETENSORS_DTYPES:
        raise CheckpointError(f"{where}: dtype {short(dt)} is not supported (allowed: "
                              f"{', '.join(SAFETENSORS_DTYPES)})")
    if not isinstance(shape, list) or not all(_nonneg_int(d) for d in shape):
        raise CheckpointError(f"{where}: shape {short(shape)} is not a list of non-negative "
                              "integers")
    if not isinstance(offsets, list) or len(offsets) != 2 \
            or not all(_nonneg_int(o) for o in offsets):
        raise CheckpointError(f"{where}: data_offsets {short(offsets)} is not two "
                              "non-negative integers [begin, end]")
    return np.dtype(SAFETENSORS_DTYPES[dt]), tuple(shape), offsets[0], offsets[1]


def _nonneg_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def read_safetensors_header(path: str | os.PathLike) -> dict[str, TensorRef]:
    """Parse a ``.safetensors`` header into memory-mapped :class:`TensorRef`; every entry
    is type-checked and its offsets must match its byte count, lie inside the file and not
    overlap (:class:`CheckpointError` otherwise)."""
    path = os.fspath(path)
    name = os.path.basename(path)
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) != 8:
                raise CheckpointError(f"{path}: too short for a safetensors file")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8 or n > MAX_HEADER_BYTES:
                raise CheckpointError(f"{path}: bad safetensors header length {n}")
            text = f.read(n)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror or e})") from None
    try:
        header = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise CheckpointError(f"{path}: safetensors header is not JSON ({clip(e)})") \
            from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: safetensors header is not a JSON object")
    meta = header.get("__metadata__")
    if meta is not None and not isinstance(meta, dict):
        raise CheckpointError(f"{path}: __metadata__ is a {type(meta).__name__}, not an object")
    base = 8 + n
    out, spans = {}, []
    for key, info in header.items():
        if key == "__metadata__":
            continue
        dtype, shape, begin, end = _st_entry(path, key, info)
        nbytes = dtype.itemsize
        for d in shape:
            nbytes *= d
        if end - begin != nbytes or base + end > size:
            raise CheckpointError(f"{path}: tensor {short(key)}: offsets {[begin, end]} do not "
                                  f"fit {info['dtype']}{list(shape)} in a {size}-byte file")
        if nbytes:
            spans.append((begin, end, key))
        out[key] = TensorRef(shape, dtype, _mmap_loader(path, base + begin, dtype, shape, size),
                             f"{name}:{key}")
    spans.sort()
    for (b0, e0, k0), (b1, _e1, k1) in zip(spans, spans[1:]):
        if b1 < e0:
            raise CheckpointError(f"{path}: tensors {short(k0)} and {short(k1)} overlap "
                                  f"(data_offsets {[b0, e0]} and {[b1, _e1]})")
    return out


def _mmap_loader(path: str, offset: int, dtype: np.dtype, shape: tuple, size: int):
    def load() -> np.ndarray:
        count = 1
        for d in shape:
            count *= d
        if count == 0:
            return np.zeros(shape, dtype)
        try:
            if os.path.getsize(path) != size:
                raise CheckpointError(f"{path}: changed size while being read")
            return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=shape)
        except OSError as e:
            raise CheckpointError(f"{path}: cannot read ({e.strerror or e})") from None
    return load


# -- shards ----------------------------------------------------------------------------

def _read_file(path: Path) -> dict[str, TensorRef]:
    if path.suffix == ".safetensors":
        return read_safetensors_header(path)
    return read_torch_file(path)


def _read_json(path: Path, what: str):
    try:
        if path.stat().st_size > MAX_JSON_BYTES:
            raise CheckpointError(f"{path}: larger than {MAX_JSON_BYTES} bytes; not a {what}")
        return json.loads(path.read_bytes())
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror or e})") from None
    except (ValueError, RecursionError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({clip(e)})") from None


def _shard_path(index_path: Path, fname: str) -> Path:
    """``fname`` (a weight_map value) inside the checkpoint directory: relative, no ``..``."""
    parts = Path(fname).parts
    if not fname or os.path.isabs(fname) or ".." in parts or "\\" in fname \
            or fname.startswith("~"):
        raise CheckpointError(f"{index_path}: shard {short(fname)} is not a file name inside "
                              "the checkpoint directory (absolute paths and '..' are refused)")
    return index_path.parent / fname


def _read_sharded(index_path: Path) -> tuple[dict[str, TensorRef], list[str]]:
    index = _read_json(index_path, "shard index")
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index_path}: not a shard index: 'weight_map' is "
                              f"{'absent' if weight_map is None else type(weight_map).__name__}"
                              ", expected an object mapping tensor names to shard files")
    bad = [k for k, v in weight_map.items() if not isinstance(v, str)]
    if bad:
        raise CheckpointError(f"{index_path}: weight_map values must be shard file names; "
                              f"not for {listing(short(k) for k in bad)}")
    files = sorted(set(weight_map.values()))
    tensors, origin = {}, {}
    for fname in files:
        fpath = _shard_path(index_path, fname)
        if not fpath.is_file():
            raise CheckpointError(f"{index_path}: shard {short(fname)} does not exist")
        for k, ref in _read_file(fpath).items():
            if k in tensors:
                raise CheckpointError(f"tensor {short(k)} is in both {origin[k]} and {fname}")
            tensors[k], origin[k] = ref, fname
    absent = sorted(k for k, f in weight_map.items() if origin.get(k) != f)
    if absent:
        raise CheckpointError(
            f"{index_path}: tensors listed in the weight_map are not in their shard: "
            + listing(f"{short(k)} (expected in {weight_map[k]})" for k in absent))
    return tensors, [str(index_path.parent / f) for f in files]


def _read_files(paths: list[Path]) -> dict[str, TensorRef]:
    tensors, origin = {}, {}
    for p in paths:
        for k, ref in _read_file(p).items():
            if k in tensors:
                raise CheckpointError(f"tensor {short(k)} is in both {origin[k]} and {p.name}")
            tensors[k], origin[k] = ref, p.name
    return tensors


def find_weight_files(src: Path) -> tuple[str, list[Path]]:
    """Pick the weight files of a checkpoint directory in the order vLLM / HF prefer
    (indexes, then single files; trainer state skipped). Returns ``(how, paths)``, ``how``
    ``"index"`` or ``"files"``."""
    for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        if (src / index).is_file():
            return "index", [src / index]
        single = src / index.removesuffix(".index.json")
        if single.is_file():
            return "files", [single]
    if (src / "medusa_lm_head.pt").is_file():
        return "files", [src / "medusa_lm_head.pt"]
    for patterns in (("*.safetensors",), ("*.bin", "*.pt", "*.pth")):
        found = sorted(p for pat in patterns for p in src.glob(pat)
                       if p.is_file() and not _ignored(p.name))
        if found:
            return "files", found
    raise CheckpointError(f"{src}: no weight files (*.safetensors, *.bin, *.pt, or a "
                          "*.index.json shard index)")


def _ignored(name: str) -> bool:
    return name in IGNORED_EXTRA_FILES or name in TRAINER_FILES or name.startswith("rng_state")


def read_checkpoint(src: str | os.PathLike) -> Checkpoint:
    """Read ``config.json`` and the tensor headers of a checkpoint.

    ``src`` is a directory, or one weight file (``model.safetensors``,
    ``pytorch_model.bin``, ``medusa_lm_head.pt``, or a ``*.index.json``); a
    ``config.json`` beside it is read when present.
    """
    src = Path(src).absolute()
    if not src.exists():
        raise CheckpointError(f"{src} does not exist")
    directory = src if src.is_dir() else src.parent
    notes = []
    if src.is_dir():
        how, paths = find_weight_files(src)
        for extra in IGNORED_EXTRA_FILES:
            if (src / extra).exists():
                notes.append(f"ignored {extra} (not used by vLLM's loader either)")
    else:
        how, paths = ("index" if src.name.endswith(".index.json") else "files"), [src]
    if how == "index":
        tensors, files = _read_sharded(paths[0])
    else:
        tensors, files = _read_files(paths), [str(p) for p in paths]
    config = {}
    cfg_path = directory / "config.json"
    if cfg_path.is_file():
        config = _read_json(cfg_path, "config")
        if not isinstance(config, dict):
            raise CheckpointError(f"{cfg_path}: not a JSON object")
    return Checkpoint(src, config, tensors, files, notes)

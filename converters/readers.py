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

from specjax.converters.errors import CheckpointError
from specjax.converters.tensor_ref import TensorRef
from specjax.converters.torch_pickle import read_torch_file

SAFETENSORS_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8,
    "U64": np.uint64, "U32": np.uint32, "U16": np.uint16, "U8": np.uint8, "BOOL": np.bool_,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
}
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

def read_safetensors_header(path: str | os.PathLike) -> dict[str, TensorRef]:
    """Parse a ``.safetensors`` header: 8-byte little-endian length N, N bytes of JSON
    ``{name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": ...}``, then the
    data (offsets relative to its start)."""
    path = os.fspath(path)
    name = os.path.basename(path)
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise CheckpointError(f"{path}: too short for a safetensors file")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8 or n > 100 * 2**20:
            raise CheckpointError(f"{path}: bad safetensors header length {n}")
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise CheckpointError(f"{path}: safetensors header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: safetensors header is not a JSON object")
    base = 8 + n
    out = {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype = np.dtype(SAFETENSORS_DTYPES[info["dtype"]])
            shape = tuple(int(s) for s in info["shape"])
            begin, end = (int(o) for o in info["data_offsets"])
        except KeyError as e:
            raise CheckpointError(f"{path}: tensor {key!r}: bad or unsupported header entry "
                                  f"{info!r} ({e})") from None
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if min(shape, default=0) < 0 or end - begin != nbytes or begin < 0 \
                or base + end > size:
            raise CheckpointError(f"{path}: tensor {key!r}: offsets {[begin, end]} do not fit "
                                  f"{info['dtype']}{list(shape)} in a {size}-byte file")

        def load(path=path, offset=base + begin, dtype=dtype, shape=shape, nbytes=nbytes):
            with open(path, "rb") as f:
                f.seek(offset)
                raw = f.read(nbytes)
            return np.frombuffer(raw, dtype=dtype).reshape(shape)

        out[key] = TensorRef(shape, dtype, load, f"{name}:{key}")
    return out


# -- shards ----------------------------------------------------------------------------

def _read_file(path: Path) -> dict[str, TensorRef]:
    if path.suffix == ".safetensors":
        return read_safetensors_header(path)
    return read_torch_file(path)


def _read_sharded(index_path: Path) -> tuple[dict[str, TensorRef], list[str]]:
    try:
        weight_map = json.loads(index_path.read_text())["weight_map"]
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{index_path}: not a shard index with a weight_map ({e})") \
            from None
    files = sorted(set(weight_map.values()))
    tensors, origin = {}, {}
    for fname in files:
        fpath = index_path.parent / fname
        if not fpath.is_file():
            raise CheckpointError(f"{index_path}: shard {fname} does not exist")
        for k, ref in _read_file(fpath).items():
            if k in tensors:
                raise CheckpointError(f"tensor {k!r} is in both {origin[k]} and {fname}")
            tensors[k], origin[k] = ref, fname
    absent = sorted(k for k, f in weight_map.items() if origin.get(k) != f)
    if absent:
        raise CheckpointError(
            f"{index_path}: tensors listed in the weight_map are not in their shard: "
            + ", ".join(f"{k} (expected in {weight_map[k]})" for k in absent))
    return tensors, [str(index_path.parent / f) for f in files]


def _read_files(paths: list[Path]) -> dict[str, TensorRef]:
    tensors, origin = {}, {}
    for p in paths:
        for k, ref in _read_file(p).items():
            if k in tensors:
                raise CheckpointError(f"tensor {k!r} is in both {origin[k]} and {p.name}")
            tensors[k], origin[k] = ref, p.name
    return tensors


def find_weight_files(src: Path) -> tuple[str, list[Path]]:
    """Pick the weight files of a checkpoint directory, in the order vLLM / HF prefer:
    the safetensors index, ``model.safetensors``, the ``.bin`` index,
    ``pytorch_model.bin``, ``medusa_lm_head.pt``, then any ``*.safetensors``, then any
    ``*.bin`` / ``*.pt`` / ``*.pth`` except trainer state (``training_args.bin``,
    ``optimizer.pt``...). Returns ``(how, paths)`` with ``how`` ``"index"`` or ``"files"``."""
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
        try:
            config = json.loads(cfg_path.read_text())
        except ValueError as e:
            raise CheckpointError(f"{cfg_path}: not valid JSON ({e})") from None
        if not isinstance(config, dict):
            raise CheckpointError(f"{cfg_path}: not a JSON object")
    return Checkpoint(src, config, tensors, files, notes)

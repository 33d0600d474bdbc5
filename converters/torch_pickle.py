"""Read PyTorch ``torch.save`` zip archives (``.bin``, ``.pt``) without importing torch.

Layout of such an archive (torch >= 1.6; ``torch/serialization.py``): one top-level folder
``<prefix>/`` holding ``data.pkl`` (the pickled object), ``data/<key>`` (one raw
little-endian buffer per storage), ``version``, and in newer files ``byteorder`` and
``.data/*``. In ``data.pkl`` every storage is a persistent id
``('storage', <torch.XStorage>, key, location, numel)`` and every tensor is
``torch._utils._rebuild_tensor_v2(storage, offset, size, stride, requires_grad, hooks)``
(offset and strides in elements).

Pickle is code execution, so the unpickler resolves only an allow-list of globals: the
tensor-rebuild functions (replaced here by NumPy versions), the storage types and dtypes
(inert markers), ``collections.OrderedDict`` and ``_codecs.encode`` for latin-1 only.
Any other global raises :class:`UnsafePickleError` naming it, before anything is called.
Tensors come back as :class:`TensorRef` (their bytes are read on demand) after a bounds
check of the view against its storage.
"""

from __future__ import annotations

import collections
import io
import os
import pickle
import zipfile

import ml_dtypes
import numpy as np

from specjax.converters.errors import CheckpointError, UnsafePickleError
from specjax.converters.tensor_ref import TensorRef

_STORAGE_DTYPES = {
    "FloatStorage": np.float32,
    "HalfStorage": np.float16,
    "BFloat16Storage": ml_dtypes.bfloat16,
    "DoubleStorage": np.float64,
    "LongStorage": np.int64,
    "IntStorage": np.int32,
    "ShortStorage": np.int16,
    "CharStorage": np.int8,
    "ByteStorage": np.uint8,
    "BoolStorage": np.bool_,
    "UntypedStorage": np.uint8,
}
_TORCH_DTYPES = {
    "float32": np.float32, "float": np.float32,
    "float16": np.float16, "half": np.float16,
    "bfloat16": ml_dtypes.bfloat16,
    "float64": np.float64, "double": np.float64,
    "int64": np.int64, "long": np.int64,
    "int32": np.int32, "int": np.int32,
    "int16": np.int16, "short": np.int16,
    "int8": np.int8, "uint8": np.uint8, "bool": np.bool_,
}
_REBUILD_FUNCTIONS = ("_rebuild_tensor", "_rebuild_tensor_v2", "_rebuild_tensor_v3",
                      "_rebuild_parameter", "_rebuild_parameter_with_state")


class _Marker:
    """An inert stand-in for a torch global (a storage type or a dtype); not callable."""

    def __init__(self, name: str, dtype):
        self.name = name
        self.dtype = np.dtype(dtype)

    def __repr__(self):
        return f"torch.{self.name}"


class _Storage:
    """One ``data/<key>`` record: ``numel`` elements of ``dtype``, read once on demand."""

    def __init__(self, archive: "_Archive", key: str, dtype: np.dtype, numel: int):
        self.archive, self.key, self.dtype, self.numel = archive, key, dtype, numel
        self._array = None

    def array(self) -> np.ndarray:
        if self._array is None:
            raw = self.archive.read_record(f"data/{self.key}")
            arr = np.frombuffer(raw, dtype=self.dtype, count=self.numel)
            if self.archive.big_endian:
                arr = arr.byteswap()
            self._array = arr
        return self._array


class _Archive:
    def __init__(self, path: str):
        self.path = path
        if not zipfile.is_zipfile(path):
            with open(path, "rb") as f:
                head = f.read(16)
            if head[:1] == b"\x80":
                raise CheckpointError(
                    f"{path}: a legacy (pre-zip, torch < 1.6) torch.save file; re-save it "
                    "with a recent torch or convert it to safetensors")
            raise CheckpointError(f"{path}: not a PyTorch zip archive")
        self.zf = zipfile.ZipFile(path)
        pkls = [n for n in self.zf.namelist() if n.endswith("/data.pkl") and n.count("/") == 1]
        if len(pkls) != 1:
            raise CheckpointError(
                f"{path}: a zip archive but not torch.save output (found "
                f"{len(pkls)} top-level */data.pkl records)")
        self.prefix = pkls[0][: -len("data.pkl")]
        self.names = set(self.zf.namelist())
        byteorder = self.prefix + "byteorder"
        self.big_endian = (byteorder in self.names
                           and self.zf.read(byteorder).strip() == b"big")

    def record_size(self, name: str) -> int | None:
        full = self.prefix + name
        return self.zf.getinfo(full).file_size if full in self.names else None

    def read_record(self, name: str) -> bytes:
        return self.zf.read(self.prefix + name)


class _RestrictedUnpickler(pickle.Unpickler):
    def __init__(self, archive: _Archive):
        super().__init__(io.BytesIO(archive.read_record("data.pkl")))
        self.archive = archive
        self.storages: dict[str, _Storage] = {}
        self.n_tensors = 0

    # -- globals ---------------------------------------------------------------------
    def find_class(self, module: str, name: str):
        if module == "collections" and name == "OrderedDict":
            return collections.OrderedDict
        if module == "torch._utils" and name in _REBUILD_FUNCTIONS:
            return getattr(self, name)
        if module == "torch" and name in _STORAGE_DTYPES:
            return _Marker(name, _STORAGE_DTYPES[name])
        if module == "torch" and name in _TORCH_DTYPES:
            return _Marker(name, _TORCH_DTYPES[name])
        if module == "_codecs" and name == "encode":
            return _latin1_encode
        raise UnsafePickleError(f"{module}.{name}", self.archive.path)

    def persistent_load(self, pid):
        if (not isinstance(pid, tuple) or len(pid) != 5
                or _ascii(pid[0]) != "storage" or not isinstance(pid[1], _Marker)
                or pid[1].name not in _STORAGE_DTYPES):
            raise CheckpointError(f"{self.archive.path}: unexpected persistent id {pid!r}")
        _, storage_type, key, _location, numel = pid
        key = _ascii(key)
        if not isinstance(numel, int) or numel < 0:
            raise CheckpointError(f"{self.archive.path}: storage {key!r} has numel {numel!r}")
        if key in self.storages:
            return self.storages[key]
        size = self.archive.record_size(f"data/{key}")
        nbytes = numel * storage_type.dtype.itemsize
        if size is None or size < nbytes:
            raise CheckpointError(
                f"{self.archive.path}: storage record data/{key} is "
                f"{'absent' if size is None else f'{size} bytes'}, expected {nbytes} bytes")
        st = self.storages[key] = _Storage(self.archive, key, storage_type.dtype, numel)
        return st

    # -- tensor rebuild (NumPy versions of torch._utils') ----------------------------
    def _rebuild_tensor(self, storage, storage_offset, size, stride):
        return self._view(storage, storage_offset, size, stride, None)

    def _rebuild_tensor_v2(self, storage, storage_offset, size, stride, requires_grad=False,
                           backward_hooks=None, metadata=None):
        return self._view(storage, storage_offset, size, stride, None)

    def _rebuild_tensor_v3(self, storage, storage_offset, size, stride, requires_grad,
                           backward_hooks, dtype, metadata=None):
        if not isinstance(dtype, _Marker):
            raise CheckpointError(f"{self.archive.path}: bad dtype {dtype!r} in tensor rebuild")
        return self._view(storage, storage_offset, size, stride, dtype.dtype)

    def _rebuild_parameter(self, data, requires_grad, backward_hooks):
        return self._check_tensor(data)

    def _rebuild_parameter_with_state(self, data, requires_grad, backward_hooks, state):
        return self._check_tensor(data)

    def _check_tensor(self, data):
        if not isinstance(data, TensorRef):
            raise CheckpointError(f"{self.archive.path}: a parameter wraps {type(data).__name__}")
        return data

    def _view(self, storage, offset, size, stride, dtype) -> TensorRef:
        path = self.archive.path
        if not isinstance(storage, _Storage):
            raise CheckpointError(f"{path}: tensor rebuilt from {type(storage).__name__}, "
                                  "not a storage")
        size, stride = tuple(size), tuple(stride)
        if (not _ints(size) or not _ints(stride) or len(size) != len(stride)
                or not isinstance(offset, int) or offset < 0):
            raise CheckpointError(f"{path}: bad tensor view offset={offset!r} size={size!r} "
                                  f"stride={stride!r}")
        dtype = storage.dtype if dtype is None else np.dtype(dtype)
        numel = storage.numel * storage.dtype.itemsize // dtype.itemsize
        n = int(np.prod(size, dtype=np.int64))
        if n and offset + sum((s - 1) * st for s, st in zip(size, stride)) >= numel:
            raise CheckpointError(
                f"{path}: tensor view offset={offset} size={list(size)} stride={list(stride)} "
                f"reads past the end of storage {storage.key} ({numel} elements)")
        self.n_tensors += 1
        contiguous = stride == _contiguous_strides(size)

        def load(storage=storage, offset=offset, size=size, stride=stride, dtype=dtype):
            base = storage.array()
            if base.dtype != dtype:
                base = base.view(np.uint8)[: numel * dtype.itemsize].view(dtype)
            if n == 0:
                return np.zeros(size, dtype)
            if contiguous:
                return base[offset: offset + n].reshape(size)
            return np.array(np.lib.stride_tricks.as_strided(
                base[offset:], shape=size, strides=[s * dtype.itemsize for s in stride],
                writeable=False))

        return TensorRef(size, dtype, load, f"{os.path.basename(path)}:data/{storage.key}")


def _latin1_encode(obj, encoding="latin1", errors="strict"):
    # Protocol-2 pickles write bytes as _codecs.encode(str, 'latin1').
    if encoding not in ("latin1", "latin-1") or not isinstance(obj, str):
        raise CheckpointError(f"refusing _codecs.encode with encoding {encoding!r}")
    return obj.encode("latin1")


def _ascii(x):
    return x.decode("ascii") if isinstance(x, bytes) else x


def _ints(t):
    return all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in t)


def _contiguous_strides(size):
    strides, acc = [], 1
    for s in reversed(size):
        strides.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(strides))


def read_torch_file(path: str | os.PathLike) -> dict[str, TensorRef]:
    """The state dict in a ``torch.save`` zip archive, as ``{name: TensorRef}``.

    Raises :class:`UnsafePickleError` for a pickle naming a global outside the
    allow-list, and :class:`CheckpointError` for anything else that is not a flat
    mapping of names to tensors.
    """
    path = os.fspath(path)
    archive = _Archive(path)
    unpickler = _RestrictedUnpickler(archive)
    try:
        obj = unpickler.load()
    except (CheckpointError, UnsafePickleError):
        raise
    except Exception as e:  # malformed pickle
        raise CheckpointError(f"{path}: cannot unpickle data.pkl ({type(e).__name__}: {e})") \
            from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path}: holds a {type(obj).__name__}, not a state dict")
    out = {}
    for k, v in obj.items():
        if not isinstance(k, str) or not isinstance(v, TensorRef):
            raise CheckpointError(
                f"{path}: entry {k!r} is a {type(v).__name__}, not a tensor (a state dict "
                "maps names to tensors)")
        out[k] = v
    return out

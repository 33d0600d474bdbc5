"""Read PyTorch ``torch.save`` zip archives (``.bin``, ``.pt``) without importing torch.

The archive layout is torch's ``torch/serialization.py`` (``<prefix>/data.pkl`` plus one
raw little-endian ``data/<key>`` per storage). Pickle is code execution, so the unpickler
resolves only an allow-list of globals (tensor rebuilding, storage types, dtypes,
``OrderedDict``, latin-1 ``_codecs.encode``); any other raises :class:`UnsafePickleError`
before anything is called. Tensors come back as bounds-checked :class:`TensorRef`.
"""

from __future__ import annotations

import collections
import io
import os
import pickle
import zipfile
import zlib

import ml_dtypes
import numpy as np

from specjax.converters.errors import CheckpointError, UnsafePickleError, clip, short
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


#: ``data.pkl`` larger than this is refused (a state dict's pickle is ~200 bytes a tensor).
MAX_PICKLE_BYTES = 16 * 2**20
#: Zip failures that mean a damaged archive (wrapped in CheckpointError naming the record).
_ZIP_ERRORS = (zipfile.BadZipFile, zipfile.LargeZipFile, RuntimeError, NotImplementedError,
               EOFError, OSError, ValueError, zlib.error)


class _Inert:
    """The unpickler's own objects refuse the BUILD opcode (``__setstate__``) and any
    attribute assignment after construction."""

    __slots__ = ()

    def __setstate__(self, state):
        raise CheckpointError(f"the pickle tries to modify a {type(self).__name__.lstrip('_')} "
                              "(BUILD on an object of the unpickler); refused")

    def __setattr__(self, name, value):
        raise AttributeError(f"{type(self).__name__} is immutable")

    def _init(self, **kw):
        for k, v in kw.items():
            object.__setattr__(self, k, v)


class _Marker(_Inert):
    """An inert stand-in for a torch global (a storage type or a dtype); not callable."""

    __slots__ = ("name", "dtype")

    def __init__(self, name: str, dtype):
        self._init(name=name, dtype=np.dtype(dtype))

    def __repr__(self):
        return f"torch.{self.name}"


class _Storage(_Inert):
    """One ``data/<key>`` record: ``numel`` elements of ``dtype``, read on demand (not
    cached)."""

    __slots__ = ("archive", "key", "dtype", "numel")

    def __init__(self, archive: "_Archive", key: str, dtype: np.dtype, numel: int):
        self._init(archive=archive, key=key, dtype=dtype, numel=numel)

    def array(self) -> np.ndarray:
        nbytes = self.numel * self.dtype.itemsize
        raw = self.archive.read_record(f"data/{self.key}", exact=nbytes)
        arr = np.frombuffer(raw, dtype=self.dtype, count=self.numel)
        return arr.byteswap() if self.archive.big_endian else arr


class _Archive:
    def __init__(self, path: str):
        self.path = path
        try:
            is_zip = zipfile.is_zipfile(path)
            if not is_zip:
                with open(path, "rb") as f:
                    head = f.read(16)
        except OSError as e:
            raise CheckpointError(f"{path}: cannot read ({e.strerror or e})") from None
        if not is_zip:
            if head[:1] == b"\x80":
                raise CheckpointError(
                    f"{path}: a legacy (pre-zip, torch < 1.6) torch.save file; re-save it "
                    "with a recent torch or convert it to safetensors")
            raise CheckpointError(f"{path}: not a PyTorch zip archive")
        try:  # the archive is opened per record read, so no file stays open
            with zipfile.ZipFile(path) as zf:
                infos = zf.infolist()
        except _ZIP_ERRORS as e:
            raise CheckpointError(f"{path}: damaged zip archive ({clip(e)})") from None
        self.infos = {i.filename: i for i in infos}
        pkls = [n for n in self.infos if n.endswith("/data.pkl") and n.count("/") == 1]
        if len(pkls) != 1:
            raise CheckpointError(
                f"{path}: a zip archive but not torch.save output (found "
                f"{len(pkls)} top-level */data.pkl records)")
        self.prefix = pkls[0][: -len("data.pkl")]
        byteorder = self.prefix + "byteorder"
        self.big_endian = (byteorder in self.infos
                           and self.read_record("byteorder", limit=16).strip() == b"big")

    def record_size(self, name: str) -> int | None:
        info = self.infos.get(self.prefix + name)
        return None if info is None else info.file_size

    def check_stored(self, name: str) -> None:
        """A storage record must be stored (uncompressed) and not encrypted, as torch.save
        writes it: a compressed one could inflate without bound."""
        info = self.infos.get(self.prefix + name)
        if info is None:
            return
        where = f"{self.path}: record {self.prefix}{clip(name)}"
        if info.flag_bits & 0x1:
            raise CheckpointError(f"{where} is encrypted")
        if info.compress_type != zipfile.ZIP_STORED:
            raise CheckpointError(f"{where} is compressed (method {info.compress_type}); "
                                  "torch.save stores tensor data uncompressed")

    def read_record(self, name: str, *, exact: int | None = None,
                    limit: int | None = None) -> bytes:
        """The bytes of record ``name``: exactly ``exact`` bytes (a storage) or at most
        ``limit``, whatever the zip headers declare."""
        full = self.prefix + name
        where = f"{self.path}: record {full}"
        info = self.infos.get(full)
        if info is None:
            raise CheckpointError(f"{where} is absent")
        if info.flag_bits & 0x1:
            raise CheckpointError(f"{where} is encrypted")
        if exact is not None:
            self.check_stored(name)
            if info.file_size != exact or info.compress_size != exact:
                raise CheckpointError(f"{where} is {info.file_size} bytes, expected {exact}")
        bound = exact if exact is not None else limit
        try:
            with zipfile.ZipFile(self.path) as zf, zf.open(info.filename) as f:
                raw = f.read(bound + 1)
        except _ZIP_ERRORS as e:
            raise CheckpointError(f"{where}: damaged ({clip(e)})") from None
        if exact is not None and len(raw) != exact:
            raise CheckpointError(f"{where} holds {len(raw)} bytes, expected {exact}")
        if len(raw) > bound:
            raise CheckpointError(f"{where} is larger than {bound} bytes")
        return raw


class _AllowList:
    """The allow-list unpickler's methods, over the C (:class:`_RestrictedUnpickler`) or
    the pure-Python (:class:`_KeyFinder`) unpickler."""

    def __init__(self, archive: _Archive):
        super().__init__(io.BytesIO(archive.read_record("data.pkl", limit=MAX_PICKLE_BYTES)))
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
            return self._latin1_encode
        raise UnsafePickleError(clip(f"{module}.{name}"), self.archive.path)

    def persistent_load(self, pid):
        if (not isinstance(pid, tuple) or len(pid) != 5
                or _ascii(pid[0]) != "storage" or not isinstance(pid[1], _Marker)
                or pid[1].name not in _STORAGE_DTYPES):
            raise CheckpointError(f"{self.archive.path}: unexpected persistent id {short(pid)}")
        _, storage_type, key, _location, numel = pid
        key = _ascii(key)
        if not isinstance(key, str) or not isinstance(numel, int) or isinstance(numel, bool) \
                or numel < 0:
            raise CheckpointError(f"{self.archive.path}: storage {short(key)} has numel "
                                  f"{short(numel)}")
        if key in self.storages:
            st = self.storages[key]
            if st.numel != numel or st.dtype != storage_type.dtype:
                raise CheckpointError(f"{self.archive.path}: storage {key!r} is declared twice "
                                      "with different types or sizes")
            return st
        self.archive.check_stored(f"data/{key}")
        size = self.archive.record_size(f"data/{key}")
        nbytes = numel * storage_type.dtype.itemsize
        if size is None or size != nbytes:
            raise CheckpointError(
                f"{self.archive.path}: storage record data/{clip(key)} is "
                f"{'absent' if size is None else f'{size} bytes'}, expected {nbytes} bytes "
                f"({numel} x {storage_type.name})")
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
            raise CheckpointError(f"{path}: bad tensor view offset={short(offset)} "
                                  f"size={short(size)} stride={short(stride)}")
        dtype = storage.dtype if dtype is None else np.dtype(dtype)
        numel = storage.numel * storage.dtype.itemsize // dtype.itemsize
        n = 1
        for d in size:
            n *= d
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

    def _latin1_encode(self, obj, encoding="latin1", errors="strict"):
        # Protocol-2 pickles write bytes as _codecs.encode(str, 'latin1').
        if encoding not in ("latin1", "latin-1"):
            raise CheckpointError(f"{self.archive.path}: data.pkl calls _codecs.encode with "
                                  f"encoding {short(encoding)}; refused (only 'latin1', which "
                                  "protocol-2 pickles use for bytes, is allowed)")
        if not isinstance(obj, str):
            raise CheckpointError(f"{self.archive.path}: data.pkl calls _codecs.encode on a "
                                  f"{type(obj).__name__}; refused (only a str is allowed)")
        return obj.encode("latin1")


class _RestrictedUnpickler(_AllowList, pickle.Unpickler):
    pass


class _KeyFinder(_AllowList, pickle._Unpickler):
    """The pure-Python unpickler with the same allow-list, run again only to name the
    state-dict key of a tensor that a BUILD opcode tries to modify (the C unpickler's
    stack is not visible): at BUILD the stack ends ``key, tensor, state``."""

    dispatch = dict(pickle._Unpickler.dispatch)

    def _load_build(self):
        stack = self.stack
        if len(stack) >= 2 and isinstance(stack[-2], TensorRef):
            key = stack[-3] if len(stack) >= 3 and isinstance(stack[-3], str) else None
            raise _BuildOnTensor(key, stack[-2].source)
        pickle._Unpickler.load_build(self)

    dispatch[pickle.BUILD[0]] = _load_build


class _BuildOnTensor(Exception):
    def __init__(self, key, source):
        super().__init__(key, source)
        self.key, self.source = key, source


def _build_refusal(archive: _Archive, err: CheckpointError) -> CheckpointError:
    """``err`` (a BUILD on a rebuilt tensor) again, naming the file and the state-dict key."""
    try:
        _KeyFinder(archive).load()
    except _BuildOnTensor as b:
        key = "an unnamed entry" if b.key is None else f"key {short(b.key)}"
        return CheckpointError(f"{archive.path}: state-dict {key} (storage {b.source}): the "
                               "pickle tries to modify a rebuilt tensor (BUILD on a tensor); "
                               "refused")
    except Exception:  # noqa: BLE001 - the first refusal stands
        pass
    return err


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
    except UnsafePickleError:
        raise
    except CheckpointError as e:
        if "(BUILD on a tensor)" in str(e):
            raise _build_refusal(archive, e) from None
        raise
    except Exception as e:  # malformed pickle
        raise CheckpointError(f"{path}: cannot unpickle data.pkl ({type(e).__name__}: "
                              f"{clip(e)})") from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path}: holds a {type(obj).__name__}, not a state dict")
    out = {}
    for k, v in obj.items():
        if not isinstance(k, str) or not isinstance(v, TensorRef):
            raise CheckpointError(
                f"{path}: entry {short(k)} is a {type(v).__name__}, not a tensor (a state dict "
                "maps names to tensors)")
        out[k] = v
    return out

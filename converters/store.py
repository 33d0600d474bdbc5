"""The converted directory (``specjax-convert`` output): written in bounded pieces, checked
on load.

``DST/specjax.json`` (schema: :data:`SCHEMA`) records every params leaf's shape, dtype,
crc32 and part, and the carried files' sizes and sha256; ``DST/params/NNNNN/`` are orbax
parts of at most about :data:`PIECE_BYTES`; :data:`CARRIED_FILES` are copied byte for byte.
Layout versions 1 and 2 load. Every load failure is a
:class:`~specjax.converters.errors.CorruptOutputError` naming the file and key. Layout in
full: docs/converters.md, "The converted directory".
"""

from __future__ import annotations

import ctypes
import errno
import gc
import hashlib
import json
import logging
import os
import sys
import warnings
import zlib
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np

from specjax.converters.errors import CheckpointError, CorruptOutputError, clip, listing

METADATA_FILE = "specjax.json"
PARAMS_DIR = "params"
METADATA_VERSION = 2
SUPPORTED_VERSIONS = (1, 2)
DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
#: An orbax part holds at most about this many bytes (one tensor larger than it: alone).
PIECE_BYTES = 128 * 2**20

_STR, _INT, _DICT, _LIST = (str,), (int,), (dict,), (list,)
#: key -> (types, required). Checked by :func:`check_metadata`.
SCHEMA: dict[str, tuple[tuple[type, ...], bool]] = {
    "specjax_checkpoint_version": (_INT, True),
    "kind": (_STR, True),
    "format": (_STR, True),
    "dtype": (_STR, True),
    "hf_config": (_DICT, True),
    "config": (_DICT, True),
    "source": (_STR, False),
    "source_files": (_LIST, False),
    "num_tensors": (_INT, False),
    "num_values": (_INT, False),
    "notes": (_LIST, False),
    "created": (_STR, False),
    "extra_params": (_DICT, False),
    "parts": (_LIST, False),
    "arrays": (_DICT, False),
    "carried_files": (_DICT, False),
}
#: Tokenizer and generation files copied from SRC into DST byte for byte (those present):
#: ``specjax generate --target DST`` needs them besides the params.
CARRIED_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "tokenizer.model", "added_tokens.json", "vocab.json", "merges.txt",
                 "chat_template.jinja", "chat_template.json", "generation_config.json")
#: A carried file larger than this is refused (the tokenizer.json of a 256k-token
#: vocabulary is tens of MiB).
MAX_CARRIED_BYTES = 64 * 2**20


def leaf_name(path: tuple) -> str:
    return "/".join(str(p) for p in path)


def flatten(tree, prefix: tuple = ()) -> dict[tuple, Any]:
    """``{path tuple: leaf}`` of a nested dict."""
    if not isinstance(tree, dict):
        return {prefix: tree}
    out: dict[tuple, Any] = {}
    for k, v in tree.items():
        out.update(flatten(v, prefix + (k,)))
    return out


def unflatten(leaves: dict[tuple, Any]) -> dict:
    out: dict = {}
    for path, v in leaves.items():
        t = out
        for p in path[:-1]:
            t = t.setdefault(p, {})
        t[path[-1]] = v
    return out


def crc32(a: np.ndarray, chunk: int = 64 * 2**20) -> int:
    """zlib crc32 of ``a``'s bytes in C order (read in bounded chunks)."""
    flat = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    c = 0
    for i in range(0, flat.size, chunk):
        c = zlib.crc32(flat[i: i + chunk], c)
    return c


# -- writing ----------------------------------------------------------------------------------

def pieces(items: Iterable[tuple[tuple, Callable[[], np.ndarray], int, str]],
           piece_bytes: int = PIECE_BYTES):
    """Group ``(path, load, nbytes, key)`` into lists whose ``nbytes`` sum stays under
    ``piece_bytes`` (a larger item is a group of its own)."""
    group: list = []
    size = 0
    for item in items:
        if group and size + item[2] > piece_bytes:
            yield group
            group, size = [], 0
        group.append(item)
        size += item[2]
    if group:
        yield group


def release_memory() -> None:
    """Give freed heap memory back to the OS (glibc ``malloc_trim``; a no-op elsewhere), so
    resident memory does not grow with every part written."""
    global _TRIM
    if _TRIM is None:
        try:
            _TRIM = ctypes.CDLL(None).malloc_trim
        except (OSError, AttributeError):
            _TRIM = False
    if _TRIM:
        _TRIM(0)


_TRIM = None


def _disk_full(e: BaseException) -> bool:
    seen = 0
    while e is not None and seen < 8:
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            return True
        if "No space left on device" in str(e):
            return True
        e = e.__cause__ or e.__context__
        seen += 1
    return False


class _Quiet(logging.Filter):
    def filter(self, record):  # orbax logs each failed write thread's traceback: one message
        return record.levelno < logging.ERROR


def leaf_record(path: tuple, arr: np.ndarray, key: str) -> tuple:
    """``(path, leaf, key, record)``: ``arr`` as a ``jax.Array`` (orbax copies NumPy leaves
    twice) with its ``specjax.json`` record (shape, dtype, crc32)."""
    import jax  # noqa: PLC0415

    rec = {"shape": [int(d) for d in arr.shape], "dtype": np.dtype(arr.dtype).name,
           "crc32": crc32(arr)}
    return path, jax.device_put(arr), key, rec   # one copy (jnp.asarray makes two)


def save_parts(out_dir: Path, groups, *, held,
               progress: Callable[[list[str]], None] | None = None
               ) -> tuple[list[str], dict[str, dict]]:
    """Write each group (``[leaf_record(...)]``) as one orbax part under
    ``out_dir/params``. Returns ``(parts, arrays)`` for ``specjax.json``. A full disk is one
    :class:`CheckpointError`; orbax's own error logging is silenced during the writes."""
    import orbax.checkpoint as ocp  # noqa: PLC0415

    root = Path(out_dir) / PARAMS_DIR
    root.mkdir()
    parts: list[str] = []
    arrays: dict[str, dict] = {}
    quiet = _QuietWrites()
    quiet.__enter__()
    ckptr = ocp.StandardCheckpointer()
    failed = True
    try:
        i = -1
        for group in groups:     # (not enumerate: its cached result tuple keeps a group alive)
            i += 1
            name = f"{i:05d}"
            for item in group:
                arrays[leaf_name(item[0])] = dict(item[3], part=i)
            tree = {leaf_name(item[0]): item[1] for item in group}
            keys = [item[2] for item in group]
            del item, group          # hold no leaf beyond this part
            with held():
                try:
                    ckptr.save(root / name, unflatten({tuple(p.split("/")): a
                                                       for p, a in tree.items()}))
                except BaseException as e:
                    _raise_write_error(e, root / name)
                finally:
                    try:
                        ckptr.wait_until_finished()
                    except Exception as e:  # noqa: BLE001
                        _raise_write_error(e, root / name)
            parts.append(name)
            del tree
            release_memory()
            if progress is not None:
                progress(keys)
        failed = False
    finally:
        try:
            ckptr.close()
        except Exception:  # noqa: BLE001 (the write's own error, raised above, names it)
            if not failed:
                raise
        finally:
            quiet.__exit__(failed)
    return parts, arrays


# Drops the records of a full disk that a failed orbax write leaves to be logged later, when
# the filters of _QuietWrites are gone: asyncio's "exception was never retrieved" for the
# tasks orbax's event loop still holds (logged at exit) and absl's ERROR from orbax's
# background threads. Installed on those loggers after a failed write; passes everything else.
class _LeftoverDiskFull(logging.Filter):
    def filter(self, record):
        exc = record.exc_info[1] if record.exc_info else None
        return not ((exc is not None and _disk_full(exc))
                    or "No space left on device" in record.getMessage())


_LEFTOVERS = _LeftoverDiskFull()


def _drop_leftover_disk_full_records() -> None:
    for name in ("asyncio", "absl", "orbax"):
        lg = logging.getLogger(name)
        if _LEFTOVERS not in lg.filters:
            lg.addFilter(_LEFTOVERS)


# Silences what a failed orbax write prints besides its error: the ERROR records of orbax /
# absl / asyncio (one per array) and the "RuntimeError: Event loop is closed" tracebacks that
# TensorStore's threads print through sys.excepthook when their callbacks reach orbax's closed
# event loop. On a failure the leftover tasks are collected before the hooks are restored; the
# caller raises one clear error instead.
class _QuietWrites:
    LOGGERS = ("absl", "orbax", "asyncio", "")

    def __enter__(self):
        import threading  # noqa: PLC0415

        self._filter = _Quiet()
        self._loggers = [logging.getLogger(n) for n in self.LOGGERS]
        for lg in self._loggers:
            lg.addFilter(self._filter)
        self._hooks = (sys.excepthook, threading.excepthook, sys.unraisablehook)
        sys.excepthook = lambda *_a: None
        threading.excepthook = lambda _a: None
        sys.unraisablehook = lambda _u: None
        return self

    def __exit__(self, failed: bool = False, *_exc) -> None:
        import threading  # noqa: PLC0415

        try:
            if failed:
                _drop_leftover_disk_full_records()
                # orbax's unawaited writes may be collected later, at exit: no warning then
                warnings.filterwarnings("ignore", r"coroutine .* was never awaited",
                                        RuntimeWarning)
                gc.collect()
        finally:
            sys.excepthook, threading.excepthook, sys.unraisablehook = self._hooks
            for lg in self._loggers:
                lg.removeFilter(self._filter)


def _raise_write_error(e: BaseException, where: Path):
    if not isinstance(e, Exception):
        raise e
    if _disk_full(e):
        raise CheckpointError(f"{where}: no space left on the device while writing the "
                              "params (nothing is kept; free some space and run again)") from None
    if isinstance(e, CheckpointError):
        raise e
    raise CheckpointError(f"{where}: writing the params failed ({type(e).__name__}: "
                          f"{clip(_first_line(e), 200)})") from None


def _first_line(e: BaseException) -> str:
    s = str(e).strip()
    return s.splitlines()[0] if s else type(e).__name__


# -- reading ----------------------------------------------------------------------------------

def read_metadata(path: Path) -> dict:
    """``specjax.json`` of the converted directory ``path``, schema-checked."""
    f = Path(path) / METADATA_FILE
    try:
        meta = json.loads(f.read_bytes())
    except OSError as e:
        raise CorruptOutputError(f"{f}: cannot read ({e.strerror or e})") from None
    except (ValueError, RecursionError) as e:
        raise CorruptOutputError(f"{f}: not valid JSON ({clip(e)})") from None
    check_metadata(meta, f)
    return meta


def check_metadata(meta, f) -> None:
    if not isinstance(meta, dict):
        raise CorruptOutputError(f"{f}: holds a JSON {type(meta).__name__}, expected an object")
    version = meta.get("specjax_checkpoint_version")
    if version not in SUPPORTED_VERSIONS or isinstance(version, bool):
        raise CorruptOutputError(f"{f}: specjax_checkpoint_version {clip(repr(version))} is not "
                                 f"supported (allowed: {', '.join(map(str, SUPPORTED_VERSIONS))})")
    required = [k for k, (_, req) in SCHEMA.items() if req or (version >= 2 and k in
                                                                 ("parts", "arrays"))]
    missing = [k for k in required if k not in meta]
    if missing:
        raise CorruptOutputError(f"{f}: missing keys {listing(missing)}")
    for k, (types, _) in SCHEMA.items():
        if k in meta and (not isinstance(meta[k], types) or isinstance(meta[k], bool)):
            raise CorruptOutputError(f"{f}: key {k!r} is a {type(meta[k]).__name__}, expected "
                                     f"{' or '.join(t.__name__ for t in types)}")
    if meta["dtype"] not in DTYPE_NAMES:
        raise CorruptOutputError(f"{f}: key 'dtype' is {clip(repr(meta['dtype']))} (allowed: "
                                 f"{', '.join(DTYPE_NAMES)})")
    for name, shape in (meta.get("extra_params") or {}).items():
        if not isinstance(shape, list) or not all(_nonneg(d) for d in shape):
            raise CorruptOutputError(f"{f}: extra_params[{name!r}] is not a list of sizes")
    if version >= 2:
        parts = meta["parts"]
        if not all(isinstance(p, str) and p.isdigit() and len(p) == 5 for p in parts):
            raise CorruptOutputError(f"{f}: key 'parts' must list part names like '00000'")
        for name, rec in meta["arrays"].items():
            ok = (isinstance(rec, dict) and isinstance(rec.get("shape"), list)
                  and all(_nonneg(d) for d in rec["shape"]) and isinstance(rec.get("dtype"), str)
                  and _nonneg(rec.get("crc32")) and _nonneg(rec.get("part"))
                  and rec["part"] < len(parts))
            if not ok:
                raise CorruptOutputError(f"{f}: arrays[{clip(repr(name))}] is not "
                                         "{shape: [ints], dtype: str, crc32: int, part: int}")
    for name, rec in (meta.get("carried_files") or {}).items():
        if name not in CARRIED_FILES:
            raise CorruptOutputError(f"{f}: carried_files names {clip(repr(name))}, not one of "
                                     f"the files specjax carries ({', '.join(CARRIED_FILES)})")
        if not (isinstance(rec, dict) and _nonneg(rec.get("size"))
                and isinstance(rec.get("sha256"), str) and len(rec["sha256"]) == 64):
            raise CorruptOutputError(f"{f}: carried_files[{name!r}] is not "
                                     "{size: int, sha256: str}")


def _nonneg(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


# -- carried tokenizer and generation files -----------------------------------------------------

def carried_sources(src, cap: int | None = None) -> dict[str, Path]:
    """The :data:`CARRIED_FILES` present in the checkpoint directory ``src`` -> the file
    whose bytes DST gets (``{}`` when ``src`` is a single weight file).

    :class:`CheckpointError` naming the file when it is larger than ``cap`` (default
    :data:`MAX_CARRIED_BYTES`), not a regular file, a symbolic link leading outside ``src``
    (the HF cache's ``blobs/`` counts as inside), or names tokenizer code
    (:func:`check_no_auto_map`): the checkpoint's Python code is never run.
    """
    src = Path(src).absolute()
    if not src.is_dir():
        return {}
    cap = MAX_CARRIED_BYTES if cap is None else cap
    root = src.resolve()
    inside = [root] + ([root.parent.parent / "blobs"] if root.parent.name == "snapshots" else [])
    out: dict[str, Path] = {}
    for name in CARRIED_FILES:
        p = src / name
        if not os.path.lexists(p):
            continue
        try:
            real = p.resolve()
        except (OSError, RuntimeError):       # a loop of symbolic links
            raise CheckpointError(f"{p}: a symbolic link that resolves to no file") from None
        if p.is_symlink() and not any(real.is_relative_to(d) for d in inside):
            raise CheckpointError(f"{p}: a symbolic link to {real}, outside {src}; refusing "
                                  f"to copy it (put the file itself in {src})")
        if not real.is_file():
            raise CheckpointError(f"{p}: not a regular file (a tokenizer / generation file "
                                  "is copied into DST)")
        size = real.stat().st_size
        if size > cap:
            raise CheckpointError(f"{p}: {size} bytes, over the {_size(cap)} limit on a "
                                  "tokenizer / generation file carried into DST")
        out[name] = real
    if "tokenizer_config.json" in out:
        check_no_auto_map(src / "tokenizer_config.json",
                          _read_capped(out["tokenizer_config.json"], cap,
                                       src / "tokenizer_config.json"))
    if any(n != "generation_config.json" for n in out) and (src / "config.json").is_file():
        cfg = src / "config.json"
        if cfg.stat().st_size <= cap:
            check_no_auto_map(cfg, cfg.read_bytes())
    return out


def check_no_auto_map(f: Path, data: bytes) -> None:
    """Refuse tokenizer code: an ``auto_map`` in ``tokenizer_config.json``, or an
    ``auto_map.AutoTokenizer`` in ``config.json`` (CheckpointError naming the file and
    key). Invalid JSON in ``tokenizer_config.json`` is refused too."""
    try:
        d = json.loads(data)
    except (ValueError, RecursionError) as e:
        if f.name == "config.json":
            return            # read and refused with its own message by the converter
        raise CheckpointError(f"{f}: not valid JSON ({clip(e)})") from None
    if not isinstance(d, dict) or "auto_map" not in d:
        return
    if f.name == "config.json":
        am = d["auto_map"]
        if not (isinstance(am, dict) and "AutoTokenizer" in am):
            return
        key = "auto_map.AutoTokenizer"
    else:
        key = "auto_map"
    raise CheckpointError(f"{f}: key {key!r} names tokenizer code ({clip(repr(d['auto_map']))})"
                          "; specjax never runs a checkpoint's code (trust_remote_code stays "
                          "off) and does not carry a tokenizer that needs it")


def _size(n: int) -> str:
    return f"{n // 2**20} MiB" if n >= 2**20 and n % 2**20 == 0 else f"{n} bytes"


def _read_capped(p: Path, cap: int, shown: Path) -> bytes:
    with open(p, "rb") as fh:
        data = fh.read(cap + 1)
    if len(data) > cap:
        raise CheckpointError(f"{shown}: over the {_size(cap)} limit on a tokenizer / "
                              "generation file carried into DST (it grew while converting)")
    return data


def copy_carried(sources: dict[str, Path], out_dir: Path, src, cap: int | None = None
                 ) -> dict[str, dict]:
    """Copy :func:`carried_sources`' files into ``out_dir`` byte for byte (re-checked, in
    case they changed); returns ``carried_files``: name -> size, sha256."""
    cap = MAX_CARRIED_BYTES if cap is None else cap
    records = {}
    for name, real in sources.items():
        data = _read_capped(real, cap, Path(src).absolute() / name)
        if name == "tokenizer_config.json":
            check_no_auto_map(Path(src).absolute() / name, data)
        try:
            (Path(out_dir) / name).write_bytes(data)
        except OSError as e:
            if e.errno == errno.ENOSPC:
                raise CheckpointError(f"{Path(out_dir) / name}: no space left on the device") \
                    from None
            raise
        records[name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    return records


def verify_carried(path: Path, meta: dict, names=None, *, verify: bool = True) -> None:
    """Check the carried files ``specjax.json`` records (those in ``names``, default all):
    present, of the recorded size and (``verify``) sha256. :class:`CorruptOutputError`
    naming the file otherwise."""
    for name, rec in (meta.get("carried_files") or {}).items():
        if names is not None and name not in names:
            continue
        f = Path(path) / name
        if not f.is_file():
            raise CorruptOutputError(f"{f}: missing (specjax.json records it as carried from "
                                     "the source checkpoint); convert again")
        size = f.stat().st_size
        if size != rec["size"]:
            raise CorruptOutputError(f"{f}: {size} bytes, specjax.json records {rec['size']} "
                                     "(the file was changed or damaged; convert again)")
        if verify and hashlib.sha256(f.read_bytes()).hexdigest() != rec["sha256"]:
            raise CorruptOutputError(f"{f}: does not match its recorded sha256 (the file was "
                                     "changed or damaged; convert again)")


def restore(path: Path, meta: dict, target: dict, *, verify: bool = True) -> dict:
    """The params of the converted directory ``path`` into the abstract pytree ``target``
    (``jax.ShapeDtypeStruct`` leaves, the dtype the directory says it stores)."""
    import orbax.checkpoint as ocp  # noqa: PLC0415

    path = Path(path)
    f = path / METADATA_FILE
    want = flatten(target)
    if meta["specjax_checkpoint_version"] == 1:
        ckptr = ocp.StandardCheckpointer()
        try:
            return _orbax(lambda: ckptr.restore(path / PARAMS_DIR, target), path / PARAMS_DIR)
        finally:
            ckptr.close()
    arrays = meta["arrays"]
    names = {leaf_name(p): p for p in want}
    unknown = sorted(set(arrays) - set(names))
    absent = sorted(set(names) - set(arrays))
    if unknown or absent:
        raise CorruptOutputError(
            f"{f}: 'arrays' does not match the {meta['kind']} config: "
            + "; ".join(s for s in (unknown and f"not in the model: {listing(unknown)}",
                                    absent and f"absent: {listing(absent)}") if s))
    for name, p in names.items():
        rec, leaf = arrays[name], want[p]
        if tuple(rec["shape"]) != tuple(leaf.shape) or rec["dtype"] != np.dtype(leaf.dtype).name:
            raise CorruptOutputError(
                f"{f}: arrays[{name!r}] is recorded as {rec['dtype']}{rec['shape']}; the "
                f"config and dtype say {np.dtype(leaf.dtype).name}{list(leaf.shape)}")
    out: dict[tuple, Any] = {}
    ckptr = ocp.StandardCheckpointer()
    try:
        for i, part in enumerate(meta["parts"]):
            d = path / PARAMS_DIR / part
            mine = {tuple(name.split("/")): want[names[name]]
                    for name, rec in arrays.items() if rec["part"] == i}
            _check_part_metadata(d)
            stored = _orbax(lambda: _metadata_tree(ckptr.metadata(d)), d)
            _compare_stored(d, flatten(_plain(stored)), mine)
            got = _orbax(lambda: ckptr.restore(d, unflatten(mine)), d)
            for p, leaf in flatten(got).items():
                name = "/".join(p)
                if verify and crc32(np.asarray(leaf)) != arrays[name]["crc32"]:
                    raise CorruptOutputError(f"{d}: array {name!r} does not match its recorded "
                                             "checksum (the data file was changed or damaged; "
                                             "convert again)")
                out[names[name]] = leaf
    finally:
        ckptr.close()
    return unflatten(out)


# orbax's per-part metadata file: the list of the part's arrays (without it orbax reads the
# part as holding one unnamed array and the comparison below would name nothing useful)
PART_METADATA_FILE = "_METADATA"


def _check_part_metadata(d: Path) -> None:
    if d.is_dir() and not (d / PART_METADATA_FILE).is_file():
        raise CorruptOutputError(f"{d}: orbax's metadata file {PART_METADATA_FILE} is missing "
                                 "(the part is incomplete: it no longer lists its arrays; "
                                 "convert again)")


def _metadata_tree(m):
    """The tree of array metadata in what ``StandardCheckpointer.metadata`` returns (a
    ``StepMetadata`` holding a ``TreeMetadata``, or the tree, depending on orbax's version)."""
    m = getattr(m, "item_metadata", m)
    return getattr(m, "tree", m)


def _plain(tree):
    return {str(k): _plain(v) for k, v in tree.items()} if isinstance(tree, dict) else tree


def _compare_stored(d: Path, stored: dict, want: dict) -> None:
    want = {tuple(str(x) for x in p): v for p, v in want.items()}
    if set(stored) != set(want):
        diff = sorted("/".join(p) for p in set(stored) ^ set(want))
        raise CorruptOutputError(f"{d}: holds different arrays than specjax.json records "
                                 f"({listing(diff)})")
    for p, m in stored.items():
        w = want[p]
        if tuple(m.shape) != tuple(w.shape) or np.dtype(m.dtype) != np.dtype(w.dtype):
            raise CorruptOutputError(f"{d}: array {'/'.join(p)!r} is stored as "
                                     f"{np.dtype(m.dtype).name}{list(m.shape)}, specjax.json "
                                     f"says {np.dtype(w.dtype).name}{list(w.shape)}")


def _orbax(fn, where: Path):
    """Run an orbax call; any failure becomes one line naming ``where``."""
    quiet = _Quiet()
    loggers = [logging.getLogger(n) for n in ("absl", "orbax", "")]
    for lg in loggers:
        lg.addFilter(quiet)
    msg = None
    try:
        return fn()
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 (orbax / TensorStore raise many types)
        msg = f"{type(e).__name__}: {clip(_first_line(e), 200)}"
    finally:
        for lg in loggers:
            lg.removeFilter(quiet)
    _collect_quietly()  # orbax leaves the reads of the other arrays pending: drop them now
    raise CorruptOutputError(f"{where}: cannot read the params ({msg}); the directory is "
                             "damaged, convert again")


def _collect_quietly() -> None:
    """Collect a failed orbax restore's leftover coroutines without 'Exception ignored'
    tracebacks."""
    hook = sys.unraisablehook
    sys.unraisablehook = lambda _unraisable: None
    try:
        gc.collect()
    finally:
        sys.unraisablehook = hook

"""Training data for the demo models: CPython's standard-library sources, byte-tokenized.

:func:`stdlib_py_files` -> :func:`split_files` (deterministic whole-file split) ->
:func:`build_shard` (BOS + bytes + EOS per file) -> :func:`sample_windows` (host) or
:func:`device_windows`; :func:`corpus` does it all. Everything is a pure function of the
stdlib's relative paths and contents, so the same Python version gives the same shards.
Windows cross document boundaries (``TokenShard.doc_starts`` records them).
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from specjax.tokenizer import BYTE_TOKENIZER, ByteTokenizer

#: Directory names never descended into (third-party packages and bytecode caches).
EXCLUDED_DIRS: frozenset[str] = frozenset({"site-packages", "dist-packages", "__pycache__"})
#: Directory names whose contents count as tests (``include_tests=False`` drops them).
TEST_DIRS: frozenset[str] = frozenset({"test", "tests", "idle_test"})
#: File-name prefix of test modules outside a test directory (``include_tests=False``).
TEST_FILE_PREFIX = "test_"

DEFAULT_SALT = "specjax-v1"
_SHARD_FORMAT_VERSION = 1
_INT32_MAX = 2**31 - 1


# --------------------------------------------------------------------------- validation


def _check_int(name: str, value: Any, *, minimum: int) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int >= {minimum}, got {type(value).__name__}: {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value}")
    return int(value)


def _check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool (True or False), got {type(value).__name__}: {value!r}")
    return bool(value)


def _check_fraction(name: str, value: Any) -> float:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a float in the open interval (0, 1), got {type(value).__name__}")
    value = float(value)
    if not (math.isfinite(value) and 0.0 < value < 1.0):
        raise ValueError(f"{name} must be in the open interval (0, 1), got {value}")
    return value


def _check_root(root: Any) -> Path:
    if root is None:
        return stdlib_root()
    if not isinstance(root, (str, os.PathLike)):
        raise TypeError(f"root must be a path (str or os.PathLike) or None, got {type(root).__name__}")
    root = Path(root)
    if not root.is_dir():
        raise ValueError(f"root={str(root)!r} is not an existing directory")
    return root


def _check_paths(name: str, files: Any) -> list[Path]:
    if isinstance(files, (str, bytes, os.PathLike)) or not isinstance(files, Iterable):
        raise TypeError(f"{name} must be an iterable of paths (str or os.PathLike), got {type(files).__name__}")
    out = []
    for i, f in enumerate(files):
        if not isinstance(f, (str, os.PathLike)):
            raise TypeError(f"{name}[{i}] must be a path (str or os.PathLike), got {type(f).__name__}: {f!r}")
        out.append(Path(f))
    return out


def _check_tokens_1d(name: str, tokens: Any) -> np.ndarray:
    if not isinstance(tokens, np.ndarray):
        raise TypeError(f"{name} must be a numpy array, got {type(tokens).__name__}")
    if tokens.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tokens.shape}")
    if tokens.dtype == np.bool_ or not np.issubdtype(tokens.dtype, np.integer):
        raise TypeError(f"{name} must have an integer dtype, got {tokens.dtype}")
    return tokens


# --------------------------------------------------------------------------- file listing


def stdlib_root() -> Path:
    """The running interpreter's standard-library directory (``sysconfig.get_path("stdlib")``)."""
    return Path(sysconfig.get_path("stdlib"))


def _is_test_path(rel_parts: tuple[str, ...]) -> bool:
    *dirs, name = rel_parts
    return any(d in TEST_DIRS for d in dirs) or name.startswith(TEST_FILE_PREFIX)


def stdlib_py_files(root: Path | str | None = None, *, include_tests: bool = True) -> list[Path]:
    """Every ``*.py`` regular file under ``root`` (default :func:`stdlib_root`), sorted by
    relative POSIX path, outside ``site-packages``, ``dist-packages`` and ``__pycache__``
    (symlinked directories not followed). ``include_tests=False`` also drops files under a
    ``test`` / ``tests`` / ``idle_test`` directory and files named ``test_*``.
    """
    root = _check_root(root)
    include_tests = _check_bool("include_tests", include_tests)
    found: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in EXCLUDED_DIRS]
        base = Path(dirpath)
        for name in filenames:
            if not name.endswith(".py"):
                continue
            path = base / name
            if not path.is_file():
                continue
            rel = path.relative_to(root)
            if not include_tests and _is_test_path(rel.parts):
                continue
            found.append((rel.as_posix(), path))
    found.sort(key=lambda t: t[0])
    return [p for _, p in found]


def _relative_posix(path: Path, root: Path) -> str:
    try:
        return path.relative_to(root).as_posix()
    except ValueError:
        raise ValueError(f"files must all lie under root={str(root)!r}; {str(path)!r} does not") from None


def split_files(
    files: Iterable[Path | str],
    root: Path | str,
    *,
    heldout_fraction: float = 0.05,
    salt: str = DEFAULT_SALT,
) -> tuple[list[Path], list[Path]]:
    """Deterministic whole-file ``(train, heldout)`` split, both sorted by relative path.

    A file is held out iff the first 8 bytes of ``sha256(salt + rel)`` (big-endian, over
    ``2**64``) are below ``heldout_fraction``, ``rel`` its POSIX path relative to ``root``.
    ValueError for a file outside ``root`` or a duplicate.
    """
    files = _check_paths("files", files)
    if not isinstance(root, (str, os.PathLike)):
        raise TypeError(f"root must be a path (str or os.PathLike), got {type(root).__name__}")
    root = Path(root)
    heldout_fraction = _check_fraction("heldout_fraction", heldout_fraction)
    if not isinstance(salt, str):
        raise TypeError(f"salt must be a str, got {type(salt).__name__}")
    keyed: dict[str, Path] = {}
    for f in files:
        rel = _relative_posix(f, root)
        if rel in keyed:
            raise ValueError(f"files contains {rel!r} (relative to root) more than once")
        keyed[rel] = f
    train, heldout = [], []
    for rel in sorted(keyed):
        digest = hashlib.sha256((salt + rel).encode("utf-8")).digest()
        u = int.from_bytes(digest[:8], "big") / 2.0**64
        (heldout if u < heldout_fraction else train).append(keyed[rel])
    return train, heldout


# --------------------------------------------------------------------------- token shards


@dataclass
class TokenShard:
    """A concatenation of tokenized documents: ``tokens`` 1-D ``uint16`` (``BOS, bytes...,
    EOS`` per document), ``doc_starts`` 1-D ``int64`` (each BOS's offset), and the
    ``skipped_files`` / ``truncated_files`` counts of :func:`build_shard`."""

    tokens: np.ndarray
    doc_starts: np.ndarray
    skipped_files: int = 0
    truncated_files: int = 0

    def __post_init__(self):
        tokens = np.asarray(self.tokens)
        _check_tokens_1d("tokens", tokens)
        if tokens.dtype != np.uint16:
            if tokens.size and (tokens.min() < 0 or tokens.max() > np.iinfo(np.uint16).max):
                raise ValueError("tokens must fit uint16 (ids in [0, 65535])")
            tokens = tokens.astype(np.uint16)
        starts = np.asarray(self.doc_starts)
        if starts.ndim != 1 or (starts.size and not np.issubdtype(starts.dtype, np.integer)):
            raise ValueError(f"doc_starts must be a 1-D integer array, got shape {starts.shape} dtype {starts.dtype}")
        starts = starts.astype(np.int64)
        if tokens.size == 0:
            if starts.size:
                raise ValueError("doc_starts must be empty when tokens is empty")
        else:
            if starts.size == 0 or starts[0] != 0:
                raise ValueError("doc_starts must start with 0 when tokens is non-empty")
            if np.any(np.diff(starts) <= 0) or starts[-1] >= tokens.size:
                raise ValueError(f"doc_starts must be strictly increasing offsets in [0, {tokens.size})")
        self.tokens, self.doc_starts = tokens, starts
        self.skipped_files = _check_int("skipped_files", self.skipped_files, minimum=0)
        self.truncated_files = _check_int("truncated_files", self.truncated_files, minimum=0)

    @property
    def num_tokens(self) -> int:
        """Total number of tokens (including BOS/EOS)."""
        return int(self.tokens.size)

    @property
    def num_docs(self) -> int:
        """Number of documents (files)."""
        return int(self.doc_starts.size)

    def doc(self, i: int) -> np.ndarray:
        """Tokens of document ``i`` (a view, BOS..EOS)."""
        i = _check_int("i", i, minimum=0)
        if i >= self.num_docs:
            raise IndexError(f"i must be in [0, {self.num_docs}), got {i}")
        end = self.doc_starts[i + 1] if i + 1 < self.num_docs else self.num_tokens
        return self.tokens[self.doc_starts[i] : end]

    def save(self, path: Path | str) -> Path:
        """Write the shard to ``path`` (exactly that name) as one ``.npz`` file, atomically."""
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}")
        path = Path(path)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                np.savez(
                    f,
                    tokens=self.tokens,
                    doc_starts=self.doc_starts,
                    skipped_files=np.int64(self.skipped_files),
                    truncated_files=np.int64(self.truncated_files),
                    format_version=np.int64(_SHARD_FORMAT_VERSION),
                )
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise
        return path

    @classmethod
    def load(cls, path: Path | str) -> TokenShard:
        """Read a shard written by :meth:`save`."""
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}")
        with np.load(path, allow_pickle=False) as z:
            missing = {"tokens", "doc_starts", "format_version"} - set(z.files)
            if missing:
                raise ValueError(f"{str(path)!r} is not a TokenShard file (missing {sorted(missing)})")
            version = int(z["format_version"])
            if version != _SHARD_FORMAT_VERSION:
                raise ValueError(f"{str(path)!r} has shard format {version}; this code reads {_SHARD_FORMAT_VERSION}")
            return cls(
                tokens=z["tokens"],
                doc_starts=z["doc_starts"],
                skipped_files=int(z["skipped_files"]),
                truncated_files=int(z["truncated_files"]),
            )


def build_shard(
    files: Iterable[Path | str],
    tokenizer: ByteTokenizer = BYTE_TOKENIZER,
    *,
    max_file_bytes: int | None = None,
) -> TokenShard:
    """Tokenize ``files`` in order, each as ``BOS + bytes + EOS``; unreadable files are
    skipped, longer than ``max_file_bytes`` truncated (both counted in the shard)."""
    files = _check_paths("files", files)
    if not isinstance(tokenizer, ByteTokenizer):
        raise TypeError(f"tokenizer must be a ByteTokenizer, got {type(tokenizer).__name__}")
    if max_file_bytes is not None:
        max_file_bytes = _check_int("max_file_bytes", max_file_bytes, minimum=1)
    pieces: list[np.ndarray] = []
    starts: list[int] = []
    offset = skipped = truncated = 0
    for f in files:
        try:
            data = f.read_bytes()
        except OSError:
            skipped += 1
            continue
        if max_file_bytes is not None and len(data) > max_file_bytes:
            data = data[:max_file_bytes]
            truncated += 1
        ids = tokenizer.encode_np(data, bos=True, eos=True)
        starts.append(offset)
        pieces.append(ids)
        offset += ids.size
    tokens = np.concatenate(pieces) if pieces else np.zeros((0,), np.uint16)
    return TokenShard(tokens, np.asarray(starts, np.int64), skipped_files=skipped, truncated_files=truncated)


# --------------------------------------------------------------------------- sampling


def sample_windows(tokens: np.ndarray, rng: np.random.Generator, batch: int, length: int) -> np.ndarray:
    """``[batch, length]`` int32 windows ``tokens[s:s+length]``, ``s`` uniform in
    ``[0, len(tokens) - length]`` (independent per row). Host-side (numpy)."""
    tokens = _check_tokens_1d("tokens", tokens)
    if not isinstance(rng, np.random.Generator):
        raise TypeError(f"rng must be a numpy.random.Generator, got {type(rng).__name__}")
    batch = _check_int("batch", batch, minimum=1)
    length = _check_int("length", length, minimum=1)
    if length > tokens.size:
        raise ValueError(f"length must be <= len(tokens)={tokens.size}, got {length}")
    starts = rng.integers(0, tokens.size - length + 1, size=batch)
    windows = np.lib.stride_tricks.sliding_window_view(tokens, length)
    return windows[starts].astype(np.int32)


@functools.partial(jax.jit, static_argnames=("batch", "length"))
def device_windows(tokens: jax.Array, key: jax.Array, batch: int, length: int) -> jax.Array:
    """Device-side :func:`sample_windows`: ``[batch, length]`` int32 windows of the 1-D
    ``tokens``, starts uniform from ``key``. ``batch`` and ``length`` are static ints."""
    batch = _check_int("batch", batch, minimum=1)
    length = _check_int("length", length, minimum=1)
    if tokens.ndim != 1:
        raise ValueError(f"tokens must be 1-D, got shape {tokens.shape}")
    if not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise TypeError(f"tokens must have an integer dtype, got {tokens.dtype}")
    n = tokens.shape[0]
    if length > n:
        raise ValueError(f"length must be <= len(tokens)={n}, got {length}")
    if n > _INT32_MAX:
        raise ValueError(f"len(tokens)={n} must be <= 2**31 - 1 (int32 start offsets)")
    starts = jax.random.randint(key, (batch,), 0, n - length + 1, dtype=jnp.int32)
    rows = jax.vmap(lambda s: lax.dynamic_slice(tokens, (s,), (length,)))(starts)
    return rows.astype(jnp.int32)


# --------------------------------------------------------------------------- evaluation prompts


def heldout_prompts(
    files: Iterable[Path | str],
    *,
    num_prompts: int,
    prompt_bytes: int,
    seed: int = 0,
    tokenizer: ByteTokenizer = BYTE_TOKENIZER,
) -> list[list[int]]:
    """``num_prompts`` distinct prompts ``[BOS] + prompt_bytes bytes``, each from a
    non-empty line start of ``files`` with ``prompt_bytes`` bytes left, drawn by a seeded
    permutation (fewer prompts are a prefix of more). ValueError when too few candidates.
    """
    files = _check_paths("files", files)
    num_prompts = _check_int("num_prompts", num_prompts, minimum=0)
    prompt_bytes = _check_int("prompt_bytes", prompt_bytes, minimum=1)
    seed = _check_int("seed", seed, minimum=0)
    if not isinstance(tokenizer, ByteTokenizer):
        raise TypeError(f"tokenizer must be a ByteTokenizer, got {type(tokenizer).__name__}")
    datas: list[bytes] = []
    cand_file: list[np.ndarray] = []
    cand_start: list[np.ndarray] = []
    for f in sorted(files, key=lambda p: p.as_posix()):
        try:
            data = f.read_bytes()
        except OSError:
            continue
        if len(data) < prompt_bytes:
            continue
        arr = np.frombuffer(data, np.uint8)
        starts = np.concatenate([[0], np.flatnonzero(arr == ord("\n")) + 1])
        starts = starts[starts <= len(data) - prompt_bytes]
        starts = starts[(arr[starts] != ord("\n")) & (arr[starts] != ord("\r"))]
        if starts.size:
            cand_file.append(np.full(starts.size, len(datas), np.int64))
            cand_start.append(starts.astype(np.int64))
            datas.append(data)
    total = int(sum(s.size for s in cand_start))
    if num_prompts > total:
        raise ValueError(
            f"num_prompts={num_prompts} exceeds the {total} available line starts with "
            f"prompt_bytes={prompt_bytes} bytes left in their file; ask for fewer or shorter prompts"
        )
    if num_prompts == 0:
        return []
    fidx, sidx = np.concatenate(cand_file), np.concatenate(cand_start)
    order = np.random.default_rng(seed).permutation(total)[:num_prompts]
    return [
        tokenizer.encode(datas[fidx[i]][sidx[i] : sidx[i] + prompt_bytes], bos=True)
        for i in order.tolist()
    ]


# --------------------------------------------------------------------------- convenience


def corpus(
    root: Path | str | None = None,
    *,
    include_tests: bool = True,
    heldout_fraction: float = 0.05,
    salt: str = DEFAULT_SALT,
    max_file_bytes: int | None = None,
) -> tuple[TokenShard, TokenShard, list[Path], list[Path]]:
    """``(train_shard, heldout_shard, train_files, heldout_files)`` for the stdlib at ``root``."""
    root = _check_root(root)
    files = stdlib_py_files(root, include_tests=include_tests)
    train, heldout = split_files(files, root, heldout_fraction=heldout_fraction, salt=salt)
    return (
        build_shard(train, max_file_bytes=max_file_bytes),
        build_shard(heldout, max_file_bytes=max_file_bytes),
        train,
        heldout,
    )


__all__ = [
    "EXCLUDED_DIRS", "TEST_DIRS", "TEST_FILE_PREFIX", "DEFAULT_SALT",
    "stdlib_root", "stdlib_py_files", "split_files", "TokenShard", "build_shard",
    "sample_windows", "device_windows", "heldout_prompts", "corpus",
]

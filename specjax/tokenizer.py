"""Byte-level tokenizer for the demo models (a target LM and its draft heads).

Ids ``0..255`` are the raw bytes, then ``bos`` 256, ``eos`` 257, ``mask`` 258 (DFlash's
mask token) and ``pad`` 259: ``VOCAB_SIZE = 260``, every id fits ``uint16`` (the token
shards' dtype). Stateless: ``encode`` is the bytes plus optional BOS/EOS.
"""

from __future__ import annotations

import codecs
from dataclasses import dataclass
from typing import Any

import numpy as np

#: Number of byte tokens (ids ``0..255``).
BYTE_VOCAB: int = 256
#: Beginning-of-document token.
BOS_ID: int = 256
#: End-of-document token.
EOS_ID: int = 257
#: DFlash's mask token.
MASK_ID: int = 258
#: Padding token.
PAD_ID: int = 259
#: Total vocabulary: 256 bytes + 4 specials.
VOCAB_SIZE: int = 260
#: Special-token name -> id.
SPECIAL_IDS: dict[str, int] = {"bos": BOS_ID, "eos": EOS_ID, "mask": MASK_ID, "pad": PAD_ID}

_ID_TO_SPECIAL = {v: k for k, v in SPECIAL_IDS.items()}
_BYTES_LIKE = (bytes, bytearray, memoryview)


def _check_flag(name: str, value: Any) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool (True or False), got {type(value).__name__}: {value!r}")
    return bool(value)


def _to_bytes(text: Any) -> bytes:
    if isinstance(text, str):
        return text.encode("utf-8")
    if isinstance(text, _BYTES_LIKE):
        return bytes(text)
    raise TypeError(
        f"text must be str (encoded as UTF-8) or bytes/bytearray/memoryview, got {type(text).__name__}"
    )


def _ids_to_array(ids: Any) -> np.ndarray:
    """Validate ``ids`` (any 1-D integer sequence/array) and return it as int64, range-checked."""
    if isinstance(ids, (str, *_BYTES_LIKE)):
        raise TypeError(f"ids must be a 1-D sequence of integer token ids, got {type(ids).__name__}")
    try:
        arr = np.asarray(ids)
    except (TypeError, ValueError) as e:  # ragged nesting etc.
        raise TypeError(f"ids must be a 1-D sequence of integer token ids: {e}") from None
    if arr.ndim != 1:
        raise ValueError(f"ids must be 1-D, got shape {arr.shape}")
    if arr.size == 0:
        return np.zeros((0,), np.int64)
    if arr.dtype == object:  # e.g. Python ints beyond int64
        for pos, v in enumerate(arr.tolist()):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise TypeError(f"ids must contain integers, got {type(v).__name__} {v!r} at position {pos}")
            if not 0 <= v < VOCAB_SIZE:
                raise ValueError(f"token id {v} at position {pos} is out of range: ids must be in [0, {VOCAB_SIZE})")
        return arr.astype(np.int64)
    if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"ids must have an integer dtype, got {arr.dtype}")
    bad = (arr < 0) | (arr >= VOCAB_SIZE)
    if bad.any():
        pos = int(np.argmax(bad))
        raise ValueError(
            f"token id {int(arr[pos])} at position {pos} is out of range: ids must be in [0, {VOCAB_SIZE})"
        )
    return arr.astype(np.int64, copy=False)


@dataclass(frozen=True)
class ByteTokenizer:
    """Stateless UTF-8 byte tokenizer: id ``b`` is byte ``b``; ids 256..259 are BOS/EOS/MASK/PAD."""

    @property
    def vocab_size(self) -> int:
        return VOCAB_SIZE

    @property
    def bos_id(self) -> int:
        return BOS_ID

    @property
    def eos_id(self) -> int:
        return EOS_ID

    @property
    def mask_id(self) -> int:
        return MASK_ID

    @property
    def pad_id(self) -> int:
        return PAD_ID

    def encode_np(self, text: str | bytes, *, bos: bool = False, eos: bool = False) -> np.ndarray:
        """Encode ``text`` (``str`` as UTF-8, or bytes-like as is; else TypeError) to a 1-D
        ``uint16`` array: optional BOS, the bytes, optional EOS."""
        data = _to_bytes(text)
        bos, eos = _check_flag("bos", bos), _check_flag("eos", eos)
        out = np.empty(len(data) + bos + eos, np.uint16)
        if bos:
            out[0] = BOS_ID
        if eos:
            out[-1] = EOS_ID
        out[int(bos) : int(bos) + len(data)] = np.frombuffer(data, np.uint8)
        return out

    def encode(self, text: str | bytes, *, bos: bool = False, eos: bool = False) -> list[int]:
        """Like :meth:`encode_np` but returns a list of Python ints."""
        return self.encode_np(text, bos=bos, eos=eos).tolist()

    def decode_bytes(self, ids: Any, *, skip_special: bool = True) -> bytes:
        """Bytes of 1-D integer ``ids``; special ids are dropped (``skip_special``) or raise
        ValueError, as do ids outside ``[0, VOCAB_SIZE)``."""
        skip_special = _check_flag("skip_special", skip_special)
        arr = _ids_to_array(ids)
        special = arr >= BYTE_VOCAB
        if special.any():
            if not skip_special:
                pos = int(np.argmax(special))
                tok = int(arr[pos])
                raise ValueError(
                    f"special token id {tok} ({_ID_TO_SPECIAL[tok]}) at position {pos} has no bytes; "
                    "pass skip_special=True to drop special tokens"
                )
            arr = arr[~special]
        return arr.astype(np.uint8).tobytes()

    def decode(self, ids: Any, *, skip_special: bool = True, errors: str = "replace") -> str:
        """``decode_bytes(ids)`` as UTF-8 with codec error handler ``errors`` (default
        "replace": never raises, a model may emit any byte)."""
        if not isinstance(errors, str):
            raise TypeError(f"errors must be a str naming a codec error handler, got {type(errors).__name__}")
        try:
            codecs.lookup_error(errors)
        except LookupError:
            raise ValueError(
                f"errors={errors!r} is not a registered codec error handler "
                "(e.g. 'strict', 'replace', 'ignore', 'backslashreplace', 'surrogateescape')"
            ) from None
        return self.decode_bytes(ids, skip_special=skip_special).decode("utf-8", errors)


#: The shared tokenizer instance.
BYTE_TOKENIZER = ByteTokenizer()

__all__ = [
    "BYTE_VOCAB", "BOS_ID", "EOS_ID", "MASK_ID", "PAD_ID", "VOCAB_SIZE", "SPECIAL_IDS",
    "ByteTokenizer", "BYTE_TOKENIZER",
]

"""Argument checks shared by every public entry point.

Each raises before any work, naming the argument, showing the value (``repr``, cut to
:data:`MAX_VALUE_CHARS`) and stating what is allowed: ``TypeError``
(:class:`ArgumentTypeError`, also a ``ValueError``) for a wrong type, ``ValueError`` for
a value out of range. A ``bool`` is never an integer here; NumPy integer scalars are.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Sequence

import numpy as np

__all__ = ["MAX_VALUE_CHARS", "MAX_INT", "show", "is_int", "is_number", "check_int",
           "check_opt_int", "check_number", "check_bool", "check_choice", "check_int_sequence",
           "check_type", "ArgumentError", "ArgumentTypeError", "unknown_keys"]

#: Longest shown value in a message (the rest is replaced by ``...``).
MAX_VALUE_CHARS = 80
#: Largest integer any size or id may take (int32 on the device).
MAX_INT = 2**31 - 1


class ArgumentError(ValueError):
    """A value of the right type outside its allowed range (a ``ValueError``)."""


class ArgumentTypeError(TypeError, ValueError):
    """A value of the wrong type: a ``TypeError``, and also a ``ValueError`` so that one
    ``except ValueError`` catches every argument error."""


def show(value: Any, limit: int = MAX_VALUE_CHARS) -> str:
    """``repr(value)`` cut to ``limit`` characters."""
    try:
        r = repr(value)
    except Exception:  # noqa: BLE001 - a broken __repr__ must not hide the real error
        r = f"<{type(value).__name__}>"
    return r if len(r) <= limit else r[: limit - 3] + "..."


def is_int(v: Any) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def is_number(v: Any) -> bool:
    return (isinstance(v, (int, float, np.integer, np.floating))
            and not isinstance(v, (bool, np.bool_)))


def _range(lo: float | None, hi: float | None) -> str:
    if lo is not None and hi is not None and hi != MAX_INT:
        return f"in [{lo}, {hi}]"
    if lo is not None:
        return f">= {lo}"
    if hi is not None:
        return f"<= {hi}"
    return "any value"


def check_int(name: str, value: Any, lo: int | None = None, hi: int | None = MAX_INT, *,
              why: str = "") -> int:
    """``value`` as a Python int in ``[lo, hi]``; TypeError for a non-integer (bool
    included), ValueError outside the range. ``why`` is appended to the message."""
    tail = f" ({why})" if why else ""
    if not is_int(value):
        raise ArgumentTypeError(f"{name} must be an int {_range(lo, hi)}{tail}, got {show(value)} "
                        f"of type {type(value).__name__}")
    v = int(value)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise ArgumentError(f"{name} must be an int {_range(lo, hi)}{tail}, got {show(v)}")
    return v


def check_opt_int(name: str, value: Any, lo: int | None = None, hi: int | None = MAX_INT, *,
                  why: str = "") -> int | None:
    """``None`` or :func:`check_int`."""
    return None if value is None else check_int(name, value, lo, hi, why=why)


def check_number(name: str, value: Any, lo: float | None = None, hi: float | None = None, *,
                 finite: bool = True, why: str = "") -> float:
    """``value`` as a float in ``[lo, hi]`` (finite unless ``finite=False``)."""
    tail = f" ({why})" if why else ""
    if not is_number(value):
        raise ArgumentTypeError(f"{name} must be a number {_range(lo, hi)}{tail}, got {show(value)} "
                        f"of type {type(value).__name__}")
    v = float(value)
    if (finite and not math.isfinite(v)) or (lo is not None and v < lo) \
            or (hi is not None and v > hi):
        raise ArgumentError(f"{name} must be a {'finite ' if finite else ''}number "
                            f"{_range(lo, hi)}{tail}, got {show(value)}")
    return v


def check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise ArgumentTypeError(f"{name} must be a bool (True or False), got {show(value)} of type "
                        f"{type(value).__name__}")
    return bool(value)


def check_choice(name: str, value: Any, choices: Sequence[Any]) -> Any:
    if value not in tuple(choices):
        raise ArgumentError(f"{name}={show(value)} is not allowed; allowed values: "
                            f"{show(tuple(choices), 400)}")
    return value


def check_type(name: str, value: Any, types: type | tuple[type, ...], what: str) -> Any:
    """``value`` if it is an instance of ``types``; TypeError naming ``what`` otherwise."""
    if not isinstance(value, types):
        raise ArgumentTypeError(f"{name} must be {what}, got {show(value)} of type {type(value).__name__}")
    return value


def check_int_sequence(name: str, value: Any, lo: int | None = None, hi: int | None = MAX_INT, *,
                       min_len: int = 0, max_len: int | None = None) -> tuple[int, ...]:
    """A list / tuple / 1-D array of ints, each in ``[lo, hi]``, as a tuple. A bare int or
    a string is a TypeError (``stop_token_ids=5`` is not ``(5,)``)."""
    if isinstance(value, np.ndarray):
        if value.ndim != 1:
            raise ArgumentTypeError(f"{name} must be a 1-D sequence of ints, got an array of shape "
                            f"{value.shape}")
        value = value.tolist()
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple, range)):
        raise ArgumentTypeError(f"{name} must be a list or tuple of ints, got {show(value)} of type "
                        f"{type(value).__name__}")
    if len(value) < min_len or (max_len is not None and len(value) > max_len):
        raise ArgumentError(f"{name} must hold {_range(min_len, max_len)} values, got "
                            f"{len(value)}: {show(value)}")
    return tuple(check_int(f"{name}[{i}]", v, lo, hi) for i, v in enumerate(value))


def unknown_keys(name: str, keys: Iterable[str], allowed: Iterable[str]) -> None:
    """ValueError naming every key of ``keys`` not in ``allowed``."""
    bad = sorted(set(keys) - set(allowed))
    if bad:
        raise ArgumentError(f"{name}: unknown key(s) {show(bad, 200)}; allowed: "
                            f"{show(sorted(allowed), 600)}")


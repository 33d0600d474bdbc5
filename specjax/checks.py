"""Argument checks shared by every public entry point (``SpeculativeConfig``,
``SpeculativeConfig.from_vllm``, ``make_proposer``, ``generate`` / ``Engine``, the public
step, the HF config parser).

Each check raises before any work, with a message that names the argument, shows the value
(``repr``, truncated to :data:`MAX_VALUE_CHARS`) and states what is allowed. Wrong types are
``TypeError`` (:class:`ArgumentTypeError`, also a ``ValueError``); values of the right
type outside their range are ``ValueError``. A ``bool`` is never an integer here
(``True`` is not a count); NumPy integer scalars are.
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
    """A value of the wrong type: a ``TypeError``, and also a ``ValueError`` so that code
    written against the earlier ``ValueError``-only checks keeps catching it."""


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


def memory_limit_bytes() -> tuple[int, str] | None:
    """``(bytes, what)`` the KV cache can take at most: the default JAX device's memory
    limit (``memory_stats()['bytes_limit']``), else the host's physical memory; None when
    neither is known."""
    import os

    import jax

    try:
        dev = jax.devices()[0]
        stats = dev.memory_stats() or {}
        if stats.get("bytes_limit"):
            return int(stats["bytes_limit"]), f"the {dev.platform} device's memory limit"
    except Exception:  # noqa: BLE001 - memory stats are optional on every backend
        pass
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")), "the host's memory"
    except (ValueError, OSError, AttributeError):
        return None


def check_kv_cache_fits(*, num_blocks: int, block_size: int, num_layers: int, num_kv_heads: int,
                        head_dim: int, itemsize: int, max_model_len: int, max_num_seqs: int,
                        num_blocks_given: bool) -> None:
    """ValueError naming ``max_model_len`` and ``num_blocks`` when the target's paged KV
    cache (k and v, ``[num_blocks, block_size, kv_heads, head_dim]`` per layer) would not
    fit in :func:`memory_limit_bytes`, before anything is allocated."""
    need = 2 * num_layers * num_blocks * block_size * num_kv_heads * head_dim * itemsize
    limit = memory_limit_bytes()
    if limit is None or need <= limit[0]:
        return
    gib = lambda b: f"{b / 2**30:.3g} GiB"  # noqa: E731
    src = ("num_blocks (given)" if num_blocks_given else
           f"num_blocks (default 1 + max_num_seqs={max_num_seqs} x ceil(max_model_len / "
           f"block_size={block_size}))")
    raise ArgumentError(
        f"max_model_len={max_model_len} and num_blocks={num_blocks} need a target KV cache of "
        f"{gib(need)} ({src}), more than {limit[1]} ({gib(limit[0])}): lower max_model_len or "
        "max_num_seqs, or pass a smaller num_blocks")


def check_buckets(name: str, buckets: Any, need: int, what: str) -> tuple[int, ...] | None:
    """None, or a non-empty sequence of ints >= 1 whose largest holds ``need`` (``what``
    says which size that is)."""
    if buckets is None:
        return None
    b = check_int_sequence(name, buckets, 1, min_len=1, max_len=4096)
    if max(b) < need:
        raise ArgumentError(f"{name}={show(b)}: the largest bucket must hold {what} = {need}")
    return b


def check_engine_args(model: Any, *, max_model_len: Any, block_size: Any, max_num_seqs: Any,
                      num_blocks: Any, min_tokens_per_step: Any, kv_dtype: Any,
                      buckets: tuple[Any, Any, Any], k: int) -> None:
    """The checks of ``Engine`` / ``generate``: every integer bounded, each bucket list able
    to hold its size, the KV cache within memory (:func:`check_kv_cache_fits`)."""
    mml = check_int("max_model_len", max_model_len, 2)
    bs = check_int("block_size", block_size, 1, 1 << 16)
    seqs = check_int("max_num_seqs", max_num_seqs, 1, 1 << 16)
    check_int("min_tokens_per_step", min_tokens_per_step, 1, 1 << 20)
    nb_given = num_blocks is not None
    nb = (1 + seqs * -(-mml // bs)) if num_blocks is None else \
        check_int("num_blocks", num_blocks, 2, why="block 0 is the null block")
    if nb > MAX_INT:
        raise ArgumentError(f"max_model_len={mml} with max_num_seqs={seqs} and block_size={bs} "
                            f"gives num_blocks={nb}, above {MAX_INT}: lower them")
    bb, qb, cb = buckets
    check_buckets("batch_buckets", bb, seqs, "max_num_seqs")
    check_buckets("query_buckets", qb, k + 1, "num_speculative_tokens + 1 tokens per request")
    check_buckets("context_buckets", cb, -(-mml // bs), "ceil(max_model_len / block_size) blocks")
    cfg = getattr(model, "config", None)
    if cfg is None:
        return
    try:
        itemsize = np.dtype(kv_dtype).itemsize
    except TypeError:
        raise ArgumentTypeError(f"kv_dtype must be a dtype (e.g. jnp.bfloat16), got "
                                f"{show(kv_dtype)}") from None
    check_kv_cache_fits(num_blocks=nb, block_size=bs, num_layers=cfg.num_hidden_layers,
                        num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                        itemsize=itemsize, max_model_len=mml, max_num_seqs=seqs,
                        num_blocks_given=nb_given)
    # host token buffer [max_num_seqs, max_model_len] int32
    limit = memory_limit_bytes()
    if limit is not None and seqs * mml * 4 > limit[0]:
        raise ArgumentError(f"max_model_len={mml} x max_num_seqs={seqs} token buffer "
                            f"({seqs * mml * 4 / 2**30:.3g} GiB) exceeds {limit[1]}")

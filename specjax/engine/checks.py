"""Checks of ``Engine`` / ``generate`` that need the machine or the models: the KV cache
against the memory it would take (naming ``max_model_len`` and ``num_blocks``), bucket
lists, a ``DecoderLM`` target's params against its config. Generic argument checks:
:mod:`specjax.checks`."""

from __future__ import annotations

from typing import Any

import numpy as np

from specjax.checks import (MAX_INT, ArgumentError, ArgumentTypeError, check_int,
                            check_int_sequence, show)

__all__ = ["memory_limit_bytes", "check_kv_cache_fits", "check_buckets", "check_engine_args"]


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


def check_kv_cache_fits(*, num_blocks: int, bytes_per_block: int, block_size: int,
                        max_model_len: int, max_num_seqs: int, num_blocks_given: bool,
                        drafter_bytes_per_block: int = 0) -> None:
    """ValueError naming ``max_model_len`` and ``num_blocks`` when the KV caches (``num_blocks``
    blocks of ``bytes_per_block``, the target's ``kv_bytes_per_block``, plus
    ``drafter_bytes_per_block``, the proposer's) would not fit in :func:`memory_limit_bytes`,
    before anything is allocated."""
    need = num_blocks * (bytes_per_block + drafter_bytes_per_block)
    limit = memory_limit_bytes()
    if limit is None or need <= limit[0]:
        return
    gib = lambda b: f"{b / 2**30:.3g} GiB"  # noqa: E731
    src = ("num_blocks (given)" if num_blocks_given else
           f"num_blocks (default 1 + max_num_seqs={max_num_seqs} x ceil(max_model_len / "
           f"block_size={block_size}))")
    what = "target KV cache" if not drafter_bytes_per_block else (
        f"target and drafter KV cache ({gib(num_blocks * drafter_bytes_per_block)} the drafter's)")
    raise ArgumentError(
        f"max_model_len={max_model_len} and num_blocks={num_blocks} need a {what} of "
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
                      num_blocks: Any, kv_dtype: Any, buckets: tuple[Any, Any, Any], k: int,
                      params: Any = None, proposer: Any = None) -> None:
    """The checks of ``Engine`` / ``generate``: every integer bounded, each bucket list able
    to hold its size, the target's and the ``proposer``'s KV within memory
    (:func:`check_kv_cache_fits`); ``model`` a checked ``specjax.Target``."""
    mml = check_int("max_model_len", max_model_len, 2)
    bs = check_int("block_size", block_size, 1, 1 << 16)
    seqs = check_int("max_num_seqs", max_num_seqs, 1, 1 << 16)
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
    from specjax.models import DecoderLM

    if params is not None and isinstance(model, DecoderLM):
        from specjax.models import registry

        cfg = model.config
        registry.check_params(cfg.kind, cfg, params, name="target params")
    if kv_dtype is None:            # the default: the params' dtype (float32 without params)
        from specjax.runtime.step import params_kv_dtype

        kv_dtype = params_kv_dtype(params)
    try:
        np.dtype(kv_dtype)
    except TypeError:
        raise ArgumentTypeError(f"kv_dtype must be a dtype (e.g. jnp.bfloat16), got "
                                f"{show(kv_dtype)}") from None
    drafter = 0 if proposer is None else int(proposer.kv_bytes_per_block(bs, kv_dtype))
    check_kv_cache_fits(num_blocks=nb, bytes_per_block=int(model.kv_bytes_per_block(bs, kv_dtype)),
                        block_size=bs, max_model_len=mml, max_num_seqs=seqs,
                        num_blocks_given=nb_given, drafter_bytes_per_block=drafter)
    # host token buffer [max_num_seqs, max_model_len] int32
    limit = memory_limit_bytes()
    if limit is not None and seqs * mml * 4 > limit[0]:
        raise ArgumentError(f"max_model_len={mml} x max_num_seqs={seqs} token buffer "
                            f"({seqs * mml * 4 / 2**30:.3g} GiB) exceeds {limit[1]}")

"""The KV block pool sized from a memory fraction (vLLM's ``gpu_memory_utilization``): the
engine may use ``fraction`` of each device's memory in all; the KV blocks get what the
weights (already placed), an activation peak and the fixed proposer state leave.

:func:`kv_cache_bytes` measures the caches abstractly (nothing allocated),
:func:`blocks_for_memory` is the pure rule, :func:`num_blocks_from_memory` reads the devices'
``memory_stats()`` and applies it."""

from __future__ import annotations

from typing import Any

import numpy as np

from specjax.checks import (MAX_INT, ArgumentError, ArgumentTypeError, check_int, is_number,
                            show)

__all__ = ["kv_cache_bytes", "kv_bytes_per_block", "activation_bytes_estimate",
           "compiled_temp_bytes", "step_workspace_bytes",
           "blocks_for_memory", "num_blocks_from_memory", "pool_from_memory"]

NAME = "gpu_memory_utilization"
#: Bytes set aside besides the estimated activations: XLA's and the BLAS libraries'
#: workspaces and the compiled programs, which ``bytes_in_use`` does not hold yet.
RUNTIME_SLACK_BYTES = 256 << 20
#: ``[rows, vocab]`` float32 arrays live at once in verification: the logits, the
#: probabilities, the sampling noise, the top-k/top-p sort's values and indices, logprobs
#: or processed logits.
LOGITS_COPIES = 6


def _size(n: int) -> str:
    return f"{n / 2**30:.3g} GiB" if abs(n) >= 2**30 else f"{n / 2**20:.4g} MiB"


def _nbytes(tree: Any, shardings: Any = None) -> int:
    """Bytes of the abstract leaves of ``tree``; with ``shardings`` (a matching tree of
    ``NamedSharding``), of one device's shard of each."""
    import jax

    leaves = jax.tree.leaves(tree)
    shards = [None] * len(leaves) if shardings is None else jax.tree.leaves(shardings)
    return sum(int(np.prod(x.shape if s is None else s.shard_shape(x.shape), dtype=np.int64))
               * np.dtype(x.dtype).itemsize for x, s in zip(leaves, shards))


def kv_cache_bytes(step, block_size: int, kv_dtype=None, *, per_device: bool = False
                   ) -> tuple[int, int]:
    """``(bytes per block, fixed bytes)`` of ``step.init_caches(n, block_size, kv_dtype)``
    (target KV and proposer state): ``jax.eval_shape`` at 2 and 3 blocks, the difference per
    block, the rest fixed (buffers not sized by blocks). ``per_device``: one device's shard
    on ``step.mesh`` (the target's KV sharded as ``init_caches`` places a ``DecoderLM``'s;
    a foreign target's KV counted whole, as if replicated). Nothing is allocated and the
    step's record of pool sizes is left as it was. ValueError from ``init_caches`` (a
    ``block_size`` other than the proposer's)."""
    import jax

    block_size = check_int("block_size", block_size, 1)

    def total(n: int) -> int:
        kv, state = _abstract_caches(step, n, block_size, kv_dtype)
        if not per_device or getattr(step, "mesh", None) is None:
            return _nbytes((kv, state))
        ks, ss = _cache_shardings(step, kv, state)
        return _nbytes(kv, ks) + _nbytes(state, ss)

    two, three = total(2), total(3)
    per_block = three - two
    return per_block, two - 2 * per_block


def _abstract_caches(step, n: int, block_size: int, kv_dtype):
    """``jax.eval_shape`` of ``step.init_caches(n, ...)``, the step's record of pool sizes
    left as it was."""
    import jax

    pools = step.__dict__.get("_kv_pools")      # init_caches records pool sizes: keep them
    saved = None if pools is None else dict(pools)
    try:
        return jax.eval_shape(lambda: step.init_caches(n, block_size, kv_dtype))
    finally:
        if saved is None:
            step.__dict__.pop("_kv_pools", None)
        else:
            step.__dict__["_kv_pools"] = saved


def _cache_shardings(step, kv, state):
    """``(kv, state)`` shardings as ``init_caches`` places the caches on ``step.mesh``: by kv
    head; a foreign target's KV None (placed by its own ``init_kv_caches``)."""
    from specjax.models import DecoderLM
    from specjax.sharding import state_shardings

    mesh, axis = step.mesh, step.tp_axis
    ks = state_shardings(kv, mesh, axis=axis) if isinstance(step.target, DecoderLM) else None
    return ks, None if state is None else state_shardings(state, mesh, axis=axis)


def _placed(step, kv, state):
    """The abstract caches with the shardings the step's program receives on its mesh."""
    import jax

    def put(tree, shardings):
        if tree is None or shardings is None:
            return tree
        return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                            tree, shardings)

    ks, ss = _cache_shardings(step, kv, state)
    return put(kv, ks), put(state, ss)


def kv_bytes_per_block(step, block_size: int, kv_dtype) -> int:
    """Bytes one KV block costs in all: the target's caches plus the proposer's state
    (:func:`kv_cache_bytes`; the fixed part is its second value)."""
    return kv_cache_bytes(step, block_size, kv_dtype)[0]


def activation_bytes_estimate(step, params, *, max_num_batched_tokens: int,
                              max_num_seqs: int | None = None) -> int:
    """A conservative bound (bytes) on the step's activation peak at ``T =
    max_num_batched_tokens`` tokens: ``T x (8 H + 3 I + n_aux H)`` in the params' dtype (the
    residual stream, norm, q/k/v, attention and MLP intermediates of one layer, the final
    hidden states and the aux states EAGLE-3 / DFlash read; ``I`` the target config's
    ``intermediate_size``, else ``4 H``), plus ``rows x V x 4 x LOGITS_COPIES`` for
    verification (``rows = min(T, max_num_seqs x (k + 1))``, ``T`` without
    ``max_num_seqs``), plus :data:`RUNTIME_SLACK_BYTES`. The phases are summed though they
    do not overlap (the drafter runs after the target's layers are freed), and the estimate
    assumes the flash / chunked attention paths (no ``[T, context]`` scores)."""
    from specjax.runtime.step import params_kv_dtype

    t = check_int("max_num_batched_tokens", max_num_batched_tokens, 1)
    target = step.target
    h, v = int(target.hidden_size), int(target.vocab_size)
    inter = getattr(getattr(target, "config", None), "intermediate_size", None) or 4 * h
    n_aux = len(tuple(getattr(target, "aux_layer_ids", ()) or ()))
    act = np.dtype(params_kv_dtype(params)).itemsize
    rows = t if max_num_seqs is None else \
        min(t, check_int("max_num_seqs", max_num_seqs, 1) * (int(step.k) + 1))
    hidden = t * act * (8 * h + 3 * int(inter) + n_aux * h)
    return hidden + rows * v * 4 * LOGITS_COPIES + RUNTIME_SLACK_BYTES


def compiled_temp_bytes(step, params, *, block_size: int, kv_dtype, tokens: int,
                        requests: int, blocks: int) -> int:
    """XLA's temp bytes (``memory_analysis()``) of the fused step compiled (not run, vLLM's
    profile run) on a padding batch of ``requests`` rows, ``tokens`` slots, ``blocks`` columns;
    on ``step.mesh``, one device's (the caches placed as ``init_caches`` places them)."""
    import jax

    from specjax.runtime.batch import StepBatch
    from specjax.runtime.warmup import Bucket, padding_batches

    bucket = Bucket(max(1, min(int(requests), int(tokens))), int(tokens), int(blocks), int(tokens))
    fields = padding_batches(step, [bucket], block_size=block_size, all_greedy=(False,),
                             tree_verify=(False,))[0]
    kv, state = _abstract_caches(step, int(blocks) + 1, block_size, kv_dtype)
    if getattr(step, "mesh", None) is not None:
        kv, state = _placed(step, kv, state)
    lowered = step.lower(params, step.draft_params, kv, state, StepBatch(**fields))
    stats = lowered.compile().memory_analysis()
    return int(getattr(stats, "temp_size_in_bytes", 0) or 0)


def step_workspace_bytes(step, params, *, block_size: int, kv_dtype, max_model_len: int,
                         max_num_batched_tokens: int, max_num_seqs: int | None = None,
                         compiled: bool = True) -> int:
    """The bytes the pool leaves free: :func:`activation_bytes_estimate`, or (``compiled``)
    the widest step's :func:`compiled_temp_bytes` plus the slack where that is larger."""
    act = activation_bytes_estimate(step, params, max_num_batched_tokens=max_num_batched_tokens,
                                    max_num_seqs=max_num_seqs)
    if compiled:
        temp = compiled_temp_bytes(step, params, block_size=block_size, kv_dtype=kv_dtype,
                                   tokens=max_num_batched_tokens, requests=max_num_seqs or 1,
                                   blocks=-(-max_model_len // block_size))
        act = max(act, temp + RUNTIME_SLACK_BYTES)
    return act


def _check_fraction(fraction: Any) -> float:
    if not is_number(fraction):
        raise ArgumentTypeError(f"{NAME} must be a number in (0, 1], got {show(fraction)} of "
                                f"type {type(fraction).__name__}")
    f = float(fraction)
    if not 0.0 < f <= 1.0:
        raise ArgumentError(f"{NAME} must be a number in (0, 1] (the share of the device's "
                            f"memory the engine may use), got {show(fraction)}")
    return f


def blocks_for_memory(*, device_memory: dict, fraction: float, bytes_per_block: int,
                      fixed_bytes: int, activation_bytes: int, min_blocks: int) -> int:
    """KV blocks (the null block included) that fit in ``fraction`` of one device:
    ``budget = fraction x bytes_limit - bytes_in_use - activation_bytes - fixed_bytes``
    (``device_memory`` a ``jax.Device.memory_stats()`` dict; ``bytes_in_use`` holds the
    weights already placed), ``blocks = budget // bytes_per_block``: the pool
    ``init_caches(blocks)`` allocates, null block 0 included, stays within the budget.
    ValueError naming ``gpu_memory_utilization``: ``fraction`` outside (0, 1] (a bool
    refused), a dict without ``bytes_limit``, or fewer than ``min_blocks`` fitting (the
    memory needed and available in GiB / MiB)."""
    f = _check_fraction(fraction)
    bpb = check_int("bytes_per_block", bytes_per_block, 1, None)
    fixed = check_int("fixed_bytes", fixed_bytes, 0, None)
    act = check_int("activation_bytes", activation_bytes, 0, None)
    need_blocks = check_int("min_blocks", min_blocks, 1, None)
    if not isinstance(device_memory, dict) or not device_memory.get("bytes_limit"):
        raise ArgumentError(f"{NAME} needs the device's memory_stats() with bytes_limit, got "
                            f"{show(device_memory)}: give num_blocks")
    limit = check_int("bytes_limit", device_memory["bytes_limit"], 1, None)
    in_use = check_int("bytes_in_use", device_memory.get("bytes_in_use", 0), 0, None)
    allowed = int(f * limit)
    budget = allowed - in_use - act - fixed
    blocks = max(budget, 0) // bpb
    if blocks < need_blocks:
        need = need_blocks * bpb + in_use + act + fixed
        raise ArgumentError(
            f"{NAME}={f:g} allows {_size(allowed)} of the device's {_size(limit)}; the engine "
            f"needs {_size(need)}: {_size(in_use)} in use (weights), {_size(act)} of "
            f"activations, {_size(fixed)} of fixed proposer state and min_blocks="
            f"{need_blocks} KV blocks of {_size(bpb)} ({_size(need_blocks * bpb)}), but only "
            f"{blocks} blocks fit: raise {NAME}, lower max_model_len or max_num_batched_tokens, "
            "or give num_blocks")
    return int(min(blocks, MAX_INT))


def _devices(params: Any, step, device: Any) -> list:
    """The devices to budget: ``device`` (one or a sequence), else those holding
    ``params``' arrays, else ``step.mesh``'s, else JAX's first."""
    import jax

    if device is not None:
        return list(device) if isinstance(device, (list, tuple, set)) else [device]
    devs: dict = {}
    for leaf in jax.tree.leaves(params):
        if isinstance(leaf, jax.Array):
            for d in leaf.devices():
                devs[d.id] = d
    if devs:
        return [devs[i] for i in sorted(devs)]
    mesh = getattr(step, "mesh", None)
    return list(mesh.devices.flat) if mesh is not None else [jax.devices()[0]]


def num_blocks_from_memory(step, params, **kw) -> int:
    """:func:`pool_from_memory`'s block count."""
    return pool_from_memory(step, params, **kw)[0]


def pool_from_memory(step, params, *, fraction: float, block_size: int, kv_dtype,
                     max_model_len: int, max_num_batched_tokens: int, device=None,
                     max_num_seqs: int | None = None, compiled: bool = True,
                     activation_bytes: int | None = None) -> tuple[int, int]:
    """``(num_blocks, activation bytes left free)`` for ``Engine`` from ``fraction``
    (``gpu_memory_utilization``) of the memory of the devices holding ``params`` (``device``:
    these instead), the minimum over them: :func:`blocks_for_memory` with one device's share
    of :func:`kv_cache_bytes` (``kv_dtype`` None: the params' dtype), the activations of
    :func:`step_workspace_bytes` (``compiled``; ``activation_bytes``: given instead), params
    leaves still on the host counted whole as fixed bytes (they are placed later), and
    ``min_blocks = ceil(max_model_len / block_size) + 1`` (one request at
    ``max_model_len`` plus the null block). Call it once the params are placed: the
    devices' ``bytes_in_use`` is read now. ValueError naming ``gpu_memory_utilization``: a
    device whose ``memory_stats()`` is None (CPU), too little memory, or caches that do not
    grow per block."""
    import jax

    from specjax.runtime.step import params_kv_dtype

    _check_fraction(fraction)
    bs = check_int("block_size", block_size, 1)
    mml = check_int("max_model_len", max_model_len, 1)
    if kv_dtype is None:
        kv_dtype = params_kv_dtype(params)
    per_block, fixed = kv_cache_bytes(step, bs, kv_dtype, per_device=True)
    if per_block <= 0:
        raise ArgumentError(f"{NAME}: the caches do not grow with num_blocks (0 bytes per "
                            "block), so memory does not size the pool: give num_blocks")
    devices = _devices(params, step, device)
    for d in devices:
        if d.memory_stats() is None:
            raise ArgumentError(f"{NAME} needs the device's memory_stats(); the "
                                f"{getattr(d, 'platform', '?')} device {d} reports none: "
                                "give num_blocks")
    act = activation_bytes if activation_bytes is not None else step_workspace_bytes(
        step, params, block_size=bs, kv_dtype=kv_dtype, max_model_len=mml,
        max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
        compiled=compiled)
    host = sum(int(np.asarray(x).nbytes) for x in jax.tree.leaves(params)
               if not isinstance(x, jax.Array) and hasattr(x, "dtype"))
    out = []
    for d in devices:
        stats = d.memory_stats()
        out.append(blocks_for_memory(device_memory=stats, fraction=fraction,
                                     bytes_per_block=per_block, fixed_bytes=fixed + host,
                                     activation_bytes=act, min_blocks=-(-mml // bs) + 1))
    return min(out), act

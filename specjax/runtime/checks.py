"""The runtime's checks before work: each refuses a mistake by name, with its fix, before
anything is traced, compiled or donated, on the host and without a device sync.

A call's arguments (:func:`check_call`, :func:`check_loop_call`): caches donated to an
earlier call, draft / target params missing or not the step's, a host batch's block ids past
the KV pool and its token ids outside the vocabulary. A batch's or loop state's inputs
(``build_batch``, ``make_loop_state``): block ids (:func:`check_table`), token ids
(:func:`check_token_ids`) and per-row seeds, a sampled row without one drawing a fresh one
(:func:`row_seeds`). Why here: JAX reports these late ("Array has been deleted", a
``NoneType`` error in the trace) or not at all (block 0 or an id past the pool is read and
written silently)."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from specjax.checks import ArgumentError, ArgumentTypeError, is_int, show

__all__ = ["check_call", "check_loop_call", "check_not_donated", "check_draft_params",
           "check_target_params", "check_input_ids", "check_table", "check_token_ids",
           "row_seeds", "record_pool", "pool_size", "MAX_SEED"]

#: Largest seed (seeds are uint32 on the device).
MAX_SEED = 2**32 - 1
#: Draws the seeds of sampled rows given none: fresh entropy, not reproducible (vLLM's
#: unseeded requests).
_FRESH = np.random.default_rng()


def _signature(tree: Any) -> tuple:
    """``(treedef, leaf shapes)``: what a jitted call's compiled program is keyed on."""
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, tuple(np.shape(x) for x in leaves)


def _seen(step) -> dict:
    """Per-step memo of what passed: ``{argument: id}`` of the last object checked (a params
    tree is checked once, not every step) and the signatures that passed."""
    return step.__dict__.setdefault("_checks_passed", {})


def check_not_donated(**caches: Any) -> None:
    """ArgumentError naming the first argument with a leaf donated to an earlier call
    (``jax.Array.is_deleted()``: a host-side flag, no device sync)."""
    for name, tree in caches.items():
        for x in jax.tree.leaves(tree):
            if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) and x.is_deleted():
                raise ArgumentError(f"{name} was donated to an earlier step: pass the {name} that "
                                    f"step returned (every call donates it and returns the new one)")


def _difference(got: Any, want: Any) -> str:
    """The first path where ``got`` and ``want`` differ in structure or leaf shape."""
    flat = lambda t: {jax.tree_util.keystr(p): np.shape(x)  # noqa: E731
                      for p, x in jax.tree_util.tree_flatten_with_path(t)[0]}
    g, w = flat(got), flat(want)
    missing = [p for p in w if p not in g]
    extra = [p for p in g if p not in w]
    if missing or extra:
        return "; ".join(([f"missing {show(missing[:3], 200)}"] if missing else []) +
                         ([f"unexpected {show(extra[:3], 200)}"] if extra else []))
    for p, s in w.items():
        if g[p] != s:
            return f"{p} has shape {g[p]}, the proposer's {s}"
    return "another tree structure"


def check_draft_params(step, draft_params: Any) -> None:
    """ArgumentError naming ``draft_params`` when the step's proposer drafts with weights and
    ``draft_params`` is None or differs from ``step.draft_params`` in tree structure or leaf
    shapes (checked once per object)."""
    prop = step.proposer
    want = None if prop is None else prop.params
    if want is None or draft_params is want:
        return
    seen = _seen(step)
    if seen.get("draft_params") == id(draft_params):
        return
    sig = seen.get("draft_sig")
    if sig is None or sig[0] is not want:
        sig = seen["draft_sig"] = (want, _signature(want))
    if not sig[1][1]:           # a proposer without weights (e.g. extract_hidden_states)
        return
    if draft_params is None:
        raise ArgumentError(f"draft_params is None but the {prop.method!r} proposer drafts with "
                            "its own weights: pass step.draft_params")
    if _signature(draft_params) != sig[1]:
        raise ArgumentError(
            f"draft_params do not match the {prop.method!r} proposer's params "
            f"({_difference(draft_params, want)}): pass step.draft_params (the proposer's "
            "params as the step runs them: placed on its mesh, projections fused)")
    seen["draft_params"] = id(draft_params)


def check_target_params(step, target_params: Any) -> None:
    """ArgumentError naming ``target_params`` when None or, for a ``DecoderLM`` target, not
    matching its config (``registry.check_params``; once per object and per passing
    signature). A foreign target's params are opaque: only None is refused."""
    if target_params is None:
        raise ArgumentError("target_params is None: pass the target's params "
                            "(step.place_target_params(params) places them for this step)")
    if not getattr(step, "_own", False):
        return
    seen = _seen(step)
    if seen.get("target_params") == id(target_params):
        return
    sig = _signature(target_params)
    ok = seen.setdefault("target_sigs", set())
    if sig not in ok:
        from specjax.models import registry

        cfg = step.target.config
        try:
            registry.check_params(cfg.kind, cfg, target_params, name="target_params")
        except (TypeError, ValueError) as e:
            raise ArgumentError(f"{e}: pass the params of the model this step was built "
                                "for (step.place_target_params(params))") from None
        ok.add(sig)
    seen["target_params"] = id(target_params)


def record_pool(step, target_kv: Any, num_blocks: int) -> None:
    """Remember that KV of ``target_kv``'s signature holds ``num_blocks`` blocks (from
    ``init_caches``; None when two pool sizes share one signature)."""
    pools = step.__dict__.setdefault("_kv_pools", {})
    sig = _signature(target_kv)
    pools[sig] = num_blocks if pools.get(sig, num_blocks) == num_blocks else None


def pool_size(step, target_kv: Any) -> int | None:
    """Blocks in the KV pool ``target_kv``: a ``DecoderLM``'s leaves' leading dimension, else
    what ``init_caches`` recorded for its signature; None when unknown."""
    if getattr(step, "_own", False):
        leaves = jax.tree.leaves(target_kv)
        return int(np.shape(leaves[0])[0]) if leaves and np.ndim(leaves[0]) else None
    pools = step.__dict__.get("_kv_pools")
    return pools.get(_signature(target_kv)) if pools else None


def _check_pool(name: str, table: Any, num_blocks: int | None) -> None:
    if num_blocks is None or not isinstance(table, np.ndarray) or not table.size:
        return
    m = int(table.max())
    if m >= num_blocks:
        raise ArgumentError(f"{name} holds block id {m}, past the KV pool of num_blocks="
                            f"{num_blocks} (target_kv): hand out ids in 1..{num_blocks - 1} "
                            f"(build_batch / make_loop_state(..., num_blocks={num_blocks}) name "
                            "the request)")


def check_input_ids(batch, vocab_size: int) -> None:
    """ArgumentError naming ``batch.input_ids[j]`` outside ``[0, vocab_size)`` in a host
    batch (padding slots hold 0); a device batch is not read (no sync)."""
    ids = batch.input_ids
    if not isinstance(ids, np.ndarray) or not ids.size:
        return
    if ids.min() < 0 or ids.max() >= vocab_size:
        j = int(np.argmax((ids < 0) | (ids >= vocab_size)))
        raise ArgumentError(f"batch.input_ids[{j}] = {int(ids[j])} is outside the vocabulary "
                            f"[0, {vocab_size}) of this step: build the batch with "
                            "build_batch(..., vocab_size=step.vocab_size) to find the request")


def check_call(step, target_params: Any, draft_params: Any, target_kv: Any, draft_state: Any,
               batch) -> None:
    """``Step.__call__``'s checks after ``check_batch``: caches not donated, params given and
    the step's, a host batch's block table within the KV pool."""
    check_not_donated(target_kv=target_kv, draft_state=draft_state)
    check_target_params(step, target_params)
    check_draft_params(step, draft_params)
    _check_pool("batch.attn.block_table", batch.attn.block_table, pool_size(step, target_kv))


def check_loop_call(step, target_params: Any, draft_params: Any, target_kv: Any,
                    draft_state: Any, state) -> None:
    """``decode_loop``'s checks: :func:`check_call`'s on a loop state (a host state's block
    table against the pool, its real rows' last tokens against the vocabulary)."""
    check_not_donated(target_kv=target_kv, draft_state=draft_state, state=state)
    check_target_params(step, target_params)
    check_draft_params(step, draft_params)
    _check_pool("state.block_table", state.block_table, pool_size(step, target_kv))
    last, n = state.last_token, state.num_reqs
    if isinstance(last, np.ndarray) and isinstance(n, (np.ndarray, int)):
        real = last[: int(n)]
        bad = (real < 0) | (real >= step.vocab_size)
        if bad.any():
            i = int(np.argmax(bad))
            raise ArgumentError(f"state.last_token[{i}] = {int(real[i])} is outside the "
                                f"vocabulary [0, {step.vocab_size}) of this step")


def check_table(table: np.ndarray, lens: np.ndarray, num_blocks: int | None) -> None:
    """ArgumentError naming ``block_ids[i][j]`` for a filled cell (row ``i``'s first
    ``lens[i]`` columns) holding the null block 0, a negative id, or an id
    ``>= num_blocks`` (when given)."""
    n = lens.shape[0]
    filled = np.arange(table.shape[1])[None, :] < lens[:, None]
    cells = table[:n]
    bad = filled & ((cells <= 0) | (cells >= (num_blocks if num_blocks is not None else 2**31)))
    if not bad.any():
        return
    i, j = (int(v) for v in np.argwhere(bad)[0])
    v = int(cells[i, j])
    if v == 0:
        raise ArgumentError(f"block_ids[{i}][{j}] = 0: block 0 is the null block (padding points "
                            "at it) and never belongs to a request: hand out ids from 1")
    if v < 0:
        raise ArgumentError(f"block_ids[{i}][{j}] = {v}: block ids are >= 1 (0 is the null "
                            "block)")
    raise ArgumentError(f"block_ids[{i}][{j}] = {v} is past the KV pool (num_blocks="
                        f"{num_blocks}): hand out ids in 1..{num_blocks - 1}")


def check_token_ids(flat: np.ndarray, lens: np.ndarray, vocab_size: int | None) -> None:
    """ArgumentError naming ``token_ids[i][j]`` for a negative id or (``vocab_size`` given)
    one ``>= vocab_size``; ``flat``: every request's tokens back to back, ``lens`` per row."""
    if not flat.size:
        return
    hi = vocab_size if vocab_size is not None else np.inf
    if flat.min() >= 0 and flat.max() < hi:
        return
    k = int(np.argmax((flat < 0) | (flat >= hi)))
    i = int(np.searchsorted(np.cumsum(lens), k, side="right"))
    j = k - int(np.sum(lens[:i]))
    rule = f"in [0, vocab_size={vocab_size})" if vocab_size is not None else ">= 0"
    raise ArgumentError(f"token_ids[{i}][{j}] = {int(flat[k])}: token ids are {rule} (drafts "
                        "past the vocabulary: trim_drafts cuts them)")


def row_seeds(seeds: Any, temperature: np.ndarray, n: int, b: int) -> np.ndarray:
    """``[b] uint32`` seeds of ``n`` requests padded to ``b`` rows. ``seeds``: None or one
    entry per request, each an int in ``[0, 2**32 - 1]`` or None. A row without a seed and
    with ``temperature > 0`` draws a fresh one from OS entropy (not reproducible, as vLLM's
    unseeded requests); a greedy row without one, and padding, get 0. ArgumentError naming
    ``seeds[i]`` otherwise."""
    out = np.zeros(b, np.uint32)
    if seeds is None:
        given = np.full(n, None, object)
    else:
        given = np.asarray(seeds, dtype=None if not isinstance(seeds, (list, tuple)) or
                           all(s is not None for s in seeds) else object)
        if given.shape != (n,):
            raise ArgumentError(f"seeds must have one entry per request ({n}), got shape "
                                f"{given.shape}")
    if given.dtype != object and n:
        if not np.issubdtype(given.dtype, np.integer):
            raise ArgumentTypeError(f"seeds must be ints in [0, {MAX_SEED}] or None, got dtype "
                                    f"{given.dtype}")
        wide = given.astype(np.int64) if given.dtype != np.uint64 else given
        bad = (wide < 0) | (wide > MAX_SEED)
        if bad.any():
            i = int(np.argmax(bad))
            raise ArgumentError(f"seeds[{i}] = {int(given[i])}: a seed is an int in "
                                f"[0, {MAX_SEED}] (uint32), or None for a fresh random seed")
        out[:n] = given
        return out
    missing = np.zeros(b, np.bool_)
    for i, s in enumerate(given.tolist()):
        if s is None:
            missing[i] = True
        elif not is_int(s) or not 0 <= s <= MAX_SEED:
            raise ArgumentError(f"seeds[{i}] = {show(s)}: a seed is an int in [0, {MAX_SEED}] "
                                "(uint32), or None for a fresh random seed")
        else:
            out[i] = s
    fresh = missing & (np.asarray(temperature) > 0)
    if fresh.any():
        out[fresh] = _FRESH.integers(0, MAX_SEED, int(fresh.sum()), dtype=np.uint32,
                                     endpoint=True)
    return out

"""Requests joining and leaving the device loop between calls, without rebuilding its state.

:func:`empty_loop_state` is the :class:`~specjax.runtime.decode_loop.LoopState` of one
bucket with every row free; :func:`admit` writes one decoding request into a row and
:func:`release` frees rows. Both are jitted with the state donated and their shapes fixed by
the state's buckets (the row index is data): one compile per bucket, none per row or call.
:func:`warmup_loop` compiles ``decode_loop``, ``admit`` and ``release`` for every bucket
ahead of time.

Rows are slots. The loop runs rows ``[0, num_reqs)`` and skips finished ones: ``admit``
raises ``num_reqs`` to cover its row, ``release`` marks rows finished, resets them to
padding (null-block table, no drafts) and lowers ``num_reqs`` to the last live row + 1. So
any free row takes a new request, in any order, holes allowed; a request's tokens do not
depend on its row (its key is its seed and token counter). specjax holds nothing per
request: the caller owns the KV blocks and frees them itself."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax.checks import (ArgumentError, ArgumentTypeError, check_int, check_int_sequence,
                            check_number)
from specjax.runtime import host_transfer
from specjax.runtime.checks import MAX_SEED, check_not_donated, row_seeds
from specjax.runtime.decode_loop import LoopState, decode_loop, loop_history, make_loop_state
from specjax.runtime.warmup import (Bucket, as_bucket, as_buckets, empty_procs, logprobs_variants,
                                    procs_variants, variants)
from specjax.sampling import SamplingState
from specjax.sampling.logits_processors import ProcessorLimits
from specjax.sampling.logprobs import check_num_logprobs, logprobs_bucket

__all__ = ["empty_loop_state", "admit", "release", "warmup_loop", "rows_cache_size"]

_I32 = np.int32


def empty_loop_state(step, bucket: Bucket, *, max_model_len: int, block_size: int,
                     stop_pad: int = 1, all_greedy: bool = True, num_logprobs: int | None = None,
                     procs: ProcessorLimits | None = None) -> LoopState:
    """The host :class:`LoopState` of ``step``'s loop for ``bucket`` (``Bucket(requests,
    tokens, blocks)``: ``requests`` rows, ``tokens // requests`` query slots each, ``blocks``
    block-table columns), every row free. ``stop_pad``: stop-id columns per row;
    ``all_greedy``: False to admit sampled requests (the program then samples);
    ``num_logprobs``: the largest request ``logprobs`` (None: off); ``procs``: None, or the
    ``ProcessorLimits`` of a logits-processing state (``admit(procs=...)`` then fills rows).
    The token history is carried when ``step``'s proposer drafts from it (n-gram GPU).
    Raises ValueError / TypeError naming the argument (query slots below ``step.k + 1``, a
    ragged bucket: the loop runs decode steps of ``requests * query_len`` token slots)."""
    bk = as_bucket(bucket)
    q = bk.query_len_pad
    if bk.is_ragged:
        raise ArgumentError(f"bucket.tokens={bk.tokens} is not requests * query_len = "
                            f"{bk.requests} * {q}: the device loop runs decode steps of "
                            f"requests * query_len token slots (use Bucket.of(requests, "
                            f"query_len, blocks))")
    if q < step.k + 1:
        raise ArgumentError(f"bucket.tokens={bk.tokens} gives {q} query slots per row, below "
                            f"k + 1 = {step.k + 1} (a decoding row verifies k drafts): use "
                            f"tokens >= {bk.requests * (step.k + 1)}")
    check_int("max_model_len", max_model_len, 2)
    check_int("block_size", block_size, 1)
    check_int("stop_pad", stop_pad, 1)
    if not isinstance(all_greedy, (bool, np.bool_)):
        raise ArgumentTypeError(f"all_greedy must be True or False, got {all_greedy!r}")
    lp = logprobs_bucket([check_num_logprobs("num_logprobs", num_logprobs)])
    limits = procs_variants((procs,), max_model_len)[0]
    state = make_loop_state(
        last_token=[], num_computed=[], drafts=[], max_tokens=[], num_output=[], block_ids=[],
        k=step.k, num_reqs_pad=bk.requests, blocks_per_req_pad=bk.blocks, query_len_pad=q,
        max_model_len=max_model_len, block_size=block_size, stop_pad=stop_pad,
        history=[] if loop_history(step) else None,
        procs=empty_procs(bk.requests, limits, max_model_len))
    return dataclasses.replace(state, all_greedy=bool(all_greedy), num_logprobs=lp)


def _state(state) -> LoopState:
    if not isinstance(state, LoopState):
        raise ArgumentTypeError(f"state must be a LoopState (empty_loop_state / make_loop_state), "
                                f"got {type(state).__name__}")
    check_not_donated(state=state)
    return state


def _admit(state: LoopState, words, layout):
    r = host_transfer.unpack(words, layout)
    i = r["row"]
    put = lambda a, v: a.at[i].set(v.astype(a.dtype))  # noqa: E731
    s = state.sampling
    procs = s.procs if r["procs"] is None else jax.tree.map(
        lambda a, v: a.at[i].set(v[0].astype(a.dtype)), s.procs, r["procs"])
    sampling = SamplingState(put(s.temperature, r["temperature"]), put(s.top_k, r["top_k"]),
                             put(s.top_p, r["top_p"]), put(s.seeds, r["seed"]),
                             put(s.counters, r["num_output"]), procs)
    return dataclasses.replace(
        state, last_token=put(state.last_token, r["last_token"]),
        num_computed=put(state.num_computed, r["num_computed"]), drafts=put(state.drafts, r["drafts"]),
        num_drafts=put(state.num_drafts, r["num_drafts"]),
        max_tokens=put(state.max_tokens, r["max_tokens"]), stop_ids=put(state.stop_ids, r["stop_ids"]),
        finished=state.finished.at[i].set(False), block_table=put(state.block_table, r["blocks"]),
        sampling=sampling,
        history=None if state.history is None else put(state.history, r["history"]),
        num_reqs=jnp.maximum(state.num_reqs, i + 1).astype(jnp.int32))


def _release(state: LoopState, mask):
    b = mask.shape[0]

    def pad(a, fill):
        m = mask.reshape((b,) + (1,) * (a.ndim - 1))
        return jnp.where(m, jnp.asarray(fill, a.dtype), a)

    s = state.sampling
    finished = state.finished | mask
    live = jnp.where(~finished, jnp.arange(1, b + 1, dtype=jnp.int32), 0)
    return dataclasses.replace(
        state, last_token=pad(state.last_token, 0), num_computed=pad(state.num_computed, 0),
        drafts=pad(state.drafts, -1), num_drafts=pad(state.num_drafts, 0),
        max_tokens=pad(state.max_tokens, 1), stop_ids=pad(state.stop_ids, -1), finished=finished,
        block_table=pad(state.block_table, 0),
        sampling=SamplingState(pad(s.temperature, 0), pad(s.top_k, 0), pad(s.top_p, 1),
                               pad(s.seeds, 0), pad(s.counters, 0), s.procs),
        history=None if state.history is None else pad(state.history, 0),
        num_reqs=jnp.max(live).astype(jnp.int32))


_admit_jit = jax.jit(_admit, static_argnums=2, donate_argnums=0)
_release_jit = jax.jit(_release, donate_argnums=0)


def rows_cache_size() -> int:
    """Compiled variants of :func:`admit` and :func:`release` (for recompilation checks)."""
    return _admit_jit._cache_size() + _release_jit._cache_size()


def _row_words(state: LoopState, row: int, **v) -> tuple[np.ndarray, Any]:
    """One row's values, padded to the state's widths, as ``host_transfer.pack`` words."""
    k, s_pad, c = np.shape(state.drafts)[1], np.shape(state.stop_ids)[1], np.shape(state.block_table)[1]

    def padded(vals, n, fill):
        out = np.full(n, fill, _I32)
        out[: len(vals)] = vals
        return out

    data = dict(row=np.asarray(row, _I32), last_token=np.asarray(v["last_token"], _I32),
                num_computed=np.asarray(v["num_computed"], _I32),
                drafts=padded(v["drafts"], k, -1), num_drafts=np.asarray(len(v["drafts"]), _I32),
                max_tokens=np.asarray(v["max_tokens"], _I32),
                stop_ids=padded(v["stop_ids"], s_pad, -1), blocks=padded(v["block_ids"], c, 0),
                temperature=np.asarray(v["temperature"], np.float32),
                top_k=np.asarray(v["top_k"], _I32), top_p=np.asarray(v["top_p"], np.float32),
                seed=np.asarray(v["seed"], np.uint32), num_output=np.asarray(v["num_output"], _I32),
                history=None if state.history is None else padded(
                    v["history"], np.shape(state.history)[1], 0),
                procs=v["procs"])
    return host_transfer.pack(data)


def _check_procs(state: LoopState, procs) -> Any:
    want = state.sampling.procs
    if want is None:
        if procs is not None:
            raise ArgumentError("procs given but the state has no logits-processing rows: build it "
                                "with empty_loop_state(..., procs=ProcessorLimits(...))")
        return None
    if procs is None:
        raise ArgumentError("the state carries logits-processing rows: pass procs= (the request's "
                            "make_processor_state(..., num_reqs_pad=1, max_len=max_model_len, "
                            "limits=the state's))")
    got = jax.tree.map(np.asarray, procs)
    if type(got) is not type(want):
        raise ArgumentTypeError(f"procs must be a ProcessorState, got {type(procs).__name__}")
    for f in dataclasses.fields(want):
        a, b = getattr(got, f.name), getattr(want, f.name)
        if a.shape != (1,) + tuple(np.shape(b)[1:]) or a.dtype != np.asarray(b).dtype:
            raise ArgumentError(f"procs.{f.name} has shape {a.shape} {a.dtype}; the state's rows "
                                f"take {(1,) + tuple(np.shape(b)[1:])} {np.asarray(b).dtype} "
                                "(num_reqs_pad=1 and the state's max_len and limits)")
    return got


def admit(state: LoopState, row: int, *, last_token: int, num_computed: int, num_output: int,
          max_tokens: int, block_ids: Sequence[int], drafts: Sequence[int] = (),
          stop_ids: Sequence[int] = (), temperature: float = 0.0, top_k: int = 0,
          top_p: float = 1.0, seed: int | None = None, history: Sequence[int] | None = None,
          procs: Any = None, num_blocks: int | None = None) -> LoopState:
    """``state`` with one decoding request in ``row`` (whatever the row held is overwritten:
    pass a free row, one never used, released, or finished and committed). The state is
    donated: use the returned one. Jitted: no compile per row or call.

    The request, as ``make_loop_state`` takes it: ``last_token`` (its last token, not yet in
    the KV cache), ``num_computed`` (every token before it, its KV in ``block_ids``),
    ``num_output`` (tokens generated so far: the sampling counter), ``max_tokens``,
    ``block_ids`` (its KV blocks in order, at most the state's ``blocks`` columns, covering
    ``num_computed + 1 + len(drafts)`` positions; ids >= 1, below ``num_blocks`` when given),
    ``drafts`` (at most ``k``, e.g. the prefill step's), ``stop_ids`` (EOS included, at most
    the state's stop columns), ``temperature`` / ``top_k`` / ``top_p``, ``seed`` (None: 0
    greedy, a fresh random seed when sampled, not reproducible), ``history`` (prompt +
    output, ``num_computed + 1`` tokens; a token-history state only), ``procs`` (a one-row
    ``ProcessorState``; a logits-processing state only). Raises ValueError / TypeError naming
    the argument before any work."""
    st = _state(state)
    b, k = st.num_reqs_pad, int(np.shape(st.drafts)[1])
    s_pad, c, mml = int(np.shape(st.stop_ids)[1]), int(np.shape(st.block_table)[1]), st.max_model_len
    row = check_int("row", row, 0, b - 1, why=f"the state has num_reqs_pad={b} rows")
    last = check_int("last_token", last_token, 0)
    nc = check_int("num_computed", num_computed, 0, mml - 2,
                   why=f"the request holds num_computed + 1 tokens and max_model_len={mml} must "
                       "leave room for one more")
    mt = check_int("max_tokens", max_tokens, 1)
    no = check_int("num_output", num_output, 0, mt - 1,
                   why="a request with max_tokens outputs is finished: do not admit it")
    d = check_int_sequence("drafts", drafts, 0)
    if len(d) > k:
        raise ArgumentError(f"drafts has {len(d)} tokens; the state holds k={k} draft columns")
    stops = check_int_sequence("stop_ids", stop_ids, 0)
    if len(stops) > s_pad:
        raise ArgumentError(f"stop_ids has {len(stops)} ids; the state holds {s_pad} stop columns: "
                            f"build it with empty_loop_state(..., stop_pad={len(stops)}) or more")
    if num_blocks is not None:
        check_int("num_blocks", num_blocks, 2, why="block 0 is the null block")
    hi = MAX_SEED if num_blocks is None else num_blocks - 1
    ids = check_int_sequence("block_ids", block_ids)
    for j, v in enumerate(ids):
        check_int(f"block_ids[{j}]", v, 1, hi, why="block 0 is the null block" + (
            "" if num_blocks is None else f"; the KV pool holds num_blocks={num_blocks}"))
    if len(ids) > c:
        raise ArgumentError(f"block_ids has {len(ids)} blocks; the state's bucket holds {c} "
                            "block-table columns: use a bucket with more blocks")
    upto = min(nc + 1 + len(d), mml)
    need = -(-upto // st.block_size)
    if len(ids) < need:
        raise ArgumentError(f"block_ids has {len(ids)} blocks; the request's {upto} positions "
                            f"need {need} of block_size={st.block_size} (before each call: "
                            "loop_blocks_needed)")
    temp = check_number("temperature", temperature, 0.0, why="0 = greedy")
    if temp > 0 and st.all_greedy:
        raise ArgumentError(f"temperature={temp}, but the state was built all_greedy (its "
                            "program samples nothing): build it with "
                            "empty_loop_state(..., all_greedy=False)")
    tk = check_int("top_k", top_k, 0, why="0 = off")
    tp = check_number("top_p", top_p, 0.0, 1.0, why="1 = off")
    if tp <= 0:
        raise ArgumentError(f"top_p must be in (0, 1], got {tp}")
    if seed is None:
        sd = int(row_seeds(None, np.asarray([temp], np.float32), 1, 1)[0])
    else:
        sd = check_int("seed", seed, 0, MAX_SEED, why="uint32; None for a fresh random seed")
    if st.history is None and history is not None:
        raise ArgumentError("history given but the state carries no token history (only a "
                            "token-history proposer's state does)")
    hist = None
    if st.history is not None:
        if history is None:
            raise ArgumentError("the state carries the token history (a token-history proposer): "
                                "pass history= (prompt + output, num_computed + 1 tokens)")
        hist = check_int_sequence("history", history, 0)
        if len(hist) != nc + 1:
            raise ArgumentError(f"history has {len(hist)} tokens; the request holds "
                                f"num_computed + 1 = {nc + 1}")
        if hist[-1] != last:
            raise ArgumentError(f"history[-1] = {hist[-1]} is not last_token = {last}")
    words, layout = _row_words(
        st, row, last_token=last, num_computed=nc, drafts=d, max_tokens=mt, stop_ids=stops,
        block_ids=ids, temperature=temp, top_k=tk, top_p=tp, seed=sd, num_output=no,
        history=hist, procs=_check_procs(st, procs))
    return _admit_jit(jax.device_put(st), words, layout)


def release(state: LoopState, rows: Sequence[int]) -> LoopState:
    """``state`` with ``rows`` free: finished (a live request released is dropped: an
    abort), reset to padding (no drafts, the null block in their table row: nothing of
    theirs read or written again) and ``num_reqs`` lowered to the last live row + 1. The state is donated: use the returned one. Jitted: no compile per
    row or call. specjax holds nothing else per request: the caller frees the blocks (and a
    proposer's ``finish_requests``). Raises ValueError / TypeError naming ``rows[i]``."""
    st = _state(state)
    b = st.num_reqs_pad
    rows = check_int_sequence("rows", rows, 0, b - 1)
    mask = np.zeros(b, np.bool_)
    mask[list(rows)] = True
    return _release_jit(jax.device_put(st), mask)


def warmup_loop(step, target_params, draft_params, target_kv, draft_state, buckets, *,
                steps_per_sync: int, max_model_len: int, block_size: int,
                stop_pads: Sequence[int] = (1,), all_greedy: Sequence[bool] = (True,),
                num_logprobs: Sequence[int | None] = (None,),
                procs: Sequence[ProcessorLimits | None] = (None,),
                early_exit: Sequence[bool] = (True,)) -> tuple[Any, Any]:
    """Compile ``decode_loop`` (``steps_per_sync`` iterations), :func:`admit` and
    :func:`release` ahead of time for the :func:`empty_loop_state` of every bucket
    (``Bucket(requests, tokens, blocks)``) and variant (``stop_pads``, ``all_greedy``,
    ``num_logprobs``, ``procs``, ``early_exit``): each loop runs on a state of free rows
    (nothing written, nothing emitted). The caches are donated: returns ``(target_kv,
    draft_state)``. Raises ValueError / TypeError naming a bad argument before any work."""
    resolved = as_buckets(buckets)
    check_int("steps_per_sync", steps_per_sync, 1)
    pads = tuple(check_int(f"stop_pads[{i}]", s, 1)
                 for i, s in enumerate(variants("stop_pads", stop_pads)))
    greedy = variants("all_greedy", all_greedy)
    forms = variants("early_exit", early_exit)
    for name, vals in (("all_greedy", greedy), ("early_exit", forms)):
        for i, v in enumerate(vals):
            if not isinstance(v, (bool, np.bool_)):
                raise ArgumentTypeError(f"{name}[{i}] must be True or False, got {v!r}")
    lps = logprobs_variants(num_logprobs)
    limits = procs_variants(procs, max_model_len)
    combos = list(itertools.product(resolved, pads, greedy, lps, limits))
    states = [empty_loop_state(step, bk, max_model_len=max_model_len, block_size=block_size,
                               stop_pad=s, all_greedy=bool(g), num_logprobs=lp, procs=pl)
              for bk, s, g, lp, pl in combos]            # every argument checked first
    for st in states:
        for ee in forms:
            cur = jax.device_put(st)
            words, layout = _row_words(
                st, 0, last_token=0, num_computed=0, drafts=(), max_tokens=1, stop_ids=(),
                block_ids=(), temperature=0.0, top_k=0, top_p=1.0, seed=0, num_output=0,
                history=() if st.history is not None else None,
                procs=None if st.sampling.procs is None else jax.tree.map(
                    lambda a: np.asarray(a)[:1], st.sampling.procs))
            cur = _release_jit(_admit_jit(cur, words, layout), np.ones(st.num_reqs_pad, np.bool_))
            out, target_kv, draft_state, cur = decode_loop(
                step, target_params, draft_params, target_kv, draft_state, cur,
                steps_per_sync=steps_per_sync, early_exit=bool(ee))
            jax.block_until_ready(out)
    return target_kv, draft_state

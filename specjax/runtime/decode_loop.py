"""The device-resident decode loop: up to ``N`` decoding iterations in ONE jitted program.

``decode_loop`` runs build batch -> forward, verification, device drafting -> stop checks
over a :class:`LoopState` on the device and returns every iteration's tokens at once
(:class:`LoopOutput`): one host sync instead of ``N``. Requests must be decoding (prefill
per step, then ``make_loop_state``, or ``specjax.runtime.loop_rows.admit`` into a kept
state); seeded sampling gives the per-step path's tokens.
Host n-gram, Arctic suffix and the non-padded drafter batch are refused (``loop_support``)."""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax import _compat
from specjax.attention_metadata import CommonAttentionMetadata
from specjax.metadata import SpecDecodeMetadata
from specjax.sampling.logprobs import Logprobs, check_num_logprobs, mask_slots
from specjax.sampling import PLACEHOLDER_TOKEN_ID, SamplingState
from specjax.runtime.checks import check_loop_call, check_table, row_seeds
from specjax.runtime.step import StepBatch, _step, drafting

__all__ = ["LoopState", "LoopOutput", "make_loop_state", "decode_loop", "device_batch",
           "loop_blocks_needed", "loop_cache_size", "loop_support"]

_I32 = np.int32


@dataclasses.dataclass(frozen=True)
class LoopState:
    """What the device loop carries between iterations (a pytree of ``B`` rows, padding
    included; :func:`make_loop_state` builds it).

    Attributes: ``last_token [B]`` (the next query's first token), ``num_computed [B]``
    (``prompt + output - 1``), ``drafts [B, k]`` (-1 padded) and ``num_drafts [B]``,
    ``max_tokens [B]``, ``stop_ids [B, S]`` (EOS included, -1 padded), ``finished [B]``
    (padding True), ``block_table [B, C]``, ``sampling`` (``SamplingState``; ``counters``:
    tokens generated), ``history [B, W]`` (a device token-history proposer's) or None,
    ``num_reqs`` (0-d), ``k_cap [B]`` (drafts each row verifies at most) or None, ``slots
    [B]`` (each row's request slot in a probabilistic drafter's ``DraftProbState``; padding
    rows past it) or None; static: ``all_greedy``, ``max_model_len``, ``block_size``,
    ``query_len_pad``, ``num_logprobs`` (top-n bucket or None), ``drafter_max_model_len``,
    ``draft_len`` (``max(k_cap)``, None: k; what a chain drafter proposes),
    ``num_tokens_pad`` (the step's flat token slots, at least ``sum(1 + k_cap)`` over the
    requests; None: ``B * query_len_pad``)."""

    last_token: Any
    num_computed: Any
    drafts: Any
    num_drafts: Any
    max_tokens: Any
    stop_ids: Any
    finished: Any
    block_table: Any
    sampling: SamplingState
    history: Any
    num_reqs: Any
    k_cap: Any = None
    slots: Any = None
    all_greedy: bool = True
    max_model_len: int = 2048
    block_size: int = 16
    query_len_pad: int = 1
    num_logprobs: int | None = None
    drafter_max_model_len: int | None = None
    draft_len: int | None = None
    num_tokens_pad: int | None = None

    @property
    def num_reqs_pad(self) -> int:
        return int(np.shape(self.last_token)[0])


jax.tree_util.register_dataclass(
    LoopState, data_fields=["last_token", "num_computed", "drafts", "num_drafts", "max_tokens",
                            "stop_ids", "finished", "block_table", "sampling", "history",
                            "num_reqs", "k_cap", "slots"],
    meta_fields=["all_greedy", "max_model_len", "block_size", "query_len_pad", "num_logprobs",
                 "drafter_max_model_len", "draft_len", "num_tokens_pad"])


class LoopOutput(NamedTuple):
    """One call's results (``N = steps_per_sync`` iterations; rows past ``num_iters`` empty).

    tokens: ``[N, B, k+1] int32`` emitted per iteration (-1 padded; nothing after a stop).
    counts: ``[N, B] int32`` (0: the request did not run). num_drafts, num_accepted: ``[N, B]``
    (accepted before any stop cut the tokens, as the per-step loop counts them). finished:
    ``[B] bool`` after the call. num_iters: 0-d. logprobs: ``Logprobs`` with a leading ``[N]``
    axis (slots not emitted: padding), or None. stage_counts: a merging ``history_first``'s
    ``[5] int32`` (first-stage rows, model rows, their draft tokens, iterations whose model
    chain drafted one token), else None."""

    tokens: Any
    counts: Any
    num_drafts: Any
    num_accepted: Any
    finished: Any
    num_iters: Any
    logprobs: Any = None
    stage_counts: Any = None


def loop_blocks_needed(num_computed: int, *, steps_per_sync: int, k: int, lookahead: int,
                       block_size: int, limit: int) -> int:
    """KV blocks a request needs before ``steps_per_sync`` iterations: each computes at most
    ``k + 1`` tokens and the proposer writes ``lookahead`` slots past them; ``limit``: its last
    possible slot + 1 (``min(max_model_len, prompt + max_tokens + lookahead)``)."""
    n = min(num_computed + steps_per_sync * (k + 1) + lookahead, limit)
    return -(-n // block_size)


def make_loop_state(*, last_token: Sequence[int], num_computed: Sequence[int],
                    drafts: Sequence[Sequence[int]], max_tokens: Sequence[int],
                    num_output: Sequence[int], block_ids, k: int, num_reqs_pad: int,
                    blocks_per_req_pad: int, query_len_pad: int, max_model_len: int,
                    block_size: int, stop_ids: Sequence[Sequence[int]] | None = None,
                    stop_pad: int = 1, temperature=None, top_k=None, top_p=None, seeds=None,
                    history: Sequence[Sequence[int]] | None = None, finished=None,
                    procs=None, num_blocks: int | None = None, k_cap=None,
                    num_tokens_pad: int | None = None) -> LoopState:
    """The host (NumPy) :class:`LoopState` of ``n`` decoding requests.

    Per request ``i``: ``last_token``, ``num_computed`` (every token but the last), ``drafts``
    (at most ``k``), ``num_output`` (the sampling counter), ``block_ids`` (ids past
    ``blocks_per_req_pad`` dropped; ids >= 1, 0 being the null block, and below
    ``num_blocks``, the KV pool's size, when given), ``stop_ids`` (EOS included, at least
    ``stop_pad`` columns), ``history`` (prompt + output; a device token-history proposer
    only), ``k_cap`` (None, or the drafts each verifies at most, 0..k), ``num_tokens_pad``
    (None, or the step's token slots: at least ``sum(1 + k_cap)``, at most ``num_reqs_pad *
    query_len_pad``). Sampling defaults:
    greedy, top-k / top-p off. ``seeds``: None or per request an int
    in ``[0, 2**32 - 1]`` or None; a request at ``temperature > 0`` without one draws a fresh
    random seed (not reproducible, as vLLM's unseeded requests; the state keeps it across
    calls). ``procs``: a ``ProcessorState`` of ``num_reqs_pad`` rows and ``max_model_len``
    columns, or None. Raises ValueError naming the argument on mismatched lengths or
    out-of-range values (block 0, a block id past ``num_blocks``, a seed outside uint32)."""
    n = len(last_token)
    b, c, q = int(num_reqs_pad), int(blocks_per_req_pad), int(query_len_pad)
    if n > b:
        raise ValueError(f"{n} requests do not fit num_reqs_pad={b}")
    from specjax.checks import check_opt_int

    caps = None
    if k_cap is not None:
        caps = np.zeros(b, _I32)
        caps[:n] = np.asarray(k_cap, _I32).reshape(n)
        if n and (caps.min() < 0 or caps.max() > k):
            raise ValueError(f"k_cap must hold one value in [0, k={k}] per request, got {k_cap}")
    kq = k if caps is None else int(caps.max(initial=0))
    if q < kq + 1:
        raise ValueError(f"query_len_pad={q} is below the drafts verified + 1 = {kq + 1}")
    if num_tokens_pad is not None:
        need = int(n * (k + 1) if caps is None else (caps[:n] + 1).sum())
        t = check_opt_int("num_tokens_pad", num_tokens_pad, max(need, 1), b * q,
                          why=f"the {n} requests' query tokens ({need}) up to num_reqs_pad x "
                              f"query_len_pad")
        num_tokens_pad = None if t == b * q else t

    num_blocks = check_opt_int("num_blocks", num_blocks, 2, why="block 0 is the null block")

    def ints(name, v, fill, dtype=_I32):
        out = np.full(b, fill, dtype)
        if v is not None:
            a = np.asarray(v)
            if a.shape != (n,):
                raise ValueError(f"{name} must have one entry per request ({n}), got shape {a.shape}")
            out[:n] = a
        return out

    nc = ints("num_computed", num_computed, 0)
    if n and (nc < 0).any():
        raise ValueError("num_computed must be >= 0")
    if n and (nc + 1 >= max_model_len).any():
        i = int(np.argmax(nc + 1 >= max_model_len))
        raise ValueError(f"request {i} already holds {int(nc[i]) + 1} tokens; max_model_len="
                         f"{max_model_len} leaves no room")
    if len(drafts) != n:
        raise ValueError(f"drafts must have one list per request ({n}), got {len(drafts)}")
    dr = np.full((b, k), PLACEHOLDER_TOKEN_ID, _I32)
    nd = np.zeros(b, _I32)
    for i, d in enumerate(drafts):
        if len(d) > (k if caps is None else caps[i]):
            raise ValueError(f"drafts[{i}] has {len(d)} tokens, more than "
                             f"{'k' if caps is None else 'k_cap'}={k if caps is None else caps[i]}")
        dr[i, : len(d)] = d
        nd[i] = len(d)
    stops = [] if stop_ids is None else [list(s) for s in stop_ids]
    if stop_ids is not None and len(stops) != n:
        raise ValueError(f"stop_ids must have one list per request ({n}), got {len(stops)}")
    s_pad = max([int(stop_pad), 1] + [len(s) for s in stops])
    st = np.full((b, s_pad), -1, _I32)
    for i, s in enumerate(stops):
        st[i, : len(s)] = s
    table = np.zeros((b, c), _I32)
    if len(block_ids) != n:
        raise ValueError(f"block_ids must have one list per request ({n}), got {len(block_ids)}")
    filled = np.zeros(n, np.int64)
    for i, ids in enumerate(block_ids):
        m = filled[i] = min(len(ids), c)
        upto = min(int(nc[i]) + 1 + int(nd[i]), int(max_model_len))
        if -(-upto // block_size) > m:
            raise ValueError(f"block_ids[{i}] ({len(ids)} blocks, {c} columns) does not cover "
                             f"the request's {upto} next positions")
        table[i, :m] = np.asarray(ids[:m])
    check_table(table, filled, num_blocks)
    fin = np.ones(b, np.bool_)
    fin[:n] = False if finished is None else np.asarray(finished, np.bool_)
    temp = ints("temperature", temperature, 0.0, np.float32)
    if (temp < 0).any() or not np.isfinite(temp).all():
        raise ValueError("temperature must be finite and >= 0 (0 = greedy)")
    if procs is not None:
        if np.shape(procs.token_ids) != (b, int(max_model_len)):
            raise ValueError(f"procs.token_ids must be [num_reqs_pad={b}, max_model_len="
                             f"{max_model_len}], got {np.shape(procs.token_ids)}")
        if n and (np.asarray(procs.num_tokens)[:n] != nc[:n] + 1).any():
            raise ValueError("procs.num_tokens must be each request's num_computed + 1")
    sampling = SamplingState(temp, ints("top_k", top_k, 0), ints("top_p", top_p, 1.0, np.float32),
                             row_seeds(seeds, temp, n, b), ints("num_output", num_output, 0),
                             procs)
    hist = None
    if history is not None:
        if len(history) != n:
            raise ValueError(f"history must have one list per request ({n}), got {len(history)}")
        hist = np.zeros((b, int(max_model_len)), _I32)
        for i, h in enumerate(history):
            if len(h) != int(nc[i]) + 1:
                raise ValueError(f"history[{i}] has {len(h)} tokens; the request holds "
                                 f"num_computed + 1 = {int(nc[i]) + 1}")
            hist[i, : len(h)] = h
    return LoopState(
        last_token=ints("last_token", last_token, 0), num_computed=nc, drafts=dr, num_drafts=nd,
        max_tokens=ints("max_tokens", max_tokens, 1), stop_ids=st, finished=fin,
        block_table=table, sampling=sampling, history=hist, num_reqs=np.asarray(n, _I32),
        k_cap=caps, all_greedy=bool((temp[:n] == 0).all()), max_model_len=int(max_model_len),
        block_size=int(block_size), query_len_pad=q, draft_len=None if caps is None or kq >= k else kq,
        num_tokens_pad=num_tokens_pad)


def _row_of(cu, idx):
    """Row of each flat index ``idx`` given the inclusive cumsum ``cu`` of row lengths."""
    b = cu.shape[0]
    return jnp.minimum(jnp.sum(cu[None, :] <= idx[:, None], axis=1, dtype=jnp.int32), b - 1)


def device_batch(st: LoopState, *, k: int, vocab_size: int, tree=None) -> tuple[StepBatch, Any]:
    """The next iteration's :class:`StepBatch` from the loop state, on the device
    (traceable): what ``build_batch`` builds on the host for the same requests, drafts trimmed
    by ``trim_drafts``' rule. ``tree``: a tree-verification batch. Finished rows stay with
    their last token, no drafts and no KV writes. Returns ``(batch, num_drafts [B])``."""
    b = st.last_token.shape[0]
    qp = st.query_len_pad
    t_pad = b * qp if st.num_tokens_pad is None else st.num_tokens_pad
    rows = jnp.arange(b, dtype=jnp.int32)
    real = rows < st.num_reqs
    active = real & ~st.finished
    nc = st.num_computed
    nt = nc + 1
    kv_room = st.max_model_len - nt
    room = jnp.minimum(kv_room, st.max_tokens - st.sampling.counters) - 1
    if k:
        ok = (st.drafts >= 0) & (st.drafts < vocab_size)
        first_bad = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1, dtype=jnp.int32)
        if tree is None:
            lim = jnp.clip(room, 0, k)
        else:   # nodes of the first `levels` levels (trim_drafts' rule)
            lut = jnp.asarray((0,) + tuple(tree.cu_level_sizes), jnp.int32)
            lim = jnp.clip(jnp.minimum(lut[jnp.clip(room, 0, tree.depth)], kv_room), 0, k)
        nd = jnp.minimum(jnp.minimum(st.num_drafts, lim), first_bad)
        if st.k_cap is not None:
            nd = jnp.minimum(nd, st.k_cap)
        if st.drafter_max_model_len is not None:    # trim_drafts' drafter_room rule
            depth = k if tree is None else tree.depth
            nd = jnp.where(nt + depth <= st.drafter_max_model_len, nd, 0)
    else:
        nd = jnp.zeros((b,), jnp.int32)
    nd = jnp.where(active, nd, 0).astype(jnp.int32)
    q = jnp.where(real, 1 + nd, 0).astype(jnp.int32)
    cu_q = jnp.cumsum(q).astype(jnp.int32)
    qsl = jnp.concatenate([jnp.zeros((1,), jnp.int32), cu_q])
    total = qsl[-1]
    t = jnp.arange(t_pad, dtype=jnp.int32)
    r_t = _row_of(cu_q, t)
    i_t = t - qsl[r_t]
    valid = t < total
    tok = st.last_token[r_t]
    if k:
        tok = jnp.where(i_t == 0, tok, st.drafts[r_t, jnp.clip(i_t - 1, 0, k - 1)])
    ids = jnp.where(valid, tok, 0).astype(jnp.int32)
    offs = i_t if tree is None else jnp.asarray((0,) + tuple(tree.depths), jnp.int32)[
        jnp.clip(i_t, 0, k)]
    pos = jnp.where(valid, nc[r_t] + offs, 0).astype(jnp.int32)
    kv_pos = nc[r_t] + i_t           # a tree node j's KV sits at root + 1 + j
    table = jnp.where(real[:, None], st.block_table, 0).astype(jnp.int32)
    bs, c = st.block_size, table.shape[1]
    blk = table[r_t, jnp.clip(kv_pos // bs, 0, c - 1)]
    slots = jnp.where(valid & active[r_t], blk * bs + kv_pos % bs, -1).astype(jnp.int32)
    seq = jnp.where(real, nc + q, 0).astype(jnp.int32)
    attn = CommonAttentionMetadata(
        query_start_loc=qsl, seq_lens=seq, block_table=table, slot_mapping=slots,
        num_reqs=jnp.asarray(st.num_reqs, jnp.int32), num_actual_tokens=total,
        max_seq_len=jnp.max(seq).astype(jnp.int32), max_query_len=qp, causal=True,
        tree_mask=None if tree is None else tree.ancestor_mask(with_root=True))
    # SpecDecodeMetadata (specjax.runtime.batch._spec_metadata's layout)
    cu_d = jnp.cumsum(nd).astype(jnp.int32)
    cu_s = jnp.cumsum(jnp.where(real, nd + 1, 0)).astype(jnp.int32)
    if k:
        j = jnp.arange(b * k, dtype=jnp.int32)
        r_j = _row_of(cu_d, j)
        off = j - (cu_d[r_j] - nd[r_j])
        has = j < cu_d[-1]
        draft_ids = jnp.where(has, st.drafts[r_j, jnp.clip(off, 0, k - 1)], -1).astype(jnp.int32)
        target_idx = jnp.where(has, cu_s[r_j] - nd[r_j] - 1 + off, 0).astype(jnp.int32)
    else:
        draft_ids = target_idx = jnp.zeros((0,), jnp.int32)
    m = jnp.arange(b * (k + 1), dtype=jnp.int32)
    r_m = _row_of(cu_s, m)
    off_m = m - (cu_s[r_m] - nd[r_m] - 1)
    logits_idx = jnp.where(m < cu_s[-1], cu_q[r_m] - nd[r_m] - 1 + off_m, 0).astype(jnp.int32)
    sdm = SpecDecodeMetadata(
        draft_token_ids=draft_ids, num_draft_tokens=nd, cu_num_draft_tokens=cu_d,
        cu_num_sampled_tokens=cu_s, target_logits_indices=target_idx,
        bonus_logits_indices=jnp.where(real, cu_s - 1, 0).astype(jnp.int32),
        logits_indices=logits_idx, num_reqs=jnp.asarray(st.num_reqs, jnp.int32), max_spec_len=k)
    s = st.sampling
    batch = StepBatch(
        input_ids=ids, positions=pos, attn=attn, sdm=sdm, temperature=s.temperature,
        top_k=s.top_k, top_p=s.top_p, seeds=s.seeds, counters=s.counters,
        backup_next=jnp.where(real, st.last_token, 0).astype(jnp.int32),
        discard=jnp.zeros((b,), jnp.bool_), procs=s.procs, all_greedy=st.all_greedy,
        block_size=bs, num_logprobs=st.num_logprobs, slots=st.slots)
    return batch, nd


def _commit(st: LoopState, sampled, k: int):
    """Stop checks and the state update after one iteration (traceable). Returns
    ``(emitted [B, k+1], emit [B], num_accepted [B], new finished, last, num_computed)``."""
    b = sampled.shape[0]
    real = jnp.arange(b, dtype=jnp.int32) < st.num_reqs
    active = real & ~st.finished
    n_new = jnp.sum(sampled != PLACEHOLDER_TOKEN_ID, axis=1, dtype=jnp.int32)
    n_acc = jnp.where(active, jnp.maximum(n_new - 1, 0), 0)
    jj = jnp.arange(k + 1, dtype=jnp.int32)[None, :]
    valid = jj < n_new[:, None]
    is_stop = jnp.any((sampled[:, :, None] == st.stop_ids[:, None, :])
                      & (st.stop_ids[:, None, :] >= 0), axis=-1)
    nt = st.num_computed + 1
    length = ((st.sampling.counters[:, None] + jj + 1 >= st.max_tokens[:, None])
              | (nt[:, None] + jj + 1 >= st.max_model_len))
    hit = valid & (is_stop | length)
    any_hit = jnp.any(hit, axis=1)
    emit = jnp.where(active, jnp.where(any_hit, jnp.argmax(hit, axis=1) + 1, n_new), 0)
    emit = emit.astype(jnp.int32)
    emitted = jnp.where(jj < emit[:, None], sampled, PLACEHOLDER_TOKEN_ID)
    finished = st.finished | (active & any_hit)
    last = jnp.where(active, jnp.take_along_axis(sampled, n_acc[:, None], axis=1)[:, 0],
                     st.last_token)
    nc = jnp.where(active, st.num_computed + 1 + n_acc, st.num_computed)
    return emitted, emit, n_acc, finished, last, nc


def conditionals_on_device() -> bool:
    """Whether a ``lax.cond`` in the device loop skips a host read of its predicate: off
    GPU, or with ``WHILE`` and ``CONDITIONAL`` in ``--xla_gpu_enable_command_buffer``."""
    if jax.default_backend() != "gpu":
        return True
    m = re.search(r"--xla_gpu_enable_command_buffer=(\S*)", os.environ.get("XLA_FLAGS", ""))
    kinds = {k.strip().lstrip("+").upper() for k in m.group(1).split(",")} if m else set()
    return {"WHILE", "CONDITIONAL"} <= kinds


def _loop(spec, n_iters: int, drafter, merge: bool, early_exit: bool, tparams, dparams,
          target_kv, draft_state, st: LoopState, stop_on_finish, drafter_state=None):
    k = spec.k
    b = st.last_token.shape[0]
    real = jnp.arange(b, dtype=jnp.int32) < st.num_reqs
    fin0 = st.finished
    # history_first: a step whose rows all draft from the history runs a 1-token model chain
    shortens = (merge and spec.tree is None and spec.drafts_in == "step"
                and drafting(spec, 1) is not spec and conditionals_on_device())
    rec = (jnp.full((n_iters, b, k + 1), PLACEHOLDER_TOKEN_ID, jnp.int32),
           jnp.zeros((n_iters, b), jnp.int32), jnp.zeros((n_iters, b), jnp.int32),
           jnp.zeros((n_iters, b), jnp.int32))
    if st.num_logprobs is not None:
        m = st.num_logprobs + 1
        rec = rec + (Logprobs(jnp.full((n_iters, b, k + 1, m), -1, jnp.int32),
                              jnp.full((n_iters, b, k + 1, m), -jnp.inf, jnp.float32),
                              jnp.full((n_iters, b, k + 1), -1, jnp.int32)),)

    def go(st):
        alive = jnp.any(real & ~st.finished)
        newly = jnp.any(st.finished & ~fin0)
        return alive & ~(stop_on_finish & newly)

    def cond(carry):
        return (carry[0] < n_iters) & go(carry[2])

    def body(carry):
        i, n_run, st, tkv, dstate, (toks, cnts, nds, accs, *lps), stage = carry
        # fixed trip count: once the loop should have ended, every row sits the remaining
        # iterations out (no target KV written, nothing emitted, the state kept)
        halt = jnp.zeros((), jnp.bool_) if early_exit else ~go(st)
        view = dataclasses.replace(st, finished=st.finished | halt)
        batch, nd = device_batch(view, k=k, vocab_size=spec.vocab_size, tree=spec.tree)

        def settle(sampled):   # commit, history, first-stage drafts; all rows drafted by it?
            emitted, emit, n_acc, finished, last, nc = _commit(view, sampled, k)
            finished = jnp.where(halt, st.finished, finished)
            active = real & ~view.finished
            hist, d = st.history, None
            if drafter is not None:
                w = hist.shape[1]
                jj = jnp.arange(k + 1, dtype=jnp.int32)[None, :]
                col = jnp.where(jj < emit[:, None], st.num_computed[:, None] + 1 + jj, w)
                rows = jnp.broadcast_to(jnp.arange(b, dtype=jnp.int32)[:, None], col.shape)
                hist = hist.at[rows, col].set(emitted, mode="drop")
                d = (drafter.search(hist, nc + 1, real & ~finished) if drafter_state is None
                     else drafter.draft(drafter_state, hist, nc + 1, real & ~finished))
            short = jnp.all(~(active & ~finished) | (d.num_drafts > 0)) if merge else None
            return short, (emitted, emit, n_acc, finished, active, last, nc, hist, d, short)

        if shortens:
            out, tkv, dstate, settled = _step(spec, tparams, dparams, tkv, dstate, batch, settle)
        else:
            out, tkv, dstate, _ = _step(spec, tparams, dparams, tkv, dstate, batch)
            settled = settle(out.sampled)[1]
        emitted, emit, n_acc, finished, active, last, nc, hist, d, short = settled
        if drafter is not None:
            drafts, num_drafts = d.token_ids.astype(jnp.int32), d.num_drafts.astype(jnp.int32)
            if merge:       # history_first: the history's chain where it drafts, else the model's
                use = num_drafts > 0
                drafts = jnp.where(use[:, None], drafts[:, : out.drafts.shape[1]], out.drafts)
                num_drafts = jnp.where(use, num_drafts, out.num_drafts)
                alive = (active & ~finished).astype(jnp.int32)
                short = short & jnp.any(active) & shortens
                stage = stage + jnp.stack([jnp.sum(alive * use), jnp.sum(alive * ~use),
                                           jnp.sum(alive * use * num_drafts),
                                           jnp.sum(alive * ~use * num_drafts),
                                           short.astype(jnp.int32)])
        elif k:
            drafts, num_drafts = out.drafts, out.num_drafts
        else:
            drafts, num_drafts = st.drafts, st.num_drafts
        drafts = jnp.where(active[:, None], drafts, st.drafts)
        num_drafts = jnp.where(active, num_drafts, st.num_drafts)
        st = dataclasses.replace(st, last_token=last, num_computed=nc, drafts=drafts,
                                 num_drafts=num_drafts, finished=finished,
                                 sampling=st.sampling.advance(emit, emitted), history=hist)
        rec = (toks.at[i].set(emitted), cnts.at[i].set(emit), nds.at[i].set(nd),
               accs.at[i].set(n_acc))
        if lps:
            lp = mask_slots(out.logprobs, emitted != PLACEHOLDER_TOKEN_ID)
            rec = rec + (jax.tree.map(lambda a, x: a.at[i].set(x), lps[0], lp),)
        return i + 1, n_run + (~halt).astype(jnp.int32), st, tkv, dstate, rec, stage

    zero = jnp.zeros((), jnp.int32)
    carry = (zero, zero, st, target_kv, draft_state, rec,
             jnp.zeros(5, jnp.int32) if merge else None)
    if early_exit:
        carry = jax.lax.while_loop(cond, body, carry)
    else:   # a known trip count: no predicate read back to the host per iteration
        carry = jax.lax.fori_loop(0, n_iters, lambda _, c: body(c), carry)
    _, n_run, st, target_kv, draft_state, (toks, cnts, nds, accs, *lps), stage = carry
    return (LoopOutput(toks, cnts, nds, accs, st.finished, n_run, lps[0] if lps else None,
                       stage),
            target_kv, draft_state, st)


_loop_jit = jax.jit(_loop, static_argnums=(0, 1, 2, 3, 4), donate_argnums=(7, 8, 9))


def loop_cache_size() -> int:
    """Number of compiled variants of the device loop (for recompilation checks)."""
    return _loop_jit._cache_size()


def loop_history(step) -> bool:
    """Whether the device loop keeps token histories: a history proposer or a merging
    ``history_first``."""
    feed = step.feed
    return feed is not None and (feed.drafts_in == "history" or getattr(
        step.proposer, "loop_drafter", None) is not None)


def loop_support(step) -> str | None:
    """None when ``step`` (a ``specjax.runtime.step.Step``) can run in the device loop, else the
    reason (naming the proposer's method / option)."""
    feed, prop = step.feed, step.proposer
    if feed is None:
        return None
    method = getattr(prop, "method", "?")
    if getattr(getattr(prop, "config", None), "enable_adaptive_verification", False):
        return ("enable_adaptive_verification=True admits each step's drafts on the host "
                "(use steps_per_sync=1)")
    if getattr(prop, "first_stage", None) is not None and prop.loop_drafter is None:
        return (f"history_first={prop.config.history_first!r} redrafts each step's rows on the "
                f"host after the step; the device loop merges only a chain with ngram_gpu or "
                f"the device suffix (use steps_per_sync=1)")
    if feed.drafts_in == "split":
        return (f"disable_padded_drafter_batch=True (method={method!r}) drafts after the host's "
                f"prepare_inputs; the device loop needs the padded drafter batch (use "
                f"steps_per_sync=1)")
    if feed.drafts_in == "history" and getattr(prop, "device_drafter", None) is None:
        return (f"method={method!r} drafts on the host from the token history; only device "
                f"proposers (and ngram_gpu, suffix_backend='device') run in the device loop (use "
                f"steps_per_sync=1)")
    return None


def decode_loop(step, target_params, draft_params, target_kv, draft_state, state: LoopState, *,
                steps_per_sync: int, stop_on_finish: bool = False, early_exit: bool = True,
                drafter_state: Any = None) -> tuple[LoopOutput, Any, Any, LoopState]:
    """Up to ``steps_per_sync`` decoding iterations of ``step`` on the device in one call;
    ``target_kv``, ``draft_state`` and ``state`` are donated. Returns ``(LoopOutput, target_kv,
    draft_state, state)``; the state continues the loop once the requests hold
    ``loop_blocks_needed`` blocks. ``stop_on_finish``: end once a request finishes.
    ``early_exit``: True, a ``while_loop``; False, exactly ``steps_per_sync`` iterations (no
    predicate read back), those after the end masked; same tokens. ``drafter_state``: a
    stateful device history drafter's state (``proposer.device_drafter_state``, e.g. the
    suffix corpus), read, not changed, by every iteration. Raises ValueError, before
    anything runs, for a proposer the loop does not run, a state of another ``k`` / block
    size, a bad ``steps_per_sync``, and ``Step.__call__``'s argument checks: caches or state
    donated to an earlier call, params missing or not the step's, a host state's block id past
    the KV pool or last token outside the vocabulary."""
    if isinstance(steps_per_sync, bool) or not isinstance(steps_per_sync, (int, np.integer)) \
            or steps_per_sync < 1:
        raise ValueError(f"steps_per_sync must be an int >= 1, got {steps_per_sync!r}")
    why = loop_support(step)
    if why is not None:
        raise ValueError(why)
    if not isinstance(state, LoopState):
        raise ValueError(f"state must be a LoopState (specjax.runtime.decode_loop.make_loop_state), got "
                         f"{type(state).__name__}")
    if step._spec.draft_sampling and state.slots is None:
        raise ValueError("draft_sample_method='probabilistic' keeps draft probabilities per "
                         "request slot: give the LoopState slots ([B] int32, padding rows past "
                         "the step's max_num_seqs)")
    if np.shape(state.drafts)[1] != step.k:
        raise ValueError(f"state was built for k={np.shape(state.drafts)[1]}; the step verifies "
                         f"k={step.k}")
    feed = step.feed
    if feed is not None and feed.block_size not in (None, state.block_size):
        raise ValueError(f"state was built with block_size={state.block_size}; the proposer uses "
                         f"{feed.block_size}")
    if feed is not None and feed.max_model_len not in (None, state.max_model_len):
        raise ValueError(f"state was built with max_model_len={state.max_model_len}; the proposer "
                         f"uses {feed.max_model_len}")
    drafter = None
    merge = getattr(step.proposer, "loop_drafter", None) is not None      # history_first
    if feed is not None and (feed.drafts_in == "history" or merge):
        drafter = step.proposer.loop_drafter if merge else step.proposer.device_drafter
        if getattr(drafter, "stateful", False) and drafter_state is None:
            raise ValueError(f"method={step.proposer.method!r} drafts from a device state: give "
                             "decode_loop(..., drafter_state=proposer.device_drafter_state)")
        if state.history is None:
            raise ValueError("this proposer drafts from the token history: build the state with "
                             "make_loop_state(history=...)")
    check_num_logprobs("state.num_logprobs", state.num_logprobs)
    check_loop_call(step, target_params, draft_params, target_kv, draft_state, state)
    limit = None if feed is None else feed.drafter_max_model_len
    if state.drafter_max_model_len != limit:
        state = dataclasses.replace(state, drafter_max_model_len=limit)
    spec = drafting(step._spec, state.draft_len)
    dparams = draft_params if spec.impl is not None else None
    if early_exit not in (True, False):
        raise ValueError(f"early_exit must be True or False, got {early_exit!r}")
    # one kind of input whether the state comes from the host (NumPy) or from the previous
    # call (device arrays, e.g. overlapped): the compiled variant is keyed on both
    state = jax.device_put(state)
    with _compat.use_mesh(getattr(step, "mesh", None)):     # read by MoE experts
        return _loop_jit(spec, int(steps_per_sync), drafter, merge, bool(early_exit),
                         target_params, dparams, target_kv, draft_state, state,
                         jnp.asarray(bool(stop_on_finish)),
                         drafter_state if getattr(drafter, "stateful", False) else None)

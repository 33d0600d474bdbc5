"""The engine's decoding phase on the device loop (``DeviceLoopDriver``, owned by ``Engine``):
the loop state from the host's requests, a ``decode_loop`` dispatch, the commit of its
iterations (``CommitRule.loop``), and overlap: call ``t + 1`` is dispatched from call
``t``'s device state before the host commits ``t`` (blocks given two calls ahead; a
request finished in ``t`` sits ``t + 1`` out; a finish drains the pipeline). The same
tokens either way: a request's key depends on its own generated count only."""

from __future__ import annotations

import dataclasses
import functools
import time
import weakref
from typing import Any, NamedTuple

import jax
import numpy as np

from specjax.adaptive_k import acceptance_rate, choose_caps
from specjax.constants import next_power_of_2
from specjax.engine.scheduler import _Request
from specjax.metrics import SpecDecodingStats
from specjax.runtime.decode_loop import decode_loop, loop_cache_size, loop_history, make_loop_state
from specjax.sampling.logprobs import logprobs_bucket

_I32 = np.int32


def _on_cpu(params) -> bool:
    """Whether the target's params live on CPU devices (JAX's default backend for host
    arrays)."""
    leaf = next(iter(jax.tree.leaves(params)), None)
    if isinstance(leaf, jax.Array):
        return all(d.platform == "cpu" for d in leaf.devices())
    return jax.default_backend() == "cpu"


class RowCaps(NamedTuple):
    """``adaptive_k``'s choice for a device-loop call: the drafter's chain ``k``, the step's
    flat token slots ``tokens`` (None: rows of ``k + 1`` tokens) and each request's drafts
    ``caps`` (None: ``min(k, its own cap)``)."""

    k: int
    tokens: int | None = None
    caps: tuple[int, ...] | None = None


class _InFlight(NamedTuple):
    """A dispatched device-loop call: its rows (the running requests at dispatch, in row
    order) and its device results (copies to the host started)."""

    rows: list
    out: Any
    state: Any
    t_dispatch: float
    k: RowCaps | None = None    # adaptive_k's choice for this call (None: off)
    cost_key: tuple | None = None   # (chain K, token slots or None) it ran; None: not timed


Results = list[tuple[SpecDecodingStats | None, list[_Request]]]


class DeviceLoopDriver:
    """``engine``'s decoding phase through ``decode_loop`` (held weakly: the engine owns
    the driver). Reads ``engine.options`` per call; updates its caches and counters."""

    def __init__(self, engine) -> None:
        self._e = weakref.proxy(engine)
        self.k_policy: RowCaps | None = None     # adaptive_k's choice of the last loop_state
        #: seconds an iteration of each choice ``(K, T or None)`` took in this engine's own
        #: calls, per batch bucket (an average of the recent ones): ``adaptive_k`` weighs
        #: these over the profiled costs, which run padding rows only
        self.seen_costs: dict[int, dict[tuple[int, int | None], float]] = {}
        #: the tables ``profile_k_costs`` made per bucket (``k_costs``, ``k_token_costs``):
        #: seen times replace these only, never a table set by hand
        self.profiled: dict[int, tuple] = {}
        self._done: float | None = None          # when the last committed call's results came

    @functools.cached_property
    def idle_early_exit(self) -> bool:
        """The form of a call made while no request waits, under ``early_exit=None``: the
        fixed trip count (False) except on a CPU target (True), where XLA evaluates the
        predicate on the host anyway and each masked iteration costs a whole step."""
        return _on_cpu(self._e.target.params)

    def forms(self) -> tuple[bool, ...]:
        """The loop forms (``early_exit`` values) this engine runs."""
        ee = self._e.options.early_exit
        if ee is not None:
            return (ee,)
        return (True,) if self.idle_early_exit else (False, True)

    def loop_state(self, running: list[_Request], ahead: int = 1):
        """Blocks for ``ahead`` calls, then the device loop's state (NumPy)."""
        e, sched = self._e, self._e.scheduler
        for r in running:
            if not sched.loop_blocks(r, ahead * e.options.steps_per_sync):
                raise RuntimeError("the KV pool cannot hold this device-loop call: the engine "
                                   "reserves its blocks first (Scheduler.reserve_loop)")
        self.k_policy = self.policy(running)
        caps, tokens = self._caps(running, self.k_policy)
        B, Q, C = sched.buckets(len(running), max(caps) + 1, max(len(r.blocks) for r in running),
                                max(caps))
        hist = ([sched.tok_buf[r.row, : r.num_tokens] for r in running]
                if loop_history(e.step) else None)
        state = make_loop_state(
            last_token=[r.token(r.num_tokens - 1) for r in running],
            num_computed=[r.num_computed for r in running],
            drafts=[r.drafts[:c] for r, c in zip(running, caps)],
            k_cap=None if min(caps) == e.k and tokens is None else caps, num_tokens_pad=tokens,
            max_tokens=[r.params.max_tokens for r in running],
            num_output=[len(r.output) for r in running], block_ids=[r.blocks for r in running],
            k=e.k, num_reqs_pad=B, blocks_per_req_pad=C, query_len_pad=Q,
            max_model_len=e.max_model_len, block_size=e.block_size,
            stop_ids=[sorted(r.stop_ids) for r in running],
            stop_pad=next_power_of_2(max([1] + [len(r.stop_ids) for r in running])),
            temperature=[r.params.temperature for r in running],
            top_k=[r.params.top_k for r in running], top_p=[r.params.top_p for r in running],
            seeds=[r.seed for r in running], history=hist, procs=sched.procs(running, B))
        return dataclasses.replace(state, num_logprobs=logprobs_bucket(
            [r.params.logprobs for r in running]), slots=sched.slot_rows([r.row for r in running], B))

    def policy(self, rows: list[_Request]) -> RowCaps | None:
        """``adaptive_k``'s choice for a call over ``rows`` (None: off):
        :func:`~specjax.adaptive_k.choose_caps` over :meth:`priced`'s options."""
        e = self._e
        if not e.options.adaptive_k or e.k == 0 or not rows:
            return None
        kk, t, c = choose_caps(*self.priced(rows))
        return RowCaps(kk) if t is None else RowCaps(kk, t, tuple(int(x) for x in c))

    def priced(self, rows: list[_Request]) -> tuple[np.ndarray, np.ndarray, list]:
        """``adaptive_k``'s inputs for ``rows``: acceptance estimates ``[n]``, caps ``[n]``,
        options ``(K, T or None, s)`` (``Engine.k_costs`` / ``k_token_costs``; own profile: at
        ``seen_costs``, else profiled x median seen / profiled of its kind x (1 - EXPLORE))."""
        e = self._e
        cost = e._costs(len(rows))
        b = e.scheduler.buckets(len(rows), 1, 1)[0]
        options = [(kk, None, float(cost[kk])) for kk in range(e.k + 1)] + [
            (kk, t, c) for (kk, t), c in sorted(e.k_token_costs.get(b, {}).items())]
        caps = np.array([e.k_for(r, len(rows)) for r in rows])
        rates = acceptance_rate(np.array([r.acc_hits for r in rows]),
                                np.array([r.acc_trials for r in rows]))
        seen = self.seen_costs.get(b, {})
        rect, flat = self.profiled.get(b, (None, None))
        ours = (rect is not None and rect is e.k_costs.get(b),    # (not replaced by hand)
                flat is not None and flat is e.k_token_costs.get(b))
        # the profile's bias, read off the choices run: their own times over their profiled
        # ones (median per kind, rectangle or flat; else over both), applied to the profiled
        # costs of the choices not run yet
        ratios: dict[bool, list[float]] = {False: [], True: []}
        for kk, t, c in options:
            if ours[t is not None] and (kk, t) in seen and c > 0:
                ratios[t is not None].append(seen[kk, t] / c)
        both = ratios[False] + ratios[True]
        scale = {f: float(np.median(ratios[f] or both)) if both else 1.0 for f in ratios}
        options = [(kk, t, seen.get((kk, t), c * scale[t is not None] * (1 - self.EXPLORE))
                    if ours[t is not None] else c) for kk, t, c in options]
        return rates, caps, options

    #: the weight of a call's own time in ``seen_costs`` (the rest: the previous average)
    SEEN_WEIGHT = 0.5
    #: the discount on a choice not run yet: the profile's bias differs between choices
    #: (docs/adaptive_k.md), so one priced within this of the best is tried for a call,
    #: then priced at its own time
    EXPLORE = 0.05

    def observe_cost(self, f: _InFlight, t_done: float, iters: int) -> None:
        """Fold call ``f``'s seconds an iteration into ``seen_costs``: from its dispatch, or
        from the previous call's results when it was queued behind that call (overlap),
        to ``t_done``, its results' arrival. Calls that compiled or ran no iteration are
        left out."""
        start = f.t_dispatch if self._done is None else max(f.t_dispatch, self._done)
        self._done = t_done
        if f.cost_key is None or iters <= 0:
            return
        per = (t_done - start) / iters
        table = self.seen_costs.setdefault(self._e.scheduler.buckets(len(f.rows), 1, 1)[0], {})
        old = table.get(f.cost_key)
        table[f.cost_key] = per if old is None else (
            self.SEEN_WEIGHT * per + (1 - self.SEEN_WEIGHT) * old)

    def token_options(self, b: int, kk: int) -> list[int]:
        """The flat token slots ``adaptive_k`` may give a device-loop step of batch bucket
        ``b`` drafting ``kk >= 1`` (compiled and profiled beside its rows of ``kk + 1``):
        each token bucket (``LoopOptions.token_buckets``; None: powers of two) above ``b``
        and below those rows' ``b x Q``."""
        sched = self._e.scheduler
        if kk == 0:
            return []
        full = b * sched.buckets(b, kk + 1, 1, kk)[1]
        ts = (sched.token_buckets if sched.token_buckets is not None
              else [1 << i for i in range(full.bit_length())])
        return [t for t in ts if max(b, sched.min_tokens_per_step - 1) < t < full]

    def _caps(self, rows: list[_Request], pol: RowCaps | None) -> tuple[list[int], int | None]:
        """Each row's drafts and the step's token slots under ``pol`` (None: the rows of the
        largest cap's bucket), slots that would cover those rows dropped."""
        e = self._e
        e._k_now = None if pol is None else pol.k
        caps = [e.k_for(r, len(rows)) for r in rows]
        e._k_now = None
        if pol is None or pol.caps is None:
            return caps, None
        caps = [min(c, p) for c, p in zip(caps, pol.caps)]
        q = e.scheduler.buckets(len(rows), max(caps) + 1, 1, max(caps))[1]
        b = e.scheduler.buckets(len(rows), 1, 1)[0]
        return caps, (None if pol.tokens >= b * q else pol.tokens)

    def recap(self, rows: list[_Request], state, pol: RowCaps):
        """``state`` continued under ``adaptive_k``'s new choice: caps, token bucket and
        slots, chain length as :meth:`loop_state` sets them (drafts made under the old one
        are trimmed or fall short: lossless)."""
        e = self._e
        caps, tokens = self._caps(rows, pol)
        _, q, _ = e.scheduler.buckets(len(rows), max(caps) + 1, 1, max(caps))
        kc = np.zeros(state.num_reqs_pad, _I32)
        kc[: len(caps)] = caps
        full = min(caps) == e.k and tokens is None
        return dataclasses.replace(state, k_cap=None if full else kc, query_len_pad=q,
                                   draft_len=None if max(caps) >= e.k else max(caps),
                                   num_tokens_pad=tokens)

    def dispatch(self, rows: list[_Request], state, stop_on_finish: bool,
                 prev_k: RowCaps | None = None) -> _InFlight:
        """Dispatch one call (not waiting for it). ``state``: the previous call's device
        state to continue from (its block table refreshed for blocks two calls ahead), or
        None to build it from the host's requests."""
        e, sched = self._e, self._e.scheduler
        n = e.options.steps_per_sync
        t = time.perf_counter()
        if state is None:
            state = self.loop_state(rows)
            k = self.k_policy
        else:
            k = prev_k
            _, _, C = sched.buckets(len(rows), e.k + 1, max(len(r.blocks) for r in rows))
            table = np.zeros((state.num_reqs_pad, C), _I32)
            for i, r in enumerate(rows):
                m = min(len(r.blocks), C)
                table[i, :m] = r.blocks[:m]
            state = dataclasses.replace(state, block_table=table)
            if e.options.adaptive_k and (nk := self.policy(rows)) != k:
                k, state = nk, self.recap(rows, state, nk)
        ee = e.options.early_exit
        compiled = None if k is None else loop_cache_size()      # (timed under adaptive_k)
        ran = (e.k if state.draft_len is None else state.draft_len, state.num_tokens_pad)
        out, e.target_kv, e.draft_state, state = decode_loop(
            e.step, e.target.params, e.step.draft_params, e.target_kv, e.draft_state, state,
            steps_per_sync=n, stop_on_finish=stop_on_finish,
            early_exit=(stop_on_finish or self.idle_early_exit) if ee is None else ee,
            drafter_state=getattr(e.proposer, "device_drafter_state", None))
        for x in jax.tree.leaves(out):      # the next call may donate the state: not its drafts
            x.copy_to_host_async()
        e.host_s += time.perf_counter() - t
        key = None if k is None or loop_cache_size() != compiled else ran    # the program run
        return _InFlight(list(rows), out, state, t, k, key)

    def commit(self, f: _InFlight, last: bool = True) -> Results:
        """Wait for a dispatched call and commit its iterations (``CommitRule.loop``).
        ``last``: no call continues from its state, so the host takes the drafts (else the
        next call carries them). One ``(stats, finished)`` per iteration run."""
        e = self._e
        t = time.perf_counter()
        out = jax.device_get(f.out)
        if last:
            drafts, num_drafts = jax.device_get((f.state.drafts, f.state.num_drafts))
        t1 = time.perf_counter()
        e.wait_s += t1 - t
        if e.options.adaptive_k:
            self.observe_cost(f, t1, int(out.num_iters))
            for t in range(int(out.num_iters)):
                for i, r in enumerate(f.rows):
                    if out.counts[t, i]:
                        e.observe(r, int(out.num_drafts[t, i]), int(out.num_accepted[t, i]))
        results = e.commit_rule.loop(f.rows, out, e.scheduler.tok_buf)
        if out.stage_counts is not None:            # history_first merged in the loop
            e.proposer.count_merges(*(int(x) for x in out.stage_counts))
        if last:
            for i, r in enumerate(f.rows):
                if not r.finish_reason:
                    r.drafts = e._trim(r, drafts[i, : int(num_drafts[i])].tolist(), len(f.rows))
        e.host_s += time.perf_counter() - t1
        return results

    def done_after(self, r: _Request) -> bool:
        """Whether ``r`` surely finishes in the uncommitted call in flight: finished, or
        within ``steps_per_sync`` tokens of ``max_tokens`` / ``max_model_len`` (each
        iteration emits at least one token)."""
        left = min(r.params.max_tokens - len(r.output), self._e.max_model_len - r.num_tokens)
        return bool(r.finish_reason) or left <= self._e.options.steps_per_sync

    def blocks_ahead(self, rows: list[_Request]) -> bool:
        """Give each unfinished row the blocks for two calls ahead (a call continuing from
        one in flight); False when the pool is short."""
        n = 2 * self._e.options.steps_per_sync
        return all(self._e.scheduler.loop_blocks(r, n) for r in rows if not r.finish_reason)

    def sync(self, running: list[_Request], stop_on_finish: bool) -> Results:
        """One call (every running request decodes), then its commit (no overlap)."""
        return self.commit(self.dispatch(running, None, stop_on_finish))

    def sync_overlapped(self, running: list[_Request], inflight: _InFlight | None,
                        stop_on_finish: bool) -> tuple[Results, _InFlight | None]:
        """Dispatch the call after ``inflight`` (or a first one from the host), then commit
        ``inflight`` while it runs; when that finished a request, commit the new call too
        (drain). Returns ``(results, the call left in flight or None)``."""
        if inflight is None:
            inflight = self.dispatch(running, None, stop_on_finish)
        if all(self.done_after(r) for r in inflight.rows) or not self.blocks_ahead(inflight.rows):
            # a call dispatched after this one would only run masked iterations, or the pool
            # cannot give it blocks: drain (the next sync point may preempt)
            return self.commit(inflight), None
        nxt = self.dispatch(inflight.rows, inflight.state, stop_on_finish, inflight.k)
        results = self.commit(inflight, last=False)
        if any(fin for _, fin in results) or all(r.finish_reason for r in nxt.rows):
            results += self.commit(nxt)
            self._e.num_syncs += 1
            nxt = None
        return results, nxt

"""The engine's decoding phase on the device loop (``Engine`` mixes this in): the loop state
from the host's requests, one dispatch of ``specjax.runtime.decode_loop``, the commit of its
iterations, and the overlapped form (``Engine(overlap=True)``), which dispatches the next
call from the device-resident state before committing the previous one.

Overlap: a decoding batch's next inputs (each request's last token, drafts, positions,
slots) are built on the device from the previous call's state (``decode_loop.device_batch``),
so the host need not wait for the previous call's tokens before it dispatches the next:
the host commits call ``t`` (tokens, stop checks, metrics, the progress callback) and
hands out KV blocks while call ``t + 1`` runs. Blocks are given two calls ahead
(``loop_blocks_needed`` over ``2 * steps_per_sync`` iterations, within each request's
reservation). A request that finishes in call ``t`` sits call ``t + 1`` out (finished
rows write no KV and emit nothing); when one finishes, the in-flight call is committed
too (the pipeline drains) and the next batch is rebuilt from the host. The engine
overlaps only while no request waits (``Engine.generate``): with one waiting, each call
ends as soon as a request finishes so that it joins at once, as without overlap. The
same tokens either way (greedy and seeded: a request's key depends on its own generated
count only). Overlap pays with the fixed-trip form only (``early_exit=False``, the
engine's form while no request waits, except on a CPU target): on a GPU the
``while_loop``'s dispatch reads the loop predicate back each iteration and so returns only
when the loop has ended.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, NamedTuple

import jax
import numpy as np

from specjax.runtime.batch import trim_drafts
from specjax.constants import next_power_of_2
from specjax.runtime.decode_loop import decode_loop, loop_blocks_needed, make_loop_state
from specjax.engine.scheduler import _Request
from specjax.sampling.logprobs import logprobs_bucket, request_logprobs
from specjax.metrics import SpecDecodingStats

_I32 = np.int32


def _on_cpu(params) -> bool:
    """Whether the target's params live on CPU devices (JAX's default backend for host
    arrays)."""
    leaf = next(iter(jax.tree.leaves(params)), None)
    if isinstance(leaf, jax.Array):
        return all(d.platform == "cpu" for d in leaf.devices())
    return jax.default_backend() == "cpu"


class _InFlight(NamedTuple):
    """A dispatched device-loop call: its rows (the running requests at dispatch, in row
    order) and its device results (copies to the host started)."""

    rows: list
    out: Any
    state: Any
    t_dispatch: float


class DeviceLoop:
    """``Engine``'s decoding phase through ``specjax.runtime.decode_loop`` (see the module docstring)."""

    def _loop_state(self, running: list[_Request], ahead: int = 1):
        """Blocks for ``ahead`` calls of ``steps_per_sync`` iterations, then the device
        loop's state (NumPy)."""
        for r in running:
            self._loop_blocks(r, ahead)
        B, Q, C = self._buckets(len(running), self.k + 1, max(len(r.blocks) for r in running))
        hist = ([self.tok_buf[r.row, : r.num_tokens] for r in running]
                if self.drafts_in == "history" else None)
        state = make_loop_state(
            last_token=[r.token(r.num_tokens - 1) for r in running],
            num_computed=[r.num_computed for r in running], drafts=[r.drafts for r in running],
            max_tokens=[r.params.max_tokens for r in running],
            num_output=[len(r.output) for r in running], block_ids=[r.blocks for r in running],
            k=self.k, num_reqs_pad=B, blocks_per_req_pad=C, query_len_pad=Q,
            max_model_len=self.max_model_len, block_size=self.block_size,
            stop_ids=[sorted(r.stop_ids) for r in running],
            stop_pad=next_power_of_2(max([1] + [len(r.stop_ids) for r in running])),
            temperature=[r.params.temperature for r in running],
            top_k=[r.params.top_k for r in running], top_p=[r.params.top_p for r in running],
            seeds=[r.seed for r in running], history=hist, procs=self._procs(running, B))
        return dataclasses.replace(state, num_logprobs=logprobs_bucket(
            [r.params.logprobs for r in running]))

    def _loop_blocks(self, r: _Request, ahead: int) -> None:
        """Give ``r`` the KV blocks ``ahead`` calls can write (within ``r.reserve``:
        admission stays the same)."""
        limit = min(self.max_model_len, len(r.prompt) + r.params.max_tokens + self.lookahead)
        need = loop_blocks_needed(r.num_computed, steps_per_sync=ahead * self.steps_per_sync,
                                  k=self.k, lookahead=self.lookahead, block_size=self.block_size,
                                  limit=limit)
        while len(r.blocks) < need:
            r.blocks.append(self.free_blocks.pop())

    def _loop_forms(self) -> tuple[bool, ...]:
        """The device loop's forms this engine runs (``early_exit`` values)."""
        if self.loop_early_exit is not None:
            return (self.loop_early_exit,)
        return (True,) if self._idle_early_exit else (False, True)

    @functools.cached_property
    def _idle_early_exit(self) -> bool:
        """The form of a call made while no request waits, under ``loop_early_exit=None``:
        the fixed trip count (False), except on a CPU target (True). On a GPU the fixed-trip
        form launches its iterations without reading the loop predicate back to the host;
        XLA:CPU evaluates the predicate where it runs, on the host, so there is nothing to
        save there, while the fixed-trip form's masked iterations (once every request has
        finished) cost a whole step each: on 2 CPU cores ``specjax demo``'s EAGLE-3 engine
        ran 6.8-7.0 ms per decoding iteration in it against 5.2-5.4 in the while form."""
        return _on_cpu(self.target.params)

    def _dispatch(self, rows: list[_Request], state, stop_on_finish: bool) -> _InFlight:
        """Dispatch one device-loop call (not waiting for it). ``state``: the previous
        call's device state to continue from (its block table refreshed for blocks two
        calls ahead), or None to build it from the host's requests."""
        t = time.perf_counter()
        if state is None:
            state = self._loop_state(rows)
        else:
            for r in rows:
                if not r.finish_reason:
                    self._loop_blocks(r, 2)
            _, _, C = self._buckets(len(rows), self.k + 1, max(len(r.blocks) for r in rows))
            table = np.zeros((state.num_reqs_pad, C), _I32)
            for i, r in enumerate(rows):
                m = min(len(r.blocks), C)
                table[i, :m] = r.blocks[:m]
            state = dataclasses.replace(state, block_table=table)
        out, self.target_kv, self.draft_state, state = decode_loop(
            self.step, self.target.params, self.step.draft_params, self.target_kv,
            self.draft_state, state, steps_per_sync=self.steps_per_sync,
            stop_on_finish=stop_on_finish,
            early_exit=(stop_on_finish or self._idle_early_exit) if self.loop_early_exit is None
            else self.loop_early_exit)
        for x in jax.tree.leaves(out):      # the next call may donate the state: not its drafts
            x.copy_to_host_async()
        self.host_s += time.perf_counter() - t
        return _InFlight(list(rows), out, state, t)

    def _commit_loop(self, f: _InFlight, last: bool = True
                     ) -> list[tuple[SpecDecodingStats | None, list[_Request]]]:
        """Wait for a dispatched call, then commit each of its iterations as ``_step``
        commits one: the same tokens, stop rule, counters and metrics. ``last``: no call
        continues from its state (the host takes the drafts; else the next call, which was
        given the state, carries them and has donated it). Returns one ``(stats,
        finished)`` per iteration run."""
        t = time.perf_counter()
        out = jax.device_get(f.out)
        if last:
            drafts, num_drafts = jax.device_get((f.state.drafts, f.state.num_drafts))
        t1 = time.perf_counter()
        self.wait_s += t1 - t
        running = f.rows
        results = []
        for it in range(int(out.num_iters)):
            stats = SpecDecodingStats.new(self.num_spec_positions) if self.proposer is not None else None
            finished = []
            for i, r in enumerate(running):
                c = int(out.counts[it, i])
                if r.finish_reason or c == 0:
                    continue
                nd, n_acc = int(out.num_drafts[it, i]), int(out.num_accepted[it, i])
                if nd:
                    nd_stat = nd if self.tree is None else self.tree.depths[nd - 1]
                    stats.observe_draft(nd_stat, n_acc)
                    r.num_drafted += nd_stat
                    r.num_accepted += n_acc
                r.num_computed += 1 + n_acc
                kept = out.tokens[it, i, :c].tolist()
                if r.params.logprobs is not None:
                    r.logprobs += request_logprobs(jax.tree.map(lambda a: a[it], out.logprobs),
                                                   i, c, r.params.logprobs)
                for j, tok in enumerate(kept):
                    r.output.append(tok)
                    if tok in r.stop_ids:
                        r.finish_reason = "stop"
                    elif len(r.output) >= r.params.max_tokens or r.num_tokens >= self.max_model_len:
                        r.finish_reason = "length"
                    if r.finish_reason and j != c - 1:
                        raise RuntimeError("device loop emitted tokens past a stop")
                if r.row >= 0:
                    self.tok_buf[r.row, r.num_tokens - c : r.num_tokens] = kept
                r.drafts = []
                if r.finish_reason:
                    finished.append(r)
            results.append((stats, finished))
        for i, r in enumerate(running):
            if bool(out.finished[i]) != bool(r.finish_reason):
                raise RuntimeError(f"device loop and host disagree on request {r.req_id}'s stop")
            if not r.finish_reason and last:
                kv_room = self.max_model_len - r.num_tokens
                r.drafts = trim_drafts(drafts[i, : int(num_drafts[i])].tolist(),
                                       max_new_tokens=min(kv_room, r.params.max_tokens - len(r.output)),
                                       kv_room=kv_room, k=self.k, vocab_size=self.vocab_size,
                                       tree=self.tree, drafter_room=self._drafter_room(r))
        self.host_s += time.perf_counter() - t1
        return results

    def _done_after(self, r: _Request) -> bool:
        """Whether ``r`` is sure to have finished once the call in flight (not committed:
        ``r.output`` does not hold its tokens yet) has run its ``steps_per_sync``
        iterations: finished already, or within that many tokens of ``max_tokens`` or
        ``max_model_len`` (every iteration emits at least one token)."""
        left = min(r.params.max_tokens - len(r.output), self.max_model_len - r.num_tokens)
        return bool(r.finish_reason) or left <= self.steps_per_sync

    def _sync(self, running: list[_Request], stop_on_finish: bool
              ) -> list[tuple[SpecDecodingStats | None, list[_Request]]]:
        """Up to ``steps_per_sync`` iterations on the device (every running request
        decodes), then their commit (no overlap)."""
        return self._commit_loop(self._dispatch(running, None, stop_on_finish))

    def _sync_overlapped(self, running: list[_Request], inflight: _InFlight | None,
                         stop_on_finish: bool):
        """The overlapped decoding phase: dispatch the call after ``inflight`` (or a first
        one from the host), then commit ``inflight`` while it runs. When the committed
        call finished a request, the new call is committed as well (drained). Returns
        ``(results, the call left in flight or None)``."""
        if inflight is None:
            inflight = self._dispatch(running, None, stop_on_finish)
        if all(self._done_after(r) for r in inflight.rows):
            # every request surely finishes in the call in flight (each of its iterations
            # emits a token): a call dispatched after it would only run masked iterations
            return self._commit_loop(inflight), None
        nxt = self._dispatch(inflight.rows, inflight.state, stop_on_finish)
        results = self._commit_loop(inflight, last=False)
        if any(fin for _, fin in results) or all(r.finish_reason for r in nxt.rows):
            results += self._commit_loop(nxt)
            self.num_syncs += 1
            nxt = None
        return results, nxt

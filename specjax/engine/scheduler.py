"""The reference loop's host scheduling: request records, admission, the KV block pool and
token-history rows, bucket choice and the step's padded batch."""

from __future__ import annotations

import dataclasses
from typing import Any, Hashable, Sequence

import numpy as np

from specjax.constants import next_power_of_2
from specjax.engine.options import LoopOptions
from specjax.engine.types import SamplingParams
from specjax.runtime.batch import NULL_BLOCK, build_batch
from specjax.runtime.decode_loop import loop_blocks_needed
from specjax.runtime.step import StepBatch
from specjax.sampling.logits_processors import make_processor_state
from specjax.sampling.logprobs import logprobs_bucket

_I32 = np.int32


@dataclasses.dataclass
class _Request:
    index: int
    req_id: Hashable
    prompt: list[int]
    params: SamplingParams
    seed: int
    stop_ids: frozenset
    output: list[int] = dataclasses.field(default_factory=list)
    num_computed: int = 0
    drafts: list[int] = dataclasses.field(default_factory=list)
    blocks: list[int] = dataclasses.field(default_factory=list)
    row: int = -1               # row of the token-history buffer
    sched: int = 0              # uncomputed tokens scheduled in the current step
    arrival: float = 0.0        # seconds after generate began when it may be admitted
    num_preemptions: int = 0
    first_scheduled: float = -1.0
    finished_time: float = -1.0
    token_times: list = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    k_cap: int = -1             # drafts it verifies next (Engine.k_for); -1: the engine's k
    acc_hits: float = 0.0       # decayed acceptance evidence (LoopOptions.adaptive_k)
    acc_trials: float = 0.0
    draft_features: Any = None  # [k] float32 of its drafts (enable_adaptive_verification)
    num_drafted: int = 0
    num_accepted: int = 0
    proc: Any = None            # specjax.sampling.logits_processors.RequestProcessing
    logprobs: list = dataclasses.field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    def token(self, i: int) -> int:
        p = len(self.prompt)
        return self.prompt[i] if i < p else self.output[i - p]

    @staticmethod
    def documents(reqs: Sequence["_Request"]) -> tuple[list, dict]:
        """``(req_ids, {req_id: (prompt length, prompt + output)})`` of finished requests,
        ``Proposer.finish_requests``' arguments."""
        return [r.req_id for r in reqs], {r.req_id: (len(r.prompt), list(r.prompt) + list(r.output))
                                          for r in reqs}


def _pick(buckets: Sequence[int] | None, n: int, cap: int | None = None,
          name: str = "buckets", what: str = "") -> int:
    """Smallest bucket >= n (powers of two when ``buckets`` is None), at most ``cap``;
    ValueError naming ``name`` (the ``LoopOptions`` field) and ``what`` needs ``n``."""
    if buckets is None:
        b = next_power_of_2(n)
    else:
        fits = [x for x in buckets if x >= n]
        if not fits:
            raise ValueError(f"LoopOptions.{name}={tuple(buckets)}: no bucket holds {n} "
                             f"({what}); give a bucket >= {n}")
        b = min(fits)
    return b if cap is None else min(max(b, n), cap)


class Scheduler:
    """Admission, KV blocks and rows of the reference loop (host only), vLLM v1's policy:
    a token budget per step (``LoopOptions.max_num_batched_tokens``) and blocks handed out as
    requests grow; when the pool (``num_blocks - 1`` blocks, 0 the null block) runs out,
    the latest running request is preempted and recomputed later. ``tok_buf [max_num_seqs,
    max_model_len]`` holds each running request's prompt + output."""

    def __init__(self, *, max_model_len: int, block_size: int, max_num_seqs: int,
                 num_blocks: int, k: int, lookahead: int, tree: Any, options: LoopOptions) -> None:
        self.max_model_len, self.block_size = max_model_len, block_size
        self.max_num_seqs, self.num_blocks = max_num_seqs, num_blocks
        self.k, self.lookahead, self.tree = k, lookahead, tree
        self.batch_buckets, self.query_buckets = options.batch_buckets, options.query_buckets
        self.context_buckets = options.context_buckets
        self.min_tokens_per_step = options.min_tokens_per_step
        self.processor_limits = options.processor_limits
        self.token_buckets = options.token_buckets
        #: tokens one request takes per step at most: the largest query bucket
        self.max_query = max(self.query_buckets) if self.query_buckets else 1 << 62
        self.budget = options.max_num_batched_tokens
        self.chunked = options.enable_chunked_prefill
        self.threshold = options.long_prefill_token_threshold
        #: requests preempted so far (vLLM's ``num_preemptions``)
        self.num_preemptions = 0
        #: batches carry each request's row as its draft slot (probabilistic drafting)
        self.draft_slots = False
        self.max_blocks_per_req = -(-max_model_len // block_size)
        self.reset()

    def reset(self) -> None:
        """Every block and row free."""
        self.free_blocks = list(range(self.num_blocks - 1, NULL_BLOCK, -1))   # pop() -> 1, 2, ...
        self.tok_buf = np.zeros((self.max_num_seqs, self.max_model_len), _I32)
        self.free_rows = list(range(self.max_num_seqs - 1, -1, -1))

    # -- blocks and rows -----------------------------------------------------------

    def worst_blocks(self, prompt_len: int, max_tokens: int) -> int:
        n = min(self.max_model_len, prompt_len + max_tokens + self.lookahead)
        return -(-n // self.block_size)

    def check_fits(self, prompts: Sequence[Sequence[int]], sps: Sequence[SamplingParams]) -> None:
        """ValueError naming ``prompts[i]`` and ``num_blocks`` when its worst case exceeds the
        whole pool (it could not finish even alone)."""
        for i, (p, s) in enumerate(zip(prompts, sps)):
            need = self.worst_blocks(len(p), s.max_tokens)
            if need > self.num_blocks - 1:
                raise ValueError(f"prompts[{i}] may need {need} KV blocks, more than the pool's "
                                 f"{self.num_blocks - 1} (num_blocks={self.num_blocks}, block 0 "
                                 "the null block): raise num_blocks or lower max_tokens")

    def grow(self, r: _Request, upto: int) -> bool:
        """Give ``r`` the blocks for positions ``< upto`` (capped at ``max_model_len``): all
        of them, or none and False when the pool is short."""
        need = -(-min(upto, self.max_model_len) // self.block_size) - len(r.blocks)
        if need > len(self.free_blocks):
            return False
        for _ in range(max(need, 0)):
            r.blocks.append(self.free_blocks.pop())
        return True

    def release(self, r: _Request) -> None:
        self.free_blocks.extend(reversed(r.blocks))
        r.blocks = []
        if r.row >= 0:
            self.free_rows.append(r.row)
            r.row = -1

    def preempt(self, r: _Request, waiting) -> None:
        """vLLM v1's preemption by recompute: ``r`` frees its blocks and row and goes back to
        the front of ``waiting`` with nothing computed; its output and drafts are kept (its
        prompt and output are prefilled again, then its drafts verified as before)."""
        self.release(r)
        if self.draft_slots:      # its drafts' probabilities stay with the row it leaves
            r.drafts = []
        r.num_computed = r.sched = 0
        r.num_preemptions += 1
        self.num_preemptions += 1
        waiting.appendleft(r)

    def _start(self, r: _Request) -> None:
        r.row = self.free_rows.pop()
        self.tok_buf[r.row, : r.num_tokens] = r.prompt + r.output

    def loop_blocks(self, r: _Request, iterations: int) -> bool:
        """Give ``r`` the KV blocks ``iterations`` device-loop iterations of ``k + 1`` tokens
        (and the proposer's lookahead) can write, never past its worst case; False (and
        none) when the pool is short."""
        limit = min(self.max_model_len, len(r.prompt) + r.params.max_tokens + self.lookahead)
        need = loop_blocks_needed(r.num_computed, steps_per_sync=iterations, k=self.k,
                                  lookahead=self.lookahead, block_size=self.block_size,
                                  limit=limit)
        return self.grow(r, need * self.block_size)

    def reserve_loop(self, running: list[_Request], waiting, iterations: int) -> None:
        """Blocks for ``iterations`` device-loop iterations of every running request, in
        order, preempting from the back of ``running`` while the pool is short (at a sync
        point: nothing in flight). The first request always fits (``check_fits``)."""
        i = 0
        while i < len(running):
            if self.loop_blocks(running[i], iterations):
                i += 1
                continue
            victim = running.pop()
            self.preempt(victim, waiting)

    # -- scheduling ----------------------------------------------------------------

    def _tokens(self, r: _Request, budget: int) -> int:
        """Uncomputed tokens of ``r`` a step with ``budget`` tokens left takes (at most the
        largest query bucket and ``long_prefill_token_threshold``)."""
        n = min(r.num_tokens - r.num_computed, self.max_query)
        if self.threshold:
            n = min(n, self.threshold)
        return min(n, budget)

    @property
    def row_cap(self) -> int:
        """Tokens a row takes at most with drafts: ``long_prefill_token_threshold`` (as vLLM
        caps tokens with drafts) but at least a decode row's ``k + 1``; unbounded without it."""
        return max(self.threshold, self.k + 1) if self.threshold else 1 << 62

    def _cut(self, drafts: list[int], room: int) -> list[int]:
        """``drafts`` cut to ``room`` tokens (a tree's to whole levels)."""
        if len(drafts) <= room:
            return drafts
        if self.tree is None:
            return drafts[: max(room, 0)]
        fits = [n for n in self.tree.cu_level_sizes if n <= room]
        return drafts[: fits[-1] if fits else 0]

    def _drafts(self, r: _Request, n: int, budget: int) -> int:
        """Drafts ``r`` verifies when ``n`` uncomputed tokens are scheduled: none in a partial
        prefill (its drafts are kept for its last chunk), else ``r.drafts`` cut to the budget
        left and :attr:`row_cap` (stored cut)."""
        if r.num_computed + n < r.num_tokens:
            return 0
        r.drafts = self._cut(r.drafts, min(budget, self.max_query, self.row_cap) - n)
        return len(r.drafts)

    def schedule(self, waiting, running: list[_Request], now: float = float("inf")
                 ) -> list[_Request]:
        """One step's requests under the token budget, vLLM v1's rule. Running requests
        first, in order: each takes its uncomputed tokens (at most
        ``long_prefill_token_threshold``; a prefill left unfinished is a partial prefill with
        no drafts), then its drafts, all cut to the budget left, and blocks for them and the
        proposer's lookahead; while the pool is short the last running request is preempted
        (:meth:`preempt`; possibly this one). Then, unless a request was preempted, waiting
        requests that have arrived by ``now`` are admitted while a row, budget and blocks
        remain (with ``enable_chunked_prefill`` False only a whole prompt). Sets each
        scheduled request's ``sched`` (its uncomputed tokens in the step) and cuts its
        ``drafts``; returns them in row order (scheduled running requests, then admitted ones)."""
        budget, out, preempted = self.budget, [], False
        for r in running:
            r.sched = 0
        i = 0
        while i < len(running) and budget > 0:
            r = running[i]
            n = self._tokens(r, budget)
            d = self._drafts(r, n, budget)
            if not self.grow(r, r.num_computed + n + d + self.lookahead):
                self.preempt(running.pop(), waiting)
                preempted = True
                continue            # retry r, unless it was the one preempted
            r.sched = n
            out.append(r)
            budget -= n + d
            i += 1
        while not preempted and waiting and budget > 0 and len(running) < self.max_num_seqs:
            r = waiting[0]
            if r.arrival > now:
                break
            n = self._tokens(r, budget)
            if not self.chunked and n < r.num_tokens - r.num_computed:
                break
            d = self._drafts(r, n, budget)
            if not self.grow(r, n + d + self.lookahead):
                break
            waiting.popleft()
            self._start(r)
            r.sched = n
            running.append(r)
            out.append(r)
            budget -= n + d
        return out

    # -- batches -------------------------------------------------------------------

    def buckets(self, n: int, max_q: int, max_blocks: int, k: int | None = None
                ) -> tuple[int, int, int]:
        """``(rows, tokens per row, block-table width)`` of a batch of ``n`` requests whose
        rows are padded to at least ``k + 1`` tokens (None: the engine's k)."""
        b = _pick(self.batch_buckets, n, name="batch_buckets", what="requests in the step")
        k = self.k if k is None else k
        q = _pick(self.query_buckets, max(max_q, k + 1, -(-self.min_tokens_per_step // b)),
                  name="query_buckets", what="tokens of one request in the step")
        c = _pick(self.context_buckets, max_blocks, cap=self.max_blocks_per_req,
                  name="context_buckets", what="KV blocks of one request")
        return b, q, c

    def ragged_slots(self, rows: int, query_len: int, tokens: int) -> tuple[int, int]:
        """``(T, Q)`` of a ragged step: ``T`` the least ``token_buckets`` entry >= ``tokens``
        (None: its power of two, at most the budget); with no ``query_buckets`` ``Q`` is ``T``
        or :attr:`row_cap`'s power of two (the kernels read ``Q`` only for tiles: one program
        per ``T``), else ``T <= rows x Q``."""
        if self.token_buckets:
            fits = [x for x in self.token_buckets if x >= tokens]
            t = min(fits) if fits else rows * query_len
        else:
            t = next_power_of_2(tokens)
            if self.budget is not None and tokens <= self.budget:
                t = min(t, self.budget)
        if self.query_buckets is None:
            return t, min(t, next_power_of_2(self.row_cap))
        return min(t, rows * query_len), query_len

    def step_slots(self, rows: int, query_len: int, tokens: int) -> tuple[int, int]:
        """``(T, Q)`` of a step holding ``tokens``: ``ragged_slots`` past a decode step's
        ``Q``, else ``(rows x Q, Q)``; what ``build_batch`` pads and ``Engine.warmup`` compiles."""
        if query_len > self.buckets(1, self.k + 1, 1)[1]:
            return self.ragged_slots(rows, query_len, max(tokens, self.min_tokens_per_step))
        return rows * query_len, query_len

    def build_batch(self, reqs: list[_Request], tree_verify: bool = False
                    ) -> tuple[StepBatch, list[int], int]:
        """``(batch, query lengths, rows)`` of the scheduled ``reqs``: each one's ``sched``
        uncomputed tokens (fewer than all: a partial prefill, its sampled token discarded and
        its drafter fed the next prompt token), then its drafts (``tree_verify``: every
        request has one uncomputed token, the root, and verifies its tree prefix), in the
        ``step_slots`` of the step: a long chunk beside decoding rows pads to the chunk."""
        sched, computed, nd, partial = [], [], [], []
        for r in reqs:
            partial.append(r.num_computed + r.sched < r.num_tokens)
            drafts = [] if partial[-1] else r.drafts
            sched.append([r.token(i) for i in range(r.num_computed, r.num_computed + r.sched)]
                         + drafts)
            computed.append(r.num_computed)
            nd.append(len(drafts))
        qlens = [len(t) for t in sched]
        # a partial prefill takes the width its whole prompt needs: one program for its chunks
        width = max(-(-r.num_tokens // self.block_size) if p else len(r.blocks)
                    for r, p in zip(reqs, partial))
        B, Q, C = self.buckets(len(reqs), max(qlens), width,
                               max(self.k if r.k_cap < 0 else r.k_cap for r in reqs))
        T, Q = self.step_slots(B, Q, sum(qlens))
        batch = build_batch(
            sched, num_computed=computed, num_drafts=nd, block_ids=[r.blocks for r in reqs],
            block_size=self.block_size, num_reqs_pad=B, query_len_pad=Q, blocks_per_req_pad=C,
            num_tokens_pad=T, max_spec_len=self.k,
            temperature=[r.params.temperature for r in reqs],
            top_k=[r.params.top_k for r in reqs], top_p=[r.params.top_p for r in reqs],
            seeds=[r.seed for r in reqs], num_output_tokens=[len(r.output) for r in reqs],
            tree=self.tree if tree_verify else None, procs=self.procs(reqs, B),
            discard=partial if any(partial) else None)
        batch = dataclasses.replace(batch, num_logprobs=logprobs_bucket(
            [r.params.logprobs for r in reqs]), slots=self.slot_rows([r.row for r in reqs], B))
        if any(partial):      # a partial prefill's drafter reads the next prompt token
            backup = np.array(batch.backup_next, copy=True)
            for i, (r, p) in enumerate(zip(reqs, partial)):
                if p:
                    backup[i] = r.token(r.num_computed + qlens[i])
            batch = dataclasses.replace(batch, backup_next=backup)
        return batch, qlens, B

    def empty_procs(self, B: int):
        """A ``ProcessorState`` of ``B`` padding rows (compiles the processing variant)."""
        return make_processor_state([], [], [], num_reqs_pad=B, max_len=self.max_model_len,
                                    limits=self.processor_limits)

    def procs(self, running: list[_Request], B: int):
        """The batch's ``ProcessorState`` (token histories from ``tok_buf``), or None when no
        running request uses a logits-processing feature (the plain program)."""
        if not any(r.proc is not None and r.proc.active for r in running):
            return None
        return make_processor_state(
            [r.proc for r in running], [self.tok_buf[r.row, : r.num_tokens] for r in running],
            [len(r.prompt) for r in running], num_reqs_pad=B, max_len=self.max_model_len,
            limits=self.processor_limits)

    def dummy_batch(self, B: int, Q: int, C: int, tree_verify: bool = False,
                    all_greedy: bool = True, num_tokens: int | None = None) -> StepBatch:
        """A batch of ``B`` padding rows (writes nothing) in ``num_tokens`` token slots (None:
        ``B * Q``), for compiling a bucket."""
        batch = build_batch([], num_computed=[], num_drafts=[], block_ids=[],
                            block_size=self.block_size, num_reqs_pad=B, query_len_pad=Q,
                            blocks_per_req_pad=C, max_spec_len=self.k, num_tokens_pad=num_tokens,
                            tree=self.tree if tree_verify else None)
        return dataclasses.replace(batch, all_greedy=all_greedy, slots=self.slot_rows([], B))

    def slot_rows(self, rows: list[int], B: int) -> np.ndarray | None:
        """``[B] int32`` draft slots (padding: ``max_num_seqs``), None unless ``draft_slots``."""
        if not self.draft_slots:
            return None
        return np.array(rows + [self.max_num_seqs] * (B - len(rows)), _I32)

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
    reserve: int = 0            # worst-case block count over the request's life
    row: int = -1               # row of the token-history buffer
    finish_reason: str | None = None
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


def _pick(buckets: Sequence[int] | None, n: int, cap: int | None = None) -> int:
    """Smallest bucket >= n (powers of two when ``buckets`` is None), at most ``cap``."""
    if buckets is None:
        b = next_power_of_2(n)
    else:
        fits = [x for x in buckets if x >= n]
        if not fits:
            raise ValueError(f"no bucket in {tuple(buckets)} holds {n}")
        b = min(fits)
    return b if cap is None else min(max(b, n), cap)


class Scheduler:
    """Admission, KV blocks and rows of the reference loop (host only). The pool holds
    ``num_blocks - 1`` blocks (0 is the null block); admission reserves each request's worst
    case (no preemption) and blocks are handed out as it grows. ``tok_buf [max_num_seqs,
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
        self.prefill_chunk = options.prefill_chunk or 0     # 0: whole prompts
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
        """ValueError naming ``prompts[i]`` when its worst case exceeds the whole pool."""
        for i, (p, s) in enumerate(zip(prompts, sps)):
            if self.worst_blocks(len(p), s.max_tokens) > self.num_blocks - 1:
                raise ValueError(f"prompts[{i}] may need {self.worst_blocks(len(p), s.max_tokens)} "
                                 f"KV blocks, more than the pool's {self.num_blocks - 1}")

    def admit(self, waiting, running: list[_Request]) -> None:
        """Move requests from ``waiting`` (a deque) to ``running`` while a row is free and
        the pool, less what running requests may still take, holds their reservation."""
        while waiting and len(running) < self.max_num_seqs:
            r = waiting[0]
            owed = sum(x.reserve - len(x.blocks) for x in running)
            if len(self.free_blocks) - owed < r.reserve:
                if not running:   # cannot happen: check_fits bounds every request
                    raise RuntimeError("KV block pool too small for a single request")
                break
            waiting.popleft()
            r.row = self.free_rows.pop()
            self.tok_buf[r.row, : len(r.prompt)] = r.prompt
            running.append(r)

    def release(self, r: _Request) -> None:
        self.free_blocks.extend(reversed(r.blocks))
        r.blocks = []
        if r.row >= 0:
            self.free_rows.append(r.row)
            r.row = -1

    def ensure_blocks(self, r: _Request, upto: int) -> None:
        need = -(-min(upto, self.max_model_len) // self.block_size)
        while len(r.blocks) < need:
            r.blocks.append(self.free_blocks.pop())

    def loop_blocks(self, r: _Request, iterations: int) -> None:
        """Give ``r`` the KV blocks ``iterations`` device-loop iterations can write (within
        ``r.reserve``: admission stays the same)."""
        limit = min(self.max_model_len, len(r.prompt) + r.params.max_tokens + self.lookahead)
        need = loop_blocks_needed(r.num_computed, steps_per_sync=iterations, k=self.k,
                                  lookahead=self.lookahead, block_size=self.block_size,
                                  limit=limit)
        while len(r.blocks) < need:
            r.blocks.append(self.free_blocks.pop())

    # -- batches -------------------------------------------------------------------

    def buckets(self, n: int, max_q: int, max_blocks: int) -> tuple[int, int, int]:
        """``(rows, tokens per row, block-table width)`` of a batch of ``n`` requests."""
        b = _pick(self.batch_buckets, n)
        q = _pick(self.query_buckets, max(max_q, self.k + 1, -(-self.min_tokens_per_step // b)))
        c = _pick(self.context_buckets, max_blocks, cap=self.max_blocks_per_req)
        return b, q, c

    def scheduled(self, r: _Request) -> int:
        """Uncomputed tokens of ``r`` the next step schedules (its drafts aside): all, or
        ``prefill_chunk`` of a longer prompt (a partial prefill)."""
        n = r.num_tokens - r.num_computed
        return min(n, self.prefill_chunk) if self.prefill_chunk else n

    def build_batch(self, running: list[_Request], tree_verify: bool = False
                    ) -> tuple[StepBatch, list[int], int]:
        """``(batch, query lengths, rows)``: each request's uncomputed tokens (at most
        ``prefill_chunk``: a partial prefill, its sampled token discarded and its drafter fed
        the next prompt token), then its drafts (``tree_verify``: every request has one
        uncomputed token, the root, and verifies its tree prefix); blocks are handed out for
        them and the proposer's lookahead."""
        sched, computed, nd, partial = [], [], [], []
        for r in running:
            n = self.scheduled(r)
            partial.append(r.num_computed + n < r.num_tokens)
            drafts = [] if partial[-1] else r.drafts
            sched.append([r.token(i) for i in range(r.num_computed, r.num_computed + n)] + drafts)
            computed.append(r.num_computed)
            nd.append(len(drafts))
            self.ensure_blocks(r, r.num_computed + len(sched[-1]) + self.lookahead)
        qlens = [len(t) for t in sched]
        # a partial prefill takes the width its whole prompt needs: one program for its chunks
        width = max(-(-r.num_tokens // self.block_size) if p else len(r.blocks)
                    for r, p in zip(running, partial))
        B, Q, C = self.buckets(len(running), max(qlens), width)
        batch = build_batch(
            sched, num_computed=computed, num_drafts=nd, block_ids=[r.blocks for r in running],
            block_size=self.block_size, num_reqs_pad=B, query_len_pad=Q, blocks_per_req_pad=C,
            max_spec_len=self.k, temperature=[r.params.temperature for r in running],
            top_k=[r.params.top_k for r in running], top_p=[r.params.top_p for r in running],
            seeds=[r.seed for r in running], num_output_tokens=[len(r.output) for r in running],
            tree=self.tree if tree_verify else None, procs=self.procs(running, B),
            discard=partial if any(partial) else None)
        batch = dataclasses.replace(batch, num_logprobs=logprobs_bucket(
            [r.params.logprobs for r in running]))
        if any(partial):      # a partial prefill's drafter reads the next prompt token
            backup = np.array(batch.backup_next, copy=True)
            for i, (r, p) in enumerate(zip(running, partial)):
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
                    all_greedy: bool = True) -> StepBatch:
        """A batch of ``B`` padding rows (writes nothing), for compiling a bucket."""
        batch = build_batch([], num_computed=[], num_drafts=[], block_ids=[],
                            block_size=self.block_size, num_reqs_pad=B, query_len_pad=Q,
                            blocks_per_req_pad=C, max_spec_len=self.k,
                            tree=self.tree if tree_verify else None)
        return dataclasses.replace(batch, all_greedy=all_greedy)

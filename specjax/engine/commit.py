"""The host commit rule: what one iteration's tokens do to a request (output, stop, counters,
KV position, logprobs, token history, metrics). The per-step path (``CommitRule.step``) and
the device-loop path (``CommitRule.loop``) both commit through ``CommitRule.request``, so a
request leaves the same record whichever path ran it."""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import numpy as np

from specjax.engine.scheduler import _Request
from specjax.metrics import SpecDecodingStats
from specjax.sampling import PLACEHOLDER_TOKEN_ID
from specjax.sampling.logprobs import request_logprobs

__all__ = ["CommitRule"]


@dataclasses.dataclass(frozen=True)
class CommitRule:
    """``max_model_len``: the context cap (a request reaching it finishes with ``"length"``);
    ``tree``: the verified ``TokenTree`` (a request-step counts its deepest verified level as
    its drafts) or None; ``num_spec_positions``: length of the per-position acceptance
    counts, None without a proposer (no metrics)."""

    max_model_len: int
    tree: Any = None
    num_spec_positions: int | None = None

    def new_stats(self) -> SpecDecodingStats | None:
        return None if self.num_spec_positions is None else \
            SpecDecodingStats.new(self.num_spec_positions)

    def request(self, r: _Request, tokens: Sequence[int], *, num_scheduled: int,
                num_drafts: int, num_accepted: int, tok_buf: np.ndarray,
                stats: SpecDecodingStats | None, logprobs: Any = None, index: int = 0) -> list[int]:
        """Commit one iteration of ``r``: ``tokens`` (accepted drafts, then the bonus /
        recovered token) are appended up to and including the first that finishes it (a
        stop id: ``"stop"``; ``max_tokens`` or ``max_model_len``: ``"length"``). Its
        ``num_scheduled`` tokens were in the batch, ``num_drafts`` of them drafts, of which
        ``num_accepted`` were accepted (before any stop cut ``tokens``). ``logprobs``: the
        output's ``Logprobs`` (row ``index``). Clears ``r.drafts``; returns the tokens kept."""
        if num_drafts:
            nd_stat = num_drafts if self.tree is None else self.tree.depths[num_drafts - 1]
            stats.observe_draft(nd_stat, num_accepted)
            r.num_drafted += nd_stat
            r.num_accepted += num_accepted
        # the root and the accepted tokens are in the KV cache (a tree's moved there)
        r.num_computed += num_scheduled - (num_drafts - num_accepted)
        kept = []
        for tok in tokens:
            kept.append(tok)
            r.output.append(tok)
            if tok in r.stop_ids:
                r.finish_reason = "stop"
            elif len(r.output) >= r.params.max_tokens or r.num_tokens >= self.max_model_len:
                r.finish_reason = "length"
            if r.finish_reason:
                break
        if r.params.logprobs is not None:
            r.logprobs += request_logprobs(logprobs, index, len(kept), r.params.logprobs)
        if r.row >= 0:
            tok_buf[r.row, r.num_tokens - len(kept): r.num_tokens] = kept
        r.drafts = []
        return kept

    def step(self, running: list[_Request], out, qlens: Sequence[int], tok_buf: np.ndarray
             ) -> tuple[SpecDecodingStats | None, list[_Request], list[list[int]]]:
        """Commit a host ``StepOutput`` (row ``i``: ``running[i]``, ``qlens[i]`` tokens
        scheduled, ``len(r.drafts)`` of them drafts; fewer than its uncomputed tokens: a
        partial prefill, computed and its sampled token discarded). Returns ``(stats,
        finished, kept tokens per request)``."""
        stats = self.new_stats()
        finished, gained = [], []
        for i, r in enumerate(running):
            if qlens[i] < r.num_tokens - r.num_computed:      # a partial prefill
                r.num_computed += qlens[i]
                gained.append([])
                continue
            new = [int(t) for t in out.sampled[i] if t != PLACEHOLDER_TOKEN_ID]
            kept = self.request(r, new, num_scheduled=qlens[i], num_drafts=len(r.drafts),
                                num_accepted=len(new) - 1, tok_buf=tok_buf, stats=stats,
                                logprobs=out.logprobs, index=i)
            if r.finish_reason:
                finished.append(r)
            gained.append(kept)
        return stats, finished, gained

    def loop(self, rows: list[_Request], out, tok_buf: np.ndarray
             ) -> list[tuple[SpecDecodingStats | None, list[_Request]]]:
        """Commit a host ``LoopOutput`` (row ``i``: ``rows[i]``), one ``(stats, finished)``
        per iteration run. RuntimeError when the device emitted a token past a stop or its
        finished flags disagree with this rule's."""
        results = []
        for it in range(int(out.num_iters)):
            stats = self.new_stats()
            finished = []
            lp = None if out.logprobs is None else jax.tree.map(lambda a: a[it], out.logprobs)
            for i, r in enumerate(rows):
                c = int(out.counts[it, i])
                if r.finish_reason or c == 0:
                    continue
                nd = int(out.num_drafts[it, i])
                kept = self.request(r, out.tokens[it, i, :c].tolist(), num_scheduled=1 + nd,
                                    num_drafts=nd, num_accepted=int(out.num_accepted[it, i]),
                                    tok_buf=tok_buf, stats=stats, logprobs=lp, index=i)
                if len(kept) != c:
                    raise RuntimeError("device loop emitted tokens past a stop")
                if r.finish_reason:
                    finished.append(r)
            results.append((stats, finished))
        for i, r in enumerate(rows):
            if bool(out.finished[i]) != bool(r.finish_reason):
                raise RuntimeError(f"device loop and host disagree on request {r.req_id}'s stop")
        return results

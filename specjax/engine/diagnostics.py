"""Benchmark probes of the reference loop's step (``engine.diagnostics``): the cost of a
steady-state decode step, its lowered program, and KV-cache copies in its HLO."""

from __future__ import annotations

import itertools
import re
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax.engine.scheduler import _Request
from specjax.sampling.logits_processors import check_request
from specjax.engine.types import SamplingParams
from specjax.proposers import TokenHistory

_I32 = np.int32
_bench_counter = itertools.count()


class Diagnostics:
    """Benchmark methods of ``engine`` (its step, caches and request pool); every request
    they make is released before they return."""

    def __init__(self, engine) -> None:
        self.engine = engine

    def time_decode_step(self, num_reqs: int, context_len: int, *, iters: int = 20, seed: int = 0,
                         sampling_params: SamplingParams | Sequence[SamplingParams] | None = None
                         ) -> dict[str, float]:
        """Seconds of one steady-state decode step: ``num_reqs`` requests, ``context_len``
        tokens cached and ``k`` random drafts each, stepped ``iters`` times, each synced as the
        loop is (token-history proposers drafting in their steady state). Returns ``step_s``,
        ``host_propose_s`` (0 for device proposers), ``build_s`` (medians) and ``compile_s``.
        ``sampling_params``: one for all or one per request (None: greedy); selects the variant."""
        e = self.engine
        reqs = self._bench_requests(num_reqs, context_len, seed, sampling_params)
        try:
            tv = e.tree is not None
            batch, _, b_pad = e.scheduler.build_batch(reqs, tree_verify=tv)
            t0 = time.perf_counter()
            jax.device_get(e._run(batch))   # compiles
            compile_s = time.perf_counter() - t0
            drafting = e.drafts_in == "history"
            if drafting:
                ids = [r.req_id for r in reqs]
                rows = e.scheduler.tok_buf[[r.row for r in reqs]]
                first = max(1, context_len - iters)

                def history(i: int) -> TokenHistory:
                    n = min(first + i, context_len)
                    return TokenHistory(ids, rows, np.full(num_reqs, n, _I32),
                                        np.full(num_reqs, first - 1, _I32),
                                        [[int(rows[j, n - 1])] for j in range(num_reqs)],
                                        rows_pad=b_pad)

                e.proposer.propose_from_history(history(0))
            step, host = [], []
            for i in range(1, iters + 1):
                t0 = time.perf_counter()
                jax.device_get(e._run(batch))   # what the loop fetches each step
                step.append(time.perf_counter() - t0)
                if drafting:
                    hist = history(i)
                    t0 = time.perf_counter()
                    e.proposer.propose_from_history(hist)
                    host.append(time.perf_counter() - t0)
            build = []
            for _ in range(iters):
                t0 = time.perf_counter()
                e.scheduler.build_batch(reqs, tree_verify=tv)
                build.append(time.perf_counter() - t0)
        finally:
            if e.proposer is not None:
                e.proposer.finish_requests([r.req_id for r in reqs])
            for r in reqs:
                e.scheduler.release(r)
        return {"step_s": float(np.median(step)), "host_propose_s": float(np.median(host)) if host else 0.0,
                "compile_s": compile_s, "build_s": float(np.median(build))}

    def lower_decode_step(self, num_reqs: int, context_len: int, *, seed: int = 0,
                          sampling_params: SamplingParams | Sequence[SamplingParams] | None = None):
        """The ``jax.stages.Lowered`` of the step ``time_decode_step`` times (same buckets),
        for inspecting what XLA makes of it: ``.as_text()`` (donation shows as
        ``tf.aliasing_output``), ``.compile().as_text()`` (see ``kv_cache_copies``)."""
        e = self.engine
        reqs = self._bench_requests(num_reqs, context_len, seed, sampling_params)
        try:
            tv = e.tree is not None
            batch, _, _ = e.scheduler.build_batch(reqs, tree_verify=tv)
            return e.step.lower(e.target.params, e.step.draft_params, e.target_kv,
                                   e.draft_state, batch)
        finally:
            for r in reqs:
                e.scheduler.release(r)

    def decode_step_tokens(self, num_reqs: int, context_len: int, *, seed: int = 0,
                           sampling_params: SamplingParams | Sequence[SamplingParams] | None = None
                           ) -> int:
        """``T_pad``, the padded token count of the step ``lower_decode_step`` lowers."""
        e = self.engine
        reqs = self._bench_requests(num_reqs, context_len, seed, sampling_params)
        try:
            batch, _, _ = e.scheduler.build_batch(reqs, tree_verify=e.tree is not None)
            return int(batch.input_ids.shape[0])
        finally:
            for r in reqs:
                e.scheduler.release(r)

    def decode_step_output(self, num_reqs: int, context_len: int, *, seed: int = 0,
                           sampling_params: SamplingParams | Sequence[SamplingParams] | None = None):
        """``(batch, output)``: the padded ``StepBatch`` of the step ``time_decode_step``
        times and the host ``StepOutput`` of one call of it (what a benchmark checks its
        variant by: ``batch.procs``, ``batch.num_logprobs``, ``output.logprobs``)."""
        e = self.engine
        reqs = self._bench_requests(num_reqs, context_len, seed, sampling_params)
        try:
            batch, _, _ = e.scheduler.build_batch(reqs, tree_verify=e.tree is not None)
            return batch, jax.device_get(e._run(batch))
        finally:
            if e.proposer is not None:
                e.proposer.finish_requests([r.req_id for r in reqs])
            for r in reqs:
                e.scheduler.release(r)

    def kv_cache_copies(self, compiled_hlo: str) -> int:
        """How many instructions of a compiled step's HLO text copy a whole KV-cache-shaped
        buffer (target or draft; ``copy`` ops and copy fusions). 0 when the donated caches
        are updated in place."""
        e = self.engine
        shapes = set()
        for x in jax.tree.leaves((e.target_kv, e.draft_state)):
            if getattr(x, "ndim", 0) == 4:        # [num_blocks, block_size, heads, head_dim]
                for dims in (x.shape, (x.shape[0] * x.shape[1],) + x.shape[2:]):
                    shapes.add(f"{jnp.dtype(x.dtype).name}[{','.join(map(str, dims))}]"
                               .replace("float32", "f32").replace("bfloat16", "bf16")
                               .replace("float16", "f16"))
        n = 0
        for line in compiled_hlo.splitlines():
            m = re.match(r"\s*(?:ROOT\s+)?%(\S+)\s*=\s*([a-z0-9]+\[[0-9,]*\])\S*\s+([a-z-]+)\(", line)
            if m and m.group(2) in shapes and (m.group(3) == "copy" or
                                               (m.group(3) == "fusion" and "copy" in m.group(1))):
                n += 1
        return n

    def _bench_requests(self, num_reqs: int, context_len: int, seed: int,
                        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None
                        ) -> list[_Request]:
        """Requests in the steady decode state: ``context_len`` tokens (all but the last in
        the KV cache) and ``k`` random drafts; each holds a token-history row. Their
        sampling parameters: ``time_decode_step``'s ``sampling_params``."""
        e = self.engine
        if not 1 <= num_reqs <= e.max_num_seqs:
            raise ValueError(f"num_reqs must be in [1, max_num_seqs={e.max_num_seqs}], got {num_reqs}")
        if not 2 <= context_len <= e.max_model_len - e.k - 1:
            raise ValueError(f"context_len must be in [2, max_model_len - k - 1 = "
                             f"{e.max_model_len - e.k - 1}], got {context_len}")
        sps = self._bench_params(num_reqs, sampling_params)
        rng = np.random.default_rng(seed)
        reqs = []
        for i in range(num_reqs):
            toks = rng.integers(0, e.vocab_size, context_len).tolist()
            r = _Request(index=i, req_id=f"bench-{next(_bench_counter)}", prompt=toks[:-1],
                         params=sps[i], seed=i if sps[i].seed is None else sps[i].seed,
                         stop_ids=frozenset(), output=toks[-1:], num_computed=context_len - 1,
                         drafts=rng.integers(0, e.vocab_size, e.k).tolist(),
                         proc=sps[i].processing())
            r.row = e.scheduler.free_rows.pop()
            e.scheduler.tok_buf[r.row, :context_len] = toks
            reqs.append(r)
            r.sched = 1
            if not e.scheduler.grow(r, context_len + len(r.drafts) + e.lookahead):
                for x in reqs:
                    e.scheduler.release(x)
                raise ValueError(f"the KV pool (num_blocks={e.num_blocks}) cannot hold "
                                 f"{num_reqs} requests of context_len={context_len}")
        return reqs

    def _bench_params(self, num_reqs: int, sampling_params) -> list[SamplingParams]:
        """``sampling_params`` as one ``SamplingParams`` per bench request, each checked
        against the engine's limits (as ``generate`` does) before any work."""
        e = self.engine
        if sampling_params is None:
            sampling_params = SamplingParams()
        sps = ([sampling_params] * num_reqs if isinstance(sampling_params, SamplingParams)
               else list(sampling_params))
        if len(sps) != num_reqs or not all(isinstance(s, SamplingParams) for s in sps):
            raise ValueError(f"sampling_params must be None, a SamplingParams or {num_reqs} of "
                             f"them (one per request), got {sampling_params!r}")
        for i, sp in enumerate(sps):
            check_request(f"sampling_params[{i}]", sp.processing(), e.scheduler.processor_limits,
                          e.vocab_size, len(e.step.logits_processors))
        return sps


"""Benchmark probes of the reference loop's step (``Engine`` mixes these in): the cost of
a steady-state decode step, its lowered program, and KV-cache copies in its HLO."""

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
    """``Engine``'s benchmark methods (they use its step, caches and request pool)."""

    def time_decode_step(self, num_reqs: int, context_len: int, *, iters: int = 20, seed: int = 0,
                         sampling_params: SamplingParams | Sequence[SamplingParams] | None = None
                         ) -> dict[str, float]:
        """Cost of one steady-state decode step (benchmarks).

        ``num_reqs`` requests, each with ``context_len`` tokens in the KV cache and ``k``
        random drafts to verify (none for plain decoding), run through the jitted step
        (target forward + verification + device drafting) ``iters`` times, each synced
        on the sampled tokens as the loop does. Token-history proposers also draft after
        each step, from histories that grow by one token a call as the loop's do (lengths
        ``context_len - iters + 1 .. context_len``, after an untimed first call at
        ``context_len - iters`` that hands the proposer the whole contexts), so stateful
        ones (``ngram_gpu``, suffix) are timed in their steady state. Returns seconds:
        ``step_s`` (median), ``host_propose_s`` (median of the drafting calls, 0 for device
        proposers), ``compile_s`` (first call) and ``build_s`` (median of ``iters`` host
        builds of the step's padded batch, processor state included, after the timed calls).

        ``sampling_params``: every request's (one ``SamplingParams``) or each one's (a
        sequence of ``num_reqs``); None is greedy with no feature. The batch then runs the
        variant those parameters select (sampling, logits processors, the logprobs bucket),
        as the loop would; ``max_tokens`` is ignored (the requests never finish) and no stop
        id is set (``min_tokens`` suppresses nothing).
        """
        reqs = self._bench_requests(num_reqs, context_len, seed, sampling_params)
        try:
            tv = self.tree is not None
            batch, _, b_pad = self._build_batch(reqs, tree_verify=tv)
            t0 = time.perf_counter()
            jax.device_get(self._run(batch))   # compiles
            compile_s = time.perf_counter() - t0
            drafting = self.drafts_in == "history"
            if drafting:
                ids = [r.req_id for r in reqs]
                rows = self.tok_buf[[r.row for r in reqs]]
                first = max(1, context_len - iters)

                def history(i: int) -> TokenHistory:
                    n = min(first + i, context_len)
                    return TokenHistory(ids, rows, np.full(num_reqs, n, _I32),
                                        np.full(num_reqs, first - 1, _I32),
                                        [[int(rows[j, n - 1])] for j in range(num_reqs)],
                                        rows_pad=b_pad)

                self.proposer.propose_from_history(history(0))
            step, host = [], []
            for i in range(1, iters + 1):
                t0 = time.perf_counter()
                jax.device_get(self._run(batch))   # what the loop fetches each step
                step.append(time.perf_counter() - t0)
                if drafting:
                    hist = history(i)
                    t0 = time.perf_counter()
                    self.proposer.propose_from_history(hist)
                    host.append(time.perf_counter() - t0)
            build = []
            for _ in range(iters):
                t0 = time.perf_counter()
                self._build_batch(reqs, tree_verify=tv)
                build.append(time.perf_counter() - t0)
        finally:
            if self.proposer is not None:
                self.proposer.finish_requests([r.req_id for r in reqs])
            for r in reqs:
                self._release(r)
        return {"step_s": float(np.median(step)), "host_propose_s": float(np.median(host)) if host else 0.0,
                "compile_s": compile_s, "build_s": float(np.median(build))}

    def lower_decode_step(self, num_reqs: int, context_len: int, *, seed: int = 0,
                          sampling_params: SamplingParams | Sequence[SamplingParams] | None = None):
        """The ``jax.stages.Lowered`` of the step ``time_decode_step`` times (same buckets),
        for inspecting what XLA makes of it: ``.as_text()`` (donation shows as
        ``tf.aliasing_output``), ``.compile().as_text()`` (see ``kv_cache_copies``)."""
        reqs = self._bench_requests(num_reqs, context_len, seed, sampling_params)
        try:
            tv = self.tree is not None
            batch, _, _ = self._build_batch(reqs, tree_verify=tv)
            return self.step.lower(self.target.params, self.step.draft_params, self.target_kv,
                                   self.draft_state, batch)
        finally:
            for r in reqs:
                self._release(r)

    def decode_step_tokens(self, num_reqs: int, context_len: int, *, seed: int = 0,
                           sampling_params: SamplingParams | Sequence[SamplingParams] | None = None
                           ) -> int:
        """``T_pad``, the padded token count of the step ``lower_decode_step`` lowers."""
        reqs = self._bench_requests(num_reqs, context_len, seed, sampling_params)
        try:
            batch, _, _ = self._build_batch(reqs, tree_verify=self.tree is not None)
            return int(batch.input_ids.shape[0])
        finally:
            for r in reqs:
                self._release(r)

    def decode_step_output(self, num_reqs: int, context_len: int, *, seed: int = 0,
                           sampling_params: SamplingParams | Sequence[SamplingParams] | None = None):
        """``(batch, output)``: the padded ``StepBatch`` of the step ``time_decode_step``
        times and the host ``StepOutput`` of one call of it (what a benchmark checks its
        variant by: ``batch.procs``, ``batch.num_logprobs``, ``output.logprobs``)."""
        reqs = self._bench_requests(num_reqs, context_len, seed, sampling_params)
        try:
            batch, _, _ = self._build_batch(reqs, tree_verify=self.tree is not None)
            return batch, jax.device_get(self._run(batch))
        finally:
            if self.proposer is not None:
                self.proposer.finish_requests([r.req_id for r in reqs])
            for r in reqs:
                self._release(r)

    def kv_cache_copies(self, compiled_hlo: str) -> int:
        """How many instructions of a compiled step's HLO text copy a whole KV-cache-shaped
        buffer (target or draft; ``copy`` ops and copy fusions). 0 when the donated caches
        are updated in place."""
        shapes = set()
        for x in jax.tree.leaves((self.target_kv, self.draft_state)):
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
        if not 1 <= num_reqs <= self.max_num_seqs:
            raise ValueError(f"num_reqs must be in [1, max_num_seqs={self.max_num_seqs}], got {num_reqs}")
        if not 2 <= context_len <= self.max_model_len - self.k - 1:
            raise ValueError(f"context_len must be in [2, max_model_len - k - 1 = "
                             f"{self.max_model_len - self.k - 1}], got {context_len}")
        sps = self._bench_params(num_reqs, sampling_params)
        rng = np.random.default_rng(seed)
        reqs = []
        for i in range(num_reqs):
            toks = rng.integers(0, self.vocab_size, context_len).tolist()
            r = _Request(index=i, req_id=f"bench-{next(_bench_counter)}", prompt=toks[:-1],
                         params=sps[i], seed=i if sps[i].seed is None else sps[i].seed,
                         stop_ids=frozenset(), output=toks[-1:], num_computed=context_len - 1,
                         drafts=rng.integers(0, self.vocab_size, self.k).tolist(),
                         proc=sps[i].processing())
            r.row = self.free_rows.pop()
            self.tok_buf[r.row, :context_len] = toks
            reqs.append(r)
        return reqs

    def _bench_params(self, num_reqs: int, sampling_params) -> list[SamplingParams]:
        """``sampling_params`` as one ``SamplingParams`` per bench request, each checked
        against the engine's limits (as ``generate`` does) before any work."""
        if sampling_params is None:
            sampling_params = SamplingParams()
        sps = ([sampling_params] * num_reqs if isinstance(sampling_params, SamplingParams)
               else list(sampling_params))
        if len(sps) != num_reqs or not all(isinstance(s, SamplingParams) for s in sps):
            raise ValueError(f"sampling_params must be None, a SamplingParams or {num_reqs} of "
                             f"them (one per request), got {sampling_params!r}")
        for i, sp in enumerate(sps):
            check_request(f"sampling_params[{i}]", sp.processing(), self.processor_limits,
                          self.vocab_size, len(self.step.logits_processors))
        return sps

    # -- scheduling ----------------------------------------------------------------

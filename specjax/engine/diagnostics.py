"""Benchmark probes of the reference loop's step (``Engine`` mixes these in): the cost of
a steady-state decode step, its lowered program, and KV-cache copies in its HLO."""

from __future__ import annotations

import itertools
import re
import time

import jax
import jax.numpy as jnp
import numpy as np

from specjax.engine.scheduler import _Request
from specjax.engine.types import SamplingParams
from specjax.proposers import TokenHistory

_I32 = np.int32
_bench_counter = itertools.count()


class Diagnostics:
    """``Engine``'s benchmark methods (they use its step, caches and request pool)."""

    def time_decode_step(self, num_reqs: int, context_len: int, *, iters: int = 20, seed: int = 0
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
        proposers) and ``compile_s`` (first call).
        """
        reqs = self._bench_requests(num_reqs, context_len, seed)
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
        finally:
            if self.proposer is not None:
                self.proposer.finish_requests([r.req_id for r in reqs])
            for r in reqs:
                self._release(r)
        return {"step_s": float(np.median(step)), "host_propose_s": float(np.median(host)) if host else 0.0,
                "compile_s": compile_s}

    def lower_decode_step(self, num_reqs: int, context_len: int, *, seed: int = 0):
        """The ``jax.stages.Lowered`` of the step ``time_decode_step`` times (same buckets),
        for inspecting what XLA makes of it: ``.as_text()`` (donation shows as
        ``tf.aliasing_output``), ``.compile().as_text()`` (see ``kv_cache_copies``)."""
        reqs = self._bench_requests(num_reqs, context_len, seed)
        try:
            tv = self.tree is not None
            batch, _, _ = self._build_batch(reqs, tree_verify=tv)
            return self.step.lower(self.target.params, self.step.draft_params, self.target_kv,
                                   self.draft_state, batch)
        finally:
            for r in reqs:
                self._release(r)

    def decode_step_tokens(self, num_reqs: int, context_len: int, *, seed: int = 0) -> int:
        """``T_pad``, the padded token count of the step ``lower_decode_step`` lowers."""
        reqs = self._bench_requests(num_reqs, context_len, seed)
        try:
            batch, _, _ = self._build_batch(reqs, tree_verify=self.tree is not None)
            return int(batch.input_ids.shape[0])
        finally:
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

    def _bench_requests(self, num_reqs: int, context_len: int, seed: int) -> list[_Request]:
        """Requests in the steady decode state: ``context_len`` tokens (all but the last in
        the KV cache) and ``k`` random drafts; each holds a token-history row."""
        if not 1 <= num_reqs <= self.max_num_seqs:
            raise ValueError(f"num_reqs must be in [1, max_num_seqs={self.max_num_seqs}], got {num_reqs}")
        if not 2 <= context_len <= self.max_model_len - self.k - 1:
            raise ValueError(f"context_len must be in [2, max_model_len - k - 1 = "
                             f"{self.max_model_len - self.k - 1}], got {context_len}")
        rng = np.random.default_rng(seed)
        reqs = []
        for i in range(num_reqs):
            toks = rng.integers(0, self.vocab_size, context_len).tolist()
            r = _Request(index=i, req_id=f"bench-{next(_bench_counter)}", prompt=toks[:-1],
                         params=SamplingParams(max_tokens=self.max_model_len), seed=i,
                         stop_ids=frozenset(), output=toks[-1:], num_computed=context_len - 1,
                         drafts=rng.integers(0, self.vocab_size, self.k).tolist())
            r.row = self.free_rows.pop()
            self.tok_buf[r.row, :context_len] = toks
            reqs.append(r)
        return reqs

    # -- scheduling ----------------------------------------------------------------

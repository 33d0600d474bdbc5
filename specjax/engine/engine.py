"""The reference decoding loop: ``Engine`` (a target, a proposer, a paged KV cache; its
``Scheduler``, ``CommitRule`` and ``DeviceLoopDriver``) and ``generate``."""

from __future__ import annotations

import collections
import dataclasses
import inspect
import itertools
import time
from typing import Any, Callable, Iterable, Sequence

import jax
import numpy as np

from specjax.checks import (ArgumentError, ArgumentTypeError, check_int, check_opt_int, check_type,
                            show)
from specjax.engine.checks import check_engine_args
from specjax.engine.commit import CommitRule
from specjax.engine.device_loop import DeviceLoopDriver, _InFlight, _on_cpu
from specjax.engine.diagnostics import Diagnostics
from specjax.engine.options import (DEFAULT_CPU_MAX_NUM_BATCHED_TOKENS,
                                    DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_STEPS_PER_SYNC,
                                    LoopOptions)
from specjax.engine.scheduler import Scheduler, _pick, _Request
from specjax.engine.verification import AdaptiveVerifier, profile_k_costs
from specjax.engine.types import (GenerateResult, RequestMetrics, RequestOutput, SamplingParams,
                                  TargetModel)
from specjax.metrics import SpecDecodingStats
from specjax.proposers import Proposer, TokenHistory
from specjax.adaptive_k import acceptance_rate, choose_k, k_schedule_lookup, observe_acceptance
from specjax.runtime.batch import trim_drafts
from specjax.runtime.decode_loop import (decode_loop, loop_cache_size, loop_history, loop_support,
                                         make_loop_state)
from specjax.runtime.output import StepOutput
from specjax.runtime.step import StepBatch, make_step, params_kv_dtype, step_cache_size
from specjax.sampling.logits_processors import check_request
from specjax.sampling.logprobs import check_logprobs_mode, check_num_logprobs, logprobs_bucket
from specjax.target import check_target

_I32 = np.int32
_req_counter = itertools.count()


class Engine:
    """A target, a proposer (None: plain decoding), a paged KV cache and the decoding loop:
    ``scheduler`` (admission, blocks, batches), the public step or the device loop
    (``driver``), one commit rule (``commit_rule``). Greedy output is plain greedy's.

    Args:
      target: ``TargetModel(model, params)``, a ``(model, params)`` pair (``model`` a
        ``specjax.Target``) or a decoder's ``Pretrained``; proposer: ``specjax.make_proposer``'s or None.
      max_model_len: prompt + output cap; block_size: tokens per KV block; max_num_seqs:
        running requests at most; num_blocks: the KV pool (default: ``max_num_seqs``
        requests at ``max_model_len`` plus the null block: never preempts);
        gpu_memory_utilization: instead, the pool from this fraction of the device's memory
        (vLLM's meaning; ``specjax.engine.memory``; may preempt).
      kv_dtype: None: the params' (``params_kv_dtype``); mesh, tp_axis: tensor parallelism.
      logits_processors, logprobs_mode: docs/sampling.md.
      options: ``LoopOptions``; ``self.options`` holds them with ``steps_per_sync``,
        ``overlap`` and ``max_num_batched_tokens`` resolved.

    Raises ValueError / TypeError naming the argument before anything is allocated."""

    def __init__(self, target, proposer: Proposer | None = None, *, max_model_len: int,
                 block_size: int = 16, max_num_seqs: int = 8, num_blocks: int | None = None,
                 gpu_memory_utilization: float | None = None, kv_dtype=None, mesh: Any = None, tp_axis: str = "tp",
                 logits_processors: tuple = (), logprobs_mode: str = "raw_logprobs",
                 options: LoopOptions | None = None) -> None:
        from specjax.models import Pretrained
        from specjax.models.config import DECODER_KINDS

        opts = LoopOptions() if options is None else \
            check_type("options", options, LoopOptions, "a specjax.engine.LoopOptions or None")
        check_logprobs_mode(logprobs_mode)
        if isinstance(target, Pretrained):
            if target.kind not in DECODER_KINDS:
                raise ValueError(f"target is a {target.kind!r} checkpoint, not a decoder LM (one "
                                 f"of {sorted(DECODER_KINDS)})")
            target = TargetModel(target.model, target.params)
        if isinstance(target, tuple) and not isinstance(target, TargetModel):
            if len(target) != 2:
                raise ValueError("target must be TargetModel(model, params) or a (model, params) pair")
            target = TargetModel(*target)
        if not isinstance(target, TargetModel):
            raise ValueError("target must be TargetModel(model, params) with a specjax.Target "
                             f"model (e.g. a specjax.models.DecoderLM), got {type(target).__name__}")
        check_target(target.model, "target.model")
        if proposer is not None and not isinstance(proposer, Proposer):
            raise ValueError(f"proposer must come from specjax.make_proposer (a Proposer) or be None, "
                             f"got {type(proposer).__name__}")
        check_engine_args(target.model, max_model_len=max_model_len, block_size=block_size,
                          max_num_seqs=max_num_seqs, kv_dtype=kv_dtype,
                          num_blocks=num_blocks if gpu_memory_utilization is None else 2,
                          buckets=(opts.batch_buckets, opts.query_buckets, opts.context_buckets),
                          k=0 if proposer is None else proposer.num_speculative_tokens,
                          params=target.params, proposer=proposer)
        if gpu_memory_utilization is not None:
            from specjax.engine.memory import _check_fraction

            _check_fraction(gpu_memory_utilization)
        feed = None if proposer is None else proposer.feed
        if feed is not None:
            for name, got, want in (("block_size", feed.block_size, block_size),
                                    ("max_model_len", feed.max_model_len, max_model_len)):
                if got is not None and got != want:
                    raise ValueError(f"the proposer was built with {name}={got}, the engine uses {want}")
        # The public step: the proposer's Feed decides everything below.
        self.step = make_step(target.model, proposer, mesh=mesh, tp_axis=tp_axis,
                              tree_verification=opts.tree_verification,
                              logits_processors=logits_processors, logprobs_mode=logprobs_mode,
                              fuse_projections=opts.fuse_projections)
        self.feed = feed
        self.proposer = self.step.proposer
        self.k = self.step.k
        self.mesh, self.tp_axis = mesh, tp_axis
        self.target = TargetModel(self.step.target, self.step.place_target_params(target.params))
        if opts.max_num_batched_tokens is None:
            opts = dataclasses.replace(opts, max_num_batched_tokens=(
                DEFAULT_CPU_MAX_NUM_BATCHED_TOKENS if _on_cpu(self.target.params)
                else DEFAULT_MAX_NUM_BATCHED_TOKENS))
        _check_budget(opts, int(max_model_len), int(block_size))
        self.vocab_size = self.step.vocab_size
        self.max_model_len = int(max_model_len)
        self.block_size = int(block_size)
        self.max_num_seqs = int(max_num_seqs)
        self.kv_dtype = params_kv_dtype(target.params) if kv_dtype is None else kv_dtype
        self.workspace_bytes = 0     # what the pool leaves free for the step's temp
        if gpu_memory_utilization is not None:
            from specjax.engine.memory import pool_from_memory

            if num_blocks is not None:
                raise ArgumentError(f"num_blocks={num_blocks} and gpu_memory_utilization="
                                    f"{gpu_memory_utilization}: give one (the pool's size)")
            num_blocks, self.workspace_bytes = pool_from_memory(
                self.step, self.target.params, fraction=gpu_memory_utilization,
                block_size=self.block_size, kv_dtype=self.kv_dtype,
                max_model_len=self.max_model_len, max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=opts.max_num_batched_tokens)
        self.num_blocks = 1 + self.max_num_seqs * -(-self.max_model_len // self.block_size) \
            if num_blocks is None else int(num_blocks)
        self.drafts_in = "none" if feed is None else feed.drafts_in
        #: KV slots the proposer writes past the verified tokens (vLLM's num_lookahead_tokens)
        self.lookahead = 0 if feed is None else feed.lookahead
        #: the drafter's context limit when shorter than max_model_len (else None)
        self.drafter_max_model_len = None if feed is None else feed.drafter_max_model_len
        self.tree = self.step.tree
        sched_k = getattr(getattr(self.proposer, "config", None),
                          "num_speculative_tokens_per_batch_size", None)
        #: ``dense[n]``: k after a step of n requests (None: always k)
        self.k_lookup = None if sched_k is None else k_schedule_lookup(
            sched_k, self.max_num_seqs, self.k)
        #: ``adaptive_k``'s seconds per step: batch bucket -> ``[k + 1]`` (K = 0..k)
        self.k_costs: dict[int, np.ndarray] = {}
        #: its seconds per device-loop step of flat token slots: bucket -> {(K, T): s}
        self.k_token_costs: dict[int, dict[tuple[int, int], float]] = {}
        self._k_now: int | None = None       # adaptive_k's choice for the step being set up
        if (av := getattr(getattr(self.proposer, "config", None), "enable_adaptive_verification",
                          False)) and opts.adaptive_k:
            raise ValueError("options.adaptive_k=True and enable_adaptive_verification=True both "
                             "choose the drafts each step verifies: set one")
        #: vLLM's adaptive verification (``enable_adaptive_verification``), else None
        self.verifier = AdaptiveVerifier(self.k, self.proposer) if av else None
        #: length of the per-position acceptance counts: k, or the tree's depth
        self.num_spec_positions = self.k if self.tree is None else self.tree.depth
        self.scheduler = Scheduler(max_model_len=self.max_model_len, block_size=self.block_size,
                                   max_num_seqs=self.max_num_seqs, num_blocks=self.num_blocks,
                                   k=self.k, lookahead=self.lookahead, tree=self.tree,
                                   options=opts)
        self.scheduler.draft_slots = self.step._spec.draft_sampling
        self.commit_rule = CommitRule(self.max_model_len, self.tree,
                                      None if self.proposer is None else self.num_spec_positions)
        self.driver = DeviceLoopDriver(self)
        why = loop_support(self.step)
        n = opts.steps_per_sync or (DEFAULT_STEPS_PER_SYNC if why is None else 1)
        self.options = dataclasses.replace(opts, steps_per_sync=n)
        if opts.overlap is None:
            overlap = why is None and (n > 1 or False in self.driver.forms())
        else:
            overlap = opts.overlap
        self.options = dataclasses.replace(self.options, overlap=overlap)
        #: device-to-host round trips so far (one per step, or per device-loop call)
        self.num_syncs = 0
        #: seconds the host spent building / dispatching / committing steps (host_s) and
        #: blocked waiting for the device's results (wait_s), over every generate call
        self.host_s = self.wait_s = 0.0
        if n > 1 and why is not None:
            raise ValueError(f"steps_per_sync={n}: {why}")
        if overlap and why is not None:
            raise ValueError(f"overlap=True: {why}; its next step's drafts come from this "
                             "step's tokens on the host, so it cannot be dispatched earlier")
        self._reset_cache()

    @property
    def diagnostics(self) -> Diagnostics:
        """Benchmark probes of this engine's step (``time_decode_step``, ...)."""
        return Diagnostics(self)

    def _reset_cache(self) -> None:
        self.target_kv, self.draft_state = self.step.init_caches(
            self.num_blocks, self.block_size, self.kv_dtype, max_num_seqs=self.max_num_seqs)
        self.scheduler.reset()

    def _check_inputs(self, prompts, sampling_params) -> tuple[list[list[int]], list[SamplingParams]]:
        if isinstance(prompts, np.ndarray) and prompts.ndim == 2:
            prompts = list(prompts)
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or len(prompts) == 0:
            raise ValueError("prompts must be a non-empty list of token-id lists")
        out = []
        for i, p in enumerate(prompts):
            arr = np.asarray(p)
            if arr.ndim != 1 or arr.size == 0 or not (np.issubdtype(arr.dtype, np.integer)):
                raise ValueError(f"prompts[{i}] must be a non-empty list of int token ids")
            if arr.min() < 0 or arr.max() >= self.vocab_size:
                bad = int(arr[(arr < 0) | (arr >= self.vocab_size)][0])
                raise ValueError(f"prompts[{i}] holds token id {bad}, outside the target's vocabulary "
                                 f"[0, {self.vocab_size})")
            if arr.size >= self.max_model_len:
                raise ValueError(f"prompts[{i}] has {arr.size} tokens; max_model_len={self.max_model_len} "
                                 "leaves no room to generate")
            out.append([int(t) for t in arr])
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sps = [sampling_params] * len(out)
        else:
            sps = list(sampling_params)
            if len(sps) != len(out):
                raise ValueError(f"sampling_params has {len(sps)} entries for {len(out)} prompts")
            if not all(isinstance(s, SamplingParams) for s in sps):
                raise ValueError("sampling_params must be a SamplingParams or a list of them")
        for i, sp in enumerate(sps):
            nk = sp.num_speculative_tokens
            if nk is not None and nk not in range(self.k + 1):
                raise ValueError(f"sampling_params[{i}].num_speculative_tokens={nk}: this engine "
                                 f"verifies at most k={self.k} drafts (allowed: None, 0..{self.k})")
            if nk not in (None, self.k) and self.tree is not None:
                raise ValueError(f"sampling_params[{i}].num_speculative_tokens={nk}: a token "
                                 "tree's drafts are not capped per request (allowed: None, "
                                 f"{self.k})")
        self.scheduler.check_fits(out, sps)
        return out, sps

    def _k_rises(self, n: int) -> bool:
        """Whether a finish among ``n`` requests would raise the schedule's K."""
        return self.k_lookup is not None and 1 < n <= self.max_num_seqs and \
            int(self.k_lookup[1:n].max()) > int(self.k_lookup[n])

    def k_for(self, r: _Request, num_reqs: int) -> int:
        """Drafts ``r`` verifies after a step of ``num_reqs`` requests: k capped by the
        schedule, ``adaptive_k``'s choice and the request's ``num_speculative_tokens``."""
        k = self.k
        if self.k_lookup is not None:
            k = min(k, int(self.k_lookup[min(max(num_reqs, 1), self.max_num_seqs)]))
        if self._k_now is not None:
            k = min(k, self._k_now)
        nk = r.params.num_speculative_tokens
        return k if nk is None else min(k, nk)

    def policy_k(self, running: list[_Request]) -> int | None:
        """``adaptive_k``'s K for the next step of ``running`` (None: off):
        :func:`~specjax.adaptive_k.choose_k` under this batch bucket's ``k_costs``."""
        if not self.options.adaptive_k or self.k == 0 or not running:
            return None
        cost = self._costs(len(running))
        self._k_now = None
        caps = np.array([self.k_for(r, len(running)) for r in running])
        rates = acceptance_rate(np.array([r.acc_hits for r in running]),
                                np.array([r.acc_trials for r in running]))
        return choose_k(rates, caps, cost)

    def _costs(self, n: int) -> np.ndarray:
        """``k_costs`` of the batch bucket of ``n`` requests (profiled when first needed)."""
        b = self.scheduler.buckets(n, 1, 1)[0]
        if b not in self.k_costs:
            self.profile_k_costs([b])
        return self.k_costs[b]

    def observe(self, r: _Request, drafts: int, accepted: int) -> None:
        """One step's acceptance evidence of ``r`` (``LoopOptions.adaptive_k``)."""
        if self.options.adaptive_k:
            h, t = observe_acceptance(np.float64(r.acc_hits), np.float64(r.acc_trials),
                                      np.int64(drafts), np.int64(accepted))
            r.acc_hits, r.acc_trials = float(h), float(t)

    def profile_k_costs(self, batch_sizes: Sequence[int], reps: int = 3) -> dict:
        """:func:`specjax.engine.verification.profile_k_costs`."""
        return profile_k_costs(self, batch_sizes, reps)

    # -- public --------------------------------------------------------------------

    def generate(self, prompts: Sequence[Sequence[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 eos_token_id: int | None = None, seed: int = 0,
                 stat_loggers: Iterable[Callable[[SpecDecodingStats], None]] = (),
                 progress: Callable[[int, int, int, int], None] | None = None,
                 arrival_times: Sequence[float] | None = None) -> GenerateResult:
        """Generate for every prompt; see :func:`generate`."""
        prompts, sps = self._check_inputs(prompts, sampling_params)
        check_opt_int("eos_token_id", eos_token_id, 0, self.vocab_size - 1,
                      why="a token id of the target's vocabulary")
        check_int("seed", seed, 0, 2**63 - 1)
        arrivals = _check_arrivals(arrival_times, len(prompts))
        stat_loggers = list(stat_loggers)
        sched, opts = self.scheduler, self.options
        rng = np.random.default_rng(seed)
        reqs = []
        for i, (p, sp) in enumerate(zip(prompts, sps)):
            stops = set(sp.stop_token_ids)
            if eos_token_id is not None and not sp.ignore_eos:
                stops.add(int(eos_token_id))
            r = _Request(index=i, req_id=f"req-{next(_req_counter)}", prompt=p, params=sp,
                         seed=int(sp.seed if sp.seed is not None else rng.integers(0, 2**31 - 1)) % 2**32,
                         stop_ids=frozenset(stops), arrival=arrivals[i])
            r.proc = sp.processing(stops)
            check_request(f"sampling_params[{i}]", r.proc, sched.processor_limits,
                          self.vocab_size, len(self.step.logits_processors))
            reqs.append(r)
        waiting = collections.deque(sorted(reqs, key=lambda r: r.arrival))   # FCFS by arrival
        running: list[_Request] = []
        total = SpecDecodingStats.new(self.num_spec_positions)
        steps, done, preemptions0 = 0, 0, sched.num_preemptions
        t0 = time.perf_counter()
        now = lambda: time.perf_counter() - t0  # noqa: E731
        inflight: _InFlight | None = None       # overlap: a device-loop call not committed yet
        try:
            while waiting or running:
                batch_reqs = running
                if inflight is None:     # (none can join before a request in flight finishes)
                    if not running and waiting[0].arrival > now():
                        time.sleep(waiting[0].arrival - now())
                    batch_reqs = sched.schedule(waiting, running, now())
                    t = now()
                    for r in batch_reqs:
                        if r.first_scheduled < 0:
                            r.first_scheduled = t
                if inflight is not None or self._decode_only(batch_reqs, running):
                    if inflight is None:    # a sync point: blocks for the call, or preempt
                        sched.reserve_loop(running, waiting, opts.steps_per_sync)
                    # a finish that raises the schedule's K ends the call (K per step)
                    k_up = self._k_rises(len(running))
                    if opts.overlap and not waiting and not k_up:   # (none waits until drained)
                        results, inflight = self.driver.sync_overlapped(running, inflight,
                                                                        stop_on_finish=False)
                    else:
                        results = self.driver.sync(running, stop_on_finish=bool(waiting) or k_up)
                else:
                    results = [self._step(batch_reqs, running)]
                self.num_syncs += 1
                t = now()
                for r in running:
                    r.token_times += [t] * (len(r.output) - len(r.token_times))
                for stats, finished in results:     # one entry per iteration
                    steps += 1
                    if stats is not None:
                        for f in stat_loggers:
                            f(stats)
                        _accumulate(total, stats)
                    for r in finished:
                        r.token_times += [t] * (len(r.output) - len(r.token_times))
                        r.finished_time = t
                        running.remove(r)
                        sched.release(r)
                    if finished and self.proposer is not None:   # (a suffix corpus learns now)
                        self.proposer.finish_requests(*_Request.documents(finished))
                    done += len(finished)
                    if progress is not None:
                        progress(done, len(reqs), sum(len(r.output) for r in reqs),
                                 sum(1 for r in reqs if r.output))
        finally:
            if self.proposer is not None:
                self.proposer.finish_requests([r.req_id for r in reqs])
            for r in running:
                sched.release(r)
        elapsed = time.perf_counter() - t0
        outs = [RequestOutput(r.prompt, r.output, r.finish_reason, r.num_drafted, r.num_accepted,
                              None if r.params.logprobs is None else r.logprobs) for r in reqs]
        return GenerateResult(outs, total, steps, elapsed, sched.num_preemptions - preemptions0,
                              [_metrics(r) for r in reqs])

    def _decode_only(self, batch_reqs: list[_Request], running: list[_Request]) -> bool:
        """Whether the device loop takes the next iterations: it runs (``steps_per_sync > 1``
        or ``overlap``), every running request was scheduled and decodes (one uncomputed
        token) and ``k + 1`` tokens each fit the budget."""
        opts = self.options
        return (opts.steps_per_sync > 1 or opts.overlap) and len(batch_reqs) == len(running) \
            and len(running) * (self.k + 1) <= opts.max_num_batched_tokens \
            and all(r.num_tokens - r.num_computed == 1 for r in running)

    def warmup(self, batch_sizes: Sequence[int], query_lens: Sequence[int],
               context_blocks: Sequence[int] | None = None, *, all_greedy: Sequence[bool] = (True,),
               stop_pads: Sequence[int] = (1, 2), logits_processing: Sequence[bool] = (False,),
               num_logprobs: Sequence[int | None] = (None,),
               num_tokens: Sequence[int] | None = None,
               num_speculative_tokens: Sequence[int] | None = None) -> int:
        """Compile the step for every combination of the given buckets (dummy batches that
        write nothing; ``context_blocks`` None: the widest) and, where the device loop runs, the
        loop for every batch size, width, ``all_greedy``, ``stop_pads`` (stop-id columns: a power
        of two) and form. ``logits_processing``: plain (False) and / or processing (True)
        variants; ``num_logprobs``: each largest ``SamplingParams.logprobs`` a batch can hold
        (None: none asks); ``num_tokens``: ragged steps' token slots (``Scheduler.step_slots``;
        None: rows x ``query_lens`` only); ``num_speculative_tokens``: the device loop's draft
        counts (``k_for``; None: the schedule's, else k). Returns the variants compiled."""
        sched, opts = self.scheduler, self.options
        lps = sorted({logprobs_bucket([check_num_logprobs("num_logprobs", n)]) for n in num_logprobs},
                     key=lambda n: -1 if n is None else n)
        if context_blocks is None:
            context_blocks = [sched.max_blocks_per_req]
        before = step_cache_size() + loop_cache_size()
        phases = (False,) if self.tree is None else (False, True)
        tokens = (None,) if num_tokens is None else tuple(
            check_int(f"num_tokens[{i}]", t, 1) for i, t in enumerate(num_tokens))
        for b, q, c, g, tv, pr, lp, t in itertools.product(
                batch_sizes, query_lens, context_blocks, all_greedy, phases, logits_processing,
                lps, tokens):
            if int(b) * int(q) < opts.min_tokens_per_step:      # as Scheduler.buckets pads it
                q = _pick(opts.query_buckets, -(-opts.min_tokens_per_step // int(b)),
                          name="query_buckets", what="min_tokens_per_step over the rows")
            if t is not None:
                t, q = sched.step_slots(int(b), int(q), min(t, sched.budget or t))
            batch = sched.dummy_batch(int(b), int(q), int(c), tree_verify=tv, all_greedy=bool(g),
                                      num_tokens=t)
            if pr:
                batch = dataclasses.replace(batch, procs=sched.empty_procs(int(b)))
            jax.block_until_ready(self._run(dataclasses.replace(batch, num_logprobs=lp)))
        if opts.steps_per_sync > 1 or opts.overlap:   # the device loop runs
            if num_speculative_tokens is None:
                ks = (list(range(self.k + 1)) if opts.adaptive_k else [self.k]
                      if self.k_lookup is None else sorted(set(self.k_lookup[1:].tolist())))
            else:
                ks = [check_int(f"num_speculative_tokens[{i}]", x, 0, self.k)
                      for i, x in enumerate(num_speculative_tokens)]
            for b, c, g, s, pr, lp, ee, kk in itertools.product(
                    batch_sizes, context_blocks, all_greedy, stop_pads, logits_processing, lps,
                    self.driver.forms(), ks):
                _, q, _ = sched.buckets(int(b), kk + 1, 1, kk)
                # adaptive_k: each flat token slot count as well (k_cap given: rows differ)
                flat = self.driver.token_options(int(b), kk) if opts.adaptive_k else []
                for t in [None] + flat:
                    state = make_loop_state(
                        last_token=[], num_computed=[], drafts=[], max_tokens=[],
                        num_output=[], block_ids=[], k=self.k, num_reqs_pad=int(b),
                        blocks_per_req_pad=int(c), num_tokens_pad=t,
                        k_cap=None if kk == self.k and t is None else [], query_len_pad=q,
                        max_model_len=self.max_model_len, block_size=self.block_size,
                        stop_pad=int(s), history=[] if loop_history(self.step) else None,
                        procs=sched.empty_procs(int(b)) if pr else None)
                    out, self.target_kv, self.draft_state, _ = decode_loop(
                        self.step, self.target.params, self.step.draft_params, self.target_kv,
                        self.draft_state, dataclasses.replace(
                            state, all_greedy=bool(g), num_logprobs=lp,
                            draft_len=None if kk == self.k else kk),
                        steps_per_sync=opts.steps_per_sync, early_exit=ee,
                        drafter_state=getattr(self.proposer, "device_drafter_state", None))
                    jax.block_until_ready(out)
        n = step_cache_size() + loop_cache_size() - before
        if self.proposer is not None:
            self.proposer.warmup_finish(self.max_num_seqs)
        if (opts.adaptive_k or self.verifier is not None) and self.k:
            self.profile_k_costs(batch_sizes)
        return n

    # -- one step ------------------------------------------------------------------

    def _run(self, batch: StepBatch, draft_len: int | None = None) -> StepOutput:
        """Run the public step on ``batch`` (caches and state donated and replaced)."""
        out, self.target_kv, self.draft_state = self.step(
            self.target.params, self.step.draft_params, self.target_kv, self.draft_state, batch,
            draft_len=draft_len)
        return out

    def _trim(self, r: _Request, drafts: list[int], num_reqs: int) -> list[int]:
        """``drafts`` cut to what ``r`` can verify next after a step of ``num_reqs`` requests
        (``trim_drafts``: never past :meth:`k_for`, ``max_model_len``, ``max_tokens`` or the
        drafter's limit; a token outside the vocabulary, from a buggy proposer, ends them)."""
        kv_room = self.max_model_len - r.num_tokens
        lim = self.drafter_max_model_len
        r.k_cap = self.k_for(r, num_reqs)
        d = trim_drafts(drafts, max_new_tokens=min(kv_room, r.params.max_tokens - len(r.output)),
                        kv_room=kv_room, k=self.k, vocab_size=self.vocab_size, tree=self.tree,
                        drafter_room=None if lim is None else lim - r.num_tokens)
        return d if self.tree is not None else d[: r.k_cap]

    def _step(self, reqs: list[_Request], running: list[_Request]
              ) -> tuple[SpecDecodingStats | None, list[_Request]]:
        """One step of the scheduled ``reqs`` (of ``running``) and its commit."""
        # Tree mode: the tree mask is static for the whole batch and a prompt needs causal
        # attention, so a step with a prompt to prefill is a chain step in which nobody
        # verifies drafts (decoding requests verify just their root and get redrafted);
        # every other step is a tree-verification step.
        tree_verify = self.tree is not None and all(
            r.num_tokens - r.num_computed == 1 for r in reqs)
        if self.tree is not None and not tree_verify:
            for r in running:
                r.drafts = []
        running = reqs
        t0 = time.perf_counter()
        before = [(r.num_drafted, r.num_accepted) for r in running]
        batch, qlens, b_pad = self.scheduler.build_batch(running, tree_verify=tree_verify)
        partial = [q < r.num_tokens - r.num_computed for q, r in zip(qlens, running)]
        dev = self._run(batch)
        t1 = time.perf_counter()
        out = jax.device_get(dev)       # one fetch of the step's results
        t2 = time.perf_counter()
        self.wait_s += t2 - t1
        tok_buf = self.scheduler.tok_buf
        stats, finished, gained = self.commit_rule.step(running, out, qlens, tok_buf)
        if self.verifier is not None:
            self.verifier.observe(running, [r.num_drafted - d for r, (d, _) in zip(running, before)],
                                  [r.num_accepted - a for r, (_, a) in zip(running, before)])
        # a partial prefill drafts nothing (its drafter only wrote the chunk's KV)
        alive = [i for i, r in enumerate(running) if not r.finish_reason and not partial[i]]
        if self.drafts_in in ("step", "split"):
            feats = None if self.verifier is None else self.verifier.features(out, self.proposer)
            for i in alive:
                running[i].drafts = out.drafts[i, : int(out.num_drafts[i])].tolist()
                if feats is not None:
                    running[i].draft_features = feats[i]
            if getattr(self.proposer, "first_stage", None) is not None and alive:  # history_first
                new = self.proposer.redraft(_history(running, alive, gained, tok_buf, b_pad),
                                            [running[i].drafts for i in alive])
                for i, d in zip(alive, new):
                    running[i].drafts = d
        elif self.drafts_in == "history" and alive:
            hist = _history(running, alive, gained, tok_buf, b_pad)
            drafted = self.proposer.propose_from_history(hist)
            tok, cnt = np.asarray(drafted.token_ids), np.asarray(drafted.num_drafts)
            feats = None if self.verifier is None else self.verifier.features(drafted, self.proposer)
            for j, i in enumerate(alive):
                running[i].drafts = tok[j, : int(cnt[j])].tolist()
                running[i].draft_features = None if feats is None else np.asarray(feats[j])
        for r, (d0, a0) in zip(running, before):
            self.observe(r, r.num_drafted - d0, r.num_accepted - a0)
        self._k_now = self.policy_k([running[i] for i in alive])
        for i in alive:
            running[i].drafts = self._trim(running[i], running[i].drafts, len(running))
        self._k_now = None
        if self.verifier is not None and alive:
            self.verifier.admit([running[i] for i in alive], len(alive),
                                self._costs(len(running)))
        self.host_s += (t1 - t0) + (time.perf_counter() - t2)
        return stats, finished


def _history(running: list[_Request], alive: list[int], gained, tok_buf, b_pad) -> TokenHistory:
    """The ``TokenHistory`` of the ``alive`` rows of ``running`` after a step."""
    return TokenHistory(
        req_ids=[running[i].req_id for i in alive], token_ids=tok_buf[[running[i].row for i in alive]],
        num_tokens=np.array([running[i].num_tokens for i in alive], _I32),
        num_prompt_tokens=np.array([len(running[i].prompt) for i in alive], _I32),
        sampled_token_ids=[gained[i] for i in alive], rows_pad=b_pad)


def _check_budget(opts: LoopOptions, max_model_len: int, block_size: int) -> None:
    """ValueError naming the field: a token budget below one block, or (chunked prefill
    off) below ``max_model_len`` or with a per-request threshold."""
    budget = opts.max_num_batched_tokens
    if budget < block_size:
        raise ArgumentError(f"max_num_batched_tokens={budget} is below one KV block "
                            f"(block_size={block_size}): give at least {block_size}")
    if not opts.enable_chunked_prefill:
        if budget < max_model_len:
            raise ArgumentError(
                f"max_num_batched_tokens={budget} is below max_model_len={max_model_len} with "
                "enable_chunked_prefill=False: a prompt must prefill in one step (raise the "
                "budget, lower max_model_len or enable chunked prefill)")
        if opts.long_prefill_token_threshold:
            raise ArgumentError(
                f"long_prefill_token_threshold={opts.long_prefill_token_threshold} chunks "
                "prompts, but enable_chunked_prefill=False: set it to 0 or enable chunking")


def _check_arrivals(arrival_times: Any, n: int) -> list[float]:
    """``arrival_times`` (None: all 0) as ``n`` finite seconds >= 0 (ValueError naming it)."""
    if arrival_times is None:
        return [0.0] * n
    a = np.asarray(arrival_times)
    if a.shape != (n,) or not (np.issubdtype(a.dtype, np.integer) or np.issubdtype(
            a.dtype, np.floating)) or not np.isfinite(a).all() or (a < 0).any():
        raise ArgumentError(f"arrival_times must be {n} finite seconds >= 0 (one per prompt), "
                            f"got {show(arrival_times)}")
    return [float(x) for x in a]


def _metrics(r: _Request) -> RequestMetrics:
    """``r``'s timeline (-1 for what never happened)."""
    return RequestMetrics(r.arrival, r.first_scheduled, r.token_times[0] if r.token_times else -1.0,
                          r.finished_time, list(r.token_times), r.num_preemptions)


def _accumulate(total: SpecDecodingStats, s: SpecDecodingStats) -> None:
    total.num_drafts += s.num_drafts
    total.num_draft_tokens += s.num_draft_tokens
    total.num_accepted_tokens += s.num_accepted_tokens
    for p, a in enumerate(s.num_accepted_tokens_per_pos):
        total.num_accepted_tokens_per_pos[p] += a


#: Engine's keyword parameters: the options ``generate`` passes on.
_ENGINE_OPTIONS = tuple(n for n, p in inspect.signature(Engine.__init__).parameters.items()
                        if p.kind is inspect.Parameter.KEYWORD_ONLY)


def generate(target, proposer: Proposer | None, prompts: Sequence[Sequence[int]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
             eos_token_id: int | None = None, seed: int = 0,
             stat_loggers: Iterable[Callable[[SpecDecodingStats], None]] = (),
             progress: Callable[[int, int, int, int], None] | None = None,
             arrival_times: Sequence[float] | None = None,
             **engine_options) -> GenerateResult:
    """Batched generation with speculative decoding (``proposer``) or plain decoding (None).

    ``target``, ``proposer``: as :class:`Engine`'s. ``prompts``: non-empty token-id lists.
    ``sampling_params``: one ``SamplingParams`` for all or one per prompt. ``eos_token_id``:
    a stop token of every request without ``ignore_eos``. ``seed``: draws the seeds of
    unseeded requests. ``stat_loggers``: called with each iteration's ``SpecDecodingStats``.
    ``progress``: called after each iteration with ``(finished, total, generated_tokens,
    started)``, ``started`` the requests holding at least one generated token.
    ``arrival_times``: seconds after the start at which each request may be admitted (None:
    all at once); ``GenerateResult.request_metrics`` holds each one's timeline.
    ``engine_options``: :class:`Engine`'s keyword arguments (``max_model_len`` and
    ``block_size`` default to the proposer's, else 2048 and 16; ``max_num_seqs`` to every
    prompt at once, at most 256). Returns ``GenerateResult``. Raises TypeError for an unknown
    option (listing the allowed ones), ValueError / TypeError naming a bad argument."""
    bad = sorted(set(engine_options) - set(_ENGINE_OPTIONS))
    if bad:
        fields = {f.name for f in dataclasses.fields(LoopOptions)}
        hint = "".join(f"; {b} is a LoopOptions field: options=LoopOptions({b}=...)"
                       for b in bad if b in fields)
        raise ArgumentTypeError(f"generate() got unknown option(s) {show(bad)}; allowed: "
                                f"{show(sorted(_ENGINE_OPTIONS), 600)}{hint}")
    feed = proposer.feed if isinstance(proposer, Proposer) else None
    kw = dict(engine_options)
    if kw.get("max_model_len") is None:
        kw["max_model_len"] = (feed and feed.max_model_len) or 2048
    if kw.get("block_size") is None:
        kw["block_size"] = (feed and feed.block_size) or 16
    if kw.get("max_num_seqs") is None:   # all at once, up to 256
        kw["max_num_seqs"] = min(256, max(1, len(prompts))) if hasattr(prompts, "__len__") else 1
    engine = Engine(target, proposer, **kw)
    return engine.generate(prompts, sampling_params, eos_token_id=eos_token_id, seed=seed,
                           stat_loggers=stat_loggers, progress=progress,
                           arrival_times=arrival_times)

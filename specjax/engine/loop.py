"""The reference decoding loop: ``Engine`` (scheduler, block pool, the public step per
iteration, commit) and ``generate``."""

from __future__ import annotations

import collections
import dataclasses
import itertools
import time
from typing import Any, Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax.runtime.batch import NULL_BLOCK, build_batch, trim_drafts
from specjax.checks import check_int, check_opt_int
from specjax.engine.checks import check_engine_args as _check_engine_args
from specjax.sampling.logits_processors import (ProcessorLimits, check_limits, check_request,
                                       make_processor_state)
from specjax.runtime.decode_loop import decode_loop, loop_cache_size, loop_support, make_loop_state
from specjax.engine.device_loop import DeviceLoop, _InFlight
from specjax.engine.diagnostics import Diagnostics
from specjax.engine.scheduler import _pick, _Request
from specjax.engine.types import GenerateResult, RequestOutput, SamplingParams, TargetModel
from specjax.sampling.logprobs import (check_logprobs_mode, check_num_logprobs, logprobs_bucket,
                              request_logprobs)
from specjax.metrics import SpecDecodingStats
from specjax.proposers import Proposer, TokenHistory
from specjax.sampling import PLACEHOLDER_TOKEN_ID
from specjax.runtime.step import StepBatch, StepOutput, make_step, params_kv_dtype, step_cache_size

_NULL_BLOCK = NULL_BLOCK
#: Iterations per host sync of the device loop when ``steps_per_sync`` is not given (the
#: measured choice: docs/performance.md).
DEFAULT_STEPS_PER_SYNC = 8
_I32 = np.int32
_req_counter = itertools.count()


class Engine(DeviceLoop, Diagnostics):
    """A target, a proposer (or None), a paged KV cache, and the decoding loop.

    Args:
      target: ``TargetModel(model, params)``, a ``(model, params)`` tuple, or a decoder's
        ``Pretrained`` (``specjax.load_pretrained``); ``model`` is a
        ``specjax.models.DecoderLM``. When the proposer needs aux hidden states, the runner
        is rebuilt with the proposer's ``aux_layer_ids``.
      proposer: from ``specjax.make_proposer``, or None for plain decoding.
      max_model_len: context cap (prompt + output).
      block_size: tokens per KV block.
      max_num_seqs: most requests running at once (the rest wait).
      num_blocks: size of the KV block pool (default: enough for ``max_num_seqs`` requests
        at ``max_model_len``, plus the null block).
      batch_buckets / query_buckets / context_buckets: padded sizes the jitted step is
        compiled for: rows, tokens per request (``T = rows * query``), block-table width in
        blocks. None: powers of two (context capped at ``max_model_len``). Fewer buckets,
        fewer compilations.
      kv_dtype: KV caches' dtype; None (default): the target params' (``step.params_kv_dtype``).
      min_tokens_per_step: pad every step to at least this many tokens (``B_pad *
        query_len >= min_tokens_per_step``, the query bucket rising as needed; default 1:
        no padding). The padding token writes nothing (slot -1) and is not sampled. It was
        2 until the one-token step's causes were fixed in the models
        (``specjax.models.params.two_row_matmul``; the fused KV-cache write): on the H200 the
        unpadded one-token step now runs as fast as the padded one (``benchmarks/RESULTS.md``).
      tree_verification: None (default): verify trees when the proposer's token tree
        branches (see the module docstring), chains otherwise; True: the tree path even
        for a chain tree (tests, benchmarks; needs a device model proposer); False: chain
        verification.
      mesh: a ``jax.sharding.Mesh`` for tensor parallelism (None: one device). The target's
        params and KV caches, and a device proposer's params and state, are placed with
        ``specjax.sharding``'s Megatron rules over its ``tp_axis`` axis (attention by kv
        head, MLP by intermediate size, vocabulary-split heads; other axes replicate); XLA's
        partitioner follows those placements through the jitted step. A proposer with
        ``mesh`` / ``vocab_axis`` fields (EAGLE, EAGLE-3, DFlash, draft model) gets them, so
        its ``config.use_local_argmax_reduction`` reduces over the vocabulary shards
        (``Proposer.on_mesh``, through ``specjax.runtime.step.make_step``).
        Indivisible head / intermediate / vocabulary sizes raise ValueError naming the
        parameter, before anything is placed.
      tp_axis: the mesh axis to shard over (default ``"tp"``).
      steps_per_sync: decoding iterations per host sync. None (default):
        :data:`DEFAULT_STEPS_PER_SYNC` where the device loop runs this proposer (plain
        decoding and every device proposer), else 1 (host n-gram, suffix, the non-padded
        drafter batch). ``1`` is the per-step loop; ``N > 1`` runs up to ``N`` iterations of a batch in which every request decodes in
        ONE jitted program (``specjax.runtime.decode_loop``), syncing early when a request finishes
        and another is waiting; steps that prefill a prompt stay per-step. The same tokens
        as ``steps_per_sync=1`` (greedy and seeded sampling; tree verification too).
        Proposers the device loop does not run (host n-gram, suffix, the non-padded drafter
        batch) are refused by name.
      logits_processors: a static tuple of user logits processors (pure JAX functions,
        ``specjax.sampling.logits_processors``; a request picks one with
        ``SamplingParams.logits_processor``). See docs/sampling.md.
      processor_limits: ``specjax.sampling.logits_processors.ProcessorLimits``, the fixed padded
        sizes of logit_bias, bad_words, allowed_token_ids, min_tokens' stop ids and
        processor parameters (a request beyond one is refused naming it); None: defaults.
      loop_early_exit: the device loop's form (``specjax.runtime.decode_loop.decode_loop``'s
        ``early_exit``): True, a ``lax.while_loop`` that stops at once when every request
        has finished or one finished while another waits; False, always ``steps_per_sync``
        iterations (a known trip count, the rest masked). None (default): False while no
        request waits, True for a call made while one does (so it can join as soon as a
        request finishes); on a CPU target True for every call (XLA:CPU reads no predicate
        back, and a masked iteration costs a whole step). The forms it uses are compiled by
        ``warmup``. On the H200 the
        fixed-trip form launches its iterations without reading a predicate back to the
        host each one, so its dispatch returns while the device computes, which is what
        overlap needs (``benchmarks/RESULTS.md``, eleventh session).
      logprobs_mode: vLLM's ``LogprobsMode`` of the logprobs requests ask for with
        ``SamplingParams.logprobs`` (``specjax.sampling.logprobs.LOGPROBS_MODES``; default
        ``"raw_logprobs"``).
      overlap: host/device overlap of the decoding phase (``specjax.engine.device_loop``):
        the next device-loop call (``steps_per_sync`` iterations, 1 included) is dispatched
        from the previous call's device-resident state before the host commits that call,
        so the host's commit, block allocation and the next call's launch run while the
        device computes. None (default): on where the device loop runs this proposer,
        except per-step (``steps_per_sync=1``) where it runs only the while form (a CPU
        target, or ``loop_early_exit=True``), which gains nothing from it. Measured on the H200 (8B-shaped target): N = 8, the plain loop
        5.05 -> 4.47 ms per iteration at B = 1, EAGLE-3 5.64 -> 5.09 ms (``benchmarks/loop.py
        --early-exit 0 --overlap 0,1``); per-step (``--n 1 --overlap 0,1``), plain 6.25 ->
        4.38 / 6.69 -> 4.61 ms per step at B = 1 / 8, EAGLE-3 7.40 -> 4.99 / 7.96 -> 5.65.
        The same tokens either way. ``True`` is refused by name for proposers the device
        loop does not run (host n-gram, suffix, the non-padded drafter batch: their next
        drafts are computed on the host from the step's tokens, so nothing of the next
        step can be dispatched before they arrive).
      fuse_projections: on one device, run the target and a drafting model with q/k/v and
        gate/up fused into one GEMM each (default True; ``specjax.models.fuse_projections``;
        0.07-0.56 ms per 8B-shaped loop iteration on the H200). Unless the params are
        fused already, the engine holds its own fused copy of those weights: fuse them first
        and drop the original to hold one copy. False: the params as given.
    """

    def __init__(self, target, proposer: Proposer | None = None, *, max_model_len: int,
                 block_size: int = 16, max_num_seqs: int = 8, num_blocks: int | None = None,
                 batch_buckets: Sequence[int] | None = None,
                 query_buckets: Sequence[int] | None = None,
                 context_buckets: Sequence[int] | None = None, kv_dtype=None,
                 min_tokens_per_step: int = 1, tree_verification: bool | None = None,
                 mesh: Any = None, tp_axis: str = "tp", steps_per_sync: int | None = None,
                 loop_early_exit: bool | None = None, logits_processors: tuple = (),
                 processor_limits: ProcessorLimits | None = None,
                 logprobs_mode: str = "raw_logprobs", overlap: bool | None = None,
                 fuse_projections: bool = True) -> None:
        from specjax.models import DecoderLM, Pretrained
        from specjax.models.config import DECODER_KINDS

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
        if not isinstance(target, TargetModel) or not isinstance(target.model, DecoderLM):
            raise ValueError("target must be TargetModel(model, params) with a specjax.models.DecoderLM "
                             f"model, got {type(getattr(target, 'model', target)).__name__}")
        if proposer is not None and not isinstance(proposer, Proposer):
            raise ValueError(f"proposer must come from specjax.make_proposer (a Proposer) or be None, "
                             f"got {type(proposer).__name__}")
        _check_engine_args(target.model, max_model_len=max_model_len, block_size=block_size,
                           max_num_seqs=max_num_seqs, num_blocks=num_blocks,
                           min_tokens_per_step=min_tokens_per_step, kv_dtype=kv_dtype,
                           buckets=(batch_buckets, query_buckets, context_buckets),
                           k=0 if proposer is None else proposer.num_speculative_tokens,
                           params=target.params)
        if steps_per_sync is not None:
            check_int("steps_per_sync", steps_per_sync, 1)
        feed = None if proposer is None else proposer.feed
        if feed is not None:
            for name, got, want in (("block_size", feed.block_size, block_size),
                                    ("max_model_len", feed.max_model_len, max_model_len)):
                if got is not None and got != want:
                    raise ValueError(f"the proposer was built with {name}={got}, the engine uses {want}")
        # The public step: the proposer's Feed decides everything below.
        self.processor_limits = check_limits(processor_limits)
        self.step = make_step(target.model, proposer, mesh=mesh, tp_axis=tp_axis,
                              tree_verification=tree_verification,
                              logits_processors=logits_processors, logprobs_mode=logprobs_mode,
                              fuse_projections=fuse_projections)
        self.feed = feed
        self.proposer = self.step.proposer
        self.k = self.step.k
        self.mesh, self.tp_axis = mesh, tp_axis
        self.target = TargetModel(self.step.target, self.step.place_target_params(target.params))
        self.vocab_size = self.step.vocab_size
        self.max_model_len = int(max_model_len)
        self.block_size = int(block_size)
        self.max_num_seqs = int(max_num_seqs)
        self.min_tokens_per_step = int(min_tokens_per_step)
        self.batch_buckets = None if batch_buckets is None else tuple(sorted(batch_buckets))
        self.query_buckets = None if query_buckets is None else tuple(sorted(query_buckets))
        self.context_buckets = None if context_buckets is None else tuple(sorted(context_buckets))
        # Lookahead: KV slots the proposer writes past the verified tokens (the draft chain,
        # extra slots of draft-model / parallel drafting), allocated ahead like vLLM's
        # num_lookahead_tokens.
        self.lookahead = 0 if feed is None else feed.lookahead
        self.max_blocks_per_req = -(-self.max_model_len // self.block_size)
        if num_blocks is None:
            num_blocks = 1 + self.max_num_seqs * self.max_blocks_per_req
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, (int, np.integer)) or num_blocks < 2:
            raise ValueError(f"num_blocks must be an int >= 2 (block 0 is the null block), "
                             f"got {num_blocks!r}")
        self.num_blocks = int(num_blocks)
        self.kv_dtype = params_kv_dtype(target.params) if kv_dtype is None else kv_dtype
        self.drafts_in = "none" if feed is None else feed.drafts_in
        #: the drafter's context limit when shorter than max_model_len (else None)
        self.drafter_max_model_len = None if feed is None else feed.drafter_max_model_len
        self.tree = self.step.tree
        #: length of the per-position acceptance counts: k, or the tree's depth
        self.num_spec_positions = self.k if self.tree is None else self.tree.depth
        self.steps_per_sync = (int(steps_per_sync) if steps_per_sync is not None else
                               DEFAULT_STEPS_PER_SYNC if loop_support(self.step) is None else 1)
        if loop_early_exit is not None and not isinstance(loop_early_exit, (bool, np.bool_)):
            raise ValueError(f"loop_early_exit must be True, False or None (the fixed-trip form "
                             f"unless a request waits), got {loop_early_exit!r}")
        #: the device loop's form: True / False, or None (per call: early exit while a
        #: request waits or on a CPU target, else the fixed trip count)
        self.loop_early_exit = None if loop_early_exit is None else bool(loop_early_exit)
        if overlap is not None and not isinstance(overlap, (bool, np.bool_)):
            raise ValueError(f"overlap must be True, False or None (on where the device loop "
                             f"runs), got {overlap!r}")
        self.overlap = (loop_support(self.step) is None and (
            self.steps_per_sync > 1 or False in self._loop_forms()) if overlap is None else bool(overlap))
        #: device-to-host round trips so far (one per step, or per device-loop call)
        self.num_syncs = 0
        #: seconds the host spent building / dispatching / committing steps (host_s) and
        #: blocked waiting for the device's results (wait_s), over every generate call
        self.host_s = self.wait_s = 0.0
        if self.steps_per_sync > 1 and (why := loop_support(self.step)) is not None:
            raise ValueError(f"steps_per_sync={self.steps_per_sync}: {why}")
        if self.overlap and (why := loop_support(self.step)) is not None:
            raise ValueError(f"overlap=True: {why}; its next step's drafts come from this "
                             "step's tokens on the host, so it cannot be dispatched earlier")
        self._reset_cache()

    # -- state ---------------------------------------------------------------------

    def _reset_cache(self) -> None:
        self.target_kv, self.draft_state = self.step.init_caches(self.num_blocks, self.block_size,
                                                                 self.kv_dtype)
        self.free_blocks = list(range(self.num_blocks - 1, _NULL_BLOCK, -1))   # pop() -> 1, 2, ...
        self.tok_buf = np.zeros((self.max_num_seqs, self.max_model_len), _I32)
        self.free_rows = list(range(self.max_num_seqs - 1, -1, -1))

    # -- validation ----------------------------------------------------------------

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
        for i, (p, s) in enumerate(zip(out, sps)):
            if self._worst_blocks(len(p), s.max_tokens) > self.num_blocks - 1:
                raise ValueError(f"prompts[{i}] may need {self._worst_blocks(len(p), s.max_tokens)} KV "
                                 f"blocks, more than the pool's {self.num_blocks - 1}")
        return out, sps

    def _worst_blocks(self, prompt_len: int, max_tokens: int) -> int:
        n = min(self.max_model_len, prompt_len + max_tokens + self.lookahead)
        return -(-n // self.block_size)

    # -- public --------------------------------------------------------------------

    def generate(self, prompts: Sequence[Sequence[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 eos_token_id: int | None = None, seed: int = 0,
                 stat_loggers: Iterable[Callable[[SpecDecodingStats], None]] = (),
                 progress: Callable[[int, int, int], None] | None = None) -> GenerateResult:
        """Generate for every prompt; see :func:`generate`."""
        prompts, sps = self._check_inputs(prompts, sampling_params)
        check_opt_int("eos_token_id", eos_token_id, 0, self.vocab_size - 1,
                      why="a token id of the target's vocabulary")
        check_int("seed", seed, 0, 2**63 - 1)
        stat_loggers = list(stat_loggers)
        rng = np.random.default_rng(seed)
        waiting = collections.deque()
        reqs = []
        for i, (p, sp) in enumerate(zip(prompts, sps)):
            stops = set(sp.stop_token_ids)
            if eos_token_id is not None and not sp.ignore_eos:
                stops.add(int(eos_token_id))
            r = _Request(index=i, req_id=f"req-{next(_req_counter)}", prompt=p, params=sp,
                         seed=int(sp.seed if sp.seed is not None else rng.integers(0, 2**31 - 1)) % 2**32,
                         stop_ids=frozenset(stops))
            r.proc = sp.processing(stops)
            check_request(f"sampling_params[{i}]", r.proc, self.processor_limits, self.vocab_size,
                          len(self.step.logits_processors))
            r.reserve = self._worst_blocks(len(p), sp.max_tokens)
            reqs.append(r)
            waiting.append(r)
        running: list[_Request] = []
        total = SpecDecodingStats.new(self.num_spec_positions)
        steps, done = 0, 0
        t0 = time.perf_counter()
        inflight: _InFlight | None = None       # overlap: a device-loop call not committed yet
        try:
            while waiting or running:
                if inflight is None:     # (none can join before a request in flight finishes)
                    self._admit(waiting, running)
                if inflight is not None or ((self.steps_per_sync > 1 or self.overlap) and all(
                        r.num_tokens - r.num_computed == 1 for r in running)):
                    if self.overlap and not waiting:     # (waiting only ever shrinks)
                        results, inflight = self._sync_overlapped(running, inflight,
                                                                  stop_on_finish=False)
                    else:
                        results = self._sync(running, stop_on_finish=bool(waiting))
                else:
                    results = [self._step(running)]
                self.num_syncs += 1
                for stats, finished in results:     # one entry per iteration
                    steps += 1
                    if stats is not None:
                        for f in stat_loggers:
                            f(stats)
                        _accumulate(total, stats)
                    for r in finished:
                        running.remove(r)
                        self._release(r)
                    done += len(finished)
                    if progress is not None:
                        progress(done, len(reqs), sum(len(r.output) for r in reqs))
        finally:
            if self.proposer is not None:
                self.proposer.finish_requests([r.req_id for r in reqs])
            for r in running:
                self._release(r)
        elapsed = time.perf_counter() - t0
        outs = [RequestOutput(r.prompt, r.output, r.finish_reason, r.num_drafted, r.num_accepted,
                              None if r.params.logprobs is None else r.logprobs) for r in reqs]
        return GenerateResult(outs, total, steps, elapsed)

    def warmup(self, batch_sizes: Sequence[int], query_lens: Sequence[int],
               context_blocks: Sequence[int] | None = None, *, all_greedy: Sequence[bool] = (True,),
               stop_pads: Sequence[int] = (1, 2), logits_processing: Sequence[bool] = (False,),
               num_logprobs: Sequence[int | None] = (None,)) -> int:
        """Compile the step for every combination of the given buckets ahead of time (a
        dummy step with no real request, which writes nothing). Returns the number of
        variants compiled. ``context_blocks`` None: the widest (``max_model_len``).
        With ``steps_per_sync > 1`` or ``overlap`` the device loop is compiled too, for every
        batch size, context width, ``all_greedy``, ``stop_pads`` (stop-id columns: the power
        of two >= the most stop ids, EOS included, of a running request) and loop form (both
        under ``loop_early_exit=None``). ``logits_processing``:
        the plain variant (False) and / or the one with logits processors (True: a batch in
        which some request uses penalties, bad words, ... ; one fixed shape,
        ``processor_limits``). ``num_logprobs``: the
        largest ``SamplingParams.logprobs`` among a batch's running requests (None: none
        asks), each compiled as its bucket (``specjax.sampling.logprobs.logprobs_bucket``); list
        every value the running requests' largest ``n`` can take as requests finish."""
        lps = sorted({logprobs_bucket([check_num_logprobs("num_logprobs", n)]) for n in num_logprobs},
                     key=lambda n: -1 if n is None else n)
        if context_blocks is None:
            context_blocks = [self.max_blocks_per_req]
        before = step_cache_size() + loop_cache_size()
        phases = (False,) if self.tree is None else (False, True)
        for b, q, c, g, tv, pr, lp in itertools.product(batch_sizes, query_lens, context_blocks,
                                                        all_greedy, phases, logits_processing, lps):
            if int(b) * int(q) < self.min_tokens_per_step:      # as _buckets pads it
                q = _pick(self.query_buckets, -(-self.min_tokens_per_step // int(b)))
            batch = self._dummy_batch(int(b), int(q), int(c), tree_verify=tv, all_greedy=bool(g))
            if pr:
                batch = dataclasses.replace(batch, procs=self._empty_procs(int(b)))
            jax.block_until_ready(self._run(dataclasses.replace(batch, num_logprobs=lp)))
        if self.steps_per_sync > 1 or self.overlap:   # the device loop runs
            for b, c, g, s, pr, lp, ee in itertools.product(batch_sizes, context_blocks, all_greedy,
                                                            stop_pads, logits_processing, lps,
                                                            self._loop_forms()):
                _, q, _ = self._buckets(int(b), self.k + 1, 1)
                state = make_loop_state(
                    last_token=[], num_computed=[], drafts=[], max_tokens=[], num_output=[],
                    block_ids=[], k=self.k, num_reqs_pad=int(b), blocks_per_req_pad=int(c),
                    query_len_pad=q, max_model_len=self.max_model_len, block_size=self.block_size,
                    stop_pad=int(s), history=[] if self.drafts_in == "history" else None,
                    procs=self._empty_procs(int(b)) if pr else None)
                out, self.target_kv, self.draft_state, _ = decode_loop(
                    self.step, self.target.params, self.step.draft_params, self.target_kv,
                    self.draft_state, dataclasses.replace(state, all_greedy=bool(g), num_logprobs=lp),
                    steps_per_sync=self.steps_per_sync, early_exit=ee)
                jax.block_until_ready(out)
        return step_cache_size() + loop_cache_size() - before

    def _admit(self, waiting, running) -> None:
        while waiting and len(running) < self.max_num_seqs:
            r = waiting[0]
            owed = sum(x.reserve - len(x.blocks) for x in running)
            if len(self.free_blocks) - owed < r.reserve:
                if not running:   # cannot happen: _check_inputs bounds every request
                    raise RuntimeError("KV block pool too small for a single request")
                break
            waiting.popleft()
            r.row = self.free_rows.pop()
            self.tok_buf[r.row, : len(r.prompt)] = r.prompt
            running.append(r)

    def _release(self, r: _Request) -> None:
        self.free_blocks.extend(reversed(r.blocks))
        r.blocks = []
        if r.row >= 0:
            self.free_rows.append(r.row)
            r.row = -1

    def _ensure_blocks(self, r: _Request, upto: int) -> None:
        need = -(-min(upto, self.max_model_len) // self.block_size)
        while len(r.blocks) < need:
            r.blocks.append(self.free_blocks.pop())

    def _buckets(self, n: int, max_q: int, max_blocks: int) -> tuple[int, int, int]:
        b = _pick(self.batch_buckets, n)
        q = _pick(self.query_buckets, max(max_q, self.k + 1, -(-self.min_tokens_per_step // b)))
        c = _pick(self.context_buckets, max_blocks, cap=self.max_blocks_per_req)
        return b, q, c

    def _build_batch(self, running: list[_Request], tree_verify: bool = False
                     ) -> tuple[StepBatch, list[int], int]:
        """The step's padded inputs (``specjax.runtime.batch.build_batch``): each request's
        uncomputed tokens, then its drafts; a tree-verification step (``tree_verify``: every
        request has one uncomputed token, the root) verifies each request's tree prefix."""
        sched, computed, nd = [], [], []
        for r in running:
            sched.append([r.token(i) for i in range(r.num_computed, r.num_tokens)] + r.drafts)
            computed.append(r.num_computed)
            nd.append(len(r.drafts))
            self._ensure_blocks(r, r.num_computed + len(sched[-1]) + self.lookahead)
        qlens = [len(t) for t in sched]
        B, Q, C = self._buckets(len(running), max(qlens), max(len(r.blocks) for r in running))
        batch = build_batch(
            sched, num_computed=computed, num_drafts=nd, block_ids=[r.blocks for r in running],
            block_size=self.block_size, num_reqs_pad=B, query_len_pad=Q, blocks_per_req_pad=C,
            max_spec_len=self.k, temperature=[r.params.temperature for r in running],
            top_k=[r.params.top_k for r in running], top_p=[r.params.top_p for r in running],
            seeds=[r.seed for r in running], num_output_tokens=[len(r.output) for r in running],
            tree=self.tree if tree_verify else None, procs=self._procs(running, B))
        batch = dataclasses.replace(batch, num_logprobs=logprobs_bucket(
            [r.params.logprobs for r in running]))
        return batch, qlens, B

    def _empty_procs(self, B: int):
        """A ``ProcessorState`` of ``B`` padding rows (compiles the processing variant)."""
        return make_processor_state([], [], [], num_reqs_pad=B, max_len=self.max_model_len,
                                    limits=self.processor_limits)

    def _procs(self, running: list[_Request], B: int):
        """The batch's ``ProcessorState`` (token histories from ``tok_buf``), or None when no
        running request uses a logits-processing feature (the plain program)."""
        if not any(r.proc is not None and r.proc.active for r in running):
            return None
        return make_processor_state(
            [r.proc for r in running], [self.tok_buf[r.row, : r.num_tokens] for r in running],
            [len(r.prompt) for r in running], num_reqs_pad=B, max_len=self.max_model_len,
            limits=self.processor_limits)

    def _dummy_batch(self, B: int, Q: int, C: int, tree_verify: bool = False,
                     all_greedy: bool = True) -> StepBatch:
        """A batch of ``B`` padding rows (writes nothing), for compiling a bucket."""
        batch = build_batch([], num_computed=[], num_drafts=[], block_ids=[],
                            block_size=self.block_size, num_reqs_pad=B, query_len_pad=Q,
                            blocks_per_req_pad=C, max_spec_len=self.k,
                            tree=self.tree if tree_verify else None)
        return dataclasses.replace(batch, all_greedy=all_greedy)

    def _run(self, batch: StepBatch) -> StepOutput:
        """Run the public step on ``batch`` (caches and state donated and replaced)."""
        out, self.target_kv, self.draft_state = self.step(
            self.target.params, self.step.draft_params, self.target_kv, self.draft_state, batch)
        return out

    def _drafter_room(self, r: _Request) -> int | None:
        lim = self.drafter_max_model_len
        return None if lim is None else lim - r.num_tokens

    # -- one step ------------------------------------------------------------------

    def _step(self, running: list[_Request]) -> tuple[SpecDecodingStats | None, list[_Request]]:
        # Tree mode: the tree mask is static for the whole batch and a prompt needs causal
        # attention, so a step with a prompt to prefill is a chain step in which nobody
        # verifies drafts (decoding requests verify just their root and get redrafted);
        # every other step is a tree-verification step.
        tree_verify = self.tree is not None and all(
            r.num_tokens - r.num_computed == 1 for r in running)
        if self.tree is not None and not tree_verify:
            for r in running:
                r.drafts = []
        t0 = time.perf_counter()
        batch, qlens, b_pad = self._build_batch(running, tree_verify=tree_verify)
        dev = self._run(batch)
        t1 = time.perf_counter()
        out = jax.device_get(dev)       # one fetch of the step's results
        t2 = time.perf_counter()
        self.wait_s += t2 - t1
        sampled = out.sampled
        drafts_np = (out.drafts, out.num_drafts) if self.drafts_in in ("step", "split") else None

        stats = SpecDecodingStats.new(self.num_spec_positions) if self.proposer is not None else None
        finished, gained = [], []
        for i, r in enumerate(running):
            row = sampled[i]
            new = [int(t) for t in row if t != PLACEHOLDER_TOKEN_ID]
            nd = len(r.drafts)
            n_acc = len(new) - 1
            if nd:
                # trees: a request-step counts its deepest verified level as its drafts
                # (the most it can accept); position p = level p + 1
                nd_stat = nd if self.tree is None else self.tree.depths[nd - 1]
                stats.observe_draft(nd_stat, n_acc)
                r.num_drafted += nd_stat
                r.num_accepted += n_acc
            # the root and the accepted tokens are in the KV cache (a tree's moved there)
            r.num_computed += qlens[i] - (nd - n_acc)
            kept = []
            for tok in new:
                kept.append(tok)
                r.output.append(tok)
                if tok in r.stop_ids:
                    r.finish_reason = "stop"
                elif len(r.output) >= r.params.max_tokens or r.num_tokens >= self.max_model_len:
                    r.finish_reason = "length"
                if r.finish_reason:
                    break
            if r.params.logprobs is not None:
                r.logprobs += request_logprobs(out.logprobs, i, len(kept), r.params.logprobs)
            if r.row >= 0:
                start = r.num_tokens - len(kept)
                self.tok_buf[r.row, start : r.num_tokens] = kept
            r.drafts = []
            if r.finish_reason:
                finished.append(r)
            elif drafts_np is not None:
                tok, cnt = drafts_np
                r.drafts = tok[i, : int(cnt[i])].tolist()
            gained.append(kept)

        alive = [i for i, r in enumerate(running) if not r.finish_reason]
        if self.drafts_in == "history" and alive:
            rows = [running[i].row for i in alive]
            hist = TokenHistory(
                req_ids=[running[i].req_id for i in alive],
                token_ids=self.tok_buf[rows],
                num_tokens=np.array([running[i].num_tokens for i in alive], _I32),
                num_prompt_tokens=np.array([len(running[i].prompt) for i in alive], _I32),
                sampled_token_ids=[gained[i] for i in alive], rows_pad=b_pad)
            out = self.proposer.propose_from_history(hist)
            tok, cnt = np.asarray(out.token_ids), np.asarray(out.num_drafts)
            for j, i in enumerate(alive):
                running[i].drafts = tok[j, : int(cnt[j])].tolist()
        for i in alive:
            r = running[i]
            # Never verify past max_model_len or beyond what max_tokens can still use; a
            # token outside the vocabulary (a buggy proposer) ends the draft, as the target
            # would embed it as garbage.
            kv_room = self.max_model_len - r.num_tokens
            r.drafts = trim_drafts(r.drafts, max_new_tokens=min(kv_room, r.params.max_tokens - len(r.output)),
                                   kv_room=kv_room, k=self.k, vocab_size=self.vocab_size,
                                   tree=self.tree, drafter_room=self._drafter_room(r))
        self.host_s += (t1 - t0) + (time.perf_counter() - t2)
        return stats, finished


def _accumulate(total: SpecDecodingStats, s: SpecDecodingStats) -> None:
    total.num_drafts += s.num_drafts
    total.num_draft_tokens += s.num_draft_tokens
    total.num_accepted_tokens += s.num_accepted_tokens
    for p, a in enumerate(s.num_accepted_tokens_per_pos):
        total.num_accepted_tokens_per_pos[p] += a


def generate(target, proposer: Proposer | None, prompts: Sequence[Sequence[int]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
             max_model_len: int | None = None, block_size: int | None = None,
             max_num_seqs: int | None = None, num_blocks: int | None = None,
             eos_token_id: int | None = None, seed: int = 0,
             batch_buckets: Sequence[int] | None = None, query_buckets: Sequence[int] | None = None,
             context_buckets: Sequence[int] | None = None, min_tokens_per_step: int = 1,
             stat_loggers: Iterable[Callable[[SpecDecodingStats], None]] = (),
             progress: Callable[[int, int, int], None] | None = None, mesh: Any = None,
             tp_axis: str = "tp", steps_per_sync: int | None = None,
             loop_early_exit: bool | None = None, logits_processors: tuple = (),
             processor_limits: ProcessorLimits | None = None,
             logprobs_mode: str = "raw_logprobs", overlap: bool | None = None,
             kv_dtype=None, fuse_projections: bool = True) -> GenerateResult:
    """Batched generation with speculative decoding (``proposer``) or plain decoding (None).

    Args:
      target: ``TargetModel(model, params)``, ``(model, params)`` or a decoder's
        ``Pretrained``; ``model`` a ``specjax.models.DecoderLM``.
      proposer: ``specjax.make_proposer(...)`` or None.
      prompts: token-id lists (non-empty, ids in the target's vocabulary).
      sampling_params: one ``SamplingParams`` for all or one per prompt.
      max_model_len, block_size: default to the proposer's (else 2048 and 16).
      max_num_seqs: most running requests (default: all prompts at once, at most 256).
      eos_token_id: a stop token for every request without ``ignore_eos``.
      seed: draws the seeds of requests whose ``SamplingParams.seed`` is None.
      stat_loggers: called with each step's ``SpecDecodingStats`` (e.g.
        ``SpecDecodingLogging().observe``, ``SpecDecodingProm(...).observe``).
      progress: called after each step with ``(finished, total, generated_tokens)``.
      Other arguments: see :class:`Engine`.

    Returns:
      ``GenerateResult`` (outputs in prompt order, summed metrics, steps, wall time).

    Raises:
      ValueError: empty prompt list, token ids outside the vocabulary, ``max_tokens < 1``,
        a proposer whose vocabulary differs from the target's, ... before generation.
    """
    feed = proposer.feed if isinstance(proposer, Proposer) else None
    if max_model_len is None:
        max_model_len = (feed and feed.max_model_len) or 2048
    if block_size is None:
        block_size = (feed and feed.block_size) or 16
    if max_num_seqs is None:   # all at once, up to 256
        max_num_seqs = min(256, max(1, len(prompts))) if hasattr(prompts, "__len__") else 1
    engine = Engine(target, proposer, max_model_len=max_model_len, block_size=block_size,
                    max_num_seqs=max_num_seqs, num_blocks=num_blocks,
                    batch_buckets=batch_buckets, query_buckets=query_buckets,
                    context_buckets=context_buckets, min_tokens_per_step=min_tokens_per_step,
                    mesh=mesh, tp_axis=tp_axis, steps_per_sync=steps_per_sync,
                    loop_early_exit=loop_early_exit, logits_processors=logits_processors,
                    processor_limits=processor_limits, logprobs_mode=logprobs_mode,
                    overlap=overlap, kv_dtype=kv_dtype, fuse_projections=fuse_projections)
    return engine.generate(prompts, sampling_params, eos_token_id=eos_token_id, seed=seed,
                           stat_loggers=stat_loggers, progress=progress)

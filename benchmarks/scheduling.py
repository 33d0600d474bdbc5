"""vLLM v1-style scheduling in the engine (issue 51's GPU goals): decoding beside a chunked
long prefill, and a Poisson workload with and without chunked prefill.

``itl``: one ``--long``-token prompt (default 32768) prefills in chunks of each
``--chunks`` (``LoopOptions(long_prefill_token_threshold=chunk)``) while ``--running``
requests (``--running-prompt`` tokens each) decode beside it, plain and EAGLE-3 (k =
``--k``, a target-shaped head, synthetic acceptance at ``loop.DEMO_RATES``). All arrive at
once, the long prompt last (the threshold chunks the running prompts too); an identical
warm-up run compiles first. Over the window from the long request's ``first_scheduled_time``
(or the step where the last running request got its first token, when later: the steps
before are ``skipped_steps``) to its ``first_token_time``:

- ``ITL p50 / p99`` (ms): the gaps between a running request's consecutive token deliveries
  (distinct ``token_times``) that end in the window (its first token has none);
- ``every step``: whether each running request got a token in every engine step of the
  window (its distinct token times there == the steps there, counted by wrapping
  ``Engine._step``): the scheduler never starves decoding for a chunk;
- ``step / floor``: each chunk step's time (``Engine._step``: build, device, fetch,
  commit) over its floor: chunk FLOPs (2 x dense params x chunk tokens, plus the EAGLE-3
  head's fc and layer; attention over the context so far) / the bf16 GEMM rate measured
  here at ``[chunk, hidden] x [hidden, 2 x intermediate]`` + (weights + live K/V of every
  row, EAGLE-3's propose reads) / ``floors.HBM_BPS``; median and max over the chunk steps
  (steps where a running request still prefills are left out). Goal <= 1.3.

``mixed``: ``--num-requests`` requests arriving as a Poisson process at ``--rate`` req/s,
prompts log-uniform in ``--prompt-range``, outputs uniform in ``--output-range`` (greedy,
EOS ignored, ``--seed``), ``max_num_seqs`` = min(``--max-seqs``, requests), the KV pool
from ``--gpu-mem`` of the device (may preempt) or ``--num-blocks``, plain and EAGLE-3, with
chunked prefill (the default budget) and without (``enable_chunked_prefill=False``, budget =
``max_model_len``): output tokens/s (over generate's wall time), TTFT (first token -
arrival), ITL (gaps between deliveries; tokens of one device-loop call share one), TPOT
((finish - first token) / (tokens - 1)), p50 / p99 in ms, and preemptions. One context
bucket (``max_model_len``) and ``--batch-buckets`` keep the programs few. ``--warmup short``
compiles first: ``Engine.warmup`` for the decode programs of every batch bucket, then a
spread of the prompts one at a time and together (a few tokens each); ``full``: the whole
workload once, then every ragged step's program (``token_buckets``: powers of two from
``RAGGED_MIN_SLOTS`` and the budget) for each batch bucket (no compile should be left).
Programs still compiled during the timed run and JAX's compile seconds are in every row
(``compiles``, ``compile_s``); a row whose compile time is over 5% of its wall time says so.

Why: chunked prefill must keep decoding latency flat beside a long prompt at near the
hardware floor, and raise throughput / cut TTFT on a mixed load.

Usage (H200)::

    python benchmarks/scheduling.py --json sched.json                  # both parts, 8B target
    python benchmarks/scheduling.py --parts mixed --rate 8 --num-requests 128
    python benchmarks/scheduling.py --cpu-smoke --json /tmp/s.json     # CPU, tiny target

Prints a Markdown table per part; ``--json`` holds the settings and every row (rewritten
after each row).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import time
import types

import jax
import jax.monitoring
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import floors  # noqa: E402
from e2e import TARGETS, make_engine  # noqa: E402
from loop import BS, DEMO_RATES, build_target, drafter  # noqa: E402
from prefill import Sink, attention_flops, cdiv, gemm_rate, prefill_flops, short  # noqa: E402

from specjax.engine import Engine, LoopOptions, SamplingParams, step_cache_size  # noqa: E402
from specjax.engine.options import (DEFAULT_CPU_MAX_NUM_BATCHED_TOKENS,  # noqa: E402
                                    DEFAULT_MAX_NUM_BATCHED_TOKENS)
from specjax.engine.memory import activation_bytes_estimate  # noqa: E402
from specjax.runtime.decode_loop import loop_cache_size  # noqa: E402

PARTS = ("itl", "mixed")
GOAL = 1.3
#: ``--cpu-smoke``'s sizes (``TARGETS["tiny"]``, float32).
SMOKE = dict(long=256, chunks="32,64", running=2, running_prompt=16, num_requests=6,
             prompt_range="16,128", output_range="8,32", rate=20.0, batch_buckets="8",
             num_blocks=20)     # a pool short enough to preempt


class CompileClock:
    """JAX's compile time so far (trace, lowering, backend compile; seconds), from
    ``jax.monitoring``'s duration events, and the engine's compiled programs."""

    def __init__(self):
        self.s = 0.0
        jax.monitoring.register_event_duration_secs_listener(self._on)

    def _on(self, event: str, duration: float, **_) -> None:
        if event.startswith("/jax/core/compile/"):
            self.s += duration

    def close(self) -> None:
        jax.monitoring.unregister_event_duration_listener(self._on)

    def mark(self) -> tuple[float, int]:
        return self.s, step_cache_size() + loop_cache_size()

    def since(self, mark) -> dict:
        """``compile_s`` and engine programs (step + device loop) compiled since ``mark``."""
        return dict(compile_s=self.s - mark[0], compiles=step_cache_size() + loop_cache_size() - mark[1])


def med(xs) -> float:
    return statistics.median(xs) if xs else math.nan


def pct(xs, q: float) -> float:
    """The ``q``-th percentile of ``xs`` in ms (nan when empty)."""
    return float(np.percentile(xs, q)) * 1e3 if len(xs) else math.nan


def delivery_gaps(times, lo: float = -math.inf, hi: float = math.inf) -> list[float]:
    """Gaps (s) between consecutive distinct ``times`` whose later end lies in ``(lo, hi]``."""
    t = sorted(set(times))
    return [b - a for a, b in zip(t, t[1:]) if lo < b <= hi]


class Setup:
    """Target, geometry, dtype and proposers of a run."""

    def __init__(self, args):
        self.args, self.dtype = args, jnp.dtype(args.dtype)
        self.size = "tiny" if args.cpu_smoke else args.target
        self.target, self.geo, _ = build_target(self.size, self.dtype)    # random weights, fused
        if jax.default_backend() == "gpu":      # contiguous, as a checkpoint's load lays them
            host = jax.device_get(self.target.params)
            self.target = self.target._replace(params=None)
            gc.collect()
            self.target = self.target._replace(params=jax.device_put(host))
        self.draft_vocab = floors.EAGLE3_DRAFT_VOCAB_8B if self.size == "8b" else self.geo["vocab_size"]

    def proposer(self, method: str, mml: int):
        return None if method == "plain" else drafter(
            method, self.target, self.geo, self.size, self.args.k, DEMO_RATES, mml, self.dtype)


# -- part 1: decoding beside a chunked long prefill --------------------------------------------

def spy_steps(eng: Engine, log: list) -> None:
    """Wrap ``eng._step``: append per call its rows ``(index, computed, scheduled, drafts)``,
    its seconds and each row's output length after it."""
    orig = eng._step

    def spy(reqs, running):
        rows = [(r.index, r.num_computed, r.sched, len(r.drafts)) for r in reqs]
        t = time.perf_counter()
        out = orig(reqs, running)
        log.append(dict(rows=rows, s=time.perf_counter() - t, out={r.index: len(r.output) for r in reqs}))
        return out

    eng._step = spy


def watch_compiles(eng: Engine) -> list:
    """Wrap ``eng._step``; the returned list gets, for each step that compiled a program,
    ``(requests, scheduled tokens, longest query)``: the shapes a warm-up missed."""
    orig, seen = eng._step, []

    def spy(reqs, running):
        before = step_cache_size() + loop_cache_size()
        q = [r.sched + len(r.drafts) for r in reqs]
        out = orig(reqs, running)
        if step_cache_size() + loop_cache_size() > before:
            seen.append((len(reqs), sum(q), max(q, default=0)))
        return out

    eng._step = spy
    return seen


def chunk_floor_s(su: Setup, rows, long_idx: int, k: int, gemm_tflops: float) -> float:
    """The floor (s) of one step: the long row's chunk FLOPs / the GEMM rate + weights and
    the live K/V of every row (+ EAGLE-3's propose reads) / ``floors.HBM_BPS``."""
    geo, isz = su.geo, su.dtype.itemsize
    s, c = next((nc, n) for i, nc, n, _ in rows if i == long_idx)
    flops = prefill_flops(geo, c)["dense"] + geo["num_hidden_layers"] * (
        attention_flops(geo, s + c) - attention_flops(geo, s))
    w = floors.llama_weight_bytes(geo, isz)
    live = sum(nc + n + d for _, nc, n, d in rows)
    others = [nc for i, nc, _, _ in rows if i != long_idx]
    if k:
        h, dv = geo["hidden_size"], su.draft_vocab
        head, fc = floors.eagle3_weight_bytes(geo, dv, 1)          # parameter counts
        flops += 2.0 * c * (head - h - dv * h + fc)                # fc + layer over the chunk
        w += floors.eagle3_propose_bytes(geo, len(others), int(np.mean(others or [0])), k, dv, isz)
    return flops / (gemm_tflops * 1e12) + (w + live * floors.kv_bytes_per_token(geo, isz)) / floors.HBM_BPS


def itl_case(su: Setup, method: str, chunk: int, gemm_tflops: float, clock: CompileClock) -> dict:
    """One (method, chunk) case of the ``itl`` part: a warm-up run, then the timed one."""
    a, k = su.args, 0 if method == "plain" else su.args.k
    n_chunks = cdiv(a.long, chunk)
    run_tokens = (k + 1) * (n_chunks + 2)      # > tokens any running request gets in the window
    mml = cdiv(max(a.long, a.running_prompt + run_tokens) + 2 * k + 16, BS) * BS
    rng = np.random.default_rng(a.seed)
    v = su.geo["vocab_size"]
    prompts = [rng.integers(0, v, a.running_prompt).tolist() for _ in range(a.running)]
    prompts.append(rng.integers(0, v, a.long).tolist())
    L = a.running
    sps = [SamplingParams(max_tokens=run_tokens, ignore_eos=True)] * a.running + [
        SamplingParams(max_tokens=1, ignore_eos=True)]
    eng = make_engine(su.target, su.proposer(method, mml), a.running + 1, mml, su.dtype,
                      loop=dict(long_prefill_token_threshold=chunk))
    log: list = []
    spy_steps(eng, log)
    t0 = time.perf_counter()
    eng.generate(prompts, sps)                 # the warm-up run: compiles
    warm_s = time.perf_counter() - t0
    log.clear()
    mark = clock.mark()
    res = eng.generate(prompts, sps)
    row = dict(kind="itl", method=method, k=k, chunk=chunk, long=a.long, running=a.running,
               running_prompt=a.running_prompt, max_model_len=mml, warmup_s=warm_s,
               budget=eng.options.max_num_batched_tokens, **clock.since(mark))
    del eng
    # the window: the long prompt's prefill steps from the one where every running request has
    # a token (a running prompt over the threshold is chunked too, and gives none until done)
    first = next(j for j, e in enumerate(log) if any(r[0] == L for r in e["rows"]))
    last = next(j for j, e in enumerate(log) if e["out"].get(L, 0) >= 1)
    seen: dict = {}
    for start, e in enumerate(log):
        seen.update(e["out"])
        if start >= first and all(seen.get(i, 0) >= 1 for i in range(a.running)):
            break
    window = log[start: last + 1]
    m = res.request_metrics
    lo = max([m[L].first_scheduled_time] + [m[i].first_token_time for i in range(a.running)])
    hi = m[L].first_token_time
    got = [len({t for t in m[i].token_times if lo <= t <= hi}) for i in range(a.running)]
    gaps = [g for i in range(a.running) for g in delivery_gaps(m[i].token_times, lo, hi)]
    chunks = [e for e in window if any(r[0] == L for r in e["rows"])
              and all(n == 1 for i, _, n, _ in e["rows"] if i != L)]
    ms = [e["s"] * 1e3 for e in chunks]
    fl = [chunk_floor_s(su, e["rows"], L, k, gemm_tflops) * 1e3 for e in chunks]
    ratio = [x / f for x, f in zip(ms, fl)]
    past = [next(nc for i, nc, _, _ in e["rows"] if i == L) for e in chunks]
    row["chunk_steps_by_past"] = [[p, x, f] for p, x, f in zip(past, ms, fl)]
    row.update(steps=len(window), skipped_steps=start - first, tokens_in_window=got,
               every_step=bool(window) and all(g == len(window) for g in got),
               window_s=hi - lo, itl_p50_ms=pct(gaps, 50), itl_p99_ms=pct(gaps, 99), itl_n=len(gaps),
               chunk_steps=len(chunks), step_ms_p50=med(ms), floor_ms_p50=med(fl), ratio_p50=med(ratio),
               ratio_max=max(ratio, default=math.nan), gemm_tflops=gemm_tflops,
               num_preemptions=res.num_preemptions)
    row["itl_x_floor"] = row["itl_p50_ms"] / row["floor_ms_p50"]
    row["goal_met"] = bool(row["ratio_p50"] <= GOAL)
    return row


def torch_anchor(args, geo: dict) -> list[dict]:
    """PyTorch's chunk step per chunk size (``torch_chunk.py`` in its own process, run before
    JAX takes the GPU's memory); rows with ``error`` where it fails."""
    cmd = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "torch_chunk.py"),
           "--geo", json.dumps(geo), "--chunks", ",".join(map(str, args.chunks)),
           "--long", str(args.long), "--running", str(args.running),
           "--running-prompt", str(args.running_prompt)]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode:
        return [dict(kind="torch_chunk", chunk=c, error=out.stderr[-600:]) for c in args.chunks]
    return json.loads(out.stdout.strip().splitlines()[-1])


def anchor_rows(su: Setup, anchors: list[dict], itl_rows: list[dict], rates: dict) -> list[dict]:
    """Each anchor row with its floor (``chunk_floor_s`` of its rows: the chunk at ``past``
    beside the decode rows) and specjax's plain chunk step at the same ``past``."""
    out = []
    for r in anchors:
        r = dict(r)
        if "error" not in r and r.get("eager_ms") is not None:
            rows = [(-1, r["past"], r["chunk"], 0)] + [(i, r["running_prompt"], 1, 0)
                                                      for i in range(r["running"])]
            r["floor_ms"] = chunk_floor_s(su, rows, -1, 0, rates[r["chunk"]]) * 1e3
            best = min((x for x in (r.get("eager_ms"), r.get("compiled_ms")) if x is not None))
            r["torch_ms"], r["torch_x_floor"] = best, best / r["floor_ms"]
            ours = [x for q in itl_rows if q.get("method") == "plain" and q.get("chunk") == r["chunk"]
                    for p, x, _ in q.get("chunk_steps_by_past", ()) if p == r["past"]]
            if ours:
                r["specjax_ms"] = ours[0]
                r["specjax_x_torch"] = ours[0] / best
        out.append(r)
    return out


def run_itl(su: Setup, sink: Sink, clock: CompileClock, anchors: list[dict]) -> None:
    a, h, i = su.args, su.geo["hidden_size"], su.geo["intermediate_size"]
    rates, tiny = {}, a.cpu_smoke
    # a sub-millisecond GEMM: warm-up enough for the clocks to rise before it is timed
    ns = types.SimpleNamespace(warmup=2 if tiny else 20, iters=10 if tiny else 50, case_s=2.0,
                               min_iters=2 if tiny else 3, tiny=tiny)
    for c in a.chunks:         # the GEMM rate at the chunk's rows (the MLP's gate/up shape)
        g = gemm_rate(c, h, 2 * i, su.dtype, ns)
        sink(dict(g, kind="gemm"))
        rates[c] = g.get("tflops", math.nan)
    done: list[dict] = []
    for method in a.methods:
        for c in a.chunks:
            try:
                row = itl_case(su, method, c, rates[c], clock)
            except Exception as e:  # noqa: BLE001 - recorded, the run goes on
                row = dict(kind="itl", method=method, chunk=c, error=short(e))
            gc.collect()
            sink(row)
            done.append(row)
    for r in anchor_rows(su, anchors, done, rates):
        sink(r)


# -- part 2: a Poisson workload -------------------------------------------------------------

def workload(a, vocab: int):
    """``(prompts, max_tokens, arrival seconds)`` of the mixed part (seeded)."""
    rng = np.random.default_rng(a.seed)
    n, (plo, phi), (olo, ohi) = a.num_requests, a.prompt_range, a.output_range
    gaps = rng.exponential(1.0 / a.rate, n)
    arrivals = np.concatenate([[0.0], np.cumsum(gaps[:-1])])
    lens = np.exp(rng.uniform(math.log(plo), math.log(phi), n)).round().astype(int).clip(plo, phi)
    outs = rng.integers(olo, ohi + 1, n)
    return [rng.integers(0, vocab, p).tolist() for p in lens], [int(o) for o in outs], arrivals.tolist()


def device_memory() -> dict | None:
    """GiB in use, at peak and the limit of the first device (None where it reports none)."""
    st = jax.devices()[0].memory_stats()
    return None if not st else {k: round(st.get(k, 0) / 2**30, 3)
                                for k in ("bytes_in_use", "peak_bytes_in_use", "bytes_limit",
                                          "largest_free_block_bytes")}


def largest_live_arrays(n: int = 8) -> list[str]:
    """The ``n`` largest (dtype, shape) groups of live device arrays, ``"GiB xcount
    dtype[shape]"``: what held the memory when a case failed."""
    groups: dict = {}
    for x in jax.live_arrays():
        key = f"{x.dtype}{list(x.shape)}"
        size, count = groups.get(key, (0, 0))
        groups[key] = (size + x.nbytes, count + 1)
    top = sorted(groups.items(), key=lambda kv: -kv[1][0])[:n]
    return [f"{b / 2**30:.3f} GiB x{c} {key}" for key, (b, c) in top]


#: The fewest token slots of a ragged step (``LoopOptions.token_buckets``): below it the 8B
#: step reads its weights in the time its GEMMs take, so padding costs nothing, and the
#: programs to compile are few enough for ``--warmup full`` to compile them all.
RAGGED_MIN_SLOTS = 128


def ragged_slot_counts(least: int, budget: int) -> list[int]:
    """Powers of two from ``least`` below ``budget``, then ``budget``: a ragged step's token
    slot counts (``LoopOptions.token_buckets``)."""
    out, t = [], least
    while t < budget:
        out.append(t)
        t *= 2
    return out + [budget]


def mixed_case(su: Setup, method: str, chunked: bool, work, clock: CompileClock,
               memory: dict) -> dict:
    """One (method, chunked) case of the ``mixed`` part: warm-up, then the timed workload.
    ``memory`` (filled as it goes, kept when it fails): the device's memory before the engine,
    after it (its KV pool and the activation bytes its sizing set aside) and after warm-up."""
    memory["before_engine"] = device_memory()
    a, k = su.args, 0 if method == "plain" else su.args.k
    prompts, outs, arrivals = work
    mml = cdiv(a.prompt_range[1] + a.output_range[1] + 2 * k + 16, BS) * BS
    seqs = min(a.max_seqs, len(prompts))
    buckets = tuple(sorted({b for b in a.batch_buckets if b < seqs} | {seqs}))
    default = DEFAULT_MAX_NUM_BATCHED_TOKENS if jax.default_backend() == "gpu" else \
        DEFAULT_CPU_MAX_NUM_BATCHED_TOKENS                  # the engine's default budget
    budget = default if chunked else mml
    opts = LoopOptions(batch_buckets=buckets, context_buckets=(mml // BS,),
                       token_buckets=tuple(ragged_slot_counts(RAGGED_MIN_SLOTS, budget)),
                       enable_chunked_prefill=chunked, max_num_batched_tokens=budget)
    mem = a.gpu_mem if a.num_blocks is None and jax.default_backend() == "gpu" else None
    eng = Engine(su.target, su.proposer(method, mml), max_model_len=mml, block_size=BS,
                 max_num_seqs=seqs, num_blocks=a.num_blocks, gpu_memory_utilization=mem,
                 kv_dtype=su.dtype, options=opts)
    memory["after_engine"] = dict(device_memory() or {}, num_blocks=eng.num_blocks,
                               activation_estimate_gib=round(activation_bytes_estimate(
                                   eng.step, eng.target.params, max_num_seqs=seqs,
                                   max_num_batched_tokens=eng.options.max_num_batched_tokens)
                                   / 2**30, 3), workspace_gib=round(eng.workspace_bytes / 2**30, 3))
    sps = [SamplingParams(max_tokens=o, ignore_eos=True) for o in outs]
    t0 = time.perf_counter()
    if a.warmup == "full":
        eng.generate(prompts, sps, arrival_times=arrivals)
        memory["phase"] = "warmup: every ragged step"
        eng.warmup(buckets, [1 << (budget - 1).bit_length()], num_tokens=opts.token_buckets,
                   stop_pads=(1,))
    elif a.warmup == "short":   # decode programs per batch bucket; a spread of prompts alone, then together
        memory["phase"] = "warmup: decode programs"
        eng.warmup(buckets, [k + 1], stop_pads=(1,))     # (no stop ids: one column)
        pick = sorted(range(len(prompts)), key=lambda j: len(prompts[j]))[:: max(1, len(prompts) // 8)]
        few = SamplingParams(max_tokens=2 * (k + 1) + 2, ignore_eos=True)
        for j in pick:
            memory["phase"] = f"warmup: one prompt of {len(prompts[j])} tokens"
            eng.generate([prompts[j]], few)
        memory["phase"] = "warmup: the prompts together"
        eng.generate([prompts[j] for j in pick], few)
    warm_s = time.perf_counter() - t0
    memory["after_warmup"] = device_memory()
    memory["phase"] = "timed run"
    compiled_at = watch_compiles(eng)
    mark = clock.mark()
    res = eng.generate(prompts, sps, arrival_times=arrivals)
    row = dict(kind="mixed", memory=memory, method=method, k=k, chunked=chunked, budget=eng.options.max_num_batched_tokens,
               max_num_seqs=seqs, num_blocks=eng.num_blocks, batch_buckets=list(buckets),
               max_model_len=mml, rate=a.rate, num_requests=len(prompts), warmup=a.warmup,
               warmup_s=warm_s, compiled_at=compiled_at[:32], **clock.since(mark))
    del eng
    m = res.request_metrics
    ttft = [x.first_token_time - x.arrival_time for x in m]
    itl = [g for x in m for g in delivery_gaps(x.token_times)]
    tpot = [(x.finished_time - x.first_token_time) / (len(x.token_times) - 1) for x in m
            if len(x.token_times) > 1]
    n_out = res.num_generated_tokens
    row.update(output_tokens=n_out, prompt_tokens=sum(map(len, prompts)), elapsed_s=res.elapsed_s,
               throughput_tok_s=n_out / res.elapsed_s, ttft_p50_ms=pct(ttft, 50),
               ttft_p99_ms=pct(ttft, 99), itl_p50_ms=pct(itl, 50), itl_p99_ms=pct(itl, 99),
               tpot_p50_ms=pct(tpot, 50), num_preemptions=res.num_preemptions, steps=res.num_steps,
               mean_acceptance_length=res.mean_acceptance_length)
    if row["compile_s"] > 0.05 * res.elapsed_s:
        row["caveat"] = (f"compile-dominated (steps that compiled: (requests, tokens, longest "
                         f"query) {compiled_at[:8]}): {row['compiles']} engine programs and "
                         f"{row['compile_s']:.1f} s of JAX compiling inside the {res.elapsed_s:.1f} s run")
    return row


def run_mixed(su: Setup, sink: Sink, clock: CompileClock) -> None:
    work = workload(su.args, su.geo["vocab_size"])
    for method in su.args.methods:
        for chunked in (True, False):
            memory: dict = {}
            try:
                row = mixed_case(su, method, chunked, work, clock, memory)
            except Exception as e:  # noqa: BLE001 - OOM and friends: recorded
                row = dict(kind="mixed", method=method, chunked=chunked, error=short(e),
                           memory=dict(memory, at_error=device_memory(),
                                       largest_live=largest_live_arrays()))
            gc.collect()
            sink(row)


# -- tables and main ---------------------------------------------------------------------------

def _f(x, spec=".2f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def _head(cols: str) -> None:
    """A Markdown table's header row and its rule."""
    print("\n" + cols)
    print("|---" * (cols.count("|") - 1) + "|")


def print_tables(rows: list[dict]) -> None:
    itl = [r for r in rows if r["kind"] == "itl"]
    if itl:
        _head("| method | chunk | steps | every step a token | ITL p50 ms | ITL p99 ms | step ms p50 "
              f"| floor ms p50 | step / floor p50 (goal <= {GOAL}) | max | ITL p50 / floor | GEMM TFLOP/s "
              "| compiles in run |")
        for r in itl:
            if "error" in r:
                print(f"| {r['method']} | {r['chunk']} | fails: {r['error'][:150]} |" + " |" * 10)
                continue
            print(f"| {r['method']} | {r['chunk']} | {r['steps']} | {'yes' if r['every_step'] else 'NO'} | "
                  f"{_f(r['itl_p50_ms'])} | {_f(r['itl_p99_ms'])} | {_f(r['step_ms_p50'])} | "
                  f"{_f(r['floor_ms_p50'], '.3f')} | {_f(r['ratio_p50'])} | {_f(r['ratio_max'])} | "
                  f"{_f(r['itl_x_floor'])} | {_f(r['gemm_tflops'], '.3g')} | {r['compiles']} "
                  f"({r['compile_s']:.1f} s) |")
    anchors = [r for r in rows if r["kind"] == "torch_chunk"]
    if anchors:
        _head("| PyTorch chunk step | past | attention | eager ms | compiled ms | floor ms "
              "| PyTorch / floor | specjax plain ms (same past) | specjax / PyTorch |")
        for r in anchors:
            if "error" in r or r.get("eager_ms") is None:
                print(f"| {r['chunk']} | fails: {str(r.get('error', r))[:150]} |" + " |" * 7)
                continue
            print(f"| {r['chunk']} | {r['past']} | {r['attention']} | {_f(r['eager_ms'])} | "
                  f"{_f(r.get('compiled_ms'))} | {_f(r['floor_ms'], '.3f')} | "
                  f"{_f(r['torch_x_floor'])} | {_f(r.get('specjax_ms'))} | "
                  f"{_f(r.get('specjax_x_torch'))} |")
    mixed = [r for r in rows if r["kind"] == "mixed"]
    if mixed:
        _head("| method | chunked | budget | seqs | KV blocks | out tok/s | TTFT p50 ms | TTFT p99 ms "
              "| ITL p50 ms | ITL p99 ms | TPOT p50 ms | preemptions | compiles in run |")
        for r in mixed:
            lead = f"| {r['method']} | {'yes' if r['chunked'] else 'no'} |"
            if "error" in r:
                print(f"{lead} fails: {r['error'][:150]} |" + " |" * 10)
                continue
            print(f"{lead} {r['budget']} | {r['max_num_seqs']} | {r['num_blocks']} | "
                  f"{_f(r['throughput_tok_s'], ',.0f')} | {_f(r['ttft_p50_ms'], ',.1f')} | "
                  f"{_f(r['ttft_p99_ms'], ',.1f')} | {_f(r['itl_p50_ms'])} | {_f(r['itl_p99_ms'])} | "
                  f"{_f(r['tpot_p50_ms'])} | {r['num_preemptions']} | {r['compiles']} ({r['compile_s']:.1f} s) |")
        for r in mixed:
            if "caveat" in r:
                print(f"- {r['method']}, chunked={r['chunked']}: {r['caveat']}")


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="the tiny float32 target and tiny sizes (" + ", ".join(
                        f"{k}={v}" for k, v in SMOKE.items()) + ") unless given")
    ap.add_argument("--parts", default=",".join(PARTS), help="comma separated, of itl,mixed")
    ap.add_argument("--target", choices=("8b", "1b", "tiny"), default=None,
                    help="8b on a GPU, else tiny")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default=None,
                    help="default bfloat16 (float32 with --cpu-smoke)")
    ap.add_argument("--methods", default="plain,eagle3", help="of plain,eagle3")
    ap.add_argument("--k", type=int, default=3, help="EAGLE-3 drafts per step")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--long", type=int, default=None, help="itl: long prompt tokens (32768)")
    ap.add_argument("--chunks", default=None, help="itl: long_prefill_token_threshold values (512,1024,2048)")
    ap.add_argument("--running", type=int, default=None, help="itl: decoding requests (8)")
    ap.add_argument("--running-prompt", type=int, default=None, help="itl: their prompt tokens (1024)")
    ap.add_argument("--rate", type=float, default=None, help="mixed: arrivals per second (4)")
    ap.add_argument("--num-requests", type=int, default=None, help="mixed: requests (64)")
    ap.add_argument("--prompt-range", default=None, help="mixed: lo,hi prompt tokens, log-uniform (128,32768)")
    ap.add_argument("--output-range", default=None, help="mixed: lo,hi output tokens, uniform (64,1024)")
    ap.add_argument("--max-seqs", type=int, default=256, help="mixed: max_num_seqs at most")
    ap.add_argument("--batch-buckets", default=None,
                    help="mixed: batch buckets below max_num_seqs (8,32,128; max_num_seqs is one too)")
    ap.add_argument("--gpu-mem", type=float, default=0.9,
                    help="mixed: gpu_memory_utilization sizing the KV pool on a GPU")
    ap.add_argument("--num-blocks", type=int, default=None, help="mixed: the KV pool instead")
    ap.add_argument("--warmup", choices=("short", "full", "none"), default="short",
                    help="mixed: before the timed run, a short generate, the whole workload, or none")
    ap.add_argument("--torch", action="store_true",
                    help="itl: PyTorch's chunk step beside it (torch_chunk.py, its own process)")
    ap.add_argument("--json", default=None, help="write the settings and every row here")
    args = ap.parse_args(argv)
    defaults = dict(long=32768, chunks="512,1024,2048", running=8, running_prompt=1024, rate=4.0,
                    num_requests=64, prompt_range="128,32768", output_range="64,1024",
                    batch_buckets="8,32,128", num_blocks=None)
    for key, v in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, SMOKE.get(key, v) if args.cpu_smoke else v)
    args.dtype = args.dtype or ("float32" if args.cpu_smoke else "bfloat16")
    args.parts = [p for p in args.parts.split(",") if p]
    args.methods = [m for m in args.methods.split(",") if m]
    if set(args.parts) - set(PARTS) or set(args.methods) - {"plain", "eagle3"}:
        ap.error(f"--parts of {PARTS}, --methods of plain,eagle3")
    args.chunks, args.batch_buckets = _ints(args.chunks), _ints(args.batch_buckets)
    args.prompt_range, args.output_range = _ints(args.prompt_range), _ints(args.output_range)
    for name in ("prompt_range", "output_range"):
        r = getattr(args, name)
        if len(r) != 2 or not 1 <= r[0] <= r[1]:
            ap.error(f"--{name.replace('_', '-')}: lo,hi with 1 <= lo <= hi")
    anchors: list[dict] = []
    if args.torch and "itl" in args.parts and not args.cpu_smoke:
        # first: before this process's JAX backend takes the GPU's memory
        anchors = torch_anchor(args, TARGETS[args.target or "8b"])
    gpu = jax.default_backend() == "gpu"
    args.target = args.target or ("8b" if gpu else "tiny")
    dev = jax.devices()[0]
    settings = dict(vars(args), argv=argv, jax=jax.__version__, device=f"{dev.platform} {dev.device_kind}",
                    xla_flags=os.environ.get("XLA_FLAGS", ""), goal=GOAL, hbm_bps=floors.HBM_BPS)
    print(f"# jax {jax.__version__}; {settings['device']}; target "
          f"{'tiny' if args.cpu_smoke else args.target} {args.dtype}; parts {args.parts}; "
          f"methods {args.methods}; k={args.k}", flush=True)
    sink = Sink(args.json, settings)
    clock = CompileClock()
    su = Setup(args)
    t0 = time.perf_counter()
    if "itl" in args.parts:
        run_itl(su, sink, clock, anchors)
    if "mixed" in args.parts:
        run_mixed(su, sink, clock)
    clock.close()
    sink.doc["wall_s"] = time.perf_counter() - t0
    sink.flush()
    print_tables(sink.doc["rows"])
    print(f"\n# wall {sink.doc['wall_s']:.0f} s", flush=True)
    starved = [(r["method"], r["chunk"]) for r in sink.doc["rows"]
               if r["kind"] == "itl" and r.get("every_step") is False]
    if starved:
        print(f"# CHECK FAILED: a running request went without a token in a prefill step: {starved}")
    return 1 if starved else 0


if __name__ == "__main__":
    sys.exit(main())

"""The device-resident decode loop (``LoopOptions(steps_per_sync=N)``) against the per-step loop.

For each batch size B, each N in ``--n`` (1 = the per-step loop) and each method (plain
decoding; EAGLE-3 at ``--k`` with ``rejection_sample_method="synthetic"`` and the demo
EAGLE-3 head's held-out per-position rates ``--rates``, unconditional), B requests with
``--context``-token prompts run through ``Engine.generate`` (greedy, EOS ignored, the
batch fixed: no request can finish inside the timed window). A warm-up run compiles every
program first. Timed, from the time every request has its first token (the prefill step)
until ``--iters`` (rounded up to a multiple of N) more iterations have been delivered to the host (syncs included):

    per-iter ms = decode wall / iterations
    tokens/s    = tokens delivered in that window / decode wall (all requests)
    host / wait = per iteration, the engine's host time (building, dispatching and
                  committing steps) and the time it sat blocked on the device's results
                  (``Engine.host_s`` / ``wait_s``); the rest of ``iter ms`` is the benchmark's
                  own callback and the loop around it
    ov          = ``LoopOptions(overlap=...)`` (``--overlap``; default: the engine's own
                  choice, on for N > 1): y = the next device-loop call is dispatched
                  before the previous one is committed (N = 1 too)
    ex          = the device loop's form (``--early-exit``): w = while_loop (stops as
                  soon as it may), f = a fixed trip count of N (masked once done),
                  a = the engine's default (``early_exit=None``: f while no request
                  waits, which is every iteration here; w on a CPU target), - = N = 1
    speed-up    = tokens/s / plain decoding's tokens/s at the same B, N, form and overlap
                  (and, the last column, plain's at N = 1 without overlap: the per-step loop)
    TTFT ms     = start of generate -> every request's first token (the prefill steps,
                  compiled already)
    rec.        = programs compiled during the timed runs (must be 0)
    ITL ms      = decode wall / tokens per request (mean inter-token latency); ``gap ms``:
                  the median time between host deliveries (one per sync)

Weights are random (timing does not depend on values; acceptance is synthetic). The
context grows by at most ``iters * (k + 1)`` tokens over the window.

Usage (GPU: an 8B-shaped target like ``benchmarks/e2e.py --target 8b``)::

    python benchmarks/loop.py --target 8b --batch 1,8,32 --n 1,4,8,16,32 --out loop.json
    python benchmarks/loop.py --target 8b --batch 1,8 --n 1,8 --overlap 0,1   # overlap on / off
    python benchmarks/loop.py --target tiny --batch 1,2 --n 1,4 --iters 8 --context 24  # CPU

Prints a table and writes every row as JSON (a list) to ``--out``.

``--torch`` then times ``benchmarks/torch_anchors.py``'s PyTorch decode step and fused
EAGLE-3 step (4-token verify + propose; torch.compile + CUDA graph) at the same B and
``--context`` in this process, and prints loop / torch per iteration (the loop's context
grows over its window, the anchors' does not: the ratio is conservative).
``--profile DIR`` traces one more run of each row under the JAX profiler and prints, per
compiled program (the device events' ``hlo_module``), its kernel time, the device's busy
time and span while it runs, and the idle gaps between its kernels by size: where the loop's
per-iteration time goes beyond its kernels.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from e2e import TARGETS, make_engine, random_params  # noqa: E402

from specjax.config import SpeculativeConfig  # noqa: E402
from specjax.runtime.decode_loop import loop_cache_size  # noqa: E402
from specjax.engine import Engine, SamplingParams, TargetModel, step_cache_size  # noqa: E402
from specjax.models import fuse_projections, registry  # noqa: E402
from specjax.models.config import eagle3_default_aux_layer_ids  # noqa: E402
from specjax.proposers import make_proposer  # noqa: E402

BS = 16
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=256, rope_theta=10000.0,
            rms_norm_eps=1e-5)
DEMO_RATES = (0.76, 0.65, 0.56)


class _Stop(Exception):
    """Raised from the progress callback once the timed window is complete."""


def build_target(size: str, dtype, unfused: bool = False) -> tuple[TargetModel, dict, dict | None]:
    """``(target with fused projections, geometry, the checkpoint-layout params or None)``:
    fused once here, so each engine's ``place_target_params`` (which fuses) keeps these
    arrays; the unfused params only when ``unfused`` (``--fuse 0``)."""
    geo = TINY if size == "tiny" else TARGETS[size]
    cfg = registry.config_from_hf("llama", geo)
    raw = random_params("llama", cfg, dtype, jax.random.key(0))
    return (TargetModel(registry.make_model("llama", cfg), fuse_projections(raw)), geo,
            raw if unfused else None)


def drafter(method: str, target: TargetModel, geo: dict, size: str, k: int, rates, mml: int,
            dtype, **spec):
    """The ``method`` proposer (``eagle3``: the 8B-shaped EAGLE-3 head; ``mtp``: a MiMo MTP
    module of the target's shape; ``ngram_gpu``, ``suffix``: the device history matchers,
    suffix with vLLM 0.34's default corpus), synthetic acceptance at ``rates``; ``spec``:
    more ``SpeculativeConfig`` fields of a model method."""
    synthetic = dict(rejection_sample_method="synthetic", synthetic_acceptance_rates=tuple(rates))
    if method in ("ngram_gpu", "suffix"):
        lookup = dict(prompt_lookup_min=2, prompt_lookup_max=5) if method == "ngram_gpu" else {}
        return make_proposer(SpeculativeConfig(method=method, num_speculative_tokens=k, **lookup,
                                               **synthetic), max_model_len=mml, block_size=BS)
    g = {key: v for key, v in geo.items() if key != "tie_word_embeddings"}
    if method == "mtp":
        hf = dict(g, num_hidden_layers=1, num_nextn_predict_layers=1)
    else:
        aux = eagle3_default_aux_layer_ids(g["num_hidden_layers"])
        hf = dict(g, num_hidden_layers=1, target_hidden_size=g["hidden_size"],
                  eagle_aux_hidden_state_layer_ids=list(aux),
                  **({"draft_vocab_size": 32000, "has_d2t": True} if size == "8b" else {}))
    cfg = registry.config_from_hf(method, hf)
    params = random_params(method, cfg, dtype, jax.random.key(1))
    cfg_spec = SpeculativeConfig(method=method, num_speculative_tokens=k,
                                 rejection_sample_method="synthetic",
                                 synthetic_acceptance_rates=tuple(rates), **spec)
    return make_proposer(cfg_spec, target=target.model, target_params=target.params, draft=cfg,
                         draft_params=params, max_model_len=mml, block_size=BS)


def measure(eng: Engine, prompts, iters: int, max_tokens: int, hook=None, skip: int = 0) -> dict:
    """One generate call timed over ``iters`` delivered iterations that start ``skip``
    iterations after the end of the first sync in which every request holds its first token
    (a prompt batch larger than one step's token budget prefills over several iterations,
    which would otherwise fall inside the window; ``skip`` lets a per-request policy learn
    the same requests first). ``iters`` and ``skip``: multiples of the engine's steps per
    sync, so the window starts and ends on a sync (tokens are counted as each sync delivers
    them). ``hook(i)`` runs after window iteration i (0 = the window's start); with a hook,
    ``marks`` holds each window iteration's ``(seconds since the start, tokens generated
    since it)``."""
    marks: list[tuple[float, int, int]] = []   # (time, generated, sync) after each iteration
    split: list[tuple[float, float]] = []      # (engine host s, engine wait s) at each mark
    b = len(prompts)
    start: list[int] = []                      # the first mark at which all b have a token

    def progress(done, total, generated, started):
        marks.append((time.perf_counter(), generated, eng.num_syncs))
        split.append((eng.host_s, eng.wait_s))
        if not start and started == b:
            start.append(len(marks) - 1)
        elif start and marks[-1][2] == marks[start[0]][2]:     # (the same fetch: its end)
            start[0] = len(marks) - 1
        if start and len(marks) > start[0] + skip + iters:
            raise _Stop
        if start and hook is not None and len(marks) - 1 >= start[0] + skip:
            hook(len(marks) - 1 - start[0] - skip)

    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    try:
        eng.generate(prompts, sp, progress=progress)
    except _Stop:
        pass
    if not start or len(marks) <= start[0] + skip + iters:
        raise RuntimeError(f"the run ended after {len(marks)} iterations, before every request's "
                           f"first token + {skip} + {iters}")
    ttft = marks[start[0]][0] - t0
    marks, split = marks[start[0] + skip:], split[start[0] + skip:]
    (t_first, g_first, s_first), (t_last, g_last, s_last) = marks[0], marks[iters]
    wall = t_last - t_first
    tokens = g_last - g_first
    # a delivery: the first iteration of each sync (the rest come from the same fetch)
    times = [t for i, (t, _, s) in enumerate(marks[: iters + 1]) if i == 0 or s != marks[i - 1][2]]
    gaps = [y - x for x, y in zip(times, times[1:])]
    host_ms, wait_ms = ((split[iters][j] - split[0][j]) / iters * 1e3 for j in (0, 1))
    extra = {} if hook is None else dict(
        marks=[(t - t_first, g - g_first) for t, g, _ in marks[: iters + 1]])
    return dict(per_iter_ms=wall / iters * 1e3, host_ms=host_ms, wait_ms=wait_ms,
                tokens_per_s=tokens / wall,
                tokens_per_iter=tokens / iters / b, ttft_ms=ttft * 1e3,
                itl_ms=wall / (tokens / b) * 1e3, gap_ms=(statistics.median(gaps) * 1e3
                                                         if gaps else float("nan")),
                syncs=len(times) - 1, iters=iters, **extra)


def _module_of(e: dict) -> str:
    a = e.get("args") or {}
    return str(a.get("hlo_module") or a.get("hlo_module_name") or a.get("module") or "?")


#: idle gaps between consecutive kernels of one program, binned (us)
GAP_BINS = (5.0, 20.0, 100.0, 1000.0)


def device_time_by_module(events: list, iterations: int) -> dict:
    """Per compiled program: kernel time, device busy time (union of kernel intervals) and
    span (first kernel start to last kernel end, per run of the program: runs are split
    by idle gaps over 1 ms), kernel count and the idle gaps between its kernels, binned
    by GAP_BINS; every figure divided by ``iterations``."""
    by: dict[str, list] = {}
    for e in events:
        by.setdefault(_module_of(e), []).append((float(e["ts"]), float(e.get("dur", 0.0))))
    out = {}
    for mod, spans in by.items():
        spans.sort()
        kern = sum(d for _, d in spans)
        busy, span, end, start = 0.0, 0.0, None, None
        gaps = [0.0] * (len(GAP_BINS) + 1)
        counts = [0] * (len(GAP_BINS) + 1)
        for ts, dur in spans:
            if end is None or ts - end > 1000.0:          # a new run of the program
                if end is not None:
                    span += end - start
                start, end = ts, ts + dur
                busy += dur
                continue
            if ts > end:
                g = ts - end
                i = sum(g > b for b in GAP_BINS)
                gaps[i] += g
                counts[i] += 1
            busy += max(ts + dur - max(ts, end), 0.0)
            end = max(end, ts + dur)
        if end is not None:
            span += end - start
        out[mod] = dict(kernels=len(spans) / iterations, kernel_us=kern / iterations,
                        busy_us=busy / iterations, span_us=span / iterations,
                        gap_us=[g / iterations for g in gaps], gap_counts=[c / iterations for c in counts])
    return out


def host_between_calls(kernels: list, host: list, top: int = 30) -> dict:
    """What the host does while the device sits idle between two calls of the loop program:
    the idle intervals (the loop's kernels split into calls by gaps over 1 ms) and, per
    host event name (Python frames ``$...`` included: they nest, so the sums overlap),
    its time inside those intervals, per interval."""
    loop = sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0))) for e in kernels
                  if "loop" in _module_of(e))
    idle, end = [], None
    for ts, te in loop:
        if end is not None and ts - end > 1000.0:
            idle.append((end, ts))
        end = te if end is None else max(end, te)
    names: dict[str, float] = {}
    for e in host:
        hs = float(e.get("ts", 0.0))
        he = hs + float(e.get("dur", 0.0))
        for a, b in idle:
            o = min(he, b) - max(hs, a)
            if o > 0:
                names[e.get("name", "?")] = names.get(e.get("name", "?"), 0.0) + o
    n = max(len(idle), 1)
    return dict(intervals=len(idle), idle_us=sum(b - a for a, b in idle) / n,
                host_us={k: v / n for k, v in sorted(names.items(), key=lambda kv: -kv[1])[:top]})


def profile_row(eng: Engine, prompts, iters: int, max_tokens: int, log_dir: str) -> dict:
    """One more ``measure`` run under the JAX profiler; device time by program."""
    import profile_step

    os.makedirs(log_dir, exist_ok=True)
    with jax.profiler.trace(log_dir, create_perfetto_trace=True):
        r = measure(eng, prompts, iters, max_tokens)
    trace = profile_step._load_trace(log_dir)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    _, dev = profile_step.device_pids(events)
    kernels = [e for e in events if e.get("ph") == "X" and e.get("pid") in dev]
    mods = device_time_by_module(kernels, r["iters"])
    host = [e for e in events if e.get("ph") == "X" and e.get("pid") not in dev]
    return dict(per_iter_ms=r["per_iter_ms"], iters=r["iters"], modules=mods,
                between_calls=host_between_calls(kernels, host),
                args_keys=sorted((kernels[0].get("args") or {}).keys()) if kernels else [])


def print_profile(label: str, p: dict) -> None:
    bins = ["<5", "5-20", "20-100", "100-1000", ">1000"]
    print(f"### profile {label}: {p['per_iter_ms']:.3f} ms/iteration over {p['iters']} iterations "
          f"(event args: {p['args_keys']})")
    for mod, m in sorted(p["modules"].items(), key=lambda kv: -kv[1]["kernel_us"])[:6]:
        gaps = ", ".join(f"{b} us: {c:.1f} gaps {g:.0f} us" for b, c, g in
                         zip(bins, m["gap_counts"], m["gap_us"]) if c)
        print(f"###   {mod[:60]}: {m['kernels']:.0f} kernels, kernels {m['kernel_us']:.0f} us, busy "
              f"{m['busy_us']:.0f} us, span {m['span_us']:.0f} us per iteration; idle gaps: {gaps}",
              flush=True)
    bc = p.get("between_calls") or {}
    if bc.get("intervals"):
        print(f"###   between loop calls: {bc['intervals']} idle intervals of {bc['idle_us']:.0f} us "
              "each; host events inside them (us per interval; nested frames overlap):")
        for name, us in bc["host_us"].items():
            print(f"###     {us:8.0f}  {name[:110]}")


def run(args) -> list[dict]:
    dtype = jnp.dtype(args.dtype)
    batches = [int(x) for x in args.batch.split(",")]
    ns = [int(x) for x in args.n.split(",")]
    auto = lambda x: None if x == "auto" else bool(int(x))  # noqa: E731  (None: Engine's default)
    exits = [auto(x) for x in args.early_exit.split(",")]
    overlaps = [auto(x) for x in args.overlap.split(",")]
    fuses = [bool(int(x)) for x in args.fuse.split(",")]
    k = args.k
    target, geo, raw = build_target(args.target, dtype, unfused=False in fuses)
    # timed iterations: a multiple of N (the window ends on a sync), at least --iters
    window = {n: -(-args.iters // n) * n for n in ns}
    max_tokens = (max(window.values()) + 2) * (k + 1)  # nobody finishes inside the window
    mml = -(-(args.context + max_tokens + 2 * k + 8) // BS) * BS
    rng = np.random.default_rng(0)
    rows: list[dict] = []
    plain_tps: dict[tuple[int, int], float] = {}
    for b in batches:
        prompts = [rng.integers(0, geo["vocab_size"], args.context).tolist() for _ in range(b)]
        for method in args.methods:
            prop = None if method == "plain" else drafter(method, target, geo, args.target, k,
                                                          args.rates, mml, dtype)
            for n, ee, ov, fu in [(n, ee, ov, fu) for n in ns for ee in (exits if n > 1 else [None])
                                  for ov in overlaps for fu in fuses]:
                tgt = target if fu else TargetModel(target.model, raw)
                eng = make_engine(tgt, prop, b, mml, dtype, loop=dict(
                    steps_per_sync=n, early_exit=ee, overlap=ov, fuse_projections=fu))
                t = time.perf_counter()
                measure(eng, prompts, min(window[n], 2 * n), max_tokens)   # compiles
                compile_s = time.perf_counter() - t
                before = loop_cache_size() + step_cache_size()
                reps = [measure(eng, prompts, window[n], max_tokens) for _ in range(args.repeat)]
                recompiles = loop_cache_size() + step_cache_size() - before
                r = min(reps, key=lambda x: x["per_iter_ms"])           # the least disturbed
                ov = eng.options.overlap                               # None: the engine's pick
                form = "-" if n == 1 else {None: "a", True: "w", False: "f"}[ee]
                r.update(method=method, batch=b, n=n, early_exit=ee, form=form, overlap=ov,
                         fused=fu, k=0 if prop is None else k,
                         compile_s=compile_s, recompiles=recompiles,
                         per_iter_ms_all=[x["per_iter_ms"] for x in reps])
                if prop is None:
                    plain_tps[(b, n, ee, ov, fu)] = r["tokens_per_s"]
                r["speedup"] = r["tokens_per_s"] / plain_tps.get((b, n, ee, ov, fu), float("nan"))
                r["speedup_vs_step"] = r["tokens_per_s"] / plain_tps.get((b, 1, None, False, fu),
                                                                         float("nan"))
                rows.append(r)
                if args.profile:
                    tag = f"{method}_b{b}_n{n}_{form}_{'y' if ov else 'n'}"
                    r["profile"] = profile_row(eng, prompts, min(window[n], max(2 * n, 16)), max_tokens,
                                               os.path.join(args.profile, tag))
                print(f"{method:<7} {b:>3} {n:>3} {form:>2} {'y' if ov else 'n':>2} {'y' if fu else 'n':>2} "
                      f"{r['per_iter_ms']:>9.3f} {r['host_ms']:>7.3f} {r['wait_ms']:>7.3f} "
                      f"{r['tokens_per_iter']:>7.2f} "
                      f"{r['tokens_per_s']:>10.1f} {r['speedup']:>7.2f}x {r['speedup_vs_step']:>7.2f}x "
                      f"{r['ttft_ms']:>8.1f} {r['itl_ms']:>7.3f} {r['gap_ms']:>7.3f} {r['syncs']:>5} "
                      f"{compile_s:>8.1f} {recompiles:>4}", flush=True)
                if r.get("profile"):
                    print_profile(tag, r["profile"])
                del eng
                gc.collect()
        del prop
        gc.collect()
    return rows


#: The PyTorch anchor each loop row is compared with (``--torch``).
ANCHOR = {"plain": "decode", "eagle3": "fused", "mtp": "mtp_fused"}


def torch_pairs(args, rows: list[dict]) -> list[dict]:
    """The PyTorch anchors (decode, fused = 4-token verify + propose) at each B, in this
    process, and each loop row against its anchor (``ANCHOR``: plain -> decode, eagle3 -> fused, mtp -> mtp_fused)."""
    import torch_anchors
    import floors
    from e2e import TARGETS

    batches = sorted({r["batch"] for r in rows})
    print(f"\n# PyTorch anchors (torch.compile + CUDA graph), B = {batches}", flush=True)
    trows = torch_anchors.measure(
        TARGETS[args.target], batches, args.context, k=args.k,
        anchors=("decode", "fused") + (("mtp_fused",) if "mtp" in args.methods else ()),
        draft_vocab=floors.EAGLE3_DRAFT_VOCAB_8B if args.target == "8b" else None,
        dtype=args.dtype)
    by = {(t["anchor"], t["batch"]): t for t in trows}
    pairs = []
    print("\n| loop | B | N | form | loop ms / iteration | torch anchor | torch ms (synced) | "
          "torch ms (graph) | floor ms | loop / torch (synced) | loop / torch (graph) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        a = by.get((ANCHOR[r["method"]], r["batch"]))
        if a is None:
            continue
        p = dict(method=r["method"], batch=r["batch"], n=r["n"], form=r["form"],
                 overlap=r["overlap"], loop_ms=r["per_iter_ms"], anchor=a["anchor"],
                 torch_synced_ms=a["synced_ms"], torch_graph_ms=a["graph_ms"], floor_ms=a["floor_ms"])
        pairs.append(p)
        print(f"| {p['method']} | {p['batch']} | {p['n']} | {p['form']} | "
              f"{p['loop_ms']:.3f} | {p['anchor']} | {p['torch_synced_ms']:.3f} | "
              f"{p['torch_graph_ms']:.3f} | {p['floor_ms']:.3f} | "
              f"{p['loop_ms'] / p['torch_synced_ms']:.2f} | {p['loop_ms'] / p['torch_graph_ms']:.2f} |",
              flush=True)
    return pairs


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--torch" in argv and "XLA_PYTHON_CLIENT_MEM_FRACTION" not in os.environ:
        # before JAX's backend starts: leave PyTorch half the GPU (JAX takes 75% by default)
        os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = "0.5"
    gpu = jax.default_backend() == "gpu"
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", choices=("8b", "1b", "tiny"), default="8b" if gpu else "tiny")
    ap.add_argument("--batch", default="1,8,32")
    ap.add_argument("--n", default="1,4,8,16,32", help="steps_per_sync values (1: per-step)")
    ap.add_argument("--methods", nargs="+", choices=("plain", "eagle3", "mtp", "ngram_gpu", "suffix"),
                    default=["plain", "eagle3"],
                    help="speed-up columns need plain in the same run")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--rates", type=float, nargs="+", default=list(DEMO_RATES),
                    help="synthetic per-position acceptance rates (unconditional), k of them")
    ap.add_argument("--iters", type=int, default=200, help="timed iterations (>= 200 on the GPU)")
    ap.add_argument("--repeat", type=int, default=2, help="timed runs per row (the fastest kept)")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"),
                    default="bfloat16" if gpu else "float32")
    ap.add_argument("--early-exit", default="auto", help="the device loop's form(s), comma "
                    "separated: 1 = while_loop (stops early), 0 = fixed trip count (masked), auto = "
                    "the Engine's default (the fixed trip count while no request waits: every "
                    "row here)")
    ap.add_argument("--overlap", default="auto", help="LoopOptions(overlap=...) value(s), comma "
                    "separated: 1 = the next device-loop call dispatched before the host "
                    "commits the previous one (N = 1 included), 0 = none, auto = the Engine's "
                    "default (on for N > 1)")
    ap.add_argument("--fuse", default="1", help="LoopOptions(fuse_projections=...) value(s), comma "
                    "separated: 1 = q/k/v and gate/up fused (the default), 0 = the checkpoint "
                    "layout (one process, the same random weights)")
    ap.add_argument("--torch", action="store_true",
                    help="then time the PyTorch decode and fused EAGLE-3 anchors (torch.compile + "
                         "CUDA graph) in this process and print loop / torch")
    ap.add_argument("--profile", metavar="DIR", default=None,
                    help="trace one more run per row under the JAX profiler (traces under DIR) "
                         "and print device time by program, with the idle gaps between kernels")
    ap.add_argument("--out", default=None, help="write the rows as a JSON list here")
    args = ap.parse_args(argv)
    if args.torch and args.target == "tiny":
        ap.error("--torch needs --target 8b or 1b (the anchors' Llama geometry in benchmarks/e2e.py)")
    if len(args.rates) != args.k:
        ap.error(f"--rates needs k={args.k} values, got {len(args.rates)}")
    if args.iters < 2 or args.repeat < 1:
        ap.error("--iters must be >= 2 and --repeat >= 1")
    dev = jax.devices()[0]
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; jax {jax.__version__}; "
          f"{dev.platform} {dev.device_kind}; target {args.target} {args.dtype}; context "
          f"{args.context}; k={args.k}; rates {args.rates}; iters {args.iters}; "
          f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}", flush=True)
    head = (f"{'method':<7} {'B':>3} {'N':>3} {'ex':>2} {'ov':>2} {'fu':>2} {'iter ms':>9} {'host':>7} "
            f"{'wait':>7} {'tok/it':>7} {'tokens/s':>10} "
            f"{'speedup':>8} {'vs N=1':>8} {'TTFT ms':>8} {'ITL ms':>7} {'gap ms':>7} {'syncs':>5} "
            f"{'compile':>8} {'rec.':>4}")
    print(head)
    print("-" * len(head), flush=True)
    rows = run(args)
    pairs = torch_pairs(args, rows) if args.torch else []
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(argv=argv, rows=rows, torch_pairs=pairs), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

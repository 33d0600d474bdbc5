"""Where the time of one engine step goes, per GPU kernel: a JAX profiler trace of the
plain step, the fused speculative step (verify + draft) and the proposer alone,
aggregated by kernel name, with the device busy time against the wall time (the gap is
host-side: dispatch, launches, syncs) and the host-side events by name.

Written to explain the EAGLE-3 gap in benchmarks/RESULTS.md (fused step at k=1 costs
~3.4 ms more than the plain verify step plus ``propose`` timed alone). For each
configuration the script warms the step up, records ``--steps`` steps under
``jax.profiler.trace(..., create_perfetto_trace=True)``, reads the Perfetto JSON the
profiler writes and sums the device-side events by name (events of processes whose name
mentions the GPU). Output: a markdown table per configuration (top kernels, total device
time per step, wall time per step) and JSON.

Usage (H200; the 8B-shaped target of benchmarks/e2e.py, random weights)::

    python benchmarks/profile_step.py --batch 1 --context 1024 --k 1 --propose --out /tmp/prof
    python benchmarks/profile_step.py --target demo --steps 3     # CPU smoke run
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import sys
import time

import jax
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import floors  # noqa: E402  (benchmarks/ is on sys.path when run as a script)
from e2e import BS, Models  # noqa: E402
from specjax.engine import Engine, LoopOptions  # noqa: E402


def _load_trace(log_dir: str) -> dict:
    files = sorted(glob.glob(os.path.join(log_dir, "**", "*.trace.json.gz"), recursive=True)
                   + glob.glob(os.path.join(log_dir, "**", "perfetto_trace.json.gz"), recursive=True))
    if not files:
        raise FileNotFoundError(f"no Perfetto/Chrome trace written under {log_dir}")
    with gzip.open(files[-1], "rt") as f:
        return json.load(f)


def device_pids(events: list) -> tuple[dict, set]:
    """``(process name by pid, the pids of device processes)``: processes whose name
    mentions the GPU."""
    pname = {e.get("pid"): str(e.get("args", {}).get("name", "")) for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    return pname, {pid for pid, n in pname.items() if "gpu" in n.lower() or "/device:" in n.lower()}


def summarize(trace: dict, calls: int) -> dict:
    """Per-step numbers from a trace of ``calls`` steps: device kernel time by name, the
    number of device events, device busy time (union of the event intervals over every
    stream), the trace's wall span, and host events by name (total duration)."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    pname, dev = device_pids(events)
    kernels: dict[str, float] = collections.defaultdict(float)
    host: dict[str, float] = collections.defaultdict(float)
    spans = []
    for e in events:
        if e.get("ph") != "X":
            continue
        dur = float(e.get("dur", 0.0))
        if e.get("pid") in dev:
            kernels[e.get("name", "?")] += dur
            spans.append((float(e.get("ts", 0.0)), dur, e.get("name", "?")))
        elif not str(e.get("name", "")).startswith("$"):     # runtime events, not Python frames
            host[e.get("name", "?")] += dur
    busy, end, first, last = 0.0, -1e30, None, None
    for ts, dur, _ in sorted(spans):
        first = ts if first is None else first
        last = max(last or ts, ts + dur)
        if ts + dur > end:
            busy += ts + dur - max(ts, end)
            end = ts + dur
    per = lambda d: {k: v / calls for k, v in d.items()}  # noqa: E731
    return dict(kernels_us_per_step=per(kernels), host_us_per_step=per(host),
                device_events_per_step=len(spans) / calls, device_busy_us_per_step=busy / calls,
                device_span_us_per_step=((last or 0) - (first or 0)) / calls,
                processes=sorted(pname[p] for p in dev), sequence=last_call(spans))


def last_call(spans: list, gap_us: float = 50.0) -> list:
    """The device events of the last call, in order: ``[name, start_us (from the call's
    first kernel), duration_us, idle_us before it]``. Calls are told apart by a device idle
    gap over ``gap_us`` (each profiled call is synced: the host's launch latency separates
    them)."""
    call, end = [], None
    for ts, dur, name in sorted(spans):
        if end is not None and ts - end > gap_us:
            call = []
        call.append((ts, dur, name, 0.0 if not call else max(ts - end, 0.0)))
        end = ts + dur if end is None else max(end, ts + dur)
    t0 = call[0][0] if call else 0.0
    return [[name, round(ts - t0, 2), round(dur, 2), round(idle, 2)] for ts, dur, name, idle in call]


def _trace(log_dir: str, calls: int, fn) -> dict:
    """Run ``fn`` under the profiler, summarize the trace."""
    os.makedirs(log_dir, exist_ok=True)
    with jax.profiler.trace(log_dir, create_perfetto_trace=True):
        fn()
    return summarize(_load_trace(log_dir), calls)


def profile(eng: Engine, b: int, context: int, steps: int, log_dir: str) -> dict:
    diag = eng.diagnostics
    diag.time_decode_step(b, context, iters=3)                # compile + warm up
    out = {}
    # time_decode_step runs steps + 1 calls (one untimed first call).
    r = _trace(log_dir, steps + 1, lambda: out.update(diag.time_decode_step(b, context, iters=steps)))
    return dict(r, step_ms=out["step_s"] * 1e3)


def profile_propose(b: int, k: int, context: int, steps: int, log_dir: str,
                    models=None, method: str | None = None) -> dict:
    """A proposer's ``propose`` alone, each call synced as in benchmarks/proposers.py's
    latency column: the 8B-shaped EAGLE-3 head of its default table, or (``models``,
    ``method``) any method built as its ``--methods`` table builds it."""
    if method is None:
        from proposers import eagle3_head, propose_case
        model, params, _, _ = eagle3_head()
        prop, state, inputs = propose_case(model, b, k, context)
    else:
        from proposers import method_case
        prop, params, state, inputs, _ = method_case(models, method, b, k, context)
    box = [state]

    def calls(n):
        lat = []
        for _ in range(n):
            t0 = time.perf_counter()
            out, box[0] = prop.propose(params, box[0], inputs)
            jax.block_until_ready(out)
            lat.append(time.perf_counter() - t0)
        return lat

    calls(3)
    lat = []
    r = _trace(log_dir, steps, lambda: lat.extend(calls(steps)))
    return dict(r, step_ms=float(np.median(lat)) * 1e3)


def _table(name: str, r: dict, top: int, sequence: bool = False) -> str:
    ks = sorted(r["kernels_us_per_step"].items(), key=lambda kv: -kv[1])
    total = sum(v for _, v in ks)
    lines = [f"### {name}: {r['step_ms']:.3f} ms/step (median wall); device: {total / 1e3:.3f} ms of "
             f"kernels, busy {r['device_busy_us_per_step'] / 1e3:.3f} ms, span "
             f"{r['device_span_us_per_step'] / 1e3:.3f} ms, {r['device_events_per_step']:.0f} events "
             "per step", "", "| kernel | us/step | share |", "|---|---:|---:|"]
    for k, v in ks[:top]:
        lines.append(f"| `{k[:90]}` | {v:.1f} | {v / max(total, 1e-9):.1%} |")
    if sequence and r.get("sequence"):
        seq = r["sequence"]
        lines += ["", f"The last call's {len(seq)} kernels in order (idle: device gap before it):",
                  "", "| # | kernel | start us | us | idle us |", "|---:|---|---:|---:|---:|"]
        lines += [f"| {i} | `{n[:80]}` | {t:.1f} | {d:.1f} | {g:.1f} |"
                  for i, (n, t, d, g) in enumerate(seq)]
    hs = sorted(r["host_us_per_step"].items(), key=lambda kv: -kv[1])[:top]
    lines += ["", "| host event | us/step |", "|---|---:|"]
    lines += [f"| `{k[:90]}` | {v:.1f} |" for k, v in hs]
    return "\n".join(lines)


def main(argv=None) -> int:
    gpu = jax.default_backend() == "gpu"
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", choices=("8b", "1b", "demo"), default="8b" if gpu else "demo")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--k", type=int, default=1)
    ap.add_argument("--methods", nargs="+", default=["eagle3"])
    ap.add_argument("--tree", action="append", default=[],
                    help="also profile eagle / eagle3 (of --methods) with this "
                         "speculative_token_tree (tree verification + tree drafting; repeatable)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--propose", action="store_true",
                    help="also profile the 8B-shaped EAGLE-3 propose alone (k=--k, B=--batch)")
    ap.add_argument("--propose-methods", nargs="+", default=(),
                    help="profile these methods' propose alone (built as benchmarks/proposers.py "
                         "--methods builds them)")
    ap.add_argument("--no-engine", action="store_true", help="skip the engine-step profiles")
    ap.add_argument("--sequence", action="store_true",
                    help="also list the last call's kernels in launch order, with the idle "
                         "gaps between them")
    ap.add_argument("--out", default="/tmp/specjax_profile")
    ap.add_argument("--min-tokens", type=int, default=1,
                    help="LoopOptions(min_tokens_per_step=...): 2 profiles the plain step padded to "
                         "two tokens (the engine's default before the one-token fix)")
    args = ap.parse_args(argv)
    dtype = jax.numpy.bfloat16 if gpu else jax.numpy.float32
    models = Models(args.target, dtype)
    from specjax.token_tree import TokenTree
    widest = max([args.k] + [TokenTree.from_choices(t).num_nodes for t in args.tree])
    mml = -(-(args.context + 2 * widest + 8) // BS) * BS
    dev = jax.devices()[0]
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; jax {jax.__version__}; "
          f"{dev.platform} {dev.device_kind}; target {args.target}; B={args.batch}; "
          f"context {args.context}; k={args.k}; steps {args.steps}", flush=True)

    def engine(prop):
        return Engine(models.target, prop, max_model_len=mml, block_size=BS, max_num_seqs=args.batch,
                      kv_dtype=dtype, options=LoopOptions(
                          batch_buckets=(args.batch,), context_buckets=(mml // BS,),
                          min_tokens_per_step=args.min_tokens))

    results = {}
    if not args.no_engine:
        results["plain"] = profile(engine(None), args.batch, args.context, args.steps,
                                   os.path.join(args.out, "plain"))
        for m in args.methods:
            results[m] = profile(engine(models.proposer(m, args.k, mml)), args.batch, args.context,
                                 args.steps, os.path.join(args.out, m))
            for i, tree in enumerate(args.tree if m in ("eagle", "eagle3") else ()):
                results[f"{m} tree {tree}"] = profile(
                    engine(models.proposer(m, TokenTree.from_choices(tree).depth, mml, tree=tree)),
                    args.batch, args.context, args.steps, os.path.join(args.out, f"{m}_tree{i}"))
    if args.propose:
        results["propose alone"] = profile_propose(args.batch, args.k, args.context, args.steps,
                                                   os.path.join(args.out, "propose"))
    for m in args.propose_methods:
        results[f"{m} propose alone"] = profile_propose(
            args.batch, args.k, args.context, args.steps, os.path.join(args.out, f"propose_{m}"),
            models=models, method=m)
    for name, r in results.items():
        print(_table(name, r, args.top, args.sequence), "\n", flush=True)
    if results:
        print("# device processes counted:", next(iter(results.values()))["processes"])
    if models.geo is not None:
        nb = jax.numpy.dtype(dtype).itemsize
        fl = {t: floors.floor_ms(floors.target_step_bytes(models.geo, args.batch, args.context - 1, t, nb))
              for t in (1, args.k + 1)}
        print(f"# floor (benchmarks/floors.py) of the target forward: {fl[1]:.3f} ms at 1 token, "
              f"{fl[args.k + 1]:.3f} ms at {args.k + 1} tokens (verify); drafting not included")
    with open(os.path.join(args.out, "profile.json"), "w") as f:
        json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

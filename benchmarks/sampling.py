"""What the sampling features cost in the engine step (issue 22): the step with each feature
on against the step with none, per method and batch size, at the target's vocabulary
(128256 for ``--target 8b``).

The measure is ``benchmarks/e2e.py``'s: ``engine.diagnostics.time_decode_step`` (every request holds
``--context`` tokens in the paged KV cache and ``k`` random drafts; the jitted step, synced
on what the loop fetches; the n-gram proposer's host drafting added), median over
``--iters`` calls; here also the median over ``--rounds`` rounds, the variants interleaved
(forward, then backward order) so drift hits them alike. Variants (every request of the
batch alike unless said):

    a  greedy: no feature (the parent's program: ``procs`` None, no logprobs)
    b  temperature 1, top_k 50, top_p 0.9 (the sampling path without processors)
    c  b + presence 0.5, frequency 0.5, repetition 1.1 penalties, min_p 0.05 (processors on)
    d  c + logprobs=5 (bucket 8), logprobs_mode raw_logprobs (the default)
    e  d with logprobs_mode processed_logprobs (an engine of that mode)
    mixed  B > 1: requests alternate a and d (skip with --no-mixed)

Each row gives ms (step + host drafting), its ratio to a and to b of the same (B, method),
the spread over rounds, the host time to build the step's padded batch (the processor
state included: the loop pays it every step, outside the timed device step) and what the
step ran with, read off the batch and one call's output (``procs`` on, the logprobs bucket
and the returned logprobs' columns). Weights are random.

Usage::

    python benchmarks/sampling.py --target 8b --batch 1,8 --json sampling.json    # GPU
    python benchmarks/sampling.py --target tiny --batch 2 --context 32 --iters 2 --rounds 1
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import e2e  # noqa: E402  (the target shapes, random params, proposers and engine of e2e.py)

from specjax.engine import SamplingParams  # noqa: E402

METHODS = ("plain", "ngram", "eagle3")
GREEDY = SamplingParams()
SAMPLED = SamplingParams(temperature=1.0, top_k=50, top_p=0.9)
PROCESSED = dataclasses.replace(SAMPLED, presence_penalty=0.5, frequency_penalty=0.5,
                                repetition_penalty=1.1, min_p=0.05)
LOGPROBS = dataclasses.replace(PROCESSED, logprobs=5)
#: variant -> (its requests' SamplingParams, one per request of a batch of b; logprobs_mode)
VARIANTS = {
    "a greedy": (lambda b: [GREEDY] * b, "raw_logprobs"),
    "b top_k/top_p": (lambda b: [SAMPLED] * b, "raw_logprobs"),
    "c + penalties, min_p": (lambda b: [PROCESSED] * b, "raw_logprobs"),
    "d + logprobs=5": (lambda b: [LOGPROBS] * b, "raw_logprobs"),
    "e processed logprobs": (lambda b: [LOGPROBS] * b, "processed_logprobs"),
    "mixed a|d": (lambda b: [GREEDY if i % 2 == 0 else LOGPROBS for i in range(b)], "raw_logprobs"),
}


def engine(models: e2e.Models, method: str, b: int, mml: int, k: int, dtype, logprobs_mode: str):
    """``method``'s engine (``plain``: no proposer) for ``b`` requests, as e2e.py's rows."""
    prop = None if method == "plain" else models.proposer(method, k, mml)
    return e2e.make_engine(models.target, prop, b, mml, dtype, logprobs_mode=logprobs_mode)


def probe(eng, b: int, context: int, sps) -> dict:
    """What the step of ``sps`` runs with: one call's batch and output."""
    batch, out = eng.diagnostics.decode_step_output(b, context, sampling_params=sps)
    lp = out.logprobs
    return dict(procs=batch.procs is not None, all_greedy=bool(batch.all_greedy),
                num_logprobs=batch.num_logprobs, logprobs_mode=eng.step.logprobs_mode,
                logprobs_cols=None if lp is None else int(np.shape(lp.logprobs)[-1]),
                logprobs_finite=None if lp is None else bool(np.isfinite(lp.logprobs[:len(sps), 0, 0]).all()))


def measure(models: e2e.Models, method: str, b: int, *, context: int, k: int, dtype, iters: int,
            rounds: int, variants) -> list[dict]:
    """One row per variant of ``(method, b)``: medians over ``rounds`` interleaved rounds."""
    mml = e2e.max_model_len(context, k)
    engines = {mode: engine(models, method, b, mml, k, dtype, mode)
               for mode in dict.fromkeys(VARIANTS[v][1] for v in variants)}
    got: dict[str, list[dict]] = {v: [] for v in variants}
    for r in range(rounds):
        for v in (variants if r % 2 == 0 else variants[::-1]):
            make, mode = VARIANTS[v]
            got[v].append(engines[mode].diagnostics.time_decode_step(
                b, context, iters=iters, sampling_params=make(b)))
    rows = []
    for v in variants:
        make, mode = VARIANTS[v]
        ts = got[v]
        tot = [(t["step_s"] + t["host_propose_s"]) * 1e3 for t in ts]
        rows.append(dict(variant=v, batch=b, method=method, k=0 if method == "plain" else k,
                         ms=float(np.median(tot)), spread_ms=max(tot) - min(tot),
                         step_ms=float(np.median([t["step_s"] * 1e3 for t in ts])),
                         host_ms=float(np.median([t["host_propose_s"] * 1e3 for t in ts])),
                         build_ms=float(np.median([t["build_s"] * 1e3 for t in ts])),
                         compile_s=ts[0]["compile_s"], rounds_ms=tot,
                         **probe(engines[mode], b, context, make(b))))
    base = {r["variant"][0]: r["ms"] for r in rows if r["variant"][0] in "ab"}
    for r in rows:
        r["x_a"] = r["ms"] / base["a"] if "a" in base else float("nan")
        r["x_b"] = r["ms"] / base["b"] if "b" in base else float("nan")
    del engines
    gc.collect()
    return rows


def checks(r: dict) -> str:
    """A row's features as the step ran them."""
    out = ["procs" if r["procs"] else "-", "greedy" if r["all_greedy"] else "sampled"]
    if r["num_logprobs"] is not None:
        out.append(f"logprobs bucket {r['logprobs_cols'] - 1} ({r['logprobs_mode']})")
    return ", ".join(out)


def print_table(rows: list[dict]) -> None:
    print("\n| variant | B | method | ms | x a | x b | spread ms | step ms | host ms | build ms | ran with |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['variant']} | {r['batch']} | {r['method']} | {r['ms']:.3f} | {r['x_a']:.3f} | "
              f"{r['x_b']:.3f} | {r['spread_ms']:.3f} | {r['step_ms']:.3f} | {r['host_ms']:.3f} | "
              f"{r['build_ms']:.3f} | {checks(r)} |", flush=True)


def main(argv=None) -> int:
    gpu = jax.default_backend() == "gpu"
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", choices=("8b", "1b", "tiny"), default="8b" if gpu else "tiny")
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    ap.add_argument("--variants", nargs="+", default=None, metavar="LETTER",
                    help="the variants' first letters / 'mixed' (default: all; a and b give the ratios)")
    ap.add_argument("--no-mixed", dest="mixed", action="store_false",
                    help="skip the mixed batch (requests alternating a and d)")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16" if gpu else "float32")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None, help="write the settings and every row here "
                                                 "(rewritten after each (B, method))")
    args = ap.parse_args(argv)
    if args.iters < 1 or args.rounds < 1:
        ap.error(f"--iters and --rounds must be >= 1, got {args.iters} and {args.rounds}")
    names = list(VARIANTS)
    if args.variants:
        keys = {v.split()[0]: v for v in names}
        bad = [v for v in args.variants if v not in keys]
        if bad:
            ap.error(f"--variants: {bad} not among {sorted(keys)}")
        names = [keys[v] for v in args.variants]
    if not args.mixed:
        names = [v for v in names if not v.startswith("mixed")]
    batches = [int(b) for b in args.batch.split(",")]
    dtype = jnp.dtype(args.dtype)
    dev = jax.devices()[0]
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; jax {jax.__version__}; "
          f"{dev.platform} {dev.device_kind}; target {args.target} {args.dtype} (vocab "
          f"{e2e.TARGETS[args.target]['vocab_size']}); context {args.context}; k={args.k}; "
          f"iters {args.iters}; rounds {args.rounds}; XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}",
          flush=True)
    models = e2e.Models(args.target, dtype)
    rows: list[dict] = []
    for b in batches:
        for m in args.methods:
            vs = [v for v in names if b > 1 or not v.startswith("mixed")]
            t0 = time.perf_counter()
            try:
                got = measure(models, m, b, context=args.context, k=args.k, dtype=dtype,
                              iters=args.iters, rounds=args.rounds, variants=vs)
                rows += got
                print(f"# {m} B={b} in {time.perf_counter() - t0:.0f} s: " + ", ".join(
                    f"{r['variant'].split()[0]} {r['ms']:.3f} ms ({r['x_a']:.2f}x a)" for r in got),
                    flush=True)
            except Exception as e:  # keep the other rows
                print(f"# {m} B={b} failed: {type(e).__name__}: {e}", flush=True)
                rows.append(dict(method=m, batch=b, failed=f"{type(e).__name__}: {e}"))
            finally:
                gc.collect()
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(dict(settings=vars(args), jax=jax.__version__, device=dev.device_kind,
                                   vocab_size=e2e.TARGETS[args.target]["vocab_size"], rows=rows), f, indent=1)
    print_table([r for r in rows if "failed" not in r])
    return 1 if any("failed" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())

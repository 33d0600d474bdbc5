"""The verify-and-propose entry plus the target's forward against the fused step (issue 48).

A stack that runs its model itself (``specjax.make_verify_step``) pays for its own forward,
one jitted call that also takes the logits at ``vs.logits_indices(batch)``, then for the
entry ``vs(...)`` (verification, sampling and drafting in a second jitted call). Issue 48's
criterion: that path costs <= 1.03x the fused step (``specjax.make_step``: forward,
verification and drafting in one program) at B = 1 / 8 / 32.

For each method of ``--methods`` and each B of ``--batch``, one decode batch is built with
``build_batch`` as a serving loop would: every request holds ``--context`` tokens (all but
the last in the paged KV cache) and ``k`` random drafts, so it schedules one uncomputed token
plus ``k`` drafts (``plain``: the one token). Timed, on that batch:

    fused  step(tparams, dparams, kv, state, batch)                  (one jitted call)
    entry  fwd(tparams, kv, stack inputs) -> logits, hidden, aux, kv  (the stack's forward:
           model.forward + compute_logits at vs.logits_indices(batch), one jitted call;
           its inputs sent as one buffer, --forward-inputs)
           then vs(dparams, state, batch, logits, hidden, aux)       (the entry)

Each call is synced on its ``StepOutput`` (what a loop fetches); donated buffers are reused
(the returned KV and draft state feed the next call; both paths share them: same batch,
same slots). A series is ``--warmup`` uncounted calls then the median over ``--iters``;
a round times both series, A B in even rounds and B A in odd ones, after a first round
that compiles (not counted). The table gives each path's median over ``--rounds`` rounds,
its spread (max - min), the ratio of the medians and whether both paths returned the same
tokens and drafts on the compile round. Host drafting (n-gram) is outside both paths and
not timed. ``--parts`` also times the forward alone and the entry alone.

``floor ms``: the target's verify forward (weights + live K/V / 4.3 TB/s,
``benchmarks/floors.py`` via ``e2e.step_floor_ms``); drafting not included. Weights are
random (bf16 on the GPU).

Usage::

    python benchmarks/verify_entry.py --target 8b --batch 1,8,32 --rounds 3 --json verify.json  # GPU
    python benchmarks/verify_entry.py --target tiny --batch 1,2 --iters 2 --rounds 1            # CPU
"""

from __future__ import annotations

import argparse
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

import e2e  # noqa: E402  (the target shapes, random params and proposers of e2e.py)

from specjax.runtime import host_transfer  # noqa: E402
from specjax.runtime.batch import build_batch  # noqa: E402
from specjax.runtime.step import make_step  # noqa: E402
from specjax.runtime.verify import make_verify_step  # noqa: E402

METHODS = ("plain", "ngram", "eagle3")
#: what --methods accepts: plain decoding, the n-gram proposers, every device method
CHOICES = ("plain", "ngram", "ngram_gpu") + e2e.DEVICE_METHODS
#: issue 48's bound on entry / fused
CRITERION = 1.03


def make_forward(model, packed: bool):
    """The stack's forward: ``model.forward`` then ``compute_logits`` at the given rows, one
    jitted call, the KV donated. ``packed``: its inputs ``(input_ids, positions, attn,
    logits indices)`` arrive as one int32 buffer (``host_transfer``; one upload, as the
    fused step sends its batch), else as separate arrays."""
    def run(params, kv, ids, pos, attn, idx):
        hidden, aux, kv = model.forward(params, ids, pos, kv, attn)
        return model.compute_logits(params, hidden[idx]), hidden, aux, kv

    if not packed:
        jitted = jax.jit(run, donate_argnums=1)
        return lambda params, kv, inputs: jitted(params, kv, *inputs)

    def run_packed(params, kv, words, layout):
        return run(params, kv, *host_transfer.unpack(words, layout))

    jitted = jax.jit(run_packed, static_argnums=3, donate_argnums=1)

    def call(params, kv, inputs):
        words, layout = host_transfer.pack(inputs)
        return jitted(params, kv, words, layout)
    return call


def decode_batch(b: int, context: int, k: int, vocab: int, mml: int, seed: int = 0):
    """``(batch, num_blocks)``: ``b`` requests in the steady decode state (``context - 1``
    tokens cached, the last one uncomputed, ``k`` random drafts), one batch bucket of ``b``
    rows, ``k + 1`` token slots each and ``mml // BS`` blocks per request (e2e.py's
    buckets); request ``i`` owns blocks ``1 + i * C .. (i + 1) * C``."""
    rng = np.random.default_rng(seed)
    c = mml // e2e.BS
    toks = [rng.integers(0, vocab, 1 + k).tolist() for _ in range(b)]
    batch = build_batch(toks, num_computed=[context - 1] * b, num_drafts=[k] * b,
                        block_ids=[list(range(1 + i * c, 1 + (i + 1) * c)) for i in range(b)],
                        block_size=e2e.BS, num_reqs_pad=b, query_len_pad=k + 1,
                        blocks_per_req_pad=c, max_spec_len=k)
    return batch, 1 + b * c


def series(call, warmup: int, iters: int, sync=jax.device_get) -> float:
    """Median seconds of ``sync(call())`` over ``iters`` calls, after ``warmup`` uncounted
    ones (default ``sync``: fetch the output to the host, as a loop fetches a
    ``StepOutput``)."""
    for _ in range(warmup):
        sync(call())
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        sync(call())
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def measure(models: e2e.Models, method: str, b: int, *, context: int, k: int, dtype, iters: int,
            rounds: int, warmup: int, packed: bool, parts: bool) -> dict:
    """One row: ``(method, b)``'s fused step and entry path over interleaved rounds."""
    mml = e2e.max_model_len(context, k)
    prop = None if method == "plain" else models.proposer(method, k, mml)
    step = make_step(models.target.model, prop)
    tparams = step.place_target_params(models.target.params)
    vs = make_verify_step(prop, vocab_size=step.vocab_size)
    kk = step.k
    batch, nb = decode_batch(b, context, kk, step.vocab_size, mml)
    kv, state = step.init_caches(nb, e2e.BS, dtype)
    fwd = make_forward(step.target, packed)     # the target with the proposer's aux layers
    live = {"kv": kv, "state": state}
    del kv, state

    def forward():
        idx = vs.logits_indices(batch)
        logits, hidden, aux, live["kv"] = fwd(
            tparams, live["kv"], (batch.input_ids, batch.positions, batch.attn, idx))
        return logits, hidden, aux

    def fused():
        out, live["kv"], live["state"] = step(tparams, step.draft_params, live["kv"],
                                              live["state"], batch)
        return out

    def entry():
        logits, hidden, aux = forward()
        out, live["state"], _ = vs(vs.draft_params, live["state"], batch, logits, hidden, aux)
        return out

    calls = {"fused": fused, "entry": entry}
    compile_s, first = {}, {}
    for name, call in calls.items():                 # round 0: compile, not counted
        t0 = time.perf_counter()
        first[name] = np.asarray(jax.device_get(call()).packed)
        compile_s[name] = time.perf_counter() - t0
    times: dict[str, list[float]] = {name: [] for name in calls}
    for r in range(rounds):
        for name in (("fused", "entry") if r % 2 == 0 else ("entry", "fused")):
            times[name].append(series(calls[name], warmup, iters) * 1e3)
    row = dict(method=method, batch=b, k=kk, t_pad=int(np.shape(batch.input_ids)[0]),
               compile_s=compile_s, same_tokens=bool(np.array_equal(first["fused"], first["entry"])),
               fused_rounds_ms=times["fused"], entry_rounds_ms=times["entry"])
    for name in calls:
        row[f"{name}_ms"] = float(np.median(times[name]))
        row[f"{name}_spread_ms"] = max(times[name]) - min(times[name])
    row["ratio"] = row["entry_ms"] / row["fused_ms"]
    row["round_ratios"] = [e / f for e, f in zip(times["entry"], times["fused"])]
    row["floor_ms"] = e2e.step_floor_ms(models.geo, b, context, kk + 1, dtype)
    if parts:      # each half of the entry path alone (after the rounds: they cannot skew them)
        logits, hidden, aux = forward()
        row["forward_ms"] = series(lambda: forward()[0], warmup, iters,   # logits stay there
                                   sync=jax.block_until_ready) * 1e3

        def entry_alone():
            out, live["state"], _ = vs(vs.draft_params, live["state"], batch, logits, hidden, aux)
            return out
        row["verify_ms"] = series(entry_alone, warmup, iters) * 1e3
    return row


def print_table(rows: list[dict], parts: bool) -> None:
    extra = " forward ms | entry alone ms |" if parts else ""
    print(f"\n| method | B | T | fused ms (spread) | entry ms (spread) | entry / fused | "
          f"<= {CRITERION} | floor ms | fused / floor | same tokens |{extra}")
    print("|---|---|---|---|---|---|---|---|---|---|" + ("---|---|" if parts else ""))
    for r in rows:
        if "failed" in r:
            print(f"| {r['method']} | {r['batch']} | failed: {r['failed']} |", flush=True)
            continue
        more = f" {r['forward_ms']:.3f} | {r['verify_ms']:.3f} |" if parts else ""
        print(f"| {r['method']} | {r['batch']} | {r['t_pad']} | {r['fused_ms']:.3f} "
              f"({r['fused_spread_ms']:.3f}) | {r['entry_ms']:.3f} ({r['entry_spread_ms']:.3f}) | "
              f"{r['ratio']:.3f} | {'yes' if r['ratio'] <= CRITERION else 'NO'} | "
              f"{r['floor_ms']:.3f} | {r['fused_ms'] / r['floor_ms']:.2f} | "
              f"{'yes' if r['same_tokens'] else 'no'} |{more}", flush=True)


def main(argv=None) -> int:
    gpu = jax.default_backend() == "gpu"
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", choices=("8b", "1b", "tiny"), default="8b" if gpu else "tiny")
    ap.add_argument("--batch", default="1,8,32")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--k", type=int, default=3, help="drafts per request (plain: 0)")
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=CHOICES)
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16" if gpu else "float32")
    ap.add_argument("--iters", type=int, default=20, help="timed calls per series (median)")
    ap.add_argument("--warmup", type=int, default=2, help="uncounted calls before each series")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--forward-inputs", choices=("packed", "arrays"), default="packed",
                    help="the stack's forward inputs: one int32 buffer (default) or ~12 arrays")
    ap.add_argument("--parts", action="store_true",
                    help="also time the stack's forward alone and the entry alone")
    ap.add_argument("--json", default=None, help="write the settings and every row here "
                                                 "(rewritten after each (method, B))")
    args = ap.parse_args(argv)
    if args.iters < 1 or args.rounds < 1 or args.warmup < 0 or args.k < 1:
        ap.error(f"--iters, --rounds and --k must be >= 1 and --warmup >= 0, got {args.iters}, "
                 f"{args.rounds}, {args.k} and {args.warmup}")
    batches = [int(x) for x in args.batch.split(",")]
    dtype = jnp.dtype(args.dtype)
    dev = jax.devices()[0]
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; jax {jax.__version__}; "
          f"{dev.platform} {dev.device_kind}; target {args.target} {args.dtype}; context "
          f"{args.context}; k={args.k}; iters {args.iters} (+{args.warmup} warmup); rounds "
          f"{args.rounds}; forward inputs {args.forward_inputs}; "
          f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}", flush=True)
    models = e2e.Models(args.target, dtype)
    rows: list[dict] = []
    for b in batches:
        for m in args.methods:
            t0 = time.perf_counter()
            try:
                r = measure(models, m, b, context=args.context, k=args.k, dtype=dtype,
                            iters=args.iters, rounds=args.rounds, warmup=args.warmup,
                            packed=args.forward_inputs == "packed", parts=args.parts)
                print(f"# {m} B={b} in {time.perf_counter() - t0:.0f} s: fused {r['fused_ms']:.3f} "
                      f"ms, entry {r['entry_ms']:.3f} ms ({r['ratio']:.3f}x)", flush=True)
            except Exception as e:  # keep the other rows
                print(f"# {m} B={b} failed: {type(e).__name__}: {e}", flush=True)
                r = dict(method=m, batch=b, failed=f"{type(e).__name__}: {e}")
            finally:
                gc.collect()
            rows.append(r)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(dict(settings=vars(args), jax=jax.__version__, device=dev.device_kind,
                                   criterion=CRITERION, rows=rows), f, indent=1)
    print_table(rows, args.parts)
    print("\n(entry: the stack's forward + logits, then vs(...); ratio: median entry / median "
          "fused over rounds; floor: the target's verify forward, weights + live K/V / 4.3 TB/s)")
    return 1 if any("failed" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())

"""Time decode-shaped paged attention, backend xla (jnp reference) vs pallas (Triton kernel),
and one EAGLE-3 propose (benchmarks/proposers.py) with each backend.

Attention: B requests of ``--context`` keys each (the last ``q`` of them are the step's
queries), query lengths 1 and 4, 32 query / 8 KV heads, head_dim 128, bf16, block size 16,
causal; the block table is the power-of-two context bucket benchmarks/proposers.py uses
(128 blocks = 2048 tokens for a 1k context), with the requests' blocks scattered. Floor =
the K/V bytes the requests actually hold (``B * context * 8 * 128 * 2 * 2``) / 4.3 TB/s.

Timing (as benchmarks/proposers.py): ``latency`` is the median over ``--reps`` calls of one
jitted call plus ``block_until_ready``; ``pipelined`` is ``--reps`` calls back to back, then
one ``block_until_ready``, divided by ``--reps``.

``--sweep`` also times the Pallas kernel's knobs (key tile ``block_k``, ``num_stages``,
``num_splits``) and prints the best per shape. ``--propose`` runs benchmarks/proposers.py's
``main`` once per backend (the process default, ``specjax.kernels.default_backend``; the
proposers' index ops stay on ``kernel_backend="xla"``).

``--heads 32/4 --head-dim 256 --window 1024 --sinks`` time another shape (Gemma 3's head_dim
256, GQA group 8), a sliding window (keys ``> position - window``) and per-head sink logits;
the floor then counts only the K/V bytes inside the window.

Usage: python benchmarks/attention.py [--batches 1,8,64] [--qlens 1,4] [--context 1024]
       [--reps 20] [--sweep] [--propose] [--heads 32/8] [--head-dim 128] [--window W]
       [--sinks] [--out F.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from specjax.attention_metadata import CommonAttentionMetadata
import specjax.kernels as K
from specjax.kernels.paged_attention import pallas as pk
from specjax.kernels import paged_attention as attn

from floors import HBM_BPS  # noqa: E402  (benchmarks/floors.py: the floor, defined once)
NH, NKV, HD, BS = 32, 8, 128, 16
WINDOW, SINKS = None, None          # --window, --sinks (set by main)


def timed(fn, args, reps):
    """(median latency, pipelined time per call) in seconds; ``fn`` already compiled."""
    jax.block_until_ready(fn(*args))
    lat = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        lat.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    out = None
    for _ in range(reps):
        out = fn(*args)
    jax.block_until_ready(out)
    return statistics.median(lat), (time.perf_counter() - t0) / reps


def make_inputs(b, qlen, ctx, k_spec=3, seed=0):
    width = -(-(ctx + k_spec + 8) // BS)
    width = 1 << (width - 1).bit_length()          # power-of-two context bucket
    nb = b * width
    rng = np.random.default_rng(seed)
    table = rng.permutation(nb).reshape(b, width).astype(np.int32)
    md = CommonAttentionMetadata.from_query_lens([qlen] * b, [ctx] * b, table, block_size=BS,
                                                 max_query_len=qlen)
    dt = jnp.bfloat16
    k = jax.random.normal(jax.random.key(seed), (nb, BS, NKV, HD), jnp.float32).astype(dt)
    v = jax.random.normal(jax.random.key(seed + 1), (nb, BS, NKV, HD), jnp.float32).astype(dt)
    q = jax.random.normal(jax.random.key(seed + 2), (b * qlen, NH, HD), jnp.float32).astype(dt)
    return q, attn.KVCache(k, v), md, width


def pallas_fn(scale, **knobs):
    return jax.jit(lambda q, c, m: pk.paged_attention(
        q, c.k, c.v, m.query_start_loc, m.seq_lens, m.block_table, SINKS, scale=scale,
        max_query_len=m.max_query_len, causal=m.causal, tree_mask=m.tree_mask,
        sliding_window=WINDOW, **knobs))


def bench_attention(args):
    rows = []
    scale = HD ** -0.5
    xla = jax.jit(lambda q, c, m: attn.paged_attention_xla(q, c, m, scale=scale,
                                                           sliding_window=WINDOW, sinks=SINKS))
    for b in [int(s) for s in args.batches.split(",")]:
        for qlen in [int(s) for s in args.qlens.split(",")]:
            q, cache, md, width = make_inputs(b, qlen, args.context)
            kv_bytes = b * min(args.context, WINDOW or args.context) * NKV * HD * 2 * 2
            floor = kv_bytes / HBM_BPS
            max_tiles = -(-width * BS // 64)
            splits = pk.default_num_splits(b, NKV, max_tiles)
            want = xla(q, cache, md)
            variants = [("xla", xla, {})]
            kn = dict(block_k=64, num_stages=2, num_splits=splits)   # the defaults at HD 128
            if HD > 128 or WINDOW is not None:
                kn = {}                                         # the kernel's own choice
            variants.append(("pallas", pallas_fn(scale, **kn), kn))
            if args.sweep:
                for bk in (32, 64, 128):
                    for st in (2, 3):
                        if (bk, st) != (64, 2):
                            kn = dict(block_k=bk, num_stages=st,
                                      num_splits=pk.default_num_splits(
                                          b, NKV, -(-width * BS // bk)))
                            variants.append(("pallas-sweep", pallas_fn(scale, **kn), kn))
                for s in sorted({1, 2 * splits, max(1, splits // 2)} - {splits}):
                    kn = dict(block_k=64, num_stages=2, num_splits=s)
                    variants.append(("pallas-sweep", pallas_fn(scale, **kn), kn))
            for name, fn, knobs in variants:
                try:
                    got = fn(q, cache, md)
                    err = float(jnp.max(jnp.abs(got.astype(jnp.float32)
                                                - want.astype(jnp.float32))))
                    lat, pipe = timed(fn, (q, cache, md), args.reps)
                except Exception as e:  # report and go on: one bad knob must not end the run
                    print(f"B={b} q={qlen} {name} {knobs}: FAILED {type(e).__name__}: {e}")
                    rows.append(dict(batch=b, q_len=qlen, backend=name, knobs=knobs,
                                     error=f"{type(e).__name__}: {e}"))
                    continue
                r = dict(batch=b, q_len=qlen, context=args.context, width_blocks=width,
                         backend=name, knobs=knobs, latency_us=lat * 1e6,
                         pipelined_us=pipe * 1e6, floor_us=floor * 1e6, x_floor=pipe / floor, max_abs_diff_vs_xla=err)
                rows.append(r)
                print(f"B={b:3d} q={qlen} {name:12s} {json.dumps(knobs):60s} latency "
                      f"{r['latency_us']:9.1f} us  pipelined {r['pipelined_us']:9.1f} us  floor "
                      f"{r['floor_us']:7.1f} us ({r['x_floor']:.2f}x)  |diff| {err:.3g}", flush=True)
    return rows


def attention_table(rows):
    out = ["| B | q | xla pipelined (us) | pallas pipelined (us) | best pallas (us) [knobs] | "
           "floor (us) | xla / floor | pallas / floor | best / floor | max abs diff |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    keys = sorted({(r["batch"], r["q_len"]) for r in rows if "error" not in r})
    for b, qlen in keys:
        rs = [r for r in rows if (r["batch"], r["q_len"]) == (b, qlen) and "error" not in r]
        x = next((r for r in rs if r["backend"] == "xla"), None)
        p = next((r for r in rs if r["backend"] == "pallas"), None)
        pal = [r for r in rs if r["backend"].startswith("pallas")]
        best = min(pal, key=lambda r: r["pipelined_us"]) if pal else None
        f = rs[0]["floor_us"]
        fmt = lambda r: f"{r['pipelined_us']:.1f}" if r else "-"  # noqa: E731
        ratio = lambda r: f"{r['pipelined_us'] / f:.2f}" if r else "-"  # noqa: E731
        out.append(f"| {b} | {qlen} | {fmt(x)} | {fmt(p)} | "
                   f"{fmt(best)} {json.dumps(best['knobs']) if best else ''} | {f:.1f} | "
                   f"{ratio(x)} | {ratio(p)} | {ratio(best)} | "
                   f"{max(r['max_abs_diff_vs_xla'] for r in pal) if pal else '-'} |")
    return "\n".join(out)


def bench_propose(args):
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import proposers  # benchmarks/proposers.py

    res = {}
    for backend in ("xla", "pallas"):
        print(f"# EAGLE-3 propose, attention backend {backend}", flush=True)
        with K.default_backend(backend):
            res[backend] = proposers.main(["--batches", args.batches, "--k", "3",
                                           "--context", str(args.context),
                                           "--reps", str(args.reps)])
    lines = ["| B | xla latency (ms) | xla pipelined (ms) | pallas latency (ms) | "
             "pallas pipelined (ms) | floor (ms) | xla / floor | pallas / floor |",
             "|---|---|---|---|---|---|---|---|"]
    for x, p in zip(res["xla"], res["pallas"]):
        lines.append(f"| {x['batch']} | {x['latency_ms']:.3f} | {x['pipelined_ms']:.3f} | "
                     f"{p['latency_ms']:.3f} | {p['pipelined_ms']:.3f} | {x['floor_ms']:.3f} | "
                     f"{x['pipelined_ms'] / x['floor_ms']:.2f} | "
                     f"{p['pipelined_ms'] / p['floor_ms']:.2f} |")
    return res, "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--qlens", default="1,4")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--sweep", action="store_true", help="also time the kernel's knobs")
    ap.add_argument("--propose", action="store_true",
                    help="also time benchmarks/proposers.py's EAGLE-3 propose per backend")
    ap.add_argument("--heads", default="32/8", help="query heads / KV heads")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--window", type=int, default=None, help="sliding window (keys)")
    ap.add_argument("--sinks", action="store_true", help="per-head sink logits")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    global NH, NKV, HD, WINDOW, SINKS
    try:
        NH, NKV = (int(x) for x in args.heads.split("/"))
    except ValueError:
        ap.error(f"--heads takes Q/KV head counts like 32/8, got {args.heads!r}")
    if NH % NKV or args.head_dim < 16 or (args.window is not None and args.window < 1):
        ap.error("--heads: KV heads must divide query heads; --head-dim >= 16; --window >= 1")
    HD, WINDOW = args.head_dim, args.window
    SINKS = (jax.random.normal(jax.random.key(9), (NH,), jnp.float32) if args.sinks else None)
    dev = jax.devices()[0]
    md4 = make_inputs(1, 4, 16)[2]
    auto = attn.resolve_attention_backend((4, NH, HD), (1, BS, NKV, HD), md4, jnp.bfloat16, "auto")
    print(f"# jax {jax.__version__}, {dev.device_kind}, backend {jax.default_backend()}; "
          f"{NH}/{NKV} heads, head_dim {HD}, bf16, block {BS}, context {args.context}, "
          f"window {WINDOW}, sinks {SINKS is not None}; "
          f"backend 'auto' resolves to {auto!r} here", flush=True)
    rows = bench_attention(args)
    table = attention_table(rows)
    print("\n## paged attention (bf16, pipelined)\n")
    print(table)
    result = dict(jax=jax.__version__, device=dev.device_kind, context=args.context,
                  reps=args.reps, attention=rows)
    if args.propose:
        res, ptable = bench_propose(args)
        print("\n## EAGLE-3 propose (benchmarks/proposers.py), per attention backend\n")
        print(ptable)
        result["propose"] = res
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()

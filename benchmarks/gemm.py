"""Small-M GEMMs (the matmuls of a draft forward at B = 1..8) against the HBM floor.

A draft forward at small batch is a chain of GEMVs whose time is the weight bytes read;
this measures how close XLA's GEMMs get, per shape, and whether merging the projections
that share an input (q/k/v, gate/up) helps. Each case jits ``R`` dots of the same shape over
``R`` distinct weight arrays (together > 4x the 50 MB L2, so nothing is served from cache),
summed so none is dead code; time per dot = pipelined time / R; floor = weight bytes / 4.3
TB/s (activations are a few KB).

Usage (H200)::

    python benchmarks/gemm.py --ms 1,2,8 --json /tmp/gemm.json
    XLA_FLAGS=--xla_gpu_enable_triton_gemm=false python benchmarks/gemm.py   # cuBLAS only
    python benchmarks/gemm.py --shapes 8b --ms 4,32,128                      # the target's verify
    python benchmarks/gemm.py --quick                                        # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp

from floors import HBM_BPS  # noqa: E402  (benchmarks/floors.py: the floor, defined once)
L2_BYTES = 50 * 2 ** 20

# (name, K, N): the 8B-shaped EAGLE-3 head and the Llama-3.2-1B-shaped draft model.
SHAPES = [
    ("eagle3 q (2H->H)", 8192, 4096),
    ("eagle3 k|v (2H->Hkv)", 8192, 1024),
    ("eagle3 qkv merged", 8192, 6144),
    ("eagle3 o", 4096, 4096),
    ("eagle3 gate|up", 4096, 14336),
    ("eagle3 gate_up merged", 4096, 28672),
    ("eagle3 down", 14336, 4096),
    ("eagle3 lm_head (Vd 32000)", 4096, 32000),
    ("eagle3 fc (3H->H)", 12288, 4096),
    ("1b q|o", 2048, 2048),
    ("1b k|v", 2048, 512),
    ("1b qkv merged", 2048, 3072),
    ("1b gate|up", 2048, 8192),
    ("1b gate_up merged", 2048, 16384),
    ("1b down", 8192, 2048),
    # the Llama-3.1-8B-shaped target's projections (fused: models.fuse_projections), whose
    # verify runs them at M = B * (k + 1) rows
    ("8b qkv merged", 4096, 6144),
    ("8b o", 4096, 4096),
    ("8b gate_up merged", 4096, 28672),
    ("8b down", 14336, 4096),
    ("8b lm_head (V 128256)", 4096, 128256),
]


def time_case(m: int, k: int, n: int, *, reps: int, min_bytes: int, f32_out: bool = False) -> dict:
    wbytes = k * n * 2
    r = max(2, -(-min_bytes // wbytes))
    key = jax.random.key(0)
    ws = [jax.random.normal(jax.random.fold_in(key, i), (k, n), jnp.bfloat16) for i in range(r)]
    x = jax.random.normal(jax.random.key(1), (m, k), jnp.bfloat16)
    pet = jnp.float32 if f32_out else None

    @jax.jit
    def f(x, ws):
        acc = jnp.zeros((m, n), jnp.float32)
        for w in ws:
            acc = acc + jnp.dot(x, w, preferred_element_type=pet).astype(jnp.float32)
        return acc

    jax.block_until_ready(f(x, ws))
    jax.block_until_ready(f(x, ws))
    t0 = time.perf_counter()
    for _ in range(reps):
        out = f(x, ws)
    jax.block_until_ready(out)
    per = (time.perf_counter() - t0) / reps / r
    floor = wbytes / HBM_BPS
    del ws
    return dict(m=m, k=k, n=n, copies=r, us=per * 1e6, floor_us=floor * 1e6, ratio=per / floor,
                gbps=wbytes / per / 1e9)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ms", default="1,2,8")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--shapes", default=None,
                    help="only the shapes whose name starts with this (e.g. '8b', 'eagle3')")
    ap.add_argument("--quick", action="store_true", help="tiny shapes (CPU smoke run)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    shapes = [s for s in SHAPES if args.shapes is None or s[0].startswith(args.shapes)]
    if args.quick:
        shapes = [(n, k // 32, nn // 32) for n, k, nn in shapes[:3]]
    min_bytes = 2 ** 16 if args.quick else 4 * L2_BYTES
    print(f"# jax {jax.__version__}, {jax.devices()[0].device_kind}; XLA_FLAGS="
          f"{os.environ.get('XLA_FLAGS', '')!r}")
    print("| shape | K | N | M | us / dot | floor us | x floor | GB/s |")
    print("|---|---|---|---|---|---|---|---|", flush=True)
    rows = []
    for name, k, n in shapes:
        for m in (int(s) for s in args.ms.split(",")):
            r = time_case(m, k, n, reps=args.reps, min_bytes=min_bytes, f32_out="lm_head" in name)
            r["shape"] = name
            rows.append(r)
            print(f"| {name} | {k} | {n} | {m} | {r['us']:.1f} | {r['floor_us']:.1f} | "
                  f"{r['ratio']:.2f}x | {r['gbps']:.0f} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()

"""The Pallas grouped matmul's tiles on a MoE target's decode / verify GEMMs (issue 54).

For T tokens (``--tokens``, T * top_k pairs routed uniformly, seeded) and each projection of
a Qwen3-30B-A3B layer (``gate_up`` ``[T*k, H] x [E, H, 2I]``, ``down`` ``[T*k, I] x [E, I,
H]``): ``kernels/grouped_matmul/pallas.py`` at every configuration of the grid (block_m the
default), its ``pair_matmul`` alike (up to ``--pair-max`` pairs), ``jax.lax.ragged_dot``, and
``dense`` (one XLA GEMM reading the touched experts' bytes: what a memory-bound GEMM reaches
here), per layer over ``--layers`` weight stacks in
one program, beside the floor (touched bytes / ``floors.HBM_BPS``). Rows print as measured.

    python benchmarks/grouped_tiles.py --tokens 1,8,32 --json tiles.json          # GPU
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import floors  # noqa: E402
from moe import GEOMETRIES  # noqa: E402


KNOBS = ("block_n", "block_k", "split_k", "num_warps", "num_stages")
#: The kernels swept over ``KNOBS``: the sorted grouped matmul and, up to ``--pair-max``
#: pairs, ``pair_matmul``.
TUNED = ("pallas", "pair")


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def _time(fn, args, iters: int) -> float:
    """Median ms of ``fn(*args)`` over ``iters`` calls (after one compiling call)."""
    import jax

    jax.block_until_ready(fn(*args))
    per = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        per.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(per)


def run(geo: dict, tokens: list[int], grid: dict, layers: int, iters: int, dtype_name: str,
        emit, pair_max: int = 64) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from specjax.kernels.grouped_matmul import pallas

    dtype = jnp.dtype(dtype_name)
    h, i, e, k = (geo[x] for x in ("hidden_size", "moe_intermediate_size", "num_experts",
                                   "num_experts_per_tok"))
    shapes = {"gate_up": (h, 2 * i), "down": (i, h)}
    keys = jax.random.split(jax.random.key(0), 2 * layers)
    stacks = {name: [(jax.random.normal(keys[2 * j + n], (e, kk, nn), jnp.float32)
                      / np.sqrt(kk)).astype(dtype) for j in range(layers)]
              for n, (name, (kk, nn)) in enumerate(shapes.items())}
    rng = np.random.default_rng(0)
    rows = []
    for t in tokens:
        ids = np.stack([rng.choice(e, k, replace=False) for _ in range(t)]).reshape(-1)
        sizes = jnp.asarray(np.bincount(ids, minlength=e), jnp.int32)
        touched = int(np.count_nonzero(np.bincount(ids, minlength=e)))
        for name, (kk, nn) in shapes.items():
            lhs = jax.random.normal(jax.random.key(t), (t * k, kk), jnp.float32).astype(dtype)
            floor = floors.floor_ms(touched * kk * nn * dtype.itemsize)
            base = dict(tokens=t, pairs=t * k, gemm=name, touched=touched, floor_ms=floor)

            def timed(label, one, extra, args):
                fn = jax.jit(lambda x, ws: [one(x, w) for w in ws])
                try:
                    ms = _time(fn, args, iters) / layers
                except Exception as err:  # noqa: BLE001 - a configuration that does not compile
                    emit(dict(base, impl=label, error=f"{type(err).__name__}: {str(err)[:160]}",
                              **extra))
                    return
                rows.append(dict(base, impl=label, ms=ms, **extra))
                emit(rows[-1])

            ws = stacks[name]
            timed("ragged_dot", lambda x, w: jax.lax.ragged_dot(x, w, sizes), {}, (lhs, ws))
            dense = [w[:touched].transpose(1, 0, 2).reshape(kk, touched * nn) for w in ws]
            timed("dense", lambda x, w: x @ w, {}, (lhs[:t], dense))
            del dense
            pairs, groups = jnp.arange(t * k, dtype=jnp.int32), jnp.asarray(ids, jnp.int32)
            for bn, bk, sk, nw, ns in itertools.product(*(grid[x] for x in KNOBS)):
                if nn % bn or kk % bk or (kk // bk) % sk:
                    continue
                cfg = dict(block_n=bn, block_k=bk, split_k=sk, num_warps=nw, num_stages=ns)
                timed("pallas", lambda x, w, cfg=cfg: pallas.grouped_matmul(x, w, sizes, **cfg),
                      cfg, (lhs, ws))
                if t * k <= pair_max:
                    timed("pair", lambda x, w, cfg=cfg: pallas.pair_matmul(x, w, pairs, groups,
                                                                            **cfg), cfg, (lhs, ws))
    return rows


def best(rows: list[dict]) -> list[dict]:
    """Per (tokens, gemm): the fastest ``pallas`` and ``pair`` rows beside ``ragged_dot`` and
    ``dense``."""
    out = []
    for key in dict.fromkeys((r["tokens"], r["gemm"]) for r in rows):
        mine = [r for r in rows if (r["tokens"], r["gemm"]) == key and "ms" in r]
        out += [r for r in mine if r["impl"] not in TUNED]
        out += [min(c, key=lambda r: r["ms"]) for impl in TUNED
                if (c := [r for r in mine if r["impl"] == impl])]
    return out


def _line(r: dict) -> str:
    cfg = " ".join(f"{n}={r[n]}" for n in KNOBS if n in r)
    if "error" in r:
        return f"# T={r['tokens']} {r['gemm']} {r['impl']} {cfg}: {r['error']}"
    return (f"| {r['tokens']} | {r['gemm']} | {r['impl']} {cfg} | {r['ms'] * 1e3:.1f} | "
            f"{r['floor_ms'] * 1e3:.1f} | {r['ms'] / r['floor_ms']:.2f} |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--geometry", choices=tuple(GEOMETRIES), default=None,
                    help="default: 30b-a3b on a GPU, tiny elsewhere")
    ap.add_argument("--tokens", default="1,8,32", help="tokens T (T * top_k routed pairs)")
    ap.add_argument("--block-n", default="32,64,128")
    ap.add_argument("--block-k", default="64,128")
    ap.add_argument("--split-k", default="1,2,4")
    ap.add_argument("--num-warps", default="4,8")
    ap.add_argument("--num-stages", default="3")
    ap.add_argument("--layers", type=int, default=8, help="weight stacks in one program")
    ap.add_argument("--pair-max", type=int, default=64,
                    help="pairs (T * top_k) up to which pair_matmul is swept too")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    try:
        tokens = _ints(args.tokens)
        grid = {n: _ints(getattr(args, n)) for n in KNOBS}
    except ValueError:
        ap.error("--tokens, --block-n, --block-k, --split-k, --num-warps, --num-stages take "
                 "comma-separated integers")
    if min(tokens) < 1 or args.layers < 1 or args.iters < 2 or min(min(v) for v in grid.values()) < 1:
        ap.error("--tokens, the tile lists and --layers must be >= 1; --iters >= 2")
    import jax

    gpu = jax.default_backend() == "gpu"
    name = args.geometry or ("30b-a3b" if gpu else "tiny")
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; jax {jax.__version__}; "
          f"{jax.devices()[0].device_kind}; {name}; {args.layers} layers a program; floor at "
          f"{floors.HBM_BPS / 1e12:.1f} TB/s")
    print("| T | GEMM | impl | us a layer | floor us | / floor |\n|---|---|---|---|---|---|",
          flush=True)
    rows = run(GEOMETRIES[name], tokens, grid, args.layers, args.iters,
               "bfloat16" if gpu else "float32", lambda r: print(_line(r), flush=True),
               args.pair_max)
    print("# best per (T, GEMM):")
    for r in best(rows):
        print(_line(r))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(argv=argv, geometry=name, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

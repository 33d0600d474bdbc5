"""The Pallas paged-attention kernel as a model runs it: ``--layers`` calls (distinct K/V
caches, one per layer, each call's output the next one's queries) in one jitted program, so
the ~50 us of one jitted call's dispatch is spread over the layers and the figure is the
kernels' own time, with the kernel's knobs swept (``num_splits``, ``block_k``).
``--kv-write`` times ``attend`` instead (the step's K/V written into each layer's cache, then
the attention; caches donated, as in a model step) with its ``fused_kv_write`` and
``kv_write_kernel`` arguments swept.

Shapes as ``benchmarks/attention.py`` (its ``make_inputs``: 32 query / 8 KV heads, head_dim
128, bf16, block 16, ``--context`` keys per request, a power-of-two block-table bucket);
floor = every layer's live K/V bytes / 4.3 TB/s. Time: the best of 3 rounds of 10 pipelined
calls. This is what chose ``limits.PROGRAMS_PER_SM`` (benchmarks/RESULTS.md).

Usage (GPU): python benchmarks/attention_layers.py [--batches 1,8,16,32,64] [--qlens 1,4]
             [--layers 32] [--context 1024] [--splits 1,2,4,8] [--block-k 64,128] [--kv-write]
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

import jax
import jax.numpy as jnp

from attention import HD, NKV, make_inputs  # noqa: E402  (benchmarks/attention.py)
from floors import HBM_BPS  # noqa: E402
from specjax.kernels import paged_attention as attn
from specjax.kernels.paged_attention import pallas as pk

#: ``attend``'s cache-write arguments swept by ``--kv-write`` (the first is the default).
KV_WRITE_GRID = [dict(fused_kv_write="auto", kv_write_kernel=True),
                 dict(fused_kv_write=True, kv_write_kernel=True),
                 dict(fused_kv_write=False, kv_write_kernel=True),
                 dict(fused_kv_write=False, kv_write_kernel=False)]


def ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",")]


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,8,16,32,64")
    ap.add_argument("--qlens", default="1,4")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--splits", default="1,2,4,8")
    ap.add_argument("--block-k", default="64,128")
    ap.add_argument("--kv-write", action="store_true",
                    help="time attend (K/V write + attention) over its cache-write arguments")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.kv_write:
        return kv_write_sweep(args)
    rows = []
    for b, ql in itertools.product(ints(args.batches), ints(args.qlens)):
        q, cache, md, _ = make_inputs(b, ql, args.context)
        ks = [jnp.array(cache.k, copy=True) for _ in range(args.layers)]
        vs = [jnp.array(cache.v, copy=True) for _ in range(args.layers)]
        floor = args.layers * b * args.context * NKV * HD * 2 * 2 / HBM_BPS
        grid = [{}] + [dict(num_splits=s, block_k=bk)
                       for s, bk in itertools.product(ints(args.splits), ints(args.block_k))]
        for kn in grid:
            def layers(q, ks, vs, qsl, sl, bt, kn=kn):
                x = q
                for k, v in zip(ks, vs):
                    x = pk.paged_attention(x, k, v, qsl, sl, bt, scale=HD ** -0.5,
                                           max_query_len=ql, causal=True, **kn)
                return x
            f = jax.jit(layers)
            a = (q, ks, vs, md.query_start_loc, md.seq_lens, md.block_table)
            try:
                jax.block_until_ready(f(*a))
            except Exception as e:  # one bad knob must not end the sweep
                print(f"B={b} q={ql} {json.dumps(kn)}: FAILED {type(e).__name__}: {e}")
                continue
            rows.append(_record(args, b, ql, kn or "default", _best_of(lambda: f(*a)), floor))
    return _write(args, rows)


def _best_of(call) -> float:
    """Seconds per ``call()`` (which returns what to wait for): the best of 3 rounds of 10."""
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(10):
            out = call()
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - t0) / 10)
    return best


def _record(args, b: int, ql: int, knobs, best: float, floor: float) -> dict:
    r = dict(batch=b, q_len=ql, layers=args.layers, knobs=knobs, ms=best * 1e3,
             floor_ms=floor * 1e3)
    print(f"B={b:3d} q={ql} {json.dumps(knobs):50s} {r['ms']:7.3f} ms  floor "
          f"{r['floor_ms']:.3f} ({best / floor:.2f}x)", flush=True)
    return r


def _write(args, rows: list[dict]) -> list[dict]:
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    return rows


def kv_write_sweep(args) -> list[dict]:
    """``--layers`` calls of ``attend`` per program (each layer's output the next one's
    queries, its first ``NKV`` heads the new K/V), the caches donated and carried from call
    to call, per entry of :data:`KV_WRITE_GRID`."""
    rows = []
    for b, ql in itertools.product(ints(args.batches), ints(args.qlens)):
        q, cache, md, _ = make_inputs(b, ql, args.context)
        floor = args.layers * b * args.context * NKV * HD * 2 * 2 / HBM_BPS
        for kn in KV_WRITE_GRID:
            def layers(q, ks, vs, md, kn=kn):
                x, ks2, vs2 = q, [], []
                for k, v in zip(ks, vs):
                    new = x[:, :NKV]
                    x, c = attn.attend(x, new, -new, attn.KVCache(k, v), md, scale=HD ** -0.5,
                                       backend="pallas", **kn)
                    ks2.append(c.k)
                    vs2.append(c.v)
                return x, ks2, vs2
            f = jax.jit(layers, donate_argnums=(1, 2))
            ks = [jnp.array(cache.k, copy=True) for _ in range(args.layers)]
            vs = [jnp.array(cache.v, copy=True) for _ in range(args.layers)]
            try:
                out, ks, vs = f(q, ks, vs, md)
                jax.block_until_ready(out)
            except Exception as e:  # one failing variant must not end the sweep
                print(f"B={b} q={ql} {json.dumps(kn)}: FAILED {type(e).__name__}: {e}")
                continue
            carried = [ks, vs]

            def call(f=f, carried=carried):      # the caches donated and carried
                out, carried[0], carried[1] = f(q, carried[0], carried[1], md)
                return out
            rows.append(_record(args, b, ql, kn, _best_of(call), floor))
    return _write(args, rows)


if __name__ == "__main__":
    main()

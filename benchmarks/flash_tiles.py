"""The flash kernel's tiles (issue 50): ``flash_config``'s ``rows``, ``block_k``,
``num_warps`` and the pipeline's ``num_stages`` swept on one layer's attention, per backend
(``flash.py`` through Pallas-Triton, ``triton_flash.py`` through jax-triton).

Cases (8B shapes: 32 query heads, 8 kv heads, head_dim 128, bf16, block size 16):

- ``prefill T``: one request, T prompt tokens, causal (default 1024, 8192, 32768);
- ``chunks``: four prefill chunks (4096, 2048, 1024, 512 tokens) at the end of 8k-token
  contexts beside 64 decode rows of 4k-token contexts: a chunked-prefill step;
- ``batch``: 16 requests of 1,024 prompt tokens (a 16k-token step of B = 256's prefill);
- ``chunk T/C``: one T-token prefill chunk at the end of a C-token context beside 8 decode
  rows of 1k-token contexts (``scheduling.py``'s ITL step: ``chunk 512/32768``).

Each config: compiled, its output checked against ``paged_attention(backend="xla")`` (the
reference; ``max |err|`` over the batch), then timed (median of up to ``--iters`` synced
calls). A config the compiler refuses (shared memory) is recorded with its error. The
default (every knob ``None``) is the first row of each case; ``x default`` = its time / the
config's. FLOP rate: the causal half of QK^T and PV (each case's visible pairs).

Usage (GPU)::

    python benchmarks/flash_tiles.py --json tiles.json
    python benchmarks/flash_tiles.py --backends pallas --cases "prefill 32768" --quick
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from prefill import jax_sync, short, timed  # noqa: E402

from specjax.attention_metadata import CommonAttentionMetadata  # noqa: E402
from specjax.kernels.paged_attention import KVCache, paged_attention  # noqa: E402
from specjax.kernels.paged_attention import flash as kflash  # noqa: E402

NH, NKV, HD, BS = 32, 8, 128, 16
ROWS, BLOCK_K, WARPS, STAGES = (64, 128, 256), (32, 64, 128), (4, 8), (1, 2, 3, 4)
QUICK = dict(rows=(64, 128), block_k=(64, 128), num_warps=(4, 8), num_stages=(2, 3))


def case_batch(name: str):
    """``(query_lens, seq_lens)`` of a case name (see the module docstring)."""
    if name.startswith("prefill "):
        t = int(name.split()[1])
        return [t], [t]
    if name == "chunks":
        q = [4096, 2048, 1024, 512] + [1] * 64
        return q, [8192] * 4 + [4096] * 64
    if name == "batch":
        return [1024] * 16, [1024] * 16
    if name.startswith("chunk "):
        try:
            t, c = (int(x) for x in name.split()[1].split("/"))
        except ValueError:
            t = c = 0
        if not 0 < t <= c:
            raise ValueError(f"--cases: {name!r} needs integers 0 < T <= C")
        return [t] + [1] * 8, [c] + [1024] * 8
    raise ValueError(f"--cases: unknown case {name!r}; allowed 'prefill T', chunks, batch, "
                     "'chunk T/C'")


def make_inputs(name: str, dtype, seed: int = 0):
    """``(q, cache, metadata, visible pairs)``: each request's blocks contiguous, after the
    null block 0."""
    qlens, slens = case_batch(name)
    nblk = [-(-s // BS) for s in slens]
    width = max(nblk)
    table = np.zeros((len(qlens), width), np.int32)
    first = 1
    for i, n in enumerate(nblk):
        table[i, :n] = np.arange(first, first + n)
        first += n
    md = CommonAttentionMetadata.from_query_lens(qlens, slens, table, block_size=BS)
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    t = sum(qlens)
    q = jax.random.normal(kq, (t, NH, HD), jnp.float32).astype(dtype)
    shape = (first, BS, NKV, HD)
    cache = KVCache(jax.random.normal(kk, shape, jnp.float32).astype(dtype),
                    jax.random.normal(kv, shape, jnp.float32).astype(dtype))
    return q, cache, md, visible_pairs(qlens, slens)


def visible_pairs(qlens, slens) -> int:
    """(query, key) pairs a causal mask lets through: each request's queries are the last
    of its context."""
    return sum(ql * (s - ql) + ql * (ql + 1) // 2 for ql, s in zip(qlens, slens))


def run_config(backend: str, q, cache, md, ref, knobs: dict, args) -> dict:
    """Compile, check and time one config of one backend."""
    if backend == "pallas":
        from specjax.kernels.paged_attention.flash import paged_attention as kern
    else:
        from specjax.kernels.paged_attention.triton_flash import paged_attention as kern
    f = jax.jit(functools.partial(kern, scale=HD ** -0.5, max_query_len=md.max_query_len,
                                  causal=True, **knobs))

    def call():
        return f(q, cache.k, cache.v, md.query_start_loc, md.seq_lens, md.block_table)

    r = timed(call, jax_sync, warmup=1, iters=args.iters, budget_s=args.case_s)
    out = r.pop("out")
    n = int(md.query_start_loc[-1])
    r["max_err"] = float(jnp.max(jnp.abs(out[:n].astype(jnp.float32) - ref[:n])))
    return r


def sweep(knob_sets: dict):
    """Every combination of the knobs; the default (all ``None``) first."""
    names = list(knob_sets)
    yield {}
    for values in itertools.product(*(knob_sets[k] for k in names)):
        yield dict(zip(names, values))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="prefill 1024,prefill 8192,prefill 32768,chunks,batch",
                    help="comma separated: 'prefill T', chunks, batch, 'chunk T/C'")
    ap.add_argument("--backends", default="pallas,triton", help="of pallas,triton")
    ap.add_argument("--quick", action="store_true", help=f"fewer configs: {QUICK}")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--case-s", type=float, default=1.0, help="stop timing a config after this")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    ap.add_argument("--json", default=None, help="write every row here (rewritten per row)")
    args = ap.parse_args(argv)
    bad = sorted(set(args.backends.split(",")) - {"pallas", "triton"})
    if bad:
        ap.error(f"--backends: unknown {bad}; allowed pallas, triton")
    knob_sets = QUICK if args.quick else dict(rows=ROWS, block_k=BLOCK_K, num_warps=WARPS,
                                              num_stages=STAGES)
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    for name in cases:
        try:
            case_batch(name)
        except ValueError as e:
            ap.error(str(e))
    dtype = jnp.dtype(args.dtype)
    rows: list[dict] = []
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; jax {jax.__version__}; "
          f"{jax.devices()[0].device_kind}; {args.dtype}", flush=True)
    for name in cases:
        q, cache, md, pairs = make_inputs(name, dtype)
        flops = 4.0 * NH * HD * pairs
        ref = jax.jit(functools.partial(paged_attention, scale=HD ** -0.5, backend="xla"))(
            q, cache, md).astype(jnp.float32)
        for backend in args.backends.split(","):
            base = None
            for knobs in sweep(knob_sets):
                if knobs:
                    try:
                        kflash.flash_config(head_dim=HD, group=NH // NKV,
                                            max_query_len=md.max_query_len, **knobs)
                    except ValueError:
                        continue
                row = dict(case=name, backend=backend, knobs=knobs or "default", flops=flops)
                try:
                    r = run_config(backend, q, cache, md, ref, knobs, args)
                    row.update(r, tflops=flops / (r["ms"] * 1e-3) / 1e12)
                    base = r["ms"] if not knobs else base
                    if base:
                        row["x_default"] = base / r["ms"]
                except Exception as e:  # noqa: BLE001 - recorded, the sweep goes on
                    row["error"] = short(e, 160)
                rows.append(row)
                print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                               for k, v in row.items() if k not in ("min_ms", "max_ms")),
                      flush=True)
                if args.json:
                    with open(args.json, "w") as fh:
                        json.dump(rows, fh, indent=1, default=str)
        del q, cache, ref
    print("\n| case | backend | best knobs | ms | TFLOP/s | x default | default ms |")
    print("|---|---|---|---|---|---|---|")
    for key in dict.fromkeys((r["case"], r["backend"]) for r in rows):
        ok = [r for r in rows if (r["case"], r["backend"]) == key and "ms" in r]
        if not ok:
            continue
        best = min(ok, key=lambda r: r["ms"])
        dflt = next((r["ms"] for r in ok if r["knobs"] == "default"), float("nan"))
        print(f"| {key[0]} | {key[1]} | {best['knobs']} | {best['ms']:.2f} | "
              f"{best['tflops']:.0f} | {dflt / best['ms']:.2f} | {dflt:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

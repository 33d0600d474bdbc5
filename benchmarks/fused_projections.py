"""q/k/v and gate/up as separate GEMMs against one fused GEMM (``specjax.models.
fuse_projections``), and against a concatenation inside the jitted program: 32 layers of
distinct Llama-3.1-8B-shaped bf16 weights (so no layer's weights sit in L2), M rows each,
pipelined ms per program (best of 3 runs of 30 calls), beside the weight-read floor
(benchmarks/floors.py's 4.3 TB/s).

Usage (H200): python benchmarks/fused_projections.py      (SMOKE=1: tiny shapes, any device)
"""
import os
import time

import jax
import jax.numpy as jnp

from floors import HBM_BPS

H, NQ, NKV, I, L = 4096, 4096, 1024, 14336, 32
if os.environ.get("SMOKE"):
    H, NQ, NKV, I, L = 256, 256, 64, 512, 2
key = jax.random.key(0)
def w(*s, k=[0]):
    k[0] += 1
    return (jax.random.normal(jax.random.fold_in(key, k[0]), s, jnp.float32) * 0.02).astype(jnp.bfloat16)
wq = [w(H, NQ) for _ in range(L)]; wk = [w(H, NKV) for _ in range(L)]; wv = [w(H, NKV) for _ in range(L)]
wqkv = [jnp.concatenate([a, b, c], 1) for a, b, c in zip(wq, wk, wv)]
wg = [w(H, I) for _ in range(L)]; wu = [w(H, I) for _ in range(L)]
wgu = [jnp.concatenate([a, b], 1) for a, b in zip(wg, wu)]
def sep_qkv(x, wq, wk, wv):
    acc = []
    for a, b, c in zip(wq, wk, wv):
        acc += [(x @ a)[:, :8].astype(jnp.float32).sum(), (x @ b)[:, :8].astype(jnp.float32).sum(), (x @ c)[:, :8].astype(jnp.float32).sum()]
        x = x + acc[-1].astype(x.dtype) * 0
    return sum(acc)
def fused_qkv(x, wqkv):
    acc = []
    for a in wqkv:
        y = x @ a
        acc += [y[:, :8].astype(jnp.float32).sum(), y[:, NQ:NQ + 8].astype(jnp.float32).sum(), y[:, NQ + NKV:NQ + NKV + 8].astype(jnp.float32).sum()]
        x = x + acc[-1].astype(x.dtype) * 0
    return sum(acc)
def cat_qkv(x, wq, wk, wv):
    return fused_qkv(x, [jnp.concatenate([a, b, c], 1) for a, b, c in zip(wq, wk, wv)])
def cat_mlp(x, wg, wu):
    return fused_mlp(x, [jnp.concatenate([a, b], 1) for a, b in zip(wg, wu)])
def sep_mlp(x, wg, wu):
    acc = []
    for a, b in zip(wg, wu):
        y = jax.nn.silu(x @ a) * (x @ b)
        acc.append(y[:, :8].astype(jnp.float32).sum()); x = x + acc[-1].astype(x.dtype) * 0
    return sum(acc)
def fused_mlp(x, wgu):
    acc = []
    for a in wgu:
        y = x @ a
        y = jax.nn.silu(y[:, :I]) * y[:, I:]
        acc.append(y[:, :8].astype(jnp.float32).sum()); x = x + acc[-1].astype(x.dtype) * 0
    return sum(acc)
def timeit(f, args, reps=30):
    jax.block_until_ready(f(*args))
    ts = []
    for _ in range(3):
        t0 = time.perf_counter(); o = None
        for _ in range(reps): o = f(*args)
        jax.block_until_ready(o); ts.append((time.perf_counter() - t0) / reps)
    return min(ts) * 1e3
bw = HBM_BPS
for m in (2, 8, 32, 128, 256):
    x = w(m, H)
    f1, f2, f3, f4 = (jax.jit(f) for f in (sep_qkv, fused_qkv, sep_mlp, fused_mlp))
    t1 = timeit(f1, (x, wq, wk, wv)); t2 = timeit(f2, (x, wqkv))
    t3 = timeit(f3, (x, wg, wu)); t4 = timeit(f4, (x, wgu))
    t5 = timeit(jax.jit(cat_qkv), (x, wq, wk, wv)); t6 = timeit(jax.jit(cat_mlp), (x, wg, wu))
    print(f"M={m}: in-jit concat qkv {t5:.3f} gate_up {t6:.3f}", flush=True)
    fq = L * H * (NQ + 2 * NKV) * 2 / bw * 1e3; fm = L * H * 2 * I * 2 / bw * 1e3
    print(f"M={m}: qkv sep {t1:.3f} fused {t2:.3f} ms (floor {fq:.3f}, fused/sep {t2/t1:.3f}); "
          f"gate_up sep {t3:.3f} fused {t4:.3f} ms (floor {fm:.3f}, fused/sep {t4/t3:.3f})", flush=True)

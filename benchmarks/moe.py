"""MoE targets (issue 54): the expert GEMMs and the decode / verify steps of a
Qwen3-30B-A3B-shaped bf16 target (random weights) against their floors and PyTorch.

Parts (``--parts``, default all):

- ``experts``: the sparse MoE blocks of the first ``--expert-layers`` layers (default 8; 0:
  all; each compiled grouped GEMM costs compile time, and a layer's time is every layer's)
  (router, top-k, the grouped GEMMs) over
  ``T = B * q`` tokens (q = 1: decode, q = k + 1: a verify step) as one jitted program,
  ``jax.lax.ragged_dot`` (backend ``"xla"``) beside specjax's Pallas kernel (``"pallas"``,
  ``kernels/grouped_matmul``: the GPU default) and JAX's Hopper Pallas example
  (``jax.experimental.pallas.ops.gpu.ragged_dot_mgpu``, GPU only), with the experts the
  routing actually touched (``touched``: distinct experts summed over layers) and the
  floor ``touched * expert bytes / HBM_BPS``. Its PyTorch anchor (``--torch``) is the same
  stack with ``torch._grouped_mm``, ``torch.compile``'d and replayed in a CUDA graph, in a
  separate process (``python benchmarks/moe.py --anchor experts ...``) so the two never
  share a GPU allocator.
- ``decode``: the engine (``Engine.generate``, ``benchmarks/loop.py``'s ``measure``) with the
  MoE target, plain and EAGLE-3 (a random 1-layer head, synthetic acceptance), per delivered
  iteration, beside the step's floor: attention, router, norms and lm_head weights, the
  expected distinct experts of ``B * q`` uniformly routed tokens per layer, and the K/V.
  Its PyTorch anchor (``--torch``) is the whole Qwen3-MoE forward (:class:`TorchMoE`: SDPA
  over a static cache, the same ``torch._grouped_mm`` MoE block, each layer
  ``torch.compile``'d, the step a CUDA graph; greedy tokens out) at q = 1 (decode) and
  q = k + 1 (a verify step), in its own process before JAX, printed beside the plain
  iteration.

Parts run in the order ``--parts`` names them; each row is printed as it is measured (with
its compile seconds), so a run cut short keeps what it measured.

Usage (GPU)::

    python benchmarks/moe.py --batch 1,8,32 --torch --json moe.json
    python benchmarks/moe.py --geometry tiny --batch 1,2 --iters 4   # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

import floors  # noqa: E402

#: Qwen3-30B-A3B (``config.json`` keys) and a tiny one for CPU runs.
GEOMETRIES = {
    "30b-a3b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
                    num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                    vocab_size=151936, num_experts=128, num_experts_per_tok=8,
                    moe_intermediate_size=768, norm_topk_prob=True, rope_theta=1e6,
                    rms_norm_eps=1e-6),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=8,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256,
                 num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                 norm_topk_prob=True, rope_theta=1e6, rms_norm_eps=1e-6),
}


def expert_bytes(geo: dict, dtype_bytes: int = 2) -> int:
    """One expert's gate, up and down matrices."""
    return 3 * geo["hidden_size"] * geo["moe_intermediate_size"] * dtype_bytes


def expected_touched(geo: dict, tokens: int) -> float:
    """Expected distinct experts per layer of ``tokens`` uniformly routed tokens."""
    e, k = geo["num_experts"], geo["num_experts_per_tok"]
    return e * (1 - (1 - k / e) ** tokens)


def dense_bytes(geo: dict, dtype_bytes: int = 2) -> int:
    """Attention, router, norms and the lm_head (embedding rows gathered: not counted)."""
    h, hd, L = geo["hidden_size"], geo["head_dim"], geo["num_hidden_layers"]
    q, kv = geo["num_attention_heads"] * hd, geo["num_key_value_heads"] * hd
    per_layer = h * (q + 2 * kv) + q * h + h * geo["num_experts"] + 2 * h + 2 * hd
    return (L * per_layer + h + geo["vocab_size"] * h) * dtype_bytes


def step_floor_ms(geo: dict, batch: int, context: int, q: int) -> float:
    """The MoE forward's floor over ``q`` new tokens per request, ``context`` cached."""
    experts = geo["num_hidden_layers"] * expected_touched(geo, batch * q) * expert_bytes(geo)
    kv = floors.kv_bytes_per_token(geo) * batch * (context + q)
    return floors.floor_ms(dense_bytes(geo) + experts + kv)


# -- part experts ---------------------------------------------------------------------------

def expert_geometry(geo: dict, layers: int) -> dict:
    """``geo`` cut to its first ``layers`` layers (0: all)."""
    return dict(geo, num_hidden_layers=min(layers or geo["num_hidden_layers"],
                                           geo["num_hidden_layers"]))


def experts_rows(geo: dict, batches, qs, iters: int, dtype_name: str,
                 only: set | None = None) -> list[dict]:
    import jax
    import jax.numpy as jnp

    from specjax.models import moe

    dtype = jnp.dtype(dtype_name)
    L, h, i, e, k = (geo[x] for x in ("num_hidden_layers", "hidden_size",
                                      "moe_intermediate_size", "num_experts",
                                      "num_experts_per_tok"))
    # one set of arrays per layer, made one layer at a time: a stacked [L, E, H, 2I] array
    # costs 72 GiB in float32 to draw and is copied whole by XLA around a scan over layers
    weights = []
    for key in jax.random.split(jax.random.key(0), L):
        kr, kg, kd = jax.random.split(key, 3)
        weights.append(((jax.random.normal(kr, (h, e), jnp.float32) / np.sqrt(h)).astype(dtype),
                        (jax.random.normal(kg, (e, h, 2 * i), jnp.float32)
                         / np.sqrt(h)).astype(dtype),
                        (jax.random.normal(kd, (e, i, h), jnp.float32)
                         / np.sqrt(i)).astype(dtype)))
    gpu = jax.default_backend() == "gpu"
    impls: dict = {"ragged_dot": None, "pallas": "pallas"}    # (None: backend "xla")
    if gpu:
        try:
            from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

            def mgpu(lhs, rhs, group_sizes):
                return ragged_dot_mgpu.ragged_dot(lhs, rhs, group_sizes=group_sizes, block_m=64,
                                                  block_n=128, block_k=64,
                                                  max_concurrent_steps=4, grid_block_n=1)
            impls["pallas_mgpu"] = mgpu
        except ImportError as err:
            print(f"# pallas ragged_dot_mgpu unavailable: {err}")

    def stack(x, weights, impl):
        touched = 0
        for r, gu, d in weights:                # unrolled, as the engine's target runs its layers
            route, ids = moe.softmax_top_k(x.astype(jnp.float32) @ r.astype(jnp.float32),
                                              k, True)
            if impl is None or isinstance(impl, str):
                y = moe.grouped_experts(x, route, ids, gu, d, backend=impl or "xla")
            else:
                real = jax.lax.ragged_dot
                jax.lax.ragged_dot = impl           # the same routing and scatter, other GEMM
                try:
                    y = moe.grouped_experts(x, route, ids, gu, d, backend="xla")
                finally:
                    jax.lax.ragged_dot = real
            touched = touched + jnp.sum(jnp.bincount(ids.reshape(-1), length=e) > 0)
            x = x + y
        return x, touched

    if only is not None:
        impls = {n: f for n, f in impls.items() if n in only}
    rows = []
    for b in batches:
        for q in qs:
            t = b * q
            x = (jax.random.normal(jax.random.key(t), (t, h), jnp.float32)).astype(dtype)
            for name, impl in impls.items():
                # the weights are arguments: closed over, they would be compiled in as constants
                fn = jax.jit(lambda x, w, impl=impl: stack(x, w, impl))
                w = weights
                t0 = time.perf_counter()
                try:
                    out, touched = fn(x, w)
                    jax.block_until_ready(out)
                except Exception as err:  # noqa: BLE001 - a kernel that does not take this shape
                    print(f"# {name} T={t}: {type(err).__name__}: {str(err)[:160]}")
                    continue
                compile_s = time.perf_counter() - t0
                per = []
                for _ in range(iters):
                    t0 = time.perf_counter()
                    jax.block_until_ready(fn(x, w))
                    per.append((time.perf_counter() - t0) * 1e3)
                touched = int(touched)
                floor = floors.floor_ms(touched * expert_bytes(geo, dtype.itemsize)
                                        + L * h * e * dtype.itemsize)
                rows.append(dict(part="experts", impl=name, batch=b, q=q, tokens=t,
                                 ms=statistics.median(per), touched=touched, floor_ms=floor,
                                 compile_s=compile_s))
                print(f"# {name} T={t}: {rows[-1]['ms']:.3f} ms (floor {floor:.3f}), compile "
                      f"{compile_s:.1f} s", flush=True)
    return rows


# -- the PyTorch anchors (their own process) -------------------------------------------------

def _torch_moe(geo: dict, device: str, dtype):
    """The sparse MoE block in torch: ``moe(x [T, H], router [H, E], gate_up [E, H, 2I]
    (gate and up columns interleaved), down [E, I, H]) -> [T, H]`` (no residual): softmax
    router in float32, top-k (renormalised under ``norm_topk_prob``), the (token, expert)
    pairs sorted by expert, ``torch._grouped_mm`` on CUDA (one matmul per expert on the
    CPU), the weighted sum back per token. Returns ``(moe, layout, impl)``; ``layout(w)``
    puts an expert stack of ``dtype`` in the layout the grouped GEMM takes; ``impl`` names
    the GEMM."""
    import torch

    e, k = geo["num_experts"], geo["num_experts_per_tok"]
    grouped = getattr(torch, "_grouped_mm", None) if device == "cuda" else None
    layout = lambda w: w  # noqa: E731
    if grouped is not None:
        h = geo["hidden_size"]
        w = torch.ones(e, h, 16, device=device, dtype=dtype)
        try:                                    # some builds want column-major experts
            grouped(torch.ones(16, h, device=device, dtype=dtype), w,
                    offs=torch.full((e,), 16, device=device, dtype=torch.int32))
        except RuntimeError:
            layout = lambda w: w.transpose(-2, -1).contiguous().transpose(-2, -1)  # noqa: E731

    def gemm(a, w, offs, sizes):
        if grouped is not None:
            return grouped(a, w, offs=offs)
        out, start = [], 0                      # CPU: the same math, one matmul per expert
        for j, n in enumerate(sizes.tolist()):
            out.append(a[start:start + n] @ w[j])
            start += n
        return torch.cat(out)

    def moe(x, r, gu, d):
        p = torch.softmax(x.float() @ r.float(), -1)
        wts, ids = torch.topk(p, k, -1)
        if geo.get("norm_topk_prob", True):
            wts = wts / wts.sum(-1, keepdim=True)
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        token = order // k
        # (bincount sizes its output from the data: a host sync, not capturable)
        sizes = torch.zeros(e, device=flat.device, dtype=torch.int64).scatter_add_(
            0, flat, torch.ones_like(flat))
        offs = torch.cumsum(sizes, 0).to(torch.int32)
        y = gemm(x[token], gu, offs, sizes)
        y = torch.nn.functional.silu(y[:, 0::2]) * y[:, 1::2]
        y = gemm(y, d, offs, sizes) * wts.reshape(-1)[order].to(x.dtype)[:, None]
        return torch.zeros_like(x).index_add_(0, token, y)
    return moe, layout, "torch_grouped_mm" if grouped is not None else "torch_loop"


def _device_dtype():
    import torch

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    return dev, (torch.bfloat16 if dev == "cuda" else torch.float32)


def anchor_rows(geo: dict, batches, qs) -> list[dict]:
    """Part ``experts``' anchor: ``geo``'s MoE blocks alone (residual added), each
    ``torch.compile``d, the stack replayed in a CUDA graph, per (B, q)."""
    import torch

    from torch_anchors import time_graph

    dev, dt = _device_dtype()
    L, h, i, e = (geo[x] for x in ("num_hidden_layers", "hidden_size", "moe_intermediate_size",
                                   "num_experts"))
    g = torch.Generator(device=dev).manual_seed(0)
    moe, layout, impl = _torch_moe(geo, dev, dt)
    router = [torch.randn(h, e, device=dev, generator=g, dtype=dt) / h ** 0.5 for _ in range(L)]
    w13 = [layout(torch.randn(e, h, 2 * i, device=dev, generator=g, dtype=dt) / h ** 0.5)
           for _ in range(L)]
    w2 = [layout(torch.randn(e, i, h, device=dev, generator=g, dtype=dt) / i ** 0.5)
          for _ in range(L)]

    def block(x, r, gu, d):
        return x + moe(x, r, gu, d)

    layer = torch.compile(block, dynamic=False) if dev == "cuda" else block
    rows = []
    for b in batches:
        for q in qs:
            x = torch.randn(b * q, h, device=dev, dtype=dt, generator=g)

            def step(x=x):
                for r, gu, d in zip(router, w13, w2):
                    x = layer(x, r, gu, d)
                return x
            name = impl
            try:
                t = time_graph(step, reps=5, rounds=5, replays=5, warmup=2)
            except RuntimeError as err:         # not capturable: timed without the graph
                print(f"# {impl} T={b * q}: no CUDA graph ({str(err)[:120]})", file=sys.stderr)
                t, name = time_graph(step, reps=5, rounds=5, replays=5, warmup=2,
                                     cuda_graph=False), impl + " (no graph)"
            rows.append(dict(part="experts", impl=name, batch=b, q=q, tokens=b * q,
                             ms=t["graph_ms"]))
    return rows


class TorchMoE:
    """A random-weight Qwen3-MoE target (``geo``) in PyTorch: the ``decode`` part's anchor.
    Each layer: RMSNorm, fused q/k/v, per-head q/k RMSNorm, RoPE (rotate-half), the new K/V
    written into a static cache ``[B, kv_heads, S, head_dim]``, SDPA over the slots at or
    before each query's position, o-projection, RMSNorm, :func:`_torch_moe`; then the final
    norm and the lm_head. ``bind(batch, cache_len)`` allocates the caches; ``logits(tokens
    [B, T], pos [T])`` runs a forward (layers ``torch.compile``d when ``compile``)."""

    def __init__(self, geo: dict, *, device: str | None = None, dtype=None,
                 compile: bool = True, seed: int = 0):
        import torch

        from torch_anchors import _attend, _rms, _rope

        self.torch, self.geo = torch, geo
        self.device, self.dtype = (a or b for a, b in zip((device, dtype), _device_dtype()))
        dev, dt = self.device, self.dtype
        h, i, e, v = (geo[x] for x in ("hidden_size", "moe_intermediate_size", "num_experts",
                                       "vocab_size"))
        nh, nkv, hd = geo["num_attention_heads"], geo["num_key_value_heads"], geo["head_dim"]
        eps = geo["rms_norm_eps"]
        g = torch.Generator(device=dev).manual_seed(seed)
        moe, layout, _ = _torch_moe(geo, dev, dt)

        def w(*shape, fan_in=None):
            return torch.randn(*shape, device=dev, generator=g, dtype=dt) / (
                fan_in or shape[-1]) ** 0.5

        def norm(n):       # near 1, not 1: a test can tell the norms' weights apart
            return 1 + 0.1 * torch.randn(n, device=dev, generator=g, dtype=dt)

        self.embed, self.norm, self.lm_head = w(v, h, fan_in=1), norm(h), w(v, h)
        self.layers = [dict(ln1=norm(h), wqkv=w((nh + 2 * nkv) * hd, h), qn=norm(hd),
                            kn=norm(hd), wo=w(h, nh * hd), ln2=norm(h),
                            r=w(h, e, fan_in=h), gu=layout(w(e, h, 2 * i, fan_in=h)),
                            d=layout(w(e, i, h, fan_in=i)))
                       for _ in range(geo["num_hidden_layers"])]
        group = nh // nkv

        def layer(x, ln1, wqkv, qn, kn, wo, ln2, r, gu, d, kc, vc, cos, sin, pos, mask):
            b, t, _ = x.shape
            qkv = torch.nn.functional.linear(_rms(x, ln1, eps), wqkv)
            q, k, val = qkv.split([nh * hd, nkv * hd, nkv * hd], -1)
            q = _rope(_rms(q.view(b, t, nh, hd), qn, eps), cos, sin).transpose(1, 2)
            k = _rope(_rms(k.view(b, t, nkv, hd), kn, eps), cos, sin).transpose(1, 2)
            kc[:, :, pos] = k
            vc[:, :, pos] = val.view(b, t, nkv, hd).transpose(1, 2)
            o = _attend(q, kc, vc, mask, group).transpose(1, 2).reshape(b, t, nh * hd)
            x = x + torch.nn.functional.linear(o, wo)
            return x + moe(_rms(x, ln2, eps).reshape(b * t, h), r, gu, d).view(b, t, h)

        def head(x):
            return torch.nn.functional.linear(_rms(x, self.norm, eps), self.lm_head)

        wrap = (lambda f: torch.compile(f, dynamic=False)) if compile else (lambda f: f)
        self._layer, self._head = wrap(layer), wrap(head)
        inv = 1.0 / (geo["rope_theta"] ** (torch.arange(0, hd, 2, device=dev).float() / hd))
        self._inv = inv
        self.caches: list = []

    def bind(self, batch: int, cache_len: int) -> None:
        """Zeroed caches of ``cache_len`` slots for ``batch`` requests, and RoPE tables."""
        torch = self.torch
        self.caches = []                        # (the old ones freed first)
        shape = (batch, self.geo["num_key_value_heads"], cache_len, self.geo["head_dim"])
        self.caches = [tuple(torch.zeros(shape, device=self.device, dtype=self.dtype)
                             for _ in range(2)) for _ in self.layers]
        ang = torch.arange(cache_len, device=self.device).float()[:, None] * self._inv[None]
        ang = torch.cat((ang, ang), -1)
        self.cos, self.sin = ang.cos().to(self.dtype), ang.sin().to(self.dtype)
        self.slots = torch.arange(cache_len, device=self.device)

    def logits(self, tokens, pos):
        """``[B, T, V]`` logits of ``tokens [B, T]`` at cache slots ``pos [T]`` (each
        query sees the slots at or before its own)."""
        cos, sin = self.cos[pos], self.sin[pos]
        mask = self.slots[None, :] <= pos[:, None]
        x = self.embed[tokens]
        for wts, (kc, vc) in zip(self.layers, self.caches):
            x = self._layer(x, *wts.values(), kc, vc, cos, sin, pos, mask)
        return self._head(x)


def anchor_decode_rows(geo: dict, batches, qs, context: int) -> list[dict]:
    """Part ``decode``'s anchor: :class:`TorchMoE`'s greedy forward over ``q`` new tokens
    per request after ``context`` cached slots (q = 1: decode; k + 1: a verify step),
    replayed in a CUDA graph, per (B, q)."""
    import torch

    from torch_anchors import time_graph

    model = TorchMoE(geo, compile=torch.cuda.is_available())
    g = torch.Generator(device=model.device).manual_seed(1)
    rows = []
    for b in batches:
        for q in qs:
            model.bind(b, context + q)
            tokens = torch.randint(0, geo["vocab_size"], (b, q), device=model.device, generator=g)
            pos = torch.arange(context, context + q, device=model.device)
            t = time_graph(lambda: model.logits(tokens, pos).argmax(-1), reps=5, rounds=5,
                           replays=5, warmup=2)
            rows.append(dict(part="decode", impl="torch", batch=b, q=q, tokens=b * q,
                             ms=t["graph_ms"], compile_s=t["compile_s"]))
            print(f"# torch decode B={b} q={q}: {t['graph_ms']:.3f} ms", file=sys.stderr)
    return rows


# -- part decode ----------------------------------------------------------------------------

def decode_rows(geo: dict, batches, k: int, context: int, iters: int, dtype_name: str,
                profile_dir: str | None = None):
    """The ``decode`` part's rows; with ``profile_dir``, each plain step is also traced
    (``profile_step.py``'s per-kernel table, printed and kept as ``row["profile"]``)."""
    import gc

    import jax
    import jax.numpy as jnp

    import loop
    from e2e import make_engine
    from specjax.models import moe, registry
    from specjax.engine import TargetModel

    dtype = jnp.dtype(dtype_name)
    cfg = registry.config_from_hf("qwen3_moe", geo)
    abstract = registry.abstract_params("qwen3_moe", cfg, dtype)
    flat, tree = jax.tree_util.tree_flatten_with_path(abstract)
    keys = jax.random.split(jax.random.key(0), len(flat))
    leaves = []
    for key, (path, a) in zip(keys, flat):
        name = jax.tree_util.keystr(path)
        fan_in = 1 if "embed" in name or len(a.shape) == 1 else a.shape[-2]
        leaves.append(jnp.ones(a.shape, dtype) if "norm" in name else
                      (jax.random.normal(key, a.shape, jnp.float32) / np.sqrt(fan_in)).astype(dtype))
    target = TargetModel(registry.make_model("qwen3_moe", cfg), jax.tree_util.tree_unflatten(tree, leaves))
    dense = {x: geo[x] for x in ("hidden_size", "intermediate_size", "num_attention_heads",
                                 "num_key_value_heads", "head_dim", "vocab_size", "rope_theta",
                                 "rms_norm_eps", "num_hidden_layers")}
    max_tokens = (iters + 2) * (k + 1)
    mml = -(-(context + max_tokens + 2 * k + 8) // loop.BS) * loop.BS
    rng = np.random.default_rng(0)
    rows = []
    for b in batches:
        prompts = [rng.integers(0, geo["vocab_size"], context).tolist() for _ in range(b)]
        for method in ("plain", "eagle3"):
            prop = None if method == "plain" else loop.drafter(
                method, target, dense, "moe", k, loop.DEMO_RATES[:k], mml, dtype)
            eng = make_engine(target, prop, b, mml, dtype)
            loop.measure(eng, prompts, 2, max_tokens)                    # compiles
            r = loop.measure(eng, prompts, iters, max_tokens)
            q = 1 if prop is None else k + 1
            r.update(part="decode", method=method, batch=b, k=0 if prop is None else k,
                     floor_ms=step_floor_ms(geo, b, context, q),
                     expert_gb=geo["num_hidden_layers"] * expected_touched(geo, b * q)
                     * expert_bytes(geo) / 1e9)
            r["per_floor"] = r["per_iter_ms"] / r["floor_ms"]
            if profile_dir and prop is None:
                import profile_step

                got = profile_step.profile(eng, b, context, 10, os.path.join(profile_dir, f"b{b}"))
                print(profile_step._table(f"plain B={b}", got, 30), flush=True)
                r["profile"] = {x: got[x] for x in ("step_ms", "kernels_us_per_step",
                                                    "device_busy_us_per_step",
                                                    "device_events_per_step")}
            rows.append(r)
            print(f"{method:<7} B={b:>3} iter {r['per_iter_ms']:8.3f} ms  floor {r['floor_ms']:8.3f}"
                  f" ms  x{r['per_floor']:5.2f}  experts {r['expert_gb']:6.2f} GB  "
                  f"tok/s {r['tokens_per_s']:9.1f}  pair_max {moe.PAIR_MAX_PAIRS}", flush=True)
            del eng, prop
            gc.collect()
    return rows


def torch_decode_table(rows: list[dict], k: int) -> str:
    """specjax's plain iteration beside PyTorch's decode forward (q = 1), and PyTorch's
    verify forward (q = k + 1) beside it, per B (rows of one run: the last of each)."""
    ours = {r["batch"]: r for r in rows if r.get("part") == "decode" and r.get("method") == "plain"}
    ref = {(r["batch"], r["q"]): r["ms"] for r in rows if r.get("impl") == "torch"}
    out = ["| B | specjax plain ms / iteration | PyTorch decode ms | specjax / PyTorch | "
           f"PyTorch verify (q = {k + 1}) ms | floor ms |", "|---|---|---|---|---|---|"]
    for b, r in sorted(ours.items()):
        t = ref.get((b, 1), float("nan"))
        out.append(f"| {b} | {r['per_iter_ms']:.3f} | {t:.3f} | {r['per_iter_ms'] / t:.2f} | "
                   f"{ref.get((b, k + 1), float('nan')):.3f} | {r['floor_ms']:.3f} |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--geometry", choices=tuple(GEOMETRIES), default=None,
                    help="default: 30b-a3b on a GPU, tiny elsewhere")
    ap.add_argument("--batch", default="1,8,32")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--parts", default="experts,decode", help="in the order run")
    ap.add_argument("--expert-layers", type=int, default=8, help="layers of part experts (0: all)")
    ap.add_argument("--impls", default=None, help="part experts' JAX impls (default: all)")
    ap.add_argument("--torch", action="store_true",
                    help="each part's PyTorch anchor (its own process, before JAX)")
    ap.add_argument("--anchor", choices=("experts", "decode"), default=None,
                    help=argparse.SUPPRESS)
    ap.add_argument("--profile", default=None, metavar="DIR",
                    help="part decode: trace each plain step into DIR, per-kernel table")
    ap.add_argument("--pair-max", default=None,
                    help="part decode: models.moe.PAIR_MAX_PAIRS values, comma separated, each "
                         "run (0: the sorted grouped matmul always; default: the library's)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    order = args.parts.split(",")
    parts = set(order)
    if not parts <= {"experts", "decode"} or args.k < 1 or args.iters < 2 \
            or args.expert_layers < 0:
        ap.error("--parts takes experts,decode; --k >= 1; --iters >= 2; --expert-layers >= 0")
    only = None if args.impls is None else set(args.impls.split(","))
    batches = [int(x) for x in args.batch.split(",")]
    pair_max = [None] if args.pair_max is None else [int(x) for x in args.pair_max.split(",")]
    qs = (1, args.k + 1)
    if args.anchor == "experts":
        print(json.dumps(anchor_rows(expert_geometry(GEOMETRIES[args.geometry],
                                                     args.expert_layers), batches, qs)))
        return 0
    if args.anchor == "decode":
        print(json.dumps(anchor_decode_rows(GEOMETRIES[args.geometry], batches, qs,
                                            args.context)))
        return 0
    anchor: dict[str, list] = {"experts": [], "decode": []}
    for part in order if args.torch else ():    # first: before JAX takes the GPU's memory
        out = subprocess.run([sys.executable, os.path.abspath(__file__), "--anchor", part,
                              "--geometry", args.geometry or "30b-a3b", "--batch", args.batch,
                              "--k", str(args.k), "--expert-layers", str(args.expert_layers),
                              "--context", str(args.context)],
                             capture_output=True, text=True)
        if out.returncode:
            print(f"# torch {part} anchor failed: {out.stderr[-2000:]}")
        else:
            anchor[part] = json.loads(out.stdout.strip().splitlines()[-1])
    import jax

    gpu = jax.default_backend() == "gpu"
    name = args.geometry or ("30b-a3b" if gpu else "tiny")
    geo = GEOMETRIES[name]
    dtype = "bfloat16" if gpu else "float32"
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; jax {jax.__version__}; "
          f"{jax.devices()[0].device_kind}; {name} {dtype}; k={args.k}; context {args.context}")
    rows = []
    for part in order:
        if part == "decode":
            from specjax.models import moe

            for pm in pair_max:         # the programs traced afresh for each threshold
                if pm is not None:
                    moe.PAIR_MAX_PAIRS = pm
                    jax.clear_caches()
                got = decode_rows(geo, batches, args.k, args.context, args.iters, dtype,
                                  args.profile)
                rows += [dict(r, pair_max=moe.PAIR_MAX_PAIRS) for r in got]
            if anchor["decode"]:
                rows += anchor["decode"]
                print(torch_decode_table(rows, args.k))
            continue
        eg = expert_geometry(geo, args.expert_layers)
        print(f"# part experts: {eg['num_hidden_layers']} layers", flush=True)
        got = experts_rows(eg, batches, qs, args.iters, dtype, only) + anchor["experts"]
        rows += got
        print("| impl | B | q | tokens | ms | touched | floor ms | / floor |")
        print("|---|---|---|---|---|---|---|---|")
        for r in got:
            fl = next((x["floor_ms"] for x in got if "floor_ms" in x
                       and (x["batch"], x["q"]) == (r["batch"], r["q"])), float("nan"))
            print(f"| {r['impl']} | {r['batch']} | {r['q']} | {r['tokens']} | {r['ms']:.3f} | "
                  f"{r.get('touched', '-')} | {fl:.3f} | {r['ms'] / fl:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(argv=argv, geometry=name, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

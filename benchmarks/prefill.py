"""Prefill: time to first token against PyTorch, and the attention options for long queries
(issue 50, item 3), all in one process.

For each prompt length T (``--prompts``, default 1024, 8192, 32768; add 131072 for the
128k goal) on the 8B-shaped bf16 target of ``benchmarks/e2e.py --target 8b`` (random
weights, q/k/v and gate/up fused as the engine runs them), one request:

- ``engine TTFT``: ``Engine.generate`` of one T-token prompt (``max_tokens=1``), start of
  generate -> the first token's progress callback, as ``benchmarks/loop.py``'s TTFT column
  (the engine's host work included; compiled first by a warm-up call);
- ``specjax forward``: the bare jitted prefill: ``target.forward`` over the T prompt
  tokens (K/V written into a paged cache, the caches donated) + the lm_head at the last
  position + argmax, the token fetched to the host; attention through the current default
  backend (``--forward-backends`` names others: the backend ``paged_attention`` resolves to
  is in the row);
- ``torch eager`` / ``torch compile``: PyTorch's same-shaped forward (the same weights,
  shared from JAX through DLPack: no copy) with ``F.scaled_dot_product_attention(
  is_causal=True)`` restricted to the flash backend (GQA by ``enable_gqa=True`` where flash
  takes it, else K/V repeated per query head, as HF's ``repeat_kv``), + the lm_head at the
  last position + argmax, the token fetched to the host; eager, and with one decoder layer
  and the head ``torch.compile``'d (inductor, ``dynamic=False``: one compile per T, reused by
  all 32 layers; no CUDA graph: a prefill is milliseconds of GEMMs, not launch bound). No K/V
  cache is written (the issue's anchor); its last-position logits are compared with the
  specjax forward's (``logits rel err``);
- the attention alone at T (one layer's shapes: 32 query heads, 8 kv heads, head_dim 128,
  bf16, causal, one request whose keys are its own T tokens, K/V random in a paged cache
  whose blocks are the request's, in order): specjax's ``paged_attention`` per backend
  (``auto``, ``xla`` the reference, ``pallas``, ``triton``; a kernel that does not take the
  shape is recorded with the reason, not run); ``jax.nn.dot_product_attention(
  implementation="cudnn")`` over the K/V gathered from the paged cache (the gather timed
  with it) and over contiguous K/V; ``implementation="xla"``; the Mosaic GPU flash attention
  example (``jax.experimental.pallas.ops.gpu.attention_mgpu``; block_kv tuned over 256, 128,
  64; q pre-scaled: the example has no scale; float16 operands: its scratch is float16); the
  Pallas-Triton example
  (``...ops.gpu.attention.mha``, K/V repeated per query head: it has no GQA); PyTorch SDPA
  (flash; cuDNN) on the same tensors. Every output is checked on a few query rows against a
  float64 NumPy oracle (``rel err``: ||out - ref|| / ||ref||; bf16 lands near 1e-3 to 1e-2).

Each case: warm-up (compile) call(s), then a median over up to ``--iters`` calls (at least
3, at most ``--case-s`` seconds after the third), each synced (the token / output fetched
or blocked on). A failure (out of memory, an autotuner that finds no config, an unsupported
shape) is recorded in the row and the run goes on. FLOPs: dense GEMMs 2 x T x (q/k/v, o,
gate/up, down weights) per layer, the lm_head at one row, causal attention 4 x heads x
head_dim x T(T+1)/2 per layer (QK^T and PV over the causal half); TFLOP/s = FLOPs / time,
beside the bf16 GEMM rate measured here first (a ``[min(T, 8192), 4096] x [4096, 28672]``
dot, and ``benchmarks/gemm.py``'s ``time_case`` at that shape) and the 989 TFLOP/s sheet figure.

``--batch-prefill``: instead, B = ``--batch`` (256) requests of ``--batch-prompt`` (1024)
tokens through the engine, plain and EAGLE-3 (k = 3, the 8B-shaped head, synthetic
acceptance at the demo head's rates, as ``benchmarks/loop.py`` runs them): the batch's time
to first token (prefill tokens/s = B x prompt / TTFT) and then ``--decode-iters`` loop
iterations (tokens/s over them); an OOM is recorded, not fatal.

Usage (GPU; unless ``XLA_PYTHON_CLIENT_MEM_FRACTION`` is set, JAX gets half the GPU when a
PyTorch part runs in the process, else 0.92; inductor compiles in the process,
``TORCHINDUCTOR_COMPILE_THREADS=1``, unless set)::

    python benchmarks/prefill.py --json prefill.json                       # 1k, 8k, 32k
    python benchmarks/prefill.py --prompts 131072 --parts engine           # then --parts torch
    python benchmarks/prefill.py --batch-prefill --json batch.json         # B = 256, 1k prompts
    python benchmarks/prefill.py --tiny                                    # CPU smoke (< 60 s)

Prints each row as it is measured, then markdown tables; ``--json`` is rewritten after
every row (a run cut by a time limit keeps what it measured).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import math
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import floors  # noqa: E402
from e2e import make_engine  # noqa: E402
from loop import BS, DEMO_RATES, build_target, drafter, measure as loop_measure  # noqa: E402

from specjax.attention_metadata import CommonAttentionMetadata  # noqa: E402
from specjax.engine import SamplingParams  # noqa: E402
from specjax.kernels import backend as kbackend  # noqa: E402
from specjax.kernels.paged_attention import (  # noqa: E402
    ATTENTION_BACKENDS, paged_attention, resolve_attention_backend)
from specjax.kernels.paged_attention.limits import unsupported_reason  # noqa: E402
from specjax.models import rope  # noqa: E402

#: The bf16 dense rate of the H100 / H200 datasheet (TFLOP/s).
SHEET_TFLOPS = 989.0
PARTS = ("engine", "forward", "torch", "torch_compile", "attention", "gemm")
#: Attention options timed at each length (``--attn`` picks among them).
ATTN_CASES = tuple(f"specjax:{b}" for b in sorted(ATTENTION_BACKENDS, key=lambda b: b == "auto")) + (
    "jax_dpa_cudnn+gather", "jax_dpa_cudnn", "jax_dpa_xla", "mosaic_gpu", "pallas_triton_mha",
    "torch_sdpa_flash", "torch_sdpa_cudnn")
MGPU_BLOCK_KV = (256, 128, 64)


def short(e: BaseException, n: int = 300) -> str:
    s = f"{type(e).__name__}: {str(e) or '(no message)'}".replace("\n", " ")
    return s if len(s) <= n else s[: n - 3] + "..."


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# -- FLOPs -----------------------------------------------------------------------------------

def attention_flops(geo, t: int) -> float:
    """One layer's causal attention over a T-token prompt: QK^T and PV, the causal half."""
    return 4.0 * geo["num_attention_heads"] * floors.head_dim(geo) * t * (t + 1) / 2


def prefill_flops(geo, t: int) -> dict:
    """FLOPs of the prefill forward over T tokens (dense GEMMs, attention, the lm_head at the
    last position)."""
    h, i, hd = geo["hidden_size"], geo["intermediate_size"], floors.head_dim(geo)
    nh, nkv, nl = geo["num_attention_heads"], geo["num_key_value_heads"], geo["num_hidden_layers"]
    per_token = 2.0 * (h * (nh + 2 * nkv) * hd + nh * hd * h + 3 * h * i)
    dense = nl * t * per_token
    attn = nl * attention_flops(geo, t)
    head = 2.0 * h * geo["vocab_size"]
    return dict(dense=dense, attention=attn, head=head, total=dense + attn + head)


# -- timing ----------------------------------------------------------------------------------

def timed(fn, sync, *, warmup: int, iters: int, budget_s: float, min_iters: int = 3) -> dict:
    """``sync(fn())`` once (compiles) plus ``warmup - 1`` more, then timed calls: at most
    ``iters``, at least ``min_iters``, no more once ``budget_s`` is spent. ms: the median."""
    t0 = time.perf_counter()
    out = sync(fn())
    first_s = time.perf_counter() - t0
    for _ in range(max(warmup - 1, 0)):
        out = sync(fn())
    times: list[float] = []
    while len(times) < max(iters, 1) and (len(times) < min_iters or sum(times) < budget_s):
        t = time.perf_counter()
        out = sync(fn())
        times.append(time.perf_counter() - t)
    return dict(ms=statistics.median(times) * 1e3, min_ms=min(times) * 1e3,
                max_ms=max(times) * 1e3, n=len(times), first_s=first_s, out=out)


def jax_sync(out):
    return jax.block_until_ready(out)


# -- the specjax side ------------------------------------------------------------------------

def prompt_metadata(t: int, first_block: int = 1):
    """One request of ``t`` prompt tokens in blocks ``first_block ..`` (block 0 is the
    engine's null block): ``(metadata, number of blocks)``."""
    n = cdiv(t, BS)
    table = np.arange(first_block, first_block + n)[None]
    return CommonAttentionMetadata.from_query_lens([t], [t], table, block_size=BS), n


def engine_ttft(target, t: int, dtype, args) -> dict:
    """Time to first token of one ``t``-token prompt through the engine (``max_tokens=1``):
    the start of generate -> the callback after the iteration that samples it (the last
    prefill chunk); ``generate_ms`` the whole call."""
    mml = cdiv(t + 16, BS) * BS
    eng = make_engine(target, None, 1, mml, dtype)
    prompt = np.random.default_rng(1).integers(0, target.model.vocab_size, t).tolist()
    sp = SamplingParams(max_tokens=1, ignore_eos=True)

    def once():
        first: list[float] = []
        t0 = time.perf_counter()
        # (a prompt past one step's token budget prefills in chunks, a callback each)
        eng.generate([prompt], sp, progress=lambda done, total, generated, started: (
            started and not first and first.append(time.perf_counter())))
        t1 = time.perf_counter()
        return (first[0] if first else t1) - t0, t1 - t0

    t0 = time.perf_counter()
    once()                                               # compiles
    first_s = time.perf_counter() - t0
    runs = []
    while len(runs) < max(args.ttft_reps, 1) and (len(runs) < 2 or sum(r[1] for r in runs) < args.case_s):
        runs.append(once())
    return dict(ms=statistics.median(r[0] for r in runs) * 1e3,
                min_ms=min(r[0] for r in runs) * 1e3, max_ms=max(r[0] for r in runs) * 1e3,
                generate_ms=statistics.median(r[1] for r in runs) * 1e3, n=len(runs),
                first_s=first_s, max_model_len=mml)


def specjax_forward(target, t: int, dtype, backend: str, args) -> dict:
    """The bare jitted prefill over ``t`` tokens with ``backend`` as the process default
    (``"auto"``: the current default): the argmax token and the last-position logits."""
    model, params = target.model, target.params
    cfg = model.config
    md, n = prompt_metadata(t)
    caches = [model.init_kv_caches(n + 1, BS, dtype)]
    ids = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size, t), jnp.int32)
    pos = jnp.arange(t, dtype=jnp.int32)

    @functools.partial(jax.jit, donate_argnums=(3,))
    def fwd(params, ids, pos, kv, md):
        hidden, _, kv = model.forward(params, ids, pos, kv, md)
        logits = model.compute_logits(params, hidden[t - 1:t])
        return jnp.argmax(logits, -1), logits, kv

    ctx = contextlib.nullcontext() if backend == "auto" else kbackend.default_backend(backend)
    with ctx:
        resolved = resolve_attention_backend((t, cfg.num_attention_heads, cfg.head_dim),
                                             caches[0][0].k.shape, md, dtype)

        def call():
            tok, logits, caches[0] = fwd(params, ids, pos, caches[0], md)
            return tok, logits

        r = timed(call, lambda o: (np.asarray(o[0]), o[1]), warmup=args.warmup, iters=args.iters,
                  budget_s=args.case_s, min_iters=args.min_iters)
    tok, logits = r.pop("out")
    r.update(token=int(tok[0]), logits=np.asarray(logits, np.float32)[0], attn_backend=resolved)
    caches.clear()
    return r


# -- the PyTorch side ------------------------------------------------------------------------

def torch_or_none():
    try:
        import torch
        return torch
    except ImportError:
        return None


def to_torch(x, torch, device, copied: list | None = None):
    """A JAX array as a torch tensor on ``device``: shared through DLPack where it can be,
    else copied through NumPy (bf16 through its bits; the refusal appended to ``copied``)."""
    try:
        out = torch.from_dlpack(x)
        if out.device.type == device.type:
            return out.to(device)
        why = f"DLPack gave a {out.device} tensor"
    except Exception as e:  # noqa: BLE001 - any DLPack refusal: copy instead
        why = short(e, 120)
    if copied is not None:
        copied.append(why)
    a = np.asarray(x)
    if a.dtype == jnp.bfloat16:
        return torch.from_numpy(a.view(np.uint16).copy()).view(torch.bfloat16).to(device)
    return torch.from_numpy(np.ascontiguousarray(a)).to(device)


class TorchPrefill:
    """The target's prefill forward the PyTorch way, on the JAX target's weights (JAX keeps
    kernels ``[in, out]``; ``F.linear`` gets their transposed views, no copy)."""

    def __init__(self, target, geo, torch):
        import torch_anchors

        self.torch, self.geo = torch, geo
        self.F = torch.nn.functional
        self.device = (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
                       else torch.device("cpu"))
        p = target.params
        self.copied: list[str] = []
        tt = functools.partial(to_torch, torch=torch, device=self.device, copied=self.copied)
        self.nh, self.nkv = geo["num_attention_heads"], geo["num_key_value_heads"]
        self.hd, self.eps = floors.head_dim(geo), geo.get("rms_norm_eps", 1e-5)
        self.layers = []
        for i in range(geo["num_hidden_layers"]):
            lp = p["layers"][i]
            self.layers.append((tt(lp["input_layernorm"]["weight"]),
                                tt(lp["self_attn"]["qkv_proj"]["kernel"]).t(),
                                tt(lp["self_attn"]["o_proj"]["kernel"]).t(),
                                tt(lp["post_attention_layernorm"]["weight"]),
                                tt(lp["mlp"]["gate_up_proj"]["kernel"]).t(),
                                tt(lp["mlp"]["down_proj"]["kernel"]).t()))
        self.embed = tt(p["embed_tokens"]["embedding"])
        head = p.get("lm_head") or {"embedding": p["embed_tokens"]["embedding"]}
        self.lm_head = tt(head["kernel"]).t() if "kernel" in head else tt(head["embedding"])
        self.norm = tt(p["norm"]["weight"])
        self.dtype = self.embed.dtype
        cfg = target.model.config
        self.inv_freq = torch.from_numpy(np.asarray(rope.inv_freq(
            cfg.head_dim, cfg.rope_theta, cfg.rope_scaling))).to(self.device)
        self._rms, self._rope = torch_anchors._rms, torch_anchors._rope
        self.gqa = self._probe_gqa()
        self._compiled = None

    def sdpa_ctx(self, which: str = "flash"):
        """Only flash (or only cuDNN) for SDPA on CUDA; nothing forced on a CPU."""
        if self.device.type != "cuda":
            return contextlib.nullcontext()
        from torch.nn.attention import SDPBackend, sdpa_kernel
        return sdpa_kernel([SDPBackend.FLASH_ATTENTION if which == "flash" else SDPBackend.CUDNN_ATTENTION])

    def _probe_gqa(self) -> str:
        """``"enable_gqa"`` where flash SDPA takes fewer kv heads, else ``"repeat"``."""
        torch = self.torch
        try:
            q = torch.randn(1, 4, 128, self.hd, device=self.device, dtype=self.dtype)
            k = torch.randn(1, 1, 128, self.hd, device=self.device, dtype=self.dtype)
            with self.sdpa_ctx():
                self.F.scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=True)
            return "enable_gqa"
        except Exception:  # noqa: BLE001
            return "repeat"

    def attend(self, q, k, v, gqa: str | None = None):
        """q ``[1, nh, T, hd]``, k / v ``[1, nkv, T, hd]`` -> ``[1, nh, T, hd]``, causal;
        ``gqa``: ``"enable_gqa"`` or ``"repeat"`` (None: the probed one)."""
        if (gqa or self.gqa) == "enable_gqa":
            return self.F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        g = self.nh // self.nkv
        return self.F.scaled_dot_product_attention(q, k.repeat_interleave(g, 1),
                                                   v.repeat_interleave(g, 1), is_causal=True)

    def _layer(self, h, ln1, wqkv, wo, ln2, w13, w2, cos, sin):
        F, nh, nkv, hd = self.F, self.nh, self.nkv, self.hd
        b, t, _ = h.shape
        q, k, v = F.linear(self._rms(h, ln1, self.eps), wqkv).split([nh * hd, nkv * hd, nkv * hd], -1)
        q = self._rope(q.view(b, t, nh, hd), cos, sin).transpose(1, 2)
        k = self._rope(k.view(b, t, nkv, hd), cos, sin).transpose(1, 2)
        v = v.view(b, t, nkv, hd).transpose(1, 2)
        o = self.attend(q, k, v).transpose(1, 2).reshape(b, t, nh * hd)
        h = h + F.linear(o, wo)
        gate, up = F.linear(self._rms(h, ln2, self.eps), w13).chunk(2, -1)
        return h + F.linear(F.silu(gate) * up, w2)

    def _head(self, h, norm, lm_head):
        return self.F.linear(self._rms(h, norm, self.eps), lm_head).float()

    def forward(self, ids, compiled: bool):
        """``ids [1, T]`` -> (argmax token [1], last-position logits [1, V] float32)."""
        torch = self.torch
        if compiled and self._compiled is None:
            for name in ("cache_size_limit", "recompile_limit"):
                if hasattr(torch._dynamo.config, name):
                    setattr(torch._dynamo.config, name, max(64, getattr(torch._dynamo.config, name)))
            self._compiled = (torch.compile(self._layer, dynamic=False),
                              torch.compile(self._head, dynamic=False))
        layer, head = self._compiled if compiled else (self._layer, self._head)
        t = ids.shape[1]
        ang = torch.arange(t, device=self.device).float()[:, None] * self.inv_freq[None]
        ang = torch.cat((ang, ang), -1)
        cos, sin = ang.cos().to(self.dtype), ang.sin().to(self.dtype)
        with self.sdpa_ctx():
            h = self.embed[ids]
            for w in self.layers:
                h = layer(h, *w, cos, sin)
            logits = head(h[:, -1], self.norm, self.lm_head)
        return logits.argmax(-1), logits


def torch_forward(tp: TorchPrefill, t: int, compiled: bool, args) -> dict:
    torch = tp.torch
    ids = torch.from_numpy(np.random.default_rng(1).integers(0, tp.geo["vocab_size"], t)).to(tp.device)[None]

    def sync(o):
        return int(o[0].item()), o[1]

    with torch.no_grad():
        r = timed(lambda: tp.forward(ids, compiled), sync, warmup=args.warmup, iters=args.iters,
                  budget_s=args.case_s, min_iters=args.min_iters)
    tok, logits = r.pop("out")
    r.update(token=tok, logits=logits[0].cpu().numpy(), gqa=tp.gqa)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return r


# -- attention alone -------------------------------------------------------------------------

def gather_kv(cache_x, table, t: int):
    """``[num_blocks, bs, nkv, hd]`` paged -> ``[1, t, nkv, hd]`` contiguous (the request's
    blocks ``table`` in order)."""
    g = cache_x[table]
    return g.reshape((-1,) + cache_x.shape[2:])[:t][None]


def oracle_rows(q, k, v, rows, group: int, scale: float) -> np.ndarray:
    """float64 causal GQA attention at query ``rows``: q ``[T, nh, hd]``, k / v ``[T, nkv,
    hd]`` (NumPy) -> ``[len(rows), nh, hd]``."""
    out = np.zeros((len(rows), q.shape[1], q.shape[2]))
    k64, v64 = k.astype(np.float64), v.astype(np.float64)
    for i, r in enumerate(rows):
        kk, vv = k64[: r + 1], v64[: r + 1]
        for h in range(q.shape[1]):
            s = kk[:, h // group] @ q[r, h].astype(np.float64) * scale
            p = np.exp(s - s.max())
            out[i, h] = (p / p.sum()) @ vv[:, h // group]
    return out


def rel_err(got, want) -> float:
    got = np.asarray(got, np.float64)
    if not np.isfinite(got).all():
        return float("nan")
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def attention_cases(geo, t: int, dtype, cases, tp: TorchPrefill | None, args, emit) -> None:
    """Every attention option of ``cases`` at ``t`` query tokens (one layer's shapes)."""
    nh, nkv, hd = geo["num_attention_heads"], geo["num_key_value_heads"], floors.head_dim(geo)
    group, scale = nh // nkv, hd ** -0.5
    md, n = prompt_metadata(t)
    key = jax.random.key(t)
    kq, kk, kv = jax.random.split(key, 3)
    q = jax.random.normal(kq, (t, nh, hd), jnp.float32).astype(dtype)
    shape = (n + 1, BS, nkv, hd)
    from specjax.kernels.paged_attention import KVCache
    cache = KVCache(jax.random.normal(kk, shape, jnp.float32).astype(dtype),
                    jax.random.normal(kv, shape, jnp.float32).astype(dtype))
    table = md.block_table[0]
    kg, vg = gather_kv(cache.k, table, t), gather_kv(cache.v, table, t)
    rng = np.random.default_rng(t)
    rows = sorted({0, t // 2, t - 1, *rng.integers(0, t, 3).tolist()})
    q_np = np.asarray(q.astype(jnp.float32))
    ref = oracle_rows(q_np, np.asarray(kg[0].astype(jnp.float32)), np.asarray(vg[0].astype(jnp.float32)),
                      rows, group, scale)
    flops = attention_flops(geo, t)
    measured: dict[str, float] = {}

    def run(case, make, to_rows, note=""):
        """``make()`` -> a zero-argument callable returning the output; ``to_rows(out)`` ->
        ``[len(rows), nh, hd]`` NumPy float32."""
        row = dict(kind="attention", prompt=t, case=case, flops=flops)
        try:
            fn = make()
            r = timed(fn, jax_sync if not case.startswith("torch") else _torch_sync, warmup=args.warmup,
                      iters=args.iters, budget_s=args.case_s, min_iters=args.min_iters)
            out = r.pop("out")
            row.update(r, tflops=flops / (r["ms"] * 1e-3) / 1e12, rel_err=rel_err(to_rows(out), ref))
            measured[case] = r["ms"]
        except Exception as e:  # noqa: BLE001 - recorded, the run goes on
            row["error"] = short(e)
        row["note"] = note() if callable(note) else note
        emit(row)

    jrows = np.asarray(rows)

    for case in cases:
        if case.startswith("specjax:"):
            b = case.split(":", 1)[1]
            row = dict(kind="attention", prompt=t, case=case, flops=flops)
            try:
                resolved = resolve_attention_backend(q.shape, cache.k.shape, md, dtype, b)
            except Exception as e:  # noqa: BLE001 - e.g. triton without a GPU
                emit(dict(row, error=short(e)))
                continue
            if b != "auto" and resolved != b:
                reason = unsupported_reason(num_heads=nh, num_kv_heads=nkv, head_dim=hd,
                                            max_query_len=t, dtype=dtype)
                emit(dict(row, skipped=f"runs {resolved!r} here: {reason or 'not taken'}"))
                continue
            if b == "auto" and f"specjax:{resolved}" in measured:
                ms = measured[f"specjax:{resolved}"]
                emit(dict(row, note=f"-> {resolved}", same_as=f"specjax:{resolved}", ms=ms,
                          tflops=flops / (ms * 1e-3) / 1e12))
                continue
            f = jax.jit(functools.partial(paged_attention, scale=scale, backend=b))
            run(case, lambda f=f: (lambda: f(q, cache, md)), lambda o: np.asarray(o[jrows], np.float32),
                note=f"-> {resolved}")
        elif case == "jax_dpa_cudnn+gather":
            f = jax.jit(lambda q, ck, cv, table: jax.nn.dot_product_attention(
                q[None], gather_kv(ck, table, t), gather_kv(cv, table, t), scale=scale,
                is_causal=True, implementation="cudnn"))
            run(case, lambda: (lambda: f(q, cache.k, cache.v, table)),
                lambda o: np.asarray(o[0, jrows], np.float32), note="K/V gathered from the paged cache")
        elif case in ("jax_dpa_cudnn", "jax_dpa_xla"):
            impl = case.rsplit("_", 1)[1]
            f = jax.jit(lambda q, k, v, impl=impl: jax.nn.dot_product_attention(
                q[None], k, v, scale=scale, is_causal=True, implementation=impl))
            run(case, lambda f=f: (lambda: f(q, kg, vg)), lambda o: np.asarray(o[0, jrows], np.float32),
                note="contiguous K/V")
        elif case == "mosaic_gpu":
            mosaic_case(q, kg, vg, scale, run, jrows)
        elif case == "pallas_triton_mha":
            def make():
                import warnings

                with warnings.catch_warnings():      # deprecated (Pallas-Triton) in JAX 0.11+
                    warnings.simplefilter("ignore", DeprecationWarning)
                    from jax.experimental.pallas.ops.gpu import attention as pl_attention
                f = jax.jit(lambda q, k, v: pl_attention.mha(
                    q[None], jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2), None,
                    sm_scale=scale, causal=True))
                return lambda: f(q, kg, vg)
            run(case, make, lambda o: np.asarray(o[0, jrows], np.float32),
                note="K/V repeated per query head (no GQA), repeat timed")
        elif case.startswith("torch_sdpa_"):
            which = case.rsplit("_", 1)[1]
            if tp is None:
                emit(dict(kind="attention", prompt=t, case=case, flops=flops, skipped="no torch"))
                continue

            gqa = [tp.gqa]

            def make(which=which, gqa=gqa):
                torch = tp.torch
                qt = to_torch(q, torch, tp.device).transpose(0, 1)[None]        # [1, nh, T, hd]
                kt = to_torch(kg[0], torch, tp.device).transpose(0, 1)[None]    # [1, nkv, T, hd]
                vt = to_torch(vg[0], torch, tp.device).transpose(0, 1)[None]

                def call():
                    with torch.no_grad(), tp.sdpa_ctx(which):
                        return tp.attend(qt, kt, vt, gqa[0])
                try:                      # this backend may not take fewer kv heads
                    call()
                except Exception:  # noqa: BLE001
                    if gqa[0] == "repeat":
                        raise
                    gqa[0] = "repeat"
                return call
            run(case, make, lambda o: o[0].transpose(0, 1)[jrows.tolist()].float().cpu().numpy(),
                note=lambda: f"GQA: {gqa[0]}")
        else:
            raise ValueError(f"unknown attention case {case!r}")


def _torch_sync(out):
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return out


def mosaic_case(q, kg, vg, scale, run, jrows):
    """The Mosaic GPU attention example, block_kv tuned: each config timed briefly (3
    calls), the fastest one timed as the row; configs that fail are named in its note."""
    fails: list[str] = []
    best: dict = {}

    def make_for(bkv):
        def make():
            import dataclasses

            from jax.experimental.pallas.ops.gpu import attention_mgpu as mgpu

            names = {f.name for f in dataclasses.fields(mgpu.TuningConfig)}
            kw = dict(block_q=64, block_kv=bkv, max_concurrent_steps=2, causal=True)
            cfg = mgpu.TuningConfig(**{k: v for k, v in kw.items() if k in names})
            # the example has no scale, and its shared-memory scratch is float16 whatever the
            # inputs (bfloat16 fails its copies): float16 operands
            qs = (q.astype(jnp.float32) * scale).astype(jnp.float16)[None]
            k16, v16 = kg.astype(jnp.float16), vg.astype(jnp.float16)
            f = jax.jit(lambda q, k, v: mgpu.attention(q, k, v, cfg))
            return lambda: f(qs, k16, v16)
        return make

    for bkv in MGPU_BLOCK_KV:
        try:
            fn = make_for(bkv)()
            jax.block_until_ready(fn())
            times = []
            for _ in range(3):
                t = time.perf_counter()
                jax.block_until_ready(fn())
                times.append(time.perf_counter() - t)
            ms = statistics.median(times) * 1e3
            if not best or ms < best["ms"]:
                best = dict(ms=ms, bkv=bkv)
        except Exception as e:  # noqa: BLE001
            fails.append(f"block_kv={bkv}: {short(e, 160)}")
    failed = f"; failed: {'; '.join(fails)}" if fails else ""
    if not best:
        def make():
            raise RuntimeError("no block_kv config ran" + failed)
        run("mosaic_gpu", make, lambda o: o)
        return
    run("mosaic_gpu", make_for(best["bkv"]), lambda o: np.asarray(o[0, jrows], np.float32),
        note=f"block_q=64, block_kv={best['bkv']} (best of {MGPU_BLOCK_KV}); q pre-scaled; "
             f"float16 operands (the example's scratch){failed}")


# -- GEMM rate -------------------------------------------------------------------------------

def gemm_rate(m: int, k: int, n: int, dtype, args) -> dict:
    """bf16 ``[m, k] x [k, n]`` (f32 accumulation, ``dtype`` out) rate, TFLOP/s: a plain
    jitted dot, and ``benchmarks/gemm.py``'s ``time_case`` (its dots summed into a float32
    accumulator: the sum's traffic counts against it) where it imports."""
    out = dict(kind="gemm", m=m, k=k, n=n)
    try:
        x = jax.random.normal(jax.random.key(2), (m, k), jnp.float32).astype(dtype)
        ws = [jax.random.normal(jax.random.key(3 + i), (k, n), jnp.float32).astype(dtype) for i in range(2)]
        f = jax.jit(lambda x, w: x @ w)
        i = [0]

        def call():       # two weight sets alternated: nothing served from the L2
            i[0] ^= 1
            return f(x, ws[i[0]])
        r = timed(call, jax_sync, warmup=args.warmup, iters=max(args.iters, 10), budget_s=args.case_s,
                  min_iters=args.min_iters)
        r.pop("out")
        out.update(ms=r["ms"], tflops=2.0 * m * k * n / (r["ms"] * 1e-3) / 1e12)
    except Exception as e:  # noqa: BLE001
        out["error"] = short(e)
    try:
        import gemm

        g = gemm.time_case(m, k, n, reps=5 if args.tiny else 20,
                           min_bytes=2 ** 16 if args.tiny else 4 * gemm.L2_BYTES)
        out["gemm_py_tflops"] = 2.0 * m * k * n / (g["us"] * 1e-6) / 1e12
    except Exception as e:  # noqa: BLE001
        out["gemm_py_error"] = short(e)
    return out


# -- the runs --------------------------------------------------------------------------------

class Sink:
    """Rows: printed as they come, kept, and the ``--json`` document rewritten after each."""

    def __init__(self, path: str | None, settings: dict):
        self.path, self.doc = path, dict(settings=settings, rows=[])

    def __call__(self, row: dict) -> None:
        row = {k: v for k, v in row.items() if k not in ("logits", "out")}
        self.doc["rows"].append(row)
        bits = [f"{k}={_fmt(v)}" for k, v in row.items() if k not in ("kind",)]
        print(f"[{row.get('kind')}] " + " ".join(bits), flush=True)
        self.flush()

    def flush(self) -> None:
        if self.path:
            with open(self.path, "w") as f:
                json.dump(self.doc, f, indent=1, default=float)


def _fmt(v):
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def run_prompts(args, sink: Sink) -> None:
    dtype = jnp.dtype(args.dtype)
    target, geo, _ = build_target(args.target, dtype)
    torch = torch_or_none() if ({"torch", "torch_compile"} & set(args.parts)
                                or any(c.startswith("torch") for c in args.attn)) else None
    tp = None
    if torch is not None:
        try:
            tp = TorchPrefill(target, geo, torch)
            sink.doc["settings"]["torch"] = dict(
                version=torch.__version__, device=str(tp.device), gqa=tp.gqa,
                weights=(f"copied through the host ({len(tp.copied)} tensors: {tp.copied[0]})"
                         if tp.copied else "shared with JAX through DLPack"))
            print(f"# torch {torch.__version__} on {tp.device}; SDPA GQA: {tp.gqa}; weights "
                  f"{sink.doc['settings']['torch']['weights']}", flush=True)
        except Exception as e:  # noqa: BLE001
            sink(dict(kind="torch_setup", error=short(e)))
    elif {"torch", "torch_compile"} & set(args.parts):
        sink(dict(kind="torch_setup", skipped="torch is not installed: PyTorch rows skipped"))
    gemm_tf = None
    if "gemm" in args.parts:
        m = min(max(args.prompts), 8192)
        g = gemm_rate(m, geo["hidden_size"], 2 * geo["intermediate_size"], dtype, args)
        sink(g)
        gemm_tf = g.get("tflops")
        sink.doc["gemm_tflops"] = gemm_tf
    for t in args.prompts:
        fl = prefill_flops(geo, t)
        base = dict(prompt=t, flops=fl["total"], attention_flops=fl["attention"])
        got: dict[str, dict] = {}

        def case(kind, label, fn):
            row = dict(kind=kind, case=label, **base)
            try:
                r = fn()
                row.update(r)
                row["tflops"] = fl["total"] / (r["ms"] * 1e-3) / 1e12
                if gemm_tf:
                    row["x_gemm"] = row["tflops"] / gemm_tf
                row["x_sheet"] = row["tflops"] / SHEET_TFLOPS
                got[label] = r
            except Exception as e:  # noqa: BLE001 - recorded, the run goes on
                row["error"] = short(e)
            gc.collect()
            sink(row)
            return row

        if "engine" in args.parts:
            case("ttft", "engine TTFT", lambda: engine_ttft(target, t, dtype, args))
        if "forward" in args.parts:
            for b in args.forward_backends:
                case("forward", "specjax forward" + ("" if b == "auto" else f" ({b})"),
                     lambda b=b: specjax_forward(target, t, dtype, b, args))
        jax_logits = next((r["logits"] for k, r in got.items() if k.startswith("specjax forward")), None)
        for part, compiled in (("torch", False), ("torch_compile", True)):
            if part not in args.parts:
                continue
            label = "torch compile" if compiled else "torch eager"
            if tp is None:
                sink(dict(kind="torch", case=label, prompt=t, skipped="no torch"))
                continue
            row = case("torch", label, lambda compiled=compiled: torch_forward(tp, t, compiled, args))
            if "error" not in row and jax_logits is not None:
                tl = got[label]["logits"]
                row_extra = dict(logits_rel_err=rel_err(tl, jax_logits.astype(np.float64)),
                                 same_token=bool(got[label]["token"] == int(np.argmax(jax_logits))))
                sink.doc["rows"][-1].update(row_extra)
                print(f"    {label} vs specjax forward: {row_extra}", flush=True)
                sink.flush()
        # ratios to PyTorch
        for r in sink.doc["rows"]:
            if r.get("prompt") == t and r.get("kind") in ("ttft", "forward", "torch") and "ms" in r:
                for lab, key in (("torch eager", "x_torch_eager"), ("torch compile", "x_torch_compile")):
                    if lab in got:
                        r[key] = r["ms"] / got[lab]["ms"]
        sink.flush()
        if "attention" in args.parts:
            attention_cases(geo, t, dtype, args.attn, tp, args, sink)
            flash = next((r["ms"] for r in sink.doc["rows"] if r.get("prompt") == t
                          and r.get("case") == "torch_sdpa_flash" and "ms" in r and "skipped" not in r), None)
            if flash:
                for r in sink.doc["rows"]:
                    if r.get("prompt") == t and r.get("kind") == "attention" and "ms" in r:
                        r["x_torch_flash"] = r["ms"] / flash
                sink.flush()
        got.clear()
        gc.collect()
        if tp is not None and tp.device.type == "cuda":
            tp.torch.cuda.empty_cache()


def run_batch(args, sink: Sink) -> None:
    dtype = jnp.dtype(args.dtype)
    target, geo, _ = build_target(args.target, dtype)
    b, p, k = args.batch, args.batch_prompt, 3
    iters = args.decode_iters
    max_tokens = (iters + 2) * (k + 1)
    mml = cdiv(p + max_tokens + 2 * k + 8, BS) * BS
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, geo["vocab_size"], p).tolist() for _ in range(b)]
    for method in args.methods:
        row = dict(kind="batch", method=method, batch=b, prompt=p, max_model_len=mml, k=0 if method == "plain" else k)
        eng = prop = None
        try:
            prop = None if method == "plain" else drafter(method, target, geo, args.target, k,
                                                          DEMO_RATES, mml, dtype)
            eng = make_engine(target, prop, b, mml, dtype)
            t0 = time.perf_counter()
            loop_measure(eng, prompts, min(iters, 8), max_tokens)        # compiles
            row["compile_s"] = time.perf_counter() - t0
            r = loop_measure(eng, prompts, iters, max_tokens)
            row.update(ttft_ms=r["ttft_ms"], prefill_tokens_per_s=b * p / (r["ttft_ms"] * 1e-3),
                       decode_tokens_per_s=r["tokens_per_s"], per_iter_ms=r["per_iter_ms"],
                       tokens_per_iter=r["tokens_per_iter"], iters=r["iters"])
            fl = prefill_flops(geo, p)
            row["prefill_tflops"] = b * fl["total"] / (r["ttft_ms"] * 1e-3) / 1e12
        except Exception as e:  # noqa: BLE001 - OOM and friends: recorded
            row["error"] = short(e)
        del eng, prop
        gc.collect()
        sink(row)


# -- tables ----------------------------------------------------------------------------------

def _ms(r, key="ms"):
    """A cell: the figure, or why there is none."""
    if r is None:
        return "-"
    if "error" in r:
        return "fails: " + r["error"][:100]
    if key in r:
        return f"{r[key]:,.1f}"
    return "skipped: " + r["skipped"][:100] if "skipped" in r else "-"


def _g(x, spec=".3g"):
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def _ratio(a, b):
    ok = a is not None and b is not None and "ms" in a and "ms" in b and "error" not in a and "error" not in b
    return f"{a['ms'] / b['ms']:.2f}x" if ok else "-"


def print_tables(doc: dict) -> None:
    """The markdown tables: batch rows (``--batch-prefill``), else the TTFT table (the
    issue's) and the attention options."""
    rows = doc["rows"]
    batch = [r for r in rows if r.get("kind") == "batch"]
    if batch:
        print("\n| method | B | prompt | TTFT ms | prefill tok/s | prefill TFLOP/s | decode tok/s | ms / iter |")
        print("|---|---|---|---|---|---|---|---|")
        for r in batch:
            lead = f"| {r['method']} | {r['batch']} | {r['prompt']} |"
            if "error" in r:
                print(f"{lead} fails: {r['error'][:160]} | | | | |")
            else:
                print(f"{lead} {r['ttft_ms']:,.1f} | {r['prefill_tokens_per_s']:,.0f} | "
                      f"{_g(r['prefill_tflops'])} | {r['decode_tokens_per_s']:,.0f} | {r['per_iter_ms']:.2f} |")
        return
    gemm_tf = doc.get("gemm_tflops")
    print(f"\n(bf16 GEMM rate measured here: {_g(gemm_tf)} TFLOP/s; sheet {SHEET_TFLOPS:.0f} TFLOP/s)")
    prompts = sorted({r["prompt"] for r in rows if "prompt" in r})

    def pick(t, case):
        return next((r for r in rows if r.get("prompt") == t and r.get("case") == case), None)
    print("\n| prompt tokens | specjax TTFT ms | specjax forward ms | torch eager ms | torch compile ms "
          "| TTFT / eager | TTFT / compile | forward / compile | forward TFLOP/s | x GEMM rate | x sheet |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for t in prompts:
        tt, fw = pick(t, "engine TTFT"), pick(t, "specjax forward")
        te, tc = pick(t, "torch eager"), pick(t, "torch compile")
        fl = fw or {}
        print(f"| {t:,} | {_ms(tt)} | {_ms(fw)} | {_ms(te)} | {_ms(tc)} | {_ratio(tt, te)} | "
              f"{_ratio(tt, tc)} | {_ratio(fw, tc)} | {_g(fl.get('tflops'))} | "
              f"{_g(fl.get('x_gemm'), '.2f')} | {_g(fl.get('x_sheet'), '.2f')} |")
    att = [r for r in rows if r.get("kind") == "attention"]
    if att:
        print("\n| prompt | attention option (one layer) | ms | TFLOP/s | x torch flash | rel err | note |")
        print("|---|---|---|---|---|---|---|")
        for r in att:
            note = r.get("note", "") + (f" (= the {r['same_as']} row)" if "same_as" in r else "")
            print(f"| {r['prompt']:,} | {r['case']} | {_ms(r)} | {_g(r.get('tflops'))} | "
                  f"{_g(r.get('x_torch_flash'), '.2f')} | {_g(r.get('rel_err'), '.1e')} | {note[:100]} |")


# -- main ------------------------------------------------------------------------------------

def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true",
                    help="CPU smoke run: the tiny fp32 target, prompts 32,128, 2 iterations, "
                         "the batch mode at B = 4 with 32-token prompts")
    ap.add_argument("--target", choices=("8b", "1b", "tiny"), default=None,
                    help="default 8b (tiny with --tiny)")
    ap.add_argument("--prompts", default=None, help="prompt lengths, comma separated "
                    "(default 1024,8192,32768; add 131072 for the 128k goal)")
    ap.add_argument("--parts", default=",".join(PARTS),
                    help=f"comma separated, of {','.join(PARTS)} (default all)")
    ap.add_argument("--attn", default=None,
                    help=f"attention options, comma separated, of {','.join(ATTN_CASES)} (default all)")
    ap.add_argument("--forward-backends", default="auto",
                    help="process default attention backend(s) of the bare forward rows, comma "
                         f"separated, of {','.join(ATTENTION_BACKENDS)} (auto: the current default)")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default=None,
                    help="default bfloat16 (float32 with --tiny)")
    ap.add_argument("--iters", type=int, default=None, help="timed calls per case at most (default 10; 2 with --tiny)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed calls first, the compile "
                    "included (default 2; 1 with --tiny)")
    ap.add_argument("--case-s", type=float, default=8.0,
                    help="stop timing a case once its timed calls have taken this long (after 3)")
    ap.add_argument("--ttft-reps", type=int, default=5, help="engine TTFT runs per prompt length")
    ap.add_argument("--batch-prefill", action="store_true",
                    help="B = --batch requests of --batch-prompt tokens through the engine, plain "
                         "and EAGLE-3: the batch's TTFT and decode tokens/s")
    ap.add_argument("--batch", type=int, default=None, help="default 256 (4 with --tiny)")
    ap.add_argument("--batch-prompt", type=int, default=None, help="default 1024 (32 with --tiny)")
    ap.add_argument("--methods", default="plain,eagle3", help="--batch-prefill methods")
    ap.add_argument("--decode-iters", type=int, default=None,
                    help="--batch-prefill: timed loop iterations after the first token (default 32; 8 with --tiny)")
    ap.add_argument("--json", default=None, help="write the settings and every row here (one document)")
    args = ap.parse_args(argv)
    args.target = args.target or ("tiny" if args.tiny else "8b")
    args.dtype = args.dtype or ("float32" if args.tiny else "bfloat16")
    args.prompts = [int(x) for x in (args.prompts or ("32,128" if args.tiny else "1024,8192,32768")).split(",")]
    args.parts = [p for p in args.parts.split(",") if p]
    bad = sorted(set(args.parts) - set(PARTS))
    if bad:
        ap.error(f"--parts: unknown {bad}; allowed {PARTS}")
    args.attn = [c for c in (args.attn.split(",") if args.attn else ATTN_CASES) if c]
    bad = sorted(set(args.attn) - set(ATTN_CASES))
    if bad:
        ap.error(f"--attn: unknown {bad}; allowed {ATTN_CASES}")
    args.forward_backends = [b for b in args.forward_backends.split(",") if b]
    bad = sorted(set(args.forward_backends) - set(ATTENTION_BACKENDS))
    if bad:
        ap.error(f"--forward-backends: unknown {bad}; allowed {ATTENTION_BACKENDS}")
    args.iters = args.iters or (2 if args.tiny else 10)
    args.warmup = args.warmup or (1 if args.tiny else 2)
    args.min_iters = 2 if args.tiny else 3
    args.batch = args.batch or (4 if args.tiny else 256)
    args.batch_prompt = args.batch_prompt or (32 if args.tiny else 1024)
    args.decode_iters = args.decode_iters or (8 if args.tiny else 32)
    args.methods = [m for m in args.methods.split(",") if m]
    if any(m not in ("plain", "eagle3", "mtp") for m in args.methods):
        ap.error("--methods: plain, eagle3, mtp")
    torch_in = not args.batch_prefill and bool(
        set(args.parts) & {"torch", "torch_compile"}
        or ("attention" in args.parts and any(c.startswith("torch") for c in args.attn)))
    if not args.tiny and "XLA_PYTHON_CLIENT_MEM_FRACTION" not in os.environ:
        # before JAX's backend starts: with PyTorch in the process, half the GPU each; else
        # JAX's default 0.75 leaves an 80 GB card short of a 128k prompt's or B = 256's pool
        os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = "0.5" if torch_in else "0.92"
    # inductor compiles in this process: its worker pool's subprocesses failed at 8k and 32k
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    gpu = jax.default_backend() == "gpu"
    dev = jax.devices()[0]
    settings = dict(argv=argv, date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                    jax=jax.__version__, device=f"{dev.platform} {dev.device_kind}",
                    xla_flags=os.environ.get("XLA_FLAGS", ""),
                    mem_fraction=os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", ""),
                    target=args.target, dtype=args.dtype, prompts=args.prompts, parts=args.parts,
                    attn=args.attn, kernel_backend_default=kbackend.get_default_backend(),
                    batch_prefill=args.batch_prefill, batch=args.batch, batch_prompt=args.batch_prompt,
                    methods=args.methods, decode_iters=args.decode_iters)
    print(f"# {settings['date']}; jax {jax.__version__}; {settings['device']}; target {args.target} "
          f"{args.dtype}; "
          + (f"batch prefill: B = {args.batch} x {args.batch_prompt} tokens, {args.methods}, "
             f"{args.decode_iters} decode iterations; " if args.batch_prefill else
             f"prompts {args.prompts}; parts {args.parts}; ")
          + f"XLA_FLAGS={settings['xla_flags']!r}; "
          f"XLA_PYTHON_CLIENT_MEM_FRACTION={settings['mem_fraction']!r}; gpu={gpu}", flush=True)
    sink = Sink(args.json, settings)
    t0 = time.perf_counter()
    if args.batch_prefill:
        run_batch(args, sink)
    else:
        run_prompts(args, sink)
    sink.doc["wall_s"] = time.perf_counter() - t0
    sink.flush()
    print_tables(sink.doc)
    print(f"\n# wall {sink.doc['wall_s']:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

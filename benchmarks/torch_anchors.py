"""PyTorch anchors for specjax's step benchmarks: the same steps written the PyTorch way,
``torch.compile``'d (inductor) and replayed in a CUDA graph, timed in the calling process.

Steps (shapes of ``benchmarks/e2e.py --target 8b``: Llama-3.1-8B, bf16, random weights):

- ``decode``: a Llama decode step, 1 token per request, greedy (argmax) next tokens;
- ``verify``: the same forward over ``k + 1`` = 4 tokens per request (a k = 3 verify step:
  logits of every position, argmax);
- ``propose``: the 8B-shaped EAGLE-3 head's ``propose`` of k drafts (fc over the target's
  3 aux hidden states, the first pass over the 4 tokens, then k - 1 single-token steps;
  draft vocabulary 32000 mapped through d2t), as ``benchmarks/proposers.py`` times it;
- ``mtp``: a MiMo MTP module's ``propose`` of k drafts (vLLM ``mimo_mtp.py``: the target's
  final hidden states and the input ids shifted by one, ``input_proj`` over the normed
  hidden and normed embedding, one Qwen2 layer with q/k/v bias, the final norm, the
  target's lm_head; the post-norm output recycled as the next step's hidden), as
  ``benchmarks/proposers.py --methods mtp`` times it;
- ``mtp_fused``: verify + the MTP propose in one graph, the module fed the verify's final
  (post-norm) hidden states (the PyTorch way of specjax's fused MTP step);
- ``fused``: verify + propose in one graph, the aux states taken from the verify pass (the
  inputs of layers ``(2, L//2, L-3)``) and the proposer fed its last-position token (the
  PyTorch way of specjax's fused EAGLE-3 step; the greedy acceptance compare is omitted).

Each request holds ``context`` tokens, all but the last in a static K/V cache (as
``engine.diagnostics.time_decode_step`` sets it up: ``context - 1`` cached, the new tokens at positions
``context - 1 ..``); the cache is one ``[B, kv_heads, S, head_dim]`` buffer per layer, ``S``
the context rounded up to 64. Attention is ``F.scaled_dot_product_attention`` over the whole
static cache with a boolean mask (``s <= position``); the GQA group is folded into the query
length (``[B, kv_heads, group * T, head_dim]``) so K/V are read once, not repeated per query
head. One decoder layer and the lm_head are each ``torch.compile``'d (``dynamic=False``; one
compile per shape, reused by all 32 layers, which have identical shapes) and the whole step
(embedding, 32 layers, lm_head, argmax, cache writes) is captured in one
``torch.cuda.CUDAGraph``.

Timed per anchor (``time_graph``): ``graph_ms``, the median over rounds of back-to-back
replays between CUDA events; ``synced_ms``, the median wall time of one replay followed by
copying its tokens to the host (what specjax's ``time_decode_step`` does each step). On a
CPU (only for testing this file's logic) there is no graph: the step is called directly.

The shape arithmetic (``plan``) is plain Python; torch is imported only when a model is
built. ``check`` compares the cached steps against an uncached full forward (fp32, tiny
shapes) and runs on any device.

Usage (GPU machine)::

    python benchmarks/torch_anchors.py --batch 1,8,32 [--check] [--json F]
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys
import time
from typing import Any, Mapping

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import floors  # noqa: E402

ANCHORS = ("decode", "verify", "propose", "fused", "mtp", "mtp_fused")


def aux_layer_ids(num_layers: int) -> tuple[int, int, int]:
    """vLLM's default EAGLE-3 aux layers (inputs of layers 2, L//2, L-3)."""
    return (2, num_layers // 2, num_layers - 3)


def plan(geo: Mapping, batch: int, context: int, tokens: int, *, dtype_bytes: int = 2,
         k: int = 3, draft_vocab: int | None = None) -> dict[str, Any]:
    """Shapes and floor bytes of one anchor step (no torch): ``tokens`` new tokens per
    request at positions ``context - 1 ..`` with ``context - 1`` cached, a ``cache_len``-slot
    static cache (``context + max(tokens, k + 1)`` rounded up to 64)."""
    if batch < 1 or tokens < 1 or k < 1:
        raise ValueError(f"batch, tokens and k must be >= 1, got {batch}, {tokens}, {k}")
    if context < 2:
        raise ValueError(f"context must be >= 2 (one cached token at least), got {context}")
    hd, nh, nkv = floors.head_dim(geo), geo["num_attention_heads"], geo["num_key_value_heads"]
    if nh % nkv:
        raise ValueError(f"num_attention_heads {nh} is not a multiple of num_key_value_heads {nkv}")
    group = nh // nkv
    cached = context - 1
    cache_len = -(-(context + max(tokens, k + 1)) // 64) * 64
    dv = draft_vocab or geo["vocab_size"]
    return dict(
        batch=batch, tokens=tokens, cached=cached, positions=list(range(cached, cached + tokens)),
        cache_len=cache_len, group=group,
        kv_cache_shape=(batch, nkv, cache_len, hd),
        folded_query_shape=(batch, nkv, group * tokens, hd), mask_shape=(group * tokens, cache_len),
        qkv_out=(nh + 2 * nkv) * hd,
        target_bytes=floors.target_step_bytes(geo, batch, cached, tokens, dtype_bytes),
        propose_bytes=floors.eagle3_propose_bytes(geo, batch, cached, k, dv, dtype_bytes),
        mtp_bytes=floors.mtp_propose_bytes(geo, batch, cached, k, dtype_bytes),
        aux_layers=aux_layer_ids(geo["num_hidden_layers"]),
    )


# -- torch ---------------------------------------------------------------------------------

def _rms(x, w, eps):
    import torch

    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def _rope(x, cos, sin):
    """``x`` [B, T, heads, hd]; cos / sin [T, hd] (rotate-half convention)."""
    import torch

    c, s = cos[None, :, None, :], sin[None, :, None, :]
    x1, x2 = x.chunk(2, -1)
    return x * c + torch.cat((-x2, x1), -1) * s


def _attend(q, k_cache, v_cache, mask, group):
    """q [B, nh, T, hd] against the static cache [B, nkv, S, hd], the group folded into
    the query length; mask [T, S] (True: attend)."""
    import torch.nn.functional as F

    b, nh, t, hd = q.shape
    nkv = k_cache.shape[1]
    qf = q.reshape(b, nkv, group * t, hd)
    o = F.scaled_dot_product_attention(qf, k_cache, v_cache, attn_mask=mask.repeat(group, 1))
    return o.reshape(b, nh, t, hd)


def _layer_fn(nh: int, nkv: int, hd: int, eps: float, eagle: bool):
    """One decoder layer ``(h[, emb], weights..., k_cache, v_cache, cos, sin, pos, mask) ->
    h``, writing the new K/V into the caches. ``eagle``: EAGLE-3's layer (q/k/v read the
    concatenation of the normed embedding and the normed hidden state; the residual is
    the hidden state)."""
    import torch
    import torch.nn.functional as F

    group = nh // nkv

    def attn_mlp(x, h, wqkv, wo, ln2, w13, w2, kc, vc, cos, sin, pos, mask, bqkv=None):
        b, t, _ = x.shape
        q, k, v = F.linear(x, wqkv, bqkv).split([nh * hd, nkv * hd, nkv * hd], -1)
        q = _rope(q.view(b, t, nh, hd), cos, sin).transpose(1, 2)
        k = _rope(k.view(b, t, nkv, hd), cos, sin).transpose(1, 2)
        kc[:, :, pos] = k
        vc[:, :, pos] = v.view(b, t, nkv, hd).transpose(1, 2)
        o = _attend(q, kc, vc, mask, group).transpose(1, 2).reshape(b, t, nh * hd)
        h = h + F.linear(o, wo)
        gate, up = F.linear(_rms(h, ln2, eps), w13).chunk(2, -1)
        return h + F.linear(F.silu(gate) * up, w2)

    if eagle:
        def layer(h, emb, ln_in, ln_hid, wqkv, wo, ln2, w13, w2, kc, vc, cos, sin, pos, mask):
            x = torch.cat((_rms(emb, ln_in, eps), _rms(h, ln_hid, eps)), -1)
            return attn_mlp(x, h, wqkv, wo, ln2, w13, w2, kc, vc, cos, sin, pos, mask)
    else:
        def layer(h, ln1, wqkv, wo, ln2, w13, w2, kc, vc, cos, sin, pos, mask):
            return attn_mlp(_rms(h, ln1, eps), h, wqkv, wo, ln2, w13, w2, kc, vc, cos, sin, pos, mask)
    layer.attn_mlp = attn_mlp
    return layer


def _mtp_fn(nh: int, nkv: int, hd: int, eps: float):
    """One MiMo MTP module forward ``(h, emb, pos, weights..., k_cache, v_cache, cos, sin,
    mask) -> (o, s)`` (post-norm ``o``, the next step's hidden; pre-norm ``s``, which
    ``_head_fn`` turns into tokens: its norm is the final norm), writing the new K/V into
    the caches."""
    import torch
    import torch.nn.functional as F

    attn_mlp = _layer_fn(nh, nkv, hd, eps, eagle=False).attn_mlp

    def mtp(h, emb, pos, ln_tok, ln_hid, w_in, ln1, wqkv, bqkv, wo, ln2, w13, w2, ln_f,
            kc, vc, cos, sin, mask):
        emb = torch.where((pos == 0)[None, :, None], torch.zeros_like(emb), emb)
        x = F.linear(torch.cat((_rms(h, ln_hid, eps), _rms(emb, ln_tok, eps)), -1), w_in)
        s = attn_mlp(_rms(x, ln1, eps), x, wqkv, wo, ln2, w13, w2, kc, vc, cos, sin, pos, mask,
                     bqkv)
        return _rms(s, ln_f, eps), s
    return mtp


def _head_fn(eps: float):
    import torch.nn.functional as F

    def head(h, norm, lm_head):
        return F.linear(_rms(h, norm, eps), lm_head).argmax(-1)
    return head


class Anchors:
    """Random-weight PyTorch target (Llama geometry ``geo``) and EAGLE-3 head for one batch
    size, with static caches; ``step(name)`` returns a zero-argument callable running that
    anchor on fixed inputs (the cache writes land on the same slots every call: a steady
    state, as specjax's benchmark re-runs one batch)."""

    def __init__(self, geo: Mapping, batch: int, context: int, *, k: int = 3,
                 draft_vocab: int | None = None, dtype=None, device=None, compile: bool = True,
                 seed: int = 0):
        import torch

        self.torch = torch
        self.geo, self.batch, self.context, self.k = dict(geo), batch, context, k
        self.dtype = getattr(torch, dtype) if isinstance(dtype, str) else (dtype or torch.bfloat16)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.draft_vocab = draft_vocab or geo["vocab_size"]
        self.plan = {t: plan(geo, batch, context, t, k=k, draft_vocab=self.draft_vocab)
                     for t in (1, k + 1)}
        p = self.plan[k + 1]
        g = torch.Generator(device=self.device).manual_seed(seed)
        h, i, v = geo["hidden_size"], geo["intermediate_size"], geo["vocab_size"]
        nh, nkv, hd = geo["num_attention_heads"], geo["num_key_value_heads"], floors.head_dim(geo)
        eps, L = geo.get("rms_norm_eps", 1e-5), geo["num_hidden_layers"]
        dev, dt = self.device, self.dtype

        def w(*shape):
            return (torch.randn(*shape, generator=g, device=dev, dtype=torch.float32)
                    / math.sqrt(shape[-1])).to(dt)

        def ones(n):
            return torch.ones(n, device=dev, dtype=dt)

        def cache():
            return torch.zeros(p["kv_cache_shape"], device=dev, dtype=dt)

        self.embed = (torch.randn(v, h, generator=g, device=dev, dtype=torch.float32)).to(dt)
        self.layers = [(ones(h), w(p["qkv_out"], h), w(h, nh * hd), ones(h), w(2 * i, h), w(h, i))
                       for _ in range(L)]
        self.caches = [(cache(), cache()) for _ in range(L)]
        self.norm, self.lm_head = ones(h), w(v, h)
        # EAGLE-3 head: fc (3 aux states -> H), one layer over [emb | hidden], draft lm_head, d2t
        dv = self.draft_vocab
        self.fc = w(h, 3 * h)
        self.e_layer = (ones(h), ones(h), w(p["qkv_out"], 2 * h), w(h, nh * hd), ones(h),
                        w(2 * i, h), w(h, i))
        self.e_cache = (cache(), cache())
        self.e_norm, self.e_lm_head = ones(h), w(dv, h)
        self.d2t = torch.randint(0, v - dv + 1, (dv,), generator=g, device=dev)
        # MiMo MTP module: token / hidden norms, input_proj, a Qwen2 layer (q/k/v bias), final
        # norm; the target's embedding and lm_head
        self.m_weights = (ones(h), ones(h), w(h, 2 * h), ones(h), w(p["qkv_out"], h),
                          w(p["qkv_out"]), w(h, nh * hd), ones(h), w(2 * i, h), w(h, i), ones(h))
        self.m_cache = (cache(), cache())
        self.hidden_in = w(batch, k + 1, h)
        # RoPE tables over the cache slots
        inv = 1.0 / (geo.get("rope_theta", 10000.0) ** (torch.arange(0, hd, 2, device=dev).float() / hd))
        ang = torch.arange(p["cache_len"], device=dev).float()[:, None] * inv[None]
        ang = torch.cat((ang, ang), -1)
        self.cos, self.sin = ang.cos().to(dt), ang.sin().to(dt)
        self.slots = torch.arange(p["cache_len"], device=dev)
        self.aux = tuple(p["aux_layers"])
        # fixed inputs
        self.tokens = {t: torch.randint(0, v, (batch, t), generator=g, device=dev) for t in (1, k + 1)}
        self.pos = {t: torch.tensor(self.plan[t]["positions"], device=dev) for t in (1, k + 1)}
        self.aux_in = w(batch, k + 1, 3 * h)
        self.next_tok = torch.randint(0, v, (batch,), generator=g, device=dev)
        if compile:   # one code object compiled per shape: several batch sizes, two heads
            for name in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit",
                         "accumulated_recompile_limit"):
                if hasattr(torch._dynamo.config, name):
                    setattr(torch._dynamo.config, name, max(256, getattr(torch._dynamo.config, name)))
        wrap = (lambda f: torch.compile(f, dynamic=False)) if compile else (lambda f: f)
        self._layer = wrap(_layer_fn(nh, nkv, hd, eps, eagle=False))
        self._e_layer = wrap(_layer_fn(nh, nkv, hd, eps, eagle=True))
        self._head = wrap(_head_fn(eps))
        self._mtp = wrap(_mtp_fn(nh, nkv, hd, eps))

    def _rope_mask(self, pos):
        return self.cos[pos], self.sin[pos], self.slots[None, :] <= pos[:, None]

    def target(self, tokens, pos, want_aux: bool = False, want_hidden: bool = False):
        """Greedy next tokens [B, T] of a target forward over ``tokens`` at ``pos`` (and
        the aux states [B, T, 3H] when ``want_aux``, the final post-norm hidden states
        [B, T, H] when ``want_hidden``)."""
        cos, sin, mask = self._rope_mask(pos)
        h = self.embed[tokens]
        inputs = {}
        for li, (wts, (kc, vc)) in enumerate(zip(self.layers, self.caches)):
            if want_aux and li in self.aux:
                inputs[li] = h
            h = self._layer(h, *wts, kc, vc, cos, sin, pos, mask)
        out = self._head(h, self.norm, self.lm_head)
        if want_hidden:
            return out, _rms(h, self.norm, self.geo.get("rms_norm_eps", 1e-5))
        return (out, self.torch.cat([inputs[li] for li in self.aux], -1)) if want_aux else out

    def propose(self, target_tokens, pos, aux, next_tokens):
        """k draft tokens [B, k] of the EAGLE-3 head (vLLM's chain: first pass over the
        target batch, its input ids shifted by one with the next token appended)."""
        torch = self.torch
        hidden = torch.nn.functional.linear(aux, self.fc)
        ids = torch.cat((target_tokens[:, 1:], next_tokens[:, None]), 1)
        kc, vc = self.e_cache
        drafts = []
        for step in range(self.k):
            cos, sin, mask = self._rope_mask(pos)
            hidden = self._e_layer(hidden, self.embed[ids], *self.e_layer, kc, vc, cos, sin, pos, mask)
            hidden = hidden[:, -1:]
            d = self._head(hidden, self.e_norm, self.e_lm_head)[:, 0]
            tok = d + self.d2t[d]
            drafts.append(tok)
            ids, pos = tok[:, None], pos[-1:] + 1
        return torch.stack(drafts, 1)

    def propose_mtp(self, target_tokens, pos, hidden, next_tokens):
        """k draft tokens [B, k] of the MTP module (vLLM's V1 chain with module 0 every
        step: the first pass over the target batch, then single-token steps)."""
        torch = self.torch
        ids = torch.cat((target_tokens[:, 1:], next_tokens[:, None]), 1)
        kc, vc = self.m_cache
        drafts = []
        for step in range(self.k):
            cos, sin, mask = self._rope_mask(pos)
            hidden, s = self._mtp(hidden, self.embed[ids], pos, *self.m_weights, kc, vc, cos, sin, mask)
            hidden = hidden[:, -1:]
            # logits = lm_head(o), o = final_norm(s): the head's rms + lm_head + argmax (a
            # separately compiled lm_head + argmax on o ran 7.9 ms at B = 32 under inductor)
            tok = self._head(s[:, -1:], self.m_weights[-1], self.lm_head)[:, 0]
            drafts.append(tok)
            ids, pos = tok[:, None], pos[-1:] + 1
        return torch.stack(drafts, 1)

    def step(self, name: str):
        k1 = self.k + 1
        if name == "decode":
            return lambda: self.target(self.tokens[1], self.pos[1])
        if name == "verify":
            return lambda: self.target(self.tokens[k1], self.pos[k1])
        if name == "propose":
            return lambda: self.propose(self.tokens[k1], self.pos[k1], self.aux_in, self.next_tok)
        if name == "mtp":
            return lambda: self.propose_mtp(self.tokens[k1], self.pos[k1], self.hidden_in, self.next_tok)
        if name == "mtp_fused":
            def mtp_fused():
                out, hid = self.target(self.tokens[k1], self.pos[k1], want_hidden=True)
                return out, self.propose_mtp(self.tokens[k1], self.pos[k1], hid, out[:, -1])
            return mtp_fused
        if name == "fused":
            def fused():
                out, aux = self.target(self.tokens[k1], self.pos[k1], want_aux=True)
                return out, self.propose(self.tokens[k1], self.pos[k1], aux, out[:, -1])
            return fused
        raise ValueError(f"anchor must be one of {ANCHORS}, got {name!r}")

    def floor_ms(self, name: str) -> float:
        k1 = self.k + 1
        nbytes = {"decode": self.plan[1]["target_bytes"], "verify": self.plan[k1]["target_bytes"],
                  "propose": self.plan[k1]["propose_bytes"], "mtp": self.plan[k1]["mtp_bytes"],
                  "fused": self.plan[k1]["target_bytes"] + self.plan[k1]["propose_bytes"],
                  "mtp_fused": self.plan[k1]["target_bytes"] + self.plan[k1]["mtp_bytes"]}[name]
        return floors.floor_ms(nbytes)


def time_graph(fn, *, reps: int = 50, rounds: int = 10, replays: int = 20, warmup: int = 3,
               cuda_graph: bool | None = None) -> dict[str, float]:
    """Capture ``fn`` in a CUDA graph (on a CUDA device) and time it: ``graph_ms`` (median
    over ``rounds`` of ``replays`` back-to-back replays between CUDA events), ``synced_ms``
    (median of ``reps`` replays each followed by copying the outputs to the host) and
    ``compile_s`` (the warm-up calls: compiles + autotuning). Without CUDA: direct calls,
    both figures wall time."""
    import torch

    cuda_graph = torch.cuda.is_available() if cuda_graph is None else cuda_graph
    t0 = time.perf_counter()
    if cuda_graph:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(warmup):
                fn()
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        compile_s = time.perf_counter() - t0
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fn()
        run = graph.replay
        for _ in range(warmup):
            run()
        torch.cuda.synchronize()
        per = []
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(rounds):
            start.record()
            for _ in range(replays):
                run()
            end.record()
            end.synchronize()
            per.append(start.elapsed_time(end) / replays)
    else:
        for _ in range(warmup):
            out = fn()
        compile_s = time.perf_counter() - t0

        def run():
            nonlocal out
            out = fn()
        sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
        per = []
        for _ in range(rounds):
            sync()
            t1 = time.perf_counter()
            for _ in range(replays):
                run()
            sync()
            per.append((time.perf_counter() - t1) / replays * 1e3)
    outs = out if isinstance(out, tuple) else (out,)
    lat = []
    for _ in range(reps):
        t1 = time.perf_counter()
        run()
        [o.cpu() for o in outs]
        lat.append(time.perf_counter() - t1)
    return dict(graph_ms=statistics.median(per), synced_ms=statistics.median(lat) * 1e3,
                compile_s=compile_s)


def measure(geo: Mapping, batches, context: int, *, k: int = 3, draft_vocab: int | None = None,
            anchors=ANCHORS, dtype=None, device=None, compile: bool = True, reps: int = 50,
            rounds: int = 10, log=print) -> list[dict]:
    """Time each anchor at each batch size (one ``Anchors`` per batch, freed after);
    rows: ``anchor, batch, graph_ms, synced_ms, floor_ms, compile_s``. ``dtype``: a torch
    dtype or its name ("bfloat16")."""
    import torch

    bad = [a for a in anchors if a not in ANCHORS]
    if bad:
        raise ValueError(f"anchors must be among {ANCHORS}, got {bad}")
    rows = []
    for b in batches:
        m = Anchors(geo, b, context, k=k, draft_vocab=draft_vocab, dtype=dtype, device=device,
                    compile=compile)
        for a in anchors:
            t = time_graph(m.step(a), reps=reps, rounds=rounds)
            r = dict(anchor=a, batch=b, k=k, context=context, floor_ms=m.floor_ms(a), **t)
            rows.append(r)
            if log:
                log(f"torch {a:<8} B={b:<3} graph {r['graph_ms']:8.3f} ms  synced {r['synced_ms']:8.3f} ms  "
                    f"floor {r['floor_ms']:7.3f} ms  (compile {r['compile_s']:.1f} s)")
        del m
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return rows


# -- correctness ---------------------------------------------------------------------------

def _reference_logits(m: Anchors, tokens):
    """Uncached full causal forward over ``tokens`` [B, N] (positions 0 ..): logits
    [B, N, V], aux states [B, N, 3H] (GQA by repeating K/V per query head)."""
    import torch
    import torch.nn.functional as F

    geo = m.geo
    nh, nkv, hd = geo["num_attention_heads"], geo["num_key_value_heads"], floors.head_dim(geo)
    eps = geo.get("rms_norm_eps", 1e-5)
    b, n = tokens.shape
    pos = torch.arange(n, device=tokens.device)
    cos, sin = m.cos[pos], m.sin[pos]
    causal = torch.ones(n, n, dtype=torch.bool, device=tokens.device).tril()
    h = m.embed[tokens]
    inputs = {}
    for li, (ln1, wqkv, wo, ln2, w13, w2) in enumerate(m.layers):
        inputs[li] = h
        q, k, v = F.linear(_rms(h, ln1, eps), wqkv).split([nh * hd, nkv * hd, nkv * hd], -1)
        q = _rope(q.view(b, n, nh, hd), cos, sin).transpose(1, 2)
        k = _rope(k.view(b, n, nkv, hd), cos, sin).transpose(1, 2).repeat_interleave(nh // nkv, 1)
        v = v.view(b, n, nkv, hd).transpose(1, 2).repeat_interleave(nh // nkv, 1)
        att = (q @ k.transpose(-1, -2) / math.sqrt(hd)).masked_fill(~causal, float("-inf")).softmax(-1)
        h = h + F.linear((att @ v).transpose(1, 2).reshape(b, n, nh * hd), wo)
        gate, up = F.linear(_rms(h, ln2, eps), w13).chunk(2, -1)
        h = h + F.linear(F.silu(gate) * up, w2)
    return F.linear(_rms(h, m.norm, eps), m.lm_head), torch.cat([inputs[li] for li in m.aux], -1)


def check(device=None, compile: bool = False) -> dict[str, float]:
    """The cached anchors against an uncached forward (fp32, tiny geometry, batch 2):
    prefill the cache token by token with ``decode`` steps, then the 4-token ``verify``
    must give the reference's argmax at every position, and the aux states of the fused
    step must equal the reference's. Raises AssertionError; returns the aux states' largest
    gap relative to their largest value."""
    import torch

    geo = floors.TARGETS["tiny"]
    ctx, k, b = 12, 3, 2
    m = Anchors(geo, b, ctx, k=k, dtype=torch.float32, device=device, compile=compile)
    n = ctx - 1 + k + 1
    seq = torch.randint(0, geo["vocab_size"], (b, n), device=m.device)
    ref, ref_aux = _reference_logits(m, seq)
    for kc, vc in m.caches:            # garbage in every slot: each must be written before
        kc.normal_(0, 10)              # it is read, and the mask must hide the later ones
        vc.normal_(0, 10)
    for p in range(ctx - 1):           # decode steps fill positions 0 .. ctx-2
        got = m.target(seq[:, p:p + 1], torch.tensor([p], device=m.device))
        want = ref[:, p:p + 1].argmax(-1)
        assert torch.equal(got, want), f"decode step at position {p}: {got.tolist()} != {want.tolist()}"
    pos = torch.arange(ctx - 1, n, device=m.device)
    got, aux = m.target(seq[:, ctx - 1:], pos, want_aux=True)
    want = ref[:, ctx - 1:].argmax(-1)
    assert torch.equal(got, want), f"verify: {got.tolist()} != {want.tolist()}"
    gap = ((aux - ref_aux[:, ctx - 1:]).abs().max() / ref_aux.abs().max()).item()
    assert gap < 1e-4, f"aux states differ by {gap} (relative to their largest)"
    drafts = m.propose(seq[:, ctx - 1:], pos, aux, got[:, -1])
    assert drafts.shape == (b, k) and bool(((drafts >= 0) & (drafts < geo["vocab_size"])).all())
    drafts = m.propose_mtp(seq[:, ctx - 1:], pos, m.hidden_in, got[:, -1])
    assert drafts.shape == (b, k) and bool(((drafts >= 0) & (drafts < geo["vocab_size"])).all())
    return dict(aux_gap=gap)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", choices=tuple(floors.TARGETS), default="8b")
    ap.add_argument("--batch", default="1,8,32")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--anchors", nargs="+", default=list(ANCHORS), choices=ANCHORS)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--no-compile", dest="compile", action="store_false")
    ap.add_argument("--check", action="store_true", help="first check the cached steps against "
                    "an uncached forward (tiny fp32)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.check:
        print("# check:", check(compile=args.compile), flush=True)
    dv = floors.EAGLE3_DRAFT_VOCAB_8B if args.target == "8b" else None
    import torch

    dtype = "bfloat16" if torch.cuda.is_available() else "float32"
    rows = measure(floors.TARGETS[args.target], [int(b) for b in args.batch.split(",")], args.context,
                   k=args.k, draft_vocab=dv, anchors=args.anchors, dtype=dtype, compile=args.compile,
                   reps=args.reps)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

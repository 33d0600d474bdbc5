"""PyTorch's chunk step, the anchor of ``scheduling.py``'s ``itl`` part (run in its own
process, before JAX takes the GPU's memory): a Llama-shaped forward (random bf16 weights,
``--geo``) over one ``chunk``-token slice of a long prompt at ``past`` cached tokens, beside
``--running`` decoding rows of ``--running-prompt`` cached tokens each, the way a PyTorch
server runs it: the projections and MLP as one GEMM over all ``chunk + running`` rows, the
chunk's attention by FlashAttention-2 (``torch.ops.aten._flash_attention_forward``:
grouped-query heads, causal aligned bottom-right, i.e. each chunk token sees the whole
past) and the decode rows' by SDPA flash, new K/V written in place into contiguous caches,
the greedy token of every row; eager and ``torch.compile``'d (``dynamic=False``), each
captured in a CUDA graph (``torch_anchors.time_graph``).

Prints one JSON line: a row per chunk (``past`` = ``--past`` or half of ``--long`` rounded
down to a whole chunk) with ``eager_ms`` / ``compiled_ms`` (graph replays), the attention
path used and ``check`` (the chunk attention's largest difference from a float32 reference
on random inputs of the chunk's shape).

Usage: ``python benchmarks/torch_chunk.py --geo '{...}' --chunks 512,1024 --long 32768``."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def build(geo: dict, torch, dev, dt):
    """The weights on ``dev``, random."""
    g = torch.Generator(device=dev).manual_seed(0)
    h, i, v = geo["hidden_size"], geo["intermediate_size"], geo["vocab_size"]
    nh, nkv = geo["num_attention_heads"], geo["num_key_value_heads"]
    hd = geo.get("head_dim") or h // nh

    def w(*shape, scale=None):
        s = scale if scale is not None else shape[-1] ** -0.5
        return (torch.randn(*shape, device=dev, generator=g, dtype=dt) * s)

    layers = [dict(ln1=torch.ones(h, device=dev, dtype=dt), ln2=torch.ones(h, device=dev, dtype=dt),
                   wqkv=w((nh + 2 * nkv) * hd, h), wo=w(h, nh * hd), w13=w(2 * i, h), w2=w(h, i))
              for _ in range(geo["num_hidden_layers"])]
    return dict(layers=layers, embed=w(v, h, scale=1.0), norm=torch.ones(h, device=dev, dtype=dt),
                lm_head=w(v, h))


def caches(geo: dict, past: int, chunk: int, running: int, ctx: int, torch, dev, dt):
    """Per layer, the long row's K/V ``[past + chunk, nkv, hd]`` (FlashAttention's layout)
    and the decode rows' ``[running, ctx + 1, nkv, hd]``: the past random, the new slots
    written by the step."""
    nh, nkv = geo["num_attention_heads"], geo["num_key_value_heads"]
    hd = geo.get("head_dim") or geo["hidden_size"] // nh
    new = lambda *shape: torch.randn(*shape, device=dev, dtype=dt)  # noqa: E731
    return [dict(k=new(past + chunk, nkv, hd), v=new(past + chunk, nkv, hd),
                 dk=new(running, ctx + 1, nkv, hd), dv=new(running, ctx + 1, nkv, hd))
            for _ in range(geo["num_hidden_layers"])]


def flash_bottom_right(torch, q, k, v, scale):
    """q ``[T, nh, hd]``, k / v ``[S, nkv, hd]`` (S >= T) -> ``[T, nh, hd]``: causal with the
    last query on the last key (FlashAttention-2's alignment)."""
    out = torch.ops.aten._flash_attention_forward(
        q[None], k[None], v[None], None, None, q.shape[0], k.shape[0], 0.0, True, False,
        scale=scale)
    return out[0][0]


def sdpa_bottom_right(torch, q, k, v, scale):
    """The same through SDPA's ``causal_lower_right`` bias, K/V heads repeated."""
    from torch.nn.attention.bias import causal_lower_right

    g = q.shape[1] // k.shape[1]
    qt, kt, vt = (x.transpose(0, 1)[None] for x in (q, k.repeat_interleave(g, 1),
                                                     v.repeat_interleave(g, 1)))
    o = torch.nn.functional.scaled_dot_product_attention(
        qt, kt, vt, attn_mask=causal_lower_right(q.shape[0], k.shape[0]), scale=scale)
    return o[0].transpose(0, 1)


def make_step(geo: dict, params, caches, past: int, chunk: int, running: int, ctx: int,
              attend, torch, compiled: bool = False):
    """``step(ids [chunk + running]) -> tokens [1 + running]`` (the chunk's last row and
    the decode rows), K/V written in place; ``compiled``: the layer ``torch.compile``'d
    (one program, called per layer)."""
    from torch_anchors import _rms, _rope

    F = torch.nn.functional
    h, nh, nkv = geo["hidden_size"], geo["num_attention_heads"], geo["num_key_value_heads"]
    hd = geo.get("head_dim") or h // nh
    eps, theta = geo.get("rms_norm_eps", 1e-5), geo.get("rope_theta", 10000.0)
    dev = params["embed"].device
    inv = 1.0 / theta ** (torch.arange(0, hd, 2, device=dev).float() / hd)
    pos = torch.cat([torch.arange(past, past + chunk, device=dev),
                     torch.full((running,), ctx, device=dev)]).float()
    ang = torch.cat([pos[:, None] * inv[None]] * 2, -1)
    cos, sin = ang.cos().to(params["embed"].dtype), ang.sin().to(params["embed"].dtype)
    scale = hd ** -0.5

    def layer(x, p, c):
        t = x.shape[0]
        q, k, v = F.linear(_rms(x, p["ln1"], eps), p["wqkv"]).split([nh * hd, nkv * hd, nkv * hd], -1)
        q = _rope(q.view(1, t, nh, hd), cos, sin)[0]
        k = _rope(k.view(1, t, nkv, hd), cos, sin)[0]
        v = v.view(t, nkv, hd)
        c["k"][past:].copy_(k[:chunk])
        c["v"][past:].copy_(v[:chunk])
        c["dk"][:, ctx].copy_(k[chunk:])
        c["dv"][:, ctx].copy_(v[chunk:])
        long = attend(torch, q[:chunk], c["k"], c["v"], scale)
        dec = F.scaled_dot_product_attention(q[chunk:].view(running, nh, 1, hd),
                                             c["dk"].transpose(1, 2), c["dv"].transpose(1, 2),
                                             scale=scale, enable_gqa=True)
        o = torch.cat([long.reshape(chunk, nh * hd), dec.reshape(running, nh * hd)])
        x = x + F.linear(o, p["wo"])
        gate, up = F.linear(_rms(x, p["ln2"], eps), p["w13"]).chunk(2, -1)
        return x + F.linear(F.silu(gate) * up, p["w2"])

    run_layer = torch.compile(layer, dynamic=False) if compiled else layer

    def step(ids):
        x = params["embed"][ids]
        for p, c in zip(params["layers"], caches):
            x = run_layer(x, p, c)
        last = torch.cat([x[chunk - 1: chunk], x[chunk:]])     # the rows that sample
        return F.linear(_rms(last, params["norm"], eps), params["lm_head"]).argmax(-1)

    return step


def check_attention(torch, attend, geo, past: int, chunk: int, dev, dt) -> float:
    """Largest |attend - float32 reference| on random inputs of the chunk's shape."""
    nh, nkv = geo["num_attention_heads"], geo["num_key_value_heads"]
    hd = geo.get("head_dim") or geo["hidden_size"] // nh
    g = torch.Generator(device=dev).manual_seed(1)
    q = torch.randn(chunk, nh, hd, device=dev, generator=g, dtype=dt)
    k = torch.randn(past + chunk, nkv, hd, device=dev, generator=g, dtype=dt)
    v = torch.randn(past + chunk, nkv, hd, device=dev, generator=g, dtype=dt)
    got = attend(torch, q, k, v, hd ** -0.5).float()
    rep = nh // nkv
    kf, vf = k.float().repeat_interleave(rep, 1), v.float().repeat_interleave(rep, 1)
    ref = []
    for s in range(0, chunk, 128):          # bounded memory: 128 queries at a time
        sc = torch.einsum("thd,shd->hts", q[s:s + 128].float(), kf) * hd ** -0.5
        qpos = past + torch.arange(s, min(s + 128, chunk), device=dev)
        sc = sc.masked_fill(torch.arange(past + chunk, device=dev)[None, None] > qpos[None, :, None],
                            -math.inf)
        ref.append(torch.einsum("hts,shd->thd", sc.softmax(-1), vf))
    return float((got - torch.cat(ref)).abs().max())


def main(argv=None) -> int:
    import torch

    from torch_anchors import time_graph

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--geo", required=True, help="the target geometry (HF config keys), JSON")
    ap.add_argument("--chunks", default="512,1024,2048")
    ap.add_argument("--long", type=int, default=32768)
    ap.add_argument("--past", type=int, default=None)
    ap.add_argument("--running", type=int, default=8)
    ap.add_argument("--running-prompt", type=int, default=1024)
    ap.add_argument("--no-compile", action="store_true")
    a = ap.parse_args(argv)
    geo = json.loads(a.geo)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    rows = []
    params = build(geo, torch, dev, dt)
    for chunk in (int(c) for c in a.chunks.split(",")):
        past = a.past if a.past is not None else (a.long // 2) // chunk * chunk
        row = dict(kind="torch_chunk", chunk=chunk, past=past, running=a.running,
                   running_prompt=a.running_prompt, torch=torch.__version__,
                   device=torch.cuda.get_device_name() if dev.type == "cuda" else "cpu")
        attend = None
        for name, fn in (("flash_attention_forward", flash_bottom_right),
                         ("sdpa_causal_lower_right_repeat", sdpa_bottom_right)):
            try:
                err = check_attention(torch, fn, geo, past, chunk, dev, dt)
            except Exception as e:  # noqa: BLE001 - the next path
                row[f"{name}_error"] = str(e)[:200]
                continue
            attend, row["attention"], row["check"] = fn, name, err
            break
        if attend is None:
            rows.append(row)
            continue
        kv = caches(geo, past, chunk, a.running, a.running_prompt, torch, dev, dt)
        ids = torch.randint(0, geo["vocab_size"], (chunk + a.running,), device=dev)
        shape = (geo, params, kv, past, chunk, a.running, a.running_prompt, attend, torch)
        with torch.no_grad():
            step = make_step(*shape)
            row["eager_ms"] = time_graph(lambda: step(ids), reps=5, rounds=5, replays=5)["graph_ms"]
            if not a.no_compile:
                try:
                    cstep = make_step(*shape, compiled=True)
                    t = time_graph(lambda: cstep(ids), reps=5, rounds=5, replays=5)
                    row["compiled_ms"], row["compile_s"] = t["graph_ms"], t["compile_s"]
                except Exception as e:  # noqa: BLE001 - eager still recorded
                    row["compile_error"] = str(e)[:300]
        del kv
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        rows.append(row)
        print(f"# {row}", file=sys.stderr, flush=True)
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())

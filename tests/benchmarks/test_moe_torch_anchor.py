"""``benchmarks/moe.py``'s PyTorch decode anchor (``TorchMoE``, issue 54) against a float64
NumPy forward of the same weights written here from Qwen3-MoE's definition (no cache, one
token and one expert at a time): the anchor times the model it claims to. The forward's
test needs torch (not in the project's install) and is skipped without it."""

import suite_paths  # tests/support: where the suite's pieces are
import json
import sys

import numpy as np
import pytest

sys.path.insert(0, str(suite_paths.BENCHMARKS))

import moe  # noqa: E402


def _np(t):

    return t.detach().double().numpy()


def _rms(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _rope(x, pos, theta):
    """Rotate-half RoPE of ``x [N, heads, hd]`` at positions ``pos [N]``."""
    hd = x.shape[-1]
    ang = pos[:, None] * theta ** (-np.arange(0, hd, 2) / hd)[None]
    cos, sin = np.cos(ang)[:, None], np.sin(ang)[:, None]
    x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def reference_logits(m, tokens):
    """``[B, N, V]`` logits of the whole sequences ``tokens [B, N]``, causal."""
    g = m.geo
    nh, nkv, hd, eps = (g["num_attention_heads"], g["num_key_value_heads"], g["head_dim"],
                        g["rms_norm_eps"])
    out = []
    for seq in tokens:
        n = len(seq)
        pos = np.arange(n, dtype=np.float64)
        x = _np(m.embed)[seq]
        for lw in m.layers:
            w = {k: _np(v) for k, v in lw.items()}
            qkv = _rms(x, w["ln1"], eps) @ w["wqkv"].T
            q = qkv[:, : nh * hd].reshape(n, nh, hd)
            k = qkv[:, nh * hd: (nh + nkv) * hd].reshape(n, nkv, hd)
            v = qkv[:, (nh + nkv) * hd:].reshape(n, nkv, hd)
            q = _rope(_rms(q, w["qn"], eps), pos, g["rope_theta"])
            k = _rope(_rms(k, w["kn"], eps), pos, g["rope_theta"])
            o = np.zeros((n, nh, hd))
            for head in range(nh):
                kv = head // (nh // nkv)
                s = q[:, head] @ k[:, kv].T / np.sqrt(hd)
                s = np.where(np.tril(np.ones((n, n), bool)), s, -np.inf)
                p = np.exp(s - s.max(-1, keepdims=True))
                o[:, head] = (p / p.sum(-1, keepdims=True)) @ v[:, kv]
            x = x + o.reshape(n, nh * hd) @ w["wo"].T
            y = _rms(x, w["ln2"], eps)
            moe_out = np.zeros_like(x)
            for t in range(n):
                z = y[t] @ w["r"]
                p = np.exp(z - z.max())
                p /= p.sum()
                top = np.argsort(-p)[: g["num_experts_per_tok"]]
                wts = p[top] / p[top].sum()
                for e, wt in zip(top, wts):
                    gu = y[t] @ w["gu"][e]
                    gate, up = gu[0::2], gu[1::2]
                    moe_out[t] += wt * ((gate / (1 + np.exp(-gate)) * up) @ w["d"][e])
            x = x + moe_out
        out.append(_rms(x, _np(m.norm), eps) @ _np(m.lm_head).T)
    return np.stack(out)


def test_torch_decode_anchor_is_the_qwen3_moe_forward():
    torch = pytest.importorskip("torch")
    geo = moe.GEOMETRIES["tiny"]
    m = moe.TorchMoE(geo, device="cpu", dtype=torch.float32, compile=False)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, geo["vocab_size"], (2, 11))
    ref = reference_logits(m, tokens)
    c = 7                                   # a prefill of 7, then a verify-like step of 4
    m.bind(2, 16)
    t = torch.as_tensor(tokens)
    first = m.logits(t[:, :c], torch.arange(c))
    then = m.logits(t[:, c:], torch.arange(c, 11))
    got = np.concatenate([_np(first), _np(then)], 1)
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)
    # the anchor's rows (CPU: timed without a graph), one per (B, q)
    rows = moe.anchor_decode_rows(geo, [1, 2], (1, 4), context=8)
    assert [(r["batch"], r["q"]) for r in rows] == [(1, 1), (1, 4), (2, 1), (2, 4)]
    assert all(r["impl"] == "torch" and r["ms"] > 0 for r in rows)
    json.dumps(rows)


def test_the_table_puts_specjax_beside_the_anchor():
    rows = [dict(part="decode", method="plain", batch=1, per_iter_ms=5.0, floor_ms=2.0),
            dict(part="decode", method="eagle3", batch=1, per_iter_ms=9.0, floor_ms=4.0),
            dict(part="decode", impl="torch", batch=1, q=1, ms=4.0),
            dict(part="decode", impl="torch", batch=1, q=4, ms=6.0)]
    table = moe.torch_decode_table(rows, 3)
    assert "| 1 | 5.000 | 4.000 | 1.25 | 6.000 | 2.000 |" in table

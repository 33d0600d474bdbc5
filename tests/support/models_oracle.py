"""NumPy oracle for tests/models/test_models.py (no tests here).

Written from research/checkpoint_formats.md, independent of specjax.models: it reads the
canonical tensors (PyTorch layout ``[out, in]``, canonical key names) and runs one request
at a time over its full sequence with dense attention, in float64.
"""

from __future__ import annotations

import math

import numpy as np


def f64(t, key):
    return np.asarray(t[key], np.float64)


def rms(x, w, eps):
    return w * (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps))


def lin(t, name, x):
    y = x @ f64(t, name + ".weight").T
    if name + ".bias" in t:
        y = y + f64(t, name + ".bias")
    return y


def silu(x):
    return x / (1 + np.exp(-x))


def inv_freq(hd, theta, scaling):
    f = 1.0 / theta ** (np.arange(0, hd, 2) / hd)
    if not scaling or scaling.get("rope_type", "default") == "default":
        return f
    if scaling["rope_type"] == "linear":
        return f / scaling["factor"]
    # llama3: long wavelengths divided by factor, short kept, smooth ramp in between
    factor, lo, hi = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    out = []
    for fr in f:
        wl = 2 * math.pi / fr
        if wl < old / hi:
            out.append(fr)
        elif wl > old / lo:
            out.append(fr / factor)
        else:
            s = (old / wl - lo) / (hi - lo)
            out.append((1 - s) * fr / factor + s * fr)
    return np.array(out)


def rope(x, pos, freq):
    """x [S, n, hd] (rotate-half layout)."""
    ang = np.asarray(pos, np.float64)[:, None] * freq[None, :]
    cos = np.cos(np.concatenate([ang, ang], -1))[:, None, :]
    sin = np.sin(np.concatenate([ang, ang], -1))[:, None, :]
    h = x.shape[-1] // 2
    rot = np.concatenate([-x[..., h:], x[..., :h]], -1)
    return x * cos + rot * sin


def attention(q, k, v, mask):
    """q [S, nh, hd], k/v [Skv, nkv, hd], mask [S, Skv] bool -> [S, nh*hd]."""
    nh, nkv, hd = q.shape[1], k.shape[1], q.shape[2]
    g = nh // nkv
    out = np.zeros_like(q)
    for h in range(nh):
        s = q[:, h] @ k[:, h // g].T / math.sqrt(hd)
        s = np.where(mask, s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        out[:, h] = p @ v[:, h // g]
    return out.reshape(q.shape[0], nh * hd)


class Geo:
    """The geometry an oracle needs, from a plain dict (hf-style)."""

    def __init__(self, **kw):
        self.__dict__.update(kw)


def qkv(t, pre, x_q, x_kv, g, pos_q, pos_kv, qk_norm):
    q = lin(t, pre + "self_attn.q_proj", x_q).reshape(len(x_q), g.nh, g.hd)
    k = lin(t, pre + "self_attn.k_proj", x_kv).reshape(len(x_kv), g.nkv, g.hd)
    v = lin(t, pre + "self_attn.v_proj", x_kv).reshape(len(x_kv), g.nkv, g.hd)
    if qk_norm:
        q = rms(q, f64(t, pre + "self_attn.q_norm.weight"), g.eps)
        k = rms(k, f64(t, pre + "self_attn.k_norm.weight"), g.eps)
    freq = inv_freq(g.hd, g.theta, g.scaling)
    return rope(q, pos_q, freq), rope(k, pos_kv, freq), v


def mlp(t, pre, x):
    return lin(t, pre + "mlp.down_proj", silu(lin(t, pre + "mlp.gate_proj", x)) * lin(t, pre + "mlp.up_proj", x))


def layer(t, pre, h, g, causal_mask, *, input_norm=True, qk_norm=False):
    """Standard pre-norm decoder layer over a whole sequence."""
    x = rms(h, f64(t, pre + "input_layernorm.weight"), g.eps) if input_norm else h
    pos = np.arange(len(h))
    q, k, v = qkv(t, pre, x, x, g, pos, pos, qk_norm)
    h = h + lin(t, pre + "self_attn.o_proj", attention(q, k, v, causal_mask))
    return h + mlp(t, pre, rms(h, f64(t, pre + "post_attention_layernorm.weight"), g.eps))


def causal(n):
    return np.tril(np.ones((n, n), bool))


# -- models --------------------------------------------------------------------------------

def decoder(t, g, ids, n_layers, qk_norm, tied):
    """HF Llama/Qwen LM over one sequence at positions 0..S-1 -> (hidden, layer inputs, logits)."""
    h = f64(t, "model.embed_tokens.weight")[ids]
    inputs = []
    for i in range(n_layers):
        inputs.append(h)
        h = layer(t, f"model.layers.{i}.", h, g, causal(len(ids)), qk_norm=qk_norm)
    hidden = rms(h, f64(t, "model.norm.weight"), g.eps)
    head = f64(t, "model.embed_tokens.weight") if tied else f64(t, "lm_head.weight")
    return hidden, inputs, hidden @ head.T


def eagle(t, g, embed, lm_head, ids, hidden, n_layers):
    """EAGLE-1: z = fc(cat(embed, hidden)); layer 0 without input norm; no final norm."""
    z = lin(t, "fc", np.concatenate([embed[ids], hidden], -1))
    h = z
    for i in range(n_layers):
        h = layer(t, f"layers.{i}.", h, g, causal(len(ids)), input_norm=i > 0)
    return h, h @ lm_head.T


def mtp(t, g, embed, lm_head, ids, pos, hidden, n_layers=1):
    """MiMo MTP (research/vllm_delta_0.33.md 1.3): e = embed(t), zero at position 0;
    x = input_proj(cat(hidden_layernorm(h), token_layernorm(e))) (hidden first); a Qwen2
    block (input norm, q/k/v bias); o = final_layernorm(s); logits = lm_head(o). ``pos``:
    the rows' positions, 0..S-1 here (the sequence starts at 0)."""
    e = embed[ids] * (np.asarray(pos) != 0)[:, None]
    x = lin(t, "input_proj", np.concatenate([rms(hidden, f64(t, "hidden_layernorm.weight"), g.eps),
                                             rms(e, f64(t, "token_layernorm.weight"), g.eps)], -1))
    for i in range(n_layers):
        x = layer(t, f"layers.{i}.", x, g, causal(len(ids)))
    o = rms(x, f64(t, "final_layernorm.weight"), g.eps)
    return o, o @ lm_head.T


def eagle3(t, g, embed, ids, aux, n_layers, norm_before_residual, qk_norm=False, *,
           norm_before_fc=False, fc_norm=False, n_aux=3):
    """EAGLE-3 over one sequence; aux [S, n_aux*Ht] -> (normed, prenorm, draft logits).
    vLLM v0.33's pre-fc norms (research/vllm_delta_0.33.md 2.3): ``input_norm`` over the
    whole concatenation, then ``fc_norm.{i}`` on each Ht-wide chunk."""
    if norm_before_fc:
        aux = rms(aux, f64(t, "input_norm.weight"), g.eps)
    if fc_norm:
        aux = np.concatenate([rms(c, f64(t, f"fc_norm.{i}.weight"), g.eps)
                              for i, c in enumerate(np.split(aux, n_aux, axis=-1))], -1)
    gg = lin(t, "fc", aux)
    e = rms(embed[ids], f64(t, "layers.0.input_layernorm.weight"), g.eps)
    hn = rms(gg, f64(t, "layers.0.hidden_norm.weight"), g.eps)
    resid = hn if norm_before_residual else gg
    x = np.concatenate([e, hn], -1)
    pos = np.arange(len(ids))
    q, k, v = qkv(t, "layers.0.", x, x, g, pos, pos, qk_norm)
    h = resid + lin(t, "layers.0.self_attn.o_proj", attention(q, k, v, causal(len(ids))))
    h = h + mlp(t, "layers.0.", rms(h, f64(t, "layers.0.post_attention_layernorm.weight"), g.eps))
    for i in range(1, n_layers):
        h = layer(t, f"layers.{i}.", h, g, causal(len(ids)), qk_norm=qk_norm)
    normed = rms(h, f64(t, "norm.weight"), g.eps)
    return normed, h, normed @ f64(t, "lm_head.weight").T


def dflash(t, g, embed, lm_head, aux_ctx, block_ids, p0, n_layers):
    """z-lab DFlash: ctx = hidden_norm(fc(aux)) at positions 0..C-1; block at p0..p0+B-1,
    non-causal over cat(ctx, block). Returns (normed block [B, H], logits of slots 1..)."""
    ctx = rms(lin(t, "fc", aux_ctx), f64(t, "hidden_norm.weight"), g.eps)
    c, b = len(ctx), len(block_ids)
    x = embed[block_ids]
    pos_q = p0 + np.arange(b)
    pos_kv = np.concatenate([np.arange(c), pos_q])
    for i in range(n_layers):
        pre = f"layers.{i}."
        u = rms(x, f64(t, pre + "input_layernorm.weight"), g.eps)
        q, k, v = qkv(t, pre, u, np.concatenate([ctx, u]), g, pos_q, pos_kv, True)
        x = x + lin(t, pre + "self_attn.o_proj", attention(q, k, v, np.ones((b, c + b), bool)))
        x = x + mlp(t, pre, rms(x, f64(t, pre + "post_attention_layernorm.weight"), g.eps))
    out = rms(x, f64(t, "norm.weight"), g.eps)
    return out, out[1:] @ lm_head.T


def medusa(t, hidden, num_heads, num_layers, shared_head, token_map=None, vocab=None):
    """Per head: z += silu(W z + b) per layer; logits = W_lm z (token_map -> -inf scatter)."""
    outs = []
    for k in range(num_heads):
        z = hidden.copy()
        for l in range(num_layers):
            z = z + silu(lin(t, f"blocks.{k}.layers.{l}", z))
        w = f64(t, "lm_head.weight" if shared_head else f"lm_heads.{k}.weight")
        lg = z @ w.T
        if token_map is not None:
            full = np.full((len(z), vocab), -np.inf)
            full[:, token_map] = lg
            lg = full
        outs.append(lg)
    return np.stack(outs)

"""A target written from scratch against ``specjax.Target`` (nothing from ``specjax.models``):
GPT-2 style (LayerNorm, learned positions, GELU MLP, multi-head attention, untied lm_head,
biases), random weights from a seed, with its own KV layout (ONE array per model,
``[num_layers, 2, num_blocks * block_size, heads, head_dim]``) and its own ``jax.numpy``
attention reading the context through the block table. ``full_recompute_greedy`` is an
independent NumPy reference (float64, the whole sequence each step, no cache)."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

VOCAB, HIDDEN, LAYERS, HEADS, MAX_POS = 97, 64, 2, 4, 256


def init_params(seed: int = 0, *, vocab: int = VOCAB, hidden: int = HIDDEN,
                layers: int = LAYERS, max_pos: int = MAX_POS, scale: float = 1.0) -> dict:
    """GPT-2 weights, N(0, 0.2^2) (the head scaled by ``scale``), LayerNorm gains near 1."""
    rng = np.random.default_rng(seed)
    w = lambda *shape, s=0.2: jnp.asarray(rng.normal(0.0, s, shape), jnp.float32)  # noqa: E731
    ln = lambda: {"g": jnp.asarray(1.0 + rng.normal(0, 0.1, hidden), jnp.float32),  # noqa: E731
                  "b": w(hidden, s=0.1)}
    return {
        "wte": w(vocab, hidden, s=1.0), "wpe": w(max_pos, hidden, s=0.3),
        "blocks": [{"ln_1": ln(), "attn_w": w(hidden, 3 * hidden), "attn_b": w(3 * hidden, s=0.05),
                    "proj_w": w(hidden, hidden), "proj_b": w(hidden, s=0.05), "ln_2": ln(),
                    "fc_w": w(hidden, 4 * hidden), "fc_b": w(4 * hidden, s=0.05),
                    "out_w": w(4 * hidden, hidden, s=0.1), "out_b": w(hidden, s=0.05)}
                   for _ in range(layers)],
        "ln_f": ln(), "lm_head": w(hidden, vocab, s=0.5 * scale),
    }


def _ln(x, p, eps=1e-5):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / jnp.sqrt(var + eps) * p["g"] + p["b"]


def _gelu(x):
    return 0.5 * x * (1.0 + jnp.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


@dataclasses.dataclass(frozen=True)
class ForeignGPT:
    """The protocol's members and nothing else specjax could read (no ``config``).
    ``block_size`` is the one this target is built for (its flat KV layout needs it)."""

    vocab_size: int = VOCAB
    hidden_size: int = HIDDEN
    num_layers: int = LAYERS
    aux_layer_ids: tuple[int, ...] = ()
    recurrent: bool = False
    num_heads: int = HEADS
    block_size: int = 8

    def with_aux_layers(self, ids):
        return dataclasses.replace(self, aux_layer_ids=tuple(int(i) for i in ids))

    def init_kv_caches(self, num_blocks, block_size, dtype):
        assert block_size == self.block_size, (block_size, self.block_size)
        hd = self.hidden_size // self.num_heads
        return jnp.zeros((self.num_layers, 2, num_blocks * block_size, self.num_heads, hd), dtype)

    def kv_bytes_per_block(self, block_size, dtype):
        return 2 * self.num_layers * block_size * self.hidden_size * jnp.dtype(dtype).itemsize

    def shared_weights(self, params):
        return {"embed_tokens": {"embedding": params["wte"]}, "lm_head": {"kernel": params["lm_head"]}}

    def compute_logits(self, params, hidden):
        return (hidden @ params["lm_head"]).astype(jnp.float32)

    def forward(self, params, input_ids, positions, kv, attn):
        if attn.tree_mask is not None:
            raise NotImplementedError("ForeignGPT attends causally only (no tree mask)")
        t_pad = input_ids.shape[0]
        nh, hd = self.num_heads, self.hidden_size // self.num_heads
        bs, size = self.block_size, kv.shape[2]
        qsl, bt = attn.query_start_loc, attn.block_table
        b_pad = qsl.shape[0] - 1
        req = jnp.clip(jnp.searchsorted(qsl, jnp.arange(t_pad), side="right") - 1, 0, b_pad - 1)
        ctx = jnp.arange(bt.shape[1] * bs)
        key_slots = (bt[:, ctx // bs] * bs + ctx % bs)[req]                      # [T, C]
        seen = (ctx[None, :] < attn.seq_lens[req][:, None]) & (ctx[None, :] <= positions[:, None])
        write = jnp.where(attn.slot_mapping < 0, size, attn.slot_mapping)       # -1: dropped
        h = params["wte"][input_ids] + params["wpe"][positions]
        aux = []
        for i, blk in enumerate(params["blocks"]):
            if i in self.aux_layer_ids:
                aux.append(h)
            x = _ln(h, blk["ln_1"])
            q, k, v = jnp.split(x @ blk["attn_w"] + blk["attn_b"], 3, axis=-1)
            q, k, v = (a.reshape(t_pad, nh, hd) for a in (q, k, v))
            kv = kv.at[i, 0, write].set(k.astype(kv.dtype), mode="drop")
            kv = kv.at[i, 1, write].set(v.astype(kv.dtype), mode="drop")
            keys, vals = kv[i, 0][key_slots], kv[i, 1][key_slots]               # [T, C, nh, hd]
            s = jnp.einsum("thd,tchd->thc", q, keys.astype(q.dtype)) / math.sqrt(hd)
            s = jnp.where(seen[:, None, :], s, -1e30)
            o = jnp.einsum("thc,tchd->thd", jax.nn.softmax(s, axis=-1), vals.astype(q.dtype))
            h = h + o.reshape(t_pad, -1) @ blk["proj_w"] + blk["proj_b"]
            x = _ln(h, blk["ln_2"])
            h = h + _gelu(x @ blk["fc_w"] + blk["fc_b"]) @ blk["out_w"] + blk["out_b"]
        return _ln(h, params["ln_f"]), (jnp.stack(aux, axis=1) if aux else None), kv


# --- the independent reference ---------------------------------------------------------


def _np_ln(x, p, eps=1e-5):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * np.asarray(p["g"], np.float64) + np.asarray(p["b"], np.float64)


def _np_logits(params, tokens, num_heads):
    """GPT-2 over the whole sequence in float64 NumPy, a causal mask, no cache: [S, V]."""
    f = lambda a: np.asarray(a, np.float64)  # noqa: E731
    s = len(tokens)
    h = f(params["wte"])[tokens] + f(params["wpe"])[:s]
    mask = np.tril(np.ones((s, s), bool))
    for blk in params["blocks"]:
        x = _np_ln(h, blk["ln_1"])
        qkv = x @ f(blk["attn_w"]) + f(blk["attn_b"])
        heads = []
        for q, k, v in zip(*(np.split(m, num_heads, axis=-1) for m in np.split(qkv, 3, axis=-1))):
            sc = q @ k.T / math.sqrt(q.shape[-1])
            sc = np.where(mask, sc, -np.inf)
            p = np.exp(sc - sc.max(-1, keepdims=True))
            heads.append((p / p.sum(-1, keepdims=True)) @ v)
        h = h + np.concatenate(heads, -1) @ f(blk["proj_w"]) + f(blk["proj_b"])
        x = _np_ln(h, blk["ln_2"])
        u = x @ f(blk["fc_w"]) + f(blk["fc_b"])
        u = 0.5 * u * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (u + 0.044715 * u ** 3)))
        h = h + u @ f(blk["out_w"]) + f(blk["out_b"])
    return _np_ln(h, params["ln_f"]) @ f(params["lm_head"])


def full_recompute_greedy(params, prompt, n: int, *, num_heads: int = HEADS) -> list[int]:
    """``n`` greedy tokens after ``prompt``, the whole sequence recomputed for each."""
    seq = [int(t) for t in prompt]
    for _ in range(n):
        seq.append(int(np.argmax(_np_logits(params, seq, num_heads)[-1])))
    return seq[len(prompt):]


def greedy_margin(params, prompt, out, *, num_heads: int = HEADS) -> float:
    """The smallest gap between the top two logits along ``prompt + out`` (ties: flaky)."""
    seq = [int(t) for t in prompt] + list(out)
    lg = np.sort(_np_logits(params, seq, num_heads)[len(prompt) - 1:-1], axis=-1)
    return float((lg[:, -1] - lg[:, -2]).min())

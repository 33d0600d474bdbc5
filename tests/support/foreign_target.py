"""A target written from scratch against ``specjax.Target`` (nothing from ``specjax.models``):
GPT-2 style (LayerNorm, learned positions, GELU MLP, multi-head attention, untied lm_head,
biases), random weights from a seed, with its own KV layout (ONE array per model,
``[num_layers, 2, num_blocks * block_size, heads, head_dim]``) and its own ``jax.numpy``
attention reading the context through the block table (causal, or ``attn.tree_mask`` on a
tree batch). ``MovableForeignGPT`` adds the optional ``move_kv`` (tree verification);
``ForeignGPT`` has none. ``shard`` places the params for tensor parallelism over heads and a
``ForeignGPT(mesh=...)`` makes its KV cache split the same way.

The independent NumPy references (float64, the whole sequence each time, no cache):
``full_recompute_logits`` / ``full_recompute_greedy`` / ``full_recompute_aux`` (the residual
stream before given layers, EAGLE-3's input)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

VOCAB, HIDDEN, LAYERS, HEADS, MAX_POS = 97, 64, 2, 4, 256


def init_params(seed: int = 0, *, vocab: int = VOCAB, hidden: int = HIDDEN,
                layers: int = LAYERS, max_pos: int = MAX_POS, scale: float = 1.0) -> dict:
    """GPT-2 weights, N(0, 0.2^2) (the head scaled by ``scale``), LayerNorm gains near 1.
    ``attn_w [H, 3, H]`` / ``attn_b [3, H]``: GPT-2's ``c_attn`` with q / k / v on their own
    axis (so that the head columns of each can be split over devices)."""
    rng = np.random.default_rng(seed)
    w = lambda *shape, s=0.2: jnp.asarray(rng.normal(0.0, s, shape), jnp.float32)  # noqa: E731
    ln = lambda: {"g": jnp.asarray(1.0 + rng.normal(0, 0.1, hidden), jnp.float32),  # noqa: E731
                  "b": w(hidden, s=0.1)}
    return {
        "wte": w(vocab, hidden, s=1.0), "wpe": w(max_pos, hidden, s=0.3),
        "blocks": [{"ln_1": ln(), "attn_w": w(hidden, 3 * hidden).reshape(hidden, 3, hidden),
                    "attn_b": w(3 * hidden, s=0.05).reshape(3, hidden),
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
    """The protocol's members and nothing else specjax could read (no ``config``, no
    ``move_kv``: tree verification is refused for it). ``block_size`` is the one this target
    is built for (its flat KV layout needs it); ``mesh`` / ``tp_axis``: ``init_kv_caches``
    places the cache split by heads over that axis (the params: :func:`shard`)."""

    vocab_size: int = VOCAB
    hidden_size: int = HIDDEN
    num_layers: int = LAYERS
    aux_layer_ids: tuple[int, ...] = ()
    recurrent: bool = False
    num_heads: int = HEADS
    block_size: int = 8
    mesh: Any = None
    tp_axis: str = "tp"

    def with_aux_layers(self, ids):
        return dataclasses.replace(self, aux_layer_ids=tuple(int(i) for i in ids))

    def init_kv_caches(self, num_blocks, block_size, dtype):
        assert block_size == self.block_size, (block_size, self.block_size)
        hd = self.hidden_size // self.num_heads
        kv = jnp.zeros((self.num_layers, 2, num_blocks * block_size, self.num_heads, hd), dtype)
        if self.mesh is not None:
            kv = jax.device_put(kv, NamedSharding(self.mesh, kv_spec(self.tp_axis)))
        return kv

    def kv_bytes_per_block(self, block_size, dtype):
        return 2 * self.num_layers * block_size * self.hidden_size * jnp.dtype(dtype).itemsize

    def shared_weights(self, params):
        return {"embed_tokens": {"embedding": params["wte"]},
                "lm_head": {"kernel": params["lm_head"]}}

    def compute_logits(self, params, hidden):
        return (hidden @ params["lm_head"]).astype(jnp.float32)

    def _visible(self, attn, positions, t_pad):
        """``(key_slots [T, C], seen [T, C])``: the flat KV slot of each context index of
        each token's request, and whether the token attends to it."""
        bs, qsl, bt, seq = self.block_size, attn.query_start_loc, attn.block_table, attn.seq_lens
        b_pad = qsl.shape[0] - 1
        t = jnp.arange(t_pad)
        req = jnp.clip(jnp.searchsorted(qsl, t, side="right") - 1, 0, b_pad - 1)
        ctx = jnp.arange(bt.shape[1] * bs)
        key_slots = (bt[:, ctx // bs] * bs + ctx % bs)[req]                    # [T, C]
        in_ctx = ctx[None, :] < seq[req][:, None]
        if attn.tree_mask is None:                # causal: every key up to my position
            return key_slots, in_ctx & (ctx[None, :] <= positions[:, None])
        # a tree batch: each request's query block [root, nodes...] sits at context indices
        # seq_len - query_len ...; a token sees all the context before its block and, inside
        # it, the block tokens its tree_mask row allows (its ancestors and itself)
        allow = np.asarray(attn.tree_mask, bool)                              # static [Q, Q]
        q = allow.shape[0]
        allow = jnp.asarray(np.pad(allow, ((0, 0), (0, 1))))                  # column q: False
        block_start = (seq - (qsl[1:] - qsl[:-1]))[req]                        # [T]
        mine = jnp.clip(t - qsl[req], 0, q - 1)                                # row in the block
        col = ctx[None, :] - block_start[:, None]                              # [T, C]
        inside = allow[mine[:, None], jnp.where((col >= 0) & (col < q), col, q)]
        return key_slots, in_ctx & ((col < 0) | inside)

    def forward(self, params, input_ids, positions, kv, attn):
        t_pad = input_ids.shape[0]
        nh, hd = self.num_heads, self.hidden_size // self.num_heads
        size = kv.shape[2]
        key_slots, seen = self._visible(attn, positions, t_pad)
        write = jnp.where(attn.slot_mapping < 0, size, attn.slot_mapping)       # -1: dropped
        h = params["wte"][input_ids] + params["wpe"][positions]
        aux = []
        for i, blk in enumerate(params["blocks"]):
            if i in self.aux_layer_ids:
                aux.append(h)
            x = _ln(h, blk["ln_1"])
            qkv = jnp.einsum("th,hcd->ctd", x, blk["attn_w"]) + blk["attn_b"][:, None, :]
            q, k, v = (qkv[j].reshape(t_pad, nh, hd) for j in range(3))
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


@dataclasses.dataclass(frozen=True)
class MovableForeignGPT(ForeignGPT):
    """``ForeignGPT`` with the optional ``move_kv``: tree verification runs on it."""

    def move_kv(self, kv, src_slots, dst_slots):
        """Copy the K and V of flat slot ``src_slots[i]`` to ``dst_slots[i]`` in every layer
        (-1 on either side: nothing); every source is read before anything is written."""
        size = kv.shape[2]
        moved = kv[:, :, jnp.clip(src_slots, 0, size - 1)]                     # [L, 2, N, ...]
        dst = jnp.where((src_slots < 0) | (dst_slots < 0), size, dst_slots)    # size: dropped
        return kv.at[:, :, dst].set(moved, mode="drop")


# --- tensor parallelism over heads -----------------------------------------------------


def kv_spec(axis: str = "tp") -> P:
    """The KV cache ``[L, 2, slots, heads, hd]`` split by heads."""
    return P(None, None, None, axis, None)


def param_specs(params: dict, axis: str = "tp") -> dict:
    """Megatron-style specs: q / k / v columns and the MLP's up projection split by heads /
    columns (column-parallel), ``proj_w`` / ``out_w`` rows (row-parallel: an all-reduce);
    embeddings, norms, biases after the reductions and the lm_head replicated."""
    col = {"attn_w": P(None, None, axis), "attn_b": P(None, axis), "fc_w": P(None, axis),
           "fc_b": P(axis), "proj_w": P(axis, None), "out_w": P(axis, None)}
    rep = lambda tree: jax.tree.map(lambda _: P(), tree)  # noqa: E731
    return {k: ([{n: col.get(n, P()) if not isinstance(v, dict) else rep(v)
                  for n, v in blk.items()} for blk in params["blocks"]]
                if k == "blocks" else rep(v)) for k, v in params.items()}


def shard(params: dict, mesh, axis: str = "tp") -> dict:
    """``params`` placed on ``mesh`` by :func:`param_specs` (heads over ``axis``)."""
    specs = param_specs(params, axis)
    return jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), params, specs,
                        is_leaf=lambda x: isinstance(x, P))


# --- the independent reference ---------------------------------------------------------


def _np_ln(x, p, eps=1e-5):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    g, b = np.asarray(p["g"], np.float64), np.asarray(p["b"], np.float64)
    return (x - mu) / np.sqrt(var + eps) * g + b


def _np_forward(params, tokens, num_heads):
    """GPT-2 over the whole sequence in float64 NumPy, a causal mask, no cache: the residual
    stream before each layer ``[L, S, H]`` and the logits ``[S, V]``."""
    f = lambda a: np.asarray(a, np.float64)  # noqa: E731
    s = len(tokens)
    h = f(params["wte"])[np.asarray(tokens, np.int64)] + f(params["wpe"])[:s]
    mask = np.tril(np.ones((s, s), bool))
    streams = []
    for blk in params["blocks"]:
        streams.append(h)
        x = _np_ln(h, blk["ln_1"])
        hid = h.shape[-1]
        qkv = x @ f(blk["attn_w"]).reshape(hid, 3 * hid) + f(blk["attn_b"]).reshape(3 * hid)
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
    return np.stack(streams), _np_ln(h, params["ln_f"]) @ f(params["lm_head"])


def full_recompute_logits(params, tokens, *, num_heads: int = HEADS) -> np.ndarray:
    """``[S, V]`` float64: the next-token logits after each prefix of ``tokens``."""
    return _np_forward(params, tokens, num_heads)[1]


def full_recompute_aux(params, tokens, layer_ids, *, num_heads: int = HEADS) -> np.ndarray:
    """``[S, len(layer_ids), H]`` float64: the residual stream entering each of
    ``layer_ids`` at every position of ``tokens`` (what ``forward`` returns as ``aux``)."""
    streams = _np_forward(params, tokens, num_heads)[0]
    return np.stack([streams[i] for i in layer_ids], axis=1)


def full_recompute_greedy(params, prompt, n: int, *, num_heads: int = HEADS) -> list[int]:
    """``n`` greedy tokens after ``prompt``, the whole sequence recomputed for each."""
    seq = [int(t) for t in prompt]
    for _ in range(n):
        seq.append(int(np.argmax(full_recompute_logits(params, seq, num_heads=num_heads)[-1])))
    return seq[len(prompt):]


def greedy_margin(params, prompt, out, *, num_heads: int = HEADS) -> float:
    """The smallest gap between the top two logits along ``prompt + out`` (ties: flaky)."""
    seq = [int(t) for t in prompt] + list(out)
    lg = np.sort(full_recompute_logits(params, seq, num_heads=num_heads)[len(prompt) - 1:-1],
                 axis=-1)
    return float((lg[:, -1] - lg[:, -2]).min())

"""Training-time forward passes: dense, batched ``[B, T]``, with explicit attention masks.

The inference models' math on the same params dicts, over whole teacher-forced sequences,
with the attention patterns of training-time test (EAGLE-3 / HASS) and DFlash blocks: a
dense attention over key groups, each with its own boolean mask. Shapes: ``ids`` /
``positions [B, T] int32``, hidden states ``[B, T, H]``.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax.models import params as mp, rope
from specjax.models.config import ModelConfig
from specjax.models.layers import rms_norm

Array = jax.Array


# ------------------------------------------------------------------------------ pieces


def linear(p: dict, x: Array) -> Array:
    y = jnp.einsum("...i,io->...o", x, p["kernel"].astype(x.dtype))
    if "bias" in p:
        y = y + p["bias"].astype(y.dtype)
    return y


def norm(p: dict, x: Array, eps: float) -> Array:
    return rms_norm(x, p["weight"], eps)


def mlp(p: dict, x: Array) -> Array:
    return linear(p["down_proj"], jax.nn.silu(linear(p["gate_proj"], x)) * linear(p["up_proj"], x))


def rope_tables(cfg: ModelConfig, positions: Array) -> tuple[Array, Array]:
    """``positions [B, T]`` -> cos, sin ``[B, T, head_dim]`` (float32); each row one
    sequence (the request boundaries of ``rope.cos_sin_for``'s longrope / dynamic rule)."""
    b, t = positions.shape
    cos, sin = rope.cos_sin_for(cfg, positions.reshape(-1), jnp.arange(b + 1, dtype=jnp.int32) * t)
    return cos.reshape(b, t, -1), sin.reshape(b, t, -1)


def _rope(x: Array, cos: Array, sin: Array) -> Array:
    """``x [B, T, n, hd]``, ``cos/sin [B, T, hd]``."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, :, None, :].astype(x.dtype) + rotated * sin[:, :, None, :].astype(x.dtype)


def project_q(p: dict, cfg: ModelConfig, x: Array, cos: Array, sin: Array) -> Array:
    b, t = x.shape[:2]
    q = linear(p["q_proj"], x).reshape(b, t, cfg.num_attention_heads, cfg.head_dim)
    if "q_norm" in p:
        q = norm(p["q_norm"], q, cfg.rms_norm_eps)
    return _rope(q, cos, sin)


def project_kv(p: dict, cfg: ModelConfig, x: Array, cos: Array, sin: Array) -> tuple[Array, Array]:
    b, t = x.shape[:2]
    k = linear(p["k_proj"], x).reshape(b, t, cfg.num_key_value_heads, cfg.head_dim)
    v = linear(p["v_proj"], x).reshape(b, t, cfg.num_key_value_heads, cfg.head_dim)
    if "k_norm" in p:
        k = norm(p["k_norm"], k, cfg.rms_norm_eps)
    return _rope(k, cos, sin), v


def attention(q: Array, groups: Sequence[tuple[Array, Array, Array]], scale: float) -> Array:
    """Softmax attention of ``q [B, Tq, nh, hd]`` over key groups ``(k, v, mask)``: ``k``/``v
    [B, S_i, nkv, hd]``, ``mask`` broadcastable to ``[B, Tq, S_i]`` (True = visible). The
    softmax runs over all groups together, in float32. A query that sees no key gets zeros."""
    b, tq, nh, hd = q.shape
    nkv = groups[0][0].shape[2]
    qg = q.reshape(b, tq, nkv, nh // nkv, hd)
    scores, values = [], []
    for k, v, mask in groups:
        s = jnp.einsum("bqkgd,bskd->bkgqs", qg, k, preferred_element_type=jnp.float32) * scale
        m = jnp.broadcast_to(mask, (b, tq, k.shape[1]))[:, None, None]
        scores.append(jnp.where(m, s, -jnp.inf))
        values.append(v)
    s = jnp.concatenate(scores, axis=-1)
    mx = jnp.max(s, axis=-1, keepdims=True)
    mx = jnp.where(jnp.isfinite(mx), mx, 0.0)
    e = jnp.exp(s - mx)
    p = e / jnp.maximum(jnp.sum(e, axis=-1, keepdims=True), 1e-30)
    v = jnp.concatenate(values, axis=1)
    o = jnp.einsum("bkgqs,bskd->bqkgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return o.reshape(b, tq, nh, hd).astype(q.dtype)


def causal_mask(t: int) -> np.ndarray:
    return np.tril(np.ones((t, t), bool))[None]


def attn_out(p: dict, cfg: ModelConfig, o: Array) -> Array:
    b, t = o.shape[:2]
    return linear(p["o_proj"], o.reshape(b, t, cfg.num_attention_heads * cfg.head_dim))


def decoder_layer(p: dict, cfg: ModelConfig, h: Array, cos, sin, mask, *,
                  input_norm: bool = True) -> Array:
    """One pre-norm decoder layer over a whole sequence with ``mask [B|1, T, T]``."""
    x = norm(p["input_layernorm"], h, cfg.rms_norm_eps) if input_norm else h
    a = p["self_attn"]
    k, v = project_kv(a, cfg, x, cos, sin)
    o = attention(project_q(a, cfg, x, cos, sin), [(k, v, mask)], cfg.head_dim ** -0.5)
    h = h + attn_out(a, cfg, o)
    return h + mlp(p["mlp"], norm(p["post_attention_layernorm"], h, cfg.rms_norm_eps))


def layers_of(params: dict) -> list[dict]:
    layers = mp.normalize_keys(params)["layers"]
    return [layers[i] for i in range(len(layers))]


def cast(params, dtype):
    """Float leaves to ``dtype`` (integer maps untouched)."""
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x,
                        params)


#: Vocabularies up to this size embed through a one-hot matmul in training (see embed_rows).
ONE_HOT_MAX_VOCAB = 4096


def embed_rows(table: Array, ids: Array) -> Array:
    """``table[ids]``, as ``one_hot(ids) @ table`` for vocabularies up to
    ``ONE_HOT_MAX_VOCAB``: the same values, but a matmul gradient instead of a scatter-add
    that serializes on the most frequent rows."""
    if table.shape[0] <= ONE_HOT_MAX_VOCAB:
        return jnp.einsum("...v,vh->...h", jax.nn.one_hot(ids, table.shape[0], dtype=table.dtype), table)
    return jnp.take(table, ids, axis=0)


def positions_like(ids: Array) -> Array:
    return jnp.broadcast_to(jnp.arange(ids.shape[1], dtype=jnp.int32), ids.shape)


# ------------------------------------------------------------------------------ decoder LM


def decoder_forward(params: dict, cfg: ModelConfig, ids: Array,
                    aux_layer_ids: Sequence[int] = ()) -> tuple[Array, Array | None]:
    """Causal decoder LM over ``ids [B, T]`` (positions ``0..T-1``) -> ``(hidden [B, T, H]``
    post-norm, ``aux [B, T, n_aux, H]`` (input of each listed layer) or None)."""
    pos = positions_like(ids)
    cos, sin = rope_tables(cfg, pos)
    h = embed_rows(mp.embed_table(params), ids)
    mask = causal_mask(ids.shape[1])
    aux = []
    for i, lp in enumerate(layers_of(params)):
        if i in aux_layer_ids:
            aux.append(h)
        h = decoder_layer(lp, cfg, h, cos, sin, mask)
    hidden = norm(params["norm"], h, cfg.rms_norm_eps)
    return hidden, (jnp.stack(aux, axis=2) if aux else None)


def decoder_logits(params: dict, hidden: Array) -> Array:
    head = params.get("lm_head") or {"embedding": mp.embed_table(params)}
    return mp.lm_head_logits(head, hidden)


# ------------------------------------------------------------------------------ EAGLE TTT


def ttt_masks(t: int, depth: int) -> list[np.ndarray]:
    """Key-group masks (each ``[1, T, T]`` bool) of unroll step ``depth`` at position ``t``:
    group 0 sees depth-0 keys at ``s <= t - depth``; group ``e`` (1..depth) the depth-``e``
    key at ``s = t - depth + e`` only."""
    q = np.arange(t)[:, None]
    s = np.arange(t)[None, :]
    out = [(s <= q - depth)[None]]
    for e in range(1, depth + 1):
        out.append((s == q - depth + e)[None])
    return out


def shift_right(x: Array) -> Array:
    """``x[:, t] <- x[:, t-1]`` (position 0 gets zeros): step d's hidden input at t is step
    d-1's output at t-1."""
    return jnp.concatenate([jnp.zeros_like(x[:, :1]), x[:, :-1]], axis=1)


def eagle_ttt(kind: str, params: dict, cfg: ModelConfig, ids: Array, features: Array,
              depth: int) -> list[tuple[Array, Array]]:
    """Training-time test unroll of an EAGLE-1 (``kind="eagle"``) or EAGLE-3 head.

    ``ids [B, T]``: position ``t`` holds ``x_{t+1}``; ``features``: target post-norm hidden
    ``[B, T, H]`` (EAGLE-1) or aux states ``[B, T, n_aux * Ht]`` (EAGLE-3). Step ``d`` takes
    step ``d-1``'s hidden one position back and attends as a draft chain does
    (:func:`ttt_masks`). Returns per step ``(logits_hidden [B, T, H], prenorm [B, T, H])``.
    """
    if kind not in ("eagle", "eagle3"):
        raise ValueError(f"kind must be 'eagle' or 'eagle3', got {kind!r}")
    b, t = ids.shape
    pos = positions_like(ids)
    cos, sin = rope_tables(cfg, pos)
    e = jnp.take(mp.embed_table(params), ids, axis=0)
    layers = layers_of(params)
    eps = cfg.rms_norm_eps
    scale = cfg.head_dim ** -0.5
    if kind == "eagle":
        hid = features.astype(e.dtype)
    else:
        x = features.astype(e.dtype)
        if cfg.norm_before_fc:
            x = norm(params["input_norm"], x, eps)
        if cfg.fc_norm:
            x = jnp.concatenate([norm(params["fc_norm"][i], p, eps) for i, p in
                                 enumerate(jnp.split(x, cfg.num_aux, axis=-1))], axis=-1)
        hid = linear(params["fc"], x)
    # per layer: K/V of every earlier step (group list grows with depth)
    kv_groups: list[list[tuple[Array, Array]]] = [[] for _ in layers]
    outs = []
    for d in range(depth):
        masks = ttt_masks(t, d)
        if kind == "eagle":
            h = linear(params["fc"], jnp.concatenate([e, hid], axis=-1))
            x0, res0 = h, h
        else:
            x0 = jnp.concatenate([norm(layers[0]["input_layernorm"], e, eps),
                                  norm(layers[0]["hidden_norm"], hid, eps)], axis=-1)
            res0 = norm(layers[0]["hidden_norm"], hid, eps) if cfg.norm_before_residual else hid
        h = res0
        for i, lp in enumerate(layers):
            if i == 0:
                x = x0
            else:
                x = norm(lp["input_layernorm"], h, eps)
            a = lp["self_attn"]
            k, v = project_kv(a, cfg, x, cos, sin)
            kv_groups[i].append((k, v))
            groups = [(kk, vv, m) for (kk, vv), m in zip(kv_groups[i], masks)]
            o = attention(project_q(a, cfg, x, cos, sin), groups, scale)
            h = h + attn_out(a, cfg, o)
            h = h + mlp(lp["mlp"], norm(lp["post_attention_layernorm"], h, eps))
        pre = h
        out = pre if kind == "eagle" else norm(params["norm"], pre, eps)
        outs.append((out, pre))
        hid = shift_right(out if kind == "eagle3" and cfg.norm_output else pre)
    return outs


# ------------------------------------------------------------------------------ DFlash


def dflash_blocks(params: dict, cfg: ModelConfig, aux: Array, anchors: Array,
                  anchor_ids: Array, block_lens: Array) -> Array:
    """DFlash training forward: per anchor ``p`` a block ``[x_p, mask, ...]`` at positions
    ``p .. p + K - 1`` seeing the context K/V of positions ``< p`` and, non-causally, the
    first ``block_lens`` slots of its own block.

    ``aux [B, T, n_aux * Ht]``; ``anchors``, ``anchor_ids`` (the bonus tokens),
    ``block_lens`` (in ``[2, K]``): ``[B, M] int32``, ``1 <= p <= T - K``. Returns
    ``hidden [B, M, K, H]`` post-norm (slot ``j >= 1`` predicts ``x_{p + j}``).
    """
    c = cfg
    kb = c.block_size
    b, t = aux.shape[:2]
    m = anchors.shape[1]
    eps = c.rms_norm_eps
    scale = c.head_dim ** -0.5
    emb = mp.embed_table(params)
    ctx = norm(params["hidden_norm"], linear(params["fc"], aux.astype(emb.dtype)), eps)   # [B, T, H]
    ccos, csin = rope_tables(c, positions_like(ctx[..., 0]))
    slot = jnp.arange(kb, dtype=jnp.int32)
    qpos = (anchors[:, :, None] + slot).reshape(b, m * kb)                 # [B, M*K]
    qcos, qsin = rope_tables(c, qpos)
    ids = jnp.where(slot == 0, anchor_ids[:, :, None], c.mask_token_id).reshape(b, m * kb)
    h = jnp.take(emb, ids, axis=0)                                          # [B, M*K, H]
    # masks: context s < p; block: same anchor and slot < len
    s = jnp.arange(t, dtype=jnp.int32)
    ctx_mask = (s[None, None, None, :] < anchors[:, :, None, None]) & jnp.ones((1, 1, kb, 1), bool)
    ctx_mask = ctx_mask.reshape(b, m * kb, t)
    blk = jnp.arange(m * kb)
    same = (blk[:, None] // kb) == (blk[None, :] // kb)                     # [M*K, M*K]
    key_ok = (slot[None, None, :] < block_lens[:, :, None]).reshape(b, 1, m * kb)
    blk_mask = same[None] & key_ok
    for lp in layers_of(params):
        a = lp["self_attn"]
        ck, cv = project_kv(a, c, ctx, ccos, csin)
        x = norm(lp["input_layernorm"], h, eps)
        k, v = project_kv(a, c, x, qcos, qsin)
        o = attention(project_q(a, c, x, qcos, qsin), [(ck, cv, ctx_mask), (k, v, blk_mask)], scale)
        h = h + attn_out(a, c, o)
        h = h + mlp(lp["mlp"], norm(lp["post_attention_layernorm"], h, eps))
    return norm(params["norm"], h, eps).reshape(b, m, kb, -1)


def dspark_markov(params: dict, cfg: ModelConfig, h: Array, prev: Array) -> tuple[Array, Array]:
    """DSpark's biased logits under teacher forcing: post-norm block hidden ``h [..., S, H]``,
    the true previous tokens ``prev [..., S]`` -> ``(s * (lm_head(h) + W2 m) [..., S, Vd],
    m [..., S, r])``, the Markov state carried left to right over ``S`` as at inference."""
    from specjax.models.dspark import markov_step

    lead, n = h.shape[:-2], h.shape[-2]
    hs = h.reshape((-1, n, h.shape[-1])).astype(jnp.float32)

    def step(state, xs):
        m, state = markov_step(params, cfg, xs[0], xs[1], state)
        return state, m

    s0 = jnp.zeros((hs.shape[0], cfg.markov_rank), jnp.float32)
    _, m = jax.lax.scan(step, s0, (jnp.swapaxes(prev.reshape(hs.shape[:2]), 0, 1),
                                   jnp.swapaxes(hs, 0, 1)))
    m = jnp.swapaxes(m, 0, 1).reshape(lead + (n, -1))
    w2 = params["markov_head"]["markov_w2"]["kernel"].astype(jnp.float32)     # [r, Vd]
    z = mp.lm_head_logits(params["lm_head"], h).astype(jnp.float32)
    return cfg.logit_scale * (z + m @ w2), m


# ------------------------------------------------------------------------------ Medusa


def medusa_forward(params: dict, cfg: ModelConfig, hidden: Array) -> Array:
    """Target post-norm ``hidden [B, T, H]`` -> ``[num_heads, B, T, H]`` (ResBlocks)."""
    blocks = mp.normalize_keys(params)["blocks"]
    outs = []
    for k in range(cfg.num_heads):
        z = hidden
        for li in range(cfg.num_hidden_layers):
            z = z + jax.nn.silu(linear(blocks[k]["layers"][li], z))
        outs.append(z)
    return jnp.stack(outs)


__all__ = ["decoder_forward", "decoder_logits", "eagle_ttt", "ttt_masks", "dflash_blocks",
           "dspark_markov",
           "medusa_forward", "attention", "cast", "linear", "norm"]

"""A recurrent target written from scratch against ``specjax.Target`` (nothing from
``specjax.models``): embedding, layers each a gated linear recurrence
``s_t = a_t * s_{t-1} + (1 - a_t) * (x_t W_in)`` (``a_t = sigmoid(x_t W_gate + b_gate)``,
``x_t`` the RMS-normed residual) read out through ``W_out``, then a SiLU MLP; final RMSNorm,
untied lm_head. No attention and no per-token KV: its cache is one state per request (the way
vLLM's hybrid models keep mamba state in a block) plus the candidate states of the step's last
tokens, which ``accept`` rolls back to. ``full_recompute_greedy`` is an independent NumPy
reference (float64, the whole sequence from the zero state each step, no cache)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

VOCAB, HIDDEN, LAYERS = 97, 64, 2


def init_params(seed: int = 0, *, vocab: int = VOCAB, hidden: int = HIDDEN,
                layers: int = LAYERS) -> dict:
    """Random weights from ``seed``: gate biases near +1 (states remember a few tokens), RMSNorm
    gains near 1."""
    rng = np.random.default_rng(seed)
    w = lambda *shape, s=0.2: jnp.asarray(rng.normal(0.0, s, shape), jnp.float32)  # noqa: E731
    g = lambda: jnp.asarray(1.0 + rng.normal(0, 0.1, hidden), jnp.float32)  # noqa: E731
    return {
        "embed": w(vocab, hidden, s=1.0),
        "layers": [{"norm": g(), "w_in": w(hidden, hidden), "w_gate": w(hidden, hidden),
                    "b_gate": w(hidden, s=0.5) + 1.0, "w_out": w(hidden, hidden, s=0.3),
                    "norm_mlp": g(), "fc": w(hidden, 2 * hidden),
                    "proj": w(2 * hidden, hidden, s=0.15)}
                   for _ in range(layers)],
        "norm_f": g(), "lm_head": w(hidden, vocab, s=0.5),
    }


def _rms(x, g, eps=1e-6):
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + eps) * g


def _token(params, h, state, aux_ids):
    """One token through every layer: ``h [H]`` its embedding, ``state [L, H]`` the request's
    states before it. Returns ``(final-norm hidden [H], aux inputs [n_aux, H], states after)``."""
    aux, new = [], []
    for i, lp in enumerate(params["layers"]):
        if i in aux_ids:
            aux.append(h)
        x = _rms(h, lp["norm"])
        a = jax.nn.sigmoid(x @ lp["w_gate"] + lp["b_gate"])
        s = a * state[i] + (1.0 - a) * (x @ lp["w_in"])
        new.append(s)
        h = h + s @ lp["w_out"]
        h = h + jax.nn.silu(_rms(h, lp["norm_mlp"]) @ lp["fc"]) @ lp["proj"]
    aux = jnp.stack(aux) if aux else jnp.zeros((0,) + h.shape, h.dtype)
    return _rms(h, params["norm_f"]), aux, jnp.stack(new)


@dataclasses.dataclass(frozen=True)
class RecurrentLM:
    """The protocol's members plus ``accept`` (``recurrent=True``).

    KV: ``{"state": [num_blocks, L, H], "cand": [num_blocks, window, L, H]}``; request ``r``'s
    entries sit at its first block, ``block_table[r, 0]``. ``forward`` scans the batch's tokens
    in order (``lax.scan`` over the padded token axis), starting each row from its stored state
    (zero when ``seq_len == query_len``: a new request), leaves the state after ALL the row's
    tokens in ``state`` and the states after its last ``window`` tokens in ``cand`` (candidate
    ``w`` follows token ``query_len - window + w``). A token at ``slot_mapping == -1`` (padding,
    a row the device loop sits out) does not advance the state. ``window`` must exceed the
    drafts verified per step (rollback reaches back ``window - 1`` tokens)."""

    vocab_size: int = VOCAB
    hidden_size: int = HIDDEN
    num_layers: int = LAYERS
    aux_layer_ids: tuple[int, ...] = ()
    recurrent: bool = True
    window: int = 8

    def with_aux_layers(self, ids):
        return dataclasses.replace(self, aux_layer_ids=tuple(int(i) for i in ids))

    def init_kv_caches(self, num_blocks, block_size, dtype):
        shape = (num_blocks, self.num_layers, self.hidden_size)
        return {"state": jnp.zeros(shape, dtype),
                "cand": jnp.zeros((num_blocks, self.window) + shape[1:], dtype)}

    def kv_bytes_per_block(self, block_size, dtype):
        return (1 + self.window) * self.num_layers * self.hidden_size * jnp.dtype(dtype).itemsize

    def shared_weights(self, params):
        return {"embed_tokens": {"embedding": params["embed"]},
                "lm_head": {"kernel": params["lm_head"]}}

    def compute_logits(self, params, hidden):
        return (hidden @ params["lm_head"]).astype(jnp.float32)

    def forward(self, params, input_ids, positions, kv, attn):
        """``(hidden [T, H], aux [T, n_aux, H] or None, kv)``; ``positions`` unused (the order
        of the tokens is the recurrence's)."""
        if attn.tree_mask is not None:
            raise NotImplementedError("RecurrentLM verifies chains only (no tree mask)")
        state, cand = kv["state"], kv["cand"]
        nb, w = state.shape[0], self.window
        qsl = attn.query_start_loc
        b_pad, t_pad = qsl.shape[0] - 1, input_ids.shape[0]
        t = jnp.arange(t_pad, dtype=jnp.int32)
        req = jnp.clip(jnp.searchsorted(qsl, t, side="right") - 1, 0, b_pad - 1)
        qlen = qsl[1:] - qsl[:-1]
        valid = t < qsl[-1]
        advance = valid & (attn.slot_mapping >= 0)
        bid = attn.block_table[:, 0]
        fresh = attn.seq_lens == qlen
        init = jnp.where(fresh[:, None, None], 0.0, state[bid].astype(jnp.float32))
        ids = tuple(self.aux_layer_ids)

        def body(carry, xs):
            e, r, adv = xs
            s = carry[r]
            h, aux, s_new = _token(params, e, s, ids)
            s_new = jnp.where(adv, s_new, s)
            return carry.at[r].set(s_new), (h, aux, s_new)

        emb = params["embed"][input_ids].astype(jnp.float32)
        final, (hidden, aux, after) = jax.lax.scan(body, init, (emb, req, advance))
        rows = jnp.where(qlen > 0, bid, nb)                          # padding rows: dropped
        state = state.at[rows].set(final.astype(state.dtype), mode="drop")
        widx = (t - qsl[req]) - (qlen[req] - w)                      # candidate index
        keep = valid & (widx >= 0)
        cand = cand.at[jnp.where(keep, bid[req], nb), jnp.clip(widx, 0, w - 1)].set(
            after.astype(cand.dtype), mode="drop")
        return hidden, (aux if ids else None), {"state": state, "cand": cand}

    def accept(self, kv, num_kept, attn):
        """``kv`` with each row's state set to the candidate after its first ``num_kept [B]``
        tokens of the step (rows with ``num_kept == 0`` untouched)."""
        state, cand = kv["state"], kv["cand"]
        nb, w = state.shape[0], self.window
        qlen = attn.query_start_loc[1:] - attn.query_start_loc[:-1]
        bid = attn.block_table[:, 0]
        idx = w - 1 - (qlen - num_kept)
        ok = (num_kept > 0) & (idx >= 0)
        picked = cand[bid, jnp.clip(idx, 0, w - 1)]
        state = state.at[jnp.where(ok, bid, nb)].set(picked, mode="drop")
        return {"state": state, "cand": cand}


# --- the independent reference ---------------------------------------------------------


def reference_logits(params, tokens):
    """The model over the whole sequence in float64 NumPy from the zero state: ``[S, V]``."""
    f = lambda a: np.asarray(a, np.float64)  # noqa: E731
    rms = lambda x, g: x / np.sqrt(np.mean(x * x, -1, keepdims=True) + 1e-6) * f(g)  # noqa: E731
    sig = lambda x: 1.0 / (1.0 + np.exp(-x))  # noqa: E731
    h = f(params["embed"])[np.asarray(tokens)]
    for lp in params["layers"]:
        x = rms(h, lp["norm"])
        a = sig(x @ f(lp["w_gate"]) + f(lp["b_gate"]))
        u = x @ f(lp["w_in"])
        s, out = np.zeros(h.shape[-1]), []
        for t in range(len(tokens)):
            s = a[t] * s + (1.0 - a[t]) * u[t]
            out.append(s)
        h = h + np.stack(out) @ f(lp["w_out"])
        m = rms(h, lp["norm_mlp"]) @ f(lp["fc"])
        h = h + (m * sig(m)) @ f(lp["proj"])
    return rms(h, params["norm_f"]) @ f(params["lm_head"])


def full_recompute_greedy(params, prompt, n: int) -> list[int]:
    """``n`` greedy tokens after ``prompt``, the whole sequence recomputed for each."""
    seq = [int(t) for t in prompt]
    for _ in range(n):
        seq.append(int(np.argmax(reference_logits(params, seq)[-1])))
    return seq[len(prompt):]


def greedy_margin(params, prompt, out) -> float:
    """The smallest gap between the top two logits along ``prompt + out`` (ties: flaky)."""
    seq = [int(t) for t in prompt] + list(out)
    lg = np.sort(reference_logits(params, seq)[len(prompt) - 1:-1], axis=-1)
    return float((lg[:, -1] - lg[:, -2]).min())

"""DSpark head (vLLM 0.34 ``qwen3_dspark.py``): a DFlash backbone, then a rank-r Markov
head drafting the block left to right and an optional confidence head."""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from specjax.models.config import ModelConfig
from specjax.models.dflash import DFlashHead
from specjax.models.eagle3 import tensor_table as _dflash_table
from specjax.models.tensors import Entry

#: params entries the DFlash backbone does not read
HEAD_KEYS = ("markov_head", "confidence_head")
_F32 = jnp.float32


def backbone_params(params: dict) -> dict:
    return {k: v for k, v in params.items() if k not in HEAD_KEYS}


def affine(p: dict, x: jax.Array) -> jax.Array:
    """``x @ kernel + bias`` in float32."""
    out = jnp.einsum("...i,io->...o", x.astype(_F32), p["kernel"].astype(_F32))
    return out + p["bias"].astype(_F32) if "bias" in p else out


def markov_step(params: dict, c: ModelConfig, prev: jax.Array, h: jax.Array,
                state: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One slot: ``prev [B]`` target ids, ``h [B, H]``, ``state [B, r]`` -> ``(m [B, r], state)``."""
    mh = params["markov_head"]
    e = mh["markov_w1"]["embedding"][prev].astype(_F32)
    if c.markov_head_type == "gated":
        return jax.nn.sigmoid(affine(mh["gate_proj"], jnp.concatenate([h, e], -1))) * e, state
    if c.markov_head_type == "rnn":
        gr, cr, orr = jnp.split(affine(mh["joint_proj"], jnp.concatenate([state, e, h], -1)), 3, -1)
        gt = jax.nn.sigmoid(gr)
        state = gt * state + (1 - gt) * jnp.tanh(cr)
        return jnp.tanh(orr), state
    return e, state


def markov_chain(params: dict, c: ModelConfig, z: jax.Array, h: jax.Array, anchor: jax.Array,
                 choose: Callable | None = None, with_confidence: bool = True,
                 topk: int | None = None):
    """Sequential drafting: base logits ``z [B, N, Vd]``, post-norm hidden ``h [B, N, H]``,
    ``anchor [B]`` -> ``(drafts [B, N] int32 target ids, extras, confidences [B, N] or
    None)``. ``choose(l [B, Vd], i) -> (tokens [B] target ids, extras pytree)`` picks slot
    ``i`` from its Markov-biased logits (default: the argmax through ``d2t``, extras None);
    the extras come back stacked ``[B, N, ...]``. ``topk`` (vLLM's ``dspark_draft_topk``):
    only each slot's top-``topk`` base logits get the bias (``W2`` rows gathered, not the
    ``[Vd, r]`` product), the rest are -inf."""
    w2 = params["markov_head"]["markov_w2"]["kernel"].astype(_F32)       # [r, Vd]
    d2t = params.get("d2t")
    conf = (params.get("confidence_head")
            if c.enable_confidence_head and with_confidence else None)
    h = h.astype(_F32)

    def argmax(l, i):
        d = jnp.argmax(l, -1).astype(jnp.int32)
        return (d if d2t is None else d + d2t[d].astype(jnp.int32)), None

    default, choose = choose is None, choose or argmax

    def top(zi, m):             # ids [B, K] of the top-k base logits and their biased values
        vals, idx = jax.lax.top_k(zi.astype(_F32), topk)
        return idx, vals + c.logit_scale * jnp.einsum("rbk,br->bk", w2[:, idx], m)

    def biased(zi, m):          # [B, Vd]; with top-k, -inf outside it
        if topk is None:
            return zi.astype(_F32) + c.logit_scale * (m @ w2)
        idx, sub = top(zi, m)
        rows = jnp.arange(zi.shape[0])[:, None]
        return jnp.full(zi.shape, -jnp.inf, _F32).at[rows, idx].set(sub)

    def step(carry, xs):
        prev, state = carry
        zi, hi, i = xs
        m, state = markov_step(params, c, prev, hi, state)
        if default and topk is not None:        # the argmax among the K: no [B, Vd] array
            idx, sub = top(zi, m)
            d = jnp.take_along_axis(idx, jnp.argmax(sub, -1)[:, None], 1)[:, 0].astype(jnp.int32)
            d, extra = (d if d2t is None else d + d2t[d].astype(jnp.int32)), None
        else:
            d, extra = choose(biased(zi, m), i)
        ci = jnp.zeros(d.shape, _F32)
        if conf is not None:
            f = jnp.concatenate([hi, m], -1) if c.confidence_head_with_markov else hi
            ci = jax.nn.sigmoid(affine(conf["proj"], f)[..., 0])
        return (d, state), (d, extra, ci)

    s0 = jnp.zeros((anchor.shape[0], c.markov_rank), _F32)
    cols = jnp.arange(z.shape[1], dtype=jnp.int32)
    # unrolled: an XLA while loop reads its predicate back to the host each iteration on GPU
    _, (d, extra, ci) = jax.lax.scan(step, (anchor.astype(jnp.int32), s0),
                                     (jnp.swapaxes(z, 0, 1), jnp.swapaxes(h, 0, 1), cols),
                                     unroll=True)
    extra = jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1), extra)
    return jnp.swapaxes(d, 0, 1), extra, (jnp.swapaxes(ci, 0, 1) if conf is not None else None)


@dataclasses.dataclass(frozen=True)
class DSparkHead(DFlashHead):
    """DFlash's context and block forward (on the backbone's params), the base logits over
    the draft vocab, and :func:`markov_chain`."""

    def combine_hidden_states(self, params, aux_hidden_states):
        return super().combine_hidden_states(backbone_params(params), aux_hidden_states)

    def precompute_and_store_context_kv(self, params, *args):
        return super().precompute_and_store_context_kv(backbone_params(params), *args)

    def forward(self, params, *args):
        return super().forward(backbone_params(params), *args)

    def compute_draft_logits(self, params: dict, hidden: jax.Array) -> jax.Array:
        """``[..., H]`` -> base logits ``s * lm_head(h)`` ``[..., Vd]`` float32."""
        from specjax.models import params as mp
        head = mp.need(params, "lm_head", "the target's lm_head")
        z = mp.lm_head_logits(head, hidden)
        if z.shape[-1] != self.config.draft_vocab_size:
            raise ValueError(f"the DSpark head's lm_head gives {z.shape[-1]} logits, its "
                             f"draft_vocab_size is {self.config.draft_vocab_size}: a reduced-vocab "
                             "head needs its own lm_head (the target's is shared only if Vd == V)")
        return self.config.logit_scale * z

    def draft(self, params: dict, hidden: jax.Array, anchor: jax.Array, **kw):
        """``hidden [B, N, H]``, ``anchor [B]`` -> :func:`markov_chain` (``kw``: its
        ``choose``, ``with_confidence``, ``topk``)."""
        return markov_chain(params, self.config, self.compute_draft_logits(params, hidden),
                            hidden, anchor, **kw)


def tensor_table(c: ModelConfig) -> list[Entry]:
    """DFlash's tensors plus ``markov_head.*`` and the optional ``confidence_head.proj.*``."""
    h, v, vd, r = c.hidden_size, c.vocab_size, c.draft_vocab_size, c.markov_rank
    e = _dflash_table(c.replace(kind="dflash"))
    e += [Entry("markov_head.markov_w1.weight", ("markov_head", "markov_w1", "embedding"),
                (v, r), "copy"),
          Entry("markov_head.markov_w2.weight", ("markov_head", "markov_w2", "kernel"),
                (vd, r), "linear")]
    extra = {"gated": ("gate_proj", r, h + r), "rnn": ("joint_proj", 3 * r, 2 * r + h)}
    if c.markov_head_type in extra:
        name, o, i = extra[c.markov_head_type]
        e += [Entry(f"markov_head.{name}.weight", ("markov_head", name, "kernel"), (o, i), "linear"),
              Entry(f"markov_head.{name}.bias", ("markov_head", name, "bias"), (o,), "copy")]
    if c.enable_confidence_head:
        fi = h + r if c.confidence_head_with_markov else h
        e += [Entry("confidence_head.proj.weight", ("confidence_head", "proj", "kernel"),
                    (1, fi), "linear"),
              Entry("confidence_head.proj.bias", ("confidence_head", "proj", "bias"), (1,), "copy")]
    return e

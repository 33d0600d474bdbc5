"""Losses of every model kind: the target LM (next-token cross-entropy) and the draft heads
(self-distillation on the frozen target's next-token distributions).

Every objective is ``loss(params, frozen, tokens [B, T] int32, key) -> (loss, metrics)``,
``frozen`` holding everything fixed (the target's params, static arrays); ``metrics`` are
scalars, ``top1`` the fraction of positions where the draft's argmax equals the target's.
Each kind's inputs and labels: docs/training.md, "What each objective teaches".
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from specjax.models import share_target_weights
from specjax.models.config import ModelConfig
from specjax.training import forward as F

Array = jax.Array
Objective = Callable[[dict, dict, Array, Array], tuple[Array, dict]]


def masked_mean(x: Array, mask: Array) -> Array:
    mask = jnp.broadcast_to(mask, x.shape).astype(jnp.float32)
    return jnp.sum(x * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def soft_cross_entropy(logits: Array, target_logits: Array, mask: Array) -> tuple[Array, Array]:
    """Mean over ``mask`` of ``-sum_v p_target(v) log q(v)`` and of top-1 agreement."""
    logq = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    p = jax.nn.softmax(target_logits.astype(jnp.float32), axis=-1)
    ce = -jnp.sum(p * logq, axis=-1)
    agree = (jnp.argmax(logits, axis=-1) == jnp.argmax(target_logits, axis=-1)).astype(jnp.float32)
    return masked_mean(ce, mask), masked_mean(agree, mask)


def next_token_loss(logits: Array, labels: Array) -> Array:
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, labels[..., None], axis=-1))


@dataclasses.dataclass(frozen=True)
class TargetSetup:
    """The frozen target as the heads' objectives see it (hashable, static)."""

    config: ModelConfig
    aux_layer_ids: tuple[int, ...] = ()
    compute_dtype: str = "bfloat16"

    def run(self, frozen: dict, tokens: Array) -> tuple[Array, Array | None, Array]:
        """``(hidden [B, T, H], aux [B, T, n_aux * H] or None, logits [B, T, V] f32)``, no gradient."""
        tp = F.cast(frozen["target"], self.compute_dtype)
        hidden, aux = F.decoder_forward(tp, self.config, tokens, self.aux_layer_ids)
        logits = F.decoder_logits(tp, hidden)
        if aux is not None:
            aux = aux.reshape(aux.shape[0], aux.shape[1], -1)
        return jax.lax.stop_gradient((hidden, aux, logits))


def target_lm(config: ModelConfig, compute_dtype: str = "bfloat16") -> Objective:
    """Next-token cross-entropy of a decoder LM (the target itself); ``frozen`` unused."""

    def loss(params, frozen, tokens, key):
        p = F.cast(params, compute_dtype)
        hidden, _ = F.decoder_forward(p, config, tokens[:, :-1])
        ce = next_token_loss(F.decoder_logits(p, hidden), tokens[:, 1:])
        return ce, {"loss": ce, "bits_per_token": ce / jnp.log(2.0)}

    return loss


def eagle(kind: str, config: ModelConfig, target: TargetSetup, *, depth: int = 4,
          step_weight: float = 0.8) -> Objective:
    """EAGLE-1 (``kind="eagle"``) / EAGLE-3 with a ``depth``-step training-time-test unroll;
    step ``d`` weighted ``step_weight ** d``. EAGLE-3 with a reduced draft vocabulary
    (``frozen["draft_ids"] [Vd]``, the target ids of the draft vocab) learns the target's
    distribution renormalized over the draft vocab."""
    cdt = target.compute_dtype

    def loss(params, frozen, tokens, key):
        hidden, aux, tl = target.run(frozen, tokens)
        feats = (hidden if kind == "eagle" else aux)[:, :-1]
        labels = tl[:, 1:]                                       # L_{t+1}
        if kind == "eagle3" and "draft_ids" in frozen:
            labels = labels[..., frozen["draft_ids"]]
        p = F.cast(share_target_weights(params, frozen["target"], kind=kind), cdt)
        outs = F.eagle_ttt(kind, p, config, tokens[:, 1:], feats, depth)
        t = labels.shape[1]
        pos = jnp.arange(t)
        total, wsum, metrics = 0.0, 0.0, {}
        for d, (out, _) in enumerate(outs):
            logits = F.mp.lm_head_logits(p["lm_head"], out)
            ce, top1 = soft_cross_entropy(logits, labels, (pos >= d)[None, :])
            w = step_weight ** d
            total, wsum = total + w * ce, wsum + w
            metrics[f"ce{d}"], metrics[f"top1_{d}"] = ce, top1
        total = total / wsum
        metrics["loss"] = total
        return total, metrics

    return loss


def medusa(config: ModelConfig, target: TargetSetup) -> Objective:
    """Medusa heads: head ``k`` at ``t`` learns ``L_{t+1+k}``."""
    cdt = target.compute_dtype

    def loss(params, frozen, tokens, key):
        hidden, _, tl = target.run(frozen, tokens)
        p = F.cast(params, cdt)
        z = F.medusa_forward(p, config, hidden)
        t = tokens.shape[1]
        total, metrics = 0.0, {}
        for k in range(config.num_heads):
            n = t - 1 - k
            logits = F.mp.lm_head_logits(F.mp.normalize_keys(p)["lm_heads"][k], z[k, :, :n])
            ce, top1 = soft_cross_entropy(logits, tl[:, 1 + k:], jnp.ones((1, n), bool))
            total = total + ce
            metrics[f"ce{k}"], metrics[f"top1_{k}"] = ce, top1
        total = total / config.num_heads
        metrics["loss"] = total
        return total, metrics

    return loss


def draft_model(config: ModelConfig, target: TargetSetup) -> Objective:
    """A small decoder LM distilled from the target's distributions."""
    cdt = target.compute_dtype

    def loss(params, frozen, tokens, key):
        _, _, tl = target.run(frozen, tokens)
        p = F.cast(params, cdt)
        hidden, _ = F.decoder_forward(p, config, tokens)
        ce, top1 = soft_cross_entropy(F.decoder_logits(p, hidden), tl, jnp.ones((1, tokens.shape[1]), bool))
        return ce, {"loss": ce, "top1": top1}

    return loss


def dflash(config: ModelConfig, target: TargetSetup, *, anchors_per_seq: int = 32) -> Objective:
    """DFlash: random anchors and random block lengths ``2..block_size`` per block."""
    cdt = target.compute_dtype
    kb = config.block_size

    def loss(params, frozen, tokens, key):
        _, aux, tl = target.run(frozen, tokens)
        b, t = tokens.shape
        ka, kl = jax.random.split(key)
        anchors = jax.random.randint(ka, (b, anchors_per_seq), 1, t - kb + 1, dtype=jnp.int32)
        lens = jax.random.randint(kl, (b, anchors_per_seq), 2, kb + 1, dtype=jnp.int32)
        anchor_ids = jnp.take_along_axis(tokens, anchors, axis=1)
        p = F.cast(share_target_weights(params, frozen["target"]), cdt)
        h = F.dflash_blocks(p, config, aux, anchors, anchor_ids, lens)      # [B, M, K, H]
        logits = F.mp.lm_head_logits(p["lm_head"], h[:, :, 1:])        # slots 1..K-1
        j = jnp.arange(1, kb, dtype=jnp.int32)
        lab_pos = anchors[:, :, None] + j - 1                               # [B, M, K-1]
        labels = jax.vmap(lambda row, idx: row[idx])(tl, lab_pos)          # [B, M, K-1, V]
        valid = j[None, None, :] < lens[:, :, None]
        ce, top1 = soft_cross_entropy(logits, labels, valid)
        metrics = {"loss": ce, "top1": top1}
        for jj in range(1, min(kb, 5)):
            _, metrics[f"top1_{jj}"] = soft_cross_entropy(logits[:, :, jj - 1], labels[:, :, jj - 1],
                                                          valid[:, :, jj - 1])
        return ce, metrics

    return loss


def dspark(config: ModelConfig, target: TargetSetup, *, anchors_per_seq: int = 32,
           confidence_weight: float = 1.0) -> Objective:
    """DSpark (DeepSpec's loss): DFlash's blocks of random length (``1..K`` anchored, slot
    ``j`` predicting ``x_{p+1+j}``; ``2..K`` in DFlash's layout), each slot's logits biased
    by the Markov head fed the true previous token (teacher forcing), soft cross-entropy on
    the biased logits; the confidence head learns ``alpha_j = 1 - TV(softmax(l_j), p_target)``
    (its acceptance probability under speculative sampling) by BCE, weighted
    ``confidence_weight``. A reduced draft vocabulary is refused."""
    from specjax.models.dspark import affine

    if config.has_d2t or config.draft_vocab_size != config.vocab_size:
        raise ValueError("the dspark objective trains a full-vocabulary head (draft_vocab_size "
                         f"== vocab_size), got draft_vocab_size={config.draft_vocab_size}")
    cdt = target.compute_dtype
    kb = config.block_size
    first = 0 if config.sample_from_anchor else 1

    def loss(params, frozen, tokens, key):
        _, aux, tl = target.run(frozen, tokens)
        b, t = tokens.shape
        ka, kl = jax.random.split(key)
        anchors = jax.random.randint(ka, (b, anchors_per_seq), 1, t - kb + 1, dtype=jnp.int32)
        lens = jax.random.randint(kl, (b, anchors_per_seq), 1 + first, kb + 1, dtype=jnp.int32)
        p = F.cast(share_target_weights(params, frozen["target"]), cdt)
        h = F.dflash_blocks(p, config, aux, anchors, jnp.take_along_axis(tokens, anchors, 1),
                            lens)[:, :, first:].astype(jnp.float32)         # [B, M, S, H]
        j = jnp.arange(first, kb, dtype=jnp.int32)
        idx = anchors[:, :, None] + j - first             # label row of tl; the previous token
        labels = jax.vmap(lambda row, i: row[i])(tl, idx)                   # [B, M, S, V]
        prev = jax.vmap(lambda row, i: row[i])(tokens, idx)                 # [B, M, S]
        valid = j[None, None, :] < lens[:, :, None]
        logits, m = F.dspark_markov(p, config, h, prev)
        ce, top1 = soft_cross_entropy(logits, labels, valid)
        metrics = {"ce": ce, "top1": top1}
        for jj in range(min(kb - first, 4)):
            _, metrics[f"top1_{jj + 1}"] = soft_cross_entropy(logits[:, :, jj], labels[:, :, jj],
                                                              valid[:, :, jj])
        total = ce
        if config.enable_confidence_head:
            tv = 0.5 * jnp.abs(jax.nn.softmax(logits, -1)
                               - jax.nn.softmax(labels.astype(jnp.float32), -1)).sum(-1)
            alpha = jax.lax.stop_gradient(jnp.clip(1.0 - tv, 0.0, 1.0))
            f = jnp.concatenate([h, m], -1) if config.confidence_head_with_markov else h
            x = affine(p["confidence_head"]["proj"], f)[..., 0]
            bce = masked_mean(jax.nn.softplus(x) - alpha * x, valid) - masked_mean(
                -(alpha * jnp.log(jnp.maximum(alpha, 1e-12))
                  + (1 - alpha) * jnp.log(jnp.maximum(1 - alpha, 1e-12))), valid)
            metrics["conf_bce_excess"] = bce                # 0 at a perfect confidence head
            metrics["conf_abs_err"] = masked_mean(jnp.abs(jax.nn.sigmoid(x) - alpha), valid)
            total = total + confidence_weight * bce
        metrics["loss"] = total
        return total, metrics

    return loss


__all__ = ["TargetSetup", "target_lm", "eagle", "medusa", "draft_model", "dflash", "dspark",
           "soft_cross_entropy", "next_token_loss", "masked_mean"]

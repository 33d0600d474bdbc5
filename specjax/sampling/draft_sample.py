"""vLLM's probabilistic drafting (``draft_sample_method="probabilistic"``): drafts sampled
from the drafter's distribution at the request's temperature (top-k / top-p / min-p not
applied, as vLLM), their probabilities kept per request slot for the next step's
verification. Draft noise has its own salted stream, so a draft and the residual it may be
resampled from never share noise (vLLM's ``_DRAFT_NOISE_SALT``)."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from specjax.sampling.metadata import GREEDY_TEMPERATURE

__all__ = ["DRAFT_SAMPLE_METHODS", "DRAFT_NOISE_SALT", "DraftSampling", "DraftProbState",
           "sample_draft", "init_draft_probs", "read_draft_probs", "write_draft_probs"]

DRAFT_SAMPLE_METHODS = ("greedy", "probabilistic")
#: The draft-noise stream (vLLM's salt value; specjax's verification streams are 0, 1, 2).
DRAFT_NOISE_SALT = 2**30


class DraftSampling(NamedTuple):
    """What a sampling drafter reads per row: ``temperature [B] float32`` (0: argmax) and
    ``keys [B, 2] uint32`` (the step's per-request key data)."""

    temperature: Any
    keys: Any


class DraftProbState(NamedTuple):
    """A probabilistic proposer's state in the step: the proposer's own ``inner`` state and
    ``probs [num_slots, k, V] float32``, each running request's drafts' distributions."""

    inner: Any
    probs: Any


def sample_draft(logits: jax.Array, sampling: DraftSampling, col: Any) -> tuple[jax.Array, jax.Array]:
    """Draft column ``col`` (int or ``[B]``) of each row: ``logits [B, V]`` -> ``(tokens [B]
    int32, probs [B, V] float32)``, a Gumbel-max sample of ``logits / T`` (T = 0: the argmax; its probs at T = 1)
    and ``softmax(logits / T)``."""
    t = sampling.temperature.astype(jnp.float32)
    greedy = t == GREEDY_TEMPERATURE
    z = logits.astype(jnp.float32) / jnp.where(greedy, 1.0, t)[:, None]
    cols = jnp.broadcast_to(jnp.asarray(col, jnp.int32), t.shape)
    keys = jax.vmap(lambda k, c: jax.random.fold_in(jax.random.fold_in(
        jax.random.wrap_key_data(k), DRAFT_NOISE_SALT), c))(sampling.keys, cols)
    g = jax.vmap(lambda k: jax.random.gumbel(k, (z.shape[-1],)))(keys)
    tok = jnp.where(greedy, jnp.argmax(z, -1), jnp.argmax(z + g, -1)).astype(jnp.int32)
    return tok, jax.nn.softmax(z, axis=-1)


def init_draft_probs(inner: Any, num_slots: int, k: int, vocab_size: int) -> DraftProbState:
    return DraftProbState(inner, jnp.zeros((num_slots, k, vocab_size), jnp.float32))


def read_draft_probs(state: DraftProbState, slots: jax.Array) -> jax.Array:
    """``[B, k, V]`` of the batch's rows (``slots [B]``; padding rows: any)."""
    return state.probs[jnp.clip(slots, 0, state.probs.shape[0] - 1)]


def write_draft_probs(state: DraftProbState, inner: Any, slots: jax.Array,
                      probs: jax.Array) -> DraftProbState:
    """``state`` with ``inner`` and the rows' new ``probs [B, k, V]`` at ``slots`` (padding
    rows pass a slot past the buffer: dropped)."""
    return DraftProbState(inner, state.probs.at[slots].set(probs.astype(jnp.float32), mode="drop"))

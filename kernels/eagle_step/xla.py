"""XLA backend of :mod:`specjax.kernels.eagle_step`: the reference and the CPU path."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from specjax.constants import PADDING_SLOT_ID
from specjax.kernels._xla import _slot, _I32


@functools.partial(jax.jit, static_argnames=("block_size", "max_model_len", "input_batch_size"))
def eagle_step_update_slot_mapping_and_metadata(
    positions, block_table, seq_lens, *, block_size, max_model_len, input_batch_size, num_reqs
):
    b = positions.shape[0]
    rows = jnp.arange(b, dtype=_I32)
    real = rows < num_reqs
    # pos + 1 >= max_model_len, written so that pos + 1 cannot overflow.
    exceeds = positions >= max_model_len - 1
    clamped = jnp.where(exceeds, 0, positions + 1)
    slot = jnp.where(exceeds, PADDING_SLOT_ID, _slot(block_table, rows, clamped, block_size))
    new_seq = jnp.minimum(jnp.where(exceeds, 1, seq_lens + 1), max_model_len)
    clamped = jnp.where(real, clamped, 0)
    slot = jnp.where(real, slot, PADDING_SLOT_ID)
    new_seq = jnp.where(real, new_seq, 0)
    pad = jnp.full((input_batch_size - b,), PADDING_SLOT_ID, _I32)
    return clamped, jnp.concatenate([slot, pad]), new_seq

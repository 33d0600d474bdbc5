"""``eagle_step_update_slot_mapping_and_metadata`` as a Mosaic GPU kernel: one program per
chunk of 128 rows; each real row's block-table entry is a scalar load merged into the slot
vector."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from specjax.constants import PADDING_SLOT_ID
from specjax.kernels import _pallas as c


def _body(pos_ref, seq_ref, bt_ref, n_ref, pos_out, slot_out, seq_out, *, rows, block_size,
          max_model_len, num_blocks):
    b0 = c.program_id() * c.LANES
    lane = c.lanes()
    n = c.num_real(n_ref, rows)
    real = b0 + lane < n

    positions = pos_ref[c.chunk(b0)]
    seq_lens = seq_ref[c.chunk(b0)]
    # positions + 1 >= max_model_len, written so that positions + 1 cannot overflow.
    exceeds = positions >= max_model_len - 1
    clamped = jnp.where(exceeds, 0, positions + 1)
    block = jnp.minimum(lax.div(clamped, block_size), num_blocks - 1)
    offset = lax.rem(clamped, block_size)
    new_seq = jnp.minimum(jnp.where(exceeds, 1, seq_lens + 1), max_model_len)

    def gather(i, base):
        entry = bt_ref[b0 + i, c.extract(block, i)]
        return jnp.where(lane == i, entry, base)

    real_here = jnp.clip(n - b0, 0, c.LANES)
    base = lax.fori_loop(0, real_here, gather, c.full(0))
    slot = jnp.where(exceeds, PADDING_SLOT_ID, base * block_size + offset)

    pos_out[c.chunk(b0)] = jnp.where(real, clamped, 0)
    slot_out[c.chunk(b0)] = jnp.where(real, slot, PADDING_SLOT_ID)
    seq_out[c.chunk(b0)] = jnp.where(real, new_seq, 0)


@functools.partial(jax.jit, static_argnames=("block_size", "max_model_len", "input_batch_size"))
def eagle_step_update_slot_mapping_and_metadata(
    positions, block_table, seq_lens, *, block_size, max_model_len, input_batch_size, num_reqs
):
    b, num_blocks = block_table.shape
    if input_batch_size == 0:  # then b == 0 too: nothing to compute
        empty = jnp.zeros((0,), c.I32)
        return empty, empty, empty
    programs = c.cdiv(input_batch_size, c.LANES)
    padded = programs * c.LANES
    if b == 0:  # a ref needs a row; no real row ever reads it
        block_table = jnp.zeros((1, num_blocks), c.I32)
    vec = jax.ShapeDtypeStruct((padded,), c.I32)
    body = functools.partial(_body, rows=b, block_size=block_size, max_model_len=max_model_len,
                             num_blocks=num_blocks)
    pos_out, slot_out, seq_out = c.run_kernel(
        body, (vec, vec, vec), programs, "eagle_step_update_slot_mapping_and_metadata"
    )(c.pad_rows(positions, padded), c.pad_rows(seq_lens, padded), block_table,
      num_reqs.reshape(1))
    return c.head(pos_out, b), c.head(slot_out, input_batch_size), c.head(seq_out, b)

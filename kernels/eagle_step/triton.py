"""``eagle_step_update_slot_mapping_and_metadata``: vLLM's eagle_step slot-mapping kernel."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from specjax.constants import PADDING_SLOT_ID
from specjax.kernels import _jt
from specjax.kernels._triton import slot_of


@triton.jit
def _eagle_step_kernel(
    positions_ptr,  # [B]
    block_table_ptr,  # [B, NB]
    seq_lens_ptr,  # [B]
    num_reqs_ptr,  # [] real rows
    out_positions_ptr,  # [B]
    out_slot_mapping_ptr,  # [INPUT_B]
    out_seq_lens_ptr,  # [B]
    B: tl.constexpr,
    INPUT_B: tl.constexpr,
    NB: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    MAX_MODEL_LEN: tl.constexpr,
    PAD_ID: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    num_reqs = tl.load(num_reqs_ptr)
    in_b = offs < B
    real = in_b & (offs < num_reqs)
    pos = tl.load(positions_ptr + offs, mask=real, other=0)
    seq = tl.load(seq_lens_ptr + offs, mask=real, other=0)
    # new = pos + 1 >= MAX_MODEL_LEN, written so that pos + 1 cannot overflow.
    exceeds = pos >= MAX_MODEL_LEN - 1
    new = tl.where(exceeds, 0, pos + 1)
    live = real & ~exceeds
    slot = slot_of(block_table_ptr + offs * NB, new, live, NB, BLOCK_SIZE)
    slot = tl.where(live, slot, PAD_ID)
    seq = tl.minimum(tl.where(exceeds, 1, seq + 1), MAX_MODEL_LEN)
    tl.store(out_positions_ptr + offs, tl.where(real, new, 0), mask=in_b)
    tl.store(out_seq_lens_ptr + offs, tl.where(real, seq, 0), mask=in_b)
    tl.store(out_slot_mapping_ptr + offs, slot, mask=offs < INPUT_B)


def eagle_step_update_slot_mapping_and_metadata(
    positions, block_table, seq_lens, *, block_size, max_model_len, input_batch_size, num_reqs
):
    b, nb = block_table.shape
    out_shape = [
        jax.ShapeDtypeStruct((b,), jnp.int32),
        jax.ShapeDtypeStruct((input_batch_size,), jnp.int32),
        jax.ShapeDtypeStruct((b,), jnp.int32),
    ]
    if input_batch_size == 0:  # then b == 0 too: nothing to launch
        return tuple(jnp.zeros(s.shape, s.dtype) for s in out_shape)
    block = _jt.pow2_block(input_batch_size, 32, 256)
    pos, slots, seq = _jt.triton_call(
        positions, block_table, seq_lens, num_reqs,
        kernel=_eagle_step_kernel,
        out_shape=out_shape,
        grid=(_jt.cdiv(input_batch_size, block),),
        num_warps=max(1, min(4, block // 64)),
        name="specjax_eagle_step_update_slot_mapping",
        B=b, INPUT_B=input_batch_size, NB=nb, BLOCK_SIZE=block_size,
        MAX_MODEL_LEN=max_model_len, PAD_ID=PADDING_SLOT_ID, BLOCK=block,
    )
    return pos, slots, seq

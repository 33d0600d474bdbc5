"""``eagle_prepare_inputs_padded`` and ``eagle_prepare_next_token_padded`` (vLLM kernels 2, 3)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from specjax.kernels import _jt


@triton.jit
def _prepare_inputs_padded_kernel(
    cu_num_draft_tokens_ptr,  # [R] inclusive cumsum
    valid_sampled_tokens_count_ptr,  # [R]
    query_start_loc_ptr,  # [R + 1]
    num_reqs_ptr,  # []
    out_token_indices_ptr,  # [R]
    out_num_rejected_ptr,  # [R]
    R: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    num_reqs = tl.load(num_reqs_ptr)
    in_r = offs < R
    real = in_r & (offs < num_reqs)
    cu = tl.load(cu_num_draft_tokens_ptr + offs, mask=real, other=0)
    cu_prev = tl.load(cu_num_draft_tokens_ptr + offs - 1, mask=real & (offs > 0), other=0)
    valid = tl.load(valid_sampled_tokens_count_ptr + offs, mask=real, other=0)
    next_start = tl.load(query_start_loc_ptr + offs + 1, mask=real, other=0)
    n_draft = cu - cu_prev
    rejected = tl.where(n_draft > 0, n_draft + 1 - valid, 0)
    index = next_start - 1 - rejected
    tl.store(out_token_indices_ptr + offs, tl.where(real, index, 0), mask=in_r)
    tl.store(out_num_rejected_ptr + offs, tl.where(real, rejected, 0), mask=in_r)


def eagle_prepare_inputs_padded(cu_num_draft_tokens, valid_sampled_tokens_count, query_start_loc,
                                *, num_reqs):
    r = cu_num_draft_tokens.shape[0]
    out_shape = [jax.ShapeDtypeStruct((r,), jnp.int32)] * 2
    if r == 0:
        return tuple(jnp.zeros(s.shape, s.dtype) for s in out_shape)
    block = _jt.pow2_block(r, 32, 256)
    index, rejected = _jt.triton_call(
        cu_num_draft_tokens, valid_sampled_tokens_count, query_start_loc, num_reqs,
        kernel=_prepare_inputs_padded_kernel,
        out_shape=out_shape,
        grid=(_jt.cdiv(r, block),),
        num_warps=max(1, min(4, block // 64)),
        name="specjax_eagle_prepare_inputs_padded",
        R=r, BLOCK=block,
    )
    return index, rejected


@triton.jit
def _prepare_next_token_padded_kernel(
    sampled_token_ids_ptr,  # [R, S]
    discard_request_mask_ptr,  # [R] bool
    backup_next_token_ids_ptr,  # [R]
    num_reqs_ptr,  # []
    out_next_token_ids_ptr,  # [R]
    out_valid_count_ptr,  # [R]
    R: tl.constexpr,
    S: tl.constexpr,
    VOCAB_SIZE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_S)
    num_reqs = tl.load(num_reqs_ptr)
    in_r = rows < R
    real = in_r & (rows < num_reqs)
    m2 = real[:, None] & (cols[None, :] < S)
    tok = tl.load(sampled_token_ids_ptr + rows[:, None] * S + cols[None, :], mask=m2, other=-1)
    valid = m2 & (tok != -1) & (tok < VOCAB_SIZE)
    count = tl.sum(valid.to(tl.int32), axis=1)
    last = tl.max(tl.where(valid, cols[None, :], -1), axis=1)
    # Exactly one column matches `last` when count > 0: the sum is that token.
    last_tok = tl.sum(tl.where(cols[None, :] == last[:, None], tok, 0), axis=1)
    discard = tl.load(discard_request_mask_ptr + rows, mask=real, other=0).to(tl.int32) != 0
    backup = tl.load(backup_next_token_ids_ptr + rows, mask=real, other=0)
    nxt = tl.where(discard | (count == 0), backup, last_tok)
    count = tl.where(discard, 0, count)
    tl.store(out_next_token_ids_ptr + rows, tl.where(real, nxt, 0), mask=in_r)
    tl.store(out_valid_count_ptr + rows, tl.where(real, count, 0), mask=in_r)


def eagle_prepare_next_token_padded(sampled_token_ids, discard_request_mask, backup_next_token_ids,
                                    *, vocab_size, num_reqs):
    r, s = sampled_token_ids.shape
    out_shape = [jax.ShapeDtypeStruct((r,), jnp.int32)] * 2
    if r == 0:
        return tuple(jnp.zeros(x.shape, x.dtype) for x in out_shape)
    block_s = _jt.pow2_block(s, 1, 1 << 30)
    block_r = _jt.pow2_block(r, 1, max(1, 2048 // block_s))
    block_r = min(block_r, 256)
    nxt, count = _jt.triton_call(
        sampled_token_ids, discard_request_mask, backup_next_token_ids, num_reqs,
        kernel=_prepare_next_token_padded_kernel,
        out_shape=out_shape,
        grid=(_jt.cdiv(r, block_r),),
        num_warps=max(1, min(4, block_r * block_s // 128)),
        name="specjax_eagle_prepare_next_token_padded",
        R=r, S=s, VOCAB_SIZE=vocab_size, BLOCK_R=block_r, BLOCK_S=block_s,
    )
    return nxt, count

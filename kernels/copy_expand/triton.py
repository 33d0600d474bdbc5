"""The copy-and-expand ops as Triton kernels (vLLM kernels 4 and 5), one launch each.

Programs ``0 .. R-1`` own one request each and loop over its token range; programs ``R ..``
write the fill values outside the requests' output interval, so every output element is
written exactly once, with no ordering between programs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from specjax.constants import PADDING_SLOT_ID
from specjax.kernels import _jt
from specjax.kernels._triton import slot_of

_TOKEN_BLOCK = 128  # tokens per loop step of a request program
_FILL_BLOCK = 1024  # elements per fill program


@triton.jit
def _copy_and_expand_eagle_kernel(
    target_token_ids_ptr,  # [T]
    target_positions_ptr,  # [T]
    next_token_ids_ptr,  # [R]
    query_start_loc_ptr,  # [R + 1]
    query_end_loc_ptr,  # [R]
    num_reqs_ptr,  # []
    out_input_ids_ptr,  # [N_OUT]
    out_positions_ptr,  # [N_OUT]
    out_is_rejected_ptr,  # [N_OUT] bool
    out_is_masked_ptr,  # [N_OUT] bool
    out_new_token_indices_ptr,  # [R * P]
    out_hidden_state_mapping_ptr,  # [T]
    R: tl.constexpr,
    T: tl.constexpr,
    N_OUT: tl.constexpr,
    P: tl.constexpr,
    SHIFT: tl.constexpr,
    EXTRA: tl.constexpr,  # P - 1 with shift, else P: output length - input length
    PADDING_TOKEN_ID: tl.constexpr,
    PARALLEL_TOKEN_ID: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_P: tl.constexpr,
    FILL_BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    num_reqs = tl.minimum(tl.maximum(tl.load(num_reqs_ptr), 0), R)
    if pid < R:
        r = pid
        p = tl.arange(0, BLOCK_P)
        if r < num_reqs:
            start = tl.load(query_start_loc_ptr + r)
            next_start = tl.load(query_start_loc_ptr + r + 1)
            end = tl.load(query_end_loc_ptr + r)
            bonus = tl.load(next_token_ids_ptr + r)
            # Index clamps as in the reference (a no-op on valid input): never out of bounds.
            first_at = tl.minimum(tl.maximum(start, 0), T - 1)
            first_pos = tl.load(target_positions_ptr + first_at, mask=first_at >= 0, other=0)
            o = start + r * EXTRA
            if SHIFT:
                v = end - start
                src = start + 1
            else:
                v = end - start + 1
                src = start
            # v + P + rejected == next_start - start + EXTRA: this request's output length.
            total = next_start - start + EXTRA
            for j0 in range(0, total, BLOCK):
                j = j0 + tl.arange(0, BLOCK)
                in_req = j < total
                is_copy = j < v
                is_masked = (j > v) & (j < v + P)
                is_rejected = j >= v + P
                src_j = tl.minimum(tl.maximum(src + j, 0), T - 1)
                tok = tl.load(target_token_ids_ptr + src_j, mask=in_req & is_copy & (src_j >= 0),
                              other=0)
                ids = tl.where(is_copy, tok, bonus)
                ids = tl.where(j > v, PARALLEL_TOKEN_ID, ids)
                ids = tl.where(is_rejected, PADDING_TOKEN_ID, ids)
                pos = tl.where(is_rejected, 0, first_pos + j)
                dst = o + j
                w = in_req & (dst >= 0) & (dst < N_OUT)
                tl.store(out_input_ids_ptr + dst, ids, mask=w)
                tl.store(out_positions_ptr + dst, pos, mask=w)
                tl.store(out_is_rejected_ptr + dst, is_rejected, mask=w)
                tl.store(out_is_masked_ptr + dst, is_masked, mask=w)
                t = start + j
                t_ok = (t < next_start) & (t >= 0) & (t < T)
                tl.store(out_hidden_state_mapping_ptr + t, dst, mask=t_ok)
            tl.store(out_new_token_indices_ptr + r * P + p, o + v + p, mask=p < P)
        else:
            tl.store(out_new_token_indices_ptr + r * P + p, tl.zeros([BLOCK_P], tl.int32),
                     mask=p < P)
    else:
        i = (pid - R) * FILL_BLOCK + tl.arange(0, FILL_BLOCK)
        first = tl.load(query_start_loc_ptr)
        last = tl.load(query_start_loc_ptr + num_reqs)
        out_end = last + num_reqs * EXTRA
        fill = (i < N_OUT) & ((i < first) | (i >= out_end))
        zeros = tl.zeros([FILL_BLOCK], tl.int32)
        tl.store(out_input_ids_ptr + i, zeros, mask=fill)
        tl.store(out_positions_ptr + i, zeros, mask=fill)
        tl.store(out_is_rejected_ptr + i, zeros != 0, mask=fill)
        tl.store(out_is_masked_ptr + i, zeros != 0, mask=fill)
        t_fill = (i < T) & ((i < first) | (i >= last))
        tl.store(out_hidden_state_mapping_ptr + i, zeros + N_OUT, mask=t_fill)


def copy_and_expand_eagle_inputs(target_token_ids, target_positions, next_token_ids,
                                 query_start_loc, query_end_loc, *, padding_token_id,
                                 parallel_drafting_token_id, num_padding_slots_per_request,
                                 shift_input_ids, num_output_tokens, num_reqs):
    t = target_token_ids.shape[0]
    r = next_token_ids.shape[0]
    p = num_padding_slots_per_request
    n_out = num_output_tokens
    out_shape = [
        jax.ShapeDtypeStruct((n_out,), jnp.int32),
        jax.ShapeDtypeStruct((n_out,), jnp.int32),
        jax.ShapeDtypeStruct((n_out,), jnp.bool_),
        jax.ShapeDtypeStruct((n_out,), jnp.bool_),
        jax.ShapeDtypeStruct((r * p,), jnp.int32),
        jax.ShapeDtypeStruct((t,), jnp.int32),
    ]
    n_fill = _jt.cdiv(max(n_out, t), _FILL_BLOCK)
    if r + n_fill == 0:
        return tuple(jnp.zeros(s.shape, s.dtype) for s in out_shape)
    outs = _jt.triton_call(
        target_token_ids, target_positions, next_token_ids, query_start_loc, query_end_loc,
        num_reqs,
        kernel=_copy_and_expand_eagle_kernel,
        out_shape=out_shape,
        grid=(r + n_fill,),
        num_warps=4,
        name="specjax_copy_and_expand_eagle_inputs",
        R=r, T=t, N_OUT=n_out, P=p, SHIFT=bool(shift_input_ids),
        EXTRA=p - 1 if shift_input_ids else p,
        PADDING_TOKEN_ID=padding_token_id, PARALLEL_TOKEN_ID=parallel_drafting_token_id,
        BLOCK=_TOKEN_BLOCK, BLOCK_P=_jt.pow2_block(p, 1, 1 << 30), FILL_BLOCK=_FILL_BLOCK,
    )
    return tuple(outs)


@triton.jit
def _copy_and_expand_dflash_kernel(
    next_token_ids_ptr,  # [R]
    target_positions_ptr,  # [T]
    block_table_ptr,  # [R, NB]
    query_start_loc_ptr,  # [R + 1]
    num_rejected_ptr,  # [R], read only when HAS_REJECTED
    num_reqs_ptr,  # []
    out_input_ids_ptr,  # [R * Q]
    out_context_positions_ptr,  # [T]
    out_query_positions_ptr,  # [R * Q]
    out_context_slots_ptr,  # [T]
    out_query_slots_ptr,  # [R * Q]
    out_token_indices_ptr,  # [R * K]
    R: tl.constexpr,
    T: tl.constexpr,
    NB: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    K: tl.constexpr,
    Q: tl.constexpr,  # K + 1
    PARALLEL_TOKEN_ID: tl.constexpr,
    PAD_ID: tl.constexpr,
    HAS_REJECTED: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    FILL_BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    num_reqs = tl.minimum(tl.maximum(tl.load(num_reqs_ptr), 0), R)
    if pid < R:
        r = pid
        q = tl.arange(0, BLOCK_Q)
        qm = q < Q
        km = q < K
        if r < num_reqs:
            start = tl.load(query_start_loc_ptr + r)
            next_start = tl.load(query_start_loc_ptr + r + 1)
            row_ptr = block_table_ptr + r * NB
            for t0 in range(start, next_start, BLOCK):
                t = t0 + tl.arange(0, BLOCK)
                m = (t < next_start) & (t >= 0) & (t < T)
                pos = tl.load(target_positions_ptr + t, mask=m, other=0)
                slot = slot_of(row_ptr, pos, m, NB, BLOCK_SIZE)
                tl.store(out_context_positions_ptr + t, pos, mask=m)
                tl.store(out_context_slots_ptr + t, slot, mask=m)
            if HAS_REJECTED:
                rejected = tl.load(num_rejected_ptr + r)
            else:
                rejected = 0
            last_at = tl.minimum(tl.maximum(next_start - 1 - rejected, 0), T - 1)
            qpos = tl.load(target_positions_ptr + last_at) + 1 + q
            qslot = slot_of(row_ptr, qpos, qm, NB, BLOCK_SIZE)
            bonus = tl.load(next_token_ids_ptr + r)
            ids = tl.where(q == 0, bonus, PARALLEL_TOKEN_ID)
            tl.store(out_input_ids_ptr + r * Q + q, ids, mask=qm)
            tl.store(out_query_positions_ptr + r * Q + q, qpos, mask=qm)
            tl.store(out_query_slots_ptr + r * Q + q, qslot, mask=qm)
            tl.store(out_token_indices_ptr + r * K + q, r * Q + q + 1, mask=km)
        else:
            zeros = tl.zeros([BLOCK_Q], tl.int32)
            tl.store(out_input_ids_ptr + r * Q + q, zeros, mask=qm)
            tl.store(out_query_positions_ptr + r * Q + q, zeros, mask=qm)
            tl.store(out_query_slots_ptr + r * Q + q, zeros + PAD_ID, mask=qm)
            tl.store(out_token_indices_ptr + r * K + q, zeros, mask=km)
    else:
        i = (pid - R) * FILL_BLOCK + tl.arange(0, FILL_BLOCK)
        first = tl.load(query_start_loc_ptr)
        last = tl.load(query_start_loc_ptr + num_reqs)
        fill = (i < T) & ((i < first) | (i >= last))
        zeros = tl.zeros([FILL_BLOCK], tl.int32)
        tl.store(out_context_positions_ptr + i, zeros, mask=fill)
        tl.store(out_context_slots_ptr + i, zeros + PAD_ID, mask=fill)


def copy_and_expand_dflash_inputs(next_token_ids, target_positions, block_table, query_start_loc,
                                  num_rejected_tokens, *, parallel_drafting_token_id, block_size,
                                  num_speculative_tokens, num_reqs):
    t = target_positions.shape[0]
    r, nb = block_table.shape
    k = num_speculative_tokens
    q = 1 + k
    out_shape = [
        jax.ShapeDtypeStruct((r * q,), jnp.int32),
        jax.ShapeDtypeStruct((t,), jnp.int32),
        jax.ShapeDtypeStruct((r * q,), jnp.int32),
        jax.ShapeDtypeStruct((t,), jnp.int32),
        jax.ShapeDtypeStruct((r * q,), jnp.int32),
        jax.ShapeDtypeStruct((r * k,), jnp.int32),
    ]
    n_fill = _jt.cdiv(t, _FILL_BLOCK)
    if r + n_fill == 0:
        return tuple(jnp.zeros(s.shape, s.dtype) for s in out_shape)
    has_rejected = num_rejected_tokens is not None
    # jax-triton drops a None argument; pass any array in its place (never read).
    rejected = num_rejected_tokens if has_rejected else num_reqs
    outs = _jt.triton_call(
        next_token_ids, target_positions, block_table, query_start_loc, rejected, num_reqs,
        kernel=_copy_and_expand_dflash_kernel,
        out_shape=out_shape,
        grid=(r + n_fill,),
        num_warps=4,
        name="specjax_copy_and_expand_dflash_inputs",
        R=r, T=t, NB=nb, BLOCK_SIZE=block_size, K=k, Q=q,
        PARALLEL_TOKEN_ID=parallel_drafting_token_id, PAD_ID=PADDING_SLOT_ID,
        HAS_REJECTED=has_rejected, BLOCK=_TOKEN_BLOCK, BLOCK_Q=_jt.pow2_block(q, 1, 1 << 30),
        FILL_BLOCK=_FILL_BLOCK,
    )
    return tuple(outs)

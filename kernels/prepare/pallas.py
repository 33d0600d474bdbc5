"""``eagle_prepare_inputs_padded`` and ``eagle_prepare_next_token_padded`` as Mosaic GPU
kernels: one program per chunk of 128 requests, one request per lane, vector loads only."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from specjax.kernels import _pallas as c

_INT32_MAX = 2**31 - 1


def _prepare_inputs_body(cu_ref, valid_ref, qsl_ref, n_ref, index_out, rejected_out, *, rows):
    b0 = c.program_id() * c.LANES
    real = b0 + c.lanes() < c.num_real(n_ref, rows)
    # cu_ref holds a leading 0: cu_ref[r + 1] = cu[r] and cu_ref[r] = cu[r - 1] (0 for r = 0).
    n_draft = cu_ref[c.chunk(b0 + 1)] - cu_ref[c.chunk(b0)]
    rejected = jnp.where(n_draft > 0, n_draft + 1 - valid_ref[c.chunk(b0)], 0)
    index = qsl_ref[c.chunk(b0 + 1)] - 1 - rejected
    index_out[c.chunk(b0)] = jnp.where(real, index, 0)
    rejected_out[c.chunk(b0)] = jnp.where(real, rejected, 0)


@jax.jit
def eagle_prepare_inputs_padded(cu_num_draft_tokens, valid_sampled_tokens_count, query_start_loc,
                                *, num_reqs):
    r = cu_num_draft_tokens.shape[0]
    if r == 0:
        empty = jnp.zeros((0,), c.I32)
        return empty, empty
    programs = c.cdiv(r, c.LANES)
    padded = programs * c.LANES
    vec = jax.ShapeDtypeStruct((padded,), c.I32)
    body = functools.partial(_prepare_inputs_body, rows=r)
    index, rejected = c.run_kernel(body, (vec, vec), programs, "eagle_prepare_inputs_padded")(
        c.pad_rows(cu_num_draft_tokens, padded + 1, before=1),
        c.pad_rows(valid_sampled_tokens_count, padded),
        c.pad_rows(query_start_loc, padded + 1),
        num_reqs.reshape(1),
    )
    return c.head(index, r), c.head(rejected, r)


def _next_token_body(sampled_ref, discard_ref, backup_ref, n_ref, next_out, count_out, *, rows,
                     num_sampled, vocab_size):
    b0 = c.program_id() * c.LANES
    real = b0 + c.lanes() < c.num_real(n_ref, rows)
    count = c.full(0)
    last = c.full(0)
    for s in range(num_sampled):  # S = k + 1 is small and static
        token = sampled_ref[c.chunk(b0), s]
        valid = token != -1
        if vocab_size <= _INT32_MAX:  # otherwise every int32 is below the vocabulary size
            valid = valid & (token < vocab_size)
        count = count + valid.astype(c.I32)
        last = jnp.where(valid, token, last)
    # Masks are compared, never negated: Mosaic GPU lowers `~` on bool vectors through an
    # int round trip that it cannot convert back to i1.
    kept = discard_ref[c.chunk(b0)] == 0
    next_ids = jnp.where((count > 0) & kept, last, backup_ref[c.chunk(b0)])
    count = jnp.where(kept, count, 0)
    next_out[c.chunk(b0)] = jnp.where(real, next_ids, 0)
    count_out[c.chunk(b0)] = jnp.where(real, count, 0)


@functools.partial(jax.jit, static_argnames=("vocab_size",))
def eagle_prepare_next_token_padded(sampled_token_ids, discard_request_mask, backup_next_token_ids,
                                    *, vocab_size, num_reqs):
    r, s = sampled_token_ids.shape
    if r == 0:
        empty = jnp.zeros((0,), c.I32)
        return empty, empty
    programs = c.cdiv(r, c.LANES)
    padded = programs * c.LANES
    vec = jax.ShapeDtypeStruct((padded,), c.I32)
    body = functools.partial(_next_token_body, rows=r, num_sampled=s, vocab_size=vocab_size)
    next_ids, count = c.run_kernel(body, (vec, vec), programs, "eagle_prepare_next_token_padded")(
        c.pad_rows(sampled_token_ids, padded),
        c.pad_rows(discard_request_mask.astype(c.I32), padded),  # i1 refs do not vector-load
        c.pad_rows(backup_next_token_ids, padded),
        num_reqs.reshape(1),
    )
    return c.head(next_ids, r), c.head(count, r)

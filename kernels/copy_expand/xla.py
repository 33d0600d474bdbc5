"""XLA backend of :mod:`specjax.kernels.copy_expand`: the reference and the CPU path."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from specjax.constants import PADDING_SLOT_ID
from specjax.kernels._xla import _I32, _owner, _slot


@functools.partial(
    jax.jit,
    static_argnames=("padding_token_id", "parallel_drafting_token_id",
                     "num_padding_slots_per_request", "shift_input_ids", "num_output_tokens"),
)
def copy_and_expand_eagle_inputs(target_token_ids, target_positions, next_token_ids,
                                 query_start_loc, query_end_loc, *, padding_token_id,
                                 parallel_drafting_token_id, num_padding_slots_per_request,
                                 shift_input_ids, num_output_tokens, num_reqs):
    t = target_token_ids.shape[0]
    r = next_token_ids.shape[0]
    p = num_padding_slots_per_request
    shift = 1 if shift_input_ids else 0
    if r == 0:  # no request at all: every output is fill
        z = jnp.zeros((num_output_tokens,), _I32)
        f = jnp.zeros((num_output_tokens,), jnp.bool_)
        return z, z, f, f, jnp.zeros((0,), _I32), jnp.full((t,), num_output_tokens, _I32)
    # Output ranges are contiguous: request r's output starts at qsl[r] + r * (P - shift)
    # and is next_start - start + P - shift long.
    rows = jnp.arange(r, dtype=_I32)
    starts = query_start_loc[:-1]
    out_starts = starts + rows * (p - shift)
    n_valid = query_end_loc - starts + (1 - shift)
    out_total = query_start_loc[num_reqs] + num_reqs * (p - shift)

    o = jnp.arange(num_output_tokens, dtype=_I32)
    row, after_first = _owner(out_starts, o, num_reqs)
    live = after_first & (o < out_total)
    j = o - out_starts[row]
    v = n_valid[row]
    src = jnp.clip(starts[row] + shift + j, 0, max(t - 1, 0))
    copied = target_token_ids[src] if t > 0 else jnp.zeros_like(o)
    is_masked = live & (j > v) & (j < v + p)
    is_rejected = live & (j >= v + p)
    ids = jnp.where(j < v, copied, next_token_ids[row])
    ids = jnp.where(j > v, parallel_drafting_token_id, ids)
    ids = jnp.where(j >= v + p, padding_token_id, ids)
    first_pos = target_positions[jnp.clip(starts[row], 0, max(t - 1, 0))] if t > 0 else o
    positions = jnp.where(is_rejected, 0, first_pos + j)
    ids = jnp.where(live, ids, 0)
    positions = jnp.where(live, positions, 0)

    real = rows < num_reqs
    new_idx = out_starts[:, None] + n_valid[:, None] + jnp.arange(p, dtype=_I32)[None, :]
    new_idx = jnp.where(real[:, None], new_idx, 0).reshape(r * p)

    tok = jnp.arange(t, dtype=_I32)
    trow, t_after = _owner(starts, tok, num_reqs)
    t_live = t_after & (tok < query_start_loc[num_reqs])
    mapping = jnp.where(t_live, out_starts[trow] + (tok - starts[trow]), num_output_tokens)
    return ids, positions, is_rejected, is_masked, new_idx, mapping


@functools.partial(
    jax.jit,
    static_argnames=("parallel_drafting_token_id", "block_size", "num_speculative_tokens"),
)
def copy_and_expand_dflash_inputs(next_token_ids, target_positions, block_table, query_start_loc,
                                  num_rejected_tokens, *, parallel_drafting_token_id, block_size,
                                  num_speculative_tokens, num_reqs):
    t = target_positions.shape[0]
    r = next_token_ids.shape[0]
    k = num_speculative_tokens
    q = 1 + k
    if r == 0:  # no request at all: every output is fill
        e = jnp.zeros((0,), _I32)
        return e, jnp.zeros((t,), _I32), e, jnp.full((t,), PADDING_SLOT_ID, _I32), e, e
    rows = jnp.arange(r, dtype=_I32)
    real = rows < num_reqs

    tok = jnp.arange(t, dtype=_I32)
    trow, t_after = _owner(query_start_loc[:-1], tok, num_reqs)
    t_live = t_after & (tok < query_start_loc[num_reqs])
    ctx_pos = jnp.where(t_live, target_positions, 0)
    ctx_slot = jnp.where(t_live, _slot(block_table, trow, ctx_pos, block_size), PADDING_SLOT_ID)

    rejected = 0 if num_rejected_tokens is None else num_rejected_tokens
    last_idx = jnp.clip(query_start_loc[1:] - 1 - rejected, 0, t - 1)
    qpos = target_positions[last_idx][:, None] + 1 + jnp.arange(q, dtype=_I32)[None, :]
    qslot = _slot(block_table, rows[:, None], qpos, block_size)
    qids = jnp.where(jnp.arange(q)[None, :] == 0, next_token_ids[:, None],
                     parallel_drafting_token_id)
    live = real[:, None]
    qids = jnp.where(live, qids, 0).reshape(r * q)
    qpos = jnp.where(live, qpos, 0)
    qslot = jnp.where(live, qslot, PADDING_SLOT_ID).reshape(r * q)
    sample = rows[:, None] * q + jnp.arange(1, q, dtype=_I32)[None, :]
    sample = jnp.where(live, sample, 0).reshape(r * k)
    return qids, ctx_pos, qpos.reshape(r * q), ctx_slot, qslot, sample

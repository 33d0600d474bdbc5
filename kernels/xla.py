"""Pure ``jax.numpy`` versions of the index kernels: the reference and the CPU path.

Arguments arrive normalized by :mod:`specjax.kernels._api` (int32 arrays, 0-d int32
``num_reqs``); the semantics are the docstrings there. Everything is vectorized over
tokens and requests: no Python loop depends on data, so each op is one fused XLA
computation per shape bucket.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from specjax.attention import CommonAttentionMetadata
from specjax.constants import PADDING_SLOT_ID

_I32 = jnp.int32
_BIG = jnp.iinfo(jnp.int32).max


def _owner(starts: jax.Array, idx: jax.Array, num_reqs: jax.Array):
    """Row owning each index, for rows laid out back to back from ``starts``.

    ``starts``: ``[R]`` non-decreasing start of each row (rows >= num_reqs ignored);
    ``idx``: ``[N]``. Returns the row ``[N]`` (clipped to [0, R-1]) and whether the index
    lies before the first start (``False`` means it belongs to some real row, subject to
    the caller's end check).
    """
    r = starts.shape[0]
    real = jnp.arange(r, dtype=_I32) < num_reqs
    keyed = jnp.where(real, starts, _BIG)
    # "scan_unrolled": a fixed unrolled bisection; the default "scan" is a while loop, which
    # on GPU costs a device->host predicate sync per iteration (~800 us at 1024 requests).
    row = jnp.searchsorted(keyed, idx, side="right", method="scan_unrolled").astype(_I32) - 1
    return jnp.clip(row, 0, max(r - 1, 0)), row >= 0


def _slot(block_table: jax.Array, row: jax.Array, pos: jax.Array, block_size: int) -> jax.Array:
    nb = block_table.shape[1]
    blk = jnp.minimum(pos // block_size, nb - 1)
    return block_table[row, blk] * block_size + pos % block_size


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


@jax.jit
def eagle_prepare_inputs_padded(cu_num_draft_tokens, valid_sampled_tokens_count, query_start_loc,
                                *, num_reqs):
    r = cu_num_draft_tokens.shape[0]
    real = jnp.arange(r, dtype=_I32) < num_reqs
    prev = jnp.concatenate([jnp.zeros((1,), _I32), cu_num_draft_tokens[:-1]])
    n_draft = cu_num_draft_tokens - prev
    rejected = jnp.where(n_draft > 0, n_draft + 1 - valid_sampled_tokens_count, 0)
    index = query_start_loc[1:] - 1 - rejected
    return jnp.where(real, index, 0), jnp.where(real, rejected, 0)


@functools.partial(jax.jit, static_argnames=("vocab_size",))
def eagle_prepare_next_token_padded(sampled_token_ids, discard_request_mask, backup_next_token_ids,
                                    *, vocab_size, num_reqs):
    r, s = sampled_token_ids.shape
    real = jnp.arange(r, dtype=_I32) < num_reqs
    valid = (sampled_token_ids != -1) & (sampled_token_ids < vocab_size)
    count = valid.sum(axis=1, dtype=_I32)
    last = jnp.max(jnp.where(valid, jnp.arange(s, dtype=_I32)[None, :], 0), axis=1)
    token = jnp.take_along_axis(sampled_token_ids, last[:, None], axis=1)[:, 0]
    next_ids = jnp.where((count > 0) & ~discard_request_mask, token, backup_next_token_ids)
    count = jnp.where(discard_request_mask, 0, count)
    return jnp.where(real, next_ids, 0), jnp.where(real, count, 0)


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


# ----------------------------------------------------------------------------- XLA-only ops


@functools.partial(jax.jit, static_argnames=("block_size", "num_new_tokens", "max_model_len"))
def compute_new_slot_mapping(cad: CommonAttentionMetadata, new_positions, is_rejected_token_mask,
                             *, block_size: int, num_new_tokens: int, max_model_len: int):
    """Slot mapping after every query grew by ``num_new_tokens`` (vLLM's helper).

    ``new_positions``, ``is_rejected_token_mask``: ``[T_new]`` in the expanded layout, where
    request r's tokens start at ``query_start_loc[r] + r * num_new_tokens``. Returns
    ``[T_new] int32``: the slot of each position (clamped to ``max_model_len - 1`` for the
    lookup), -1 where the position is ``>= max_model_len``, the token is rejected, or it
    belongs to no real request.
    """
    t_new = new_positions.shape[0]
    qsl = cad.query_start_loc
    r = qsl.shape[0] - 1
    n = cad.num_reqs
    starts = qsl[:-1] + jnp.arange(r, dtype=_I32) * num_new_tokens
    tok = jnp.arange(t_new, dtype=_I32)
    row, after = _owner(starts, tok, n)
    live = after & (tok < qsl[n] + n * num_new_tokens)
    clamped = jnp.minimum(new_positions, max_model_len - 1)
    slot = _slot(cad.block_table, row, clamped, block_size)
    dead = (new_positions >= max_model_len) | is_rejected_token_mask | ~live
    return jnp.where(dead, PADDING_SLOT_ID, slot)


def extend_all_queries_by_N(cad: CommonAttentionMetadata, N: int, new_slot_mapping
                            ) -> CommonAttentionMetadata:
    """Every real query grows by ``N`` tokens (vLLM's helper, padding-aware).

    ``query_start_loc[i] += N * min(i, num_reqs)`` (padding rows keep repeating the last
    real value), real ``seq_lens += N``, ``num_actual_tokens += num_reqs * N``,
    ``max_query_len`` and ``max_seq_len += N``, and the slot mapping is replaced.
    """
    if isinstance(N, bool) or not isinstance(N, int) or N < 0:
        raise ValueError(f"N must be a non-negative int, got {N!r}")
    n = cad.num_reqs
    idx = jnp.arange(cad.query_start_loc.shape[0], dtype=_I32)
    real = jnp.arange(cad.seq_lens.shape[0], dtype=_I32) < n
    return cad.replace(
        query_start_loc=cad.query_start_loc + N * jnp.minimum(idx, n),
        seq_lens=jnp.where(real, cad.seq_lens + N, cad.seq_lens),
        num_actual_tokens=cad.num_actual_tokens + n * N,
        max_query_len=cad.max_query_len + N,
        max_seq_len=cad.max_seq_len + N,
        slot_mapping=jnp.asarray(new_slot_mapping, _I32),
    )


@jax.jit
def update_num_computed_tokens_for_batch_change(num_computed_tokens, num_accepted_tokens,
                                                prev_positions, valid_sampled_token_count,
                                                prev_num_draft_tokens, cpu_num_computed_tokens):
    """Correct async-scheduling drift after the batch changed (vLLM's helper, functional).

    ``prev_positions [B]``: previous batch index of each request, -1 if new. Gathered
    through it from the previous step's arrays: the valid count, computed count and draft
    count. A request participates when ``prev_positions >= 0`` and it had drafts.
    Returns ``(num_computed_tokens, num_accepted_tokens)`` with the first ``B`` entries
    replaced: participating ``prev_computed + valid`` and ``valid``, others
    ``cpu_num_computed_tokens`` and the unchanged accepted count.
    """
    b = prev_positions.shape[0]
    g = jnp.maximum(prev_positions, 0)
    valid = valid_sampled_token_count[g].astype(num_computed_tokens.dtype)
    part = (prev_positions >= 0) & (prev_num_draft_tokens[g] > 0)
    computed = jnp.where(part, num_computed_tokens[g] + valid, cpu_num_computed_tokens[:b])
    accepted = jnp.where(part, valid.astype(num_accepted_tokens.dtype), num_accepted_tokens[:b])
    return num_computed_tokens.at[:b].set(computed), num_accepted_tokens.at[:b].set(accepted)

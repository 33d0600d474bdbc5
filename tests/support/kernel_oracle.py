"""NumPy oracle for the five index kernels of :mod:`specjax.kernels`.

Written only from the docstrings of ``kernels/_api.py`` (the specification), with no look at
any backend: one plain Python loop per request, every quantity computed with Python ints
(arbitrary precision, so at least int64) and cast to int32 only when stored. Clarity over
speed. Each function takes the public op's argument names (``num_reqs`` a Python int, a 0-d
array, or None for "every row is real") and returns NumPy arrays with the public dtypes.
"""

from __future__ import annotations

import numpy as np

PADDING_SLOT_ID = -1


def _i32(values) -> np.ndarray:
    """Store Python ints as int32, wrapping like a two's-complement int32 store would."""
    a = np.asarray(values, dtype=np.int64)
    return a.astype(np.int32)


def _as_int_list(x) -> list[int]:
    return [int(v) for v in np.asarray(x).reshape(-1)]


def _real_rows(num_reqs, rows: int) -> int:
    if num_reqs is None:
        return rows
    n = int(np.asarray(num_reqs))
    assert 0 <= n <= rows, (n, rows)
    return n


def _slot(block_row: list[int], pos: int, block_size: int) -> int:
    """``block_table[r, min(pos // block_size, nb - 1)] * block_size + pos % block_size``."""
    nb = len(block_row)
    blk = min(pos // block_size, nb - 1)
    return block_row[blk] * block_size + pos % block_size


# ----------------------------------------------------------------------------- op 1


def eagle_step_update_slot_mapping_and_metadata(
    positions, block_table, seq_lens, *, block_size, max_model_len, input_batch_size=None,
    num_reqs=None,
):
    """Oracle of the op of the same name: ``(clamped_positions, slot_mapping, seq_lens)``."""
    pos = _as_int_list(positions)
    bt = np.asarray(block_table)
    sl = _as_int_list(seq_lens)
    b = len(pos)
    if input_batch_size is None:
        input_batch_size = b
    n = _real_rows(num_reqs, b)

    out_pos = [0] * b
    out_slot = [PADDING_SLOT_ID] * input_batch_size
    out_sl = [0] * b
    for r in range(n):
        new = pos[r] + 1
        if new >= max_model_len:
            out_pos[r] = 0
            out_slot[r] = PADDING_SLOT_ID
            seq = 1
        else:
            out_pos[r] = new
            out_slot[r] = _slot(_as_int_list(bt[r]), new, block_size)
            seq = sl[r] + 1
        out_sl[r] = min(seq, max_model_len)
    return _i32(out_pos), _i32(out_slot), _i32(out_sl)


# ----------------------------------------------------------------------------- op 2


def eagle_prepare_inputs_padded(
    cu_num_draft_tokens, valid_sampled_tokens_count, query_start_loc, *, num_reqs=None,
):
    """Oracle: ``(token_indices_to_sample, num_rejected_tokens)``."""
    cu = _as_int_list(cu_num_draft_tokens)
    valid = _as_int_list(valid_sampled_tokens_count)
    qsl = _as_int_list(query_start_loc)
    rows = len(cu)
    n = _real_rows(num_reqs, rows)

    index = [0] * rows
    rejected = [0] * rows
    for r in range(n):
        prev = cu[r - 1] if r > 0 else 0
        n_draft = cu[r] - prev
        rej = 0 if n_draft == 0 else n_draft + 1 - valid[r]
        rejected[r] = rej
        index[r] = qsl[r + 1] - 1 - rej
    return _i32(index), _i32(rejected)


# ----------------------------------------------------------------------------- op 3


def eagle_prepare_next_token_padded(
    sampled_token_ids, discard_request_mask, backup_next_token_ids, *, vocab_size,
    num_reqs=None,
):
    """Oracle: ``(next_token_ids, valid_sampled_tokens_count)``."""
    sampled = np.asarray(sampled_token_ids)
    discard = [bool(v) for v in np.asarray(discard_request_mask).reshape(-1)]
    backup = _as_int_list(backup_next_token_ids)
    rows = sampled.shape[0]
    n = _real_rows(num_reqs, rows)

    nxt = [0] * rows
    count = [0] * rows
    for r in range(n):
        if discard[r]:
            nxt[r] = backup[r]
            count[r] = 0
            continue
        c = 0
        last_valid = None
        for t in _as_int_list(sampled[r]):
            if t != -1 and t < vocab_size:
                c += 1
                last_valid = t  # scanning left to right: ends at the highest valid index
        count[r] = c
        nxt[r] = backup[r] if c == 0 else last_valid
    return _i32(nxt), _i32(count)


# ----------------------------------------------------------------------------- op 4


def copy_and_expand_eagle_inputs(
    target_token_ids, target_positions, next_token_ids, query_start_loc, query_end_loc, *,
    padding_token_id, parallel_drafting_token_id, num_padding_slots_per_request,
    shift_input_ids, num_output_tokens, num_reqs=None,
):
    """Oracle: ``(input_ids, positions, is_rejected_token_mask, is_masked_token_mask,
    new_token_indices, hidden_state_mapping)``."""
    ids = _as_int_list(target_token_ids)
    tpos = _as_int_list(target_positions)
    nxt = _as_int_list(next_token_ids)
    qsl = _as_int_list(query_start_loc)
    qel = _as_int_list(query_end_loc)
    rows = len(nxt)
    t_total = len(ids)
    p_slots = num_padding_slots_per_request
    n_out = num_output_tokens
    n = _real_rows(num_reqs, rows)

    out_ids = [0] * n_out
    out_pos = [0] * n_out
    out_rej = [False] * n_out
    out_mask = [False] * n_out
    new_idx = [0] * (rows * p_slots)
    hs_map = [n_out] * t_total

    for r in range(n):
        start, next_start, end = qsl[r], qsl[r + 1], qel[r]
        assert start <= end < next_start, ("precondition", r, start, end, next_start)
        if shift_input_ids:
            v = end - start
            read_from = start + 1
            o = start + r * (p_slots - 1)
        else:
            v = end - start + 1
            read_from = start
            o = start + r * p_slots
        rejected = next_start - end - 1
        base_pos = tpos[start]
        for j in range(v + p_slots + rejected):
            if j < v:
                tok, is_rej, is_mask = ids[read_from + j], False, False
            elif j == v:
                tok, is_rej, is_mask = nxt[r], False, False
            elif j < v + p_slots:
                tok, is_rej, is_mask = parallel_drafting_token_id, False, True
            else:
                tok, is_rej, is_mask = padding_token_id, True, False
            pos = 0 if is_rej else base_pos + j
            dst = o + j
            if 0 <= dst < n_out:  # writes past num_output_tokens are dropped
                out_ids[dst] = tok
                out_pos[dst] = pos
                out_rej[dst] = is_rej
                out_mask[dst] = is_mask
        for p in range(p_slots):
            new_idx[r * p_slots + p] = o + v + p
        for t in range(start, next_start):
            hs_map[t] = o + (t - start)

    return (
        _i32(out_ids), _i32(out_pos), np.asarray(out_rej, dtype=bool),
        np.asarray(out_mask, dtype=bool), _i32(new_idx), _i32(hs_map),
    )


# ----------------------------------------------------------------------------- op 5


def copy_and_expand_dflash_inputs(
    next_token_ids, target_positions, block_table, query_start_loc, num_rejected_tokens, *,
    parallel_drafting_token_id, block_size, num_speculative_tokens, num_reqs=None,
):
    """Oracle: ``(input_ids, context_positions, query_positions, context_slot_mapping,
    query_slot_mapping, token_indices_to_sample)``."""
    nxt = _as_int_list(next_token_ids)
    tpos = _as_int_list(target_positions)
    bt = np.asarray(block_table)
    qsl = _as_int_list(query_start_loc)
    rows = len(nxt)
    rej = [0] * rows if num_rejected_tokens is None else _as_int_list(num_rejected_tokens)
    t_total = len(tpos)
    k = num_speculative_tokens
    q_len = 1 + k
    n = _real_rows(num_reqs, rows)

    input_ids = [0] * (rows * q_len)
    ctx_pos = [0] * t_total
    query_pos = [0] * (rows * q_len)
    ctx_slot = [PADDING_SLOT_ID] * t_total
    query_slot = [PADDING_SLOT_ID] * (rows * q_len)
    sample_idx = [0] * (rows * k)

    for r in range(n):
        row = _as_int_list(bt[r])
        start, next_start = qsl[r], qsl[r + 1]
        for t in range(start, next_start):
            pos = tpos[t]
            ctx_pos[t] = pos
            ctx_slot[t] = _slot(row, pos, block_size)
        last_at = min(max(next_start - 1 - rej[r], 0), t_total - 1)
        last = tpos[last_at]
        for q in range(q_len):
            pos = last + 1 + q
            query_pos[r * q_len + q] = pos
            query_slot[r * q_len + q] = _slot(row, pos, block_size)
            input_ids[r * q_len + q] = nxt[r] if q == 0 else parallel_drafting_token_id
            if q >= 1:
                sample_idx[r * k + q - 1] = r * q_len + q

    return (
        _i32(input_ids), _i32(ctx_pos), _i32(query_pos), _i32(ctx_slot), _i32(query_slot),
        _i32(sample_idx),
    )


OPS = {
    "eagle_step_update_slot_mapping_and_metadata": eagle_step_update_slot_mapping_and_metadata,
    "eagle_prepare_inputs_padded": eagle_prepare_inputs_padded,
    "eagle_prepare_next_token_padded": eagle_prepare_next_token_padded,
    "copy_and_expand_eagle_inputs": copy_and_expand_eagle_inputs,
    "copy_and_expand_dflash_inputs": copy_and_expand_dflash_inputs,
}

"""Copy-and-expand of the target batch into the drafter's input (EAGLE / draft model, DFlash):
the docstrings below specify every backend bit for bit; ``backend=``: :mod:`~specjax.kernels.backend`."""

from __future__ import annotations

import numpy as np

from specjax.kernels import _checks as c
from specjax.kernels.backend import op_module, resolve_backend

__all__ = ["copy_and_expand_eagle_inputs", "copy_and_expand_dflash_inputs"]


def copy_and_expand_eagle_inputs(
    target_token_ids,
    target_positions,
    next_token_ids,
    query_start_loc,
    query_end_loc,
    *,
    padding_token_id: int,
    parallel_drafting_token_id: int,
    num_padding_slots_per_request: int,
    shift_input_ids: bool,
    num_output_tokens: int,
    num_reqs=None,
    backend: str = "auto",
):
    """Copy the target batch into the drafter's input, adding P extra slots per request.

    Args:
      target_token_ids, target_positions: ``[T] int32``.
      next_token_ids: ``[R] int32`` (the bonus token of each request).
      query_start_loc: ``[R+1] int32``; query_end_loc: ``[R] int32``, the last *valid*
        (non-rejected) token of each request, ``start <= end < next_start``.
      num_padding_slots_per_request: P >= 1 (bonus + P - 1 parallel-drafting slots).
      shift_input_ids: True for EAGLE (inputs read from +1), False for draft models.
      num_output_tokens: static size of the per-token outputs.

    Per real request r with ``start, next_start = qsl[r], qsl[r+1]``, ``end = qel[r]``:
    with shift ``V = end - start``, inputs read from ``start + 1 + j`` and the output
    starts at ``o = start + r * (P - 1)``; without shift ``V = end - start + 1``, inputs
    read from ``start + j`` and ``o = start + r * P``. ``rejected = next_start - end - 1``.
    Output j in ``[0, V + P + rejected)`` at ``o + j``: j < V the copied token; j == V
    the bonus ``next_token_ids[r]``; V < j < V + P ``parallel_drafting_token_id`` with the
    masked flag; j >= V + P ``padding_token_id`` with the rejected flag. Positions are
    ``target_positions[start] + j``, 0 on rejected slots. ``new_token_indices[r*P + p] =
    o + V + p`` for p < P. ``hidden_state_mapping[t] = o + (t - start)`` for t in
    ``[start, next_start)`` (vLLM writes it only with shift; specjax defines it in both
    modes). Writes past ``num_output_tokens`` are dropped.

    Returns:
      ``(input_ids, positions, is_rejected_token_mask, is_masked_token_mask)`` each
      ``[num_output_tokens]`` (int32, int32, bool, bool), ``new_token_indices [R*P]``
      int32, ``hidden_state_mapping [T]`` int32. Output slots no real request writes hold
      0 / 0 / False / False; ``new_token_indices`` of padding rows is 0;
      ``hidden_state_mapping`` of tokens of no real request is ``num_output_tokens`` (out of
      range, so a ``.at[...].set(mode="drop")`` scatter skips them).
    """
    backend = resolve_backend(backend)
    ids = c.index_array("target_token_ids", target_token_ids, 1)
    pos = c.index_array("target_positions", target_positions, 1)
    nxt = c.index_array("next_token_ids", next_token_ids, 1)
    qsl = c.index_array("query_start_loc", query_start_loc, 1)
    qel = c.index_array("query_end_loc", query_end_loc, 1)
    c.same_len("copy_and_expand_eagle_inputs", target_token_ids=ids, target_positions=pos)
    c.same_len("copy_and_expand_eagle_inputs", next_token_ids=nxt, query_end_loc=qel)
    r = nxt.shape[0]
    if qsl.shape[0] != r + 1:
        raise ValueError(f"query_start_loc must have length R+1={r + 1}, got {qsl.shape[0]}")
    if not isinstance(shift_input_ids, (bool, np.bool_)):
        raise ValueError(f"shift_input_ids must be a bool, got {shift_input_ids!r}")
    p = c.positive_int("num_padding_slots_per_request", num_padding_slots_per_request)
    n_out = c.nonneg_int("num_output_tokens", num_output_tokens)
    c.check_index_range("num_output_tokens", n_out)
    return op_module(__name__, backend).copy_and_expand_eagle_inputs(
        ids, pos, nxt, qsl, qel,
        padding_token_id=c.as_int("padding_token_id", padding_token_id),
        parallel_drafting_token_id=c.as_int("parallel_drafting_token_id", parallel_drafting_token_id),
        num_padding_slots_per_request=p, shift_input_ids=bool(shift_input_ids),
        num_output_tokens=n_out, num_reqs=c.num_reqs(num_reqs, r))


def copy_and_expand_dflash_inputs(
    next_token_ids,
    target_positions,
    block_table,
    query_start_loc,
    num_rejected_tokens,
    *,
    parallel_drafting_token_id: int,
    block_size: int,
    num_speculative_tokens: int,
    num_reqs=None,
    backend: str = "auto",
):
    """DFlash inputs: context positions/slots, and the ``[bonus, mask * k]`` query block.

    Args:
      next_token_ids: ``[R] int32``; target_positions: ``[T] int32`` (>= 0);
      block_table: ``[R, nb] int32``; query_start_loc: ``[R+1] int32`` (the context of
      request r is ``[qsl[r], qsl[r+1])``); num_rejected_tokens: ``[R] int32`` or None.
      num_speculative_tokens: k >= 1; Q = 1 + k query tokens per request.

    Per real request r: context tokens t keep their position, with slot
    ``block_table[r, min(pos // block_size, nb - 1)] * block_size + pos % block_size``.
    ``last = target_positions[clip(qsl[r+1] - 1 - rejected[r], 0, T - 1)]``; query q has
    position ``last + 1 + q`` and a slot computed the same way; its id is the bonus token
    for q == 0, else ``parallel_drafting_token_id``. ``token_indices_to_sample[r*k + q-1] =
    r*Q + q`` for q >= 1.

    Returns:
      ``(input_ids [R*Q], context_positions [T], query_positions [R*Q],
      context_slot_mapping [T], query_slot_mapping [R*Q], token_indices_to_sample [R*k])``,
      int32. Padding rows and tokens of no real request: id 0, position 0, slot -1, index 0.
    """
    backend = resolve_backend(backend)
    nxt = c.index_array("next_token_ids", next_token_ids, 1)
    pos = c.index_array("target_positions", target_positions, 1)
    bt = c.index_array("block_table", block_table, 2)
    qsl = c.index_array("query_start_loc", query_start_loc, 1)
    rej = None
    if num_rejected_tokens is not None:
        rej = c.index_array("num_rejected_tokens", num_rejected_tokens, 1)
        c.same_len("copy_and_expand_dflash_inputs", next_token_ids=nxt, num_rejected_tokens=rej)
    c.same_len("copy_and_expand_dflash_inputs", next_token_ids=nxt, block_table=bt)
    r = nxt.shape[0]
    if qsl.shape[0] != r + 1:
        raise ValueError(f"query_start_loc must have length R+1={r + 1}, got {qsl.shape[0]}")
    if pos.shape[0] < 1:
        raise ValueError("target_positions must hold at least one token")
    if bt.shape[1] < 1:
        raise ValueError("block_table must have at least one column")
    block_size = c.positive_int("block_size", block_size)
    c.check_index_range("block_table.shape[1] * block_size", bt.shape[1] * block_size)
    k = c.positive_int("num_speculative_tokens", num_speculative_tokens)
    return op_module(__name__, backend).copy_and_expand_dflash_inputs(
        nxt, pos, bt, qsl, rej,
        parallel_drafting_token_id=c.as_int("parallel_drafting_token_id", parallel_drafting_token_id),
        block_size=block_size, num_speculative_tokens=k, num_reqs=c.num_reqs(num_reqs, r))

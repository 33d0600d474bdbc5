"""EAGLE's per-draft-step update of slot mapping, positions and seq_lens: the docstring
below specifies every backend bit for bit; ``backend=``: :mod:`~specjax.kernels.backend`."""

from __future__ import annotations

from specjax.kernels import _checks as c
from specjax.kernels.backend import op_module, resolve_backend

__all__ = ["eagle_step_update_slot_mapping_and_metadata"]


def eagle_step_update_slot_mapping_and_metadata(
    positions,
    block_table,
    seq_lens,
    *,
    block_size: int,
    max_model_len: int,
    input_batch_size: int | None = None,
    num_reqs=None,
    backend: str = "auto",
):
    """Advance each request one draft position; its slot and seq_len.

    Args:
      positions: ``[B] int32``, current position of each request (>= 0).
      block_table: ``[B, nb] int32``.
      seq_lens: ``[B] int32``.
      block_size, max_model_len: positive ints.
      input_batch_size: padded size of ``slot_mapping`` (>= B; default B).
      num_reqs: optional 0-d int32, the number of real rows.

    Returns:
      ``(clamped_positions [B], slot_mapping [input_batch_size], seq_lens [B])``, int32.
      For a real row r with ``new = positions[r] + 1``: if ``new >= max_model_len`` the
      position is 0, the slot -1 and the seq_len 1; otherwise the position is ``new``, the
      slot ``block_table[r, min(new // block_size, nb - 1)] * block_size + new %
      block_size`` and the seq_len ``seq_lens[r] + 1``; seq_len is then capped at
      ``max_model_len``. Rows ``num_reqs <= r < B`` give position 0, slot -1, seq_len 0;
      ``slot_mapping[B:]`` is -1.
    """
    backend = resolve_backend(backend)
    block_size = c.positive_int("block_size", block_size)
    max_model_len = c.positive_int("max_model_len", max_model_len)
    c.check_index_range("max_model_len", max_model_len)
    positions = c.index_array("positions", positions, 1)
    block_table = c.index_array("block_table", block_table, 2)
    seq_lens = c.index_array("seq_lens", seq_lens, 1)
    c.same_len("eagle_step_update_slot_mapping_and_metadata", positions=positions,
              block_table=block_table, seq_lens=seq_lens)
    b = positions.shape[0]
    if block_table.shape[1] < 1:
        raise ValueError("block_table must have at least one column")
    c.check_index_range("block_table.shape[1] * block_size", block_table.shape[1] * block_size)
    if input_batch_size is None:
        input_batch_size = b
    input_batch_size = c.nonneg_int("input_batch_size", input_batch_size)
    if input_batch_size < b:
        raise ValueError(f"input_batch_size={input_batch_size} must be >= batch size {b}")
    return op_module(__name__, backend).eagle_step_update_slot_mapping_and_metadata(
        positions, block_table, seq_lens, block_size=block_size, max_model_len=max_model_len,
        input_batch_size=input_batch_size, num_reqs=c.num_reqs(num_reqs, b))

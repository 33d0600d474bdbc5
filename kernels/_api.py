"""Public kernel entry points: argument checks, then dispatch to one backend.

Every backend module (``xla``, ``pallas``, ``triton``) exposes the five functions below
with the same keyword signature minus ``backend``, and receives normalized arguments:
index arrays as int32 ``jax.Array``, masks as bool, ``num_reqs`` always a 0-d int32
array (the full row count when the caller gave None), ``input_batch_size`` an int.
Checks look only at shapes, dtypes and static values, so they work on tracers and run
before anything is launched.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specjax import _compat
from specjax.constants import check_index_range

BACKENDS = ("auto", "xla", "pallas", "triton")

# Fastest correct backend per platform, as measured in benchmarks/RESULTS.md: XLA everywhere
# (the index kernels are launch-bound and XLA fuses them into the step), so "auto" never
# needs the Pallas or Triton backends and picks a backend that exists on every JAX in range.
_AUTO = {"cpu": "xla", "gpu": "xla", "cuda": "xla", "rocm": "xla", "tpu": "xla"}


def _platform() -> str:
    return jax.default_backend()


def _triton_available() -> tuple[bool, str]:
    """An NVIDIA GPU and an importable jax-triton (:func:`specjax._compat.jax_triton_available`)."""
    return _compat.jax_triton_available()


def resolve_backend(backend: str) -> str:
    """Map ``backend`` to a concrete backend name, or raise ValueError naming it (also when
    the backend cannot run on this JAX / machine: ``"triton"`` without a GPU or jax-triton,
    ``"pallas"`` on a JAX without a usable Pallas Mosaic GPU)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {BACKENDS}")
    if backend == "auto":
        return _AUTO.get(_platform(), "xla")
    if backend == "triton":
        ok, why = _triton_available()
        if not ok:
            raise ValueError(f"backend='triton' is unavailable: {why}")
    if backend == "pallas":
        plgpu, why = _compat.pallas_mosaic_gpu()
        if plgpu is None:
            raise ValueError(f"backend='pallas' is unavailable: {why}")
    return backend


def _module(backend: str):
    if backend == "xla":
        from specjax.kernels import xla as mod
    elif backend == "pallas":
        from specjax.kernels import pallas as mod
    else:
        from specjax.kernels import triton as mod
    return mod


# ----------------------------------------------------------------------------- checks


def _dtype(x: Any) -> np.dtype:
    return np.dtype(x.dtype) if hasattr(x, "dtype") else np.asarray(x).dtype


def _index_array(name: str, x: Any, ndim: int) -> jax.Array:
    dt = _dtype(x)
    if not np.issubdtype(dt, np.integer):
        raise ValueError(f"{name} must be an integer array (int32 preferred), got dtype {dt}")
    shape = np.shape(x)
    if len(shape) != ndim:
        raise ValueError(f"{name} must have rank {ndim}, got shape {tuple(shape)}")
    return jnp.asarray(x, dtype=jnp.int32)


def _bool_array(name: str, x: Any, ndim: int) -> jax.Array:
    dt = _dtype(x)
    if dt != np.bool_:
        raise ValueError(f"{name} must be a bool array, got dtype {dt}")
    shape = np.shape(x)
    if len(shape) != ndim:
        raise ValueError(f"{name} must have rank {ndim}, got shape {tuple(shape)}")
    return jnp.asarray(x, dtype=jnp.bool_)


def _num_reqs(num_reqs: Any, rows: int) -> jax.Array:
    if num_reqs is None:
        return jnp.asarray(rows, dtype=jnp.int32)
    dt = _dtype(num_reqs)
    if not np.issubdtype(dt, np.integer) or np.ndim(num_reqs) != 0:
        raise ValueError(
            f"num_reqs must be None or a 0-d integer array (a device scalar), got "
            f"dtype {dt} with shape {tuple(np.shape(num_reqs))}"
        )
    if not isinstance(num_reqs, jax.core.Tracer):
        n = int(num_reqs)
        if not 0 <= n <= rows:
            raise ValueError(f"num_reqs={n} must be in [0, {rows}] (the padded row count)")
    return jnp.asarray(num_reqs, dtype=jnp.int32)


def _positive_int(name: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or int(v) <= 0:
        raise ValueError(f"{name} must be a positive int, got {v!r}")
    return int(v)


def _nonneg_int(name: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or int(v) < 0:
        raise ValueError(f"{name} must be a non-negative int, got {v!r}")
    return int(v)


def _int(name: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise ValueError(f"{name} must be an int, got {v!r}")
    return int(v)


def _same_len(what: str, **arrays: Any) -> None:
    lens = {k: np.shape(v)[0] for k, v in arrays.items()}
    if len(set(lens.values())) > 1:
        raise ValueError(f"{what}: leading dimensions disagree: {lens}")


# ----------------------------------------------------------------------------- ops


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
    block_size = _positive_int("block_size", block_size)
    max_model_len = _positive_int("max_model_len", max_model_len)
    check_index_range("max_model_len", max_model_len)
    positions = _index_array("positions", positions, 1)
    block_table = _index_array("block_table", block_table, 2)
    seq_lens = _index_array("seq_lens", seq_lens, 1)
    _same_len("eagle_step_update_slot_mapping_and_metadata", positions=positions,
              block_table=block_table, seq_lens=seq_lens)
    b = positions.shape[0]
    if block_table.shape[1] < 1:
        raise ValueError("block_table must have at least one column")
    check_index_range("block_table.shape[1] * block_size", block_table.shape[1] * block_size)
    if input_batch_size is None:
        input_batch_size = b
    input_batch_size = _nonneg_int("input_batch_size", input_batch_size)
    if input_batch_size < b:
        raise ValueError(f"input_batch_size={input_batch_size} must be >= batch size {b}")
    return _module(backend).eagle_step_update_slot_mapping_and_metadata(
        positions, block_table, seq_lens, block_size=block_size, max_model_len=max_model_len,
        input_batch_size=input_batch_size, num_reqs=_num_reqs(num_reqs, b))


def eagle_prepare_inputs_padded(
    cu_num_draft_tokens,
    valid_sampled_tokens_count,
    query_start_loc,
    *,
    num_reqs=None,
    backend: str = "auto",
):
    """Which token each request samples from in padded-drafter mode, and how many it rejected.

    Args:
      cu_num_draft_tokens: ``[R] int32``, inclusive cumsum of drafts per request.
      valid_sampled_tokens_count: ``[R] int32``, accepted + 1 (0 for discarded requests).
      query_start_loc: ``[R+1] int32``.

    Returns:
      ``(token_indices_to_sample [R], num_rejected_tokens [R])``, int32. For a real row,
      ``n = cu[r] - cu[r-1]`` (``cu[-1] = 0``), ``rejected = n + 1 - valid`` (0 when
      ``n == 0``), ``index = query_start_loc[r+1] - 1 - rejected``. Rows past
      ``num_reqs`` give 0 and 0.
    """
    backend = resolve_backend(backend)
    cu = _index_array("cu_num_draft_tokens", cu_num_draft_tokens, 1)
    valid = _index_array("valid_sampled_tokens_count", valid_sampled_tokens_count, 1)
    qsl = _index_array("query_start_loc", query_start_loc, 1)
    _same_len("eagle_prepare_inputs_padded", cu_num_draft_tokens=cu,
              valid_sampled_tokens_count=valid)
    r = cu.shape[0]
    if qsl.shape[0] != r + 1:
        raise ValueError(f"query_start_loc must have length R+1={r + 1}, got {qsl.shape[0]}")
    return _module(backend).eagle_prepare_inputs_padded(
        cu, valid, qsl, num_reqs=_num_reqs(num_reqs, r))


def eagle_prepare_next_token_padded(
    sampled_token_ids,
    discard_request_mask,
    backup_next_token_ids,
    *,
    vocab_size: int,
    num_reqs=None,
    backend: str = "auto",
):
    """The next input token of each request after verification, and its valid-token count.

    Args:
      sampled_token_ids: ``[R, S] int32`` (S = k + 1), -1 marks rejected slots.
      discard_request_mask: ``[R] bool``.
      backup_next_token_ids: ``[R] int32``.
      vocab_size: positive int. A token is valid when ``t != -1 and t < vocab_size``
        (vLLM's rule; other negative ids count as valid, as there).

    Returns:
      ``(next_token_ids [R], valid_sampled_tokens_count [R])``, int32. A discarded row gives
      ``(backup, 0)``; otherwise ``count`` is the number of valid tokens and ``next`` the
      token at the highest valid index, or the backup when ``count == 0``. Rows past
      ``num_reqs`` give 0 and 0.
    """
    backend = resolve_backend(backend)
    vocab_size = _positive_int("vocab_size", vocab_size)
    check_index_range("vocab_size", vocab_size)
    sampled = _index_array("sampled_token_ids", sampled_token_ids, 2)
    discard = _bool_array("discard_request_mask", discard_request_mask, 1)
    backup = _index_array("backup_next_token_ids", backup_next_token_ids, 1)
    _same_len("eagle_prepare_next_token_padded", sampled_token_ids=sampled,
              discard_request_mask=discard, backup_next_token_ids=backup)
    if sampled.shape[1] < 1:
        raise ValueError("sampled_token_ids must have at least one column (k + 1)")
    return _module(backend).eagle_prepare_next_token_padded(
        sampled, discard, backup, vocab_size=vocab_size,
        num_reqs=_num_reqs(num_reqs, sampled.shape[0]))


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
    ids = _index_array("target_token_ids", target_token_ids, 1)
    pos = _index_array("target_positions", target_positions, 1)
    nxt = _index_array("next_token_ids", next_token_ids, 1)
    qsl = _index_array("query_start_loc", query_start_loc, 1)
    qel = _index_array("query_end_loc", query_end_loc, 1)
    _same_len("copy_and_expand_eagle_inputs", target_token_ids=ids, target_positions=pos)
    _same_len("copy_and_expand_eagle_inputs", next_token_ids=nxt, query_end_loc=qel)
    r = nxt.shape[0]
    if qsl.shape[0] != r + 1:
        raise ValueError(f"query_start_loc must have length R+1={r + 1}, got {qsl.shape[0]}")
    if not isinstance(shift_input_ids, (bool, np.bool_)):
        raise ValueError(f"shift_input_ids must be a bool, got {shift_input_ids!r}")
    p = _positive_int("num_padding_slots_per_request", num_padding_slots_per_request)
    n_out = _nonneg_int("num_output_tokens", num_output_tokens)
    check_index_range("num_output_tokens", n_out)
    return _module(backend).copy_and_expand_eagle_inputs(
        ids, pos, nxt, qsl, qel,
        padding_token_id=_int("padding_token_id", padding_token_id),
        parallel_drafting_token_id=_int("parallel_drafting_token_id", parallel_drafting_token_id),
        num_padding_slots_per_request=p, shift_input_ids=bool(shift_input_ids),
        num_output_tokens=n_out, num_reqs=_num_reqs(num_reqs, r))


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
    nxt = _index_array("next_token_ids", next_token_ids, 1)
    pos = _index_array("target_positions", target_positions, 1)
    bt = _index_array("block_table", block_table, 2)
    qsl = _index_array("query_start_loc", query_start_loc, 1)
    rej = None
    if num_rejected_tokens is not None:
        rej = _index_array("num_rejected_tokens", num_rejected_tokens, 1)
        _same_len("copy_and_expand_dflash_inputs", next_token_ids=nxt, num_rejected_tokens=rej)
    _same_len("copy_and_expand_dflash_inputs", next_token_ids=nxt, block_table=bt)
    r = nxt.shape[0]
    if qsl.shape[0] != r + 1:
        raise ValueError(f"query_start_loc must have length R+1={r + 1}, got {qsl.shape[0]}")
    if pos.shape[0] < 1:
        raise ValueError("target_positions must hold at least one token")
    if bt.shape[1] < 1:
        raise ValueError("block_table must have at least one column")
    block_size = _positive_int("block_size", block_size)
    check_index_range("block_table.shape[1] * block_size", bt.shape[1] * block_size)
    k = _positive_int("num_speculative_tokens", num_speculative_tokens)
    return _module(backend).copy_and_expand_dflash_inputs(
        nxt, pos, bt, qsl, rej,
        parallel_drafting_token_id=_int("parallel_drafting_token_id", parallel_drafting_token_id),
        block_size=block_size, num_speculative_tokens=k, num_reqs=_num_reqs(num_reqs, r))

"""vLLM's batch-metadata helpers of speculative decoding, XLA only: a few element-wise
operations each, which XLA fuses into the step (no ``backend=``)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from specjax.attention_metadata import CommonAttentionMetadata
from specjax.constants import PADDING_SLOT_ID
from specjax.kernels._xla import _I32, _owner, _slot

__all__ = ["compute_new_slot_mapping", "extend_all_queries_by_N", "update_num_computed_tokens_for_batch_change"]


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


"""Triton backend of :mod:`specjax.kernels`: one Triton kernel per op, called through jax-triton.

Importing this package needs neither triton nor jax-triton (CI has no GPU): the kernel
modules, which import triton, load on the first call of an op, and jax-triton is
imported only inside :func:`specjax.kernels.triton._jt.triton_call`. Use the ops through
:mod:`specjax.kernels` with ``backend="triton"``, which checks and normalizes the
arguments: index arrays int32, masks bool, ``num_reqs`` a 0-d int32 device array (read by
the kernel, so a new count never recompiles), static sizes and ids Python ints (compiled
into the kernel as ``tl.constexpr``). Each op is a single launch that writes every output
element, padding rows included; results are bit-identical to :mod:`specjax.kernels.xla`.
"""

from __future__ import annotations

__all__ = [
    "eagle_step_update_slot_mapping_and_metadata",
    "eagle_prepare_inputs_padded",
    "eagle_prepare_next_token_padded",
    "copy_and_expand_eagle_inputs",
    "copy_and_expand_dflash_inputs",
    "paged_attention",
]


def paged_attention(q, k_cache, v_cache, query_start_loc, seq_lens, block_table, **kw):
    """Paged attention as Triton kernels (:mod:`specjax.kernels.triton._paged_attention`);
    the ``"triton"`` backend of :func:`specjax.models.attention.paged_attention`."""
    from specjax.kernels.triton import _paged_attention

    return _paged_attention.paged_attention(q, k_cache, v_cache, query_start_loc, seq_lens,
                                            block_table, **kw)


def eagle_step_update_slot_mapping_and_metadata(
    positions, block_table, seq_lens, *, block_size, max_model_len, input_batch_size, num_reqs
):
    from specjax.kernels.triton import _eagle_step

    return _eagle_step.eagle_step_update_slot_mapping_and_metadata(
        positions, block_table, seq_lens, block_size=block_size, max_model_len=max_model_len,
        input_batch_size=input_batch_size, num_reqs=num_reqs)


def eagle_prepare_inputs_padded(cu_num_draft_tokens, valid_sampled_tokens_count, query_start_loc,
                                *, num_reqs):
    from specjax.kernels.triton import _prepare

    return _prepare.eagle_prepare_inputs_padded(
        cu_num_draft_tokens, valid_sampled_tokens_count, query_start_loc, num_reqs=num_reqs)


def eagle_prepare_next_token_padded(sampled_token_ids, discard_request_mask, backup_next_token_ids,
                                    *, vocab_size, num_reqs):
    from specjax.kernels.triton import _prepare

    return _prepare.eagle_prepare_next_token_padded(
        sampled_token_ids, discard_request_mask, backup_next_token_ids, vocab_size=vocab_size,
        num_reqs=num_reqs)


def copy_and_expand_eagle_inputs(target_token_ids, target_positions, next_token_ids,
                                 query_start_loc, query_end_loc, *, padding_token_id,
                                 parallel_drafting_token_id, num_padding_slots_per_request,
                                 shift_input_ids, num_output_tokens, num_reqs):
    from specjax.kernels.triton import _copy_expand

    return _copy_expand.copy_and_expand_eagle_inputs(
        target_token_ids, target_positions, next_token_ids, query_start_loc, query_end_loc,
        padding_token_id=padding_token_id, parallel_drafting_token_id=parallel_drafting_token_id,
        num_padding_slots_per_request=num_padding_slots_per_request,
        shift_input_ids=shift_input_ids, num_output_tokens=num_output_tokens, num_reqs=num_reqs)


def copy_and_expand_dflash_inputs(next_token_ids, target_positions, block_table, query_start_loc,
                                  num_rejected_tokens, *, parallel_drafting_token_id, block_size,
                                  num_speculative_tokens, num_reqs):
    from specjax.kernels.triton import _copy_expand

    return _copy_expand.copy_and_expand_dflash_inputs(
        next_token_ids, target_positions, block_table, query_start_loc, num_rejected_tokens,
        parallel_drafting_token_id=parallel_drafting_token_id, block_size=block_size,
        num_speculative_tokens=num_speculative_tokens, num_reqs=num_reqs)

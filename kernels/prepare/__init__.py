"""Padded-drafter input preparation (the token each request samples from, the next input
token): the docstrings below specify every backend bit for bit; ``backend=``: :mod:`~specjax.kernels.backend`."""

from __future__ import annotations

from specjax.kernels import _checks as c
from specjax.kernels.backend import op_module, resolve_backend

__all__ = ["eagle_prepare_inputs_padded", "eagle_prepare_next_token_padded"]


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
    cu = c.index_array("cu_num_draft_tokens", cu_num_draft_tokens, 1)
    valid = c.index_array("valid_sampled_tokens_count", valid_sampled_tokens_count, 1)
    qsl = c.index_array("query_start_loc", query_start_loc, 1)
    c.same_len("eagle_prepare_inputs_padded", cu_num_draft_tokens=cu,
              valid_sampled_tokens_count=valid)
    r = cu.shape[0]
    if qsl.shape[0] != r + 1:
        raise ValueError(f"query_start_loc must have length R+1={r + 1}, got {qsl.shape[0]}")
    return op_module(__name__, backend).eagle_prepare_inputs_padded(
        cu, valid, qsl, num_reqs=c.num_reqs(num_reqs, r))


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
    vocab_size = c.positive_int("vocab_size", vocab_size)
    c.check_index_range("vocab_size", vocab_size)
    sampled = c.index_array("sampled_token_ids", sampled_token_ids, 2)
    discard = c.bool_array("discard_request_mask", discard_request_mask, 1)
    backup = c.index_array("backup_next_token_ids", backup_next_token_ids, 1)
    c.same_len("eagle_prepare_next_token_padded", sampled_token_ids=sampled,
              discard_request_mask=discard, backup_next_token_ids=backup)
    if sampled.shape[1] < 1:
        raise ValueError("sampled_token_ids must have at least one column (k + 1)")
    return op_module(__name__, backend).eagle_prepare_next_token_padded(
        sampled, discard, backup, vocab_size=vocab_size,
        num_reqs=c.num_reqs(num_reqs, sampled.shape[0]))

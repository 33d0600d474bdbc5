"""XLA backend of :mod:`specjax.kernels.prepare`: the reference and the CPU path."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from specjax.kernels._xla import _I32


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

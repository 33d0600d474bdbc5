"""Machinery shared by the device proposers, as small pieces (vLLM keeps it in
``SpecDecodeBaseProposer``): construction checks, the draft KV state, the padded-batch
helpers, the autoregressive chain of single-token steps, and the output padding."""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

import specjax.kernels as K
from specjax.attention import CommonAttentionMetadata
from specjax.config import SpeculativeConfig
from specjax.constants import check_index_range
from specjax.metadata import SpecDecodeMetadata
from specjax.proposers.base import DRAFT_PADDING_ID, DraftOutput

_I32 = jnp.int32


def check_proposer(proposer: Any, method: str, model_type: type | tuple[type, ...],
                   positive: tuple[str, ...] = ("block_size", "max_model_len")) -> SpeculativeConfig:
    """The checks every device proposer makes at construction: the config and its method,
    the model runner's type, positive int sizes, and a known kernel backend."""
    cfg = proposer.config
    name = type(proposer).__name__
    if not isinstance(cfg, SpeculativeConfig):
        raise ValueError(f"config must be a SpeculativeConfig, got {type(cfg).__name__}")
    if cfg.method != method:
        raise ValueError(f"{name} needs method {method!r}, got {cfg.method!r}")
    if not isinstance(proposer.model, model_type):
        want = model_type.__name__ if isinstance(model_type, type) else \
            " or ".join(t.__name__ for t in model_type)
        raise ValueError(f"model must be a {want} for method={method!r}, "
                         f"got {type(proposer.model).__name__}")
    for field in positive:
        v = getattr(proposer, field)
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ValueError(f"{field} must be a positive int, got {v!r}")
    if "max_model_len" in positive:
        check_index_range("max_model_len", proposer.max_model_len)
    K.resolve_backend(proposer.kernel_backend)
    return cfg


def init_kv_caches(model: Any, num_blocks: int, block_size: int, dtype) -> Any:
    """The model's zero paged cache with ``num_blocks`` blocks (the target's pool size)."""
    if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks <= 0:
        raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
    check_index_range("num_blocks * block_size", num_blocks * block_size)
    return model.init_kv_caches(num_blocks, block_size, dtype)


class PaddedBatchHelpers:
    """vLLM's padded-drafter-batch helpers (kernels 2 and 3); needs ``self.kernel_backend``."""

    def prepare_next_token_ids_padded(self, sampled_token_ids, discard_request_mask,
                                      backup_next_token_ids, *, vocab_size: int, num_reqs=None):
        """``(next_token_ids [B], valid_sampled_tokens_count [B])`` from the verifier's
        ``[B, k+1]`` output; the backup is each request's last committed token."""
        return K.eagle_prepare_next_token_padded(
            sampled_token_ids, discard_request_mask, backup_next_token_ids, vocab_size=vocab_size,
            num_reqs=num_reqs, backend=self.kernel_backend)

    def prepare_inputs_padded(self, spec_decode_metadata: SpecDecodeMetadata,
                              valid_sampled_tokens_count, attn_metadata: CommonAttentionMetadata):
        """``(token_indices_to_sample [B], num_rejected_tokens [B])``; the batch keeps every
        token (rejected ones become padding), so ``attn_metadata`` is used unchanged."""
        return K.eagle_prepare_inputs_padded(
            spec_decode_metadata.cu_num_draft_tokens, valid_sampled_tokens_count,
            attn_metadata.query_start_loc, num_reqs=attn_metadata.num_reqs,
            backend=self.kernel_backend)


#: ``step(params, prev_tokens [B], positions [B], hidden, caches, md)
#:  -> (tokens [B] int32, hidden, caches)``: one single-token draft forward + greedy pick.
StepFn = Callable[..., tuple[jax.Array, Any, Any]]


def chain_steps(step: StepFn, params: dict, drafts: jax.Array, positions: jax.Array, hidden: Any,
                seq_lens: jax.Array, cad: CommonAttentionMetadata, caches: Any, *,
                block_size: int, max_model_len: int, backend: str) -> tuple[jax.Array, Any]:
    """Fill columns ``1..k-1`` of ``drafts [B, k]`` (column 0 given) with single-token steps.

    Each step advances every request one position with
    ``eagle_step_update_slot_mapping_and_metadata`` (positions past ``max_model_len`` get
    slot -1), raises ``max_seq_len`` (capped at ``max_model_len``), and runs ``step`` on the
    previous draft. One ``lax.fori_loop``: no recompile per step, no host round trip.
    ``positions [B]`` / ``seq_lens [B]`` are those of each request's last sampled token.
    """
    b, k = drafts.shape
    n = cad.num_reqs
    step_qsl = jnp.minimum(jnp.arange(b + 1, dtype=_I32), n)

    def body(i, carry):
        drafts, positions, hidden, seq_lens, max_seq_len, caches = carry
        positions, slots, seq_lens = K.eagle_step_update_slot_mapping_and_metadata(
            positions, cad.block_table, seq_lens, block_size=block_size,
            max_model_len=max_model_len, num_reqs=n, backend=backend)
        max_seq_len = jnp.minimum(max_seq_len + 1, max_model_len)
        md = cad.replace(query_start_loc=step_qsl, seq_lens=seq_lens, slot_mapping=slots,
                         num_actual_tokens=n, max_seq_len=max_seq_len, max_query_len=1, causal=True)
        prev = jax.lax.dynamic_index_in_dim(drafts, i - 1, axis=1, keepdims=False)
        tok, hidden, caches = step(params, prev, positions, hidden, caches, md)
        drafts = jax.lax.dynamic_update_index_in_dim(drafts, tok, i, axis=1)
        return drafts, positions, hidden, seq_lens, max_seq_len, caches

    drafts, *_, caches = jax.lax.fori_loop(
        1, k, body, (drafts, positions, hidden, seq_lens, cad.max_seq_len, caches))
    return drafts, caches


def draft_output(drafts: jax.Array, num_reqs: jax.Array) -> DraftOutput:
    """``drafts [B, k]`` -> ``DraftOutput`` with -1 / 0 on rows past ``num_reqs``."""
    b, k = drafts.shape
    real = jnp.arange(b, dtype=_I32) < num_reqs
    return DraftOutput(jnp.where(real[:, None], drafts, DRAFT_PADDING_ID).astype(_I32),
                       jnp.where(real, k, 0).astype(_I32))

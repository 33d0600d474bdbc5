"""Draft-model drafting (vLLM ``draft_model.py`` on ``llm_base_proposer.py``).

An independent Llama-family LM of the target's vocabulary drafts from token ids alone: it
gets no hidden state from the target and has its own embedding and lm_head (nothing is
shared). It keeps its own paged KV cache, laid out by the target's block table.

vLLM runs it with ``pass_hidden_states_to_model=False``, which takes the *unshifted
extra-slot* path of ``set_inputs_first_pass``: ``net_num_new_slots_per_request`` is 1
(``k`` with parallel drafting), so each request's query is its accepted target tokens as
they are (not shifted), then the bonus token in one new slot (then ``k - 1``
parallel-drafting slots), then its rejected tokens as padding (slot -1, position 0):

1. ``copy_and_expand_eagle_inputs(shift_input_ids=False, num_padding_slots_per_request=P,
   padding_token_id=0)`` with ``query_end_loc = query_start_loc[1:] - 1 - num_rejected``;
2. ``compute_new_slot_mapping(num_new_tokens=P)`` with the rejected mask;
3. ``extend_all_queries_by_N(N=P)``;
4. one forward over the expanded batch and an argmax at the new slots
   (``new_token_indices``);
5. without parallel drafting and for ``k > 1``: ``k - 1`` single-token steps exactly as
   EAGLE's (``eagle_step_update_slot_mapping_and_metadata``, ``seq_lens`` first reduced by
   the rejected counts), each feeding back the previous draft.

Capacity: the new slot of a request sits at the position of its first rejected token (or
one past its context), which the block table covers as long as it covers
``max_model_len`` (positions at or past ``max_model_len`` get slot -1).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

import specjax.kernels as K
from specjax.attention import CommonAttentionMetadata
from specjax.config import SpeculativeConfig
from specjax.constants import check_index_range
from specjax.metadata import SpecDecodeMetadata
from specjax.models.llama import DecoderLM
from specjax.proposers.base import DRAFT_PADDING_ID, DraftOutput, ProposerInputs

_I32 = jnp.int32


class DraftModelState(NamedTuple):
    """The draft LM's paged KV cache: one ``KVCache`` per draft layer,
    ``[num_blocks, block_size, n_kv, head_dim]``, addressed by the target's block table."""

    kv_caches: Any


@dataclasses.dataclass(frozen=True)
class DraftModelProposer:
    """Chain (or parallel) drafting with an independent draft LM.

    Attributes:
      config: a ``SpeculativeConfig`` with ``method="draft_model"``.
      model: the draft's ``DecoderLM`` runner; its own params (embedding and lm_head
        included) are passed to ``propose``.
      target_vocab_size: the target model's vocabulary size; must equal the draft's.
      block_size, max_model_len: of the KV cache / the model.
      target_tensor_parallel_size: the target's TP degree, when known; a
        ``config.draft_tensor_parallel_size`` that differs is refused (vLLM).
      parallel_drafting_token_id: the draft's mask token (vLLM reads ``pard_token`` /
        ``ptd_token_id`` from the draft config); required with ``parallel_drafting``.
      kernel_backend: backend of the index kernels.
    """

    config: SpeculativeConfig
    model: DecoderLM
    target_vocab_size: int
    block_size: int
    max_model_len: int
    target_tensor_parallel_size: int | None = None
    parallel_drafting_token_id: int | None = None
    kernel_backend: str = "auto"

    #: What a serving loop must feed (see ``ProposerInputs``): token ids only.
    needs_hidden_states = False
    needs_aux_hidden_states = False
    runs_on = "device"

    def __post_init__(self) -> None:
        cfg = self.config
        if not isinstance(cfg, SpeculativeConfig):
            raise ValueError(f"config must be a SpeculativeConfig, got {type(cfg).__name__}")
        if cfg.method != "draft_model":
            raise ValueError(f"DraftModelProposer needs method 'draft_model', got {cfg.method!r}")
        if not isinstance(self.model, DecoderLM):
            raise ValueError(f"model must be a DecoderLM (a Llama / Qwen2 / Qwen3 draft LM), "
                             f"got {type(self.model).__name__}")
        for name in ("target_vocab_size", "block_size", "max_model_len"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        draft_vocab = self.model.config.vocab_size
        if draft_vocab != self.target_vocab_size:
            raise ValueError(
                f"the draft model's vocab_size ({draft_vocab}) must equal the target model's "
                f"vocab_size ({self.target_vocab_size}) for method='draft_model': its token ids "
                "are verified by the target as they are")
        tgt_tp, draft_tp = self.target_tensor_parallel_size, cfg.draft_tensor_parallel_size
        if tgt_tp is not None and (isinstance(tgt_tp, bool) or not isinstance(tgt_tp, int) or tgt_tp < 1):
            raise ValueError(f"target_tensor_parallel_size must be None or an int >= 1, got {tgt_tp!r}")
        if tgt_tp is not None and draft_tp is not None and draft_tp != tgt_tp:
            raise ValueError(
                f"draft_tensor_parallel_size ({draft_tp}) must equal the target's "
                f"tensor_parallel_size ({tgt_tp}) for method='draft_model' (vLLM); leave it "
                "unset to use the target's")
        pid = self.parallel_drafting_token_id
        if cfg.parallel_drafting:
            if pid is None:
                raise ValueError(
                    "parallel_drafting=True needs parallel_drafting_token_id: the draft model's "
                    "mask token (vLLM reads dflash_config.mask_token_id, pard_token or ptd_token_id "
                    "from the draft config)")
            if isinstance(pid, bool) or not isinstance(pid, int) or not 0 <= pid < draft_vocab:
                raise ValueError(f"parallel_drafting_token_id must be an int in [0, {draft_vocab}), "
                                 f"got {pid!r}")
        check_index_range("max_model_len", self.max_model_len)
        K.resolve_backend(self.kernel_backend)

    @property
    def num_speculative_tokens(self) -> int:
        return self.config.num_speculative_tokens

    @property
    def num_new_slots_per_request(self) -> int:
        """vLLM's ``net_num_new_slots_per_request``: 1, or k with parallel drafting."""
        return self.config.num_speculative_tokens if self.config.parallel_drafting else 1

    # -- state -----------------------------------------------------------------------

    def init_state(self, num_blocks: int, dtype=jnp.float32) -> DraftModelState:
        """Zero draft KV cache with ``num_blocks`` blocks (the target's block pool size)."""
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks <= 0:
            raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
        check_index_range("num_blocks * block_size", num_blocks * self.block_size)
        return DraftModelState(self.model.init_kv_caches(num_blocks, self.block_size, dtype))

    # -- padded-batch helpers (vLLM's base-class methods) ----------------------------

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

    # -- propose ---------------------------------------------------------------------

    @functools.partial(jax.jit, static_argnums=0, donate_argnums=2)
    def propose(self, params: dict, state: DraftModelState, inputs: ProposerInputs
                ) -> tuple[DraftOutput, DraftModelState]:
        """Draft ``k`` tokens for every request.

        Uses ``inputs.target_token_ids``, ``target_positions``, ``next_token_ids``,
        ``num_rejected_tokens`` (padded mode; None means none rejected) and
        ``attn_metadata``; hidden states and ``token_indices_to_sample`` are ignored (the
        draft samples at its own new slots).

        Returns ``(DraftOutput(token_ids [B_pad, k] int32, num_drafts [B_pad] int32),
        state)``; padding rows (past ``num_reqs``) hold -1 and 0.
        """
        cad = inputs.attn_metadata
        model = self.model
        k = self.config.num_speculative_tokens
        p = self.num_new_slots_per_request
        b = cad.query_start_loc.shape[0] - 1
        n = cad.num_reqs
        real = jnp.arange(b, dtype=_I32) < n
        qsl = cad.query_start_loc
        rejected = inputs.num_rejected_tokens
        if rejected is not None:
            rejected = jnp.where(real, rejected, 0).astype(_I32)

        # First pass over the expanded batch: [accepted tokens, bonus, (masks), rejected pad].
        t_out = inputs.target_token_ids.shape[0] + b * p
        query_end_loc = qsl[1:] - 1 if rejected is None else qsl[1:] - 1 - rejected
        ids, positions, is_rejected, _, new_token_indices, _ = K.copy_and_expand_eagle_inputs(
            inputs.target_token_ids, inputs.target_positions, inputs.next_token_ids, qsl,
            query_end_loc, padding_token_id=0,
            parallel_drafting_token_id=(self.parallel_drafting_token_id or 0),
            num_padding_slots_per_request=p, shift_input_ids=False, num_output_tokens=t_out,
            num_reqs=n, backend=self.kernel_backend)
        slots = K.compute_new_slot_mapping(cad, positions, is_rejected, block_size=self.block_size,
                                           num_new_tokens=p, max_model_len=self.max_model_len)
        md = K.extend_all_queries_by_N(cad, p, slots)
        hidden, _, caches = model.forward(params, ids, positions, state.kv_caches, md)
        new_token_indices = new_token_indices.reshape(b, p)
        first = self._greedy(params, hidden[new_token_indices.reshape(-1)]).reshape(b, p)

        if p > 1 or k == 1:     # parallel drafting (p == k) or a single draft
            drafts = first
        else:
            drafts = jnp.full((b, k), DRAFT_PADDING_ID, _I32).at[:, 0].set(first[:, 0])
            positions = positions[new_token_indices[:, 0]]
            seq_lens = md.seq_lens
            if rejected is not None:
                seq_lens = seq_lens - rejected
            step_qsl = jnp.minimum(jnp.arange(b + 1, dtype=_I32), n)

            def step(i, carry):
                drafts, positions, seq_lens, max_seq_len, caches = carry
                positions, slots, seq_lens = K.eagle_step_update_slot_mapping_and_metadata(
                    positions, cad.block_table, seq_lens, block_size=self.block_size,
                    max_model_len=self.max_model_len, num_reqs=n, backend=self.kernel_backend)
                max_seq_len = jnp.minimum(max_seq_len + 1, self.max_model_len)
                step_md = cad.replace(query_start_loc=step_qsl, seq_lens=seq_lens,
                                      slot_mapping=slots, num_actual_tokens=n,
                                      max_seq_len=max_seq_len, max_query_len=1, causal=True)
                prev = jax.lax.dynamic_index_in_dim(drafts, i - 1, axis=1, keepdims=False)
                h, _, caches = model.forward(params, prev, positions, caches, step_md)
                drafts = jax.lax.dynamic_update_index_in_dim(drafts, self._greedy(params, h), i,
                                                             axis=1)
                return drafts, positions, seq_lens, max_seq_len, caches

            drafts, *_, caches = jax.lax.fori_loop(
                1, k, step, (drafts, positions, seq_lens, md.max_seq_len, caches))

        token_ids = jnp.where(real[:, None], drafts, DRAFT_PADDING_ID)
        num_drafts = jnp.where(real, k, 0).astype(_I32)
        return DraftOutput(token_ids, num_drafts), DraftModelState(caches)

    def _greedy(self, params: dict, hidden: jax.Array) -> jax.Array:
        """Argmax token of each row of ``hidden [N, H]`` (the draft's own lm_head)."""
        return jnp.argmax(self.model.compute_logits(params, hidden), axis=-1).astype(_I32)

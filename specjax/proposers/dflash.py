"""DFlash block drafting (vLLM ``dflash.py`` on ``llm_base_proposer.py``).

One ``jax.jit``: the step's target tokens become context K/V in the draft cache, then one
forward of a ``[bonus, mask * k]`` block per request drafts ``k`` tokens (each layer with its
own window and causality, vLLM 0.34's ``qwen3_dflash.py``).
Positions at or past ``min(max_model_len, block-table capacity)`` are neither stored nor
attended to. Data flow: docs/integration.md, "How the device proposers draft".
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

import specjax.kernels as K
from specjax.config import SpeculativeConfig
from specjax.constants import PADDING_SLOT_ID
from specjax.models.dflash import DFlashHead
from specjax.proposers.types import DraftOutput, ProposerInputs
from specjax.proposers.common import (
    AheadOfTimeCompile,
    PaddedBatchHelpers,
    check_proposer,
    draft_output,
    init_kv_caches,
    set_head_attention,
    pick,
    repeat_sampling,
)
from specjax.sharding.vocab import check_vocab_sharding

_I32 = jnp.int32


class DFlashState(NamedTuple):
    """The draft's paged KV cache: one ``KVCache`` per draft layer, ``[num_blocks,
    block_size, n_kv, head_dim]``, under the target's block table (context K/V of every
    accepted token)."""

    kv_caches: Any


@dataclasses.dataclass(frozen=True)
class DFlashProposer(PaddedBatchHelpers, AheadOfTimeCompile):
    """DFlash proposer: ``k`` drafts per request from one non-causal block forward.

    Attributes:
      config, block_size, max_model_len, kernel_backend, mesh, vocab_axis: as EAGLE's
        (``method="dflash"``).
      model: the ``DFlashHead``; its ``config.mask_token_id`` is the mask token.
      attention: the head's attention (a hashable ``AttentionFn``, set on a copy of
        ``model``; it must honour ``md.causal`` and ``sliding_window``/``sinks`` when the
        head has them); None: specjax's backends.

    Query positions past the block table (which should cover ``min(seq_len - rejected + 1
    + k, max_model_len)``) are dropped.
    """

    config: SpeculativeConfig
    model: DFlashHead
    block_size: int
    max_model_len: int
    kernel_backend: str = "auto"
    mesh: Mesh | None = None
    vocab_axis: str = "tp"
    attention: Any = None

    #: What a serving loop must feed (see ``ProposerInputs``): the aux hidden states only
    #: (the context comes from ``fc`` over them; the final hidden states are never read).
    needs_hidden_states = False
    needs_aux_hidden_states = True

    #: the method and head class (DSpark's subclass changes them)
    method_name = "dflash"
    head_class: Any = DFlashHead

    def __post_init__(self) -> None:
        set_head_attention(self, (self.head_class,))
        check_proposer(self, self.method_name, self.head_class)
        mc = self.model.config
        if not 0 <= mc.mask_token_id < mc.vocab_size:
            raise ValueError(
                "DFlash drafts in parallel and needs the mask token id (vLLM reads "
                "dflash_config.mask_token_id, then pard_token, then ptd_token_id from the "
                f"draft config); the head's mask_token_id is {mc.mask_token_id}, it must be "
                f"in [0, vocab_size={mc.vocab_size})")
        # compute_logits: the target vocabulary, unless a reduced head comes without d2t
        width = mc.draft_vocab_size if (mc.reduced_vocab and mc.has_d2t is False) else mc.vocab_size
        check_vocab_sharding(self, width, "vocab_size")

    @property
    def num_speculative_tokens(self) -> int:
        return self.config.num_speculative_tokens

    @property
    def mask_token_id(self) -> int:
        return self.model.config.mask_token_id

    # -- state -----------------------------------------------------------------------

    def init_state(self, num_blocks: int, dtype=jnp.float32) -> DFlashState:
        """Zero draft KV cache with ``num_blocks`` blocks (the target's block pool size)."""
        return DFlashState(init_kv_caches(self.model, num_blocks, self.block_size, dtype))

    # -- host/device input preparation: the base proposer's, as in vLLM --------------


    # -- propose ---------------------------------------------------------------------

    @functools.partial(jax.jit, static_argnums=0, donate_argnums=2)
    def propose(self, params: dict, state: DFlashState, inputs: ProposerInputs
                ) -> tuple[DraftOutput, DFlashState]:
        """Draft ``k`` tokens for every request from ``inputs.aux_hidden_states [T_pad,
        n_aux, Ht]``, ``target_positions``, ``next_token_ids``, ``num_rejected_tokens`` (or
        None) and ``attn_metadata``. Returns ``(DraftOutput(token_ids [B_pad, k] int32,
        num_drafts [B_pad] int32), state)``; padding rows hold -1 and 0.
        """
        k = self.config.num_speculative_tokens
        hidden, sample_idx, caches, b, n = self.block_forward(params, state, inputs, k)
        logits = self.model.compute_logits(params, hidden[sample_idx])
        drafts = jax.tree.map(lambda x: x.reshape((b, k) + x.shape[1:]), pick(
            self, logits, repeat_sampling(inputs.draft_sampling, k),
            jnp.tile(jnp.arange(k, dtype=_I32), b)))
        return draft_output(drafts, n), DFlashState(caches)

    def block_forward(self, params: dict, state: DFlashState, inputs: ProposerInputs, k: int):
        """Context K/V, then the ``[bonus, mask * k]`` blocks' forward -> ``(hidden [B_pad *
        (1 + k), H], sample_idx [B_pad * k] (the mask slots), kv_caches, B_pad, num_reqs)``."""
        cad = inputs.attn_metadata
        model = self.model
        q = 1 + k
        b = cad.query_start_loc.shape[0] - 1
        n = cad.num_reqs
        real = jnp.arange(b, dtype=_I32) < n

        if inputs.aux_hidden_states is None:
            raise ValueError(f"method={self.config.method!r} needs inputs.aux_hidden_states "
                             "[T, n_aux, Ht]")
        context_states = model.combine_hidden_states(params, inputs.aux_hidden_states)

        ids, ctx_pos, q_pos, ctx_slots, q_slots, sample_idx = K.copy_and_expand_dflash_inputs(
            inputs.next_token_ids, inputs.target_positions, cad.block_table, cad.query_start_loc,
            inputs.num_rejected_tokens, parallel_drafting_token_id=self.mask_token_id,
            block_size=self.block_size, num_speculative_tokens=k, num_reqs=n,
            backend=self.kernel_backend)
        # Block positions past the model length or the table are neither stored nor
        # attended to (the kernel would alias them onto the table's last block).
        limit = min(self.max_model_len, cad.block_table.shape[1] * self.block_size)
        q_slots = jnp.where(q_pos >= limit, PADDING_SLOT_ID, q_slots)

        caches = model.precompute_and_store_context_kv(params, context_states, ctx_pos, ctx_slots,
                                                       state.kv_caches)

        seq_lens = cad.seq_lens
        if inputs.num_rejected_tokens is not None:
            seq_lens = seq_lens - inputs.num_rejected_tokens
        seq_lens = jnp.where(real, jnp.minimum(seq_lens + q, limit), 0)
        md = cad.replace(
            query_start_loc=jnp.minimum(jnp.arange(b + 1, dtype=_I32), n) * q,
            seq_lens=seq_lens.astype(_I32), slot_mapping=q_slots, num_actual_tokens=n * q,
            max_seq_len=jnp.minimum(cad.max_seq_len + q, limit).astype(_I32),
            max_query_len=q, causal=False)       # each layer sets its own (forward)
        hidden, caches = model.forward(params, ids, q_pos, caches, md)
        return hidden, sample_idx, caches, b, n

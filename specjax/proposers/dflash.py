"""DFlash block drafting (vLLM ``dflash.py`` on ``llm_base_proposer.py``).

A frozen, hashable configuration object plus pure functions, like
:mod:`specjax.proposers.eagle`. ``propose`` is one ``jax.jit`` (configuration static,
state donated) that does, with no host round trip and no Python loop over requests:

1. ``copy_and_expand_dflash_inputs``: each target token of this step becomes a *context*
   token (its position and slot); each request gets a query block ``[bonus, mask * k]``
   at positions ``last_valid + 1 ..`` with its slots, and the indices of its mask slots.
2. Context: ``fc`` over the stacked aux hidden states (``combine_hidden_states``), then
   ``hidden_norm`` and the K/V of every draft layer at once, written into the draft's
   paged cache (``precompute_and_store_context_kv``).
3. One forward of the query blocks with non-causal metadata: ``query_start_loc = arange
   * (1 + k)``, ``seq_lens = seq_lens - rejected + 1 + k``; each block sees its request's
   whole cached context and the whole block (its own K/V written at the query slots).
4. Greedy drafts at the mask slots: argmax of ``compute_logits`` (the target's lm_head,
   or the head's own reduced-vocab head scattered through ``d2t``). Parallel drafting:
   no autoregressive steps, ``k`` drafts from one forward.

Padded mode (``num_rejected_tokens`` given): the rejected tokens stay in the batch; as in
vLLM their context K/V are written at their slots and then overwritten by the query block
(whose positions start right after the last valid token and cover ``1 + k >= rejected``
positions), and ``seq_lens`` drop them, so they are never attended to.

One choice differs from vLLM v0.20.0, whose DFlash path has no length rule: query-block
positions at or past ``min(max_model_len, block-table capacity)`` get slot -1 and
``seq_lens`` are capped there (``max_model_len`` is the project-wide rule of the EAGLE
kernels), so those positions are neither stored nor attended to. vLLM computes their
slots from the block table with the block index capped at its last column, so past the
end of the table they overwrite context K/V of the request's last block (and its
attention reads past the table row); the drafts for positions past ``max_model_len`` are
dropped by the scheduler anyway. Like v0.20.0 the attention is always non-causal: a head
whose config says ``causal`` (later vLLM versions honour ``dflash_config.causal``) is
refused.
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
)
from specjax.sharding.vocab import check_vocab_sharding, proposer_argmax

_I32 = jnp.int32


class DFlashState(NamedTuple):
    """Every buffer the proposer owns: the draft's paged KV cache (one ``KVCache`` per
    draft layer, ``[num_blocks, block_size, n_kv, head_dim]``), laid out by the target's
    block table. It holds the context K/V of every accepted token; a step's query-block
    K/V are overwritten by the next step's context."""

    kv_caches: Any


@dataclasses.dataclass(frozen=True)
class DFlashProposer(PaddedBatchHelpers, AheadOfTimeCompile):
    """DFlash proposer: ``k`` drafts per request from one non-causal block forward.

    Attributes:
      config: a ``SpeculativeConfig`` with ``method="dflash"`` (``parallel_drafting`` is
        forced on by the config, as in vLLM).
      model: the ``DFlashHead``; its params are passed to ``propose`` with the target's
        embedding / lm_head shared in where the head has none
        (``specjax.models.share_target_weights``). Its ``config.mask_token_id`` is the
        parallel-drafting token.
      block_size, max_model_len: of the KV cache / the model.
      kernel_backend: backend of the index kernels (``"auto"``, ``"xla"``, ...).
      mesh, vocab_axis: with ``config.use_local_argmax_reduction``, greedy drafting takes
        the argmax of each shard of the vocabulary over mesh axis ``vocab_axis`` and
        reduces the (value, index) pairs (``vocab.greedy_argmax``) instead of gathering
        the logits (target vocabulary; a reduced head's are scattered through ``d2t``);
        the vocabulary must divide evenly. Mesh None (default): plain argmax.

    ``warmup(buckets, params, state)`` compiles ``propose`` for every shape bucket ahead of
    time (``common.AheadOfTimeCompile``).

    The block table passed in ``attn_metadata`` should cover each request's query block,
    ``min(seq_len - rejected + 1 + k, max_model_len)`` positions: block positions past its
    capacity are dropped like those past ``max_model_len``.
    """

    config: SpeculativeConfig
    model: DFlashHead
    block_size: int
    max_model_len: int
    kernel_backend: str = "auto"
    mesh: Mesh | None = None
    vocab_axis: str = "tp"

    #: What a serving loop must feed (see ``ProposerInputs``): the aux hidden states only
    #: (the context comes from ``fc`` over them; the final hidden states are never read).
    needs_hidden_states = False
    needs_aux_hidden_states = True

    def __post_init__(self) -> None:
        check_proposer(self, "dflash", DFlashHead)
        mc = self.model.config
        if not 0 <= mc.mask_token_id < mc.vocab_size:
            raise ValueError(
                "DFlash drafts in parallel and needs the mask token id (vLLM reads "
                "dflash_config.mask_token_id, then pard_token, then ptd_token_id from the "
                f"draft config); the head's mask_token_id is {mc.mask_token_id}, it must be "
                f"in [0, vocab_size={mc.vocab_size})")
        if mc.causal:
            raise ValueError("the DFlash head's config sets causal=True (dflash_config.causal / "
                             "is_causal); specjax drafts with non-causal attention as vLLM v0.20.0 "
                             "does: use a head with causal=False")
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
        """Draft ``k`` tokens for every request.

        Uses ``inputs.aux_hidden_states [T_pad, n_aux, Ht]``, ``target_positions [T_pad]``,
        ``next_token_ids [B_pad]``, ``num_rejected_tokens [B_pad]`` (or None) and
        ``attn_metadata``; ``target_token_ids`` only for its length and
        ``token_indices_to_sample`` not at all (the mask slots are sampled).

        Returns ``(DraftOutput(token_ids [B_pad, k] int32, num_drafts [B_pad] int32),
        state)``; padding rows (past ``num_reqs``) hold -1 and 0.
        """
        cad = inputs.attn_metadata
        model = self.model
        k = self.config.num_speculative_tokens
        q = 1 + k
        b = cad.query_start_loc.shape[0] - 1
        n = cad.num_reqs
        real = jnp.arange(b, dtype=_I32) < n

        if inputs.aux_hidden_states is None:
            raise ValueError("method='dflash' needs inputs.aux_hidden_states [T, n_aux, Ht]")
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
            max_query_len=q, causal=False)
        hidden, caches = model.forward(params, ids, q_pos, caches, md)

        logits = model.compute_logits(params, hidden[sample_idx])
        drafts = proposer_argmax(self, logits).reshape(b, k)
        return draft_output(drafts, n), DFlashState(caches)

"""Extract-hidden-states "drafting" (vLLM ``extract_hidden_states.py``).

Not a speculator: each step stores the target's aux hidden states ``[T, n_aux, H]`` into
its own paged cache (where a KV connector can read them) and returns the token the target
just sampled as the single draft, so verification always accepts it. Needs
``num_speculative_tokens == 1`` and the padded drafter batch.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from specjax.config import SpeculativeConfig
from specjax.models.extract_hidden_states import ExtractHiddenStates
from specjax.proposers.common import (AheadOfTimeCompile, PaddedBatchHelpers, check_proposer,
                                      init_kv_caches)
from specjax.proposers.types import DRAFT_PADDING_ID, DraftOutput, ProposerInputs

_I32 = jnp.int32


class ExtractHiddenStatesState(NamedTuple):
    """The hidden-state cache: a one-element list of ``[num_blocks, block_size, n_aux, H]``."""

    kv_caches: Any


@dataclasses.dataclass(frozen=True)
class ExtractHiddenStatesProposer(PaddedBatchHelpers, AheadOfTimeCompile):
    """Caches the target's aux hidden states; drafts the sampled token.

    ``config``: ``method="extract_hidden_states"``, k == 1; ``model``: the
    ``ExtractHiddenStates`` cache-only model; ``block_size``: the target cache's;
    ``kernel_backend``: of the helper kernel. ``warmup`` buckets must give
    ``max_blocks_per_req``.
    """

    config: SpeculativeConfig
    model: ExtractHiddenStates
    block_size: int
    kernel_backend: str = "auto"

    #: What a serving loop must feed (see ``ProposerInputs``).
    needs_hidden_states = False
    needs_aux_hidden_states = True

    def __post_init__(self) -> None:
        cfg = check_proposer(self, "extract_hidden_states", ExtractHiddenStates, positive=())
        if cfg.num_speculative_tokens != 1:   # SpeculativeConfig already refuses it
            raise ValueError("num_speculative_tokens must be 1 for method='extract_hidden_states', "
                             f"got {cfg.num_speculative_tokens}")
        if cfg.disable_padded_drafter_batch:
            raise ValueError("method='extract_hidden_states' needs the padded drafter batch: set "
                             "disable_padded_drafter_batch=False")
        for name, v in (("model.num_hidden_states", self.model.num_hidden_states),
                        ("model.hidden_size", self.model.hidden_size), ("block_size", self.block_size)):
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(
                    f"{name} must be a positive int, got {v!r}"
                    + (" (the draft config must set eagle_aux_hidden_state_layer_ids)"
                       if name == "model.num_hidden_states" else ""))

    @property
    def num_speculative_tokens(self) -> int:
        return 1

    # -- state -----------------------------------------------------------------------

    def init_state(self, num_blocks: int, dtype=jnp.float32) -> ExtractHiddenStatesState:
        """Zero hidden-state cache with ``num_blocks`` blocks (the target's block pool size)."""
        return ExtractHiddenStatesState(init_kv_caches(self.model, num_blocks, self.block_size, dtype))

    # -- padded-batch helpers --------------------------------------------------------

    @functools.partial(jax.jit, static_argnums=0, static_argnames=("vocab_size",))
    def prepare_next_token_ids_padded(self, sampled_token_ids, discard_request_mask,
                                      backup_next_token_ids, *, vocab_size: int, num_reqs=None):
        """This method's variant of vLLM's ``prepare_next_token_ids_padded``: from
        ``s = sampled_token_ids[:, 0]`` (``[B, S]`` int32), ``valid = 0 <= s < vocab_size``.

        Returns ``(next_token_ids [B], valid_sampled_tokens_count [B])`` int32: ``s`` when
        valid and not discarded (``discard_request_mask [B]``), else
        ``backup_next_token_ids``; the count is 1 when valid *whatever the discard flag*
        (EAGLE's kernel gives 0). Rows past ``num_reqs`` give 0 and 0.
        """
        sampled = jnp.asarray(sampled_token_ids, _I32)
        if sampled.ndim != 2 or sampled.shape[1] < 1:
            raise ValueError(f"sampled_token_ids must be [B, S] with S >= 1, got {sampled.shape}")
        first = sampled[:, 0]
        b = first.shape[0]
        valid = (first >= 0) & (first < vocab_size)
        nxt = jnp.where(valid & ~jnp.asarray(discard_request_mask, bool), first,
                        jnp.asarray(backup_next_token_ids, _I32))
        real = jnp.arange(b, dtype=_I32) < (b if num_reqs is None else num_reqs)
        return jnp.where(real, nxt, 0), jnp.where(real & valid, 1, 0).astype(_I32)

    # -- propose ---------------------------------------------------------------------

    @functools.partial(jax.jit, static_argnums=0, donate_argnums=2)
    def propose(self, params: dict, state: ExtractHiddenStatesState, inputs: ProposerInputs
                ) -> tuple[DraftOutput, ExtractHiddenStatesState]:
        """Store ``inputs.aux_hidden_states [T_pad, n_aux, H]`` at the slot mapping (-1
        skipped) and draft ``next_token_ids``: ``(DraftOutput([B_pad, 1], [B_pad]), state)``,
        padding rows -1 and 0. ``params`` is ``{}``."""
        aux = inputs.aux_hidden_states
        if aux is None:
            raise ValueError("method='extract_hidden_states' needs inputs.aux_hidden_states "
                             "[T, n_aux, H]")
        want = (self.model.num_hidden_states, self.model.hidden_size)
        if aux.ndim != 3 or tuple(aux.shape[1:]) != want:
            raise ValueError(f"inputs.aux_hidden_states must be [T, {want[0]}, {want[1]}] "
                             f"(n_aux, hidden_size of the model), got {tuple(aux.shape)}")
        cad = inputs.attn_metadata
        if cad.slot_mapping.shape[0] != aux.shape[0]:
            raise ValueError(f"attn_metadata.slot_mapping has {cad.slot_mapping.shape[0]} entries "
                             f"for {aux.shape[0]} aux hidden-state rows")
        caches = self.model.forward(params, aux, state.kv_caches, cad)
        b = cad.query_start_loc.shape[0] - 1
        real = jnp.arange(b, dtype=_I32) < cad.num_reqs
        token_ids = jnp.where(real, inputs.next_token_ids.astype(_I32), DRAFT_PADDING_ID)[:, None]
        num_drafts = real.astype(_I32)
        return DraftOutput(token_ids, num_drafts), ExtractHiddenStatesState(caches)

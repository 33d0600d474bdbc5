"""Medusa drafting (vLLM ``medusa.py``): one forward of the heads on the target's hidden state.

Head ``h`` reads the target's final post-norm hidden state of each request's last accepted
token and proposes, by its own argmax, the token ``h + 2`` places after it (the target's
own head gives the next one). The drafts of one request are the top-1 of its first ``k``
heads, a chain. No KV cache, no autoregressive loop: the state is the empty tuple, kept
only so every proposer has the same ``propose(params, state, inputs)`` signature.

vLLM's runner gathers the hidden state of the last accepted token itself
(``offset + len(sampled) - 1`` per request); here that is ``token_indices_to_sample``
(``query_start_loc[1:] - 1 - num_rejected``, from ``prepare_inputs_padded``), defaulting
to ``query_start_loc[1:] - 1`` when no token was rejected.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from specjax.config import SpeculativeConfig
from specjax.models import params as mp
from specjax.models.medusa import MedusaHeads
from specjax.proposers.common import (AheadOfTimeCompile, PaddedBatchHelpers, check_proposer,
                                      draft_output)
from specjax.proposers.types import DraftOutput, ProposerInputs

_I32 = jnp.int32


class MedusaState(NamedTuple):
    """Medusa keeps no buffers between steps."""


@dataclasses.dataclass(frozen=True)
class MedusaProposer(PaddedBatchHelpers, AheadOfTimeCompile):
    """Medusa chain proposer.

    Attributes:
      config: a ``SpeculativeConfig`` with ``method="medusa"``; ``num_speculative_tokens``
        (k) at most the number of heads (vLLM drafts with every head; k < heads uses the
        first k and never runs the others).
      model: the ``MedusaHeads`` runner; its params are passed to ``propose``.
      kernel_backend: backend of the padded-batch helper kernels.

    ``warmup(buckets, params)`` compiles ``propose`` for every shape bucket ahead of time
    (``common.AheadOfTimeCompile``; buckets must give ``max_blocks_per_req``, the width of
    the block table the loop passes, since Medusa has no ``max_model_len`` to derive it).
    """

    config: SpeculativeConfig
    model: MedusaHeads
    kernel_backend: str = "auto"

    #: What a serving loop must feed (see ``ProposerInputs``).
    needs_hidden_states = True
    needs_aux_hidden_states = False

    def __post_init__(self) -> None:
        cfg = check_proposer(self, "medusa", MedusaHeads, positive=())
        heads = self.model.config.num_heads
        if cfg.num_speculative_tokens > heads:
            raise ValueError(
                f"num_speculative_tokens={cfg.num_speculative_tokens} exceeds the number of Medusa "
                f"heads ({heads}): each head drafts one token, so k must be in [1, {heads}]")

    @property
    def num_speculative_tokens(self) -> int:
        return self.config.num_speculative_tokens

    # -- state -----------------------------------------------------------------------

    def init_state(self, num_blocks: int | None = None, dtype=None) -> MedusaState:
        """The empty state (the arguments are accepted for a uniform interface)."""
        del num_blocks, dtype
        return MedusaState()

    # -- propose ---------------------------------------------------------------------

    @functools.partial(jax.jit, static_argnums=0, donate_argnums=2)
    def propose(self, params: dict, state: MedusaState, inputs: ProposerInputs
                ) -> tuple[DraftOutput, MedusaState]:
        """Draft ``k`` tokens for every request.

        Uses ``inputs.target_hidden_states [T_pad, H]`` (post-norm),
        ``token_indices_to_sample`` (or ``query_start_loc[1:] - 1``) and ``attn_metadata``
        (``query_start_loc``, ``num_reqs``); everything else is ignored.

        Returns ``(DraftOutput(token_ids [B_pad, k] int32, num_drafts [B_pad] int32),
        state)``; padding rows (past ``num_reqs``) hold -1 and 0.
        """
        if inputs.target_hidden_states is None:
            raise ValueError("method='medusa' needs inputs.target_hidden_states [T, H]")
        cad = inputs.attn_metadata
        k = self.config.num_speculative_tokens
        hidden = inputs.target_hidden_states
        sample_idx = inputs.token_indices_to_sample
        if sample_idx is None:
            sample_idx = cad.query_start_loc[1:] - 1
        sample_idx = jnp.clip(sample_idx, 0, hidden.shape[0] - 1)

        model, head_params, token_map = self._first_heads(params, k)
        z = model.forward(head_params, hidden[sample_idx])             # [k, B, H]
        logits = model.compute_logits(head_params, z)                  # [k, B, V or Vt]
        drafts = jnp.argmax(logits, axis=-1).astype(_I32).T            # [B, k]
        if token_map is not None:   # truncated head: map its argmax to target ids
            drafts = token_map.astype(_I32)[drafts]
        return draft_output(drafts, cad.num_reqs), state

    def _first_heads(self, params: dict, k: int):
        """The runner and params of heads ``0 .. k-1`` only, and the token map (or None).

        The token map is taken out so that the argmax runs over the truncated logits and is
        mapped afterwards, instead of scattering them into a full ``-inf`` vocabulary first
        (the same token unless two logits tie exactly)."""
        p = mp.normalize_keys(params)
        token_map = p.get("token_map")
        p = {key: v for key, v in p.items() if key != "token_map"}
        cfg = self.model.config
        if k == cfg.num_heads:
            return self.model, p, token_map
        p["blocks"] = {h: p["blocks"][h] for h in range(k)}
        if "lm_heads" in p:
            p["lm_heads"] = {h: p["lm_heads"][h] for h in range(k)}
        return MedusaHeads(cfg.replace(num_heads=k)), p, token_map

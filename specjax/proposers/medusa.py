"""Medusa drafting (vLLM ``medusa.py``): one forward of the heads on the target's hidden state.

Head ``h`` reads the target's final post-norm hidden state of each request's last accepted
token (at ``token_indices_to_sample``) and proposes by argmax the token ``h + 2`` places
after it; a request's drafts are its first ``k`` heads' tokens, a chain. No KV cache and no
loop: the state is the empty tuple.
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
                                      draft_output, pick)
from specjax.proposers.types import DraftOutput, ProposerInputs

_I32 = jnp.int32


class MedusaState(NamedTuple):
    """Medusa keeps no buffers between steps."""


@dataclasses.dataclass(frozen=True)
class MedusaProposer(PaddedBatchHelpers, AheadOfTimeCompile):
    """Medusa chain proposer.

    ``config``: ``method="medusa"``, ``k`` at most the number of heads (the first ``k``
    run); ``model``: the ``MedusaHeads`` runner; ``kernel_backend``: of the padded-batch
    helpers. ``warmup`` buckets must give ``max_blocks_per_req``.
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
        """The empty state."""
        del num_blocks, dtype
        return MedusaState()

    # -- propose ---------------------------------------------------------------------

    @functools.partial(jax.jit, static_argnums=0, donate_argnums=2)
    def propose(self, params: dict, state: MedusaState, inputs: ProposerInputs
                ) -> tuple[DraftOutput, MedusaState]:
        """Draft ``k`` tokens for every request from ``inputs.target_hidden_states [T_pad,
        H]`` at ``token_indices_to_sample``. Returns ``(DraftOutput(token_ids [B_pad, k]
        int32, num_drafts [B_pad] int32), state)``; padding rows hold -1 and 0.
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
        if inputs.draft_sampling is None and not self.config.enable_adaptive_verification:
            drafts = jnp.argmax(logits, axis=-1).astype(_I32).T            # [B, k]
            if token_map is not None:   # truncated head: map its argmax to target ids
                drafts = token_map.astype(_I32)[drafts]
        else:       # head j drafts column j (a truncated head's probs scattered to target ids)
            to_t = None if token_map is None else (lambda d: token_map.astype(_I32)[d])
            heads = [pick(self, logits[j], inputs.draft_sampling, j, to_t,
                          self.model.config.vocab_size) for j in range(k)]
            drafts = jax.tree.map(lambda *c: jnp.stack(c, axis=1), *heads)
        return draft_output(drafts, cad.num_reqs), state

    def _first_heads(self, params: dict, k: int):
        """The runner and params of heads ``0 .. k-1``, and the token map (or None), applied
        after the argmax over the truncated logits."""
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

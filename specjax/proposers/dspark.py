"""DSpark block drafting (vLLM 0.34 ``spec_decode/dspark/speculator.py``): DFlash's context
and block forward, then the Markov head's left-to-right greedy chain over the block."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from specjax.models.dspark import DSparkHead
from specjax.proposers.common import draft_output
from specjax.proposers.dflash import DFlashProposer, DFlashState
from specjax.proposers.types import DraftOutput, ProposerInputs

_I32 = jnp.int32


@dataclasses.dataclass(frozen=True)
class DSparkProposer(DFlashProposer):
    """``method="dspark"``: as :class:`DFlashProposer`; the block is ``[anchor, mask * (k -
    1)]`` with every slot drafting (``sample_from_anchor``, default) or DFlash's ``[anchor,
    mask * k]`` with the mask slots drafting. Greedy drafts only."""

    method_name = "dspark"
    head_class: Any = DSparkHead

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.model.config.sample_from_anchor and self.config.num_speculative_tokens < 2:
            raise ValueError("method='dspark' with sample_from_anchor=True needs "
                             "num_speculative_tokens >= 2 in specjax for now (a one-token block "
                             "[anchor] is not implemented); got 1")

    @functools.partial(jax.jit, static_argnums=0, donate_argnums=2)
    def propose(self, params: dict, state: DFlashState, inputs: ProposerInputs
                ) -> tuple[DraftOutput, DFlashState]:
        """As :meth:`DFlashProposer.propose`; drafts from :func:`~specjax.models.dspark.markov_chain`."""
        k = self.config.num_speculative_tokens
        anchored = self.model.config.sample_from_anchor
        hidden, idx, caches, b, n = self.block_forward(params, state, inputs,
                                                       k - 1 if anchored else k)
        if anchored:                   # every slot of the k-token block
            idx = jnp.arange(b * k, dtype=_I32)
        hb = hidden[idx].reshape(b, k, hidden.shape[-1])
        drafts, _ = self.model.draft(params, hb, jnp.asarray(inputs.next_token_ids, _I32)[:b])
        return draft_output(drafts, n), DFlashState(caches)

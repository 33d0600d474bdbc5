"""DSpark block drafting (vLLM 0.34 ``spec_decode/dspark/speculator.py``): DFlash's context
and block forward, then the Markov head's left-to-right greedy chain over the block."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from specjax.models.dspark import DSparkHead
from specjax.proposers.common import Drafts, draft_output, pick
from specjax.proposers.dflash import DFlashProposer, DFlashState
from specjax.proposers.types import DraftOutput, ProposerInputs

_I32 = jnp.int32


@dataclasses.dataclass(frozen=True)
class DSparkProposer(DFlashProposer):
    """``method="dspark"``: as :class:`DFlashProposer`; the block is ``[anchor, mask * (k -
    1)]`` with every slot drafting (``sample_from_anchor``, default) or DFlash's ``[anchor,
    mask * k]`` with the mask slots drafting. Drafts are picked left to right from the
    Markov-biased logits, greedily or sampled (``draft_sample_method``). With
    ``enable_adaptive_verification`` the draft features are the confidence head's ``c_i``
    when the head has one (:attr:`drafts_confidence`), else ``logit(q_max)``."""

    method_name = "dspark"
    head_class: Any = DSparkHead

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.model.config.sample_from_anchor and self.config.num_speculative_tokens < 2:
            raise ValueError("method='dspark' with sample_from_anchor=True needs "
                             "num_speculative_tokens >= 2 in specjax for now (a one-token block "
                             "[anchor] is not implemented); got 1")

    @property
    def drafts_confidence(self) -> bool:
        """True: ``DraftOutput.features`` are survival probabilities from the confidence
        head (vLLM 0.34: they replace the online acceptance estimator)."""
        return bool(self.config.enable_adaptive_verification
                    and self.model.config.enable_confidence_head)

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
        d2t = params.get("d2t")
        to_target = None if d2t is None else (lambda d: d + d2t[d].astype(_I32))
        conf = self.drafts_confidence

        def choose(logits, i):
            d = pick(self, logits, inputs.draft_sampling, i, to_target,
                     self.model.config.vocab_size, features=False if conf else None)
            return (d.tokens, d) if isinstance(d, Drafts) else (d, None)

        cfg = self.config        # plain: markov_chain's own argmax (top-k without [B, Vd])
        plain = inputs.draft_sampling is None and not cfg.use_local_argmax_reduction and (
            conf or not cfg.enable_adaptive_verification)
        tokens, extra, c = self.model.draft(params, hb, jnp.asarray(inputs.next_token_ids, _I32)[:b],
                                            choose=None if plain else choose,
                                            with_confidence=conf,
                                            topk=cfg.dspark_draft_topk)
        feats = c if conf else None if extra is None else extra.features
        probs = None if extra is None else extra.probs
        drafts = tokens if feats is None and probs is None else Drafts(tokens, feats, probs)
        return draft_output(drafts, n), DFlashState(caches)

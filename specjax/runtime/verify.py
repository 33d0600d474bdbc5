"""Verify-and-propose without the forward, public API: for a stack that runs its model
itself.

``make_verify_step(proposer, vocab_size=V)`` returns a :class:`VerifyStep`; the stack runs
its target on a :class:`~specjax.runtime.step.StepBatch`, computes the logits at
``vs.logits_indices(batch)`` and calls ``vs(draft_params, draft_state, batch, logits, hidden,
aux)``: verification (chain or tree), sampling, logprobs and drafting in one jitted call,
the draft state donated. The fused step (``make_step``) is this plus the target's forward."""

from __future__ import annotations

from typing import Any, Callable

import jax
import numpy as np

from specjax.proposers import Proposer
from specjax.runtime import host_transfer
from specjax.runtime.checks import check_draft_params, check_not_donated
from specjax.runtime.output import StepOutput
from specjax.runtime.step import (StepBatch, _Verifier, chain_logits_indices, check_batch,
                                  configure, make_spec, split_propose, tree_logits_indices,
                                  verify_chain, verify_tree)

__all__ = ["VerifyStep", "make_verify_step"]


def _verify(spec, dparams, draft_state, b: StepBatch, logits, hidden, aux, kv, move_kv):
    if b.attn.tree_mask is not None:
        out, kv, draft_state = verify_tree(spec, dparams, draft_state, b, logits, hidden, aux, kv,
                                           move_kv)
        return out, kv, draft_state, None
    out, draft_state, extra = verify_chain(spec, dparams, draft_state, b, logits, hidden, aux)
    return out, kv, draft_state, extra


_verify_jit = jax.jit(_verify, static_argnums=(0, 8), donate_argnums=(2, 7))


def _packed_verify(spec, dparams, draft_state, words, layout, logits, hidden, aux, kv, move_kv):
    """``_verify`` on a batch sent as one int32 buffer (``specjax.runtime.host_transfer``)."""
    return _verify(spec, dparams, draft_state, host_transfer.unpack(words, layout), logits,
                   hidden, aux, kv, move_kv)


_packed_verify_jit = jax.jit(_packed_verify, static_argnums=(0, 4, 9), donate_argnums=(2, 8))


class VerifyStep(_Verifier):
    """One step's verification and drafting from logits and states the caller computed;
    build it with :func:`make_verify_step`.

    Attributes: ``proposer`` (as run: placed on ``mesh`` or with fused projections; pass
    ``vs.draft_params``) or None, ``feed``, ``k``, ``vocab_size``, ``tree`` (verified on tree
    batches, or None), ``move_kv``, ``mesh`` / ``tp_axis``, ``logits_processors``,
    ``logprobs_mode``."""

    def __init__(self, proposer: Proposer | None, *, vocab_size: int, mesh: Any = None,
                 tp_axis: str = "tp", tree_verification: bool | None = None,
                 logits_processors: tuple = (), logprobs_mode: str = "raw_logprobs",
                 fuse_projections: bool = True, move_kv: Callable | None = None) -> None:
        from specjax.checks import check_int

        vocab = check_int("vocab_size", vocab_size, 1)
        if move_kv is not None and not callable(move_kv):
            raise ValueError(f"move_kv must be None or a function (kv, src_slots, dst_slots) -> "
                             f"kv, got {type(move_kv).__name__}")
        configure(self, proposer, vocab, mesh=mesh, tp_axis=tp_axis,
                  tree_verification=tree_verification, logits_processors=logits_processors,
                  logprobs_mode=logprobs_mode, fuse_projections=fuse_projections)
        self.move_kv = move_kv
        self._spec = make_spec(self, None)

    def init_draft_state(self, num_blocks: int, dtype=None, *, max_num_seqs: int | None = None):
        """The proposer's state for ``num_blocks`` KV blocks (None without a proposer);
        with ``draft_sample_method="probabilistic"`` wrapped with ``max_num_seqs`` request
        slots of draft probabilities (``batch.slots`` names each row's)."""
        if self.proposer is None:
            return None
        state = self.proposer.init_state(num_blocks, dtype)
        if not self._spec.draft_sampling:
            return state
        from specjax.checks import check_int
        from specjax.sampling.draft_sample import init_draft_probs

        if max_num_seqs is None:
            raise ValueError("init_draft_state: max_num_seqs is required for a proposer with "
                             "draft_sample_method='probabilistic' (its draft slots)")
        return init_draft_probs(state, check_int("max_num_seqs", max_num_seqs, 1), self.k,
                                self.vocab_size)

    @property
    def draft_params(self):
        """The params to pass as ``draft_params`` (the proposer's, placed on ``mesh``)."""
        return None if self.proposer is None else self.proposer.params

    def logits_indices(self, batch: StepBatch):
        """``[N] int32``: the rows of ``batch``'s tokens whose target logits the call takes,
        in order (a chain batch: :func:`~specjax.runtime.step.chain_logits_indices`; a tree
        batch: each request's root and nodes, ``B * (1 + num_nodes)`` rows)."""
        check_batch(self, batch)
        if batch.is_tree:
            return tree_logits_indices(batch, self.tree.num_nodes)[0].reshape(-1)
        return chain_logits_indices(batch)

    def __call__(self, draft_params, draft_state, batch: StepBatch, logits, hidden=None,
                 aux=None, kv=None) -> tuple[StepOutput, Any, Any]:
        """Verify ``batch``'s drafts against ``logits`` (``[N, V']``, ``V' >= vocab_size``, at
        :meth:`logits_indices`) and draft the next ones from ``hidden [T, H]`` / ``aux [T,
        n_aux, H]`` of every scheduled token (each required when the proposer reads it).
        ``kv``: the target's KV, compacted by ``move_kv`` on a tree batch (None: the caller
        compacts it from ``StepOutput.accepted_nodes``). ``draft_state`` (from
        :meth:`init_draft_state`) and ``kv`` are donated; sampled drafts
        (``draft_sample_method="probabilistic"``) need ``batch.slots``. Returns ``(StepOutput, draft_state, kv)``; ValueError naming a wrong or
        missing argument before anything runs (``draft_state`` / ``kv`` donated to an earlier
        call, ``draft_params`` None or not shaped as ``vs.draft_params``, a host batch's token
        id outside ``vocab_size``)."""
        check_batch(self, batch)
        check_not_donated(draft_state=draft_state, kv=kv)
        check_draft_params(self, draft_params)
        spec = self._spec
        if spec.draft_sampling:
            from specjax.sampling.draft_sample import DraftProbState

            if batch.slots is None or np.shape(batch.slots) != np.shape(batch.temperature):
                raise ValueError("draft_sample_method='probabilistic': batch.slots must give each "
                                 "row's request slot ([B] int32; padding rows past the slots)")
            if not isinstance(draft_state, DraftProbState):
                raise ValueError("draft_sample_method='probabilistic': draft_state must hold the "
                                 "draft probabilities: build it with vs.init_draft_state(..., "
                                 "max_num_seqs=)")
        n = int(np.shape(self.logits_indices(batch))[0])
        if np.ndim(logits) != 2 or np.shape(logits)[0] != n or np.shape(logits)[1] < self.vocab_size:
            raise ValueError(f"logits must be [{n}, V'] with V' >= vocab_size={self.vocab_size} "
                             f"(one row per logits_indices(batch)), got {np.shape(logits)}")
        t = int(np.shape(batch.input_ids)[0])
        needs = {"hidden": spec.hidden, "aux": spec.aux}
        for name, x in (("hidden", hidden), ("aux", aux)):
            if needs[name] and x is None:
                raise ValueError(f"the {self.proposer.method!r} proposer drafts from the target's "
                                 f"{name} states: pass {name}= ([T={t}, ...], every token)")
            if x is not None and np.shape(x)[0] != t:
                raise ValueError(f"{name} must have one row per scheduled token ({t}), got "
                                 f"{np.shape(x)}")
        hidden = hidden if needs["hidden"] else None
        aux = aux if needs["aux"] else None
        dparams = draft_params if spec.impl is not None else None
        if kv is not None and batch.is_tree and self.move_kv is None:
            raise ValueError("kv= on a tree batch needs make_verify_step(..., move_kv=) to compact "
                             "it; or pass kv=None and compact from StepOutput.accepted_nodes")
        move_kv = self.move_kv if kv is not None else None
        if host_transfer.packable(batch):
            words, layout = host_transfer.pack(batch)
            out, kv, draft_state, extra = _packed_verify_jit(
                spec, dparams, draft_state, words, layout, logits, hidden, aux, kv, move_kv)
        else:
            out, kv, draft_state, extra = _verify_jit(spec, dparams, draft_state, batch, logits,
                                                      hidden, aux, kv, move_kv)
        if extra is not None and not batch.is_tree:
            out, draft_state = split_propose(self.proposer, draft_params, draft_state, batch, out,
                                             extra)
        return out, draft_state, kv


def make_verify_step(proposer: Proposer | None, *, vocab_size: int, mesh: Any = None,
                     tp_axis: str = "tp", tree_verification: bool | None = None,
                     logits_processors: tuple = (), logprobs_mode: str = "raw_logprobs",
                     fuse_projections: bool = True, move_kv: Callable | None = None
                     ) -> VerifyStep:
    """Verification and drafting for a stack that runs its target itself: ``make_step``'s
    arguments less the target, plus its ``vocab_size`` and optional ``move_kv(kv,
    src_slots, dst_slots) -> kv`` (tree verification compacts the caller's KV with it).
    Raises ValueError naming a bad argument before anything compiles."""
    return VerifyStep(proposer, vocab_size=vocab_size, mesh=mesh, tp_axis=tp_axis,
                      tree_verification=tree_verification, logits_processors=logits_processors,
                      logprobs_mode=logprobs_mode, fuse_projections=fuse_projections,
                      move_kv=move_kv)

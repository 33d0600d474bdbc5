"""EAGLE / EAGLE-3 drafting: chain, tree or parallel (vLLM ``llm_base_proposer.py`` + ``eagle.py``).

A frozen, hashable configuration object plus pure functions. ``propose`` is one
``jax.jit`` (configuration static, state donated). No host round trip, no Python loop over
requests, no recompilation inside a shape bucket.

**Chain drafting** (default): the first forward over the target's batch (ids shifted left
by one, the bonus token written at ``token_indices_to_sample``; positions and hidden
states as the target had them), greedy sampling at ``token_indices_to_sample``, then
``k - 1`` single-token steps in a ``lax.fori_loop`` (slot mapping and seq_lens advanced by
``eagle_step_update_slot_mapping_and_metadata``).

**Parallel drafting** (``parallel_drafting=True``, vLLM's P-EAGLE): one forward drafts all
``k`` tokens. vLLM's ``extra_slots_per_request`` is ``k``; EAGLE passes hidden states, so
``net_num_new_slots_per_request`` is ``k - 1``, and for ``k > 1`` the first pass takes the
*shifted extra-slot* path of ``set_inputs_first_pass``:

1. ``copy_and_expand_eagle_inputs(shift_input_ids=True, num_padding_slots_per_request=k,
   padding_token_id=0, parallel_drafting_token_id=...)`` with ``query_end_loc =
   query_start_loc[1:] - 1 - num_rejected``: each request's query becomes ``[its V
   accepted tokens shifted left by one, the bonus token, k - 1 mask tokens, its rejected
   tokens as padding]`` starting at ``start + r * (k - 1)``; positions run on from the
   request's first query position (rejected slots: position 0);
2. hidden states: the target's (EAGLE-3: after ``combine_hidden_states``) scattered
   through the kernel's hidden-state mapping into a zero ``[T + B (k-1), H]`` buffer, then
   the mask slots overwritten with the *parallel-drafting hidden state*: the checkpoint's
   ``mask_hidden`` (``params["mask_hidden"]``: flat ``[n_aux * Ht]`` through
   ``combine_hidden_states`` for EAGLE-3, ``[H]`` for EAGLE-1; the head's
   ``parallel_drafting_hidden_state``), zeros when the params have none (vLLM keeps a zero
   buffer then);
3. ``compute_new_slot_mapping(num_new_tokens=k-1)`` (rejected tokens and positions at or
   past ``max_model_len`` get slot -1) and ``extend_all_queries_by_N(k - 1)``;
4. one forward, greedy drafts at the kernel's ``new_token_indices`` (the bonus and mask
   slots, ``k`` per request): the ``[B, k]`` drafts, no autoregressive steps.

With ``k == 1`` there are no new slots and vLLM takes the default path: exactly chain
drafting with one draft. Parallel drafting needs the padded drafter batch in vLLM (the
config refuses ``disable_padded_drafter_batch=True`` with it), but ``propose`` also runs
on a batch prepared by the non-padded ``prepare_inputs`` (``num_rejected_tokens`` None).

Both modes support ``eagle`` and ``eagle3``, padded-batch mode (``num_rejected_tokens``
given: rejected tokens stay as padding and, in chain mode, ``seq_lens`` shrink before the
chain) and the non-padded mode (``prepare_inputs`` on the host).

**Tree drafting** (a branching ``speculative_token_tree``; ``num_speculative_tokens`` must
equal its node count): the same first pass, then ``specjax.proposers.tree_drafting.tree_drafts``
(vLLM's ``propose_tree``: top-k children per level, one forward per further level over
every node so far under tree attention). ``propose`` then returns ``[B, num_nodes]``
drafts in tree order (``proposer.token_tree`` gives the structure); a serving loop
verifies them with ``specjax.sampling.tree_greedy_verify``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

import specjax.kernels as K
from specjax.attention_metadata import CommonAttentionMetadata
from specjax.config import SpeculativeConfig
from specjax.models.eagle import EagleHead
from specjax.models.eagle3 import Eagle3Head
from specjax.models.mtp import MTPHead
from specjax.proposers.types import DraftOutput, ProposerInputs
from specjax.proposers.common import (
    AheadOfTimeCompile,
    PaddedBatchHelpers,
    chain_steps,
    check_parallel_drafting_token_id,
    check_proposer,
    draft_output,
    drafts_with_first,
    init_kv_caches,
    shift_in_next_tokens,
)
from specjax.sharding.vocab import check_vocab_sharding, proposer_argmax, proposer_top_k
from specjax.proposers.tree_drafting import tree_drafts
from specjax.token_tree import TokenTree

_I32 = jnp.int32


class EagleState(NamedTuple):
    """Every buffer the proposer owns: the draft model's paged KV cache (one
    ``KVCache`` per draft layer, ``[num_blocks, block_size, n_kv, head_dim]``), laid out
    by the same block table as the target's cache."""

    kv_caches: Any


@dataclasses.dataclass(frozen=True)
class EagleProposer(PaddedBatchHelpers, AheadOfTimeCompile):
    """EAGLE-1/2 or EAGLE-3 proposer: chain drafting, tree drafting with a branching
    ``config.speculative_token_tree``, or parallel drafting (P-EAGLE) with
    ``config.parallel_drafting``.

    Attributes:
      config: a ``SpeculativeConfig`` with ``method`` ``"eagle"``, ``"eagle3"`` or ``"mtp"``
        (MiMo MTP: EAGLE-1's data flow, the target's final hidden in, the head's post-norm
        output recycled, every step with the checkpoint's module 0, as vLLM's V1 runner).
      model: the head runner (``EagleHead`` / ``Eagle3Head`` / ``MTPHead``), params passed to ``propose``
        with the target's embedding / lm_head shared in where the head has none
        (``specjax.models.share_target_weights``).
      block_size, max_model_len: of the KV cache / the model.
      parallel_drafting_token_id: the mask token fed at the ``k - 1`` parallel-drafting
        slots (vLLM reads ``dflash_config.mask_token_id``, then ``pard_token``, then
        ``ptd_token_id`` from the draft config; ``specjax.load_pretrained`` puts it into the
        head's ``config.mask_token_id``, which ``make_proposer`` passes on); required with
        ``parallel_drafting``, an id of the head's input (embedding) vocabulary.
      kernel_backend: backend of the index kernels (``"auto"``, ``"xla"``, ...).
      mesh, vocab_axis: with ``config.use_local_argmax_reduction``, greedy drafting takes
        the argmax of each shard of the vocabulary over mesh axis ``vocab_axis`` and
        reduces the (value, index) pairs (``vocab.greedy_argmax``) instead of gathering
        the logits; the vocabulary must divide evenly. Mesh None (default): plain argmax.

    ``warmup(buckets, params, state)`` compiles ``propose`` for every shape bucket ahead of
    time (``common.AheadOfTimeCompile``).
    """

    config: SpeculativeConfig
    model: EagleHead | Eagle3Head | MTPHead
    block_size: int
    max_model_len: int
    parallel_drafting_token_id: int | None = None
    kernel_backend: str = "auto"
    mesh: Mesh | None = None
    vocab_axis: str = "tp"

    #: What a serving loop must feed (see ``ProposerInputs``).
    needs_hidden_states = True

    def __post_init__(self) -> None:
        method = getattr(self.config, "method", None)
        head = {"eagle3": Eagle3Head, "mtp": MTPHead}.get(method, EagleHead)
        cfg = check_proposer(self, method if method in ("eagle", "eagle3", "mtp") else "eagle", head)
        if cfg.parallel_drafting:
            if cfg.disable_padded_drafter_batch:   # SpeculativeConfig refuses it too (vLLM)
                raise ValueError("parallel_drafting=True needs the padded drafter batch: set "
                                 "disable_padded_drafter_batch=False")
            check_parallel_drafting_token_id(self, self.model.config.vocab_size, "the head's")
        tree = self.token_tree
        if not tree.is_chain:
            if cfg.num_speculative_tokens != tree.num_nodes:
                raise ValueError(
                    f"num_speculative_tokens ({cfg.num_speculative_tokens}) must equal the number "
                    f"of nodes of speculative_token_tree ({tree.num_nodes}) for tree drafting: "
                    "the proposer drafts one token per node")
            mc0 = self.model.config
            vocab = (mc0.draft_vocab_size or mc0.vocab_size) if cfg.method == "eagle3" else mc0.vocab_size
            if max(tree.children_per_level) > vocab:
                raise ValueError(f"speculative_token_tree asks for {max(tree.children_per_level)} "
                                 f"children of a node, more than the vocabulary ({vocab})")
        mc = self.model.config
        if cfg.method == "eagle3":   # the argmax runs over the draft vocabulary, then d2t
            check_vocab_sharding(self, mc.draft_vocab_size or mc.vocab_size, "draft_vocab_size")
        else:
            check_vocab_sharding(self, mc.vocab_size, "vocab_size")

    @property
    def num_speculative_tokens(self) -> int:
        return self.config.num_speculative_tokens

    @functools.cached_property
    def token_tree(self) -> TokenTree:
        """The draft tree (a chain of ``k`` nodes unless ``speculative_token_tree`` branches);
        with a branching tree ``propose`` returns one draft per node, in tree order."""
        return TokenTree(self.config.token_tree)

    @property
    def needs_aux_hidden_states(self) -> bool:
        return self.config.method == "eagle3"

    @property
    def num_new_slots_per_request(self) -> int:
        """vLLM's ``net_num_new_slots_per_request``: ``k - 1`` with parallel drafting (``k``
        extra slots, less the one EAGLE's shifted input frees), else 0."""
        return self.config.num_speculative_tokens - 1 if self.config.parallel_drafting else 0

    def init_state(self, num_blocks: int, dtype=jnp.float32) -> EagleState:
        """Zero draft KV cache with ``num_blocks`` blocks (the target's block pool size)."""
        return EagleState(init_kv_caches(self.model, num_blocks, self.block_size, dtype))

    # -- propose ---------------------------------------------------------------------

    @functools.partial(jax.jit, static_argnums=0, donate_argnums=2)
    def propose(self, params: dict, state: EagleState, inputs: ProposerInputs
                ) -> tuple[DraftOutput, EagleState]:
        """Draft ``k`` tokens for every request.

        Returns ``(DraftOutput(token_ids [B_pad, k] int32, num_drafts [B_pad] int32),
        state)``; padding rows (past ``num_reqs``) hold -1 and 0. Tree drafting: ``[B_pad,
        num_nodes]`` in tree order (``k == num_nodes``). With parallel drafting
        (``k > 1``) ``token_indices_to_sample`` is not used: the drafts are sampled at the
        bonus and mask slots of the expanded batch.
        """
        cad = inputs.attn_metadata
        model = self.model
        k = self.config.num_speculative_tokens
        b = cad.query_start_loc.shape[0] - 1
        n = cad.num_reqs
        real = jnp.arange(b, dtype=_I32) < n

        if self.config.method == "eagle3":
            if inputs.aux_hidden_states is None:
                raise ValueError("method='eagle3' needs inputs.aux_hidden_states [T, n_aux, Ht]")
            hidden = model.combine_hidden_states(params, inputs.aux_hidden_states)
        else:
            if inputs.target_hidden_states is None:
                raise ValueError("method='eagle' needs inputs.target_hidden_states [T, H]")
            hidden = inputs.target_hidden_states

        if self.num_new_slots_per_request > 0:
            return self._propose_parallel(params, state, inputs, hidden)

        sample_idx = inputs.token_indices_to_sample
        if sample_idx is None:
            sample_idx = cad.query_start_loc[1:] - 1
        sample_idx = jnp.clip(sample_idx, 0, inputs.target_token_ids.shape[0] - 1)

        # First pass: ids shifted left by one, the sampled token written at each request's
        # sampled index (padding rows write nowhere); positions and hidden states as the
        # target had them.
        ids = shift_in_next_tokens(inputs.target_token_ids, sample_idx, inputs.next_token_ids,
                                   real)
        logits_h, next_h, caches = model.forward(params, ids, inputs.target_positions, hidden,
                                                 state.kv_caches, cad)
        drafts = drafts_with_first(self._greedy(params, logits_h[sample_idx]), k)

        seq_lens = cad.seq_lens
        if inputs.num_rejected_tokens is not None:
            seq_lens = jnp.where(real, seq_lens - inputs.num_rejected_tokens, seq_lens)
        if not self.token_tree.is_chain:
            drafts, caches = tree_drafts(
                self.token_tree, model.forward, self._top, params, logits_h[sample_idx],
                next_h[sample_idx], inputs.target_positions[sample_idx], seq_lens, cad, caches,
                block_size=self.block_size, max_model_len=self.max_model_len)
            return draft_output(drafts, n), EagleState(caches)
        if k > 1:
            drafts, caches = chain_steps(
                self._step, params, drafts, inputs.target_positions[sample_idx],
                next_h[sample_idx], seq_lens, cad, caches, block_size=self.block_size,
                max_model_len=self.max_model_len, backend=self.kernel_backend)
        return draft_output(drafts, n), EagleState(caches)

    def _propose_parallel(self, params: dict, state: EagleState, inputs: ProposerInputs,
                          hidden: jax.Array) -> tuple[DraftOutput, EagleState]:
        """Parallel drafting, ``k > 1`` (vLLM's shifted extra-slot first pass; see the
        module docstring): one forward over ``[accepted tokens shifted, bonus, k - 1 masks,
        rejected padding]`` per request, greedy drafts at the bonus and mask slots."""
        cad = inputs.attn_metadata
        k = self.config.num_speculative_tokens
        net = self.num_new_slots_per_request          # k - 1
        b = cad.query_start_loc.shape[0] - 1
        n = cad.num_reqs
        qsl = cad.query_start_loc
        rejected = inputs.num_rejected_tokens
        query_end_loc = qsl[1:] - 1
        if rejected is not None:
            real = jnp.arange(b, dtype=_I32) < n
            query_end_loc = query_end_loc - jnp.where(real, rejected, 0).astype(_I32)
        t_out = inputs.target_token_ids.shape[0] + b * net
        ids, positions, is_rejected, is_masked, new_token_indices, hidden_map = \
            K.copy_and_expand_eagle_inputs(
                inputs.target_token_ids, inputs.target_positions, inputs.next_token_ids, qsl,
                query_end_loc, padding_token_id=0,
                parallel_drafting_token_id=self.parallel_drafting_token_id,
                num_padding_slots_per_request=k, shift_input_ids=True, num_output_tokens=t_out,
                num_reqs=n, backend=self.kernel_backend)
        # Target hidden state of input token start + j -> output start + r (k-1) + j (tokens
        # of no real request map out of range and are dropped); mask slots get mask_hidden.
        h = jnp.zeros((t_out, hidden.shape[-1]), hidden.dtype).at[hidden_map].set(hidden, mode="drop")
        mask_h = self.model.parallel_drafting_hidden_state(params, hidden.dtype)
        h = jnp.where(is_masked[:, None], mask_h, h)
        slots = K.compute_new_slot_mapping(cad, positions, is_rejected, block_size=self.block_size,
                                           num_new_tokens=net, max_model_len=self.max_model_len)
        md = K.extend_all_queries_by_N(cad, net, slots)
        logits_h, _, caches = self.model.forward(params, ids, positions, h, state.kv_caches, md)
        drafts = self._greedy(params, logits_h[new_token_indices]).reshape(b, k)
        return draft_output(drafts, n), EagleState(caches)

    def _step(self, params, prev, positions, hidden, caches, md):
        logits_h, hidden, caches = self.model.forward(params, prev, positions, hidden, caches, md)
        return self._greedy(params, logits_h), hidden, caches

    def _top(self, params: dict, hidden: jax.Array, c: int) -> jax.Array:
        """``[N, c]`` best tokens (target ids) of each row, best first; ``c == 1``: the
        greedy argmax (with the local argmax reduction when configured), as vLLM's
        ``propose_tree`` (``argmax`` for one child, ``topk`` otherwise)."""
        if c == 1:
            return self._greedy(params, hidden)[:, None]
        # c > 1: lax.top_k, per vocab shard with only the (value, index) candidates
        # gathered under the local argmax reduction (``proposer_top_k``)
        if self.config.method == "eagle3":
            d = proposer_top_k(self, self.model.compute_draft_logits(params, hidden), c)
            return self.model.draft_to_target_ids(params, d).astype(_I32)
        return proposer_top_k(self, self.model.compute_logits(params, hidden), c)

    def _greedy(self, params: dict, hidden: jax.Array) -> jax.Array:
        """Argmax token (target vocabulary) of each row of ``hidden [N, H]``."""
        if self.config.method == "eagle3":
            d = proposer_argmax(self, self.model.compute_draft_logits(params, hidden))
            return self.model.draft_to_target_ids(params, d).astype(_I32)
        return proposer_argmax(self, self.model.compute_logits(params, hidden))


def prepare_inputs(attn_metadata: CommonAttentionMetadata, sampled_token_ids: Sequence[Sequence[int]],
                   num_draft_tokens: Sequence[int]) -> tuple[CommonAttentionMetadata, np.ndarray]:
    """Non-padded mode (host, NumPy; vLLM's ``prepare_inputs``): drop the rejected tokens.

    ``n_rej[i] = n_draft + 1 - len(sampled)`` (0 when there were no drafts); each request
    keeps its first ``q_i - n_rej_i`` tokens. Returns the new metadata (same padded sizes;
    ``query_start_loc``, ``seq_lens``, ``slot_mapping``, ``num_actual_tokens`` updated) and
    ``token_indices [T_pad] int32``: for each kept token its index in the old batch
    (padding entries point at 0), to gather ``target_*`` arrays with.
    """
    qsl = np.asarray(attn_metadata.query_start_loc).astype(np.int64)
    n = int(attn_metadata.num_reqs)
    if len(sampled_token_ids) != n or len(num_draft_tokens) != n:
        raise ValueError(f"sampled_token_ids and num_draft_tokens need one entry per request ({n}), "
                         f"got {len(sampled_token_ids)} and {len(num_draft_tokens)}")
    nd = np.asarray(num_draft_tokens, np.int64)
    ns = np.array([len(s) for s in sampled_token_ids], np.int64)
    rej = np.where(nd > 0, nd + 1 - ns, 0)
    q = qsl[1 : n + 1] - qsl[:n]
    if (rej < 0).any() or (rej > q).any():
        bad = int(np.argmax((rej < 0) | (rej > q)))
        raise ValueError(f"request {bad}: {int(ns[bad])} sampled tokens do not fit its "
                         f"{int(nd[bad])} drafts and {int(q[bad])} scheduled tokens")
    new_q = q - rej
    b_pad, t_pad = attn_metadata.B_pad, attn_metadata.T_pad
    new_qsl = np.zeros(b_pad + 1, np.int64)
    new_qsl[1 : n + 1] = np.cumsum(new_q)
    new_qsl[n + 1 :] = new_qsl[n]
    idx = np.zeros(t_pad, np.int64)
    kept = np.concatenate([np.arange(qsl[r], qsl[r] + new_q[r]) for r in range(n)]) if n else np.zeros(0)
    idx[: len(kept)] = kept
    seq = np.asarray(attn_metadata.seq_lens).astype(np.int64).copy()
    seq[:n] -= rej
    old_slots = np.asarray(attn_metadata.slot_mapping)
    slots = np.full(t_pad, -1, np.int64)
    slots[: len(kept)] = old_slots[kept.astype(np.int64)] if len(kept) else []
    i32 = lambda a: jnp.asarray(a, _I32)  # noqa: E731
    md = attn_metadata.replace(query_start_loc=i32(new_qsl), seq_lens=i32(seq),
                               slot_mapping=i32(slots), num_actual_tokens=i32(int(new_q.sum())))
    return md, idx.astype(np.int32)

"""EAGLE / EAGLE-3 drafting: chain, tree or parallel (vLLM ``llm_base_proposer.py`` + ``eagle.py``).

A frozen, hashable configuration plus pure functions: ``propose`` is one ``jax.jit``
(configuration static, state donated), chain drafting a first forward then ``k - 1``
single-token steps, tree drafting vLLM's ``propose_tree``, parallel drafting (P-EAGLE) one
forward for all ``k``. Data flows: docs/integration.md, "How the device proposers draft".
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
    check_chain_len,
    check_parallel_drafting_token_id,
    check_proposer,
    draft_output,
    drafts_with_first,
    init_kv_caches,
    pad_draft_columns,
    set_head_attention,
    shift_in_next_tokens,
    pick,
    repeat_sampling,
)
from specjax.sharding.vocab import check_vocab_sharding, proposer_top_k
from specjax.proposers.tree_drafting import tree_drafts
from specjax.token_tree import TokenTree

_I32 = jnp.int32


class EagleState(NamedTuple):
    """The draft model's paged KV cache: one ``KVCache`` per draft layer, ``[num_blocks,
    block_size, n_kv, head_dim]``, under the target's block table."""

    kv_caches: Any


@dataclasses.dataclass(frozen=True)
class EagleProposer(PaddedBatchHelpers, AheadOfTimeCompile):
    """EAGLE-1/2, EAGLE-3 or MTP proposer (chain, tree or parallel drafting).

    Attributes:
      config: a ``SpeculativeConfig`` with ``method`` ``"eagle"``, ``"eagle3"`` or ``"mtp"``.
      model: the head runner (``EagleHead`` / ``Eagle3Head`` / ``MTPHead``); its params
        carry the target's embedding / lm_head where it has none.
      block_size, max_model_len: of the KV cache / the model.
      parallel_drafting_token_id: the mask token of the ``k - 1`` parallel-drafting slots
        (the head's ``config.mask_token_id``); required with ``parallel_drafting``.
      kernel_backend: backend of the index kernels (``"auto"``, ``"xla"``, ...).
      mesh, vocab_axis: the local argmax reduction's mesh and axis (None: plain argmax).
      attention: the head's attention, a hashable ``specjax.kernels.paged_attention.AttentionFn``
        (a stack's own kernel; set on a copy of ``model``); None: the head's own (specjax's
        backends unless the head was built with one).
      chain_len: drafts a chain proposes per call, 1..k (None: k; ``with_chain_len``).
    """

    config: SpeculativeConfig
    model: EagleHead | Eagle3Head | MTPHead
    block_size: int
    max_model_len: int
    parallel_drafting_token_id: int | None = None
    kernel_backend: str = "auto"
    mesh: Mesh | None = None
    vocab_axis: str = "tp"
    attention: Any = None
    chain_len: int | None = None

    #: What a serving loop must feed (see ``ProposerInputs``).
    needs_hidden_states = True

    def __post_init__(self) -> None:
        set_head_attention(self, (EagleHead, Eagle3Head, MTPHead))
        method = getattr(self.config, "method", None)
        head = {"eagle3": Eagle3Head, "mtp": MTPHead}.get(method, EagleHead)
        cfg = check_proposer(self, method if method in ("eagle", "eagle3", "mtp") else "eagle", head)
        check_chain_len(self)
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
        """The draft tree (a chain of ``k`` nodes unless ``speculative_token_tree`` branches)."""
        return TokenTree(self.config.token_tree)

    @property
    def needs_aux_hidden_states(self) -> bool:
        return self.config.method == "eagle3"

    @property
    def num_new_slots_per_request(self) -> int:
        """vLLM's ``net_num_new_slots_per_request``: ``k - 1`` with parallel drafting, else 0."""
        return self.config.num_speculative_tokens - 1 if self.config.parallel_drafting else 0

    def init_state(self, num_blocks: int, dtype=jnp.float32) -> EagleState:
        """Zero draft KV cache with ``num_blocks`` blocks (the target's block pool size)."""
        return EagleState(init_kv_caches(self.model, num_blocks, self.block_size, dtype))

    # -- propose ---------------------------------------------------------------------

    @functools.partial(jax.jit, static_argnums=0, donate_argnums=2)
    def propose(self, params: dict, state: EagleState, inputs: ProposerInputs
                ) -> tuple[DraftOutput, EagleState]:
        """Draft ``k`` tokens (a tree: one per node, in tree order) for every request.

        Returns ``(DraftOutput(token_ids [B_pad, k] int32, num_drafts [B_pad] int32),
        state)``; padding rows hold -1 and 0.
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
        ds = inputs.draft_sampling
        c = k if self.chain_len is None else self.chain_len
        drafts = drafts_with_first(self._greedy(params, logits_h[sample_idx], ds), c)

        seq_lens = cad.seq_lens
        if inputs.num_rejected_tokens is not None:
            seq_lens = jnp.where(real, seq_lens - inputs.num_rejected_tokens, seq_lens)
        if not self.token_tree.is_chain:
            drafts, caches = tree_drafts(
                self.token_tree, model.forward, self._top, params, logits_h[sample_idx],
                next_h[sample_idx], inputs.target_positions[sample_idx], seq_lens, cad, caches,
                block_size=self.block_size, max_model_len=self.max_model_len)
            return draft_output(drafts, n), EagleState(caches)
        if c > 1:
            drafts, caches = chain_steps(
                functools.partial(self._step, sampling=ds), params, drafts,
                inputs.target_positions[sample_idx],
                next_h[sample_idx], seq_lens, cad, caches, block_size=self.block_size,
                max_model_len=self.max_model_len, backend=self.kernel_backend)
        return pad_draft_columns(draft_output(drafts, n), k), EagleState(caches)

    def _propose_parallel(self, params: dict, state: EagleState, inputs: ProposerInputs,
                          hidden: jax.Array) -> tuple[DraftOutput, EagleState]:
        """Parallel drafting, ``k > 1``: one forward over ``[accepted tokens shifted, bonus,
        k - 1 masks, rejected padding]`` per request, greedy at the bonus and mask slots."""
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
        drafts = jax.tree.map(lambda x: x.reshape((b, k) + x.shape[1:]), self._greedy(
            params, logits_h[new_token_indices], repeat_sampling(inputs.draft_sampling, k),
            jnp.tile(jnp.arange(k, dtype=_I32), b)))
        return draft_output(drafts, n), EagleState(caches)

    def _step(self, params, prev, positions, hidden, caches, md, col=0, sampling=None):
        logits_h, hidden, caches = self.model.forward(params, prev, positions, hidden, caches, md)
        return self._greedy(params, logits_h, sampling, col), hidden, caches

    def _top(self, params: dict, hidden: jax.Array, c: int) -> jax.Array:
        """``[N, c]`` best tokens (target ids) of each row, best first (argmax for ``c == 1``)."""
        if c == 1:
            return self._greedy(params, hidden)[:, None]
        # c > 1: lax.top_k, per vocab shard with only the (value, index) candidates
        # gathered under the local argmax reduction (``proposer_top_k``)
        if self.config.method == "eagle3":
            d = proposer_top_k(self, self.model.compute_draft_logits(params, hidden), c)
            return self.model.draft_to_target_ids(params, d).astype(_I32)
        return proposer_top_k(self, self.model.compute_logits(params, hidden), c)

    def _greedy(self, params: dict, hidden: jax.Array, sampling=None, col: Any = 0) -> Any:
        """The draft (target vocabulary) of each row of ``hidden [N, H]`` (:func:`pick`)."""
        if self.config.method == "eagle3":
            return pick(self, self.model.compute_draft_logits(params, hidden), sampling, col,
                        lambda d: self.model.draft_to_target_ids(params, d).astype(_I32),
                        self.model.config.vocab_size)
        return pick(self, self.model.compute_logits(params, hidden), sampling, col)


def prepare_inputs(attn_metadata: CommonAttentionMetadata, sampled_token_ids: Sequence[Sequence[int]],
                   num_draft_tokens: Sequence[int]) -> tuple[CommonAttentionMetadata, np.ndarray]:
    """Non-padded mode (host, NumPy; vLLM's ``prepare_inputs``): drop the rejected tokens.

    Each request keeps its first ``q_i - n_rej_i`` tokens (``n_rej = n_draft + 1 -
    len(sampled)``). Returns the new metadata (same padded sizes) and ``token_indices
    [T_pad] int32``, each kept token's index in the old batch (padding: 0).
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

"""Draft-model drafting (vLLM ``draft_model.py`` on ``llm_base_proposer.py``): an
independent LM of the target's vocabulary, with its own embedding, lm_head and KV cache,
drafts from token ids alone (vLLM's ``pass_hidden_states_to_model=False`` path;
docs/integration.md, "How the device proposers draft"). The draft is any ``specjax.Target``
(a ``DecoderLM`` or a stack's own model): only the protocol's members are read.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

import specjax.kernels as K
from specjax.checks import ArgumentTypeError
from specjax.config import SpeculativeConfig
from specjax.kernels.paged_attention import check_attention
from specjax.models.llama import DecoderLM
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
    pick,
    repeat_sampling,
)
from specjax.sharding.vocab import check_vocab_sharding

_I32 = jnp.int32


class DraftModelState(NamedTuple):
    """The draft's KV cache in its own layout (``model.init_kv_caches``; a ``DecoderLM``: one
    ``KVCache`` per layer) over the target's block ids: the target's block table and slot
    mapping address it, so it holds ``num_blocks`` blocks of the target's ``block_size``.
    Block 0 is the null block (the block table's padding points at it; no request's tokens
    live there): a stack without one allocates ``num_blocks + 1`` blocks and passes its block
    ids plus 1 (or reserves one of its blocks as id 0)."""

    kv_caches: Any


@dataclasses.dataclass(frozen=True)
class DraftModelProposer(PaddedBatchHelpers, AheadOfTimeCompile):
    """Chain (or parallel) drafting with an independent draft LM.

    Attributes:
      config, block_size, max_model_len, parallel_drafting_token_id, kernel_backend, mesh,
        vocab_axis: as EAGLE's (``method="draft_model"``).
      model: the draft, any ``specjax.Target`` (e.g. a ``DecoderLM``; its own params);
        recurrent drafts are refused (drafts are rolled back by the block table alone).
      attention: a hashable ``specjax.kernels.paged_attention.AttentionFn`` for a
        ``DecoderLM`` draft's layers (a stack's kernel); None: specjax's backends.
      target_vocab_size: the target's vocabulary size; must equal the draft's.
      target_tensor_parallel_size: the target's TP degree when known; a differing
        ``config.draft_tensor_parallel_size`` is refused (vLLM).
      chain_len: as EAGLE's (drafts a chain proposes per call; None: k).
    """

    config: SpeculativeConfig
    model: Any
    target_vocab_size: int
    block_size: int
    max_model_len: int
    target_tensor_parallel_size: int | None = None
    parallel_drafting_token_id: int | None = None
    kernel_backend: str = "auto"
    mesh: Mesh | None = None
    vocab_axis: str = "tp"
    attention: Callable | None = None
    chain_len: int | None = None

    #: What a serving loop must feed (see ``ProposerInputs``): token ids only.
    needs_hidden_states = False
    needs_aux_hidden_states = False

    def __post_init__(self) -> None:
        _check_draft(self)
        cfg = check_proposer(self, "draft_model", None,
                             ("target_vocab_size", "block_size", "max_model_len"))
        check_chain_len(self)
        draft_vocab = int(self.model.vocab_size)
        if draft_vocab != self.target_vocab_size:
            raise ValueError(
                f"the draft model's vocab_size ({draft_vocab}) must equal the target model's "
                f"vocab_size ({self.target_vocab_size}) for method='draft_model': its token ids "
                "are verified by the target as they are")
        check_vocab_sharding(self, draft_vocab, "vocab_size")
        tgt_tp, draft_tp = self.target_tensor_parallel_size, cfg.draft_tensor_parallel_size
        if tgt_tp is not None and (isinstance(tgt_tp, bool) or not isinstance(tgt_tp, int) or tgt_tp < 1):
            raise ValueError(f"target_tensor_parallel_size must be None or an int >= 1, got {tgt_tp!r}")
        if tgt_tp is not None and draft_tp is not None and draft_tp != tgt_tp:
            raise ValueError(
                f"draft_tensor_parallel_size ({draft_tp}) must equal the target's "
                f"tensor_parallel_size ({tgt_tp}) for method='draft_model' (vLLM); leave it "
                "unset to use the target's")
        check_parallel_drafting_token_id(self, draft_vocab, "the draft model's")

    @property
    def num_speculative_tokens(self) -> int:
        return self.config.num_speculative_tokens

    @property
    def num_new_slots_per_request(self) -> int:
        """vLLM's ``net_num_new_slots_per_request``: 1, or k with parallel drafting."""
        return self.config.num_speculative_tokens if self.config.parallel_drafting else 1

    # -- state -----------------------------------------------------------------------

    def init_state(self, num_blocks: int, dtype=jnp.float32) -> DraftModelState:
        """Zero draft KV cache with ``num_blocks`` blocks (the target's block pool size)."""
        return DraftModelState(init_kv_caches(self.model, num_blocks, self.block_size, dtype))

    def kv_bytes_per_block(self, block_size: int, dtype=jnp.float32) -> int:
        """Bytes of one block of :meth:`init_state` (the draft's ``kv_bytes_per_block``)."""
        return int(self.model.kv_bytes_per_block(block_size, dtype))

    # -- propose ---------------------------------------------------------------------

    @functools.partial(jax.jit, static_argnums=0, donate_argnums=2)
    def propose(self, params: dict, state: DraftModelState, inputs: ProposerInputs
                ) -> tuple[DraftOutput, DraftModelState]:
        """Draft ``k`` tokens for every request from ``inputs.target_token_ids``,
        ``target_positions``, ``next_token_ids``, ``num_rejected_tokens`` (None: none) and
        ``attn_metadata``. Returns ``(DraftOutput(token_ids [B_pad, k] int32, num_drafts
        [B_pad] int32), state)``; padding rows hold -1 and 0.
        """
        cad = inputs.attn_metadata
        model = self.model
        k = self.config.num_speculative_tokens
        p = self.num_new_slots_per_request
        b = cad.query_start_loc.shape[0] - 1
        n = cad.num_reqs
        real = jnp.arange(b, dtype=_I32) < n
        qsl = cad.query_start_loc
        rejected = inputs.num_rejected_tokens
        if rejected is not None:
            rejected = jnp.where(real, rejected, 0).astype(_I32)

        # First pass over the expanded batch: [accepted tokens, bonus, (masks), rejected pad].
        t_out = inputs.target_token_ids.shape[0] + b * p
        query_end_loc = qsl[1:] - 1 if rejected is None else qsl[1:] - 1 - rejected
        ids, positions, is_rejected, _, new_token_indices, _ = K.copy_and_expand_eagle_inputs(
            inputs.target_token_ids, inputs.target_positions, inputs.next_token_ids, qsl,
            query_end_loc, padding_token_id=0,
            parallel_drafting_token_id=(self.parallel_drafting_token_id or 0),
            num_padding_slots_per_request=p, shift_input_ids=False, num_output_tokens=t_out,
            num_reqs=n, backend=self.kernel_backend)
        slots = K.compute_new_slot_mapping(cad, positions, is_rejected, block_size=self.block_size,
                                           num_new_tokens=p, max_model_len=self.max_model_len)
        md = K.extend_all_queries_by_N(cad, p, slots)
        hidden, _, caches = model.forward(params, ids, positions, state.kv_caches, md)
        new_token_indices = new_token_indices.reshape(b, p)
        ds = inputs.draft_sampling
        first = jax.tree.map(lambda x: x.reshape((b, p) + x.shape[1:]), self._greedy(
            params, hidden[new_token_indices.reshape(-1)], repeat_sampling(ds, p),
            jnp.tile(jnp.arange(p, dtype=_I32), b)))

        c = k if self.chain_len is None else self.chain_len
        if p > 1 or c == 1:     # parallel drafting (p == k) or a single draft
            drafts = first
        else:
            drafts = drafts_with_first(jax.tree.map(lambda x: x[:, 0], first), c)
            seq_lens = md.seq_lens if rejected is None else md.seq_lens - rejected
            drafts, caches = chain_steps(
                functools.partial(self._step, sampling=ds), params, drafts, positions[new_token_indices[:, 0]], None, seq_lens,
                cad.replace(max_seq_len=md.max_seq_len), caches, block_size=self.block_size,
                max_model_len=self.max_model_len, backend=self.kernel_backend)
        return pad_draft_columns(draft_output(drafts, n), k), DraftModelState(caches)

    def _step(self, params, prev, positions, hidden, caches, md, col=0, sampling=None):
        h, _, caches = self.model.forward(params, prev, positions, caches, md)
        return self._greedy(params, h, sampling, col), hidden, caches

    def _greedy(self, params: dict, hidden: jax.Array, sampling=None, col: Any = 0) -> Any:
        """The draft of each row of ``hidden [N, H]`` (the draft's own lm_head; columns
        past its ``vocab_size`` are padding; :func:`pick`)."""
        logits = self.model.compute_logits(params, hidden)
        v = self.target_vocab_size
        return pick(self, logits if logits.shape[-1] == v else logits[:, :v], sampling, col)


def _check_draft(prop: DraftModelProposer) -> None:
    """The draft is a non-recurrent ``specjax.Target``; ``attention=`` goes into a
    ``DecoderLM`` draft (a copy with it); a mesh needs a ``DecoderLM`` draft. Errors name
    the argument."""
    from specjax.target import check_target

    model = prop.model
    if getattr(model, "recurrent", False):
        raise ArgumentTypeError(
            f"model: the draft {type(model).__name__} is recurrent (recurrent=True): a draft "
            "model's state is rolled back through the block table alone, so recurrent drafts "
            "are not supported for method='draft_model'")
    check_target(model, "model (the draft)")
    attention = check_attention(prop.attention)
    if attention is not None:
        if not isinstance(model, DecoderLM):
            raise ArgumentTypeError(
                f"attention= applies to a specjax.models.DecoderLM draft; a "
                f"{type(model).__name__} draft runs its own attention inside its forward")
        object.__setattr__(prop, "model", dataclasses.replace(model, attention=attention))
    if prop.mesh is not None and not isinstance(model, DecoderLM):
        raise ValueError(f"mesh= needs a specjax.models.DecoderLM draft; a {type(model).__name__} "
                         "draft (specjax.Target) runs on one device")

"""What every proposer returns (``DraftOutput``), receives (``ProposerInputs``) and
declares to the decoding loop (``Feed``), plus small argument checks."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, NamedTuple, Sequence

import numpy as np

from specjax.checks import check_int
from specjax.token_tree import TokenTree

#: Value of an unused draft slot in ``DraftOutput.token_ids``.
DRAFT_PADDING_ID: int = -1


class DraftOutput(NamedTuple):
    """Draft tokens of one proposer step, padded to a rectangle (a pytree; ``jax.Array``
    leaves from device proposers, ``np.ndarray`` from host ones).

    Attributes:
      token_ids: ``[B, k]`` int32, row ``b``'s drafts in its first ``num_drafts[b]``
        columns, -1 after.
      num_drafts: ``[B]`` int32 in ``[0, k]``.
      features: ``[B, k]`` float32 ``logit(q_max)`` of each draft's distribution, or a
        DSpark confidence head's acceptance probability (``drafts_confidence``)
        (``enable_adaptive_verification``), else None.
      probs: ``[B, k, V]`` float32, each draft's distribution over the target vocabulary
        (``draft_sample_method="probabilistic"``), else None.
    """

    token_ids: Any
    num_drafts: Any
    features: Any = None
    probs: Any = None

    @classmethod
    def from_lists(cls, drafts: Sequence[Sequence[int]], k: int) -> "DraftOutput":
        """Pad ``B`` ragged draft lists (each at most ``k >= 1`` long) to numpy arrays
        ``token_ids [B, k]`` int32 (-1 padded), ``num_drafts [B]`` int32."""
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
            raise ValueError(f"k must be an integer >= 1, got {k!r}")
        token_ids = np.full((len(drafts), int(k)), DRAFT_PADDING_ID, dtype=np.int32)
        num_drafts = np.zeros((len(drafts),), dtype=np.int32)
        for i, draft in enumerate(drafts):
            n = len(draft)
            if n > k:
                raise ValueError(f"drafts[{i}] has {n} tokens, more than k={k}")
            if n:
                token_ids[i, :n] = np.asarray(draft, dtype=np.int32)
            num_drafts[i] = n
        return cls(token_ids, num_drafts)

    def to_lists(self) -> list[list[int]]:
        """The inverse of ``from_lists``: row ``b`` truncated to ``num_drafts[b]``."""
        token_ids = np.asarray(self.token_ids)
        num_drafts = np.asarray(self.num_drafts)
        return [token_ids[b, : int(num_drafts[b])].tolist() for b in range(token_ids.shape[0])]


def resolve_prompt_lookup(prompt_lookup_min: int | None, prompt_lookup_max: int | None) -> tuple[int, int]:
    """vLLM's n-gram size defaults and checks: ``(min_n, max_n)``; both None -> 5, one None
    copies the other; ``ValueError`` unless ``1 <= min <= max``."""
    if prompt_lookup_min is None and prompt_lookup_max is None:
        return 5, 5
    if prompt_lookup_min is None:
        prompt_lookup_min = prompt_lookup_max
    if prompt_lookup_max is None:
        prompt_lookup_max = prompt_lookup_min
    min_n = check_int("prompt_lookup_min", prompt_lookup_min, 1)
    max_n = check_int("prompt_lookup_max", prompt_lookup_max, 1)
    if min_n > max_n:
        raise ValueError(
            f"prompt_lookup_min ({min_n}) must be <= prompt_lookup_max ({max_n})"
        )
    return min_n, max_n


class ProposerInputs(NamedTuple):
    """What a device proposer receives after each target forward (vLLM ``propose``'s
    arguments), as one pytree; fields a method does not need may be None.

    ``target_token_ids`` / ``target_positions [T_pad] int32``: what the target just ran;
    ``target_hidden_states [T_pad, H]`` (final, post-norm); ``aux_hidden_states [T_pad,
    n_aux, Ht]``; ``next_token_ids [B_pad] int32``: each request's sampled token;
    ``token_indices_to_sample [B_pad] int32`` (None: ``query_start_loc[1:] - 1``);
    ``num_rejected_tokens [B_pad] int32`` (padded-batch mode) or None; ``attn_metadata``:
    the target step's ``CommonAttentionMetadata``; ``draft_sampling``: a
    ``specjax.sampling.draft_sample.DraftSampling`` when drafts are sampled, else None.
    """

    target_token_ids: Any
    target_positions: Any
    target_hidden_states: Any
    aux_hidden_states: Any
    next_token_ids: Any
    token_indices_to_sample: Any
    num_rejected_tokens: Any
    attn_metadata: Any
    draft_sampling: Any = None


#: Where a proposer drafts: ``"step"`` inside the fused jitted step (padded drafter batch),
#: ``"split"`` in a second jitted call after vLLM's host ``prepare_inputs`` (non-padded
#: mode, ``disable_padded_drafter_batch=True``), ``"history"`` from the committed token
#: history after the step (``Proposer.propose_from_history``: n-gram CPU / GPU, suffix).
DraftsIn = Literal["step", "split", "history"]


@dataclasses.dataclass(frozen=True)
class Feed:
    """Everything a decoding loop needs to know about a proposer (``Proposer.feed``);
    loops read this, never the method name. Field by field: docs/integration.md, §2.

    Attributes:
      drafts_in: where it drafts (:data:`DraftsIn`).
      num_speculative_tokens: ``k``, the draft columns (a tree's node count).
      hidden_states: feed the target's final post-norm hidden states ``[T, H]``.
      aux_layer_ids: feed the inputs of these target layers ``[T, n_aux, H]``; ``()``: none.
      lookahead: KV slots past each request's scheduled tokens the proposer may write.
      token_tree: the draft ``TokenTree`` (EAGLE / EAGLE-3), else None.
      vocab_size, block_size, max_model_len: what it was built for (None: any).
      drafter_max_model_len: the drafter's shorter context limit, else None; a request
        drafts only while ``num_tokens + depth <= drafter_max_model_len``.
    """

    drafts_in: DraftsIn
    num_speculative_tokens: int
    hidden_states: bool = False
    aux_layer_ids: tuple[int, ...] = ()
    lookahead: int = 0
    token_tree: TokenTree | None = None
    vocab_size: int | None = None
    block_size: int | None = None
    max_model_len: int | None = None
    drafter_max_model_len: int | None = None

    def __post_init__(self) -> None:
        if self.drafts_in not in ("step", "split", "history"):
            raise ValueError(f"Feed.drafts_in must be 'step', 'split' or 'history', got "
                             f"{self.drafts_in!r}")
        check_int("Feed.num_speculative_tokens", self.num_speculative_tokens, 1)
        check_int("Feed.lookahead", self.lookahead, 0)
        if self.drafter_max_model_len is not None:
            check_int("Feed.drafter_max_model_len", self.drafter_max_model_len, 1,
                      self.max_model_len)
        object.__setattr__(self, "aux_layer_ids", tuple(int(i) for i in self.aux_layer_ids))

    @property
    def in_step(self) -> bool:
        """The jitted step runs the proposer (``drafts_in`` ``"step"`` or ``"split"``)."""
        return self.drafts_in != "history"

    @property
    def aux_hidden_states(self) -> bool:
        return bool(self.aux_layer_ids)

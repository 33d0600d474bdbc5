"""What every proposer returns (``DraftOutput``), receives (``ProposerInputs``) and
declares to the decoding loop (``Feed``), plus small argument checks."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, NamedTuple, Sequence

import numpy as np

from specjax.token_tree import TokenTree

#: Value of an unused draft slot in ``DraftOutput.token_ids``.
DRAFT_PADDING_ID: int = -1


class DraftOutput(NamedTuple):
    """Draft tokens of one proposer step, padded to a rectangle.

    A NamedTuple, hence a JAX pytree: it passes through ``jax.jit`` as is. The leaves are
    ``jax.Array`` for device proposers and ``np.ndarray`` for host ones.

    Attributes:
      token_ids: ``[B, k]`` int32. Row ``b`` holds its drafts in columns
        ``0 .. num_drafts[b]-1``; every later column is -1.
      num_drafts: ``[B]`` int32, the number of leading valid drafts of each row
        (``0 <= num_drafts[b] <= k``).
    """

    token_ids: Any
    num_drafts: Any

    @classmethod
    def from_lists(cls, drafts: Sequence[Sequence[int]], k: int) -> "DraftOutput":
        """Pad ragged per-request drafts (vLLM's ``list[list[int]]``) to host arrays.

        Args:
          drafts: ``B`` lists of token ids, each at most ``k`` long.
          k: number of columns of the result (>= 1).

        Returns:
          ``DraftOutput`` of numpy arrays: ``token_ids [B, k]`` int32 (-1 padded),
          ``num_drafts [B]`` int32.
        """
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


def check_int(name: str, value: Any, *, minimum: int | None = None, maximum: int | None = None) -> int:
    """Validate an integer configuration field; raise ValueError naming it and its range.

    ``bool`` is refused (``True`` is not a token count). Returns the value as ``int``.
    """
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an integer{_range_text(minimum, maximum)}, got {value!r}")
    value = int(value)
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        raise ValueError(f"{name} must be an integer{_range_text(minimum, maximum)}, got {value}")
    return value


def _range_text(minimum: int | None, maximum: int | None) -> str:
    if minimum is not None and maximum is not None:
        return f" in [{minimum}, {maximum}]"
    if minimum is not None:
        return f" >= {minimum}"
    if maximum is not None:
        return f" <= {maximum}"
    return ""


def resolve_prompt_lookup(prompt_lookup_min: int | None, prompt_lookup_max: int | None) -> tuple[int, int]:
    """vLLM's n-gram size defaults and checks (``SpeculativeConfig``).

    Both None -> both 5; one None -> it copies the other; each must be >= 1 and
    ``prompt_lookup_min <= prompt_lookup_max``. Returns ``(min_n, max_n)``.
    """
    if prompt_lookup_min is None and prompt_lookup_max is None:
        return 5, 5
    if prompt_lookup_min is None:
        prompt_lookup_min = prompt_lookup_max
    if prompt_lookup_max is None:
        prompt_lookup_max = prompt_lookup_min
    min_n = check_int("prompt_lookup_min", prompt_lookup_min, minimum=1)
    max_n = check_int("prompt_lookup_max", prompt_lookup_max, minimum=1)
    if min_n > max_n:
        raise ValueError(
            f"prompt_lookup_min ({min_n}) must be <= prompt_lookup_max ({max_n})"
        )
    return min_n, max_n


class ProposerInputs(NamedTuple):
    """What a device proposer receives after each target forward (vLLM ``propose``'s
    arguments), as one pytree. Fields a method does not need may be None.

    Attributes:
      target_token_ids: ``[T_pad] int32``, the tokens the target just ran.
      target_positions: ``[T_pad] int32``.
      target_hidden_states: ``[T_pad, H]``, the target's final post-norm hidden states
        (EAGLE, Medusa).
      aux_hidden_states: ``[T_pad, n_aux, Ht]``, inputs of the target's aux layers
        (EAGLE-3, DFlash, extract-hidden-states).
      next_token_ids: ``[B_pad] int32``, the token each request sampled this step (the
        bonus or recovered token; ``eagle_prepare_next_token_padded``).
      token_indices_to_sample: ``[B_pad] int32`` or None (= ``query_start_loc[1:] - 1``),
        the token of each request whose output is sampled (``eagle_prepare_inputs_padded``
        in padded mode, ``prepare_inputs`` otherwise).
      num_rejected_tokens: ``[B_pad] int32`` or None: padded-batch mode when given (the
        rejected tokens stay in the batch as padding).
      attn_metadata: the target step's ``CommonAttentionMetadata``.
    """

    target_token_ids: Any
    target_positions: Any
    target_hidden_states: Any
    aux_hidden_states: Any
    next_token_ids: Any
    token_indices_to_sample: Any
    num_rejected_tokens: Any
    attn_metadata: Any


#: Where a proposer drafts: ``"step"`` inside the fused jitted step (padded drafter batch),
#: ``"split"`` in a second jitted call after vLLM's host ``prepare_inputs`` (non-padded
#: mode, ``disable_padded_drafter_batch=True``), ``"history"`` from the committed token
#: history after the step (``Proposer.propose_from_history``: n-gram CPU / GPU, suffix).
DraftsIn = Literal["step", "split", "history"]


@dataclasses.dataclass(frozen=True)
class Feed:
    """Everything a decoding loop needs to know about a proposer: the one record it reads
    (``Proposer.feed``), never the method name.

    Attributes:
      drafts_in: where it drafts (:data:`DraftsIn`).
      num_speculative_tokens: ``k``, the draft columns (a tree's node count).
      hidden_states: feed the target's final post-norm hidden states ``[T, H]``.
      aux_layer_ids: feed the inputs of these target layers ``[T, n_aux, H]`` (build the
        target with them); ``()``: none.
      lookahead: KV slots past each request's scheduled tokens the proposer may write
        (``k + max_num_new_slots_for_drafting + 1``, vLLM's ``num_lookahead_tokens``):
        allocate blocks that far ahead.
      token_tree: the draft tree (``specjax.token_tree.TokenTree``; a chain when it does not
        branch) for proposers that draft trees (EAGLE / EAGLE-3), else None.
      vocab_size: vocabulary the drafts are in (None: any, n-gram / suffix); must equal
        the target's.
      block_size / max_model_len: what the proposer was built for (None: unconstrained);
        the loop must use the same.
      drafter_max_model_len: the drafter's context limit when it is shorter than
        ``max_model_len`` (``SpeculativeConfig.max_model_len``, vLLM's draft
        ``max_model_len``), else None: a request drafts for its next step only while every
        draft position stays below it (``num_tokens + depth <= drafter_max_model_len``;
        ``depth``: k, a tree's depth); past it the request decodes without drafts.
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
        check_int("Feed.num_speculative_tokens", self.num_speculative_tokens, minimum=1)
        check_int("Feed.lookahead", self.lookahead, minimum=0)
        if self.drafter_max_model_len is not None:
            check_int("Feed.drafter_max_model_len", self.drafter_max_model_len, minimum=1,
                      maximum=self.max_model_len)
        object.__setattr__(self, "aux_layer_ids", tuple(int(i) for i in self.aux_layer_ids))

    @property
    def in_step(self) -> bool:
        """The jitted step runs the proposer (``drafts_in`` ``"step"`` or ``"split"``)."""
        return self.drafts_in != "history"

    @property
    def aux_hidden_states(self) -> bool:
        return bool(self.aux_layer_ids)

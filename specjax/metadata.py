"""``SpecDecodeMetadata``: where the drafts sit in the verified batch (vLLM ``metadata.py``)."""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax.constants import check_index_range

_ARRAY_FIELDS = (
    "draft_token_ids",
    "num_draft_tokens",
    "cu_num_draft_tokens",
    "cu_num_sampled_tokens",
    "target_logits_indices",
    "bonus_logits_indices",
    "logits_indices",
    "num_reqs",
)


@dataclasses.dataclass(frozen=True, eq=False)
class SpecDecodeMetadata:
    """Flattened drafts of ``num_reqs`` requests, padded to ``B_pad`` rows / ``N_pad`` drafts.

    Attributes (device arrays, int32):
      draft_token_ids: ``[N_pad]`` all drafts back to back (-1 on padding).
      num_draft_tokens: ``[B_pad]`` drafts per request (0 on padding rows).
      cu_num_draft_tokens, cu_num_sampled_tokens: ``[B_pad]`` inclusive cumsums of
        ``num_draft_tokens`` and ``num_draft_tokens + 1`` (padding repeats the last).
      target_logits_indices / bonus_logits_indices: ``[N_pad]`` / ``[B_pad]`` rows of
        ``logits`` for each draft / bonus position.
      logits_indices: ``[N_pad + B_pad]`` target-batch token index of every ``logits`` row.
      num_reqs: 0-d; max_spec_len: static int, the draft-count bucket.
    """

    draft_token_ids: jax.Array
    num_draft_tokens: jax.Array
    cu_num_draft_tokens: jax.Array
    cu_num_sampled_tokens: jax.Array
    target_logits_indices: jax.Array
    bonus_logits_indices: jax.Array
    logits_indices: jax.Array
    num_reqs: jax.Array
    max_spec_len: int

    @classmethod
    def from_draft_lists(
        cls,
        draft_token_ids: Sequence[Sequence[int]],
        cu_num_scheduled_tokens: Sequence[int] | None = None,
        *,
        max_spec_len: int | None = None,
        num_reqs_pad: int | None = None,
        num_drafts_pad: int | None = None,
    ) -> "SpecDecodeMetadata":
        """Build from per-request draft lists on the host (vLLM's
        ``_calc_spec_decode_metadata``); ``cu_num_scheduled_tokens [num_reqs]``: inclusive
        cumsum of scheduled tokens (None: ``n_draft + 1`` each)."""
        drafts = [list(map(int, d)) for d in draft_token_ids]
        n = len(drafts)
        nd = np.array([len(d) for d in drafts], dtype=np.int64)
        if cu_num_scheduled_tokens is None:
            cu_sched = np.cumsum(nd + 1)
        else:
            cu_sched = np.asarray(cu_num_scheduled_tokens, dtype=np.int64)
            if cu_sched.shape != (n,):
                raise ValueError(f"cu_num_scheduled_tokens must have one entry per request ({n}), "
                                 f"got shape {cu_sched.shape}")
        sched = np.diff(cu_sched, prepend=0)
        if (sched < nd + 1).any():
            bad = int(np.argmax(sched < nd + 1))
            raise ValueError(f"request {bad} was scheduled {int(sched[bad])} tokens, fewer than its "
                             f"{int(nd[bad])} drafts + 1 (cu_num_scheduled_tokens)")
        check_index_range("cu_num_scheduled_tokens[-1]", int(cu_sched[-1]) if n else 0)
        total = int(nd.sum())
        msl = int(nd.max(initial=0)) if max_spec_len is None else max_spec_len
        if msl < int(nd.max(initial=0)):
            raise ValueError(f"max_spec_len={msl} is below the longest draft {int(nd.max())}")
        b_pad = n if num_reqs_pad is None else num_reqs_pad
        n_pad = total if num_drafts_pad is None else num_drafts_pad
        if b_pad < n or n_pad < total:
            raise ValueError(f"num_reqs_pad={b_pad} / num_drafts_pad={n_pad} are below the real "
                             f"counts {n} / {total}")

        cu_draft = np.cumsum(nd)
        cu_sampled = np.cumsum(nd + 1)
        # Per request: the last n_draft + 1 scheduled tokens produce logits.
        logits_idx = np.concatenate(
            [np.arange(cu_sched[r] - nd[r] - 1, cu_sched[r]) for r in range(n)]
        ) if n else np.zeros(0, np.int64)
        target_idx = np.concatenate(
            [np.arange(cu_sampled[r] - nd[r] - 1, cu_sampled[r] - 1) for r in range(n)]
        ) if n else np.zeros(0, np.int64)

        def pad(a, size, fill, repeat_last=False):
            out = np.full(size, fill, np.int64)
            out[: len(a)] = a
            if repeat_last and len(a) and size > len(a):
                out[len(a):] = a[-1]
            return jnp.asarray(out, jnp.int32)

        return cls(
            draft_token_ids=pad(np.array([t for d in drafts for t in d], np.int64), n_pad, -1),
            num_draft_tokens=pad(nd, b_pad, 0),
            cu_num_draft_tokens=pad(cu_draft, b_pad, 0, repeat_last=True),
            cu_num_sampled_tokens=pad(cu_sampled, b_pad, 0, repeat_last=True),
            target_logits_indices=pad(target_idx, n_pad, 0),
            bonus_logits_indices=pad(cu_sampled - 1, b_pad, 0),
            logits_indices=pad(logits_idx, n_pad + b_pad, 0),
            num_reqs=jnp.asarray(n, jnp.int32),
            max_spec_len=int(msl),
        )

    @classmethod
    def make_dummy(cls, draft_token_ids: Sequence[Sequence[int]]) -> "SpecDecodeMetadata":
        """Counts and cumsums from the lists; the three index arrays zero (vLLM's dummy)."""
        m = cls.from_draft_lists(draft_token_ids)
        return dataclasses.replace(
            m,
            target_logits_indices=jnp.zeros_like(m.target_logits_indices),
            bonus_logits_indices=jnp.zeros_like(m.bonus_logits_indices),
            logits_indices=jnp.zeros_like(m.logits_indices),
        )

    def replace(self, **changes) -> "SpecDecodeMetadata":
        return dataclasses.replace(self, **changes)


jax.tree_util.register_dataclass(
    SpecDecodeMetadata, data_fields=list(_ARRAY_FIELDS), meta_fields=["max_spec_len"]
)

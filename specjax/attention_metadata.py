"""``CommonAttentionMetadata``: the ragged-batch description every step passes around.

A registered pytree: device arrays are leaves; padded sizes, the ``max_query_len`` bucket
and ``causal`` are static, so a step compiles once per bucket.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specjax.constants import PADDING_SLOT_ID, check_index_range

_ARRAY_FIELDS = (
    "query_start_loc",
    "seq_lens",
    "block_table",
    "slot_mapping",
    "num_reqs",
    "num_actual_tokens",
    "max_seq_len",
)
_STATIC_FIELDS = ("max_query_len", "causal", "tree_mask")


def _shape_of(x: Any) -> tuple[int, ...] | None:
    return tuple(x.shape) if hasattr(x, "shape") else None


@dataclasses.dataclass(frozen=True, eq=False)
class CommonAttentionMetadata:
    """Ragged batch of ``num_reqs`` requests padded to ``B_pad`` rows and ``T_pad`` tokens.

    Attributes:
      query_start_loc: ``[B_pad + 1] int32``; padding rows repeat the last real value.
      seq_lens: ``[B_pad] int32``, context length including this step's tokens (0: padding).
      block_table: ``[B_pad, max_blocks] int32``.
      slot_mapping: ``[T_pad] int32``, -1 on padding tokens.
      num_reqs, num_actual_tokens, max_seq_len: 0-d int32 device scalars.
      max_query_len: static int, the query-length bucket (an upper bound).
      causal: static bool.
      tree_mask: static ``None`` or ``Q x Q`` bools (vLLM's ``tree_attn_bias``): query ``i``
        sees the context before its block and query ``j`` of its block iff
        ``tree_mask[i][j]`` (``causal`` ignored; query lengths at most ``Q``).
    """

    query_start_loc: jax.Array
    seq_lens: jax.Array
    block_table: jax.Array
    slot_mapping: jax.Array
    num_reqs: jax.Array
    num_actual_tokens: jax.Array
    max_seq_len: jax.Array
    max_query_len: int
    causal: bool = True
    tree_mask: tuple[tuple[bool, ...], ...] | None = None

    def __post_init__(self) -> None:
        qsl = _shape_of(self.query_start_loc)
        if qsl is None:  # pytree internals (tracing with placeholder leaves): no checks
            return
        if len(qsl) != 1 or qsl[0] < 1:
            raise ValueError(f"query_start_loc must be [B_pad + 1], got shape {qsl}")
        b = qsl[0] - 1
        for name, want in (("seq_lens", (b,)), ("num_reqs", ()), ("num_actual_tokens", ()),
                           ("max_seq_len", ())):
            got = _shape_of(getattr(self, name))
            if got is not None and got != want:
                raise ValueError(f"{name} must have shape {want} (B_pad={b}), got {got}")
        bt = _shape_of(self.block_table)
        if bt is not None and (len(bt) != 2 or bt[0] != b):
            raise ValueError(f"block_table must be [B_pad={b}, max_blocks], got {bt}")
        sm = _shape_of(self.slot_mapping)
        if sm is not None and len(sm) != 1:
            raise ValueError(f"slot_mapping must be [T_pad], got {sm}")
        for name in _ARRAY_FIELDS:
            x = getattr(self, name)
            if hasattr(x, "dtype") and x.dtype != jnp.int32:
                raise ValueError(f"{name} must be int32, got {x.dtype}")
        if isinstance(self.max_query_len, bool) or not isinstance(
            self.max_query_len, (int, np.integer)
        ) or self.max_query_len < 0:
            raise ValueError(f"max_query_len must be a non-negative int, got {self.max_query_len!r}")
        if not isinstance(self.causal, (bool, np.bool_)):
            raise ValueError(f"causal must be a bool, got {self.causal!r}")
        tm = self.tree_mask
        if tm is not None:
            ok = isinstance(tm, tuple) and len(tm) > 0 and all(
                isinstance(r, tuple) and len(r) == len(tm)
                and all(isinstance(x, (bool, np.bool_)) for x in r) for r in tm)
            if not ok:
                raise ValueError("tree_mask must be None or a non-empty square tuple of tuples of "
                                 f"bools, got {tm!r}")

    # -- construction --------------------------------------------------------------

    @classmethod
    def from_query_lens(
        cls,
        query_lens,
        seq_lens,
        block_table,
        *,
        block_size: int,
        num_reqs_pad: int | None = None,
        num_tokens_pad: int | None = None,
        max_query_len: int | None = None,
        causal: bool = True,
    ) -> "CommonAttentionMetadata":
        """Build padded metadata on the host (not jittable) from ``query_lens``, ``seq_lens``
        ``[num_reqs]`` and ``block_table [num_reqs, max_blocks]``; each request's query is
        its last ``query_len`` positions."""
        q = np.asarray(query_lens, dtype=np.int64)
        s = np.asarray(seq_lens, dtype=np.int64)
        bt = np.asarray(block_table, dtype=np.int64)
        n = q.shape[0]
        if q.ndim != 1 or s.shape != (n,):
            raise ValueError(f"query_lens and seq_lens must be [num_reqs]; got {q.shape}, {s.shape}")
        if bt.ndim != 2 or bt.shape[0] != n:
            raise ValueError(f"block_table must be [num_reqs={n}, max_blocks], got {bt.shape}")
        if (q < 0).any() or (s < q).any():
            raise ValueError("need 0 <= query_lens <= seq_lens for every request")
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        check_index_range("num_blocks * block_size", int(max(bt.max(initial=0) + 1, 1)) * block_size)
        if (s > bt.shape[1] * block_size).any():
            raise ValueError("seq_lens exceed block_table capacity (max_blocks * block_size)")
        b_pad = n if num_reqs_pad is None else num_reqs_pad
        if b_pad < n:
            raise ValueError(f"num_reqs_pad={b_pad} is smaller than num_reqs={n}")
        t = int(q.sum())
        t_pad = t if num_tokens_pad is None else num_tokens_pad
        if t_pad < t:
            raise ValueError(f"num_tokens_pad={t_pad} is smaller than the token count {t}")
        mql = int(q.max(initial=0)) if max_query_len is None else max_query_len
        if mql < int(q.max(initial=0)):
            raise ValueError(f"max_query_len={mql} is below the longest query {int(q.max())}")
        qsl = np.zeros(b_pad + 1, np.int64)
        qsl[1 : n + 1] = np.cumsum(q)
        qsl[n + 1 :] = t
        seq = np.zeros(b_pad, np.int64)
        seq[:n] = s
        table = np.zeros((b_pad, max(bt.shape[1], 1)), np.int64)
        table[:n, : bt.shape[1]] = bt
        slots = np.full(t_pad, PADDING_SLOT_ID, np.int64)
        for r in range(n):
            pos = np.arange(s[r] - q[r], s[r])
            slots[qsl[r] : qsl[r + 1]] = table[r, pos // block_size] * block_size + pos % block_size
        i32 = lambda a: jnp.asarray(a, dtype=jnp.int32)  # noqa: E731
        return cls(
            query_start_loc=i32(qsl), seq_lens=i32(seq), block_table=i32(table),
            slot_mapping=i32(slots), num_reqs=i32(n), num_actual_tokens=i32(t),
            max_seq_len=i32(int(s.max(initial=0))), max_query_len=int(mql), causal=bool(causal),
        )

    # -- accessors -----------------------------------------------------------------

    @property
    def B_pad(self) -> int:
        return self.query_start_loc.shape[0] - 1

    @property
    def T_pad(self) -> int:
        return self.slot_mapping.shape[0]

    def batch_size(self) -> int:
        """The padded row count ``B_pad`` (static)."""
        return self.B_pad

    def naive_query_lens(self) -> jax.Array:
        """``[B_pad] int32``: ``query_start_loc[1:] - query_start_loc[:-1]`` (0 on padding)."""
        return self.query_start_loc[1:] - self.query_start_loc[:-1]

    def replace(self, **changes: Any) -> "CommonAttentionMetadata":
        return dataclasses.replace(self, **changes)


def _flatten(m: CommonAttentionMetadata):
    return tuple(getattr(m, f) for f in _ARRAY_FIELDS), tuple(getattr(m, f) for f in _STATIC_FIELDS)


def _flatten_with_keys(m: CommonAttentionMetadata):
    children = tuple((jax.tree_util.GetAttrKey(f), getattr(m, f)) for f in _ARRAY_FIELDS)
    return children, tuple(getattr(m, f) for f in _STATIC_FIELDS)


def _unflatten(aux, children) -> CommonAttentionMetadata:
    obj = object.__new__(CommonAttentionMetadata)
    for f, v in zip(_ARRAY_FIELDS, children):
        object.__setattr__(obj, f, v)
    for f, v in zip(_STATIC_FIELDS, aux):
        object.__setattr__(obj, f, v)
    return obj


jax.tree_util.register_pytree_with_keys(
    CommonAttentionMetadata, _flatten_with_keys, _unflatten, _flatten
)

"""N-gram (prompt lookup) proposer on the accelerator: one jit-compiled XLA computation.

The choice rule is the CPU proposer's (``ngram_cpu``), with the draft capped at
``max_model_len``. The token buffer stays on the device (``NgramGPUState``); every call is a
pure function of it, jit-compiled with the state donated so XLA updates it in place.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any, Callable, Hashable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from specjax.checks import check_int
from specjax.config import SpeculativeConfig
from specjax.constants import INT32_LIMIT, next_power_of_2
from specjax.proposers.types import (
    DRAFT_PADDING_ID,
    DraftOutput,
    resolve_prompt_lookup,
)
from specjax.proposers.interface import HistoryProposer, TokenHistory, history_feed


class NgramGPUState(NamedTuple):
    """Device token buffer of the persistent batch (a pytree; donate it to every step):
    ``token_ids [max_num_seqs, T]`` int32, row ``r``'s context in its first
    ``num_tokens[r]`` columns; ``num_tokens [max_num_seqs]`` int32 (0: empty row)."""

    token_ids: jax.Array
    num_tokens: jax.Array


def ngram_search(
    token_ids: jax.Array,
    num_tokens: jax.Array,
    valid: jax.Array,
    *,
    k: int,
    min_n: int,
    max_n: int,
    max_model_len: int,
) -> DraftOutput:
    """Draft by n-gram lookup for every row of a padded batch (traceable; no host sync).

    ``token_ids [B, T]`` int32 (row ``b``'s context in its first ``num_tokens[b]`` columns),
    ``num_tokens [B]`` int32 in ``[0, T]``, ``valid [B]`` bool (False: no draft); ``k``,
    ``min_n``, ``max_n``, ``max_model_len`` static ints. Returns ``DraftOutput(token_ids
    [B, k] int32 (-1 padded), num_drafts [B] int32)``.
    """
    # For each end position e, match_len(e) = length of the run of e - j matching the
    # context's j-th last token; one max over the key m * (T + 1) + (T - e) picks the
    # longest match, then the earliest end.
    batch, width = token_ids.shape
    token_ids = token_ids.astype(jnp.int32)
    lengths = jnp.clip(num_tokens.astype(jnp.int32), 0, width)[:, None]  # [B, 1]
    last = lengths - 1

    # The context's tail, last token first: tail[:, j] = tokens[L - 1 - j].
    offsets = jnp.arange(max_n, dtype=jnp.int32)[None, :]
    tail_index = jnp.clip(last - offsets, 0, width - 1)
    tail = jnp.take_along_axis(token_ids, tail_index, axis=1)  # [B, max_n]

    end = lax.broadcasted_iota(jnp.int32, (batch, width), 1)  # candidate end e
    run = jnp.ones((batch, width), dtype=jnp.bool_)
    match_len = jnp.zeros((batch, width), dtype=jnp.int32)
    for j in range(min(max_n, width)):  # unrolled at trace time; no match is longer than T
        # shifted[:, e] = tokens[:, e - j]; the j columns shifted in are masked by e >= j.
        shifted = token_ids if j == 0 else jnp.pad(token_ids[:, : width - j], ((0, 0), (j, 0)))
        run = run & (shifted == tail[:, j : j + 1]) & (end >= j)
        match_len = match_len + run.astype(jnp.int32)

    # An occurrence must end at e <= L - 2 so that at least one token follows it.
    eligible = (match_len >= min_n) & (end <= lengths - 2) & valid[:, None]
    key = jnp.where(eligible, match_len * (width + 1) + (width - end), 0)
    best = jnp.max(key, axis=1)  # [B]
    found = best > 0
    best_end = width - best % (width + 1)

    start = best_end + 1
    lengths = lengths[:, 0]
    budget = jnp.minimum(k, max_model_len - lengths)
    count = jnp.where(found, jnp.clip(jnp.minimum(budget, lengths - start), 0, k), 0)
    column = jnp.arange(k, dtype=jnp.int32)[None, :]
    draft_index = jnp.clip(start[:, None] + column, 0, width - 1)
    drafts = jnp.take_along_axis(token_ids, draft_index, axis=1)
    drafts = jnp.where(column < count[:, None], drafts, DRAFT_PADDING_ID)
    return DraftOutput(drafts.astype(jnp.int32), count.astype(jnp.int32))


@dataclasses.dataclass(frozen=True)
class NgramGPUProposer:
    """Static configuration of the device n-gram proposer (hashable; static under jit):
    ``num_speculative_tokens`` (k >= 1), ``max_model_len`` (>= 1, the draft cap) and
    ``prompt_lookup_min`` / ``_max`` (resolved as in vLLM's ``SpeculativeConfig``)."""

    num_speculative_tokens: int
    max_model_len: int
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None

    def __post_init__(self) -> None:
        k = check_int("num_speculative_tokens", self.num_speculative_tokens, 1)
        max_model_len = check_int("max_model_len", self.max_model_len, 1)
        min_n, max_n = resolve_prompt_lookup(self.prompt_lookup_min, self.prompt_lookup_max)
        # The selection key m * (T + 1) + (T - e) must fit int32 for every buffer width T up
        # to max_model_len.
        if (max_n + 1) * (max_model_len + 1) >= INT32_LIMIT:
            raise ValueError(
                f"(prompt_lookup_max + 1) * (max_model_len + 1) must be < 2**31 for the int32 "
                f"search key; got prompt_lookup_max={max_n}, max_model_len={max_model_len}"
            )
        object.__setattr__(self, "num_speculative_tokens", k)
        object.__setattr__(self, "max_model_len", max_model_len)
        object.__setattr__(self, "prompt_lookup_min", min_n)
        object.__setattr__(self, "prompt_lookup_max", max_n)

    @property
    def k(self) -> int:
        return self.num_speculative_tokens

    # ------------------------------------------------------------------ state

    def init_state(self, max_num_seqs: int, width: int | None = None) -> NgramGPUState:
        """An empty buffer ``[max_num_seqs, width]`` (``width`` default ``max_model_len``)."""
        rows = check_int("max_num_seqs", max_num_seqs, 1)
        width = self.max_model_len if width is None else check_int("width", width, 1)
        if width > self.max_model_len:
            raise ValueError(f"width must be in [1, max_model_len={self.max_model_len}], got {width}")
        if rows * width >= INT32_LIMIT:
            raise ValueError(f"max_num_seqs * width = {rows * width} must be < 2**31 (int32 indexing)")
        return NgramGPUState(
            jnp.zeros((rows, width), dtype=jnp.int32), jnp.zeros((rows,), dtype=jnp.int32)
        )

    # ------------------------------------------------------------------ drafting

    def propose(
        self, state: NgramGPUState, sampled_token_ids: jax.Array, num_sampled: jax.Array,
        *, rows: jax.Array | None = None,
    ) -> tuple[DraftOutput, NgramGPUState]:
        """Append this step's sampled tokens and draft; ``state`` is donated.

        ``sampled_token_ids [B, S]`` int32: row ``b``'s accepted tokens plus bonus in its
        first ``num_sampled[b]`` columns (-1 not written); a row with ``num_sampled`` 0 gets
        no draft. Batch row ``b`` is buffer row ``b``, or ``rows[b]`` (``[B]`` int32,
        distinct; -1 a padding row). Returns ``(DraftOutput [B, k] / [B], new state)``; rows
        at ``max_model_len`` or shorter than ``prompt_lookup_min`` get no draft.
        """
        _check_batch(state, sampled_token_ids, num_sampled)
        if rows is None:
            return _propose_step(self, state, sampled_token_ids, num_sampled)
        _check_int_dtype("rows", rows)
        if rows.shape != num_sampled.shape:
            raise ValueError(f"rows must be [{num_sampled.shape[0]}], got {rows.shape}")
        return _propose_rows_jit(self, state, rows, sampled_token_ids, num_sampled)

    def search(self, token_ids: jax.Array, num_tokens: jax.Array, valid: jax.Array) -> DraftOutput:
        """``ngram_search`` with this configuration (traceable; the device loop's hook)."""
        return _search(self, token_ids, num_tokens, valid)

    def propose_arrays(
        self, num_tokens: jax.Array, token_ids: jax.Array, valid: jax.Array | None = None
    ) -> DraftOutput:
        """Stateless drafting over a caller-owned buffer (nothing donated): ``num_tokens
        [B]``, ``token_ids [B, T]`` int32, ``valid [B]`` bool (default all True)."""
        _check_int_dtype("token_ids", token_ids)
        _check_int_dtype("num_tokens", num_tokens)
        if token_ids.ndim != 2 or num_tokens.shape != (token_ids.shape[0],):
            raise ValueError(
                f"token_ids must be [B, T] and num_tokens [B]; got {token_ids.shape} and {num_tokens.shape}"
            )
        if (self.prompt_lookup_max + 1) * (token_ids.shape[1] + 1) >= INT32_LIMIT:
            raise ValueError(f"token_ids width {token_ids.shape[1]} is too wide for the int32 search key")
        if valid is None:
            valid = jnp.ones(num_tokens.shape, dtype=jnp.bool_)
        elif valid.shape != num_tokens.shape or valid.dtype != jnp.bool_:
            raise ValueError(f"valid must be a [{num_tokens.shape[0]}] bool array, got {valid.shape} {valid.dtype}")
        return _propose_arrays(self, token_ids, num_tokens, valid)

    def propose_packed(self, state: NgramGPUState, packed: jax.Array) -> tuple[jax.Array, NgramGPUState]:
        """``propose(..., rows=)`` as one transfer each way (``state`` donated): ``packed
        [B, 2 + S]`` int32 (buffer row or -1, ``num_sampled``, sampled tokens) -> ``([B, k +
        1]`` int32 drafts (-1 padded) then count, new state)."""
        _check_state(state)
        _check_int_dtype("packed", packed)
        if packed.ndim != 2 or packed.shape[1] < 3:
            raise ValueError(f"packed must be [B, 2 + S] with S >= 1, got {packed.shape}")
        if packed.shape[0] > state.num_tokens.shape[0]:
            raise ValueError(f"batch size {packed.shape[0]} exceeds the buffer's {state.num_tokens.shape[0]} rows")
        return _propose_packed_jit(self, state, packed)

    # ------------------------------------------------------------------ persistent batch

    def add_requests(
        self, state: NgramGPUState, rows: jax.Array, token_ids: jax.Array, num_tokens: jax.Array
    ) -> NgramGPUState:
        """Write joining requests' contexts into their rows (``state`` donated): ``rows
        [R]`` int32 (-1 skipped), ``token_ids [R, W]`` int32 (``W <= T``), ``num_tokens [R]``."""
        _check_state(state)
        for name, value in (("rows", rows), ("token_ids", token_ids), ("num_tokens", num_tokens)):
            _check_int_dtype(name, value)
        if rows.ndim != 1 or token_ids.ndim != 2 or token_ids.shape[0] != rows.shape[0] or num_tokens.shape != rows.shape:
            raise ValueError(
                f"rows [R], token_ids [R, W] and num_tokens [R] must agree; got {rows.shape}, "
                f"{token_ids.shape}, {num_tokens.shape}"
            )
        if token_ids.shape[1] > state.token_ids.shape[1]:
            raise ValueError(f"token_ids width {token_ids.shape[1]} exceeds the buffer width {state.token_ids.shape[1]}")
        return _add_requests(state, rows, token_ids, num_tokens)

    def remove_requests(self, state: NgramGPUState, rows: jax.Array) -> NgramGPUState:
        """Empty the given rows (``[R]`` int32, -1 skipped); ``state`` donated."""
        _check_state(state)
        _check_int_dtype("rows", rows)
        if rows.ndim != 1:
            raise ValueError(f"rows must be [R], got {rows.shape}")
        return _remove_requests(state, rows)

    def move_requests(self, state: NgramGPUState, src: jax.Array, dst: jax.Array) -> NgramGPUState:
        """Copy rows ``src[i]`` to ``dst[i]`` all at once (every source read first, so
        swaps work; pairs with -1 skipped; sources kept); ``state`` donated."""
        _check_state(state)
        _check_int_dtype("src", src)
        _check_int_dtype("dst", dst)
        if src.ndim != 1 or src.shape != dst.shape:
            raise ValueError(f"src and dst must both be [M]; got {src.shape} and {dst.shape}")
        return _move_requests(state, src, dst)

    def grow_state(self, state: NgramGPUState, max_num_seqs: int) -> NgramGPUState:
        """``state`` grown to ``max_num_seqs`` (>= current) rows, the new ones empty."""
        _check_state(state)
        old = state.num_tokens.shape[0]
        rows = check_int("max_num_seqs", max_num_seqs, old)
        if rows == old:
            return state
        if rows * state.token_ids.shape[1] >= INT32_LIMIT:
            raise ValueError(f"max_num_seqs * width = {rows * state.token_ids.shape[1]} must be < 2**31")
        return _grow_jit(state, rows)

    def warmup(self, buckets: Sequence[Any], state: NgramGPUState, *,
               max_sampled: int | None = None) -> NgramGPUState:
        """Compile ``propose`` for each bucket (batch sizes or ``(B, ...)`` tuples) with
        ``num_sampled = 0``, leaving the buffer unchanged; ``max_sampled`` is ``S``
        (default ``k + 1``). Returns the state."""
        width = self.k + 1 if max_sampled is None else check_int("max_sampled", max_sampled, 1)
        batch_sizes = [b[0] if isinstance(b, (tuple, list)) else b for b in buckets]
        for size in batch_sizes:
            size = check_int("batch size", size, 1, state.num_tokens.shape[0])
            sampled = jnp.full((size, width), DRAFT_PADDING_ID, dtype=jnp.int32)
            out, state = self.propose(state, sampled, jnp.zeros((size,), dtype=jnp.int32))
            jax.block_until_ready(out)
        return state


# ---------------------------------------------------------------------- jitted bodies


def _search(cfg: NgramGPUProposer, token_ids, num_tokens, valid) -> DraftOutput:
    return ngram_search(
        token_ids,
        num_tokens,
        valid,
        k=cfg.num_speculative_tokens,
        min_n=cfg.prompt_lookup_min,
        max_n=cfg.prompt_lookup_max,
        max_model_len=cfg.max_model_len,
    )


@partial(jax.jit, static_argnums=0)
def _propose_arrays(cfg: NgramGPUProposer, token_ids, num_tokens, valid) -> DraftOutput:
    return _search(cfg, token_ids, num_tokens, valid)


@partial(jax.jit, static_argnums=0, donate_argnums=1)
def _propose_step(cfg: NgramGPUProposer, state: NgramGPUState, sampled, num_sampled):
    rows, width = state.token_ids.shape
    batch, max_new = sampled.shape
    sampled = sampled.astype(jnp.int32)
    num_sampled = num_sampled.astype(jnp.int32)
    old_len = state.num_tokens[:batch]

    column = jnp.arange(max_new, dtype=jnp.int32)[None, :]
    write_pos = old_len[:, None] + column
    write = (column < num_sampled[:, None]) & (sampled != DRAFT_PADDING_ID) & (write_pos < width)
    # Masked writes go out of bounds and are dropped.
    write_pos = jnp.where(write, write_pos, width)
    row_index = jnp.broadcast_to(jnp.arange(batch, dtype=jnp.int32)[:, None], write_pos.shape)
    token_ids = state.token_ids.at[row_index, write_pos].set(sampled, mode="drop")

    new_len = jnp.minimum(old_len + num_sampled, width)
    num_tokens = state.num_tokens.at[:batch].set(new_len)
    valid = (num_sampled > 0) & (new_len >= cfg.prompt_lookup_min) & (new_len < cfg.max_model_len)
    drafts = _search(cfg, token_ids[:batch], new_len, valid)
    return drafts, NgramGPUState(token_ids, num_tokens)


def _propose_rows(cfg: NgramGPUProposer, state: NgramGPUState, rows, sampled, num_sampled):
    limit, width = state.token_ids.shape
    max_new = sampled.shape[1]
    rows = rows.astype(jnp.int32)
    sampled = sampled.astype(jnp.int32)
    real = (rows >= 0) & (rows < limit)
    read_row = jnp.where(real, rows, 0)
    write_row = jnp.where(real, rows, limit)            # padding rows: writes dropped
    num_sampled = jnp.where(real, num_sampled.astype(jnp.int32), 0)
    old_len = state.num_tokens[read_row]

    column = jnp.arange(max_new, dtype=jnp.int32)[None, :]
    write_pos = old_len[:, None] + column
    write = (column < num_sampled[:, None]) & (sampled != DRAFT_PADDING_ID) & (write_pos < width)
    write_pos = jnp.where(write, write_pos, width)      # masked writes go out of bounds
    row_index = jnp.broadcast_to(write_row[:, None], write_pos.shape)
    token_ids = state.token_ids.at[row_index, write_pos].set(sampled, mode="drop")

    new_len = jnp.minimum(old_len + num_sampled, width)
    num_tokens = state.num_tokens.at[write_row].set(new_len, mode="drop")
    valid = real & (num_sampled > 0) & (new_len >= cfg.prompt_lookup_min) & (new_len < cfg.max_model_len)
    drafts = _search(cfg, token_ids[read_row], new_len, valid)
    return drafts, NgramGPUState(token_ids, num_tokens)


_propose_rows_jit = jax.jit(_propose_rows, static_argnums=0, donate_argnums=1)


@partial(jax.jit, static_argnums=0, donate_argnums=1)
def _propose_packed_jit(cfg: NgramGPUProposer, state: NgramGPUState, packed):
    packed = packed.astype(jnp.int32)
    drafts, state = _propose_rows(cfg, state, packed[:, 0], packed[:, 2:], packed[:, 1])
    out = jnp.concatenate([drafts.token_ids, drafts.num_drafts[:, None]], axis=1)
    return out, state


@partial(jax.jit, static_argnums=1)   # no donation: the shapes differ
def _grow_jit(state: NgramGPUState, rows: int) -> NgramGPUState:
    old, width = state.token_ids.shape
    token_ids = jnp.zeros((rows, width), jnp.int32).at[:old].set(state.token_ids)
    num_tokens = jnp.zeros((rows,), jnp.int32).at[:old].set(state.num_tokens)
    return NgramGPUState(token_ids, num_tokens)


def _drop_padding(rows, limit):
    rows = rows.astype(jnp.int32)
    return jnp.where((rows >= 0) & (rows < limit), rows, limit)


@partial(jax.jit, donate_argnums=0)
def _add_requests(state: NgramGPUState, rows, token_ids, num_tokens) -> NgramGPUState:
    limit = state.num_tokens.shape[0]
    rows = _drop_padding(rows, limit)
    width = token_ids.shape[1]
    buffer = state.token_ids.at[rows, :width].set(token_ids.astype(jnp.int32), mode="drop")
    lengths = state.num_tokens.at[rows].set(num_tokens.astype(jnp.int32), mode="drop")
    return NgramGPUState(buffer, lengths)


@partial(jax.jit, donate_argnums=0)
def _remove_requests(state: NgramGPUState, rows) -> NgramGPUState:
    rows = _drop_padding(rows, state.num_tokens.shape[0])
    return NgramGPUState(state.token_ids, state.num_tokens.at[rows].set(0, mode="drop"))


@partial(jax.jit, donate_argnums=0)
def _move_requests(state: NgramGPUState, src, dst) -> NgramGPUState:
    limit = state.num_tokens.shape[0]
    skip = (src < 0) | (src >= limit) | (dst < 0) | (dst >= limit)
    src = jnp.where(skip, 0, src.astype(jnp.int32))
    dst = jnp.where(skip, limit, dst.astype(jnp.int32))
    moved_tokens = state.token_ids[src]  # gathered before any write
    moved_lengths = state.num_tokens[src]
    buffer = state.token_ids.at[dst].set(moved_tokens, mode="drop")
    lengths = state.num_tokens.at[dst].set(moved_lengths, mode="drop")
    return NgramGPUState(buffer, lengths)


def _check_int_dtype(name: str, value) -> None:
    dtype = getattr(value, "dtype", None)
    # dtype.kind is a cheap test (jnp.issubdtype costs microseconds per call).
    if dtype is None or getattr(dtype, "kind", None) not in ("i", "u"):
        raise TypeError(f"{name} must be an integer array, got {dtype if dtype is not None else type(value).__name__}")


def _check_state(state) -> None:
    if not isinstance(state, NgramGPUState):
        raise TypeError(f"state must be an NgramGPUState (from init_state), got {type(state).__name__}")


def _check_batch(state: NgramGPUState, sampled, num_sampled) -> None:
    _check_state(state)
    _check_int_dtype("sampled_token_ids", sampled)
    _check_int_dtype("num_sampled", num_sampled)
    if sampled.ndim != 2 or num_sampled.shape != (sampled.shape[0],):
        raise ValueError(
            f"sampled_token_ids must be [B, S] and num_sampled [B]; got {sampled.shape} and {num_sampled.shape}"
        )
    if sampled.shape[0] > state.num_tokens.shape[0]:
        raise ValueError(f"batch size {sampled.shape[0]} exceeds the buffer's {state.num_tokens.shape[0]} rows")


# ---------------------------------------------------------------------------------------
# the adapter a decoding loop drives (``make_proposer``)


class DeviceRowsAdapter(HistoryProposer):
    """A history proposer over per-request rows of a device token buffer (``self.buffer``,
    an :class:`NgramGPUState` grown by powers of two; ``self._rows`` its
    :class:`NgramGPUProposer`): each request owns a row for its life, per call only its new
    tokens go up, and a new or out-of-sync request has its whole context uploaded first.
    Requests absent from a call have left; their rows are reused."""

    def _init_rows(self, rows: NgramGPUProposer) -> None:
        self._rows = rows
        self.buffer = None                # NgramGPUState, [capacity, max_model_len]
        self._slots: dict = {}            # req_id -> [row, length held on the device]
        self._free_rows: list[int] = []
        self.num_context_uploads = 0      # contexts uploaded whole (joins and re-syncs)

    def _ensure_rows(self, needed: int) -> None:
        cap = 0 if self.buffer is None else int(self.buffer.num_tokens.shape[0])
        if needed <= cap:
            return
        new_cap = next_power_of_2(needed)
        self.buffer = (self._rows.init_state(new_cap) if self.buffer is None
                       else self._rows.grow_state(self.buffer, new_cap))
        self._free_rows.extend(range(new_cap - 1, cap - 1, -1))   # pop() -> lowest first

    def _release(self, req_id) -> None:
        slot = self._slots.pop(req_id, None)
        if slot is not None:
            self._free_rows.append(slot[0])

    def _pack(self, history: TokenHistory, k: int, seen: Callable | None = None
              ) -> tuple[list, np.ndarray]:
        """Rows for ``history``'s requests (contexts uploaded where needed) and the call's
        ``packed [B_pad, 2 + S]`` int32 (buffer row or -1, ``num_sampled``, the new tokens;
        ``S >= k + 1``); ``seen(j, req_id, n, c)`` is told each request's length and new
        tokens first. ValueError on disagreeing lengths or repeated ids."""
        ids = list(history.req_ids)
        b = len(ids)
        sampled = history.sampled_token_ids
        if len(sampled) != b or len(history.num_tokens) != b:
            raise ValueError(f"history has {b} req_ids, {len(sampled)} sampled lists and "
                             f"{len(history.num_tokens)} lengths; they must agree")
        if len(set(ids)) != b:
            raise ValueError("req_ids must be distinct")
        width = self.max_model_len
        present = set(ids)
        for rid in [r for r in self._slots if r not in present]:
            self._release(rid)
        pad = history.rows_pad if (history.rows_pad or 0) >= b else next_power_of_2(max(b, 1))
        self._ensure_rows(pad)
        counts = np.fromiter((len(s) for s in sampled), np.int64, count=b)
        lengths = np.asarray(history.num_tokens, np.int64)
        if b and ((counts > lengths).any() or (lengths > history.token_ids.shape[1]).any()):
            raise ValueError("need len(sampled_token_ids[b]) <= num_tokens[b] <= token_ids.shape[1]")
        rows = np.empty(b, np.int64)
        uploads = []
        for j, rid in enumerate(ids):
            n, c = int(lengths[j]), int(counts[j])
            if seen is not None:
                seen(j, rid, n, c)
            slot = self._slots.get(rid)
            if slot is None:
                slot = self._slots[rid] = [self._free_rows.pop(), -1]
            rows[j] = slot[0]
            if n > width:              # past max_model_len: no draft; forget the row
                slot[1] = -1
                counts[j] = 0
                continue
            if slot[1] != n - c:
                uploads.append(j)
            slot[1] = n
        if uploads:
            self._upload(history, uploads, rows, lengths - counts)
        s = max(k + 1, int(counts.max(initial=1)))
        s = s if s == k + 1 else next_power_of_2(s)
        packed = np.full((pad, 2 + s), -1, np.int32)
        packed[:b, 0] = rows
        packed[:, 1] = 0
        packed[:b, 1] = counts
        for j in range(b):
            if counts[j]:
                packed[j, 2 : 2 + counts[j]] = sampled[j]
        return ids, packed

    def _upload(self, history: TokenHistory, which: list[int], rows: np.ndarray,
                base: np.ndarray) -> None:
        """Write whole contexts (minus this step's new tokens) into their rows."""
        import jax.numpy as jnp

        r = next_power_of_2(len(which))
        w = min(next_power_of_2(max(int(base[which].max(initial=1)), 1)), self.max_model_len)
        tok = np.zeros((r, w), np.int32)
        row_ids = np.full(r, -1, np.int32)
        num = np.zeros(r, np.int32)
        for i, j in enumerate(which):
            n = int(base[j])
            tok[i, :n] = history.token_ids[j, :n]
            row_ids[i], num[i] = rows[j], n
        self.buffer = self._rows.add_requests(self.buffer, jnp.asarray(row_ids), jnp.asarray(tok),
                                              jnp.asarray(num))
        self.num_context_uploads += len(which)

    def finish_requests(self, req_ids: Sequence[Hashable], documents=None) -> None:
        for rid in req_ids:
            self._release(rid)


class NgramGPUProposerAdapter(DeviceRowsAdapter):
    """``method="ngram_gpu"``: the device n-gram search (:meth:`NgramGPUProposer.
    propose_packed`) over the rows of a device token buffer."""

    def __init__(self, config: SpeculativeConfig, *, max_model_len: int) -> None:
        self.config = config
        self._feed = history_feed(config, max_model_len)
        self.impl = NgramGPUProposer(num_speculative_tokens=config.num_speculative_tokens,
                                     max_model_len=max_model_len,
                                     prompt_lookup_min=config.prompt_lookup_min,
                                     prompt_lookup_max=config.prompt_lookup_max)
        self._init_rows(self.impl)

    @property
    def device_drafter(self) -> NgramGPUProposer:
        """Hashable drafter with a traceable ``search(token_ids, num_tokens, valid)``, for
        the device decode loop."""
        return self.impl

    def propose_from_history(self, history: TokenHistory) -> DraftOutput:
        import jax.numpy as jnp

        k = self.impl.k
        ids, packed = self._pack(history, k)
        out, self.buffer = self.impl.propose_packed(self.buffer, jnp.asarray(packed))
        out = np.asarray(out)
        return DraftOutput(out[: len(ids), :k], out[: len(ids), k])

"""N-gram (prompt lookup) proposer on the host CPU, compiled with numba.

vLLM's ``NgramProposer`` rule: the longest n-gram (``prompt_lookup_min <= n <=
prompt_lookup_max``) that ends the context and occurs earlier in it wins, then its earliest
occurrence; the draft is the up to ``min(k, max_model_len - num_tokens)`` tokens after it.
A context shorter than ``prompt_lookup_min`` or at ``max_model_len`` gets no draft. One
thread below ``multithread_min_tokens`` context tokens, else ``prange`` over requests.
"""

from __future__ import annotations

import os
from typing import Sequence

import numba
import numpy as np
from numba import njit, prange

from specjax.checks import check_int
from specjax.config import SpeculativeConfig
from specjax.proposers.types import (
    DRAFT_PADDING_ID,
    DraftOutput,
    resolve_prompt_lookup,
)
from specjax.proposers.interface import (
    HistoryProposer,
    TokenHistory,
    history_feed,
    valid_mask,
)

#: vLLM's threshold: below this many context tokens in a batch, one thread is used.
NUM_TOKENS_THRESHOLD: int = 8192

#: Candidate ends screened per SIMD block (64 int32 compares vectorise on AVX2 / AVX-512).
_BLOCK: int = 64


# The screens take a window slice and int32 scalars: an int64 scalar (or indexing ``row``
# with two offsets) makes LLVM give up on vectorising the compare loop.
@njit(nogil=True, cache=True, boundscheck=False)
def _next_block_1(row, e, end, t0):
    while e + _BLOCK <= end:
        window = row[e : e + _BLOCK]
        acc = 0
        for j in range(_BLOCK):
            acc |= np.int32(window[j] == t0)
        if acc:
            return e
        e += _BLOCK
    return e


@njit(nogil=True, cache=True, boundscheck=False)
def _next_block_2(row, e, end, t0, t1):
    while e + _BLOCK <= end:
        window = row[e - 1 : e + _BLOCK]
        acc = 0
        for j in range(_BLOCK):
            acc |= np.int32(window[j + 1] == t0) & np.int32(window[j] == t1)
        if acc:
            return e
        e += _BLOCK
    return e


@njit(nogil=True, cache=True, boundscheck=False)
def _next_block_3(row, e, end, t0, t1, t2):
    while e + _BLOCK <= end:
        window = row[e - 2 : e + _BLOCK]
        acc = 0
        for j in range(_BLOCK):
            acc |= (
                np.int32(window[j + 2] == t0)
                & np.int32(window[j + 1] == t1)
                & np.int32(window[j] == t2)
            )
        if acc:
            return e
        e += _BLOCK
    return e


@njit(nogil=True, cache=True, boundscheck=False)
def _longest_earliest_match(row, num_tokens, min_n, max_n):
    """Longest suffix n-gram (``min_n <= n <= max_n``) of ``row[:num_tokens]`` (int32) with
    an earlier occurrence: ``(n, e)``, ``e <= L - 2`` the end of its earliest occurrence,
    or ``(0, -1)``."""
    # Ends are scanned left to right, each compared backwards against the context's tail,
    # stopping at the first full max_n match; candidate ends are screened 64 at a time with a
    # branch-free compare of the last few tokens (SIMD). O(L) with early exit, O(L * max_n)
    # worst case.
    last = num_tokens - 1
    end = last  # occurrence ends e range over [min_n - 1, L - 2]
    e = min_n - 1
    # Only a longer match than the best so far can change the answer, so the screen checks
    # min(max(min_n, best_n + 1), 3) tail tokens. It never reads before row[0]: every end
    # still to be visited is >= min_n - 1 and > the end of the best match (>= best_n - 1).
    n_screen = min(min_n, 3)
    t0 = row[last]
    # Same dtype as the row (see the note on the screens); clamped reads are never used
    # when the context is too short for them.
    t1 = row[max(last - 1, 0)]
    t2 = row[max(last - 2, 0)]
    best_n = 0
    best_e = -1
    while e < end:
        if n_screen == 1:
            e = _next_block_1(row, e, end, t0)
        elif n_screen == 2:
            e = _next_block_2(row, e, end, t0, t1)
        else:
            e = _next_block_3(row, e, end, t0, t1, t2)
        stop = min(e + _BLOCK, end)
        while e < stop:
            if row[e] == t0:
                limit = min(max_n, e + 1)
                n = 1
                while n < limit and row[e - n] == row[last - n]:
                    n += 1
                if n > best_n and n >= min_n:
                    best_n = n
                    best_e = e
                    if n == max_n:
                        return best_n, best_e
                    n_screen = min(best_n + 1, 3)
            e += 1
    return best_n, best_e


@njit(nogil=True, cache=True, boundscheck=False)
def _propose_row(idx, num_tokens, token_ids, valid, min_n, max_n, max_model_len, k, out_tokens, out_counts):
    num = num_tokens[idx]
    # vLLM's filtering (no sampled tokens, or at max_model_len) and the short-context rule.
    if not valid[idx] or num < min_n or num >= max_model_len:
        return
    budget = min(k, max_model_len - num)
    row = token_ids[idx]
    n, e = _longest_earliest_match(row, num, min_n, max_n)
    if n < min_n:
        return
    start = e + 1
    count = min(budget, num - start)
    for j in range(count):
        out_tokens[idx, j] = row[start + j]
    out_counts[idx] = count


@njit(nogil=True, cache=True, boundscheck=False)
def _propose_serial(num_tokens, token_ids, valid, min_n, max_n, max_model_len, k):
    batch = num_tokens.shape[0]
    out_tokens = np.full((batch, k), DRAFT_PADDING_ID, dtype=np.int32)
    out_counts = np.zeros((batch,), dtype=np.int32)
    for i in range(batch):
        _propose_row(i, num_tokens, token_ids, valid, min_n, max_n, max_model_len, k, out_tokens, out_counts)
    return out_tokens, out_counts


@njit(nogil=True, cache=True, boundscheck=False, parallel=True)
def _propose_parallel(num_tokens, token_ids, valid, min_n, max_n, max_model_len, k):
    batch = num_tokens.shape[0]
    out_tokens = np.full((batch, k), DRAFT_PADDING_ID, dtype=np.int32)
    out_counts = np.zeros((batch,), dtype=np.int32)
    for i in prange(batch):
        _propose_row(i, num_tokens, token_ids, valid, min_n, max_n, max_model_len, k, out_tokens, out_counts)
    return out_tokens, out_counts


@njit(nogil=True, cache=True)
def _scan_lengths(num_tokens, valid, width, max_model_len):
    """(first index with a length outside [0, width] or -1, rows to propose for, their tokens)."""
    total = 0
    count = 0
    for i in range(num_tokens.shape[0]):
        num = num_tokens[i]
        if num < 0 or num > width:
            return i, count, total
        if valid[i] and num < max_model_len:
            total += num
            count += 1
    return -1, count, total


def _default_num_threads() -> int:
    # vLLM caps at 1 with a TODO to raise the cap to 8; half the cores leaves room for the
    # engine's own threads.
    return max(1, min(8, (os.cpu_count() or 1) // 2, numba.config.NUMBA_NUM_THREADS))


class NgramProposer:
    """vLLM's CPU n-gram proposer (``method="ngram"``).

    ``num_speculative_tokens`` (k >= 1), ``prompt_lookup_min`` / ``_max``,
    ``max_model_len`` as vLLM's; ``max_num_threads``: numba threads for batches of at least
    ``multithread_min_tokens`` context tokens (default: half the cores, at most 8);
    ``warmup``: compile the numba kernels now.
    """

    def __init__(
        self,
        *,
        num_speculative_tokens: int,
        max_model_len: int,
        prompt_lookup_min: int | None = None,
        prompt_lookup_max: int | None = None,
        max_num_threads: int | None = None,
        multithread_min_tokens: int = NUM_TOKENS_THRESHOLD,
        warmup: bool = True,
    ) -> None:
        self.k = check_int("num_speculative_tokens", num_speculative_tokens, 1)
        self.min_n, self.max_n = resolve_prompt_lookup(prompt_lookup_min, prompt_lookup_max)
        self.max_model_len = check_int("max_model_len", max_model_len, 1)
        limit = numba.config.NUMBA_NUM_THREADS
        if max_num_threads is None:
            max_num_threads = _default_num_threads()
        self.max_num_threads = check_int("max_num_threads", max_num_threads, 1, limit)
        self.multithread_min_tokens = check_int("multithread_min_tokens", multithread_min_tokens, 0)
        if warmup:
            self._warmup()

    @property
    def num_speculative_tokens(self) -> int:
        return self.k

    def _warmup(self) -> None:
        # Compile (or load from numba's cache) the kernels for the C-contiguous int32 layout
        # every call is normalised to.
        token_ids = np.zeros((2, 8), dtype=np.int32)
        num_tokens = np.array([8, 8], dtype=np.int32)
        valid = np.ones((2,), dtype=np.bool_)
        _scan_lengths(num_tokens, valid, 8, self.max_model_len)
        args = (num_tokens, token_ids, valid, self.min_n, self.max_n, self.max_model_len, self.k)
        _propose_serial(*args)
        if self.max_num_threads > 1:
            self._run_parallel(args, 2)

    # ------------------------------------------------------------------ public API

    def propose(
        self,
        sampled_token_ids: Sequence[Sequence[int]],
        num_tokens_no_spec: np.ndarray,
        token_ids_cpu: np.ndarray,
        slot_mappings: object = None,
    ) -> list[list[int]]:
        """Draft tokens for each request (vLLM's signature): ``B`` lists, each at most ``k``.

        ``sampled_token_ids``: ``B`` lists (none: no draft); ``num_tokens_no_spec [B]``:
        context lengths ``L`` (at or past ``max_model_len``: no draft); ``token_ids_cpu
        [B', T]`` integers, row ``b``'s context in its first ``L`` columns (int32
        C-contiguous avoids a copy); ``slot_mappings`` is ignored.
        """
        del slot_mappings
        if isinstance(sampled_token_ids, (str, bytes)) or not hasattr(sampled_token_ids, "__len__"):
            raise TypeError("sampled_token_ids must be a sequence of per-request token sequences")
        batch = len(sampled_token_ids)
        try:
            has_sampled = np.fromiter(map(len, sampled_token_ids), dtype=np.int64, count=batch) > 0
        except TypeError as err:
            raise TypeError(
                "sampled_token_ids must be a sequence of per-request token sequences "
                f"(each with a length): {err}"
            ) from None
        num_tokens = _as_int_array("num_tokens_no_spec", num_tokens_no_spec, ndim=1)
        if num_tokens.shape[0] != batch:
            raise ValueError(
                f"num_tokens_no_spec has {num_tokens.shape[0]} entries but sampled_token_ids has "
                f"{batch} requests; they must agree"
            )
        out = self.propose_arrays(num_tokens, token_ids_cpu, has_sampled)
        # Two bulk tolist() calls and list slicing: much cheaper than per-row numpy slicing.
        return [row[:n] for row, n in zip(out.token_ids.tolist(), out.num_drafts.tolist())]

    def propose_arrays(
        self,
        num_tokens_no_spec: np.ndarray,
        token_ids_cpu: np.ndarray,
        valid_mask: np.ndarray | None = None,
    ) -> DraftOutput:
        """The array form of ``propose``: ``num_tokens_no_spec [B]``, ``token_ids_cpu [B', T]``,
        ``valid_mask [B]`` bool (None: all) -> ``DraftOutput`` of numpy arrays."""
        num_tokens, token_ids = self._check_inputs(num_tokens_no_spec, token_ids_cpu)
        batch = num_tokens.shape[0]
        if valid_mask is None:
            valid_mask = np.ones((batch,), dtype=np.bool_)
        else:
            valid_mask = np.asarray(valid_mask)
            if valid_mask.shape != (batch,) or valid_mask.dtype != np.bool_:
                raise ValueError(
                    f"valid_mask must be a [{batch}] bool array, got shape {valid_mask.shape} "
                    f"dtype {valid_mask.dtype}"
                )
        bad, count, total = _scan_lengths(num_tokens, valid_mask, token_ids.shape[1], self.max_model_len)
        if bad >= 0:
            raise ValueError(
                f"num_tokens_no_spec must lie in [0, {token_ids.shape[1]}] (token_ids_cpu's width); "
                f"entry {bad} is {num_tokens[bad]}"
            )
        args = (num_tokens, token_ids, valid_mask, self.min_n, self.max_n, self.max_model_len, self.k)
        if count == 0:
            return DraftOutput(np.full((batch, self.k), DRAFT_PADDING_ID, dtype=np.int32), np.zeros((batch,), np.int32))
        threads = self.num_threads_for(total, count) if self.max_num_threads > 1 else 1
        if threads > 1:
            out_tokens, out_counts = self._run_parallel(args, threads)
        else:
            out_tokens, out_counts = _propose_serial(*args)
        return DraftOutput(out_tokens, out_counts)

    def num_threads_for(self, total_tokens: int, num_requests: int) -> int:
        """1 below ``multithread_min_tokens``, else ``min(max_num_threads, num_requests)``."""
        if total_tokens < self.multithread_min_tokens:
            return 1
        return max(1, min(self.max_num_threads, num_requests))

    # ------------------------------------------------------------------ helpers

    @staticmethod
    def _run_parallel(args: tuple, threads: int):
        previous = numba.get_num_threads()
        numba.set_num_threads(threads)
        try:
            return _propose_parallel(*args)
        finally:
            numba.set_num_threads(previous)

    def _check_inputs(self, num_tokens_no_spec, token_ids_cpu) -> tuple[np.ndarray, np.ndarray]:
        num_tokens = _as_int_array("num_tokens_no_spec", num_tokens_no_spec, ndim=1)
        token_ids = _as_int_array("token_ids_cpu", token_ids_cpu, ndim=2)
        batch = num_tokens.shape[0]
        if token_ids.shape[0] < batch:
            raise ValueError(
                f"token_ids_cpu has {token_ids.shape[0]} rows but num_tokens_no_spec has {batch} "
                "requests; it needs at least one row per request"
            )
        return num_tokens, token_ids


def _as_int_array(name: str, value, *, ndim: int) -> np.ndarray:
    """``value`` as a C-contiguous int32 array of rank ``ndim`` (copies only when needed)."""
    try:
        array = np.asarray(value)
    except ValueError as err:  # ragged nested sequences
        raise ValueError(f"{name} must be a rectangular integer array: {err}") from None
    if array.dtype == object:
        raise ValueError(f"{name} must be a rectangular integer array (got ragged or object data)")
    if array.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimension(s), got shape {array.shape}")
    if array.dtype != np.int32:
        if not np.issubdtype(array.dtype, np.integer):
            raise TypeError(f"{name} must hold integer token ids / counts, got dtype {array.dtype}")
        if array.size and (array.min() < np.iinfo(np.int32).min or array.max() > np.iinfo(np.int32).max):
            raise ValueError(f"{name} has values outside the int32 range")
        array = array.astype(np.int32)
    return np.ascontiguousarray(array)


# ---------------------------------------------------------------------------------------
# the adapter a decoding loop drives (``make_proposer``)


class NgramProposerAdapter(HistoryProposer):
    """``method="ngram"``: vLLM's CPU n-gram proposer (numba) on the token history."""

    def __init__(self, config: SpeculativeConfig, *, max_model_len: int) -> None:
        self.config = config
        self._feed = history_feed(config, max_model_len)
        self.impl = NgramProposer(num_speculative_tokens=config.num_speculative_tokens,
                                  max_model_len=max_model_len,
                                  prompt_lookup_min=config.prompt_lookup_min,
                                  prompt_lookup_max=config.prompt_lookup_max)

    def propose_from_history(self, history: TokenHistory) -> DraftOutput:
        return self.impl.propose_arrays(history.num_tokens, history.token_ids, valid_mask(history))

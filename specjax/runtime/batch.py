"""Host-side (NumPy) construction of a step's padded inputs: ``build_batch -> StepBatch``.

The scheduler decides per request which tokens go into the step (its uncomputed tokens,
then its drafts) and which KV blocks it owns; ``build_batch`` makes the padded, bucketed
arrays ``specjax.runtime.step.Step`` takes (all NumPy: one upload). Padding rows have no
tokens and null-block (0) table rows; padding token slots hold token 0 at position 0 with
KV slot -1 (nothing written); padding draft slots hold -1."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from specjax.attention_metadata import CommonAttentionMetadata
from specjax.checks import ArgumentError, check_int, check_opt_int
from specjax.metadata import SpecDecodeMetadata
from specjax.runtime.checks import check_table, check_token_ids, row_seeds
from specjax.runtime.step import StepBatch
from specjax.token_tree import TokenTree

__all__ = ["build_batch", "trim_drafts", "attn_metadata_np", "spec_metadata_np", "NULL_BLOCK"]

#: The never-allocated KV block that padding entries of the block table point at.
NULL_BLOCK = 0
_I32 = np.int32


def _ragged_arange(lens: np.ndarray) -> np.ndarray:
    """``concat(arange(l) for l in lens)``."""
    lens = np.asarray(lens, np.int64)
    total = int(lens.sum())
    return np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(lens) - lens, lens)


def _ints(name: str, values, n: int, *, lo: int | None = None) -> np.ndarray:
    a = np.asarray(values)
    if a.shape != (n,) or (n and not np.issubdtype(a.dtype, np.integer)):
        raise ValueError(f"{name} must be {n} ints (one per request), got shape {a.shape} "
                         f"dtype {a.dtype}")
    a = a.astype(np.int64)
    if lo is not None and n and a.min() < lo:
        i = int(np.argmin(a))
        raise ValueError(f"{name}[{i}] = {int(a[i])}; must be >= {lo}")
    return a


def _padded(name: str, values, n: int, b: int, dtype, fill) -> np.ndarray:
    out = np.full(b, fill, dtype)
    if values is not None:
        a = np.asarray(values)
        if a.shape != (n,):
            raise ValueError(f"{name} must have one entry per request ({n}), got shape {a.shape}")
        out[:n] = a
    return out


def build_batch(token_ids: Sequence[Sequence[int]], *, num_computed: Sequence[int],
                num_drafts: Sequence[int], block_ids, block_size: int, num_reqs_pad: int,
                query_len_pad: int, blocks_per_req_pad: int, max_spec_len: int,
                temperature=None, top_k=None, top_p=None, seeds=None,
                num_output_tokens=None, discard=None, tree: TokenTree | None = None,
                procs=None, num_blocks: int | None = None,
                vocab_size: int | None = None, lookahead: int | None = None,
                max_model_len: int | None = None, num_tokens_pad: int | None = None) -> StepBatch:
    """The padded inputs of one step (NumPy leaves).

    Args:
      token_ids: per request (``n``), its uncomputed tokens then its ``num_drafts[i]`` drafts;
        a tree batch (``tree``: ``Step.tree``): the root then a breadth-first tree prefix.
      num_computed: tokens in each KV cache (``seq_len = num_computed + len(token_ids[i])``).
      block_ids: each request's KV blocks in order, covering ``seq_len`` (ids past
        ``blocks_per_req_pad`` dropped); ids >= 1 (0 is the null block), < ``num_blocks``.
      num_reqs_pad, query_len_pad, blocks_per_req_pad: the bucket (``query_len_pad``: the
        static bound of one request's tokens, ``attn.max_query_len``); max_spec_len: ``Step.k``.
      num_tokens_pad: ``T``, the token slots of the ``[T]`` arrays (``input_ids``,
        ``positions``, ``attn.slot_mapping``), at least the scheduled tokens; None:
        ``num_reqs_pad * query_len_pad``. Why: a long prefill chunk beside decoding rows
        needs ``T`` near their sum, not ``num_reqs_pad`` times the longest.
      temperature, top_k, top_p, num_output_tokens: per-request sampling (defaults: greedy,
        off, off, 0; key ``fold_in(key(seed), num_output_tokens)``).
      seeds: None or per request an int in ``[0, 2**32 - 1]`` or None. A request at
        ``temperature > 0`` without one draws a fresh random seed each call: not
        reproducible (vLLM's unseeded requests); greedy ones are unaffected.
      discard: sampled token ignored (a partial prefill). procs: a ``ProcessorState`` or None.
      num_blocks: the KV pool's size (``init_caches``), or None: block ids not bounded above.
      vocab_size: ``step.vocab_size``, or None: token ids only checked ``>= 0``.
      lookahead: ``step.feed.lookahead`` (0 without a proposer), or None: unchecked. Given,
        ValueError unless each ``block_ids[i]`` covers ``seq_len + lookahead`` positions
        (capped at ``max_model_len``, when given) and no block a request writes (from
        ``num_computed`` on) is listed by another request: the proposer writes its drafts'
        KV there (docs/integration.md, §3).

    Returns ``StepBatch``. Raises ValueError naming the argument: mismatched lengths, a
    request longer than the query bucket, more tokens than ``num_tokens_pad``, too many
    drafts, blocks or requests, block id 0, a negative one or one past ``num_blocks``, a
    token id outside the vocabulary, a seed outside uint32."""
    n = len(token_ids)
    b, q_pad, c = int(num_reqs_pad), int(query_len_pad), int(blocks_per_req_pad)
    for name, v in (("num_reqs_pad", b), ("query_len_pad", q_pad),
                    ("blocks_per_req_pad", c), ("block_size", block_size)):
        if v < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
    if n > b:
        raise ValueError(f"{n} requests do not fit num_reqs_pad={b}")
    num_blocks = check_opt_int("num_blocks", num_blocks, 2, why="block 0 is the null block")
    vocab_size = check_opt_int("vocab_size", vocab_size, 1)
    q = np.fromiter((len(t) for t in token_ids), np.int64, count=n)
    computed = _ints("num_computed", num_computed, n, lo=0)
    nd = _ints("num_drafts", num_drafts, n, lo=0)
    if n and (q < 1).any():
        raise ValueError(f"token_ids[{int(np.argmin(q))}] is empty: every request schedules "
                         "at least one token")
    if n and (q > q_pad).any():
        i = int(np.argmax(q))
        raise ValueError(f"token_ids[{i}] has {int(q[i])} tokens, more than "
                         f"query_len_pad={q_pad}")
    t = int(q.sum())
    t_pad = b * q_pad if num_tokens_pad is None else check_int("num_tokens_pad", num_tokens_pad, 1)
    if t > t_pad:
        raise ValueError(f"num_tokens_pad={t_pad} is below the {t} tokens scheduled over {n} "
                         "requests")
    limit = max_spec_len if tree is None else tree.num_nodes
    if n and ((nd > limit) | (nd > q - 1)).any():
        i = int(np.argmax((nd > limit) | (nd > q - 1)))
        raise ValueError(f"num_drafts[{i}] = {int(nd[i])}: at most "
                         f"{'max_spec_len' if tree is None else 'the tree'}'s {limit} and "
                         f"fewer than the {int(q[i])} scheduled tokens")
    if tree is not None and n and (q - nd != 1).any():
        i = int(np.argmax(q - nd != 1))
        raise ValueError(f"a tree batch schedules one uncomputed token (the root) per "
                         f"request; token_ids[{i}] has {int(q[i] - nd[i])}")
    seq = computed + q
    need = -(-seq // block_size)
    if n and (need > c).any():
        i = int(np.argmax(need > c))
        raise ValueError(f"request {i} reaches position {int(seq[i]) - 1}: it needs "
                         f"{int(need[i])} blocks, more than blocks_per_req_pad={c}")
    table = np.full((b, c), NULL_BLOCK, _I32)
    filled = np.zeros(n, np.int64)
    if len(block_ids) != n:
        raise ValueError(f"block_ids must have one list per request ({n}), got {len(block_ids)}")
    for i, (ids, w) in enumerate(zip(block_ids, need.tolist())):
        m = filled[i] = min(len(ids), c)
        if m < w:
            raise ValueError(f"block_ids[{i}] has {len(ids)} blocks; request {i} needs "
                             f"{w} for {int(seq[i])} positions")
        table[i, :m] = ids[:m]
    check_table(table, filled, num_blocks)
    if lookahead is not None:
        _check_writes(table, filled, computed, seq, check_int("lookahead", lookahead, 0),
                      check_opt_int("max_model_len", max_model_len, 1), block_size)
    attn = attn_metadata_np(q, seq, table, block_size=block_size, num_tokens_pad=t_pad,
                            max_query_len=q_pad)
    flat = np.array([x for toks in token_ids for x in toks], np.int64).reshape(t)
    check_token_ids(flat, q, vocab_size)
    ids = np.zeros(t_pad, _I32)
    ids[:t] = flat
    offs = _ragged_arange(q)
    if tree is not None:
        offs = np.array((0,) + tree.depths, np.int64)[offs]   # slot 0 the root, 1 + j node j
        attn = attn.replace(tree_mask=tree.ancestor_mask(with_root=True))
    pos = np.zeros(t_pad, _I32)
    pos[:t] = np.repeat(computed, q) + offs
    starts = np.cumsum(q) - q
    is_draft = _ragged_arange(q) >= np.repeat(q - nd, q)      # each request's last nd tokens
    sdm = _spec_metadata(flat[is_draft], nd, q, b, int(max_spec_len))
    backup = np.zeros(b, _I32)
    backup[:n] = flat[starts + q - nd - 1] if n else []
    if procs is not None and np.shape(procs.num_tokens) != (b,):
        raise ValueError(f"procs must have num_reqs_pad={b} rows, got {np.shape(procs.num_tokens)}")
    temp = _padded("temperature", temperature, n, b, np.float32, 0.0)
    if (temp < 0).any() or not np.isfinite(temp).all():
        raise ValueError("temperature must be finite and >= 0 (0 = greedy)")
    return StepBatch(
        input_ids=ids, positions=pos, attn=attn, sdm=sdm, temperature=temp,
        top_k=_padded("top_k", top_k, n, b, _I32, 0),
        top_p=_padded("top_p", top_p, n, b, np.float32, 1.0),
        seeds=row_seeds(seeds, temp, n, b),
        counters=_padded("num_output_tokens", num_output_tokens, n, b, _I32, 0),
        backup_next=backup, discard=_padded("discard", discard, n, b, np.bool_, False), procs=procs,
        all_greedy=bool((temp[:n] == 0).all()), block_size=int(block_size))


def _check_writes(table: np.ndarray, lens: np.ndarray, computed: np.ndarray, seq: np.ndarray,
                  lookahead: int, max_model_len: int | None, block_size: int) -> None:
    """ArgumentError unless each request ``i`` (``table [B, C]``, its first ``lens[i]``
    columns filled) lists blocks through position ``seq[i] + lookahead - 1`` (at most
    ``max_model_len - 1``) and no block it writes (columns from ``computed[i] //
    block_size`` through that position) is in another request's row. Why: a model proposer
    writes its drafts' KV ``lookahead`` positions past the scheduled tokens through the
    table; a missing block sends those writes to the null block or (past column ``C - 1``,
    clipped to it) over the request's own earlier positions, and another request's block
    over that request's drafter KV."""
    n, c = lens.shape[0], table.shape[1]
    if not n:
        return
    end = seq + lookahead
    if max_model_len is not None:
        end = np.maximum(np.minimum(end, max_model_len), seq)
    need = -(-end // block_size)
    if (need > lens).any():
        i = int(np.argmax(need > lens))
        raise ArgumentError(
            f"block_ids[{i}] gives {int(lens[i])} blocks (blocks_per_req_pad={c}) but request "
            f"{i} writes KV through position {int(end[i]) - 1} ({int(seq[i])} tokens, then the "
            f"proposer's lookahead={lookahead}): it needs {int(need[i])}; allocate blocks for "
            f"num_computed + len(token_ids[{i}]) + lookahead positions (capped at max_model_len)")
    col = np.arange(c)[None, :]
    cells = table[:n].astype(np.int64)
    listed = col < lens[:, None]
    written = listed & (col >= (computed // block_size)[:, None]) & (col < need[:, None])
    pairs = np.unique(cells[listed] * n + np.nonzero(listed)[0])    # (block, row) once each
    blocks, rows = np.unique(pairs // n, return_counts=True)
    bad = written & np.isin(cells, blocks[rows > 1])
    if bad.any():
        i, j = (int(v) for v in np.argwhere(bad)[0])
        v = int(cells[i, j])
        other = next(r for r in range(n) if r != i and (cells[r, : lens[r]] == v).any())
        lo, hi = max(j * block_size, int(computed[i])), min((j + 1) * block_size, int(end[i]))
        raise ArgumentError(
            f"block_ids[{i}][{j}] = {v} is also in block_ids[{other}], and request {i} writes it "
            f"(positions {lo}..{hi - 1}: its tokens or the proposer's lookahead={lookahead}): give "
            f"each request only blocks it owns, and share only full blocks of a computed prefix "
            f"(docs/integration.md, §3)")


def trim_drafts(drafts: Sequence[int], *, max_new_tokens: int, kv_room: int, k: int,
                vocab_size: int, tree: TokenTree | None = None,
                drafter_room: int | None = None) -> list[int]:
    """The drafts of a request worth verifying next step (the reference loop's rule).

    ``max_new_tokens``: tokens it may still emit (``min(max_model_len - num_tokens, max_tokens -
    num_output)``); ``kv_room``: ``max_model_len - num_tokens``. A chain keeps its first
    ``min(k, max_new_tokens - 1)`` drafts; a tree the breadth-first prefix of levels
    ``<= max_new_tokens - 1``, at most ``kv_room`` nodes. Cut before the first id outside
    ``[0, vocab_size)`` (a buggy proposer's). ``drafter_room`` (``drafter_max_model_len -
    num_tokens``, or None): below the draft depth, no drafts."""
    if drafter_room is not None and drafter_room < (k if tree is None else tree.depth):
        return []
    room = max_new_tokens - 1
    if tree is None:
        d = list(drafts[: max(0, min(room, k))])
    else:
        levels = min(max(room, 0), tree.depth)
        nodes = tree.cu_level_sizes[levels - 1] if levels else 0
        d = list(drafts[: max(0, min(nodes, kv_room))])
    for j, t in enumerate(d):
        if not 0 <= t < vocab_size:
            return d[:j]
    return d


def attn_metadata_np(query_lens, seq_lens, block_table, *, block_size: int, num_tokens_pad: int,
                     max_query_len: int) -> CommonAttentionMetadata:
    """``CommonAttentionMetadata.from_query_lens`` with NumPy leaves, vectorized: ``query_lens``,
    ``seq_lens`` ``[n]``, ``block_table`` ``[B_pad, C]`` (rows past n zeroed); padding slots -1."""
    q = np.asarray(query_lens, np.int64)
    s = np.asarray(seq_lens, np.int64)
    n = q.shape[0]
    table = np.array(block_table, _I32)
    b_pad = table.shape[0]
    table[n:] = NULL_BLOCK
    t = int(q.sum())
    qsl = np.full(b_pad + 1, t, _I32)
    qsl[0] = 0
    qsl[1 : n + 1] = np.cumsum(q)
    seq = np.zeros(b_pad, _I32)
    seq[:n] = s
    slots = np.full(num_tokens_pad, -1, _I32)
    if t:
        req = np.repeat(np.arange(n), q)
        pos = np.repeat(s - q, q) + _ragged_arange(q)
        slots[:t] = table[req, pos // block_size].astype(np.int64) * block_size + pos % block_size
    i32 = lambda v: np.asarray(v, _I32)  # noqa: E731
    return CommonAttentionMetadata(
        query_start_loc=qsl, seq_lens=seq, block_table=table, slot_mapping=slots, num_reqs=i32(n),
        num_actual_tokens=i32(t), max_seq_len=i32(int(s.max(initial=0))),
        max_query_len=int(max_query_len), causal=True)


def spec_metadata_np(drafts: Sequence[Sequence[int]], query_lens, *, num_reqs_pad: int,
                     max_spec_len: int) -> SpecDecodeMetadata:
    """``SpecDecodeMetadata.from_draft_lists(drafts, cumsum(query_lens), max_spec_len=K,
    num_reqs_pad=B, num_drafts_pad=B*K)`` with NumPy leaves, vectorized: each request's
    drafts are the last ``len(drafts)`` of its ``query_len`` scheduled tokens."""
    nd = np.array([len(d) for d in drafts], np.int64)
    flat = np.array([t for d in drafts for t in d], np.int64)
    return _spec_metadata(flat, nd, np.asarray(query_lens, np.int64), num_reqs_pad,
                          max_spec_len)


def _spec_metadata(flat: np.ndarray, nd: np.ndarray, query_lens: np.ndarray, num_reqs_pad: int,
                   max_spec_len: int) -> SpecDecodeMetadata:
    """:func:`spec_metadata_np` from the drafts concatenated (``flat``) and counted (``nd``)."""
    n, b, k = nd.shape[0], num_reqs_pad, max_spec_len
    cu_sched = np.cumsum(np.asarray(query_lens, np.int64))
    cu_draft = np.cumsum(nd)
    cu_sampled = np.cumsum(nd + 1)
    total, sampled = int(nd.sum()), int((nd + 1).sum())

    def pad(a, size, fill, repeat_last=False):
        out = np.full(size, fill, _I32)
        out[: len(a)] = a
        if repeat_last and len(a) and size > len(a):
            out[len(a):] = a[-1]
        return out

    target_idx = np.repeat(cu_sampled - nd - 1, nd) + _ragged_arange(nd)
    logits_idx = np.repeat(cu_sched - nd - 1, nd + 1) + _ragged_arange(nd + 1)
    if total > b * k or sampled > b * (k + 1):
        raise ValueError(f"{total} drafts over {n} requests do not fit num_reqs_pad={b} x "
                         f"max_spec_len={k}")
    return SpecDecodeMetadata(
        draft_token_ids=pad(flat, b * k, -1), num_draft_tokens=pad(nd, b, 0),
        cu_num_draft_tokens=pad(cu_draft, b, 0, True), cu_num_sampled_tokens=pad(cu_sampled, b, 0, True),
        target_logits_indices=pad(target_idx, b * k, 0), bonus_logits_indices=pad(cu_sampled - 1, b, 0),
        logits_indices=pad(logits_idx, b * (k + 1), 0), num_reqs=np.asarray(n, _I32),
        max_spec_len=int(k))

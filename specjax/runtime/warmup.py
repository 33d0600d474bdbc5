"""Compiling ahead of time: the shape buckets a loop runs (:class:`Bucket`: requests,
tokens, blocks, query_len) and the padding batches ``Step.warmup`` runs through the step,
one per bucket and variant, so that no real call compiles.

A bucket names the sizes a compiled step is specialised on: ``requests`` rows
(``num_reqs_pad``), a flat budget of ``tokens`` token slots (``T``, ``num_tokens_pad``),
``blocks`` block-table columns per row (``blocks_per_req_pad``) and ``query_len``, the
static bound of one request's tokens (``query_len_pad``; 0: ``tokens // requests``). The
padding batch of a bucket is ``build_batch``'s with no request (nothing written, nothing
emitted), built here without it so that ``step.py`` can call this module (``batch.py``
imports ``step.py``)."""

from __future__ import annotations

import itertools
from typing import Any, Iterable, NamedTuple, Sequence

import numpy as np

from specjax.attention_metadata import CommonAttentionMetadata
from specjax.checks import ArgumentError, ArgumentTypeError, check_bool, check_int, show
from specjax.metadata import SpecDecodeMetadata
from specjax.sampling.logits_processors import ProcessorLimits, make_processor_state
from specjax.sampling.logprobs import check_num_logprobs, logprobs_bucket

__all__ = ["Bucket", "as_bucket", "as_buckets", "padding_batches"]

_I32 = np.int32


class Bucket(NamedTuple):
    """One compiled shape: ``requests`` rows (``num_reqs_pad``), ``tokens`` token slots in
    all (the flat budget ``T``, ``num_tokens_pad``), ``blocks`` block-table columns per row
    (``blocks_per_req_pad``) and ``query_len``, the static bound of one request's tokens
    (``query_len_pad``). ``query_len`` 0 (the default, and :func:`as_bucket`'s form of a
    bucket with ``tokens == requests * query_len``): ``tokens // requests``, a uniform
    bucket; set, ``tokens`` need not be a multiple of ``requests`` (a ragged bucket: one
    long prefill chunk beside decoding rows in ``T`` slots, not ``requests * query_len``).
    ``Bucket.of(B, Q, C)`` from the per-row form."""

    requests: int
    tokens: int
    blocks: int
    query_len: int = 0

    @property
    def query_len_pad(self) -> int:
        """The static bound of one request's tokens (``query_len``, or ``tokens // requests``)."""
        return self.query_len or self.tokens // self.requests

    @property
    def is_ragged(self) -> bool:
        """Whether ``tokens`` differs from ``requests * query_len_pad``."""
        return self.tokens != self.requests * self.query_len_pad

    @classmethod
    def of(cls, num_reqs_pad: int, query_len_pad: int, blocks_per_req_pad: int) -> "Bucket":
        """The uniform bucket of ``build_batch``'s ``(num_reqs_pad, query_len_pad,
        blocks_per_req_pad)`` (``tokens = num_reqs_pad * query_len_pad``)."""
        return cls(int(num_reqs_pad), int(num_reqs_pad) * int(query_len_pad),
                   int(blocks_per_req_pad))


def as_bucket(value: Any, name: str = "bucket") -> Bucket:
    """``value`` (a ``Bucket``, a ``(requests, tokens, blocks)`` or a ``(requests, tokens,
    blocks, query_len)`` tuple) checked: ints >= 1 (``query_len`` >= 0, 0: ``tokens //
    requests``, then ``tokens`` a multiple of ``requests``), ``query_len <= tokens``.
    Returns a ``Bucket`` with ``query_len`` 0 when ``tokens == requests * query_len`` (one
    form per shape). Raises ValueError / TypeError naming ``name.field``."""
    if not isinstance(value, (tuple, list)) or len(value) not in (3, 4):
        raise ArgumentTypeError(f"{name} must be a Bucket(requests, tokens, blocks[, query_len]) "
                                f"or a 3- or 4-tuple, got {show(value)}")
    r, t, c = (check_int(f"{name}.{f}", v, 1) for f, v in zip(Bucket._fields, value[:3]))
    q = check_int(f"{name}.query_len", value[3], 0, why="0: tokens // requests") \
        if len(value) == 4 else 0
    if not q and t % r:
        raise ArgumentError(f"{name}.tokens={t} is not a multiple of requests={r}: give "
                            f"query_len (Bucket(requests, tokens, blocks, query_len), the bound "
                            f"of one request's tokens) for a ragged bucket, or use "
                            f"Bucket.of(num_reqs_pad, query_len_pad, blocks_per_req_pad)")
    if q > t:
        raise ArgumentError(f"{name}.query_len={q} is above tokens={t}: one request's tokens "
                            f"fit the batch's token slots")
    return Bucket(r, t, c, 0 if q * r == t else q)


def as_buckets(buckets: Iterable[Any], name: str = "buckets") -> tuple[Bucket, ...]:
    """:func:`as_bucket` of each of ``buckets`` (naming ``buckets[i].field``); at least one."""
    if isinstance(buckets, (str, bytes)) or not isinstance(buckets, Iterable) or (
            isinstance(buckets, Bucket)):
        raise ArgumentTypeError(f"{name} must be a list of Bucket(requests, tokens, blocks[, "
                                f"query_len]), got {show(buckets)}")
    out = tuple(as_bucket(b, f"{name}[{i}]") for i, b in enumerate(buckets))
    if not out:
        raise ArgumentError(f"{name} is empty: give at least one Bucket(requests, tokens, "
                            f"blocks[, query_len])")
    return out


def _flags(name: str, values: Sequence[Any]) -> tuple[bool, ...]:
    if isinstance(values, (bool, np.bool_)) or not isinstance(values, (list, tuple)) or not values:
        raise ArgumentTypeError(f"{name} must be a non-empty tuple of bools, got {show(values)}")
    return tuple(dict.fromkeys(check_bool(f"{name}[{i}]", v) for i, v in enumerate(values)))


def variants(name: str, values: Sequence[Any]) -> tuple:
    """``values`` as a non-empty tuple without repeats (TypeError naming ``name`` otherwise)."""
    if isinstance(values, (str, bytes)) or not isinstance(values, (list, tuple)) or not values:
        raise ArgumentTypeError(f"{name} must be a non-empty tuple, got {show(values)}")
    return tuple(dict.fromkeys(values))


def logprobs_variants(values: Sequence[int | None]) -> tuple[int | None, ...]:
    """The top-n buckets (``logprobs_bucket``) of each request ``logprobs`` in ``values``."""
    vals = variants("num_logprobs", values)
    return tuple(dict.fromkeys(logprobs_bucket([check_num_logprobs(f"num_logprobs[{i}]", v)])
                               for i, v in enumerate(vals)))


def procs_variants(values: Sequence[ProcessorLimits | None], max_model_len: int | None
                   ) -> tuple[ProcessorLimits | None, ...]:
    """``procs`` checked: None (the plain program) or a ``ProcessorLimits`` (the processing
    one; needs ``max_model_len``, the history's columns)."""
    vals = variants("procs", values)
    for i, v in enumerate(vals):
        if v is not None and not isinstance(v, ProcessorLimits):
            raise ArgumentTypeError(f"procs[{i}] must be None (no logits processing) or a "
                                    f"specjax.sampling.logits_processors.ProcessorLimits, got "
                                    f"{show(v)}")
    if any(v is not None for v in vals):
        check_int("max_model_len", max_model_len, 1,
                  why="the token-history columns of the logits processors' state")
    return vals


def empty_procs(b: int, limits: ProcessorLimits | None, max_model_len: int | None):
    """A ``ProcessorState`` of ``b`` padding rows, or None for ``limits`` None."""
    if limits is None:
        return None
    return make_processor_state([], [], [], num_reqs_pad=b, max_len=int(max_model_len),
                                limits=limits)


def padding_fields(bucket: Bucket, *, k: int, block_size: int, tree=None) -> dict[str, Any]:
    """The ``StepBatch`` fields (NumPy) of ``bucket`` with no request: ``build_batch([], ...)``'s,
    leaf for leaf (``tree``: a tree batch's mask)."""
    b, t, c = bucket.requests, bucket.tokens, bucket.blocks
    zeros = lambda n, dt=_I32: np.zeros(n, dt)  # noqa: E731
    attn = CommonAttentionMetadata(
        query_start_loc=zeros(b + 1), seq_lens=zeros(b), block_table=zeros((b, c)),
        slot_mapping=np.full(t, -1, _I32), num_reqs=np.asarray(0, _I32),
        num_actual_tokens=np.asarray(0, _I32), max_seq_len=np.asarray(0, _I32),
        max_query_len=bucket.query_len_pad, causal=True,
        tree_mask=None if tree is None else tree.ancestor_mask(with_root=True))
    sdm = SpecDecodeMetadata(
        draft_token_ids=np.full(b * k, -1, _I32), num_draft_tokens=zeros(b),
        cu_num_draft_tokens=zeros(b), cu_num_sampled_tokens=zeros(b),
        target_logits_indices=zeros(b * k), bonus_logits_indices=zeros(b),
        logits_indices=zeros(b * (k + 1)), num_reqs=np.asarray(0, _I32), max_spec_len=int(k))
    return dict(input_ids=zeros(t), positions=zeros(t), attn=attn, sdm=sdm,
                temperature=zeros(b, np.float32), top_k=zeros(b), top_p=np.ones(b, np.float32),
                seeds=zeros(b, np.uint32), counters=zeros(b), backup_next=zeros(b),
                discard=zeros(b, np.bool_), block_size=int(block_size))


def padding_batches(step, buckets: Iterable[Any], *, block_size: int,
                    all_greedy: Sequence[bool] = (True, False),
                    tree_verify: Sequence[bool] | None = None,
                    num_logprobs: Sequence[int | None] = (None,),
                    procs: Sequence[ProcessorLimits | None] = (None,),
                    max_model_len: int | None = None) -> list[dict[str, Any]]:
    """The ``StepBatch`` fields of every padding batch ``Step.warmup`` runs: one per bucket,
    ``all_greedy``, ``tree_verify`` (None: chain, and tree when ``step.tree`` is set),
    ``num_logprobs`` (request ``logprobs``; their top-n buckets) and ``procs`` variant, every
    argument checked first (ValueError / TypeError naming it)."""
    resolved = as_buckets(buckets)
    check_int("block_size", block_size, 1)
    if step.feed is not None and step.feed.block_size not in (None, block_size):
        raise ArgumentError(f"block_size={block_size}, but the proposer was built with "
                            f"block_size={step.feed.block_size}")
    greedy = _flags("all_greedy", all_greedy)
    trees = (False,) + ((True,) if step.tree is not None else ()) if tree_verify is None \
        else _flags("tree_verify", tree_verify)
    if True in trees and step.tree is None:
        raise ArgumentError("tree_verify=(True,) but this step verifies chains (step.tree is None)")
    lps = logprobs_variants(num_logprobs)
    limits = procs_variants(procs, max_model_len)
    out = []
    for bk, g, tv, lp, pl in itertools.product(resolved, greedy, trees, lps, limits):
        f = padding_fields(bk, k=step.k, block_size=block_size, tree=step.tree if tv else None)
        out.append(dict(f, all_greedy=g, num_logprobs=lp,
                        procs=empty_procs(bk.requests, pl, max_model_len)))
    return out

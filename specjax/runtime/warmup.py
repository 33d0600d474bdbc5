"""Compiling ahead of time: the shape buckets a loop runs (:class:`Bucket`: requests,
tokens, blocks) and the padding batches ``Step.warmup`` runs through the step, one per
bucket and variant, so that no real call compiles.

A bucket names the three sizes a compiled step is specialised on: ``requests`` rows
(``num_reqs_pad``), a flat budget of ``tokens`` token slots (``T``; today ``requests *
query_len_pad``, so a multiple of ``requests``) and ``blocks`` block-table columns per row
(``blocks_per_req_pad``). The padding batch of a bucket is ``build_batch``'s with no
request (nothing written, nothing emitted), built here without it so that ``step.py`` can
call this module (``batch.py`` imports ``step.py``)."""

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
    all (the flat budget ``T = requests * query_len_pad``) and ``blocks`` block-table
    columns per row (``blocks_per_req_pad``). ``Bucket.of(B, Q, C)`` from the per-row form."""

    requests: int
    tokens: int
    blocks: int

    @property
    def query_len_pad(self) -> int:
        """Token slots per row (``tokens // requests``)."""
        return self.tokens // self.requests

    @classmethod
    def of(cls, num_reqs_pad: int, query_len_pad: int, blocks_per_req_pad: int) -> "Bucket":
        """The bucket of ``build_batch``'s ``(num_reqs_pad, query_len_pad, blocks_per_req_pad)``."""
        return cls(int(num_reqs_pad), int(num_reqs_pad) * int(query_len_pad),
                   int(blocks_per_req_pad))


def as_bucket(value: Any, name: str = "bucket") -> Bucket:
    """``value`` (a ``Bucket`` or a ``(requests, tokens, blocks)`` tuple) checked: ints >= 1,
    ``tokens`` a multiple of ``requests``. Raises ValueError / TypeError naming ``name.field``."""
    if not isinstance(value, (tuple, list)) or len(value) != 3:
        raise ArgumentTypeError(f"{name} must be a Bucket(requests, tokens, blocks) or a 3-tuple, "
                                f"got {show(value)}")
    r, t, c = (check_int(f"{name}.{f}", v, 1) for f, v in zip(Bucket._fields, value))
    if t % r:
        raise ArgumentError(f"{name}.tokens={t} is not a multiple of requests={r}: the step's "
                            f"batch holds requests * query_len_pad token slots (use "
                            f"Bucket.of(num_reqs_pad, query_len_pad, blocks_per_req_pad))")
    return Bucket(r, t, c)


def as_buckets(buckets: Iterable[Any], name: str = "buckets") -> tuple[Bucket, ...]:
    """:func:`as_bucket` of each of ``buckets`` (naming ``buckets[i].field``); at least one."""
    if isinstance(buckets, (str, bytes)) or not isinstance(buckets, Iterable) or (
            isinstance(buckets, Bucket)):
        raise ArgumentTypeError(f"{name} must be a list of Bucket(requests, tokens, blocks), got "
                                f"{show(buckets)}")
    out = tuple(as_bucket(b, f"{name}[{i}]") for i, b in enumerate(buckets))
    if not out:
        raise ArgumentError(f"{name} is empty: give at least one Bucket(requests, tokens, blocks)")
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
    b, t, c = bucket
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

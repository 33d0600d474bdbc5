"""The corpus of the device suffix speculator (vLLM 0.34's GPU suffix decoding): its state,
the 2- / 4-token bucket hash and the ingestion of finished requests' documents."""

# vLLM packs a table entry as the int64 (doc_seq << 32) | corpus_pos updated by atomic_max;
# JAX runs without x64, so an entry is two int32 planes (table_seq, table_pos) updated by two
# scatter-max passes (seq first, then pos among the entries whose seq won): the same order.

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from specjax.checks import check_int
from specjax.constants import next_power_of_2

#: Slots per bucket (a bucket keeps one entry per ``doc_seq % NUM_SLOTS``).
NUM_SLOTS = 8
#: The multiplier of the 64-bit hash.
HASH_MULT = 0x9E3779B97F4A7C15
#: Largest ``doc_seq``; a batch that would pass it clears the table and restarts at 0.
DOC_SEQ_MAX = 2**31 - 1
#: Plane 0 is keyed on the last 4 tokens, plane 1 on the last 2.
KEY_LENS = (4, 2)

_MULT_LO = np.uint32(HASH_MULT & 0xFFFFFFFF)
_MULT_HI = np.uint32(HASH_MULT >> 32)
_LOW16 = np.uint32(0xFFFF)


class SuffixGPUState(NamedTuple):
    """The device corpus (a pytree): ``corpus [C]`` int32 (-1: separator or empty);
    ``table_seq`` / ``table_pos [2, NB, NUM_SLOTS]`` int32, an entry's ``doc_seq`` and
    continuation position (-1: empty); ``corpus_head``, ``doc_seq``: int32 scalars."""

    corpus: jax.Array
    table_seq: jax.Array
    table_pos: jax.Array
    corpus_head: jax.Array
    doc_seq: jax.Array


def num_buckets(corpus_len: int) -> int:
    """``next_pow2(max(16, corpus_len // 4))`` (vLLM's ``NUM_BUCKETS``)."""
    return next_power_of_2(max(16, int(corpus_len) // 4))


def init_corpus(corpus_len: int) -> SuffixGPUState:
    """An empty corpus of ``corpus_len`` (in ``[1, 2**31)``) tokens and its table."""
    corpus_len = check_int("corpus_len", corpus_len, 1, DOC_SEQ_MAX)
    shape = (2, num_buckets(corpus_len), NUM_SLOTS)
    return SuffixGPUState(jnp.full((corpus_len,), -1, jnp.int32), jnp.full(shape, -1, jnp.int32),
                          jnp.full(shape, -1, jnp.int32), jnp.zeros((), jnp.int32),
                          jnp.zeros((), jnp.int32))


# ---------------------------------------------------------------------- hash


def _mul_mult(hi: jax.Array, lo: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(hi, lo) * HASH_MULT mod 2**64`` on uint32 halves."""
    # The high word of lo * MULT_LO from 16-bit halves (Hacker's Delight ``mulhu``).
    a0, a1 = lo & _LOW16, lo >> 16
    b0, b1 = _MULT_LO & _LOW16, _MULT_LO >> 16
    t = a0 * b0
    mid1 = a1 * b0 + (t >> 16)
    mid2 = a0 * b1 + (mid1 & _LOW16)
    carry = a1 * b1 + (mid1 >> 16) + (mid2 >> 16)
    return carry + hi * _MULT_LO + lo * _MULT_HI, lo * _MULT_LO


def _bucket(hi: jax.Array, lo: jax.Array, nb: int) -> jax.Array:
    # ((hv >> 29) ^ hv) & (nb - 1): nb <= 2**29, so only the low word of the shift counts,
    # and there the signed and unsigned shifts agree.
    shifted = (lo >> 29) | (hi << 3)
    return ((shifted ^ lo) & np.uint32(nb - 1)).astype(jnp.int32)


def bucket_keys(tail: jax.Array, nb: int) -> tuple[jax.Array, jax.Array]:
    """``(key4, key2)`` int32 buckets of ``tail [..., 4]`` int32 (newest token first):
    ``hv = (hv ^ tok) * HASH_MULT`` (int64, wrapping) over the tokens, the 2-token key after
    the second, the 4-token key after the fourth."""
    hi = jnp.zeros(tail.shape[:-1], jnp.uint32)
    lo = jnp.zeros(tail.shape[:-1], jnp.uint32)
    keys = []
    for d in range(4):
        tok = tail[..., d].astype(jnp.int32)
        lo = lo ^ lax.bitcast_convert_type(tok, jnp.uint32)
        hi = hi ^ jnp.where(tok < 0, np.uint32(0xFFFFFFFF), np.uint32(0))   # sign extension
        hi, lo = _mul_mult(hi, lo)
        if d in (1, 3):
            keys.append(_bucket(hi, lo, nb))
    return keys[1], keys[0]


# ---------------------------------------------------------------------- ingestion


def suffix_ingest(state: SuffixGPUState, docs: jax.Array, doc_lens: jax.Array) -> SuffixGPUState:
    """Append documents and index them (pure, traceable; :func:`ingest` jits it, donating
    ``state``). ``docs [D, W]`` int32, document ``i`` in its first ``doc_lens[i]`` columns, in
    ingestion (sorted request-id) order; ``doc_lens [D]`` (0: padding, skipped; past ``C -
    1``: the newest ``C - 1`` tokens). Each document and a -1 separator go at the head, or at
    0 past the ring's end, over older data; its position ``j`` is indexed under the 2 (``j >=
    2``) and 4 (``j >= 4``) tokens before it, by max, in slot ``doc_seq % NUM_SLOTS``."""
    # Writes to a cell that a later document of the batch takes are masked out, so the
    # result does not depend on the order in which XLA applies the scatters.
    corpus_len = state.corpus.shape[0]
    nb = state.table_seq.shape[1]
    num_docs, width = docs.shape
    docs = docs.astype(jnp.int32)
    lens = jnp.clip(doc_lens.astype(jnp.int32), 0, width)
    trim = jnp.maximum(lens - (corpus_len - 1), 0)             # keep the newest C - 1 tokens
    lens = lens - trim
    present = lens > 0
    count = jnp.sum(present.astype(jnp.int32))
    restart = state.doc_seq > DOC_SEQ_MAX - count
    table_seq = jnp.where(restart, -1, state.table_seq).reshape(-1)
    table_pos = jnp.where(restart, -1, state.table_pos).reshape(-1)
    seqs = jnp.where(restart, 0, state.doc_seq) + jnp.cumsum(present.astype(jnp.int32)) \
        - present.astype(jnp.int32)

    def place(head, length):
        start = jnp.where(head + length + 1 > corpus_len, 0, head)
        return jnp.where(length > 0, start + length + 1, head), start

    head, starts = lax.scan(place, state.corpus_head, lens)

    # Every cell a document writes (its tokens and the separator); a cell keeps the last writer.
    col = jnp.arange(width + 1, dtype=jnp.int32)[None, :]
    cell = starts[:, None] + col
    used = present[:, None] & (col <= lens[:, None])
    doc_index = jnp.broadcast_to(jnp.arange(num_docs, dtype=jnp.int32)[:, None], cell.shape)
    owner = jnp.full((corpus_len,), -1, jnp.int32).at[jnp.where(used, cell, corpus_len)].max(
        doc_index, mode="drop")
    kept = used & (owner[jnp.clip(cell, 0, corpus_len - 1)] == doc_index)
    source = jnp.clip(trim[:, None] + col, 0, width - 1)
    tokens = jnp.where(col < lens[:, None], jnp.take_along_axis(docs, source, axis=1), -1)
    corpus = state.corpus.at[jnp.where(kept, cell, corpus_len)].set(tokens, mode="drop")

    # Preceding tokens of position j, newest first: prev[i, j, d] = doc_i[j - 1 - d].
    col = col[:, :width]
    back = col[:, :, None] - 1 - jnp.arange(4, dtype=jnp.int32)[None, None, :]
    prev_index = jnp.clip(trim[:, None, None] + back, 0, width - 1)
    prev = jnp.take_along_axis(docs, prev_index.reshape(num_docs, -1), axis=1)
    prev = prev.reshape(num_docs, width, 4)
    key4, key2 = bucket_keys(prev, nb)
    indexable = kept[:, :width] & (col < lens[:, None])
    slot = (seqs % NUM_SLOTS)[:, None]
    flat = []
    for plane, (key, key_len) in enumerate(zip((key4, key2), KEY_LENS)):
        ok = indexable & (col >= key_len)
        idx = (plane * nb + key) * NUM_SLOTS + slot
        flat.append(jnp.where(ok, idx, table_seq.shape[0]))
    idx = jnp.concatenate(flat, axis=None)
    seq_val = jnp.broadcast_to(seqs[:, None], cell[:, :width].shape)
    seq_val = jnp.concatenate([seq_val, seq_val], axis=None)
    pos_val = jnp.concatenate([cell[:, :width], cell[:, :width]], axis=None)
    # (seq, pos) packed max: max seq first, then max pos among the entries whose seq won.
    new_seq = table_seq.at[idx].max(seq_val, mode="drop")
    won = seq_val == new_seq[jnp.clip(idx, 0, table_seq.shape[0] - 1)]
    new_pos = jnp.where(table_seq == new_seq, table_pos, -1).at[idx].max(
        jnp.where(won, pos_val, -1), mode="drop")
    shape = state.table_seq.shape
    return SuffixGPUState(corpus, new_seq.reshape(shape), new_pos.reshape(shape), head,
                          jnp.where(restart, 0, state.doc_seq) + count)


ingest = jax.jit(suffix_ingest, donate_argnums=0)


def check_documents(state: SuffixGPUState, docs, doc_lens) -> None:
    """ValueError / TypeError naming ``state``, ``docs`` or ``doc_lens`` for a call
    :func:`ingest` cannot take."""
    if not isinstance(state, SuffixGPUState):
        raise TypeError(f"state must be a SuffixGPUState (from init_corpus), got {type(state).__name__}")
    for name, value in (("docs", docs), ("doc_lens", doc_lens)):
        kind = getattr(getattr(value, "dtype", None), "kind", None)
        if kind not in ("i", "u"):
            raise TypeError(f"{name} must be an integer array, got {getattr(value, 'dtype', type(value).__name__)}")
    if docs.ndim != 2 or doc_lens.shape != (docs.shape[0],):
        raise ValueError(f"docs must be [D, W] and doc_lens [D]; got {docs.shape} and {doc_lens.shape}")


def build_documents(prompt_lens: Sequence[int], token_lists: Sequence[Sequence[int]],
                    corpus_len: int, *, pad: bool = True, width: int | None = None
                    ) -> tuple[np.ndarray, np.ndarray]:
    """Host documents in order: request ``i``'s ``[max(prompt_lens[i] - 3, 0), len)`` tokens,
    the newest ``corpus_len - 1``, as ``(docs [D, W], doc_lens [D])`` int32 (``pad``: powers of
    two; ``W = width`` if given). ValueError for a bad ``prompt_lens[i]`` or a wider document."""
    corpus_len = check_int("corpus_len", corpus_len, 1, DOC_SEQ_MAX)
    if len(prompt_lens) != len(token_lists):
        raise ValueError(f"prompt_lens has {len(prompt_lens)} entries, token_lists {len(token_lists)}; "
                         "they must agree")
    docs = []
    for i, (p, toks) in enumerate(zip(prompt_lens, token_lists)):
        toks = np.asarray(toks, np.int64).reshape(-1)
        p = check_int(f"prompt_lens[{i}]", p, 0, toks.shape[0])
        doc = toks[max(p - 3, 0):]
        docs.append(doc[max(doc.shape[0] - (corpus_len - 1), 0):])
    rows = len(docs)
    widest = max((d.shape[0] for d in docs), default=1)
    if width is not None and widest > width:
        raise ValueError(f"token_lists: a document of {widest} tokens is wider than {width}")
    if pad:
        rows = next_power_of_2(max(rows, 1))
    width = width if width is not None else next_power_of_2(max(widest, 1)) if pad else widest
    out = np.full((rows, max(width, 1)), -1, np.int32)
    lens = np.zeros(rows, np.int32)
    for i, d in enumerate(docs):
        out[i, : d.shape[0]] = d
        lens[i] = d.shape[0]
    return out, lens


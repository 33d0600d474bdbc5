"""Suffix decoding on the accelerator (vLLM 0.34's GPU suffix speculator): the longest
suffix match in the request's own history, or a frequency-chosen continuation from a ring
corpus of finished responses (:mod:`~specjax.proposers.suffix_gpu_corpus`), whichever
matches longer. Every step is a pure function of device state: no host synchronisation.

Drafts: a drafting row always gets ``k`` drafts (fewer only below ``max_model_len``), as in
vLLM: slots past the chosen continuation repeat the last token and are verified like any
draft. ``num_valid`` counts the real ones.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Mapping, Sequence
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from specjax.checks import check_int
from specjax.config import SpeculativeConfig
from specjax.constants import INT32_LIMIT, next_power_of_2
from specjax.proposers import suffix_gpu_corpus as corpus_ops
from specjax.proposers.interface import TokenHistory, history_feed
from specjax.proposers.ngram_gpu import DeviceRowsAdapter, NgramGPUProposer, NgramGPUState
from specjax.proposers.suffix_gpu_corpus import (
    KEY_LENS,
    NUM_SLOTS,
    SuffixGPUState,
    bucket_keys,
)
from specjax.proposers.types import DRAFT_PADDING_ID, DraftOutput

#: Candidates per lookup: the slots of the 4-token bucket, then those of the 2-token bucket.
NUM_CANDIDATES = 2 * NUM_SLOTS
#: ``SuffixMatch.source`` values.
SOURCE_NONE, SOURCE_OWN, SOURCE_CORPUS = -1, 0, 1
#: vLLM 0.34's match-length buckets of the confidence statistics: 1..6 each, 7-10, 11-20, 21+.
NUM_LENGTH_BUCKETS = 9
#: Steps after which the statistics halve.
STATS_HALF_LIFE = 1024


def confidence_bucket(match_len: int) -> int:
    """The statistics bucket of a match of ``match_len >= 1`` tokens (0 for 0)."""
    return max(match_len, 1) - 1 if match_len <= 6 else 6 if match_len <= 10 else \
        7 if match_len <= 20 else 8


class SuffixMatch(NamedTuple):
    """What each row's drafts came from, ``[B]`` int32 each: ``num_valid`` (real drafts; the
    rest repeat the last token), ``source`` (:data:`SOURCE_OWN`, :data:`SOURCE_CORPUS` or
    :data:`SOURCE_NONE`) and ``match_len`` (the matched suffix's length, 0 for none)."""

    num_valid: jax.Array
    source: jax.Array
    match_len: jax.Array


def _own_match(tok, n, tail, tail_ok, active, max_depth):
    """``(length, pos) [B]``: the longest match ``tok[pos-1-t] == tok[n-1-t]`` over end
    positions ``pos`` in ``[1, n)``, ties to the latest ``pos`` (0, 0 for none)."""
    batch, width = tok.shape
    end = lax.broadcasted_iota(jnp.int32, (batch, width), 1)          # end = pos - 1

    def step(s, carry):
        run, length = carry
        shifted = jnp.roll(tok, s, axis=1)                              # shifted[:, e] = tok[e - s]
        want = lax.dynamic_slice_in_dim(tail, s, 1, axis=1)
        ok = lax.dynamic_slice_in_dim(tail_ok, s, 1, axis=1)
        run = run & (shifted == want) & ok & (end >= s)
        return run, length + run.astype(jnp.int32)

    run = jnp.ones((batch, width), jnp.bool_)
    _, length = lax.fori_loop(0, min(max_depth, width), step,
                              (run, jnp.zeros((batch, width), jnp.int32)))
    pos = end + 1
    eligible = (length > 0) & (pos < n[:, None]) & active[:, None]
    best = jnp.max(jnp.where(eligible, length * (width + 1) + pos, 0), axis=1)
    return best // (width + 1), best % (width + 1)


def _corpus_candidates(state: SuffixGPUState, tail, tail_ok, n, active, max_depth, k):
    """The 16 verified candidates: ``(valid, rank, c_len) [B, 16]`` and continuations
    ``(cont, cont_ok) [B, 16, k]``; ``rank`` orders valid candidates by packed entry."""
    corpus = state.corpus
    size = corpus.shape[0]
    nb = state.table_seq.shape[1]
    key4, key2 = bucket_keys(tail[:, :4], nb)
    seq = jnp.concatenate([state.table_seq[0, key4], state.table_seq[1, key2]], axis=1)
    pos = jnp.concatenate([state.table_pos[0, key4], state.table_pos[1, key2]], axis=1)
    key_len = jnp.repeat(jnp.asarray(KEY_LENS, jnp.int32), NUM_SLOTS)[None, :]
    cpos = jnp.clip(pos, 0, size - 1)

    back = cpos[:, :, None] - 1 - jnp.arange(max_depth, dtype=jnp.int32)
    ctok = jnp.where(back >= 0, corpus[jnp.clip(back, 0, size - 1)], -1)
    ok = (ctok != -1) & (ctok == tail[:, None, :max_depth]) & tail_ok[:, None, :max_depth]
    c_len = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=-1), axis=-1)
    valid = ((seq >= 0) & (pos >= 0) & (pos < size) & (corpus[cpos] != -1) & (c_len >= key_len)
             & (n[:, None] >= key_len) & active[:, None])

    # Packed order (seq, pos); a position found twice counts once, as its largest entry.
    s_i, s_j = seq[:, :, None], seq[:, None, :]
    p_i, p_j = pos[:, :, None], pos[:, None, :]
    j_less = (s_j < s_i) | ((s_j == s_i) & (p_j < p_i))                # entry j < entry i
    equal = (s_j == s_i) & (p_j == p_i)
    index = jnp.arange(NUM_CANDIDATES)
    j_before = index[None, None, :] < index[None, :, None]
    shadowed = valid[:, None, :] & (p_j == p_i) & ((~j_less & ~equal) | (equal & j_before))
    valid = valid & ~jnp.any(shadowed, axis=-1)
    rank = jnp.sum(valid[:, None, :] & j_less, axis=-1)

    ahead = cpos[:, :, None] + jnp.arange(k, dtype=jnp.int32)
    cont = jnp.where(ahead < size, corpus[jnp.clip(ahead, 0, size - 1)], -1)
    cont_ok = jnp.cumprod((cont != -1).astype(jnp.int32), axis=-1) > 0
    return valid, rank, c_len, cont, cont_ok


def _corpus_chain(valid, rank, c_len, cont, cont_ok, k):
    """The best frequency chain over every match length ``L`` of a valid candidate:
    ``(found, L, chain [B, k], chain_len) [B]``. Per ``L``, the candidates with ``c_len >=
    L`` follow, slot by slot, their most frequent next token (ties: the newest candidate's),
    keeping those that emitted it; score ``num / den`` = summed counts over the starting
    count, the best (ties to the longer ``L``) wins."""
    opt_ok = valid                                                       # option o: L = c_len[o]
    alive = valid[:, None, :] & (c_len[:, None, :] >= c_len[:, :, None]) & opt_ok[:, :, None]
    den = jnp.sum(alive.astype(jnp.int32), axis=-1)

    def step(carry, xs):
        alive, num = carry
        tok_j, ok_j = xs                                                 # [B, 16] each
        emit = alive & ok_j[:, None, :]
        same = tok_j[:, :, None] == tok_j[:, None, :]                    # [B, c, c']
        count = jnp.sum(emit[:, :, None, :] & same[:, None, :, :], axis=-1)   # [B, o, c]
        score = jnp.where(emit, count * NUM_CANDIDATES + rank[:, None, :], -1)
        best = jnp.argmax(score, axis=-1)                                # [B, o]
        any_emit = jnp.max(score, axis=-1) >= 0
        token = jnp.take_along_axis(tok_j, best, axis=1)
        num = num + jnp.where(any_emit, jnp.take_along_axis(count, best[..., None], 2)[..., 0], 0)
        alive = emit & (tok_j[:, None, :] == token[:, :, None])
        return (alive, num), (jnp.where(any_emit, token, -1), any_emit)

    xs = (jnp.moveaxis(cont, 2, 0), jnp.moveaxis(cont_ok, 2, 0))
    (_, num), (tokens, emitted) = lax.scan(step, (alive, jnp.zeros_like(den)), xs, length=k)
    chains = jnp.moveaxis(tokens, 0, 2)                                  # [B, o, k]
    lengths = jnp.sum(emitted.astype(jnp.int32), axis=0)                 # [B, o]

    # Option i beats j: a larger num / den (exact cross products), then a longer L.
    cross_i = num[:, :, None] * den[:, None, :]
    cross_j = num[:, None, :] * den[:, :, None]
    beats = (cross_i > cross_j) | ((cross_i == cross_j) & (c_len[:, :, None] > c_len[:, None, :]))
    beaten = jnp.any(opt_ok[:, :, None] & beats, axis=1)
    winner = jnp.argmax(opt_ok & ~beaten, axis=1)
    found = jnp.any(opt_ok, axis=1)
    pick = lambda a: jnp.take_along_axis(a, winner[:, None], axis=1)[:, 0]
    chain = jnp.take_along_axis(chains, winner[:, None, None], axis=1)[:, 0]
    return found, pick(c_len), chain, pick(lengths)


def suffix_search(state: SuffixGPUState, token_ids: jax.Array, num_tokens: jax.Array,
                  valid: jax.Array, *, k: int, max_depth: int, max_model_len: int,
                  use_corpus: bool) -> tuple[DraftOutput, SuffixMatch]:
    """Draft for every row of a padded batch (traceable; no host sync).

    ``token_ids [B, T]`` int32, row ``b``'s context in its first ``n = num_tokens[b]``
    columns; ``valid [B]`` bool (False: no draft); ``k``, ``max_depth``, ``max_model_len``,
    ``use_corpus`` static. Own history: the longest match (up to ``max_depth``, ties to the
    latest). Corpus (``use_corpus``): :func:`_corpus_chain` over the verified candidates, used
    only when its match is strictly longer. Returns ``(DraftOutput([B, k] int32, num_drafts
    [B]), SuffixMatch)``: ``num_drafts = min(k, max_model_len - n)`` for drafting rows (``n
    >= 1``), 0 otherwise; filler = the last token; -1 past ``num_drafts``.
    """
    _check_search(state, token_ids, num_tokens, valid, k, max_depth, max_model_len)
    width = token_ids.shape[1]
    tok = token_ids.astype(jnp.int32)
    n = jnp.clip(num_tokens.astype(jnp.int32), 0, width)
    active = valid.astype(jnp.bool_) & (n >= 1)
    cols = max(max_depth, 4)
    t = jnp.arange(cols, dtype=jnp.int32)[None, :]
    tail_ok = t < n[:, None]
    tail = jnp.take_along_axis(tok, jnp.clip(n[:, None] - 1 - t, 0, width - 1), axis=1)
    column = jnp.arange(k, dtype=jnp.int32)[None, :]

    own_len, own_pos = _own_match(tok, n, tail, tail_ok, active, max_depth)
    own_found = own_len > 0
    own_count = jnp.where(own_found, jnp.minimum(k, n - own_pos), 0)
    real = jnp.take_along_axis(tok, jnp.clip(own_pos[:, None] + column, 0, width - 1), axis=1)
    num_valid, match_len = own_count, own_len
    source = jnp.where(own_found, SOURCE_OWN, SOURCE_NONE)
    if use_corpus and max_depth >= 2:
        found, c_match, chain, chain_len = _corpus_chain(
            *_corpus_candidates(state, tail, tail_ok, n, active, max_depth, k), k)
        use = found & (c_match > own_len)
        real = jnp.where(use[:, None], chain, real)
        num_valid = jnp.where(use, chain_len, num_valid)
        match_len = jnp.where(use, c_match, match_len)
        source = jnp.where(use, SOURCE_CORPUS, source)

    num_drafts = jnp.where(active, jnp.clip(max_model_len - n, 0, k), 0)
    num_valid = jnp.minimum(num_valid, num_drafts)
    last = tail[:, :1]
    drafts = jnp.where(column < num_valid[:, None], real, last)
    drafts = jnp.where(column < num_drafts[:, None], drafts, DRAFT_PADDING_ID)
    source = jnp.where(num_valid > 0, source, SOURCE_NONE)
    match_len = jnp.where(num_valid > 0, match_len, 0)
    return (DraftOutput(drafts.astype(jnp.int32), num_drafts.astype(jnp.int32)),
            SuffixMatch(num_valid.astype(jnp.int32), source.astype(jnp.int32),
                        match_len.astype(jnp.int32)))


@dataclasses.dataclass(frozen=True)
class SuffixGPUProposer:
    """Static configuration of the device suffix speculator (hashable; static under jit):
    ``num_speculative_tokens`` (k >= 1), ``max_model_len`` (>= 1), ``max_depth``
    (``suffix_decoding_max_tree_depth``, >= 1: the longest suffix compared) and
    ``corpus_tokens`` (``suffix_decoding_corpus_tokens`` in ``[0, 2**31)``; 0 = own history
    only; the corpus is also off for ``max_depth < 2``)."""

    num_speculative_tokens: int
    max_model_len: int
    max_depth: int = 24
    corpus_tokens: int = 1 << 20

    def __post_init__(self) -> None:
        check_int("num_speculative_tokens", self.num_speculative_tokens, 1)
        check_int("max_model_len", self.max_model_len, 1)
        check_int("max_depth", self.max_depth, 1)
        check_int("corpus_tokens", self.corpus_tokens, 0, INT32_LIMIT - 1)
        # The own-history key m * (T + 1) + pos must fit int32 for widths up to max_model_len.
        if (self.max_depth + 1) * (self.max_model_len + 1) >= INT32_LIMIT:
            raise ValueError(f"(max_depth + 1) * (max_model_len + 1) must be < 2**31 for the int32 "
                             f"search key; got max_depth={self.max_depth}, "
                             f"max_model_len={self.max_model_len}")

    @property
    def k(self) -> int:
        return self.num_speculative_tokens

    @property
    def use_corpus(self) -> bool:
        return self.corpus_tokens > 0 and self.max_depth >= 2

    #: the device loop passes :meth:`draft` the corpus (``device_drafter_state``)
    stateful = True

    def init_state(self) -> SuffixGPUState:
        """An empty corpus of ``corpus_tokens`` tokens (1 when the corpus is off)."""
        return corpus_ops.init_corpus(self.corpus_tokens if self.use_corpus else 1)

    def search(self, state: SuffixGPUState, token_ids: jax.Array, num_tokens: jax.Array,
               valid: jax.Array) -> tuple[DraftOutput, SuffixMatch]:
        """:func:`suffix_search` with this configuration (traceable)."""
        return suffix_search(state, token_ids, num_tokens, valid, k=self.k,
                             max_depth=self.max_depth, max_model_len=self.max_model_len,
                             use_corpus=self.use_corpus)

    def draft(self, state: SuffixGPUState, token_ids: jax.Array, num_tokens: jax.Array,
              valid: jax.Array) -> DraftOutput:
        """The drafts of :meth:`search` (traceable; the device loop's hook)."""
        return self.search(state, token_ids, num_tokens, valid)[0]

    def propose_arrays(self, state: SuffixGPUState, token_ids: jax.Array, num_tokens: jax.Array,
                       valid: jax.Array | None = None) -> tuple[DraftOutput, SuffixMatch]:
        """:meth:`search` jit-compiled over caller-owned arrays (nothing donated):
        ``token_ids [B, T]`` int32 (``T <= max_model_len``), ``num_tokens [B]``, ``valid
        [B]`` bool (default all True)."""
        _check_state(state)
        _check_int_dtype("token_ids", token_ids)
        _check_int_dtype("num_tokens", num_tokens)
        if token_ids.ndim != 2 or num_tokens.shape != (token_ids.shape[0],):
            raise ValueError(f"token_ids must be [B, T] and num_tokens [B]; got {token_ids.shape} "
                             f"and {num_tokens.shape}")
        if token_ids.shape[1] > self.max_model_len:
            raise ValueError(f"token_ids width {token_ids.shape[1]} exceeds max_model_len="
                             f"{self.max_model_len}")
        if valid is None:
            valid = jnp.ones(num_tokens.shape, jnp.bool_)
        elif valid.shape != num_tokens.shape or valid.dtype != jnp.bool_:
            raise ValueError(f"valid must be a [{num_tokens.shape[0]}] bool array, got "
                             f"{valid.shape} {valid.dtype}")
        return _search_jit(self, state, token_ids, num_tokens, valid)

    @property
    def ingest_width(self) -> int:
        """Columns of every :meth:`ingest_documents` call (programs differ only in rows)."""
        return next_power_of_2(min(self.max_model_len, max(self.corpus_tokens - 1, 1)))

    def ingest_documents(self, state: SuffixGPUState, prompt_lens: Sequence[int],
                         token_lists: Sequence[Sequence[int]]) -> SuffixGPUState:
        """``build_documents``' documents in one :meth:`ingest` of :attr:`ingest_width`
        columns, rows a power of two. ValueError naming ``token_lists``: a wider document."""
        if not self.use_corpus or not token_lists:
            return state
        docs, lens = corpus_ops.build_documents(prompt_lens, token_lists, self.corpus_tokens,
                                                width=self.ingest_width)
        return self.ingest(state, jnp.asarray(docs), jnp.asarray(lens))

    def ingest(self, state: SuffixGPUState, docs: jax.Array, doc_lens: jax.Array) -> SuffixGPUState:
        """:func:`~specjax.proposers.suffix_gpu_corpus.suffix_ingest` (``state`` donated);
        the state unchanged when the corpus is off."""
        corpus_ops.check_documents(state, docs, doc_lens)
        if not self.use_corpus or docs.shape[0] == 0:
            return state
        return corpus_ops.ingest(state, docs, doc_lens)

    def propose_packed(self, buffer: NgramGPUState, state: SuffixGPUState, packed: jax.Array
                       ) -> tuple[jax.Array, NgramGPUState]:
        """Append each row's new tokens to its buffer row and draft (``buffer`` donated):
        ``packed [B, 2 + S]`` int32 (buffer row or -1, ``num_sampled``, the tokens) -> ``([B,
        k + 4]`` int32: drafts, ``num_drafts``, ``num_valid``, ``source``, ``match_len``;
        the new buffer)."""
        _check_state(state)
        _check_int_dtype("packed", packed)
        if packed.ndim != 2 or packed.shape[1] < 3:
            raise ValueError(f"packed must be [B, 2 + S] with S >= 1, got {packed.shape}")
        return _propose_packed_jit(self, buffer, state, packed)


@partial(jax.jit, static_argnums=0)
def _search_jit(cfg: SuffixGPUProposer, state, token_ids, num_tokens, valid):
    return cfg.search(state, token_ids, num_tokens, valid)


@partial(jax.jit, static_argnums=0, donate_argnums=1)
def _propose_packed_jit(cfg: SuffixGPUProposer, buffer: NgramGPUState, state, packed):
    packed = packed.astype(jnp.int32)
    limit, width = buffer.token_ids.shape
    rows, num_sampled, sampled = packed[:, 0], packed[:, 1], packed[:, 2:]
    real = (rows >= 0) & (rows < limit)
    read_row = jnp.where(real, rows, 0)
    write_row = jnp.where(real, rows, limit)                # padding rows: writes dropped
    num_sampled = jnp.where(real, num_sampled, 0)
    old_len = buffer.num_tokens[read_row]
    column = jnp.arange(sampled.shape[1], dtype=jnp.int32)[None, :]
    write_pos = old_len[:, None] + column
    write = (column < num_sampled[:, None]) & (sampled != DRAFT_PADDING_ID) & (write_pos < width)
    write_pos = jnp.where(write, write_pos, width)
    row_index = jnp.broadcast_to(write_row[:, None], write_pos.shape)
    token_ids = buffer.token_ids.at[row_index, write_pos].set(sampled, mode="drop")
    new_len = jnp.minimum(old_len + num_sampled, width)
    num_tokens = buffer.num_tokens.at[write_row].set(new_len, mode="drop")
    valid = real & (num_sampled > 0) & (new_len < cfg.max_model_len)
    drafts, match = cfg.search(state, token_ids[read_row], new_len, valid)
    out = jnp.concatenate([drafts.token_ids, drafts.num_drafts[:, None], match.num_valid[:, None],
                           match.source[:, None], match.match_len[:, None]], axis=1)
    return out, NgramGPUState(token_ids, num_tokens)


def _check_search(state, token_ids, num_tokens, valid, k, max_depth, max_model_len) -> None:
    _check_state(state)
    check_int("k", k, 1)
    check_int("max_depth", max_depth, 1)
    check_int("max_model_len", max_model_len, 1)
    _check_int_dtype("token_ids", token_ids)
    _check_int_dtype("num_tokens", num_tokens)
    if token_ids.ndim != 2 or num_tokens.shape != (token_ids.shape[0],) \
            or valid.shape != num_tokens.shape:
        raise ValueError(f"token_ids must be [B, T], num_tokens and valid [B]; got "
                         f"{token_ids.shape}, {num_tokens.shape} and {valid.shape}")
    if (max_depth + 1) * (token_ids.shape[1] + 1) >= INT32_LIMIT:
        raise ValueError(f"token_ids width {token_ids.shape[1]} is too wide for the int32 search "
                         f"key with max_depth={max_depth}")


def _check_int_dtype(name: str, value) -> None:
    if getattr(getattr(value, "dtype", None), "kind", None) not in ("i", "u"):
        raise TypeError(f"{name} must be an integer array, got "
                        f"{getattr(value, 'dtype', type(value).__name__)}")


def _check_state(state) -> None:
    if not isinstance(state, SuffixGPUState):
        raise TypeError(f"state must be a SuffixGPUState (from init_state), got {type(state).__name__}")


def _sorted_ids(req_ids: Sequence[Hashable]) -> list:
    try:
        return sorted(req_ids)
    except TypeError:                   # mixed id types: a fixed order all the same
        return sorted(req_ids, key=repr)


# ---------------------------------------------------------------------------------------
# the adapter a decoding loop drives (``make_proposer``)


class SuffixGPUProposerAdapter(DeviceRowsAdapter):
    """``method="suffix"`` with ``suffix_backend="device"``: :func:`suffix_search` over a
    device token buffer (one row per request, only new tokens uploaded per call) and a device
    corpus that :meth:`finish_requests` fills. A host copy of each request's tokens and prompt
    length is kept until it finishes, for its document. The device loop drafts with
    :attr:`device_drafter` from :attr:`device_drafter_state` (the corpus, read-only there:
    requests finishing inside a loop call join it when the engine sees them finish)."""

    def __init__(self, config: SpeculativeConfig, *, max_model_len: int) -> None:
        self.config = config
        self._feed = history_feed(config, max_model_len)
        corpus_tokens = config.suffix_decoding_corpus_tokens
        if config.suffix_decoding_max_cached_requests == 0:
            corpus_tokens = 0
        self.impl = SuffixGPUProposer(num_speculative_tokens=config.num_speculative_tokens,
                                      max_model_len=max_model_len,
                                      max_depth=config.suffix_decoding_max_tree_depth,
                                      corpus_tokens=corpus_tokens)
        # the token buffer's bookkeeping (its search is not used)
        self._init_rows(NgramGPUProposer(num_speculative_tokens=config.num_speculative_tokens,
                                         max_model_len=max_model_len))
        self.state = self.impl.init_state()      # SuffixGPUState
        #: adaptive verification's counts [source (own, corpus), length bucket, slot,
        #: (observed, accepted)] and each request's last (source, bucket, num_valid)
        self._stats = np.zeros((2, NUM_LENGTH_BUCKETS, config.num_speculative_tokens, 2), np.int64)
        self._last: dict = {}
        self._observed_steps = 0
        self._host: dict = {}                    # req_id -> [prompt_len, token list]
        self.last_match: SuffixMatch | None = None

    @property
    def device_drafter(self) -> SuffixGPUProposer:
        """Hashable drafter with a traceable ``draft(state, token_ids, num_tokens, valid)``."""
        return self.impl

    @property
    def device_drafter_state(self) -> SuffixGPUState:
        """The corpus the device loop drafts from."""
        return self.state

    def propose_from_history(self, history: TokenHistory) -> DraftOutput:
        if len(history.num_prompt_tokens) != len(history.req_ids):
            raise ValueError(f"history has {len(history.req_ids)} req_ids and "
                             f"{len(history.num_prompt_tokens)} prompt lengths; they must agree")
        k = self.impl.k

        def seen(j, rid, n, c):                  # the host copy, for the request's document
            host = self._host.get(rid)
            if host is None or len(host[1]) != n - c:
                self._host[rid] = [int(history.num_prompt_tokens[j]),
                                   history.token_ids[j, :n].tolist()]
            elif c:
                host[1].extend(int(t) for t in history.sampled_token_ids[j])

        ids, packed = self._pack(history, k, seen)
        b = len(ids)
        out, self.buffer = self.impl.propose_packed(self.buffer, self.state, jnp.asarray(packed))
        out = np.asarray(out)[:b]
        self.last_match = m = SuffixMatch(out[:, k + 1], out[:, k + 2], out[:, k + 3])
        if not self.drafts_confidence:
            return DraftOutput(out[:, :k], out[:, k])
        feats = np.zeros((b, k), np.float32)
        for j, rid in enumerate(ids):
            src, bkt, nv = int(m.source[j]), confidence_bucket(int(m.match_len[j])), int(m.num_valid[j])
            self._last[rid] = (src, bkt, nv)
            if src >= 0 and nv:      # Laplace on the (source, length) bucket; fillers 0
                st = self._stats[src, bkt, :nv]
                feats[j, :nv] = (st[:, 1] + 1) / (st[:, 0] + 2)
        return DraftOutput(out[:, :k], out[:, k], feats)

    @property
    def drafts_confidence(self) -> bool:
        """True with ``enable_adaptive_verification``: the drafts' features are acceptance
        probabilities from the speculator's own statistics (vLLM 0.34's suffix confidences)."""
        return bool(self.config.enable_adaptive_verification)

    def observe_verification(self, req_ids: Sequence[Hashable], verified: Sequence[int],
                             accepted: Sequence[int]) -> None:
        """Fold one step's outcome into the statistics: for each request's last drafts, slots
        ``i <= accepted``, ``i < verified``, ``i < num_valid`` are observed, ``i < accepted``
        accepted; every :data:`STATS_HALF_LIFE` calls the counts halve."""
        for rid, v, a in zip(req_ids, verified, accepted):
            src, bkt, nv = self._last.pop(rid, (SOURCE_NONE, 0, 0))
            n = min(int(v), nv, int(a) + 1)
            if src >= 0 and n > 0:
                self._stats[src, bkt, :n, 0] += 1
                self._stats[src, bkt, : min(int(a), n), 1] += 1
        self._observed_steps += 1
        if self._observed_steps % STATS_HALF_LIFE == 0:
            self._stats //= 2

    def finish_requests(self, req_ids: Sequence[Hashable],
                        documents: Mapping[Hashable, tuple[int, Sequence[int]]] | None = None
                        ) -> None:
        """Requests that left for good: their documents join the corpus in sorted request-id
        order, and their rows are freed. ``documents``: ``req_id -> (prompt_len, all token
        ids)`` for requests whose last tokens the proposer has not seen (else its host copy)."""
        documents = {} if documents is None else dict(documents)
        prompt_lens, token_lists = [], []
        for rid in _sorted_ids(set(req_ids)):
            host = self._host.pop(rid, None)
            self._release(rid)
            doc = documents.get(rid, host)
            if doc is not None:
                prompt_lens.append(int(doc[0]))
                token_lists.append(doc[1])
        self.state = self.impl.ingest_documents(self.state, prompt_lens, token_lists)

    def warmup_finish(self, max_num_seqs: int) -> None:
        """Compile the ingestion of up to ``max_num_seqs`` documents (padding rows: no-ops)."""
        rows = next_power_of_2(check_int("max_num_seqs", max_num_seqs, 1))
        while self.impl.use_corpus and rows:
            self.state = self.impl.ingest(self.state,
                                          jnp.full((rows, self.impl.ingest_width), -1, jnp.int32),
                                          jnp.zeros((rows,), jnp.int32))
            rows //= 2

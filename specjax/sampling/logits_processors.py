"""Per-request logits processors (vLLM's sampler semantics), at every verified position.

:class:`ProcessorState` holds every request's parameters and token history, padded to
:class:`ProcessorLimits`; :func:`apply_processors` applies them in vLLM v1's ``Sampler``
order, the drafts before a position counted as output, so greedy speculative decoding
equals plain greedy decoding. Semantics and user processors: docs/sampling.md.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["ProcessorLimits", "ProcessorState", "RequestProcessing", "apply_processors",
           "apply_min_p", "make_processor_state", "LogitsProcessor"]

#: ``fn(logits [T, V], params [T, P], (token_ids [T, L], num_tokens [T], position [T])) -> [T, V]``
LogitsProcessor = Callable[[jax.Array, jax.Array, tuple], jax.Array]
_I32 = np.int32
_NEG = -jnp.inf


class ProcessorLimits(NamedTuple):
    """Fixed padded sizes of :class:`ProcessorState`, so one compiled shape serves every
    mix of requests."""

    max_logit_bias: int = 32          # entries of logit_bias per request
    max_bad_words: int = 8            # bad words per request
    max_bad_word_len: int = 8         # tokens per bad word
    max_allowed_token_ids: int = 256  # allowed_token_ids per request
    max_stop_ids: int = 8             # stop ids min_tokens suppresses (EOS included)
    num_processor_params: int = 4     # floats of a request's user-processor parameters


class RequestProcessing(NamedTuple):
    """One request's processing parameters (host side; vLLM's names)."""

    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: Mapping[int, float] | None = None
    bad_words: Sequence[Sequence[int]] = ()
    allowed_token_ids: Sequence[int] | None = None
    min_tokens: int = 0
    stop_ids: Sequence[int] = ()      # what min_tokens suppresses (stop_token_ids + EOS)
    processor: int = -1
    processor_params: Sequence[float] = ()

    @property
    def active(self) -> bool:
        """Whether anything here changes the logits."""
        return bool(self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0 or self.min_p or self.logit_bias
                    or self.bad_words or self.allowed_token_ids is not None
                    or (self.min_tokens and self.stop_ids) or self.processor >= 0)


@dataclasses.dataclass(frozen=True)
class ProcessorState:
    """Per-request processing parameters and token history, ``B`` rows (a pytree).

    token_ids ``[B, L] int32`` (prompt then output, 0 after), num_tokens / num_prompt ``[B]
    int32``; presence / frequency / repetition / min_p ``[B] float32`` (off: 0, 0, 1, 0);
    bias_ids ``[B, NB] int32`` (-1 pad), bias_vals ``[B, NB] float32``; bad_words ``[B, NW,
    WL] int32`` (-1 pad), bad_lens ``[B, NW]``; allowed ``[B, NA] int32`` (-1 pad),
    use_allowed ``[B] bool``; min_tokens ``[B] int32``, stop_ids ``[B, S] int32`` (-1 pad);
    selector ``[B] int32`` (-1: no user processor), params ``[B, P] float32``.
    """

    token_ids: Any
    num_tokens: Any
    num_prompt: Any
    presence: Any
    frequency: Any
    repetition: Any
    min_p: Any
    bias_ids: Any
    bias_vals: Any
    bad_words: Any
    bad_lens: Any
    allowed: Any
    use_allowed: Any
    min_tokens: Any
    stop_ids: Any
    selector: Any
    params: Any


_FIELDS = [f.name for f in dataclasses.fields(ProcessorState)]
jax.tree_util.register_dataclass(ProcessorState, data_fields=_FIELDS, meta_fields=[])


def check_limits(limits: "ProcessorLimits | None") -> ProcessorLimits:
    """``limits`` (None: the defaults), or ValueError naming ``processor_limits``."""
    if limits is None:
        return ProcessorLimits()
    if not isinstance(limits, ProcessorLimits) or any(
            isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in limits):
        raise ValueError(f"processor_limits must be a ProcessorLimits of ints >= 0, got {limits!r}")
    return limits


def check_request(name: str, rp: RequestProcessing, limits: ProcessorLimits, vocab_size: int,
                  num_processors: int) -> None:
    """ValueError naming ``name.<field>`` when ``rp`` does not fit ``limits`` / the vocabulary."""
    if rp.logit_bias is not None and len(rp.logit_bias) > limits.max_logit_bias:
        raise ValueError(f"{name}.logit_bias has {len(rp.logit_bias)} entries; the engine's "
                         f"max_logit_bias is {limits.max_logit_bias}")
    for t in (rp.logit_bias or {}):
        if not 0 <= t < vocab_size:
            raise ValueError(f"{name}.logit_bias key {t} is outside the vocabulary [0, {vocab_size})")
    if len(rp.bad_words) > limits.max_bad_words:
        raise ValueError(f"{name}.bad_words has {len(rp.bad_words)} words; the engine's "
                         f"max_bad_words is {limits.max_bad_words}")
    for i, w in enumerate(rp.bad_words):
        if len(w) > limits.max_bad_word_len:
            raise ValueError(f"{name}.bad_words[{i}] has {len(w)} tokens; the engine's "
                             f"max_bad_word_len is {limits.max_bad_word_len}")
        if any(not 0 <= t < vocab_size for t in w):
            raise ValueError(f"{name}.bad_words[{i}] holds a token outside [0, {vocab_size})")
    if rp.allowed_token_ids is not None:
        if len(rp.allowed_token_ids) > limits.max_allowed_token_ids:
            raise ValueError(f"{name}.allowed_token_ids has {len(rp.allowed_token_ids)} ids; the "
                             f"engine's max_allowed_token_ids is {limits.max_allowed_token_ids}")
        if any(not 0 <= t < vocab_size for t in rp.allowed_token_ids):
            raise ValueError(f"{name}.allowed_token_ids holds a token outside [0, {vocab_size})")
    if rp.min_tokens and len(rp.stop_ids) > limits.max_stop_ids:
        raise ValueError(f"{name}.min_tokens suppresses {len(rp.stop_ids)} stop ids (EOS "
                         f"included); the engine's max_stop_ids is {limits.max_stop_ids}")
    if rp.processor >= num_processors:
        raise ValueError(f"{name}.logits_processor={rp.processor}: only {num_processors} "
                         f"logits_processors were given (allowed: -1 .. {num_processors - 1})")
    if len(rp.processor_params) > limits.num_processor_params:
        raise ValueError(f"{name}.logits_processor_params has {len(rp.processor_params)} values; "
                         f"the engine's num_processor_params is {limits.num_processor_params}")


def make_processor_state(requests: Sequence[RequestProcessing], histories: Sequence[Sequence[int]],
                         num_prompt: Sequence[int], *, num_reqs_pad: int, max_len: int,
                         limits: ProcessorLimits = ProcessorLimits()) -> ProcessorState:
    """The host (NumPy) :class:`ProcessorState` of ``n`` requests padded to ``num_reqs_pad``
    rows, from each request's committed tokens (``histories[i]``, at most ``max_len``) and
    prompt length."""
    n, b, lim = len(requests), int(num_reqs_pad), limits
    if n > b or len(histories) != n or len(num_prompt) != n:
        raise ValueError(f"requests ({n}), histories ({len(histories)}) and num_prompt "
                         f"({len(num_prompt)}) must match and fit num_reqs_pad={b}")
    tok = np.zeros((b, max_len), _I32)
    nt = np.zeros(b, _I32)
    npr = np.zeros(b, _I32)
    f = lambda fill, dt=np.float32: np.full(b, fill, dt)  # noqa: E731
    pres, freq, rep, minp = f(0.0), f(0.0), f(1.0), f(0.0)
    bids = np.full((b, lim.max_logit_bias), -1, _I32)
    bvals = np.zeros((b, lim.max_logit_bias), np.float32)
    bw = np.full((b, lim.max_bad_words, lim.max_bad_word_len), -1, _I32)
    bl = np.zeros((b, lim.max_bad_words), _I32)
    al = np.full((b, lim.max_allowed_token_ids), -1, _I32)
    use_al = np.zeros(b, np.bool_)
    mint = np.zeros(b, _I32)
    stops = np.full((b, lim.max_stop_ids), -1, _I32)
    sel = np.full(b, -1, _I32)
    par = np.zeros((b, lim.num_processor_params), np.float32)
    for i, (rp, h) in enumerate(zip(requests, histories)):
        if len(h) > max_len:
            raise ValueError(f"histories[{i}] has {len(h)} tokens, more than max_len={max_len}")
        tok[i, : len(h)] = h
        nt[i], npr[i] = len(h), num_prompt[i]
        pres[i], freq[i], rep[i], minp[i] = (rp.presence_penalty, rp.frequency_penalty,
                                             rp.repetition_penalty, rp.min_p)
        for j, (t, v) in enumerate((rp.logit_bias or {}).items()):
            bids[i, j], bvals[i, j] = t, v
        for j, w in enumerate(rp.bad_words):
            bw[i, j, : len(w)] = w
            bl[i, j] = len(w)
        if rp.allowed_token_ids is not None:
            use_al[i] = True
            al[i, : len(rp.allowed_token_ids)] = rp.allowed_token_ids
        mint[i] = rp.min_tokens
        stops[i, : len(rp.stop_ids)] = list(rp.stop_ids)
        sel[i] = rp.processor
        par[i, : len(rp.processor_params)] = rp.processor_params
    return ProcessorState(tok, nt, npr, pres, freq, rep, minp, bids, bvals, bw, bl, al, use_al,
                          mint, stops, sel, par)


def _row_mask(ids: jax.Array, v: int) -> jax.Array:
    """``[B, N]`` ids (-1 pad) -> ``[B, V] bool``, True at every listed id."""
    b = ids.shape[0]
    rows = jnp.broadcast_to(jnp.arange(b)[:, None], ids.shape)
    return jnp.zeros((b, v), bool).at[rows, jnp.clip(ids, 0, v - 1)].max(ids >= 0)


def _bad_words_ban(st: ProcessorState, prefix: jax.Array, plen: jax.Array, v: int) -> jax.Array:
    """``[B, T, V] bool``: tokens the bad words ban at each position."""
    b, t = plen.shape
    nw, wl = st.bad_words.shape[1:]
    d = prefix.shape[2]
    L = st.token_ids.shape[1]
    nt = st.num_tokens[:, None, None]
    m = jnp.arange(max(wl - 1, 0), dtype=jnp.int32)            # offset from the end
    a = nt + plen[:, :, None] - 1 - m                            # [B, T, WL-1] absolute index
    from_prefix = a >= nt
    ptok = jnp.take_along_axis(prefix, jnp.clip(a - nt, 0, max(d - 1, 0)), axis=2) if d else \
        jnp.zeros(a.shape, jnp.int32)
    htok = jnp.take_along_axis(jnp.broadcast_to(st.token_ids[:, None, :], (b, t, L)),
                               jnp.clip(a, 0, L - 1), axis=2)
    tail = jnp.where(a >= st.num_prompt[:, None, None], jnp.where(from_prefix, ptok, htok), -2)
    lw = st.bad_lens                                             # [B, NW]
    e_idx = lw[..., None] - 2 - m                                # [B, NW, WL-1]
    expected = jnp.take_along_axis(st.bad_words, jnp.clip(e_idx, 0, wl - 1), axis=2)
    need = m[None, None, :] < (lw - 1)[..., None]
    ok = ~need[:, None] | (tail[:, :, None, :] == expected[:, None])   # [B, T, NW, WL-1]
    match = jnp.all(ok, axis=-1) & (lw > 0)[:, None, :]          # [B, T, NW]
    last = jnp.take_along_axis(st.bad_words, jnp.clip(lw - 1, 0, wl - 1)[..., None], axis=2)[..., 0]
    bi = jnp.broadcast_to(jnp.arange(b)[:, None, None], match.shape)
    ti = jnp.broadcast_to(jnp.arange(t)[None, :, None], match.shape)
    li = jnp.broadcast_to(jnp.clip(last, 0, v - 1)[:, None, :], match.shape)
    return jnp.zeros((b, t, v), bool).at[bi, ti, li].max(match)


def _context_tokens(st: ProcessorState, prefix: jax.Array, plen: jax.Array) -> jax.Array:
    """``[B, T, L]``: each position's tokens (committed, then its prefix drafts)."""
    b, t = plen.shape
    L, d = st.token_ids.shape[1], prefix.shape[2]
    idx = jnp.arange(L, dtype=jnp.int32)[None, None, :]
    rel = idx - st.num_tokens[:, None, None]
    hist = jnp.broadcast_to(st.token_ids[:, None, :], (b, t, L))
    if not d:
        return hist
    pt = jnp.take_along_axis(prefix, jnp.clip(rel, 0, d - 1), axis=2)
    return jnp.where((rel >= 0) & (rel < plen[:, :, None]), pt, hist)


def apply_processors(logits: jax.Array, st: ProcessorState, prefix_tokens: jax.Array | None = None,
                     prefix_len: jax.Array | None = None,
                     processors: tuple[LogitsProcessor, ...] = ()) -> jax.Array:
    """Steps 1-6 on ``logits [B, T, V]`` float32 -> ``[B, T, V] float32``; ``prefix_tokens
    [B, T, D] int32`` / ``prefix_len [B, T] int32``: the drafts before each position."""
    logits = logits.astype(jnp.float32)
    b, t, v = logits.shape
    if prefix_tokens is None:
        prefix_tokens = jnp.zeros((b, t, 0), jnp.int32)
        prefix_len = jnp.zeros((b, t), jnp.int32)
    prefix_tokens = prefix_tokens.astype(jnp.int32)
    prefix_len = prefix_len.astype(jnp.int32)
    d = prefix_tokens.shape[2]
    # 1. allowed_token_ids
    if st.allowed.shape[1]:
        allowed = _row_mask(st.allowed, v)
        logits = jnp.where(st.use_allowed[:, None, None] & ~allowed[:, None, :], _NEG, logits)
    # 2. bad words
    if st.bad_words.shape[1] and st.bad_words.shape[2]:
        logits = jnp.where(_bad_words_ban(st, prefix_tokens, prefix_len, v), _NEG, logits)
    # 3. min_tokens
    if st.stop_ids.shape[1]:
        n_out = (st.num_tokens - st.num_prompt)[:, None] + prefix_len       # [B, T]
        early = n_out < st.min_tokens[:, None]
        stop = _row_mask(st.stop_ids, v)
        logits = jnp.where(early[:, :, None] & stop[:, None, :], _NEG, logits)
    # 4. logit_bias
    if st.bias_ids.shape[1]:
        rows = jnp.broadcast_to(jnp.arange(b)[:, None], st.bias_ids.shape)
        bias = jnp.zeros((b, v), jnp.float32).at[rows, jnp.clip(st.bias_ids, 0, v - 1)].add(
            jnp.where(st.bias_ids >= 0, st.bias_vals, 0.0))
        logits = logits + bias[:, None, :]
    # 5. user processors
    if processors:
        ctx_tok = _context_tokens(st, prefix_tokens, prefix_len).reshape(b * t, st.token_ids.shape[1])
        ctx = (ctx_tok, (st.num_tokens[:, None] + prefix_len).reshape(-1), prefix_len.reshape(-1))
        flat = logits.reshape(b * t, v)
        par = jnp.repeat(st.params, t, axis=0)
        sel = jnp.repeat(st.selector, t)
        out = flat
        for i, fn in enumerate(processors):
            out = jnp.where((sel == i)[:, None], fn(flat, par, ctx).astype(jnp.float32), out)
        logits = out.reshape(b, t, v)
    # 6. penalties
    L = st.token_ids.shape[1]
    idx = jnp.arange(L, dtype=jnp.int32)[None, :]
    rows = jnp.broadcast_to(jnp.arange(b)[:, None], (b, L))
    in_out = (idx >= st.num_prompt[:, None]) & (idx < st.num_tokens[:, None])
    in_prompt = idx < jnp.minimum(st.num_prompt, st.num_tokens)[:, None]
    base = jnp.zeros((b, v), jnp.float32).at[rows, st.token_ids].add(in_out.astype(jnp.float32))
    prompt_mask = jnp.zeros((b, v), bool).at[rows, st.token_ids].max(in_prompt)
    counts = jnp.broadcast_to(base[:, None, :], (b, t, v))
    if d:
        shp = (b, t, d)
        bi = jnp.broadcast_to(jnp.arange(b)[:, None, None], shp)
        ti = jnp.broadcast_to(jnp.arange(t)[None, :, None], shp)
        use = jnp.arange(d)[None, None, :] < prefix_len[:, :, None]
        counts = counts.at[bi, ti, jnp.clip(prefix_tokens, 0, v - 1)].add(use.astype(jnp.float32))
    out_mask = counts > 0
    rep = jnp.where(prompt_mask[:, None, :] | out_mask, st.repetition[:, None, None], 1.0)
    logits = jnp.where(logits > 0, logits / rep, logits * rep)
    logits = logits - st.frequency[:, None, None] * counts
    return logits - st.presence[:, None, None] * out_mask.astype(jnp.float32)


def apply_min_p(logits: jax.Array, min_p: jax.Array) -> jax.Array:
    """vLLM's ``MinPLogitsProcessor`` on ``[..., V]`` logits: probability below ``min_p *
    max_prob`` -> ``-inf`` (``min_p [...]``; 0 keeps all)."""
    probs = jax.nn.softmax(logits, axis=-1)
    thr = min_p[..., None] * jnp.max(probs, axis=-1, keepdims=True)
    return jnp.where(probs < thr, _NEG, logits)

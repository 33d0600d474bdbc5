"""Sampling metadata and logits processing (vLLM ``sampling_metadata.py`` and the
``rejection_sampler.py`` helpers): per-request temperature, top-k, top-p, min-p and PRNG
keys, and :func:`process_logits`, the distribution every verified position samples from.

Row r draws only from ``keys[r]`` (folded with a stream id and the position), so a seeded
request's tokens do not depend on the batch. Uniforms are float32 (vLLM: float64).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax.sampling.logits_processors import ProcessorState, apply_min_p, apply_processors

PLACEHOLDER_TOKEN_ID = -1
GREEDY_TEMPERATURE = 0.0
MAX_SPEC_LEN = 128

# Stream ids folded into a request's key, one per use of randomness.
_STREAM_ACCEPT, _STREAM_RECOVER, _STREAM_BONUS = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class SamplingMetadata:
    """Per-request sampling parameters, ``[B_pad]`` each (a pytree): temperature float32 (0:
    greedy), top_k int32 (0 or >= vocab: off), top_p float32 in (0, 1] (1: off), keys
    ``[B_pad, 2] uint32`` raw PRNG keys, procs a ``ProcessorState`` or None; static
    ``all_greedy`` (skips the random path) and ``processors`` (user logits processors).
    """

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    keys: jax.Array
    procs: ProcessorState | None = None
    all_greedy: bool = False
    processors: tuple = ()

    @classmethod
    def create(cls, temperature, top_k=None, top_p=None, seeds=None, *, step: int = 0
               ) -> "SamplingMetadata":
        """Build on the host. ``seeds``: one int per request (None draws from 0..B-1);
        ``step`` is folded into each key so successive steps differ."""
        import numpy as np

        t = np.asarray(temperature, np.float32)
        if t.ndim != 1:
            raise ValueError(f"temperature must be [B], got shape {t.shape}")
        if (t < 0).any() or not np.isfinite(t).all():
            raise ValueError("temperature must be finite and >= 0 (0 means greedy)")
        b = t.shape[0]
        k = np.zeros(b, np.int32) if top_k is None else np.asarray(top_k, np.int32)
        p = np.ones(b, np.float32) if top_p is None else np.asarray(top_p, np.float32)
        if k.shape != (b,) or (k < 0).any():
            raise ValueError(f"top_k must be [B={b}] ints >= 0 (0 disables), got {k!r}")
        if p.shape != (b,) or (p <= 0).any() or (p > 1).any():
            raise ValueError(f"top_p must be [B={b}] values in (0, 1], got {p!r}")
        s = np.arange(b) if seeds is None else np.asarray(seeds, np.int64)
        if s.shape != (b,):
            raise ValueError(f"seeds must hold one int per request ({b}), got shape {s.shape}")
        keys = jax.vmap(lambda sd: jax.random.key_data(
            jax.random.fold_in(jax.random.key(sd), step)))(jnp.asarray(s % 2**31, jnp.uint32))
        return cls(jnp.asarray(t), jnp.asarray(k), jnp.asarray(p), keys,
                   all_greedy=bool((t == GREEDY_TEMPERATURE).all()))


jax.tree_util.register_dataclass(
    SamplingMetadata, data_fields=["temperature", "top_k", "top_p", "keys", "procs"],
    meta_fields=["all_greedy", "processors"])


@dataclasses.dataclass(frozen=True)
class SamplingState:
    """Per-request sampling state the device decode loop carries, ``[B_pad]`` each (a
    pytree): temperature / top_k / top_p as :class:`SamplingMetadata`'s, seeds uint32,
    counters int32 (tokens generated; a step's key is ``fold_in(key(seed), counter)``, the
    per-step rule) and procs (a ``ProcessorState`` or None).
    """

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    seeds: jax.Array
    counters: jax.Array
    procs: ProcessorState | None = None

    def metadata(self, all_greedy: bool, processors: tuple = ()) -> "SamplingMetadata":
        """This step's ``SamplingMetadata`` (traceable)."""
        keys = jax.vmap(lambda s, c: jax.random.key_data(
            jax.random.fold_in(jax.random.key(s), c)))(self.seeds, self.counters)
        return SamplingMetadata(self.temperature, self.top_k, self.top_p, keys, self.procs,
                                all_greedy=all_greedy, processors=processors)

    def advance(self, num_emitted: jax.Array, emitted: jax.Array | None = None
                ) -> "SamplingState":
        """After a step that emitted ``emitted [B, k+1]`` (-1 padded), ``num_emitted [B]``."""
        n = num_emitted.astype(jnp.int32)
        procs = self.procs
        if procs is not None:
            w = procs.token_ids.shape[1]
            jj = jnp.arange(emitted.shape[1], dtype=jnp.int32)[None, :]
            col = jnp.where(jj < n[:, None], procs.num_tokens[:, None] + jj, w)
            rows = jnp.broadcast_to(jnp.arange(n.shape[0], dtype=jnp.int32)[:, None], col.shape)
            procs = dataclasses.replace(
                procs, token_ids=procs.token_ids.at[rows, col].set(emitted, mode="drop"),
                num_tokens=procs.num_tokens + n)
        return dataclasses.replace(self, counters=self.counters + n, procs=procs)


jax.tree_util.register_dataclass(
    SamplingState, data_fields=["temperature", "top_k", "top_p", "seeds", "counters", "procs"],
    meta_fields=[])


def apply_top_k_top_p(logits: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Mask ``logits [..., V]`` float32 outside the top-k (ties kept), then the smallest
    top-p prefix (at least one token), to ``-inf``; ``top_k``, ``top_p``: ``[...]``."""
    v = logits.shape[-1]
    srt = jnp.sort(logits, axis=-1)[..., ::-1]                       # descending
    k = jnp.where((top_k <= 0) | (top_k >= v), v, top_k)
    kth = jnp.take_along_axis(srt, (k - 1)[..., None], axis=-1)
    logits = jnp.where(logits < kth, -jnp.inf, logits)
    srt = jnp.where(jnp.arange(v) < k[..., None], srt, -jnp.inf)
    probs = jax.nn.softmax(srt, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs                  # mass of strictly larger
    keep_sorted = (mass_before < top_p[..., None]) | (jnp.arange(v) == 0)
    # threshold: smallest kept sorted value
    n_keep = keep_sorted.sum(axis=-1)
    thr = jnp.take_along_axis(srt, (n_keep - 1)[..., None], axis=-1)
    use_p = (top_p < 1.0)[..., None]
    return jnp.where(use_p & (logits < thr), -jnp.inf, logits)


def _process(logits: jax.Array, temperature, top_k, top_p, min_p=None) -> jax.Array:
    """Temperature, then min_p (when given), then top-k/top-p; greedy rows (temperature 0)
    are divided by 1."""
    t = jnp.where(temperature == GREEDY_TEMPERATURE, 1.0, temperature)
    logits = logits / t[..., None]
    if min_p is not None:
        logits = apply_min_p(logits, min_p)
    return apply_top_k_top_p(logits, top_k, top_p)


def _pre(logits: jax.Array, sampling: SamplingMetadata, prefix_tokens=None, prefix_len=None
         ) -> jax.Array:
    """``logits [B, T, V]`` through the logits processors (float32): greedy's argmax input."""
    logits = logits.astype(jnp.float32)
    if sampling.procs is None:
        return logits
    return apply_processors(logits, sampling.procs, prefix_tokens, prefix_len, sampling.processors)


def _post(logits: jax.Array, sampling: SamplingMetadata) -> jax.Array:
    """``[B, T, V]`` processed logits -> temperature, min_p, top-k / top-p."""
    col = lambda x: x[:, None]  # noqa: E731
    min_p = None if sampling.procs is None else col(sampling.procs.min_p)
    return _process(logits, col(sampling.temperature), col(sampling.top_k), col(sampling.top_p),
                    min_p)


def process_logits(logits: jax.Array, sampling: SamplingMetadata,
                   prefix_tokens: jax.Array | None = None, prefix_len: jax.Array | None = None
                   ) -> jax.Array:
    """The fully processed logits the rejection and bonus samplers draw from: processors,
    temperature (greedy rows: 1), min_p, top-k / top-p. ``logits [B, V]`` or ``[B, T, V]``;
    ``prefix_tokens [B, T, D]`` / ``prefix_len [B, T]`` int32: the drafts before each
    position (None: none). Returns float32 of ``logits``' shape.
    """
    squeeze = logits.ndim == 2
    x = logits[:, None] if squeeze else logits
    if squeeze and prefix_tokens is not None and prefix_tokens.ndim == 2:
        prefix_tokens, prefix_len = prefix_tokens[:, None], jnp.reshape(prefix_len, (-1, 1))
    out = _post(_pre(x, sampling, prefix_tokens, prefix_len), sampling)
    return out[:, 0] if squeeze else out


def _keys(keys: jax.Array, stream: int, pos: jax.Array | int):
    """``[B, 2]`` raw keys -> typed keys folded with a stream and a position."""
    k = jax.random.wrap_key_data(keys)
    k = jax.vmap(lambda kk: jax.random.fold_in(kk, stream))(k)
    return jax.vmap(lambda kk: jax.random.fold_in(kk, pos))(k) if isinstance(pos, int) else \
        jax.vmap(lambda kk: jax.vmap(lambda p: jax.random.fold_in(kk, p))(pos))(k)

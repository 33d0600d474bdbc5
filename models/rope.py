"""Rotary position embedding, rotate-half ("neox") layout, as HF Llama/Qwen compute it.

RoPE types (transformers' ``modeling_rope_utils.py``): ``default``, ``linear``, ``llama3``,
``yarn`` (static ``inv_freq`` + ``attention_factor``), ``longrope`` (short / long factors)
and ``dynamic`` (NTK base growing with the sequence length). :func:`cos_sin_for` is the
entry point of every model: ``cos``/``sin`` in float32, computed once per forward, shared
by every layer and multiplied by the attention factor (as HF's ``attention_scaling``).

Sequence-length rule (``longrope``, ``dynamic``): transformers picks by ``seq_len =
max(position_ids) + 1`` of the whole forward. specjax decides on device, per request: a
token's ``seq_len`` is ``1 + max`` position of *its request* in this step (request
boundaries from ``query_start_loc``), so one request of a step gets exactly HF's value
for the same forward; without ``query_start_loc`` (DFlash's context K write) it is the
token's own ``position + 1``. Documented differences: docs/models.md "RoPE types".
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

#: Types whose frequencies depend on the current sequence length (not a host constant).
SEQ_LEN_TYPES = ("longrope", "dynamic")


class RopeTables(NamedTuple):
    """Host constants of one config's RoPE (float32 ``[head_dim // 2]`` frequencies)."""

    rope_type: str
    freq: np.ndarray              # the (short, for longrope) inverse frequencies
    long_freq: np.ndarray | None  # longrope: the long factors' frequencies
    attention_factor: float       # HF ``attention_scaling``: cos and sin are multiplied by it
    original_max: int             # longrope: long factors when seq_len > this; dynamic: L
    factor: float                 # dynamic: the NTK factor
    theta: float
    head_dim: int


def _exponent(head_dim: int) -> np.ndarray:
    return (np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32)
            / np.float32(head_dim)).astype(np.float32)


def _default(head_dim: int, theta: float) -> np.ndarray:
    return (1.0 / (np.float32(theta) ** _exponent(head_dim))).astype(np.float32)


def yarn_get_mscale(scale: float = 1.0, mscale: float = 1.0) -> float:
    """YaRN's Eq. 21, ``0.1 * mscale * log(scale) + 1`` (1 for ``scale <= 1``)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(head_dim: int, theta: float, d: dict) -> tuple[np.ndarray, float]:
    factor = float(d["factor"])
    old_len = float(d["original_max_position_embeddings"])
    att = d.get("attention_factor")
    if att is None:
        ms, ms_all = d.get("mscale"), d.get("mscale_all_dim")
        att = (yarn_get_mscale(factor, ms) / yarn_get_mscale(factor, ms_all) if ms and ms_all
               else yarn_get_mscale(factor))
    beta_fast = d.get("beta_fast") or 32
    beta_slow = d.get("beta_slow") or 1
    dim = head_dim

    def corr_dim(n_rot):
        return (dim * math.log(old_len / (n_rot * 2 * math.pi))) / (2 * math.log(theta))

    low, high = corr_dim(beta_fast), corr_dim(beta_slow)
    if d.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001                                # HF: prevent the singularity
    pos_freqs = (np.float32(theta) ** _exponent(dim)).astype(np.float32)
    extra = (1.0 / pos_freqs).astype(np.float32)
    inter = (1.0 / (np.float32(factor) * pos_freqs)).astype(np.float32)
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low))
                   / np.float32(high - low), 0, 1).astype(np.float32)
    keep = (1 - ramp).astype(np.float32)             # HF's inv_freq_extrapolation_factor
    return (inter * (1 - keep) + extra * keep).astype(np.float32), float(att)


def _llama3(freq: np.ndarray, d: dict) -> np.ndarray:
    factor = float(d["factor"])
    low = float(d["low_freq_factor"])
    high = float(d["high_freq_factor"])
    old_len = float(d["original_max_position_embeddings"])
    low_wavelen = old_len / low
    high_wavelen = old_len / high
    wavelen = (2 * math.pi / freq).astype(np.float32)
    scaled = np.where(wavelen > low_wavelen, freq / factor, freq).astype(np.float32)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


@functools.lru_cache(maxsize=64)
def tables(head_dim: int, theta: float, rope_scaling: tuple | None,
           max_position_embeddings: int = 2048) -> RopeTables:
    """The config's RoPE constants (``rope_scaling``: ModelConfig's frozen tuple)."""
    d = dict(rope_scaling) if rope_scaling else {}
    rtype = d.get("rope_type", d.get("type", "default")) or "default"
    base = _default(head_dim, theta)
    kw = dict(long_freq=None, attention_factor=1.0, original_max=int(max_position_embeddings),
              factor=1.0, theta=float(theta), head_dim=int(head_dim))
    if rtype == "default":
        return RopeTables(rtype, base, **kw)
    if rtype == "linear":
        return RopeTables(rtype, (base / np.float32(d["factor"])).astype(np.float32), **kw)
    if rtype == "llama3":
        return RopeTables(rtype, _llama3(base, d), **kw)
    if rtype == "yarn":
        freq, kw["attention_factor"] = _yarn(head_dim, theta, d)
        return RopeTables(rtype, freq, **kw)
    if rtype == "longrope":
        old = int(d["original_max_position_embeddings"])
        factor = d.get("factor")
        factor = max_position_embeddings / old if factor is None else float(factor)
        att = d.get("attention_factor")
        if att is None:
            att = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(old))
        power = (np.float32(theta) ** _exponent(head_dim)).astype(np.float32)
        short, long_ = (np.asarray(d[k], np.float32) for k in ("short_factor", "long_factor"))
        for name, f in (("short_factor", short), ("long_factor", long_)):
            if f.shape != (head_dim // 2,):
                raise ValueError(f"rope_scaling.{name} must hold head_dim/2={head_dim // 2} "
                                 f"numbers, got {f.size}")
        kw.update(long_freq=(1.0 / (long_ * power)).astype(np.float32), attention_factor=float(att),
                  original_max=old)
        return RopeTables(rtype, (1.0 / (short * power)).astype(np.float32), **kw)
    if rtype == "dynamic":
        kw["factor"] = float(d["factor"])
        return RopeTables(rtype, base, **kw)
    raise ValueError(f"rope_scaling.rope_type must be one of ('default', 'linear', 'llama3', "
                     f"'yarn', 'longrope', 'dynamic'), got {rtype!r}")


def inv_freq(head_dim: int, theta: float, rope_scaling: tuple | None) -> np.ndarray:
    """``[head_dim // 2] float32`` inverse frequencies of a type with no attention factor
    and no sequence-length dependence (``default``, ``linear``, ``llama3``); the others
    raise ValueError by name (use :func:`cos_sin_for`)."""
    t = tables(head_dim, theta, rope_scaling)
    if t.rope_type in SEQ_LEN_TYPES or t.attention_factor != 1.0:
        raise ValueError(f"rope_type {t.rope_type!r} needs rope.cos_sin_for (sequence-length "
                         "dependent frequencies or an attention factor)")
    return t.freq


def request_seq_lens(positions: jax.Array, query_start_loc: jax.Array | None) -> jax.Array:
    """``[T] int32``: each token's HF ``seq_len``: ``1 + max`` position of its request in
    this step (requests from ``query_start_loc [B_pad + 1]``; tokens past the last request
    form one more segment), or ``position + 1`` without ``query_start_loc``."""
    positions = positions.astype(jnp.int32)
    if query_start_loc is None:
        return positions + 1
    req = jnp.searchsorted(query_start_loc[1:], jnp.arange(positions.shape[0]), side="right")
    seg_max = jax.ops.segment_max(positions, req, num_segments=query_start_loc.shape[0])
    return seg_max[req] + 1


def _freqs(t: RopeTables, positions: jax.Array, query_start_loc) -> jax.Array:
    """``[T, head_dim // 2]`` or ``[head_dim // 2]`` float32 frequencies for ``positions``."""
    if t.rope_type == "longrope":
        s = request_seq_lens(positions, query_start_loc)
        return jnp.where((s > t.original_max)[:, None], jnp.asarray(t.long_freq)[None, :],
                         jnp.asarray(t.freq)[None, :])
    if t.rope_type == "dynamic":
        s = jnp.maximum(request_seq_lens(positions, query_start_loc), t.original_max)
        dim = t.head_dim
        base = jnp.float32(t.theta) * (
            (jnp.float32(t.factor) * s.astype(jnp.float32) / jnp.float32(t.original_max))
            - jnp.float32(t.factor - 1)) ** jnp.float32(dim / (dim - 2))
        return 1.0 / (base[:, None] ** jnp.asarray(_exponent(dim))[None, :])
    return jnp.asarray(t.freq)


def cos_sin_for(config, positions: jax.Array, query_start_loc: jax.Array | None = None
                ) -> tuple[jax.Array, jax.Array]:
    """``positions [T] int32`` -> ``(cos, sin)``, each ``[T, head_dim] float32``, for a
    ``ModelConfig`` (its ``rope_scaling`` and ``max_position_embeddings``), scaled by the
    attention factor; ``query_start_loc``: the step's request boundaries (longrope /
    dynamic, see the module docstring)."""
    c = config
    t = tables(c.head_dim, c.rope_theta, c.rope_scaling, c.max_position_embeddings)
    freq = _freqs(t, positions, query_start_loc)
    angles = positions.astype(jnp.float32)[:, None] * (freq if freq.ndim == 2 else freq[None, :])
    emb = jnp.concatenate([angles, angles], axis=-1)
    cos, sin = jnp.cos(emb), jnp.sin(emb)
    if t.attention_factor != 1.0:
        cos, sin = cos * jnp.float32(t.attention_factor), sin * jnp.float32(t.attention_factor)
    return cos, sin


def cos_sin(positions: jax.Array, freq: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """``positions [T] int32`` -> ``(cos, sin)``, each ``[T, head_dim] float32``."""
    angles = positions.astype(jnp.float32)[:, None] * jnp.asarray(freq)[None, :]
    emb = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """``x [T, n, head_dim]`` rotated by ``cos``/``sin [T, head_dim]``; keeps ``x.dtype``."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    c = cos[:, None, :].astype(x.dtype)
    s = sin[:, None, :].astype(x.dtype)
    return x * c + rotated * s

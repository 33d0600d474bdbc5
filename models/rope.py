"""Rotary position embedding, rotate-half ("neox") layout, as HF Llama/Qwen compute it.

``inv_freq`` is a host constant of the config (float32, built the way HF builds it, with
the llama3 / linear scalings); ``cos``/``sin`` are computed in float32 once per forward
and shared by every layer.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np


@functools.lru_cache(maxsize=64)
def inv_freq(head_dim: int, theta: float, rope_scaling: tuple | None) -> np.ndarray:
    """``[head_dim // 2] float32`` inverse frequencies, with the config's scaling applied."""
    exponent = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    freq = (1.0 / (np.float32(theta) ** exponent)).astype(np.float32)
    d = dict(rope_scaling) if rope_scaling else {}
    rtype = d.get("rope_type", d.get("type", "default"))
    if rtype in (None, "default"):
        return freq
    if rtype == "linear":
        return (freq / np.float32(d["factor"])).astype(np.float32)
    if rtype == "llama3":
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
    raise ValueError(f"rope_scaling.rope_type must be one of ('default', 'linear', 'llama3'), got {rtype!r}")


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

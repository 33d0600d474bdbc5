"""Logprobs of the emitted tokens and the top-n, as vLLM's ``RejectionSampler`` returns them.

Each emitted token's distribution is the one it was verified or sampled at (a tree: its
parent's slot on the accepted path); values per ``logprobs_mode`` (vLLM's four). Layout
(:class:`Logprobs`, ``S`` sampled columns, ``n`` the static top-n bucket):
``logprob_token_ids [B, S, n + 1] int32`` (column 0 the emitted token, then the top-n),
``logprobs [B, S, n + 1] float32``, ``selected_token_ranks [B, S] int32`` (1: the most
likely). A slot without an emitted token is padding: ids -1, values ``-inf``, rank -1.
``num_logprobs=None`` (static) traces nothing. Details: docs/sampling.md, "Logprobs".
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax.checks import ArgumentError, check_choice, check_int
# (defined in specjax.constants so that the command line reads them without importing JAX)
from specjax.constants import DEFAULT_LOGPROBS_MODE, LOGPROBS_MODES, MAX_LOGPROBS

__all__ = ["LOGPROBS_MODES", "DEFAULT_LOGPROBS_MODE", "MAX_LOGPROBS", "Logprob", "Logprobs",
           "check_num_logprobs", "check_logprobs_mode", "logprobs_bucket", "gather_logprobs",
           "chain_logprobs", "tree_logprobs", "mask_slots", "request_logprobs"]

#: Compiled top-n buckets (a request's ``n`` is served by the smallest bucket >= n).
_BUCKETS = (0, 1, 2, 4, 8, 16, 20)


class Logprob(NamedTuple):
    """One entry of a position's dict (vLLM's ``Logprob`` without the decoded text)."""

    logprob: float
    rank: int


class Logprobs(NamedTuple):
    """Device logprobs of one step (see the module docstring for the layout)."""

    logprob_token_ids: Any
    logprobs: Any
    selected_token_ranks: Any


def check_num_logprobs(name: str, value: Any) -> int | None:
    """A request's ``logprobs``: None (off) or an int in ``0..MAX_LOGPROBS`` (vLLM's ``-1``
    is refused, as vLLM refuses it above its default ``max_logprobs``)."""
    if value is None:
        return None
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value == -1:
        raise ArgumentError(f"{name}=-1 asks for the whole vocabulary (vLLM's meaning), more than "
                            f"max_logprobs={MAX_LOGPROBS}; use None (off) or an int in "
                            f"[0, {MAX_LOGPROBS}]")
    return check_int(name, value, 0, MAX_LOGPROBS, why="None turns logprobs off")


def check_logprobs_mode(value: Any) -> str:
    """``logprobs_mode`` is one of :data:`LOGPROBS_MODES`."""
    return check_choice("logprobs_mode", value, LOGPROBS_MODES)


def logprobs_bucket(ns: Sequence[int | None]) -> int | None:
    """The static top-n bucket of a batch whose requests ask for ``ns`` (None: off)."""
    want = [int(n) for n in ns if n is not None]
    if not want:
        return None
    m = max(want)
    return next(b for b in _BUCKETS if b >= m)


def _processed_for_logprobs(logits: jax.Array, sampling, emitted: jax.Array | None = None
                            ) -> jax.Array:
    """The processed logits ``[B, S, V]`` verification samples from (greedy rows at
    temperature 1, no top-k / top-p); slot ``i``'s prefix is the first ``i`` tokens of
    ``emitted [B, S]``."""
    import dataclasses

    from specjax.sampling import GREEDY_TEMPERATURE, process_logits

    g = sampling.temperature == GREEDY_TEMPERATURE
    sampling = dataclasses.replace(sampling, top_k=jnp.where(g, 0, sampling.top_k),
                                   top_p=jnp.where(g, 1.0, sampling.top_p))
    if sampling.procs is None or emitted is None:
        return process_logits(logits, sampling)
    b, s = emitted.shape
    tok = jnp.broadcast_to(jnp.maximum(emitted, 0).astype(jnp.int32)[:, None, :], (b, s, s))
    n = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32)[None, :], (b, s))
    return process_logits(logits, sampling, tok, n)


def _values(raw: jax.Array, sampling, mode: str, emitted: jax.Array | None = None) -> jax.Array:
    x = raw.astype(jnp.float32)
    if mode.startswith("processed"):
        x = _processed_for_logprobs(x, sampling, emitted)
    if mode.endswith("logprobs"):
        x = jax.nn.log_softmax(x, axis=-1)
    return x


def gather_logprobs(values: jax.Array, tokens: jax.Array, num_logprobs: int) -> Logprobs:
    """vLLM's ``gather_logprobs`` per slot: ``values [B, S, V]``, ``tokens [B, S]`` (-1:
    padding) -> :class:`Logprobs` with the padding convention."""
    pad = tokens < 0
    tok = jnp.where(pad, 0, tokens).astype(jnp.int32)
    tok_val = jnp.take_along_axis(values, tok[..., None], axis=-1)         # [B, S, 1]
    ranks = jnp.sum(values >= tok_val, axis=-1, dtype=jnp.int32)
    if num_logprobs:
        top_val, top_ids = jax.lax.top_k(values, num_logprobs)
        ids = jnp.concatenate([tok[..., None], top_ids.astype(jnp.int32)], axis=-1)
        vals = jnp.concatenate([tok_val, top_val], axis=-1)
    else:
        ids, vals = tok[..., None], tok_val
    return Logprobs(jnp.where(pad[..., None], -1, ids),
                    jnp.where(pad[..., None], -jnp.inf, vals).astype(jnp.float32),
                    jnp.where(pad, -1, ranks))


def chain_logprobs(metadata, logits: jax.Array, sampling, sampled: jax.Array, *,
                   num_logprobs: int, mode: str) -> Logprobs:
    """Logprobs of a chain step (traceable): ``logits [N_pad + B_pad, V]`` laid out as
    ``rejection_sample`` reads them, ``sampled [B, k+1]`` its output."""
    b, s = sampled.shape
    nd = metadata.num_draft_tokens
    start = metadata.cu_num_sampled_tokens - nd - 1
    rows = jnp.clip(start[:, None] + jnp.arange(s, dtype=jnp.int32)[None, :], 0,
                    logits.shape[0] - 1)
    return gather_logprobs(_values(logits[rows], sampling, mode, sampled), sampled, num_logprobs)


def tree_logprobs(target_logits: jax.Array, accepted_nodes: jax.Array, sampling,
                  sampled: jax.Array, *, num_logprobs: int, mode: str) -> Logprobs:
    """Logprobs of a tree step (traceable): ``target_logits [B, 1 + N, V]``,
    ``accepted_nodes [B, depth]`` (-1 after the path), ``sampled [B, S]``; emitted token
    ``i`` was drawn at path node ``i`` (the root first)."""
    b, s = sampled.shape
    depth = accepted_nodes.shape[1]
    slots = jnp.concatenate([jnp.zeros((b, 1), jnp.int32),
                             1 + jnp.maximum(accepted_nodes, 0).astype(jnp.int32)], axis=1)
    if s > depth + 1:
        slots = jnp.concatenate([slots, jnp.zeros((b, s - depth - 1), jnp.int32)], axis=1)
    rows = jnp.take_along_axis(target_logits, slots[:, :s, None], axis=1)     # [B, S, V]
    return gather_logprobs(_values(rows, sampling, mode, sampled), sampled, num_logprobs)


def mask_slots(lp: Logprobs, keep: jax.Array) -> Logprobs:
    """Padding (the module's convention) wherever ``keep [B, S]`` is False."""
    return Logprobs(jnp.where(keep[..., None], lp.logprob_token_ids, -1),
                    jnp.where(keep[..., None], lp.logprobs, -jnp.inf),
                    jnp.where(keep, lp.selected_token_ranks, -1))


def request_logprobs(lp, row: int, num_tokens: int, n: int, slot0: int = 0
                     ) -> list[dict[int, Logprob]]:
    """Host: ``{token_id: Logprob}`` dicts of request ``row``'s ``num_tokens`` emitted
    tokens from slot ``slot0`` of a fetched :class:`Logprobs`, keeping ``n`` top entries
    (the emitted token, then the top-n; a token in both keeps its top-n entry)."""
    out = []
    for j in range(slot0, slot0 + num_tokens):
        ids = lp.logprob_token_ids[row, j, : n + 1].tolist()
        vals = lp.logprobs[row, j, : n + 1].tolist()
        ranks = [int(lp.selected_token_ranks[row, j])] + list(range(1, n + 1))
        out.append({int(t): Logprob(float(v), r) for t, v, r in zip(ids, vals, ranks)})
    return out

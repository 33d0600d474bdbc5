"""One step's results as one packed device buffer (``StepOutput``): a single device-to-host
copy per step."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from specjax.sampling import PLACEHOLDER_TOKEN_ID

__all__ = ["StepOutput"]


class StepOutput:
    """One step's results: a pytree over ONE packed ``[B, 2k + 3] int32`` array (one
    device-to-host copy; fields are views; ``[B, 3k + 3]`` with ``features``), plus
    ``logprobs``.

    Fields:
      sampled: ``[B, k+1]``, the accepted drafts then the recovered / bonus token, -1 after
        (padding rows all -1). drafts: ``[B, k]``, the next step's drafts (-1 padded; all -1
        for a ``"history"`` proposer), ``num_drafts [B]`` of them valid. num_accepted: ``[B]``.
        features: ``[B, k]`` float32, the drafts' ``DraftOutput.features``, else None.
      logprobs: ``specjax.sampling.logprobs.Logprobs`` (``[B, k+1, n+1]`` ids and values,
        ``[B, k+1]`` ranks) when the batch set ``num_logprobs``, else None.
      accepted_nodes: ``[B, depth] int32`` the accepted path's node indices (-1 past
        ``num_accepted``) from ``VerifyStep`` on a tree batch (a stack compacts its KV with
        them), else None."""

    __slots__ = ("packed", "k", "logprobs", "accepted_nodes")
    _fields = ("sampled", "num_accepted", "drafts", "num_drafts", "logprobs", "accepted_nodes")

    def __init__(self, packed, k: int, logprobs=None, accepted_nodes=None):
        self.packed, self.k, self.logprobs = packed, int(k), logprobs
        self.accepted_nodes = accepted_nodes

    @property
    def sampled(self):
        return self.packed[:, : self.k + 1]

    @property
    def drafts(self):
        return self.packed[:, self.k + 1: 2 * self.k + 1]

    @property
    def num_drafts(self):
        return self.packed[:, 2 * self.k + 1]

    @property
    def num_accepted(self):
        return self.packed[:, 2 * self.k + 2]

    @property
    def features(self):
        if self.packed.shape[1] == 2 * self.k + 3:
            return None
        f = self.packed[:, 2 * self.k + 3:]
        return f.view(np.float32) if isinstance(f, np.ndarray) else \
            jax.lax.bitcast_convert_type(f, jnp.float32)

    def _asdict(self) -> dict:
        return {f: getattr(self, f) for f in self._fields}

    def __repr__(self) -> str:
        return f"StepOutput(k={self.k}, packed={self.packed!r})"


jax.tree_util.register_pytree_node(
    StepOutput, lambda o: ((o.packed, o.logprobs, o.accepted_nodes), o.k),
    lambda k, leaves: StepOutput(leaves[0], k, leaves[1], leaves[2]))


def _output(sampled, drafts=None, num_drafts=None, k: int = 0, lp=None,
            features=None) -> StepOutput:
    """Pack one step's results (one output buffer: one device-to-host copy)."""
    bp = sampled.shape[0]
    n_acc = jnp.maximum(jnp.sum(sampled != PLACEHOLDER_TOKEN_ID, axis=1, dtype=jnp.int32) - 1, 0)
    if drafts is None:
        drafts = jnp.full((bp, k), PLACEHOLDER_TOKEN_ID, jnp.int32)
        num_drafts = jnp.zeros((bp,), jnp.int32)
    packed = jnp.concatenate([sampled.astype(jnp.int32), drafts.astype(jnp.int32),
                              num_drafts.astype(jnp.int32)[:, None], n_acc[:, None]], axis=1)
    return StepOutput(_with_features(packed, features), drafts.shape[1], lp)


def _with_features(packed, features):
    """``packed`` with ``features [B, k]`` float32 bitcast on as int32 columns."""
    if features is None:
        return packed
    return jnp.concatenate([packed, jax.lax.bitcast_convert_type(
        features.astype(jnp.float32), jnp.int32)], axis=1)

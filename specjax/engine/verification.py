"""vLLM's adaptive verification (``enable_adaptive_verification``) on the engine's step loop,
and the step costs per K it and ``adaptive_k`` weigh. docs/adaptive_k.md."""

from __future__ import annotations

import time
from typing import Any, Sequence

import jax
import numpy as np

from specjax.adaptive_k import (estimator_init, estimator_observe, estimator_predict,
                                estimator_refit, rectangle_budget)
from specjax.engine.scheduler import _Request
from specjax.checks import check_int
from specjax.constants import next_power_of_2

__all__ = ["AdaptiveVerifier", "profile_k_costs"]


def profile_k_costs(engine, batch_sizes: Sequence[int], reps: int = 3) -> dict:
    """``engine.k_costs[B][K]`` (K = 0..k): median seconds of a dummy step of bucket B, rows
    of K + 1 tokens, drafting K where the device loop runs (as its calls do); there, under
    ``adaptive_k``, also ``engine.k_token_costs[B][(K, T)]``, the same step in each of
    ``DeviceLoopDriver.token_options(B, K)``'s flat token slots T."""
    sched, opts = engine.scheduler, engine.options
    loop = opts.steps_per_sync > 1 or opts.overlap

    def seconds(batch, dl):
        jax.block_until_ready(engine._run(batch, dl))
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            jax.block_until_ready(engine._run(batch, dl))
            times.append(time.perf_counter() - t)
        return float(np.median(times))

    for n in batch_sizes:
        b = sched.buckets(check_int("batch_sizes[]", n, 1), 1, 1)[0]
        cost = np.zeros(engine.k + 1)
        flat = {}
        for kk in range(engine.k + 1):
            q = sched.buckets(b, kk + 1, 1, kk)[1]
            dl = kk if loop and kk < engine.k else None
            cost[kk] = seconds(sched.dummy_batch(b, q, sched.max_blocks_per_req), dl)
            for t in engine.driver.token_options(b, kk) if loop and opts.adaptive_k else ():
                flat[kk, t] = seconds(sched.dummy_batch(b, q, sched.max_blocks_per_req,
                                                        num_tokens=t), dl)
        engine.k_costs[b] = cost
        if flat:
            engine.k_token_costs[b] = flat
        engine.driver.profiled[b] = (cost, flat or None)
    return engine.k_costs


def _update(st, features, num_accepted, num_verified):
    return estimator_refit(estimator_observe(st, features, num_accepted, num_verified))


_update_jit = jax.jit(_update)
_predict_jit = jax.jit(estimator_predict)


class AdaptiveVerifier:
    """The online estimator's state (on the CPU) and the per-step admission
    (:func:`~specjax.adaptive_k.rectangle_budget` on the drafts' survival). When
    ``proposer.drafts_confidence`` the draft features are already per-draft acceptance
    probabilities (a DSpark confidence head) and replace the estimator, as in vLLM 0.34."""

    def __init__(self, k: int, proposer: Any = None):
        self.k = int(k)
        self.confidence = bool(getattr(proposer, "drafts_confidence", False))
        #: a confidence source's own statistics (suffix decoding's), fed what was verified
        self._observe_hook = getattr(proposer, "observe_verification", None)
        self.cpu = jax.devices("cpu")[0]
        self.state = jax.device_put(estimator_init(self.k), self.cpu)
        #: the K* of each admission so far (what the policy chose, for tests and benchmarks)
        self.history: list[int] = []

    @staticmethod
    def features(out: Any, proposer: Any) -> np.ndarray:
        """The step's ``[B, k]`` draft features (``StepOutput.features`` or a history
        proposer's ``DraftOutput.features``); an error naming the proposer when it gave none."""
        if out.features is None:
            raise RuntimeError(f"enable_adaptive_verification=True: the proposer "
                               f"{type(proposer).__name__} returned no DraftOutput.features")
        return out.features

    def _rows(self, reqs: Sequence[_Request], cols: Any) -> Any:
        """``[B_pad, k]`` float32 features of ``reqs`` (rows past them 0), on the CPU."""
        b = next_power_of_2(max(len(reqs), 1))
        f = np.zeros((b, self.k), np.float32)
        for i, (r, n) in enumerate(zip(reqs, cols)):
            if n:
                f[i, :n] = r.draft_features[:n]
        return jax.device_put(f, self.cpu)

    def admit(self, reqs: Sequence[_Request], n0: int, cost: np.ndarray) -> int:
        """Trim each of ``reqs``' drafts (their ``draft_features`` set) to ``K*`` under the
        step costs ``cost [k + 1]`` (K = 0..k) with ``n0`` requests decoding; returns K*."""
        if not reqs:
            return 0
        nd = np.array([len(r.drafts) for r in reqs])
        rows = self._rows(reqs, nd)
        conf = np.clip(np.asarray(rows), 0.0, 1.0) if self.confidence else \
            np.asarray(_predict_jit(self.state, rows))
        conf = conf[: len(reqs)]
        kk = rectangle_budget(np.cumprod(conf, axis=1), nd, n0, cost)   # survival
        for r in reqs:
            r.drafts, r.k_cap = r.drafts[:kk], min(r.k_cap, kk)
        self.history.append(kk)
        return kk

    def observe(self, reqs: Sequence[_Request], verified: Sequence[int],
                accepted: Sequence[int]) -> None:
        """Fold ``verified[i]`` drafts of ``reqs[i]``, ``accepted[i]`` accepted, in (a
        confidence source that keeps statistics gets them instead of the estimator)."""
        if self.confidence and self._observe_hook is not None:
            self._observe_hook([r.req_id for r in reqs], list(verified), list(accepted))
        if self.confidence or not any(verified):
            return
        b = next_power_of_2(max(len(reqs), 1))
        pad = lambda x: jax.device_put(  # noqa: E731
            np.pad(np.asarray(x, np.int32), (0, b - len(reqs))), self.cpu)
        self.state = _update_jit(self.state, self._rows(reqs, verified), pad(accepted),
                                 pad(verified))

"""Speculative-decoding metrics: the same numbers, log line and Prometheus counters as
vLLM's ``vllm/v1/spec_decode/metrics.py``, so existing dashboards and PromQL keep working.

``SpecDecodingStats``: one engine step's counts (``observe_draft`` per request with
verified drafts); ``SpecDecodingLogging``: accumulates them and logs vLLM's line;
``SpecDecodingProm``: the ``<prefix>spec_decode_*`` counters. Formulas and PromQL:
docs/integration.md, §5.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import Callable, Mapping, Sequence

import numpy as np

logger = logging.getLogger(__name__)

LOG_FORMAT = (
    "SpecDecoding metrics: "
    "Mean acceptance length: %.2f, "
    "Accepted throughput: %.2f tokens/s, "
    "Drafted throughput: %.2f tokens/s, "
    "Accepted: %d tokens, "
    "Drafted: %d tokens, "
    "Per-position acceptance rate: %s, "
    "Avg Draft acceptance rate: %.1f%%"
)


def _check_count(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
    return int(value)


@dataclasses.dataclass
class SpecDecodingStats:
    """Per-step counts: ``num_spec_tokens`` (k), ``num_drafts`` (requests whose drafts were
    verified), ``num_draft_tokens``, ``num_accepted_tokens`` and
    ``num_accepted_tokens_per_pos`` (``[k]``: drafts accepted at position ``p``)."""

    num_spec_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = dataclasses.field(default_factory=list)

    @classmethod
    def new(cls, num_spec_tokens: int) -> "SpecDecodingStats":
        """Zero counts, with ``num_accepted_tokens_per_pos`` of length ``num_spec_tokens``."""
        k = _check_count("num_spec_tokens", num_spec_tokens)
        return cls(num_spec_tokens=k, num_accepted_tokens_per_pos=[0] * k)

    def observe_draft(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """Record one request's verified draft: ``num_accepted_tokens`` leading tokens of
        ``num_draft_tokens`` were accepted (``num_accepted_tokens <= num_spec_tokens``)."""
        num_draft_tokens = _check_count("num_draft_tokens", num_draft_tokens)
        num_accepted_tokens = _check_count("num_accepted_tokens", num_accepted_tokens)
        if num_accepted_tokens > self.num_spec_tokens:
            raise ValueError(
                f"num_accepted_tokens ({num_accepted_tokens}) must be <= num_spec_tokens "
                f"({self.num_spec_tokens})"
            )
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        for pos in range(num_accepted_tokens):
            self.num_accepted_tokens_per_pos[pos] += 1


class SpecDecodingLogging:
    """Aggregates ``SpecDecodingStats`` between log lines; ``clock``: float seconds for the
    throughputs (default ``time.monotonic``)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.reset()

    def reset(self) -> None:
        self.num_drafts: list[int] = []
        self.num_draft_tokens: list[int] = []
        self.num_accepted_tokens: list[int] = []
        self.accepted_tokens_per_pos_lists: list[list[int]] = []
        self.last_log_time = self._clock()

    def observe(self, spec_decoding_stats: SpecDecodingStats) -> None:
        per_pos = list(spec_decoding_stats.num_accepted_tokens_per_pos)
        if self.accepted_tokens_per_pos_lists and len(per_pos) != len(self.accepted_tokens_per_pos_lists[0]):
            raise ValueError(
                f"stats with {len(per_pos)} positions cannot be aggregated with stats of "
                f"{len(self.accepted_tokens_per_pos_lists[0])} positions (num_spec_tokens changed)"
            )
        self.num_drafts.append(spec_decoding_stats.num_drafts)
        self.num_draft_tokens.append(spec_decoding_stats.num_draft_tokens)
        self.num_accepted_tokens.append(spec_decoding_stats.num_accepted_tokens)
        self.accepted_tokens_per_pos_lists.append(per_pos)

    def log(self, log_fn: Callable[..., None] = logger.info) -> None:
        """Make exactly one ``log_fn(LOG_FORMAT, *values)`` call, then reset; do nothing
        when nothing was observed since the last reset."""
        if not self.num_drafts:
            return
        num_drafts = int(np.sum(self.num_drafts))
        num_draft_tokens = int(np.sum(self.num_draft_tokens))
        num_accepted_tokens = int(np.sum(self.num_accepted_tokens))

        elapsed = self._clock() - self.last_log_time
        draft_throughput = num_draft_tokens / elapsed if elapsed > 0 else 0.0
        accepted_throughput = num_accepted_tokens / elapsed if elapsed > 0 else 0.0
        draft_acceptance_rate = (
            num_accepted_tokens / num_draft_tokens * 100 if num_draft_tokens > 0 else math.nan
        )
        # vLLM divides by num_drafts unguarded (numpy then yields nan / inf with a warning).
        mean_acceptance_length = 1 + num_accepted_tokens / num_drafts if num_drafts > 0 else math.nan
        per_pos_sums = np.sum(np.asarray(self.accepted_tokens_per_pos_lists, dtype=np.int64), axis=0)
        if num_drafts > 0:
            acceptance_rates = (per_pos_sums / num_drafts).tolist()
        else:
            acceptance_rates = [math.nan] * per_pos_sums.shape[0]
        rates_str = ", ".join(f"{p:.3f}" for p in acceptance_rates)

        log_fn(
            LOG_FORMAT,
            mean_acceptance_length,
            accepted_throughput,
            draft_throughput,
            num_accepted_tokens,
            num_draft_tokens,
            rates_str,
            draft_acceptance_rate,
        )
        self.reset()


class SpecDecodingProm:
    """Prometheus counters for speculative decoding (vLLM's names, documentation, labels).

    ``speculative_config``: None (counters off), ``k``, or an object with
    ``num_speculative_tokens``; ``labelnames`` / ``per_engine_labelvalues``: every
    counter's labels and each engine's values; ``prefix`` (default ``"vllm:"``);
    ``registry`` (default: prometheus_client's global one).
    """

    _counter_cls = None  # set lazily to prometheus_client.Counter; overridable like vLLM's

    def __init__(
        self,
        speculative_config,
        labelnames: Sequence[str],
        per_engine_labelvalues: Mapping[int, Sequence[str]],
        *,
        prefix: str = "vllm:",
        registry=None,
    ) -> None:
        import prometheus_client

        counter_cls = self._counter_cls or prometheus_client.Counter
        if registry is None:
            registry = prometheus_client.REGISTRY
        if not isinstance(prefix, str):
            raise ValueError(f"prefix must be a string such as 'vllm:', got {prefix!r}")
        labelnames = list(labelnames)
        if "position" in labelnames:
            raise ValueError("labelnames must not contain 'position' (it is added for the per-position counter)")
        for engine, values in per_engine_labelvalues.items():
            if len(values) != len(labelnames):
                raise ValueError(
                    f"per_engine_labelvalues[{engine}] has {len(values)} values but labelnames "
                    f"has {len(labelnames)} ({labelnames})"
                )

        self.spec_decoding_enabled = speculative_config is not None
        if not self.spec_decoding_enabled:
            return
        num_spec_tokens = getattr(speculative_config, "num_speculative_tokens", speculative_config)
        self.num_spec_tokens = _check_count("num_speculative_tokens", num_spec_tokens)
        self.prefix = prefix

        def counter(name: str, documentation: str, names: list[str]):
            return counter_cls(
                name=f"{prefix}{name}", documentation=documentation, labelnames=names, registry=registry
            )

        drafts = counter("spec_decode_num_drafts", "Number of spec decoding drafts.", labelnames)
        draft_tokens = counter("spec_decode_num_draft_tokens", "Number of draft tokens.", labelnames)
        accepted = counter("spec_decode_num_accepted_tokens", "Number of accepted tokens.", labelnames)
        per_pos = counter(
            "spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft position.",
            labelnames + ["position"],
        )
        engines = {int(idx): [str(v) for v in values] for idx, values in per_engine_labelvalues.items()}
        self.counter_spec_decode_num_drafts = {i: drafts.labels(*v) for i, v in engines.items()}
        self.counter_spec_decode_num_draft_tokens = {i: draft_tokens.labels(*v) for i, v in engines.items()}
        self.counter_spec_decode_num_accepted_tokens = {i: accepted.labels(*v) for i, v in engines.items()}
        self.counter_spec_decode_num_accepted_tokens_per_pos = {
            i: [per_pos.labels(*v, str(pos)) for pos in range(self.num_spec_tokens)] for i, v in engines.items()
        }

    def observe(self, spec_decoding_stats: SpecDecodingStats, engine_idx: int = 0) -> None:
        """Add one step's stats to engine ``engine_idx``'s counters."""
        if not self.spec_decoding_enabled:
            return
        if engine_idx not in self.counter_spec_decode_num_drafts:
            raise ValueError(
                f"engine_idx {engine_idx} has no label values; known engines: "
                f"{sorted(self.counter_spec_decode_num_drafts)}"
            )
        per_pos = spec_decoding_stats.num_accepted_tokens_per_pos
        counters = self.counter_spec_decode_num_accepted_tokens_per_pos[engine_idx]
        if len(per_pos) != len(counters):
            raise ValueError(
                f"stats have {len(per_pos)} positions but the counters were made for "
                f"num_speculative_tokens={len(counters)}"
            )
        self.counter_spec_decode_num_drafts[engine_idx].inc(spec_decoding_stats.num_drafts)
        self.counter_spec_decode_num_draft_tokens[engine_idx].inc(spec_decoding_stats.num_draft_tokens)
        self.counter_spec_decode_num_accepted_tokens[engine_idx].inc(spec_decoding_stats.num_accepted_tokens)
        for counter, value in zip(counters, per_pos):
            counter.inc(value)

"""The reference loop's public types: per-request ``SamplingParams``, ``RequestOutput``,
``GenerateResult`` and ``TargetModel``."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import numpy as np

from specjax.metrics import SpecDecodingStats


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling parameters (vLLM's names).

    Attributes:
      max_tokens: most tokens to generate (>= 1).
      temperature: 0 is greedy; > 0 samples.
      top_k: 0 disables; top_p: 1 disables.
      seed: per-request seed; None draws one from ``generate``'s ``seed``. A seeded request
        gives the same tokens whatever else is in the batch.
      stop_token_ids: generation stops after emitting any of these (the token is kept).
      ignore_eos: do not stop on ``generate``'s ``eos_token_id``.
      logprobs: None (off) or ``n`` in 0..20: each generated token's logprob and rank and
        the top-``n`` (``RequestOutput.logprobs``; values per the engine's
        ``logprobs_mode``; ``specjax.logprobs``).
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None

    def __post_init__(self) -> None:
        def is_int(v):
            return isinstance(v, (int, np.integer)) and not isinstance(v, bool)

        if not is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {t!r}")
        if not is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 disables), got {self.top_k!r}")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {p!r}")
        if self.seed is not None and not is_int(self.seed):
            raise ValueError(f"seed must be None or an int, got {self.seed!r}")
        from specjax.checks import check_int_sequence

        stops = check_int_sequence("stop_token_ids", self.stop_token_ids, 0)
        object.__setattr__(self, "stop_token_ids", tuple(int(s) for s in stops))
        from specjax.logprobs import check_num_logprobs

        object.__setattr__(self, "logprobs", check_num_logprobs("logprobs", self.logprobs))


class RequestOutput(NamedTuple):
    """One request's result: ``token_ids`` generated (prompt excluded), ``finish_reason``
    ``"stop"`` (stop / EOS token, kept in ``token_ids``) or ``"length"`` (``max_tokens`` or
    ``max_model_len``), its draft counts, and ``logprobs``: None unless
    ``SamplingParams.logprobs`` was set, else one ``{token_id: Logprob(logprob, rank)}``
    per generated token (vLLM's ``SampleLogprobs``; ``specjax.logprobs``)."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: str
    num_draft_tokens: int
    num_accepted_tokens: int
    logprobs: list | None = None


@dataclasses.dataclass
class GenerateResult:
    """Outputs in prompt order plus the run's speculative-decoding metrics.

    ``spec_stats`` sums every step's ``SpecDecodingStats`` (vLLM's counters);
    ``elapsed_s`` is the wall time of the loop (compilation included unless warmed up).
    """

    outputs: list[RequestOutput]
    spec_stats: SpecDecodingStats
    num_steps: int
    elapsed_s: float

    @property
    def token_ids(self) -> list[list[int]]:
        return [o.token_ids for o in self.outputs]

    @property
    def num_generated_tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.outputs)

    @property
    def mean_acceptance_length(self) -> float:
        """``1 + accepted / drafts`` (vLLM's; the bonus token counts); nan without drafts."""
        s = self.spec_stats
        return 1 + s.num_accepted_tokens / s.num_drafts if s.num_drafts else math.nan

    @property
    def acceptance_rate_per_position(self) -> list[float]:
        s = self.spec_stats
        return [a / s.num_drafts if s.num_drafts else math.nan for a in s.num_accepted_tokens_per_pos]


class TargetModel(NamedTuple):
    """The target: a ``specjax.models.DecoderLM`` runner and its params dict."""

    model: Any
    params: dict

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
    """Per-request sampling parameters (vLLM's names); a bad value raises naming the field.

    Attributes:
      max_tokens: most tokens to generate (>= 1). temperature: 0 is greedy. top_k: 0 off;
        top_p: 1 off. min_p: in [0, 1]; tokens below ``min_p`` times the top probability drop.
      seed: None draws one from ``generate``'s ``seed``; a seeded request gives the same tokens
        whatever else is in the batch.
      stop_token_ids: stop after emitting one (kept); ignore_eos: ignore ``eos_token_id``.
      presence_penalty, frequency_penalty: in [-2, 2], 0 off; repetition_penalty: > 0, 1 off.
      logit_bias: ``{token_id: bias}`` (bias in [-100, 100]); bad_words: token-id sequences
        never completed; allowed_token_ids: only these (None: all); min_tokens: stop and EOS
        suppressed until this many were generated.
      logits_processor: index into the engine's ``logits_processors`` (-1: none), with
        ``logits_processor_params``.
      logprobs: None or ``n`` in 0..20: each token's logprob, rank and the top-``n``.
      num_speculative_tokens: None (the engine's k) or at most this many drafts verified per
        step for this request, 0 none (specjax's; vLLM has no per-request k).
      Refused when set: ``n`` / ``best_of`` other than 1, ``prompt_logprobs``,
      ``structured_outputs``, ``stop`` (stop strings need detokenization)."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: Any = None
    bad_words: Any = ()
    allowed_token_ids: Any = None
    min_tokens: int = 0
    logits_processor: int = -1
    logits_processor_params: tuple[float, ...] = ()
    n: int = 1
    best_of: Any = None
    prompt_logprobs: Any = None
    structured_outputs: Any = None
    stop: Any = None
    logprobs: int | None = None
    num_speculative_tokens: int | None = None

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
        from specjax.sampling.logprobs import check_num_logprobs

        object.__setattr__(self, "logprobs", check_num_logprobs("logprobs", self.logprobs))
        if self.num_speculative_tokens is not None and (
                not is_int(self.num_speculative_tokens) or self.num_speculative_tokens < 0):
            raise ValueError(f"num_speculative_tokens must be None or an int >= 0 (0: no "
                             f"speculation for this request), got {self.num_speculative_tokens!r}")
        _check_processing(self)

    def processing(self, stop_ids=()) -> Any:
        """This request's ``specjax.sampling.logits_processors.RequestProcessing`` (``stop_ids``:
        what ``min_tokens`` suppresses: stop_token_ids plus EOS)."""
        from specjax.sampling.logits_processors import RequestProcessing

        return RequestProcessing(
            self.presence_penalty, self.frequency_penalty, self.repetition_penalty, self.min_p,
            self.logit_bias, self.bad_words, self.allowed_token_ids, self.min_tokens,
            tuple(sorted(stop_ids)) if self.min_tokens else (), self.logits_processor,
            self.logits_processor_params)


def _check_processing(sp: "SamplingParams") -> None:
    """The logits-processing fields of ``sp`` (normalized in place) and the refused ones."""
    from specjax.checks import (ArgumentError, check_int, check_int_sequence, check_number,
                                show)

    def put(name, v):
        object.__setattr__(sp, name, v)

    if sp.n != 1 or sp.best_of not in (None, 1):
        raise ArgumentError(f"n={show(sp.n)} / best_of={show(sp.best_of)}: several sequences "
                            f"per request are not supported (allowed: n=1, best_of None or 1)")
    for name in ("prompt_logprobs", "structured_outputs"):
        if getattr(sp, name) is not None:
            raise ArgumentError(f"{name}={show(getattr(sp, name))} is not supported (allowed: None)")
    if sp.stop:
        raise ArgumentError(f"stop={show(sp.stop)}: stop strings need detokenization, which "
                            f"specjax does not do; use stop_token_ids (allowed: None or [])")
    put("presence_penalty", check_number("presence_penalty", sp.presence_penalty, -2.0, 2.0))
    put("frequency_penalty", check_number("frequency_penalty", sp.frequency_penalty, -2.0, 2.0))
    rp = check_number("repetition_penalty", sp.repetition_penalty, 0.0)
    if rp <= 0:
        raise ArgumentError(f"repetition_penalty must be > 0 (1 disables), got {show(rp)}")
    put("repetition_penalty", rp)
    put("min_p", check_number("min_p", sp.min_p, 0.0, 1.0))
    if sp.logit_bias is not None:
        if not isinstance(sp.logit_bias, dict):
            raise ArgumentError(f"logit_bias must be a dict {{token_id: bias}} or None, got "
                                f"{show(sp.logit_bias)}")
        put("logit_bias", {check_int(f"logit_bias key {show(t)}", t, 0):
                           check_number(f"logit_bias[{t}]", b, -100.0, 100.0)
                           for t, b in sp.logit_bias.items()} or None)
    if isinstance(sp.bad_words, (str, bytes)) or not isinstance(sp.bad_words, (list, tuple)):
        raise ArgumentError(f"bad_words must be a list of token-id lists (strings need a "
                            f"tokenizer), got {show(sp.bad_words)}")
    put("bad_words", tuple(check_int_sequence(f"bad_words[{i}]", w, 0, min_len=1)
                           for i, w in enumerate(sp.bad_words)))
    if sp.allowed_token_ids is not None:
        put("allowed_token_ids", check_int_sequence("allowed_token_ids", sp.allowed_token_ids,
                                                    0, min_len=1))
    put("min_tokens", check_int("min_tokens", sp.min_tokens, 0))
    if sp.min_tokens > sp.max_tokens:
        raise ArgumentError(f"min_tokens={sp.min_tokens} must be <= max_tokens={sp.max_tokens}")
    put("logits_processor", check_int("logits_processor", sp.logits_processor, -1))
    if isinstance(sp.logits_processor_params, (str, bytes)) or not isinstance(
            sp.logits_processor_params, (list, tuple)):
        raise ArgumentError(f"logits_processor_params must be a list of numbers, got "
                            f"{show(sp.logits_processor_params)}")
    put("logits_processor_params", tuple(
        check_number(f"logits_processor_params[{i}]", x)
        for i, x in enumerate(sp.logits_processor_params)))


class RequestMetrics(NamedTuple):
    """One request's timeline in seconds after ``generate`` began (host times: tokens of
    one device-loop call share the time they were committed). ``arrival_time``: when it
    could be admitted; ``first_scheduled_time``: its first step; ``first_token_time``: its
    first token committed (TTFT is ``first_token_time - arrival_time``); ``token_times``:
    one per generated token (inter-token latencies are their differences);
    ``finished_time``; ``num_preemptions``: times it was preempted and recomputed."""

    arrival_time: float
    first_scheduled_time: float
    first_token_time: float
    finished_time: float
    token_times: list[float]
    num_preemptions: int


class RequestOutput(NamedTuple):
    """One request's result: ``token_ids`` generated (prompt excluded), ``finish_reason``
    ``"stop"`` (stop / EOS token, kept in ``token_ids``) or ``"length"`` (``max_tokens`` or
    ``max_model_len``), its draft counts, and ``logprobs``: None unless
    ``SamplingParams.logprobs`` was set, else one ``{token_id: Logprob(logprob, rank)}``
    per generated token (vLLM's ``SampleLogprobs``; ``specjax.sampling.logprobs``)."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: str
    num_draft_tokens: int
    num_accepted_tokens: int
    logprobs: list | None = None


@dataclasses.dataclass
class GenerateResult:
    """Outputs in prompt order, ``spec_stats`` (every iteration's ``SpecDecodingStats``
    summed), ``num_steps`` (iterations), ``elapsed_s`` (wall time, compilation included
    unless warmed up), ``num_preemptions`` (vLLM's: requests preempted and recomputed) and
    ``request_metrics`` (each request's :class:`RequestMetrics`, in prompt order)."""

    outputs: list[RequestOutput]
    spec_stats: SpecDecodingStats
    num_steps: int
    elapsed_s: float
    num_preemptions: int = 0
    request_metrics: list[RequestMetrics] = dataclasses.field(default_factory=list)

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
    """The target: a ``specjax.Target`` (e.g. a ``specjax.models.DecoderLM`` runner) and its
    params (a dict for a ``DecoderLM``; any pytree the target's ``forward`` takes)."""

    model: Any
    params: Any

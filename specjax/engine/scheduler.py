"""The reference loop's request records and bucket choice (host side)."""

from __future__ import annotations

import dataclasses
from typing import Any, Hashable, Sequence

from specjax.constants import next_power_of_2
from specjax.engine.types import SamplingParams


@dataclasses.dataclass
class _Request:
    index: int
    req_id: Hashable
    prompt: list[int]
    params: SamplingParams
    seed: int
    stop_ids: frozenset
    output: list[int] = dataclasses.field(default_factory=list)
    num_computed: int = 0
    drafts: list[int] = dataclasses.field(default_factory=list)
    blocks: list[int] = dataclasses.field(default_factory=list)
    reserve: int = 0            # worst-case block count over the request's life
    row: int = -1               # row of the token-history buffer
    finish_reason: str | None = None
    num_drafted: int = 0
    num_accepted: int = 0
    proc: Any = None            # specjax.sampling.logits_processors.RequestProcessing
    logprobs: list = dataclasses.field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    def token(self, i: int) -> int:
        p = len(self.prompt)
        return self.prompt[i] if i < p else self.output[i - p]


def _pick(buckets: Sequence[int] | None, n: int, cap: int | None = None) -> int:
    """Smallest bucket >= n (powers of two when ``buckets`` is None), at most ``cap``."""
    if buckets is None:
        b = next_power_of_2(n)
    else:
        fits = [x for x in buckets if x >= n]
        if not fits:
            raise ValueError(f"no bucket in {tuple(buckets)} holds {n}")
        b = min(fits)
    return b if cap is None else min(max(b, n), cap)

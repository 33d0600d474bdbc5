"""``LoopOptions``: how ``Engine`` compiles and runs its decoding loop, in one record.

None of them changes greedy tokens: they trade compilations, host syncs and memory
(docs/performance.md says what each default gains)."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from specjax.checks import ArgumentTypeError, check_bool, check_int, check_int_sequence, show

__all__ = ["LoopOptions", "DEFAULT_STEPS_PER_SYNC", "DEFAULT_MAX_NUM_BATCHED_TOKENS",
           "DEFAULT_CPU_MAX_NUM_BATCHED_TOKENS"]

#: Iterations per host sync of the device loop when ``steps_per_sync`` is None.
DEFAULT_STEPS_PER_SYNC = 8
#: A step's token budget on an accelerator when ``max_num_batched_tokens`` is None (vLLM's
#: offline default on a large GPU): large enough that a chunk runs at the GEMM rate.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 16384
#: The budget on a CPU target: a step's activations grow with its tokens, so a long prompt's
#: peak memory stays bounded.
DEFAULT_CPU_MAX_NUM_BATCHED_TOKENS = 2048


def _opt_bool(name: str, value: Any) -> bool | None:
    if value is not None and not isinstance(value, (bool, np.bool_)):
        raise ArgumentTypeError(f"{name} must be True, False or None (the engine's choice), "
                                f"got {show(value)}")
    return None if value is None else bool(value)


def _buckets(name: str, value: Any) -> tuple[int, ...] | None:
    if value is None:
        return None
    return tuple(sorted(check_int_sequence(name, value, 1, min_len=1, max_len=4096)))


@dataclasses.dataclass(frozen=True)
class LoopOptions:
    """Loop settings of ``Engine`` / ``generate`` (``options=``); a bad field raises
    TypeError / ValueError naming it.

    Attributes:
      steps_per_sync: iterations per host sync (>= 1); None: ``DEFAULT_STEPS_PER_SYNC`` where
        the device loop runs the proposer, else 1 (N > 1 for another is refused by name).
      early_exit: the device loop's form: True, a ``while_loop`` stopping once it may; False,
        always ``steps_per_sync`` iterations; None: False unless a request waits or on CPU.
      overlap: dispatch the next device-loop call before committing the previous one; None:
        on where the device loop runs, unless only the while form runs per step.
      batch_buckets, query_buckets, context_buckets, token_buckets: padded rows, tokens per
        row, block-table width, flat token slots (at most rows x tokens per row) the step
        compiles for; None: powers of two.
      min_tokens_per_step: pad each step to at least this many tokens (writes nothing).
      processor_limits: ``ProcessorLimits`` (padded logits-processing sizes); None: defaults.
      tree_verification: None: trees when the proposer's tree branches; True: forced; False.
      fuse_projections: fuse q/k/v and gate/up on one device (a fused copy of the weights).
      max_num_batched_tokens, enable_chunked_prefill, long_prefill_token_threshold: vLLM's
        scheduling (docs/scheduling.md): a step's token budget (None: 2048 on a CPU target,
        else 16384), prompts split over steps (False: whole, the budget must hold
        ``max_model_len``), prompt tokens one request takes per step at most (0: no cap).
      adaptive_k: each step verifies the k maximising expected tokens per second, from each
        request's recent acceptance and the step's measured cost per k
        (``specjax.adaptive_k``; ``Engine.k_costs``, profiled when first needed); on the
        device loop per request, in flat token slots (docs/adaptive_k.md)."""

    steps_per_sync: int | None = None
    early_exit: bool | None = None
    overlap: bool | None = None
    batch_buckets: tuple[int, ...] | None = None
    query_buckets: tuple[int, ...] | None = None
    context_buckets: tuple[int, ...] | None = None
    token_buckets: tuple[int, ...] | None = None
    min_tokens_per_step: int = 1
    processor_limits: Any = None
    tree_verification: bool | None = None
    fuse_projections: bool = True
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    adaptive_k: bool = False

    def __post_init__(self) -> None:
        from specjax.sampling.logits_processors import check_limits

        def put(name, value):
            object.__setattr__(self, name, value)

        if self.steps_per_sync is not None:
            put("steps_per_sync", check_int("steps_per_sync", self.steps_per_sync, 1))
        for name in ("early_exit", "overlap", "tree_verification"):
            put(name, _opt_bool(name, getattr(self, name)))
        for name in ("batch_buckets", "query_buckets", "context_buckets", "token_buckets"):
            put(name, _buckets(name, getattr(self, name)))
        put("min_tokens_per_step", check_int("min_tokens_per_step", self.min_tokens_per_step,
                                             1, 1 << 20))
        put("processor_limits", check_limits(self.processor_limits))
        put("fuse_projections", check_bool("fuse_projections", self.fuse_projections))
        if self.max_num_batched_tokens is not None:
            put("max_num_batched_tokens", check_int("max_num_batched_tokens",
                                                    self.max_num_batched_tokens, 1, 1 << 30))
        put("enable_chunked_prefill", check_bool("enable_chunked_prefill",
                                                 self.enable_chunked_prefill))
        put("adaptive_k", check_bool("adaptive_k", self.adaptive_k))
        put("long_prefill_token_threshold", check_int(
            "long_prefill_token_threshold", self.long_prefill_token_threshold, 0, 1 << 30))

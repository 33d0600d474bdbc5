"""Reference decoding loop: batched speculative decoding with any proposer.

``generate(target, proposer, prompts, sampling_params)`` runs vLLM v1's scheduler + model
runner reduced to speculative decoding: schedule on the host (``scheduler``: admission,
KV blocks), step on the device (the public step, or up to ``steps_per_sync`` iterations
in one program: ``device_loop``), commit on the host (``commit``: one stop rule for both).
Plain decoding is ``proposer=None``; greedy speculative decoding emits its tokens.
docs/integration.md: tree verification and what the loop does not do yet."""

from __future__ import annotations

from specjax.engine.engine import Engine, generate
from specjax.engine.options import LoopOptions
from specjax.engine.types import (GenerateResult, RequestMetrics, RequestOutput, SamplingParams,
                                  TargetModel)
from specjax.runtime.step import step_cache_size

__all__ = ["SamplingParams", "RequestOutput", "RequestMetrics", "GenerateResult", "TargetModel", "Engine",
           "LoopOptions", "generate", "step_cache_size"]

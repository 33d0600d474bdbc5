"""The runtime a serving loop calls: the fused verify + propose step
(:mod:`~specjax.runtime.step`, tree verification's KV compaction included), the host batch
builders (:mod:`~specjax.runtime.batch`), the device-resident decode loop
(:mod:`~specjax.runtime.decode_loop`) and the packed host-to-device transfer
(:mod:`~specjax.runtime.host_transfer`). docs/integration.md shows the loop around them."""

from specjax.runtime.batch import build_batch
from specjax.runtime.decode_loop import (LoopOutput, LoopState, decode_loop, loop_blocks_needed,
                                         make_loop_state)
from specjax.runtime.step import Step, StepBatch, StepOutput, make_step

__all__ = ["build_batch", "LoopOutput", "LoopState", "decode_loop", "loop_blocks_needed",
           "make_loop_state", "Step", "StepBatch", "StepOutput", "make_step"]

"""The runtime a serving loop calls: the fused verify + propose step
(:mod:`~specjax.runtime.step`), the same without the forward for a stack that runs its own
model (:mod:`~specjax.runtime.verify`), tree verification's KV compaction
(:mod:`~specjax.runtime.tree`), the host batch
builders (:mod:`~specjax.runtime.batch`), the device-resident decode loop
(:mod:`~specjax.runtime.decode_loop`), its rows joining and leaving
(:mod:`~specjax.runtime.loop_rows`), compiling ahead of time (:mod:`~specjax.runtime.warmup`)
and the packed host-to-device transfer
(:mod:`~specjax.runtime.host_transfer`). docs/integration.md shows the loop around them."""

from specjax.runtime.batch import build_batch
from specjax.runtime.decode_loop import (LoopOutput, LoopState, decode_loop, loop_blocks_needed,
                                         make_loop_state)
from specjax.runtime.loop_rows import admit, empty_loop_state, release, warmup_loop
from specjax.runtime.output import StepOutput
from specjax.runtime.step import Step, StepBatch, make_step
from specjax.runtime.verify import VerifyStep, make_verify_step
from specjax.runtime.warmup import Bucket

__all__ = ["build_batch", "LoopOutput", "LoopState", "decode_loop", "loop_blocks_needed",
           "make_loop_state", "Step", "StepBatch", "StepOutput", "make_step", "VerifyStep",
           "make_verify_step", "admit", "release", "empty_loop_state", "warmup_loop", "Bucket"]

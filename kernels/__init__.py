"""Every kernel of specjax: one folder per op family, each with its public op (argument
checks and the specification in its docstrings) and its ``xla`` / ``pallas`` / ``triton``
versions side by side.

- ``eagle_step/``: EAGLE's per-draft-step slot / position / seq_len update.
- ``prepare/``: padded-drafter input preparation (the token to sample from, the next token).
- ``copy_expand/``: the target batch copied into the drafter's input (EAGLE, DFlash).
- ``batch_metadata/``: vLLM's metadata helpers (XLA only: they fuse into the step).
- ``paged_attention/``: the KV-cache write and paged attention (reference, Pallas and
  Triton kernels, the shared limits, the SPMD partitioning rule).
- ``backend.py``: ``backend=`` on every op, the process default
  (:func:`default_backend`, :func:`set_default_backend`, ``SPECJAX_KERNEL_BACKEND``) and
  the precedence between them.

The index ops give bit-identical results on every backend; ``xla`` is the reference and
the CPU path. Outputs are returned (never written into arguments), in vLLM's ``out_*``
order. All index arrays are int32.

Padding contract (the JAX counterpart of vLLM's CUDA-graph padding): arrays may be padded
to a bucket. ``num_reqs`` is an optional device scalar (0-d int32) giving the number of
real requests; rows at or past it get fill values (slot ``-1``, position ``0``, token
``0``, counts ``0``, masks ``False``). When ``num_reqs`` is None every row is real.
"""

from __future__ import annotations

from specjax.kernels.backend import (
    BACKENDS,
    default_backend,
    get_default_backend,
    resolve_backend,
    set_default_backend,
)
from specjax.kernels.batch_metadata import (
    compute_new_slot_mapping,
    extend_all_queries_by_N,
    update_num_computed_tokens_for_batch_change,
)
from specjax.kernels.copy_expand import (
    copy_and_expand_dflash_inputs,
    copy_and_expand_eagle_inputs,
)
from specjax.kernels.eagle_step import eagle_step_update_slot_mapping_and_metadata
from specjax.kernels.prepare import eagle_prepare_inputs_padded, eagle_prepare_next_token_padded

__all__ = [
    "BACKENDS",
    "resolve_backend",
    "default_backend",
    "get_default_backend",
    "set_default_backend",
    "eagle_step_update_slot_mapping_and_metadata",
    "eagle_prepare_inputs_padded",
    "eagle_prepare_next_token_padded",
    "copy_and_expand_eagle_inputs",
    "copy_and_expand_dflash_inputs",
    "compute_new_slot_mapping",
    "extend_all_queries_by_N",
    "update_num_computed_tokens_for_batch_change",
]

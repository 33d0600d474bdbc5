"""Index kernels of speculative decoding: slot mapping, input prep, copy-and-expand.

Every op is one public function with ``backend="auto" | "xla" | "pallas" | "triton"``.
Each backend gives bit-identical results; :mod:`specjax.kernels.xla` is the reference and
the CPU path. Outputs are returned (never written into arguments), in vLLM's ``out_*``
order. All index arrays are int32.

Padding contract (the JAX counterpart of vLLM's CUDA-graph padding): arrays may be padded
to a bucket. ``num_reqs`` is an optional device scalar (0-d int32) giving the number of
real requests; rows at or past it get fill values (slot ``-1``, position ``0``, token
``0``, counts ``0``, masks ``False``). When ``num_reqs`` is None every row is real.

The per-op docstrings below are the specification every backend implements.
"""

from __future__ import annotations

from specjax.kernels._api import (
    BACKENDS,
    copy_and_expand_dflash_inputs,
    copy_and_expand_eagle_inputs,
    eagle_prepare_inputs_padded,
    eagle_prepare_next_token_padded,
    eagle_step_update_slot_mapping_and_metadata,
    resolve_backend,
)
from specjax.kernels.xla import (
    compute_new_slot_mapping,
    extend_all_queries_by_N,
    update_num_computed_tokens_for_batch_change,
)

__all__ = [
    "BACKENDS",
    "resolve_backend",
    "eagle_step_update_slot_mapping_and_metadata",
    "eagle_prepare_inputs_padded",
    "eagle_prepare_next_token_padded",
    "copy_and_expand_eagle_inputs",
    "copy_and_expand_dflash_inputs",
    "compute_new_slot_mapping",
    "extend_all_queries_by_N",
    "update_num_computed_tokens_for_batch_change",
]

"""Every kernel of specjax, one folder per op family (``eagle_step``, ``prepare``,
``copy_expand``, ``batch_metadata``, ``paged_attention``, ``grouped_matmul``): its public
op, whose docstrings are the specification, and its ``xla`` / ``pallas`` / ``triton``
versions; ``backend.py`` picks one. The index ops are bit-identical on every backend (``xla``: the reference and the
CPU path), return their outputs in vLLM's ``out_*`` order and use int32 indices. Padding:
arrays may be padded to a bucket; ``num_reqs`` (optional 0-d int32 device scalar) counts the
real requests, and rows at or past it get fill values (slot ``-1``, position ``0``, token
``0``, counts ``0``, masks ``False``); None: every row is real.
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

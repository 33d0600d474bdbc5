"""Pallas backend of the index kernels: Mosaic GPU kernels (``plgpu.kernel``).

Compiled for the GPU when ``jax.default_backend() == "gpu"``; run in GPU interpret mode
(``plgpu.InterpretGPUParams``) everywhere else. Called through
:mod:`specjax.kernels._api`, which normalizes the arguments; the docstrings there are the
specification, and the results are bit-identical to :mod:`specjax.kernels.xla`.
"""

from __future__ import annotations

from specjax.kernels.pallas.copy_expand import (
    copy_and_expand_dflash_inputs,
    copy_and_expand_eagle_inputs,
)
from specjax.kernels.pallas.eagle_step import eagle_step_update_slot_mapping_and_metadata
from specjax.kernels.pallas.prepare import (
    eagle_prepare_inputs_padded,
    eagle_prepare_next_token_padded,
)

__all__ = [
    "eagle_step_update_slot_mapping_and_metadata",
    "eagle_prepare_inputs_padded",
    "eagle_prepare_next_token_padded",
    "copy_and_expand_eagle_inputs",
    "copy_and_expand_dflash_inputs",
]

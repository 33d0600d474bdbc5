"""Deprecated: the Pallas backend of each op now lives in its folder
(``kernels/<op>/pallas.py``, paged attention's in ``kernels/paged_attention/pallas.py``);
this package re-exports the index ops' Pallas functions."""

from __future__ import annotations

import warnings

from specjax.kernels.copy_expand.pallas import (  # noqa: E402,F401
    copy_and_expand_dflash_inputs,
    copy_and_expand_eagle_inputs,
)
from specjax.kernels.eagle_step.pallas import eagle_step_update_slot_mapping_and_metadata  # noqa: F401
from specjax.kernels.prepare.pallas import (  # noqa: E402,F401
    eagle_prepare_inputs_padded,
    eagle_prepare_next_token_padded,
)

warnings.warn("specjax.kernels.pallas moved: each op's Pallas backend is "
              "specjax.kernels.<op>.pallas", DeprecationWarning, stacklevel=2)

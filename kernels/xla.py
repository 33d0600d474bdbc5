"""Deprecated: the XLA backend of each index op now lives in its folder
(``kernels/<op>/xla.py``); this path re-exports them."""

from __future__ import annotations

import warnings

from specjax.kernels.batch_metadata import (  # noqa: E402,F401
    compute_new_slot_mapping,
    extend_all_queries_by_N,
    update_num_computed_tokens_for_batch_change,
)
from specjax.kernels.copy_expand.xla import (  # noqa: E402,F401
    copy_and_expand_dflash_inputs,
    copy_and_expand_eagle_inputs,
)
from specjax.kernels.eagle_step.xla import eagle_step_update_slot_mapping_and_metadata  # noqa: F401
from specjax.kernels.prepare.xla import (  # noqa: E402,F401
    eagle_prepare_inputs_padded,
    eagle_prepare_next_token_padded,
)

warnings.warn("specjax.kernels.xla moved: each op's XLA backend is specjax.kernels.<op>.xla",
              DeprecationWarning, stacklevel=2)

"""Deprecated: moved to :mod:`specjax.kernels.paged_attention.pallas` (this path re-exports it)."""

from __future__ import annotations

import warnings

from specjax.kernels.paged_attention.pallas import (  # noqa: E402,F401
    DEFAULT_BLOCK_K,
    DEFAULT_NUM_SMS,
    MAX_ROWS,
    MAX_SPLITS,
    MAX_TREE,
    NEG,
    default_num_splits,
    fused_write_pays,
    kernel_config,
    num_rows,
    paged_attention,
    paged_attention_write,
    unsupported_reason,
)

warnings.warn("specjax.kernels.pallas.paged_attention moved to "
              "specjax.kernels.paged_attention.pallas; import it from there",
              DeprecationWarning, stacklevel=2)

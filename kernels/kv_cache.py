"""Deprecated: moved to :mod:`specjax.kernels.paged_attention.kv_cache` (this path re-exports it)."""

from __future__ import annotations

import warnings

from specjax.kernels.paged_attention.kv_cache import (  # noqa: E402,F401
    KVCache,
    scatter_slots,
)

warnings.warn("specjax.kernels.kv_cache moved to specjax.kernels.paged_attention.kv_cache; import it from there",
              DeprecationWarning, stacklevel=2)

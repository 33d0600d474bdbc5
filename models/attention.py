"""Deprecated: moved to :mod:`specjax.kernels.paged_attention` (this path re-exports it)."""

from __future__ import annotations

import warnings

from specjax.kernels.paged_attention import (  # noqa: E402,F401
    ATTENTION_BACKENDS,
    AUTO_MAX_QUERY_LEN,
    FUSED_KV_WRITE,
    FUSED_KV_WRITE_MODES,
    XLA_FALLBACK_COST,
    KVCache,
    attend,
    attention_backend,
    auto_kernel_backend,
    get_attention_backend,
    init_kv_caches,
    paged_attention,
    paged_attention_xla,
    resolve_attention_backend,
    scatter_slots,
    set_attention_backend,
    write_kv,
)

warnings.warn("specjax.models.attention moved to specjax.kernels.paged_attention; import it from there",
              DeprecationWarning, stacklevel=2)

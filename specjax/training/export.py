"""Deprecated location: ``export_checkpoint`` moved to :mod:`specjax.converters.export`,
each format's writer beside its reader in ``converters/format_*.py``. Importing this module
still works and emits a DeprecationWarning."""

from __future__ import annotations

import warnings

from specjax.converters.export import (  # noqa: F401 (re-exported)
    EXPORT_DTYPES,
    EXPORT_FORMATS,
    export_checkpoint,
)

__all__ = ["export_checkpoint", "EXPORT_FORMATS", "EXPORT_DTYPES"]

warnings.warn("specjax.training.export moved to specjax.converters.export; import "
              "export_checkpoint from there", DeprecationWarning, stacklevel=2)

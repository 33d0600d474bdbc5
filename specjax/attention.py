"""Deprecated: renamed to :mod:`specjax.attention_metadata` (it holds the attention metadata, not attention); this path re-exports it."""

from __future__ import annotations

import warnings

from specjax.attention_metadata import *  # noqa: E402,F401,F403

warnings.warn("specjax.attention was renamed to specjax.attention_metadata; import it from there",
              DeprecationWarning, stacklevel=2)

"""Deprecated: renamed to :mod:`specjax.proposers.types` (the types every proposer returns, receives and declares); this path re-exports it."""

from __future__ import annotations

import warnings

from specjax.proposers.types import *  # noqa: E402,F401,F403

warnings.warn("specjax.proposers.base was renamed to specjax.proposers.types; import it from there",
              DeprecationWarning, stacklevel=2)

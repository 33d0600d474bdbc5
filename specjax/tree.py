"""Deprecated: renamed to :mod:`specjax.token_tree` (the token-tree structure); this path re-exports it."""

from __future__ import annotations

import warnings

from specjax.token_tree import *  # noqa: E402,F401,F403

warnings.warn("specjax.tree was renamed to specjax.token_tree; import it from there",
              DeprecationWarning, stacklevel=2)

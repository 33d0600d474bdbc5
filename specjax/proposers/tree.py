"""Deprecated: renamed to :mod:`specjax.proposers.tree_drafting` (tree drafting); this path re-exports it."""

from __future__ import annotations

import warnings

from specjax.proposers.tree_drafting import *  # noqa: E402,F401,F403

warnings.warn("specjax.proposers.tree was renamed to specjax.proposers.tree_drafting; import it from there",
              DeprecationWarning, stacklevel=2)

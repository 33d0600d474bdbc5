"""Deprecated: renamed to :mod:`specjax.models.params` (params <-> NNX module, embedding and
LM-head math); this path re-exports it."""

from __future__ import annotations

import warnings

from specjax.models.params import *  # noqa: E402,F401,F403

warnings.warn("specjax.models.base was renamed to specjax.models.params; import it from there",
              DeprecationWarning, stacklevel=2)

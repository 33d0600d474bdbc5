"""Where the test suite's pieces live, for the suite and for the scripts it runs.

``tests/`` mirrors the packages (``kernels/``, ``models/``, ``converters/``, ``proposers/``,
``engine/``, ``sharding/``, ``training/``, ``benchmarks/``; ``specjax``'s own top-level
modules at the top); ``support/`` holds what is not a test: the NumPy oracles, case
builders, drivers run in subprocesses, and ``fixtures/``. Test modules share helpers by
plain module name (``from test_engine import build``, ``import kernel_oracle``):
``tests/conftest.py`` puts :data:`SEARCH_PATH` on ``sys.path`` once, and a subprocess gets
the same through :func:`pythonpath`.
"""

from __future__ import annotations

import os
from pathlib import Path

SUPPORT = Path(__file__).resolve().parent
TESTS = SUPPORT.parent
ROOT = TESTS.parent
FIXTURES = SUPPORT / "fixtures"
BENCHMARKS = ROOT / "benchmarks"
DOCS = ROOT / "docs"

#: the support folder, the tests root and every test folder under it (sorted)
SEARCH_PATH: tuple[str, ...] = (str(SUPPORT), str(TESTS)) + tuple(
    str(d) for d in sorted(TESTS.iterdir())
    if d.is_dir() and d.name not in ("support", "__pycache__") and not d.name.startswith("."))


def pythonpath(*extra: str | os.PathLike) -> str:
    """A ``PYTHONPATH`` value for a subprocess: ``extra``, :data:`SEARCH_PATH`, then the
    caller's own ``PYTHONPATH``."""
    parts = [str(e) for e in extra] + list(SEARCH_PATH)
    if os.environ.get("PYTHONPATH"):
        parts.append(os.environ["PYTHONPATH"])
    return os.pathsep.join(parts)

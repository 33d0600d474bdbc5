"""Shared test setup.

**Layout.** ``tests/`` mirrors the packages; ``tests/support/`` holds the oracles, case
builders, subprocess drivers and fixtures (``support/suite_paths.py``). Every test folder
and ``support/`` go on ``sys.path`` here, so test modules share helpers by module name
whatever folder they are in.

**GPU tests.** One convention: mark them ``gpu`` (``@pytest.mark.gpu`` or a module's
``pytestmark``). They are deselected by default (``addopts = -m 'not gpu'``) and run with
``python -m pytest -m gpu`` on a CUDA machine; there, or wherever they are selected on a
machine whose JAX backend is not ``gpu``, :func:`pytest_collection_modifyitems` skips them
with the reason.

**Compiled programs.**
Every compiled XLA CPU executable keeps its JIT-compiled code mapped; a long pytest process
that keeps every test module's executables (jit caches) alive crosses Linux's default
``vm.max_map_count`` (65530 mappings), and XLA's CPU compiler then aborts or segfaults in
the middle of a later compile (seen at 43% of the full suite: ``test_engine.py`` alone
leaves ~16k mappings). Dropping JAX's caches after each test module keeps the count
bounded; no test relies on a compilation surviving from another module.
"""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))
from suite_paths import SEARCH_PATH  # noqa: E402

for _p in reversed(SEARCH_PATH):
    if _p not in sys.path:
        sys.path.insert(0, _p)


def pytest_collection_modifyitems(config, items):
    """Skip ``gpu``-marked tests where JAX has no GPU backend (the one GPU convention)."""
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return
    import jax

    backend = jax.default_backend()
    if backend == "gpu":
        return
    skip = pytest.mark.skip(reason=f"needs a GPU; jax.default_backend() is {backend!r}")
    for item in gpu_items:
        item.add_marker(skip)


@pytest.fixture(autouse=True, scope="module")
def _drop_compiled_programs_after_each_module():
    yield
    import jax

    jax.clear_caches()
    gc.collect()

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
bounded; no test relies on a compilation surviving from another module. One persistent
compilation cache per pytest run, shared by its xdist workers and removed at its end, gives
the next module (and the other worker) an identical program without compiling it again;
:func:`no_compilation_cache` turns it off for a test that counts backend compiles.
Every process of the run (subprocesses inherit the variable) compiles in XLA's cheap mode,
``JAX_DISABLE_MOST_OPTIMIZATIONS=1``: compiling dominates the suite, and both sides of
every comparison compile the same way.
"""

from __future__ import annotations

import gc
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))
from suite_paths import SEARCH_PATH  # noqa: E402

for _p in reversed(SEARCH_PATH):
    if _p not in sys.path:
        sys.path.insert(0, _p)


_CACHE_ENV = "SPECJAX_TEST_COMPILATION_CACHE"


def pytest_configure(config):
    """The run's compilation cache: made by the controller (xdist workers inherit the
    path), used by every process."""
    if not hasattr(config, "workerinput") and _CACHE_ENV not in os.environ:
        os.environ[_CACHE_ENV] = tempfile.mkdtemp(prefix="specjax-jax-cache-")
        config._specjax_cache = os.environ[_CACHE_ENV]
    import jax

    jax.config.update("jax_compilation_cache_dir", os.environ[_CACHE_ENV])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def pytest_unconfigure(config):
    path = getattr(config, "_specjax_cache", None)
    if path is not None:
        shutil.rmtree(path, ignore_errors=True)
        os.environ.pop(_CACHE_ENV, None)


@pytest.fixture
def no_compilation_cache():
    """The persistent compilation cache off for one test (every program compiles)."""
    import jax
    from jax._src import compilation_cache   # JAX decides once whether to use it: reset

    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    yield
    jax.config.update("jax_enable_compilation_cache", True)
    compilation_cache.reset_cache()


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

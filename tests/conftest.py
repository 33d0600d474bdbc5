"""Shared test setup.

Every compiled XLA CPU executable keeps its JIT-compiled code mapped; a long pytest process
that keeps every test module's executables (jit caches) alive crosses Linux's default
``vm.max_map_count`` (65530 mappings), and XLA's CPU compiler then aborts or segfaults in
the middle of a later compile (seen at 43% of the full suite: ``test_engine.py`` alone
leaves ~16k mappings). Dropping JAX's caches after each test module keeps the count
bounded; no test relies on a compilation surviving from another module.
"""

from __future__ import annotations

import gc

import pytest


@pytest.fixture(autouse=True, scope="module")
def _drop_compiled_programs_after_each_module():
    yield
    import jax

    jax.clear_caches()
    gc.collect()

"""Shared compile helpers: a jitted step does not recompile when only the real counts
change; XLA's cheap compilation mode for a test module."""

import logging

import jax
import pytest


@pytest.fixture(autouse=True, scope="module")
def fast_compiles():
    """XLA's cheap compilation mode for the module that imports this fixture (compilation
    dominates such modules' run time; both sides of every comparison compile the same way)."""
    old = bool(jax.config.values.get("jax_disable_most_optimizations", False))
    jax.config.update("jax_disable_most_optimizations", True)
    yield
    jax.config.update("jax_disable_most_optimizations", old)


def assert_no_recompile(jitted, run, sizes, caplog) -> None:
    """Call ``run(n)`` once to compile, then for each n in ``sizes``; neither ``jitted``'s
    cache nor JAX's compile log may grow."""
    run(sizes[0])
    before = jitted._cache_size()
    with jax.log_compiles(), caplog.at_level(logging.DEBUG, logger="jax"):
        for n in sizes[1:]:
            run(n)
    assert jitted._cache_size() == before
    assert not [r.getMessage() for r in caplog.records if r.getMessage().startswith("Compiling")]

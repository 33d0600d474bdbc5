"""Shared compile helper: a jitted step does not recompile when only the real counts
change."""

import logging

import jax


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

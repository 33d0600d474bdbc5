"""What a Python user expects of a package: a LICENSE (Apache-2.0), ``__version__`` and
``specjax --version``, ``dir(specjax)`` listing the lazy public API, library code logging
through ``logging`` (``print`` only in the command-line modules)."""

from __future__ import annotations

import suite_paths  # tests/support: where the suite's pieces are
import ast
import re
from pathlib import Path

import pytest

import specjax

ROOT = suite_paths.ROOT
#: modules that are command lines (their output is the point)
CLI_MODULES = {"specjax/cli/main.py", "specjax/cli/demo.py", "specjax/cli/generate.py",
               "specjax/training/recipe.py", "converters/cli.py", "specjax/__main__.py"}

pytestmark = pytest.mark.smoke


def test_license_is_apache_2():
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text
    assert 'license = { text = "Apache-2.0" }' in (ROOT / "pyproject.toml").read_text()


def test_version_matches_pyproject():
    m = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M)
    assert m and specjax.__version__ == m.group(1)


def test_dir_lists_the_lazy_api():
    names = dir(specjax)
    assert set(specjax.__all__) <= set(names)
    for n in specjax.__all__:
        assert getattr(specjax, n) is not None
    with pytest.raises(AttributeError):
        specjax.not_a_name  # noqa: B018


def test_no_print_outside_the_command_lines():
    bad = []
    for top in ("specjax", "models", "converters", "kernels"):
        for f in sorted((ROOT / top).rglob("*.py")):
            rel = f.relative_to(ROOT).as_posix()
            if rel in CLI_MODULES:
                continue
            for node in ast.walk(ast.parse(f.read_text(), rel)):
                if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "print":
                    bad.append(f"{rel}:{node.lineno}")
    assert not bad, f"print() in library code (use logging): {bad}"


@pytest.mark.smoke
def test_import_sets_no_xla_flag_or_jax_option():
    """The defaults are the fast path without flags: importing specjax (and its kernels,
    models and engine) in a process whose JAX backend is already initialized changes no
    environment variable (``XLA_FLAGS`` included; JAX's own Pallas modules, imported first,
    set theirs) and no JAX config value, so a user's
    process measures what ``benchmarks/`` measures."""
    import subprocess
    import sys

    code = """
import os, jax
jax.devices()                               # the backend is initialized first
import jax.experimental.pallas              # JAX's own modules set their own variables
try:                                        # (mosaic_gpu: MOSAIC_GPU_CUDA_ROOT)
    import jax.experimental.pallas.mosaic_gpu, jax.experimental.pallas.triton
except Exception:
    pass
env = dict(os.environ)
names = sorted(n for n in dir(jax.config) if n.startswith("jax_"))
def values():
    out = {}
    for n in names:
        try:
            out[n] = repr(getattr(jax.config, n))
        except Exception:
            pass
    return out
before = values()
import specjax, specjax.kernels, specjax.models, specjax.engine, specjax.runtime.step, specjax.runtime.decode_loop
from specjax.kernels import paged_attention
changed_env = {k for k in set(env) | set(os.environ) if env.get(k) != os.environ.get(k)}
after = values()
changed = {n for n in before if before[n] != after.get(n)}
assert not changed_env, changed_env
assert not changed, changed
print("ok")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]

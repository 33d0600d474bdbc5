"""specjax._compat: the JAX-version shims, and the backend fallbacks built on them."""

from __future__ import annotations

import suite_paths  # tests/support: where the suite's pieces are
import pathlib
import re
import tomllib
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import specjax.kernels as K
from specjax import _compat
from specjax.kernels import paged_attention as attn

ROOT = suite_paths.ROOT
ON_GPU = jax.default_backend() == "gpu"

pytestmark = pytest.mark.smoke


def _pin(name: str) -> str:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return next(d for d in deps if re.match(rf"{name}\b", d))


def test_running_jax_is_in_the_pinned_range():
    """pyproject's jax pin, _compat's range and the running JAX agree."""
    lo = ".".join(map(str, _compat.MIN_JAX))
    hi = ".".join(map(str, _compat.END_JAX))
    assert _pin("jax") == f"jax>={lo},<{hi}"
    assert _compat.jax_in_supported_range(), jax.__version__
    assert _compat._parse("0.12.0.1") == (0, 12, 0, 1)
    assert _compat._parse("0.11.0.dev20250101") == (0, 11, 0)
    assert _compat._parse("0.11.1rc1") == (0, 11, 1)


def test_pallas_pieces_exist_on_this_jax():
    """Every JAX in the range has both Pallas backends specjax uses (so "auto" picks the
    kernel on a GPU); a JAX without them would make these None with a reason."""
    plgpu, why = _compat.pallas_mosaic_gpu()
    assert plgpu is not None, why
    pltr, why = _compat.pallas_triton()
    assert pltr is not None, why
    assert pltr.CompilerParams(num_warps=4, num_stages=1).num_warps == 4


@pytest.mark.skipif(ON_GPU, reason="interpret mode is the off-GPU path")
def test_interpret_params_are_the_class_pallas_recognizes():
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    p = _compat.interpret_gpu_params()
    assert isinstance(p, InterpretGPUParams)   # pallas_call dispatches on this class
    iota = _compat.mosaic_gpu_strided_iota(jnp.int32, 8)
    np.testing.assert_array_equal(np.asarray(iota), np.arange(8))


def test_shard_map_keywords():
    """``check_vma`` and ``axis_names`` reach jax.shard_map (a psum over the mapped axis)."""
    mesh = Mesh(np.array(jax.devices()[:1]), ("x",))
    x = jnp.arange(4.0)
    for check in (True, False):
        f = _compat.shard_map(lambda a: jax.lax.psum(a, "x") * 2, mesh=mesh, in_specs=P("x"),
                              out_specs=P("x"), axis_names={"x"}, check_vma=check)
        np.testing.assert_array_equal(np.asarray(jax.jit(f)(x)), np.arange(4.0) * 2)
    fn, kw = _compat._shard_map_impl()
    assert kw == "check_vma" and fn is jax.shard_map      # the spelling of 0.10.2-0.12


def test_kernel_backend_auto_and_missing_pallas(monkeypatch):
    assert K.resolve_backend("auto") == "xla"       # XLA on every platform (measured fastest)
    assert K.resolve_backend("pallas") == "pallas"
    monkeypatch.setattr(_compat, "pallas_mosaic_gpu", lambda: (None, "JAX 9.9 has no Mosaic GPU"))
    with pytest.raises(ValueError, match="backend='pallas' is unavailable: JAX 9.9 has no Mosaic"):
        K.resolve_backend("pallas")
    assert K.resolve_backend("auto") == "xla"


class _MD:
    max_query_len = 1
    tree_mask = None


def _resolve(backend="auto"):
    return attn.resolve_attention_backend((4, 4, 16), (8, 4, 2, 16), _MD(), jnp.float32, backend)


def test_attention_auto_on_a_gpu_prefers_pallas_then_triton_then_xla(monkeypatch):
    """``"auto"`` on the GPU: Pallas where it exists, else Triton (jax-triton), else XLA with
    one warning naming the cost; never an error."""
    monkeypatch.setattr(attn, "_platform", lambda: "gpu")
    monkeypatch.setattr(_compat, "_warned", set())
    with warnings.catch_warnings():
        warnings.simplefilter("error")                 # no warning while a kernel exists
        assert _resolve() == "pallas"
        monkeypatch.setattr(_compat, "pallas_triton", lambda: (None, "no Pallas Triton"))
        monkeypatch.setattr(_compat, "jax_triton_available", lambda: (True, ""))
        assert _resolve() == "triton"
    monkeypatch.setattr(_compat, "jax_triton_available", lambda: (False, "no jax-triton"))
    with pytest.warns(UserWarning, match=r"falls back to the XLA reference.*no Pallas Triton.*"
                                         r"no jax-triton.*2\.1x"):
        assert _resolve() == "xla"
    with warnings.catch_warnings():
        warnings.simplefilter("error")                 # once per process
        assert _resolve() == "xla"
    # an explicit choice that cannot run is an error naming why
    with pytest.raises(ValueError, match="attention backend 'pallas' is unavailable: no Pallas"):
        _resolve("pallas")
    # off the GPU "auto" is XLA without a warning
    monkeypatch.setattr(attn, "_platform", lambda: "cpu")
    monkeypatch.setattr(_compat, "_warned", set())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _resolve() == "xla"


def test_smoke_subset_covers_every_area():
    """``-m smoke`` (CI's run on the oldest pins) keeps tests of each area the compat layer
    and the pins touch."""
    areas = ["test_kernels", "test_paged_attention", "test_multi_device", "test_local_argmax",
             "test_proposers_eagle", "test_proposers_medusa", "test_proposers_dflash",
             "test_proposers_draft_model", "test_ngram", "test_suffix", "test_sampler",
             "test_converters", "test_demo_models", "test_cli", "test_engine", "test_training"]
    for name in areas:
        (path,) = (ROOT / "tests").rglob(f"{name}.py")
        assert "pytest.mark.smoke" in path.read_text(), f"{path} has no smoke test"
    markers = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"][
        "ini_options"]["markers"]
    assert any(m.startswith("smoke:") for m in markers)


def test_a_jax_without_pallas_gpu_backends_imports_and_falls_back(tmp_path):
    """With ``jax.experimental.pallas.mosaic_gpu`` and ``.triton`` unimportable (a JAX that
    dropped them), specjax still imports, ``"auto"`` runs, an explicit ``"pallas"`` is
    refused by name, and on a GPU attention falls back with the warning."""
    import subprocess
    import sys

    body = """
import sys, warnings
sys.modules["jax.experimental.pallas.mosaic_gpu"] = None
sys.modules["jax.experimental.pallas.triton"] = None
import jax, jax.numpy as jnp
from specjax import _compat
assert _compat.pallas_mosaic_gpu()[0] is None and _compat.pallas_triton()[0] is None
import specjax.kernels as K
import specjax.kernels.paged_attention.pallas
from specjax.kernels.paged_attention import pallas as pk
from specjax.kernels import paged_attention as attn
assert K.resolve_backend("auto") == "xla"
try:
    K.resolve_backend("pallas")
    raise SystemExit("pallas was not refused")
except ValueError as e:
    assert "no usable Pallas Mosaic GPU" in str(e), e
class MD:
    max_query_len = 1
    tree_mask = None
shape = ((4, 4, 16), (8, 4, 2, 16), MD(), jnp.float32)
assert attn.resolve_attention_backend(*shape, "auto") == "xla"
attn._platform = lambda: "gpu"
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    assert attn.resolve_attention_backend(*shape, "auto") == "xla"
assert len(w) == 1 and "falls back to the XLA reference" in str(w[0].message), w
try:
    attn.resolve_attention_backend(*shape, "pallas")
    raise SystemExit("pallas attention was not refused")
except ValueError as e:
    assert "no Pallas Triton backend" in str(e), e
print("fallback ok")
"""
    proc = subprocess.run([sys.executable, "-c", body], capture_output=True, text=True,
                          timeout=300, env={**__import__("os").environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 0 and "fallback ok" in proc.stdout, proc.stdout + proc.stderr[-4000:]

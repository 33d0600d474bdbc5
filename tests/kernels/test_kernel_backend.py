"""The kernel backend choice: per call, the process default (context manager, setter,
``SPECJAX_KERNEL_BACKEND``) for the index ops and paged attention, their precedence, the
jit cache key, and the deprecated import paths that re-export the moved modules."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax.kernels as K
from specjax.kernels import backend as B
from specjax.kernels import paged_attention as attn

pytestmark = pytest.mark.smoke


class _MD:
    max_query_len = 1
    tree_mask = None


SHAPE = ((4, 4, 16), (8, 4, 2, 16), _MD(), jnp.float32)


def test_default_backend_context_and_setter():
    assert K.get_default_backend() == "auto"
    assert K.resolve_backend("auto") == "xla"          # the index ops' own auto rule
    with K.default_backend("pallas"):
        assert K.get_default_backend() == "pallas"
        assert K.resolve_backend("auto") == "pallas"   # auto consults the default
        assert K.resolve_backend("xla") == "xla"       # a named backend wins
        with K.default_backend("xla"):
            assert K.resolve_backend("auto") == "xla"
        assert K.resolve_backend("auto") == "pallas"
    assert K.get_default_backend() == "auto"
    try:
        K.set_default_backend("xla")
        assert K.resolve_backend("auto") == "xla" and K.get_default_backend() == "xla"
    finally:
        K.set_default_backend("auto")
    for bad in ("mosaic", None, 3):
        with pytest.raises(ValueError, match=r"backend=.* is not one of \('auto', 'xla', 'pallas', 'triton'\)"):
            K.set_default_backend(bad)


def test_default_refused_when_it_cannot_run():
    ok, _ = B._triton_available()
    if ok:
        pytest.skip("this machine runs Triton")
    with K.default_backend("triton"):
        with pytest.raises(ValueError, match="backend='triton' is unavailable"):
            K.resolve_backend("auto")


def test_attention_precedence():
    # per call > process default > auto
    assert attn.resolve_attention_backend(*SHAPE) == "xla"              # CPU auto
    with K.default_backend("pallas"):
        assert attn.resolve_attention_backend(*SHAPE) == "pallas"
        assert attn.resolve_attention_backend(*SHAPE, "xla") == "xla"
        assert attn.resolve_attention_backend(*SHAPE, "auto") == "pallas"
        with K.default_backend("xla"):
            assert attn.resolve_attention_backend(*SHAPE) == "xla"
            assert attn.resolve_attention_backend(*SHAPE, "pallas") == "pallas"
    for gone in ("set_attention_backend", "get_attention_backend", "attention_backend"):
        assert not hasattr(attn, gone), gone


def test_default_is_part_of_the_jit_key():
    traced = []

    @jax.jit
    def f(cu, valid, qsl):
        traced.append(K.get_default_backend())
        return K.eagle_prepare_inputs_padded(cu, valid, qsl)

    cu = jnp.asarray([1, 3], jnp.int32)
    valid = jnp.asarray([2, 1], jnp.int32)
    qsl = jnp.asarray([0, 2, 5], jnp.int32)
    want = f(cu, valid, qsl)
    with K.default_backend("pallas"):
        got = f(cu, valid, qsl)
    f(cu, valid, qsl)
    assert traced == ["auto", "pallas"], traced        # retraced once, then cached again
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def _run(code: str, **env):
    e = dict(os.environ, JAX_PLATFORMS="cpu", **env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=e,
                          timeout=300)


def test_environment_variable():
    code = "import specjax.kernels as K; print(K.get_default_backend(), K.resolve_backend('auto'))"
    r = _run(code, SPECJAX_KERNEL_BACKEND="xla")
    assert r.returncode == 0 and r.stdout.split() == ["xla", "xla"], r.stderr[-2000:]
    # paged attention follows it too
    acode = ("import jax.numpy as jnp\nfrom specjax.kernels import paged_attention as a\n"
             "class MD:\n    max_query_len = 1\n    tree_mask = None\n"
             "print(a.resolve_attention_backend((4, 4, 16), (8, 4, 2, 16), MD(), jnp.float32))")
    r = _run(acode, SPECJAX_KERNEL_BACKEND="pallas")
    assert r.returncode == 0 and r.stdout.split()[-1] == "pallas", r.stderr[-2000:]
    r = _run(code, SPECJAX_KERNEL_BACKEND="cuda")
    assert r.returncode != 0 and "SPECJAX_KERNEL_BACKEND" in r.stderr, r.stderr[-2000:]


def test_wide_integer_inputs_out_of_int32_are_refused():
    """int64 index arrays are accepted when their values fit int32 (then cast), and refused,
    naming the argument, when a value would wrap."""
    cu = np.asarray([1, 3], np.int64)
    valid = np.asarray([2, 1], np.int64)
    ok = K.eagle_prepare_inputs_padded(cu, valid, np.asarray([0, 2, 5], np.int64))
    want = K.eagle_prepare_inputs_padded(cu.astype(np.int32), valid.astype(np.int32),
                                         np.asarray([0, 2, 5], np.int32))
    for g, w in zip(ok, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    big = np.asarray([0, 2, 2 ** 31 + 5], np.int64)
    with pytest.raises(ValueError, match=r"query_start_loc \(int64\) holds values outside int32"):
        K.eagle_prepare_inputs_padded(cu, valid, big)
    with pytest.raises(ValueError, match=r"positions \(uint32\) holds values outside int32"):
        K.eagle_step_update_slot_mapping_and_metadata(
            np.asarray([2 ** 31], np.uint32), np.zeros((1, 2), np.int32), np.ones(1, np.int32),
            block_size=16, max_model_len=64)

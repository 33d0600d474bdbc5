"""The jax-triton twin of the flash-attention kernel (kernels/paged_attention/triton_flash.py).

CPU: the kernel under Triton's interpreter against the float64 oracle of
test_flash_attention.py (its float32 cases: ragged prefill chunks, decode rows, trees,
non-causal, sliding windows, sinks; an empty batch), compiled to PTX for an H200 as
jax-triton compiles it (shared memory within a block's 227 KiB), and the backend switch:
``"triton"`` runs it past the decode kernel's rows, ``"auto"`` when JAX has no Pallas
Triton backend. GPU: against the reference and the Pallas flash kernel on 8B-shaped
prefill batches. The first two need ``triton`` (and the interpreter ``torch`` and NumPy <
2.4): they skip without them, as in CI's CPU install.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax.kernels as K
from specjax import _compat
from specjax.kernels import paged_attention as attn
from specjax.kernels.paged_attention import flash, partition
from test_flash_attention import CASES, WINDOW_CASES, assert_close, make_batch
from test_paged_attention import _interpreter_ready, random_tree, run_interpreter


@pytest.mark.skipif(_interpreter_ready() is not None,
                    reason=f"needs triton, torch and numpy < 2.4: {_interpreter_ready()}")
def test_triton_flash_kernel_under_the_interpreter():
    """``tests/support/triton_interpret_flash.py`` in a subprocess (``TRITON_INTERPRET=1``
    must be set before triton is imported): every float32 case within 1e-5 of the oracle,
    padding tokens zero, an empty batch all zeros."""
    cases = 2 * sum(c.dtype == "float32" for c in {**CASES, **WINDOW_CASES}.values()) + 1
    run_interpreter("triton_interpret_flash.py", f"triton flash interpreter: {cases} cases ok")


@pytest.mark.parametrize("t,nh,nkv,hd,dt,kw", [
    (8192, 32, 8, 128, "bf16", {}),                                  # an 8B-shaped prefill
    (512, 8, 4, 256, "fp32", {}),                                    # head_dim 256, fp32
    (64, 32, 4, 64, "bf16", dict(tree=6, sliding_window=128, sinks=True)),
    (2048, 16, 2, 128, "fp16", dict(sliding_window=4096, causal=False)),
    (4096, 64, 8, 128, "bf16", {})])                                 # GQA 8
def test_triton_flash_compiles_for_h200(t, nh, nkv, hd, dt, kw):
    """The kernel compiled to PTX for sm_90 on the CPU as jax-triton compiles it
    (``ASTSource``: constexprs only from ``launch_plan``'s meta), within an H200's 227 KiB
    of shared memory a block."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from specjax.kernels.paged_attention import triton_flash as tf

    kw = dict(kw)
    tree = kw.pop("tree", None)
    plan = tf.launch_plan((t, nh, hd), (4096, 16, nkv, hd), (8, 512), scale=0.1,
                          max_query_len=t, dtype=dict(bf16=jnp.bfloat16, fp16=jnp.float16,
                                                      fp32=jnp.float32)[dt],
                          tree_mask=None if tree is None
                          else random_tree(np.random.default_rng(0), tree), **kw)
    ptrs = ("*i32",) * 5 + (f"*{dt}",) * 4
    fn = tf._flash_kernel
    sig = dict(zip(fn.arg_names, ptrs), **{k: "constexpr" for k in plan["meta"]})
    out = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=dict(plan["meta"])),
                         target=GPUTarget("cuda", 90, 32),
                         options=dict(num_warps=plan["num_warps"], num_stages=plan["num_stages"]))
    assert ".entry" in out.asm["ptx"]
    assert out.metadata.shared <= 227 * 1024, out.metadata.shared


def test_launch_plan_matches_the_pallas_kernel():
    """The twin tiles as ``flash.py`` does: the same rows, key block, warps and programs;
    shapes the Pallas kernel refuses, it refuses by the same reason."""
    pytest.importorskip("triton")
    from specjax.kernels.paged_attention import triton_flash as tf

    plan = tf.launch_plan((8192, 32, 128), (4096, 16, 8, 128), (8, 512), scale=0.1,
                          max_query_len=8192, dtype=jnp.bfloat16)
    rows, block_k, warps, stages = flash.flash_config(head_dim=128, group=4, max_query_len=8192)
    assert (plan["meta"]["ROWS"], plan["meta"]["BLOCK_K"], plan["num_warps"],
            plan["num_stages"]) == (rows, block_k, warps, stages) == (128, 64, 4, 3)
    assert plan["grid"] == (8192 // (rows // 4) + 8, 8) and plan["tq"] == rows // 4
    with pytest.raises(ValueError, match="head_dim=48 is not a power of two"):
        tf.launch_plan((64, 8, 48), (64, 16, 2, 48), (2, 4), scale=0.1, max_query_len=64)
    with pytest.raises(ValueError, match="sliding_window=0"):
        tf.launch_plan((64, 8, 64), (64, 16, 2, 64), (2, 4), scale=0.1, max_query_len=64,
                       sliding_window=0)


def test_triton_backend_runs_the_twin_past_the_decode_rows(monkeypatch):
    """``backend="triton"`` past the decode kernel's rows resolves to ``"triton"`` (it ran
    the XLA reference before) and calls the twin; below them, the decode kernel.
    ``"auto"`` on a GPU without the Pallas Triton backend picks the twin for a prefill."""
    c = CASES["f32-hd64-g4"]                                # 40 queries x G 4 > 128 rows
    q, cache, md, _ = make_batch(c, 3)
    short = md.replace(max_query_len=8)
    monkeypatch.setattr(_compat, "jax_triton_available", lambda: (True, ""))
    resolve = attn.resolve_attention_backend
    assert resolve(q.shape, cache.k.shape, md, backend="triton") == "triton"
    assert resolve(q.shape, cache.k.shape, short, backend="triton") == "triton"
    monkeypatch.setattr(attn, "_platform", lambda: "gpu")
    monkeypatch.setattr(_compat, "pallas_triton", lambda: (None, "no Pallas Triton here"))
    assert resolve(q.shape, cache.k.shape, md, backend="auto") == "triton"
    monkeypatch.setattr(_compat, "jax_triton_available", lambda: (False, "no jax-triton"))
    assert resolve(q.shape, cache.k.shape, md, backend="auto") == "xla"

    called = []
    kernels = {}
    for mod in ("triton_flash", "triton"):
        fake = type(sys)(f"specjax.kernels.paged_attention.{mod}")
        fake.paged_attention = lambda *a, _m=mod, **kw: called.append(
            (_m, kw["max_query_len"])) or jnp.zeros_like(a[0])
        kernels[mod] = fake
        monkeypatch.setitem(sys.modules, fake.__name__, fake)
        monkeypatch.setattr(attn, mod, fake, raising=False)
    args = (q, cache.k, cache.v, md.query_start_loc, md.seq_lens, md.block_table)
    partition.kernel_attention(partition.static("triton", md, 0.2), *args)
    partition.kernel_attention(partition.static("triton", short, 0.2), *args)
    assert called == [("triton_flash", c.qmax), ("triton", 8)]


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["prefill-1k", "ragged", "window-sinks", "tree", "noncausal"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_gpu_triton_flash_matches_reference_and_pallas(case, dtype):
    """The compiled twin (8B-shaped heads: 32 query, 8 kv heads, head_dim 128) against the
    float32 reference (the oracle for windows and sinks) and the Pallas flash kernel."""
    from specjax.kernels.paged_attention import triton_flash as tf
    from test_flash_attention import Case, oracle

    base = dict(nh=32, nkv=8, hd=128, bs=16, dtype=dtype)
    c = {"prefill-1k": Case(width=64, t_pad=1024 + 8, b_pad=2, qmax=1024, **base),
         "ragged": Case(width=32, t_pad=600, b_pad=9, qmax=300, **base),
         "window-sinks": Case(width=32, t_pad=600, b_pad=9, qmax=300, window=100, sinks=True,
                              **base),
         "tree": Case(width=32, t_pad=64, b_pad=9, qmax=6, tree=6, rows=32, **base),
         "noncausal": Case(width=32, t_pad=600, b_pad=9, qmax=300, causal=False, **base)}[case]
    q, cache, md, sinks = make_batch(c, 7)
    scale = 128 ** -0.5
    kw = dict(scale=scale, max_query_len=md.max_query_len, causal=md.causal,
              tree_mask=md.tree_mask, sliding_window=c.window, rows=c.rows)
    args = (q, cache.k, cache.v, md.query_start_loc, md.seq_lens, md.block_table, sinks)
    got = jax.jit(lambda *a: tf.paged_attention(*a, **kw))(*args)
    pallas = jax.jit(lambda *a: flash.paged_attention(*a, **kw))(*args)
    tol = 2e-5 if dtype == "float32" else 2e-2
    if c.window or c.sinks:
        want = oracle(q, cache, md, scale, window=c.window, sinks=sinks)
    else:
        with jax.default_matmul_precision("highest"):
            want = jax.jit(lambda q, c_, m: attn.paged_attention_xla(q, c_, m, scale=scale))(
                q, cache, md)
    assert_close(got, want, tol, f"triton flash {case} {dtype}")
    assert_close(got, pallas, tol, f"triton vs pallas flash {case} {dtype}")
    end = int(md.query_start_loc[-1])
    assert np.all(np.asarray(got[end:], np.float32) == 0)
    with K.default_backend("triton"):
        assert attn.resolve_attention_backend(q.shape, cache.k.shape, md, q.dtype) == "triton"

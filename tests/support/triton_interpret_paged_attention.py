"""Run the Triton paged-attention kernels (kernels/paged_attention/triton.py) under Triton's
interpreter on CPU and compare them with the NumPy oracle of tests/kernels/test_paged_attention.py.

Needs ``triton`` and ``torch`` (the interpreter takes torch tensors); run as a script with
``TRITON_INTERPRET=1`` set before anything imports triton (tests/kernels/test_paged_attention.py's
``test_triton_kernel_under_the_interpreter`` does it in a subprocess, and skips without
them). Prints one ``ok <case>`` line per case and exits non-zero on the first mismatch.
The cases: every float32 configuration of ``CPU_CFGS`` (GQA 1/2/3/4, causal / non-causal /
tree, 1-3 context splits, block sizes below / at / above the key tile), two seeds each, plus
an empty-batch edge (no request: zeros), plus every float32 case of
tests/kernels/test_window_sinks_kernels.py (sliding windows, sinks; the window oracle of
test_flash_attention.py). Not bfloat16: Triton 3.6's interpreter computes
bfloat16 dots and casts wrongly (a 16 x 16 ``tl.dot`` of bfloat16 inputs is off by ~1e10), so
bfloat16 is checked on the GPU only (``test_gpu_kernel_matches_reference[triton-*]``). With
NumPy >= 2.4 the interpreter cannot run a loop with loaded bounds (it converts a
one-element array with ``int()``): use NumPy < 2.4.
"""

from __future__ import annotations

import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1", "set TRITON_INTERPRET=1"

import jax  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from suite_paths import SEARCH_PATH  # noqa: E402

sys.path[:0] = list(SEARCH_PATH)
from test_paged_attention import CPU_CFGS, make_case, oracle, random_tree  # noqa: E402
import test_flash_attention  # noqa: E402
import test_window_sinks_kernels as wsk  # noqa: E402

from specjax.kernels.paged_attention import triton as tpa  # noqa: E402

_TORCH = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _t(x, dtype=None):
    a = np.asarray(x.astype(np.float32) if x.dtype == jax.numpy.bfloat16 else x)
    t = torch.from_numpy(np.ascontiguousarray(a))
    return t.to(dtype) if dtype is not None else t


def run(q, cache, md, scale, *, block_k, num_splits, window=None, sinks=None):
    """Both kernels launched as the jax-triton wrapper launches them (``launch_plan``)."""
    dt = _TORCH[str(q.dtype)]
    plan = tpa.launch_plan(q.shape, cache.k.shape, md.block_table.shape, scale=scale,
                           max_query_len=md.max_query_len, causal=md.causal,
                           tree_mask=md.tree_mask, block_k=block_k, num_splits=num_splits,
                           dtype=q.dtype, sliding_window=window, sinks=sinks is not None)
    aux = tpa.aux_buffer(plan["tree_bits"], None if sinks is None else np.asarray(sinks))
    a, mg = plan["attention"], plan["merge"]
    qsl = _t(md.query_start_loc).to(torch.int32)
    o, m, l = (torch.full(s, float("nan"), dtype=torch.float32) for s in a["out_shapes"])
    tpa._attention_kernel[a["grid"]](
        qsl, _t(md.seq_lens).to(torch.int32), _t(md.block_table).to(torch.int32),
        torch.from_numpy(np.ascontiguousarray(aux)), _t(q, dt), _t(cache.k, dt), _t(cache.v, dt),
        o, m, l, num_warps=a["num_warps"], **a["meta"])
    out = torch.full(tuple(q.shape), float("nan"), dtype=dt)
    tpa._merge_kernel[mg["grid"]](qsl, o, m, l, out, num_warps=mg["num_warps"], **mg["meta"])
    return out.to(torch.float64).numpy()


def main():
    n = 0
    for name, cfg in CPU_CFGS.items():
        if cfg.dtype != "float32":
            continue
        for seed in (1, 2):
            tree = random_tree(np.random.default_rng(seed), cfg.qmax) if cfg.tree else None
            q, cache, md = make_case(cfg, seed, tree)
            scale = cfg.hd ** -0.5
            got = run(q, cache, md, scale, block_k=cfg.block_k, num_splits=cfg.num_splits)
            want = oracle(q, cache, md, scale)
            tol = 1e-5
            err = float(np.max(np.abs(got - want)))
            end = int(md.query_start_loc[-1])
            assert np.isfinite(got).all(), f"{name} seed {seed}: an output element not written"
            assert err <= tol, f"{name} seed {seed}: max abs error {err:.3g} > {tol}"
            assert (got[end:] == 0).all(), f"{name} seed {seed}: padding tokens not zero"
            print(f"ok {name} seed={seed} err={err:.2e}", flush=True)
            n += 1
    # no request with queries at all (every token padding): zeros everywhere
    cfg = CPU_CFGS["f32-g1-causal"]
    q, cache, md = make_case(cfg, 3)
    md = md.replace(query_start_loc=md.query_start_loc * 0, seq_lens=md.seq_lens * 0)
    got = run(q, cache, md, 0.25, block_k=cfg.block_k, num_splits=cfg.num_splits)
    assert (got == 0).all(), "empty batch: not all zeros"
    print("ok empty-batch", flush=True)
    n += 1
    for name, w in wsk.CASES.items():
        if w.cfg.dtype != "float32":
            continue
        q, cache, md, sinks = wsk.case(name, 11)
        scale = w.cfg.hd ** -0.5
        got = run(q, cache, md, scale, block_k=w.cfg.block_k, num_splits=w.cfg.num_splits,
                  window=w.window, sinks=sinks)
        want = test_flash_attention.oracle(q, cache, md, scale, window=w.window, sinks=sinks)
        err = float(np.max(np.abs(got - want)))
        assert np.isfinite(got).all() and err <= 1e-5, f"{name}: max abs error {err:.3g}"
        print(f"ok {name} err={err:.2e}", flush=True)
        n += 1
    print(f"triton interpreter: {n} cases ok")


if __name__ == "__main__":
    main()

"""Run the Triton flash-attention kernel (kernels/paged_attention/triton_flash.py) under
Triton's interpreter on CPU against the NumPy float64 oracle of
tests/kernels/test_flash_attention.py, on its float32 cases (ragged prefill chunks, decode
rows, trees, non-causal, sliding windows, sinks) and an empty batch.

Needs ``triton``, ``torch`` (the interpreter takes torch tensors) and NumPy < 2.4; run as a
script with ``TRITON_INTERPRET=1`` set before anything imports triton (test_flash_attention.py's
``test_triton_flash_kernel_under_the_interpreter`` does it in a subprocess, and skips
without them). Prints one ``ok <case>`` line per case and exits non-zero on the first
mismatch. Not bfloat16: Triton 3.6's interpreter computes bfloat16 dots wrongly
(tests/support/triton_interpret_paged_attention.py says how); the GPU test covers it.
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
import test_flash_attention as tfa  # noqa: E402

from specjax.kernels.paged_attention import flash  # noqa: E402
from specjax.kernels.paged_attention import triton as tpa  # noqa: E402
from specjax.kernels.paged_attention import triton_flash as tf  # noqa: E402


def _t(x):
    return torch.from_numpy(np.ascontiguousarray(np.asarray(x)))


def run(c, q, cache, md, sinks, scale):
    """The kernel launched as the jax-triton wrapper launches it (``launch_plan``), the
    padding tokens zeroed as the wrapper zeroes them."""
    plan = tf.launch_plan(q.shape, cache.k.shape, md.block_table.shape, scale=scale,
                          max_query_len=md.max_query_len, causal=md.causal,
                          tree_mask=md.tree_mask, sliding_window=c.window,
                          sinks=sinks is not None, rows=c.rows, block_k=c.block_k,
                          dtype=q.dtype)
    prog = flash._programs(md.query_start_loc, plan["tq"], plan["grid"][0])
    aux = tpa.aux_buffer(np.asarray(plan["tree_bits"], np.int32),
                         None if sinks is None else np.asarray(sinks))
    out = torch.full(tuple(q.shape), float("nan"), dtype=torch.float32)
    tf._flash_kernel[plan["grid"]](
        _t(prog), _t(md.query_start_loc).to(torch.int32), _t(md.seq_lens).to(torch.int32),
        _t(md.block_table).to(torch.int32), _t(aux), _t(q), _t(cache.k), _t(cache.v), out,
        num_warps=plan["num_warps"], **plan["meta"])
    got = out.to(torch.float64).numpy()
    end = int(md.query_start_loc[-1])
    assert np.isfinite(got[:end]).all(), "an output element of a query token not written"
    got[end:] = 0.0
    return got


def main():
    n = 0
    cases = {**tfa.CASES, **tfa.WINDOW_CASES}
    for name, c in cases.items():
        if c.dtype != "float32":
            continue
        for seed in (1, 2):
            q, cache, md, sinks = tfa.make_batch(c, 10 * seed + len(name))
            scale = c.hd ** -0.5
            got = run(c, q, cache, md, sinks, scale)
            want = tfa.oracle(q, cache, md, scale, window=c.window, sinks=sinks)
            err = float(np.max(np.abs(got - want)))
            assert err <= 1e-5, f"{name} seed {seed}: max abs error {err:.3g} > 1e-5"
            print(f"ok {name} seed={seed} err={err:.2e}", flush=True)
            n += 1
    # no request with queries at all: every program empty, nothing written
    c = tfa.CASES["f32-hd64-g4"]
    q, cache, md, _ = tfa.make_batch(c, 3)
    md = md.replace(query_start_loc=md.query_start_loc * 0, seq_lens=md.seq_lens * 0)
    got = run(c, q, cache, md, None, 0.25)
    assert (got == 0).all(), "empty batch: not all zeros"
    print("ok empty-batch", flush=True)
    print(f"triton flash interpreter: {n + 1} cases ok")


if __name__ == "__main__":
    main()

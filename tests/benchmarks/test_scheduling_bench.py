"""``benchmarks/scheduling.py`` (issue 51: decoding beside a chunked long prefill, and a
Poisson workload with and without chunked prefill) on CPU: ``--cpu-smoke`` gives every
row with its fields, every running request a token in every step of the long prompt's
prefill, and both tables; the workload is seeded and in its ranges."""

import suite_paths  # tests/support: where the suite's pieces are
import json
import math
import sys
import types

import numpy as np
import pytest


sys.path.insert(0, str(suite_paths.BENCHMARKS))

import scheduling  # noqa: E402

ITL_FIELDS = ("method", "k", "chunk", "steps", "tokens_in_window", "every_step", "itl_p50_ms",
              "itl_p99_ms", "step_ms_p50", "floor_ms_p50", "ratio_p50", "ratio_max", "itl_x_floor",
              "gemm_tflops", "goal_met", "compiles", "compile_s")
MIXED_FIELDS = ("method", "chunked", "budget", "max_num_seqs", "num_blocks", "throughput_tok_s",
                "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "tpot_p50_ms",
                "num_preemptions", "output_tokens", "elapsed_s", "compiles", "compile_s")


@pytest.mark.slow   # 8 engines compiled, plain and EAGLE-3
def test_cpu_smoke_rows_and_every_step_gave_every_running_request_a_token(tmp_path, capsys):
    out = tmp_path / "sched.json"
    assert scheduling.main(["--cpu-smoke", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    rows = doc["rows"]
    assert not [r for r in rows if "error" in r]
    itl = {(r["method"], r["chunk"]): r for r in rows if r["kind"] == "itl"}
    assert set(itl) == {(m, c) for m in ("plain", "eagle3") for c in (32, 64)}
    for (m, c), r in itl.items():
        assert all(f in r for f in ITL_FIELDS), (m, c)
        assert r["every_step"] is True, r
        assert r["steps"] >= math.ceil(256 / c) and r["tokens_in_window"] == [r["steps"]] * 2
        assert r["itl_n"] > 0 and 0 < r["itl_p50_ms"] <= r["itl_p99_ms"]
        assert r["chunk_steps"] >= 1 and r["step_ms_p50"] > 0 and r["floor_ms_p50"] > 0
        assert r["ratio_p50"] > 0 and r["compiles"] == 0      # the warm-up run compiled them
    mixed = {(r["method"], r["chunked"]): r for r in rows if r["kind"] == "mixed"}
    assert set(mixed) == {(m, c) for m in ("plain", "eagle3") for c in (True, False)}
    for (m, chunked), r in mixed.items():
        assert all(f in r for f in MIXED_FIELDS), (m, chunked)
        assert r["num_requests"] == 6 and r["max_num_seqs"] == 6 and r["num_blocks"] == 20
        assert r["budget"] == (2048 if chunked else r["max_model_len"])
        assert r["throughput_tok_s"] > 0 and 0 < r["ttft_p50_ms"] <= r["ttft_p99_ms"]
        assert r["num_preemptions"] >= 0 and r["output_tokens"] > 0
    table = capsys.readouterr().out
    assert "| method | chunk | steps | every step a token |" in table
    assert "| method | chunked | budget |" in table and "| plain | 32 | " in table


def test_workload_is_seeded_and_in_range():
    a = types.SimpleNamespace(seed=3, num_requests=200, prompt_range=[16, 4096], output_range=[8, 32],
                              rate=10.0)
    prompts, outs, arrivals = scheduling.workload(a, 256)
    again = scheduling.workload(a, 256)
    assert (prompts, outs, arrivals) == again
    lens = np.array([len(p) for p in prompts])
    assert lens.min() >= 16 and lens.max() <= 4096 and np.median(lens) < 1024  # log-uniform
    assert min(outs) >= 8 and max(outs) <= 32
    assert arrivals[0] == 0 and all(b >= a for a, b in zip(arrivals, arrivals[1:]))
    assert 8 < len(arrivals) / arrivals[-1] < 12.5        # about --rate per second


def test_delivery_gaps_count_distinct_times_in_the_window():
    times = [0.0, 1.0, 1.0, 3.0, 6.0, 6.0, 10.0]
    assert scheduling.delivery_gaps(times) == [1.0, 2.0, 3.0, 4.0]
    assert scheduling.delivery_gaps(times, 1.0, 6.0) == [2.0, 3.0]


def test_largest_live_arrays_groups_by_dtype_and_shape_largest_first():
    import jax.numpy as jnp

    keep = [jnp.zeros((256, 1024), jnp.float32) for _ in range(3)] + [jnp.ones((8,), jnp.int32)]
    top = scheduling.largest_live_arrays(n=50)
    mine = [s for s in top if s.endswith("float32[256, 1024]")]
    assert mine and mine[0].split()[2] in {f"x{c}" for c in range(3, 100)}
    assert float(mine[0].split()[0]) >= 3 * 256 * 1024 * 4 / 2**30 - 1e-3
    sizes = [float(s.split()[0]) for s in top]
    assert sizes == sorted(sizes, reverse=True)
    del keep

"""Issue 50's CPU goal through ``benchmarks/prefill_rss.py``: ``Engine(demo target,
max_model_len=16384)`` prefills a 16k-token prompt (default options: chunked prefill on a
CPU, the tiled attention reference) with the process's peak RSS rising by at most the
weights + the KV + 256 MB (a child process; ~30 s on two cores)."""

import suite_paths  # tests/support: where the suite's pieces are
import json
import os
import subprocess
import sys


def test_16k_prefill_peak_rss_is_bounded():
    script = suite_paths.BENCHMARKS / "prefill_rss.py"
    env = dict(os.environ, JAX_DISABLE_MOST_OPTIMIZATIONS="0")   # a long run, not compiles
    p = subprocess.run([sys.executable, str(script), "--methods", "none", "--new", "4"],
                       capture_output=True, text=True, timeout=600, check=False, env=env)
    assert p.returncode in (0, 1), p.stderr[-4000:]
    row = json.loads(p.stdout.strip().splitlines()[-1])
    assert row["prompt_tokens"] == 16384 - 64 and row["max_num_batched_tokens"] == 2048
    assert row["rss_rise_mb"] <= row["bound_mb"], row

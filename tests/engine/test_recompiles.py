"""Zero recompiles with requests joining and leaving (issue 21): ``benchmarks/recompiles.py``
warms an ``Engine`` up for its buckets, then serves streams of requests (mixed prompt
lengths, max_tokens, EOS / stop ids, greedy and seeded-sampled rows; more requests than
rows, so finished rows are refilled) and counts every compilation after the warm-up
(``jax.monitoring``'s backend-compile events and ``jax.log_compiles`` records). A fast
variant (~50 iterations) per mode, and the 1,000-iteration run (``-m slow``)."""

import io
import sys

import pytest

from specjax.engine import Engine

try:
    from test_engine import METHODS, MML, build, fixed, target  # noqa: F401
except ImportError:  # tests/ made a package
    from tests.test_engine import METHODS, MML, build, fixed, target  # noqa: F401

import suite_paths  # noqa: E402  (tests/support)

sys.path.insert(0, str(suite_paths.BENCHMARKS))
import recompiles as bench  # noqa: E402

# FIXED: one batch bucket (4 rows), one query bucket (16: prompts of up to 15 tokens and the
# decode steps), one context bucket; prompts + max_tokens stay under max_model_len = 48
WORK = dict(vocab=64, max_prompt=14, max_tokens=MML - 16)


def _engine(method, n, overlap=False):
    prop = None if method is None else build(method, 3)
    return Engine(target(), prop, max_num_seqs=4, **fixed(steps_per_sync=n, overlap=overlap))


@pytest.mark.parametrize("method,n,overlap", [(None, 1, False), ("eagle3", 4, False),
                                              ("eagle3", 1, True), ("eagle3", 4, True)])
def test_no_recompile_after_warmup(method, n, overlap):
    log = io.StringIO()
    out = bench.run(_engine(method, n, overlap), iters=50, log=log, **WORK)
    assert out["iterations"] >= 50 and out["joins"] > 0, log.getvalue()
    assert out["generate_calls"] >= 1 and out["tokens"] > out["iterations"] // 2
    assert out["compiles"] == 0 and out["compile_logs"] == [], log.getvalue()
    assert "backend compiles after warm-up: 0" in log.getvalue()


def test_the_counter_sees_a_compile(no_compilation_cache):
    """The counter can fail: an engine warmed up for the greedy variants only compiles the
    sampled ones inside the run, and both counts see it (compiled programs dropped first:
    an earlier test may have compiled them)."""
    import jax

    jax.clear_caches()
    eng = _engine(None, 1)
    real = eng.warmup
    eng.warmup = lambda b, q, **kw: real(b, q, all_greedy=(True,), stop_pads=kw["stop_pads"])
    out = bench.run(eng, iters=10, **WORK)
    assert out["compiles"] > 0 and out["compile_logs"]


@pytest.mark.slow
def test_thousand_iterations_no_recompile(tmp_path):
    path = tmp_path / "recompiles.log"
    with open(path, "w") as log:
        out = bench.run(_engine("eagle3", 8), iters=1000, log=log, **WORK)
    assert out["iterations"] >= 1000 and out["joins"] > 100
    assert out["compiles"] == 0 and out["compile_logs"] == [], path.read_text()

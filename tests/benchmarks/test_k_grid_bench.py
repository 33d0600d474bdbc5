"""``benchmarks/k_grid.py`` (issue 55): the best-static-k arithmetic on a hand-made cost
table, and one tiny CPU run producing the tables, schedules, a direct check and the
adaptive policies' rows, the mixed and the falling cells."""

import suite_paths  # tests/support: where the suite's pieces are
import json
import sys

import numpy as np
import pytest


sys.path.insert(0, str(suite_paths.BENCHMARKS))

import k_grid  # noqa: E402


def test_expected_tokens_best_k_and_schedule():
    assert k_grid.expected_tokens(0.5, 0) == 1 and k_grid.expected_tokens(0.5, 2) == 1.75
    assert k_grid.expected_tokens(1.0, 3) == 4
    # k costs 10% a draft at B=1, 60% at B=64: drafting pays at B=1 only when a is high
    cost = {1: {0: 10.0, 1: 11.0, 2: 12.0}, 64: {0: 10.0, 1: 16.0, 2: 22.0}}
    assert k_grid.best_k(cost, 1, 0.9)[0] == 2 and k_grid.best_k(cost, 64, 0.3)[0] == 0
    assert k_grid.best_k(cost, 64, 0.3)[1] == pytest.approx(64 / 0.010)
    assert k_grid.schedule(cost, 0.3) == [[1, 63, 1], [64, 1 << 16, 0]]   # 1.3/11 > 1.39/12
    assert k_grid.schedule(cost, 0.95) == [[1, 1 << 16, 2]]


@pytest.mark.parametrize("a,k", [(0.3, 7), (0.7, 3), (0.9, 7), (0.5, 1)])
def test_tokens_bound_covers_simulated_runs(a, k):
    """Requests' sizing: every one of 20,000 simulated requests of 300 iterations (accepted
    prefix by independent conditional draws at rate a) stays inside the bound, and the bound
    is within 6 standard deviations of the simulated mean, not the worst case."""
    rng = np.random.default_rng(1)
    draws = rng.random((20_000, 300, k)) < a
    accepted = np.cumprod(draws, axis=-1).sum(-1)          # the accepted prefix's length
    totals = (accepted + 1).sum(-1)
    bound = k_grid.tokens_bound(a, k, 300)
    assert totals.max() <= bound
    assert bound <= totals.mean() + 6.5 * totals.std() + k + 1
    assert bound < 300 * (k + 1) and k_grid.tokens_bound(1.0, k, 300) == 300 * (k + 1)
    assert k_grid.tokens_bound(a, 0, 300) == 300


def test_tiny_run(tmp_path, capsys):
    out = tmp_path / "kg.json"
    assert k_grid.main(["--target", "tiny", "--batch", "2", "--kmax", "1", "--iters", "2",
                        "--repeat", "1", "--context", "16", "--rates", "0.5", "--check", "2:0.5",
                        "128:0.9", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert set(doc["cost_ms"]["2"]) == {"0", "1"} and all(v > 0 for v in doc["cost_ms"]["2"].values())
    assert doc["schedules"]["0.5"][0][:2] == [1, 1 << 16] and len(doc["checks"]) == 1
    printed = capsys.readouterr().out           # a cell of a batch not run: skipped
    assert "num_speculative_tokens_per_batch_size=" in printed and "128:0.9" in printed
    log = tmp_path / "kg.log"        # its log's table, reused (--cost) instead of measured
    log.write_text(printed)
    assert k_grid.main(["--target", "tiny", "--batch", "2", "--kmax", "1", "--iters", "2",
                        "--repeat", "1", "--context", "16", "--rates", "0.5", "--cost", str(log),
                        "--json", str(out)]) == 0
    reused = json.loads(out.read_text())["cost_ms"]["2"]
    assert reused == {k: round(v, 3) for k, v in doc["cost_ms"]["2"].items()}
    with pytest.raises(SystemExit, match=r"no t\(B, k\) for .*\(4, 0\)"):
        k_grid.main(["--target", "tiny", "--batch", "2,4", "--kmax", "1", "--cost", str(log)])
    with pytest.raises(SystemExit, match="query buckets pow2, not exact"):
        k_grid.main(["--target", "tiny", "--batch", "2", "--kmax", "1", "--cost", str(log),
                     "--query-buckets", "exact"])
    log.write_text(printed.replace("; jax ", "; jax 0; Other GPU; x; ", 1))
    with pytest.raises(SystemExit, match="measured on 'Other GPU'"):
        k_grid.main(["--target", "tiny", "--batch", "2", "--kmax", "1", "--cost", str(log)])
    assert k_grid.main(["--target", "tiny", "--batch", "2", "--kmax", "1", "--iters", "2",
                        "--repeat", "1", "--context", "16", "--rates", "0.9", "--policies",
                        "adaptive_k", "adaptive_verification", "--policy-warmup", "4",
                        "--mixed", "1.0,0.0", "--forced-costs", "--falling", "1.0,0.0",
                        "--falling-iters", "8,16", "--static-iters", "4", "--explore", "0.25",
                        "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["explore"] == [0.25]
    (mix,) = doc["mixed"]        # even rows accept every draft, odd rows none
    t = {int(k): v for k, v in doc["cost_ms"]["2"].items()}
    want = max(t, key=lambda k: (k + 1 + 1) / 2 / t[k])     # E(1, k) = k + 1, E(0, k) = 1
    assert mix["best_k"] == want and mix["static_tps"] > 0 and mix["adaptive_k_tps"] > 0
    assert sum(mix["choices"].values()) >= 1     # counted inside the window only
    # every choice forced and timed beside its profiled cost (kmax 1: rows of 1 or 2 tokens)
    assert [f["choice"] for f in mix["forced"]] == ["0", "1"]
    assert all(f["profiled_ms"] > 0 and f["measured_ms"] > 0 for f in mix["forced"])
    assert [f["tokens_per_iter"] for f in mix["forced"]][0] == 1
    (fall,) = doc["falling"]     # every K compiled before the window; the switch inside it
    assert fall["recompiles"] == 0 and fall["k_per_call"].count("|") == 1
    assert fall["switch"] < fall["iters"] and len(fall["windows_vs_best"]) >= 1
    assert all(x in (0, 1) for x in fall["k_per_call"] if x != "|")
    # each phase against static K forced on the same engine: the predicted best among them
    for g, best, ratio in zip(fall["static_tps"], fall["best_k"],
                              (fall["phase1_vs_static"], fall["phase2_vs_static"])):
        assert str(best) in g and all(v > 0 for v in g.values()) and ratio > 0
    rows = doc["policies"]
    assert [r["policy"] for r in rows] == ["adaptive_k", "adaptive_verification"]
    assert all(r["tokens_per_s"] > 0 and r["vs_best"] > 0 and r["best_k"] in (0, 1) for r in rows)
    with pytest.raises(SystemExit):
        k_grid.main(["--rates", "1.5"])
    with pytest.raises(SystemExit):
        k_grid.main(["--mixed", "0.5"])
    with pytest.raises(SystemExit):
        k_grid.main(["--falling-iters", "8"])

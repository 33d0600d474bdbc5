"""``benchmarks/grouped_tiles.py`` (issue 54) on CPU with the tiny MoE geometry: every
(T, GEMM) gets its ``ragged_dot``, ``dense`` and per-configuration Pallas rows, floors from
the touched experts, and the closing table keeps the fastest Pallas row."""

import suite_paths  # tests/support: where the suite's pieces are
import json
import sys

import pytest

sys.path.insert(0, str(suite_paths.BENCHMARKS))

import grouped_tiles  # noqa: E402
import moe  # noqa: E402


def test_cpu_smoke_rows_floors_and_best(tmp_path, capsys):
    out = tmp_path / "t.json"
    assert grouped_tiles.main(["--geometry", "tiny", "--tokens", "1,3", "--block-n", "16,32",
                               "--block-k", "16", "--split-k", "1,2", "--num-warps", "4", "--num-stages", "2",
                               "--layers", "2", "--iters", "2", "--pair-max", "4",
                               "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    geo = moe.GEOMETRIES["tiny"]
    for t in (1, 3):
        for gemm, (k, n) in (("gate_up", (64, 64)), ("down", (32, 64))):
            mine = [r for r in rows if (r["tokens"], r["gemm"]) == (t, gemm)]
            pairs = 4 if t == 1 else 0            # --pair-max 4: T = 1's 2 pairs only
            assert sorted(r["impl"] for r in mine) == (["dense"] + ["pair"] * pairs
                                                       + ["pallas"] * 4 + ["ragged_dot"])
            touched = mine[0]["touched"]
            assert geo["num_experts_per_tok"] <= touched <= min(t * 2, geo["num_experts"])
            assert mine[0]["floor_ms"] == pytest.approx(touched * k * n * 4 / 4.3e9)
    best = grouped_tiles.best(rows)
    assert len(best) == 14
    for r in (b for b in best if b["impl"] in ("pallas", "pair")):
        assert r["ms"] == min(x["ms"] for x in rows if x["impl"] == r["impl"]
                              and (x["tokens"], x["gemm"]) == (r["tokens"], r["gemm"]))
    assert "# best per (T, GEMM):" in capsys.readouterr().out


def test_bad_lists_are_refused_by_name(capsys):
    with pytest.raises(SystemExit):
        grouped_tiles.main(["--block-n", "32,x"])
    assert "--block-n" in capsys.readouterr().err

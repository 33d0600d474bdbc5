"""``benchmarks/verify_entry.py`` (the verify-and-propose entry plus the stack's forward
against the fused step, issue 48) on CPU with the tiny target: one row per (method, B), both
paths timed every round and returning the same tokens and drafts, the table printed."""

import suite_paths  # tests/support: where the suite's pieces are
import json
import sys

import pytest


sys.path.insert(0, str(suite_paths.BENCHMARKS))

import verify_entry  # noqa: E402


def test_every_method_row_with_both_paths_timed(tmp_path, capsys):
    out = tmp_path / "verify.json"
    assert verify_entry.main(["--target", "tiny", "--batch", "2", "--context", "24", "--iters", "1",
                              "--warmup", "0", "--rounds", "2", "--parts",
                              "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["criterion"] == verify_entry.CRITERION
    rows = {r["method"]: r for r in doc["rows"]}
    assert set(rows) == set(verify_entry.METHODS)
    table = capsys.readouterr().out
    for m, r in rows.items():
        k = 0 if m == "plain" else 3
        assert (r["batch"], r["k"], r["t_pad"]) == (2, k, 2 * (k + 1))
        assert r["same_tokens"] is True, m          # the two paths compute the same step
        for path in ("fused", "entry"):
            assert len(r[f"{path}_rounds_ms"]) == 2 and min(r[f"{path}_rounds_ms"]) > 0
            assert r[f"{path}_spread_ms"] == pytest.approx(
                max(r[f"{path}_rounds_ms"]) - min(r[f"{path}_rounds_ms"]))
        assert r["ratio"] == pytest.approx(r["entry_ms"] / r["fused_ms"])
        assert r["forward_ms"] > 0 and r["verify_ms"] > 0 and r["floor_ms"] > 0
        assert f"| {m} | 2 | {r['t_pad']} | {r['fused_ms']:.3f} " in table


def test_bad_arguments_are_refused():
    with pytest.raises(SystemExit):
        verify_entry.main(["--target", "tiny", "--methods", "medusa2"])
    with pytest.raises(SystemExit):
        verify_entry.main(["--target", "tiny", "--rounds", "0"])

"""``benchmarks/attention.py`` on CPU with another shape, a sliding window and sinks (issue
53's decode kernel at GQA 8): the Pallas kernel's rows agree with the windowed reference,
the floor counts only the window's K/V bytes, and bad shapes are refused by name."""

import suite_paths  # tests/support: where the suite's pieces are
import json
import sys

import pytest

sys.path.insert(0, str(suite_paths.BENCHMARKS))

import attention  # noqa: E402


def test_window_and_sinks_rows(tmp_path, monkeypatch):
    out = tmp_path / "a.json"
    for name in ("NH", "NKV", "HD", "WINDOW", "SINKS"):      # main sets the module's shape
        monkeypatch.setattr(attention, name, getattr(attention, name))
    attention.main(["--batches", "2", "--qlens", "1", "--context", "40", "--reps", "1",
                    "--heads", "8/1", "--head-dim", "32", "--window", "12", "--sinks",
                    "--out", str(out)])
    rows = json.loads(out.read_text())["attention"]
    assert {r["backend"] for r in rows} == {"xla", "pallas"}
    for r in rows:
        assert r["floor_us"] == pytest.approx(2 * 12 * 1 * 32 * 2 * 2 / attention.HBM_BPS * 1e6)
        assert r["max_abs_diff_vs_xla"] < 2e-2              # bf16 against the reference


@pytest.mark.parametrize("argv,word", [(["--heads", "32/5"], "--heads"),
                                       (["--heads", "x"], "--heads"),
                                       (["--window", "0"], "--window")])
def test_bad_shapes_refused(argv, word, capsys):
    with pytest.raises(SystemExit):
        attention.main(argv)
    assert word in capsys.readouterr().err

"""``benchmarks/moe.py`` (issue 54) on CPU with the tiny MoE geometry: the expert stack and
the engine's plain / EAGLE-3 decode rows with their floors, and the floor arithmetic."""

import suite_paths  # tests/support: where the suite's pieces are
import json
import sys

import pytest


sys.path.insert(0, str(suite_paths.BENCHMARKS))

import moe  # noqa: E402


def test_expected_touched_and_floor_arithmetic():
    geo = moe.GEOMETRIES["30b-a3b"]
    assert moe.expected_touched(geo, 1) == pytest.approx(8)          # one token: its k experts
    assert moe.expected_touched(geo, 10_000) == pytest.approx(128)   # many tokens: all experts
    assert moe.expert_bytes(geo) == 3 * 2048 * 768 * 2
    # B=1 decode, nothing cached: 48 layers x 8 experts x 9.4 MB, the dense weights
    # (attention 1.8 GB, lm_head 0.6 GB) and one token's K/V; ms = bytes / 4.3e9
    dense = 48 * (2048 * (4096 + 2 * 512) + 4096 * 2048 + 2048 * 128) * 2 + 151936 * 2048 * 2
    assert moe.dense_bytes(geo) == pytest.approx(dense, rel=1e-3)
    kv = 48 * 2 * 512 * 2
    assert moe.step_floor_ms(geo, 1, 0, 1) == pytest.approx(
        (moe.dense_bytes(geo) + 48 * 8 * moe.expert_bytes(geo) + kv) / 4.3e9)


def test_tiny_run_rows(tmp_path, capsys):
    out = tmp_path / "moe.json"
    assert moe.main(["--geometry", "tiny", "--batch", "2", "--iters", "2", "--context", "16",
                     "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    geo = moe.GEOMETRIES["tiny"]
    experts = [r for r in rows if r["part"] == "experts"]
    assert {(r["batch"], r["q"]) for r in experts} == {(2, 1), (2, 4)}
    for r in experts:
        k, e, L = geo["num_experts_per_tok"], geo["num_experts"], geo["num_hidden_layers"]
        assert L * k <= r["touched"] <= L * min(e, r["tokens"] * k) and r["ms"] > 0
    decode = [r for r in rows if r["part"] == "decode"]
    assert {(r["method"], r["batch"]) for r in decode} == {("plain", 2), ("eagle3", 2)}
    assert all(r["floor_ms"] > 0 and r["per_iter_ms"] > 0 for r in decode)
    assert "| ragged_dot | 2 | 4 | 8 |" in capsys.readouterr().out


def test_bad_arguments_are_refused():
    with pytest.raises(SystemExit):
        moe.main(["--parts", "experts,prefill"])


def test_decode_profile_traces_the_plain_steps_only(tmp_path, capsys):
    out = tmp_path / "moe.json"
    assert moe.main(["--geometry", "tiny", "--batch", "1", "--iters", "2", "--context", "16",
                     "--parts", "decode", "--profile", str(tmp_path / "prof"),
                     "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [("profile" in r) for r in rows] == [True, False]        # plain, then eagle3
    assert rows[0]["profile"]["step_ms"] > 0
    assert list((tmp_path / "prof" / "b1").rglob("*.json.gz"))
    assert "### plain B=1:" in capsys.readouterr().out

"""``benchmarks/draft_sampling.py`` (issue 56): one tiny CPU run on the demo models."""

import suite_paths  # tests/support: where the suite's pieces are
import json
import sys


sys.path.insert(0, str(suite_paths.BENCHMARKS))

import draft_sampling  # noqa: E402


def test_tiny_run(tmp_path, capsys):
    out = tmp_path / "ds.json"
    assert draft_sampling.main(["--methods", "eagle3", "--prompts", "1", "--max-tokens", "8",
                                "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["method"] for r in rows] == ["eagle3"]
    assert rows[0]["greedy"] >= 1 and rows[0]["probabilistic"] >= 1
    assert "| eagle3 |" in capsys.readouterr().out

"""``specjax demo``: the console script runs, checks every method against plain decoding and
prints the table (a quick version: two methods, few tokens)."""

import io
import shutil
import subprocess
import sys

import pytest

from specjax.cli import demo, main as cli
from test_demo import demo_table




@pytest.mark.smoke
def test_demo_quick(capsys):
    rc = cli.main(["demo", "--method", "ngram", "eagle", "--max-tokens", "12", "--k", "2",
                   "--device", "cpu"])
    out, err = capsys.readouterr()
    assert rc == 0, out + err
    assert "shipped demo weights" in out
    rows = demo_table(out)
    assert set(rows) == {"plain", "ngram", "eagle"}
    for name in ("ngram", "eagle"):
        assert rows[name]["k"] == "2" and rows[name]["check"] == "OK"
        assert rows[name]["speed-up"].endswith("x")
    assert float(rows["eagle"]["tokens/fwd"]) > 1.5         # a trained head accepts
    assert "all methods reproduce plain greedy decoding: OK" in out
    assert "[3/3] eagle" in err                              # progress on stderr


def test_run_demo_rows():
    out, err = io.StringIO(), io.StringIO()
    rows = demo.run_demo(["extract_hidden_states"], k=4, max_tokens=4, out=out, err=err)
    assert [r.method for r in rows] == ["plain", "extract_hidden_states"]
    assert rows[1].k == 1 and rows[1].ok and len(rows[1].per_position) == 1
    cells = demo_table(out.getvalue())["extract_hidden_states"]
    assert cells["check"] == "OK" and cells["k"] == "1"
    assert cells["tokens/fwd"] == f"{rows[1].mean_acceptance_length:.2f}"
    with pytest.raises(ValueError, match="unknown"):
        demo.run_demo(["nope"], out=out, err=err)


def test_bad_arguments_exit_2(capsys):
    for argv in (["demo", "--k", "0"], ["demo", "--method", "nope"], ["demo", "--device", "tpu"], []):
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
        assert e.value.code == 2
    capsys.readouterr()


def test_console_script_is_installed():
    exe = shutil.which("specjax", path=str(__import__("pathlib").Path(sys.executable).parent))
    if exe is None:
        pytest.skip("the specjax console script is not installed (pip install -e .)")
    res = subprocess.run([exe, "demo", "--help"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "--max-tokens" in res.stdout and "--method" in res.stdout


@pytest.mark.smoke
def test_demo_draft_model_from_any_directory(monkeypatch):
    """The demo's draft_model proposer builds whatever the working directory (from the repo
    root its model name used to be a relative path to the shipped weights, loaded a second
    time beside draft= and refused)."""
    import pathlib

    import specjax

    target = demo.demo_target()
    for where in (pathlib.Path(specjax.__file__).parent.parent, pathlib.Path("/")):
        monkeypatch.chdir(where)
        prop = demo.demo_proposer("draft_model", 2, target)
        assert prop.num_speculative_tokens == 2


@pytest.mark.smoke
def test_slow_methods_get_a_measured_reason():
    rows = [demo.Row("plain", 0, 1.0, [], 1000.0, 1.0, True, steps_per_sync=8, tokens_per_iter=1.0,
                     ms_per_iter=2.0),
            demo.Row("ngram", 3, 3.0, [], 900.0, 0.9, True, steps_per_sync=1, tokens_per_iter=2.5,
                     ms_per_iter=5.6),
            demo.Row("eagle3", 3, 3.2, [], 1600.0, 1.6, True, steps_per_sync=8,
                     tokens_per_iter=2.8, ms_per_iter=3.5),
            demo.Row("extract_hidden_states", 1, 1.1, [], 950.0, 0.95, True, steps_per_sync=8,
                     tokens_per_iter=1.05, ms_per_iter=2.2)]
    lines = demo.slow_reasons(rows)
    assert len(lines) == 2                                   # only the methods below 1.0x
    assert lines[0].startswith("slower than plain: ngram 0.90x: 2.50 tokens per request per decoding")
    assert "2.80x plain's 2.00 ms" in lines[0] and "drafts on the host" in lines[0]
    assert "extract_hidden_states" in lines[1] and "token just sampled" in lines[1]
    qb = demo.query_buckets(demo._prompts())
    assert 96 in qb and max(len(p) for p in demo._prompts()) <= 96 and 4 in qb and 512 in qb


def test_demo_batch(monkeypatch, capsys):
    """``--batch``: requests decoded at once (default 1, one after another; 0: every prompt
    in one batch), the engines built with that many sequences; bad values refused by name
    before any model loads."""
    import specjax.engine

    seen = []
    init = specjax.engine.Engine.__init__

    def spy(self, *a, **kw):
        seen.append((kw["max_num_seqs"], kw["options"].batch_buckets))
        init(self, *a, **kw)

    monkeypatch.setattr(specjax.engine.Engine, "__init__", spy)
    for argv, want, text in ((["--batch", "0"], 4, "all 4 in one batch"), ([], 1, "one request at a time"),
                             (["--batch", "2"], 2, "2 requests at a time")):
        seen.clear()
        rc = cli.main(["demo", "--method", "ngram", "--max-tokens", "5", "--repeat", "1",
                       "--device", "cpu", *argv])
        out, err = capsys.readouterr()
        assert rc == 0, out + err
        assert text in out and "all methods reproduce plain greedy decoding: OK" in out
        assert seen and set(seen) == {(want, (want,))}

    def no_work(*a, **k):
        raise AssertionError("loaded a model before checking --batch")

    monkeypatch.setattr(demo, "demo_target", no_work)
    for bad in (5, 0, -1, True, 1.5):
        with pytest.raises(ValueError, match=r"--batch must be an int from 1 to the number of prompts \(4\)"):
            demo.run_demo(["ngram"], batch=bad, out=io.StringIO(), err=io.StringIO())
    with pytest.raises(SystemExit):
        cli.main(["demo", "--batch", "-1"])
    capsys.readouterr()

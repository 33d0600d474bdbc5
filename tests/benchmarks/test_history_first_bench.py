"""``benchmarks/history_first.py`` (issue 56): one tiny CPU run of a method of each
kind, lossless, with the hybrids' stage counters in the JSON."""

import suite_paths  # tests/support: where the suite's pieces are
import json
import sys

import pytest


sys.path.insert(0, str(suite_paths.BENCHMARKS))

import history_first  # noqa: E402


#: a history method of each kind, a model drafter, and hybrids with a chain and with heads,
#: on the host's and on the device's n-gram (every pairing is built the same way)
TINY = ("ngram", "suffix", "eagle3", "eagle3+ngram", "eagle3+ngram_gpu", "medusa+ngram_gpu")


def test_tiny_run(tmp_path, capsys):
    out = tmp_path / "hf.json"
    assert history_first.main(["--files", "2", "--max-file-bytes", "48", "--k", "2",
                               "--prompt-lookup-min", "2", "--methods", *TINY,
                               "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    rows = {r["method"]: r for r in doc["rows"]}
    assert set(rows) == {"plain", *TINY}
    assert all(r["lossless"] and r["tokens_per_forward"] >= 1 for r in rows.values())
    for m in TINY[3:]:                       # both stages drafted rows
        assert rows[m]["first_stage_rows"] > 0 and rows[m]["model_rows"] > 0, rows[m]
    assert doc["meta"]["files"] == ["sre_compile.py", "lib2to3/fixes/fix_long.py"]
    assert max(doc["meta"]["file_bytes"]) <= 48
    assert "tokens / target forward" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        history_first.main(["--files", "9"])


def test_timed_pass_reports_tokens_per_second(tmp_path, capsys):
    """``--timed``: a second, compiled pass gives tokens/s; its output must match the first;
    a hybrid's rows are those of one pass (a row a step at most)."""
    out = tmp_path / "hf.json"
    assert history_first.main(["--files", "1", "--max-file-bytes", "48", "--k", "2",
                               "--methods", "ngram", "eagle3+ngram", "--timed", "--json",
                               str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["method"] for r in rows] == ["plain", "ngram", "eagle3+ngram"]
    assert all(r["same_output"] and r["tokens_per_s"] > 0 for r in rows)
    assert 0 < rows[2]["first_stage_rows"] + rows[2]["model_rows"] <= rows[2]["steps"]
    assert "| tokens/s | vs plain |" in capsys.readouterr().out


def test_the_workload_texts_are_the_held_out_files():
    """Each committed text is the start of a file in the demo models' held-out split and,
    where this interpreter's stdlib has the file, equal to its first bytes."""
    from specjax.training.data import split_files, stdlib_py_files, stdlib_root

    spec = json.loads(history_first.WORKLOAD.read_text())
    assert sorted(spec["texts"]) == sorted(spec["files"]) and len(spec["files"]) == 8
    root = stdlib_root()
    train, held = split_files(stdlib_py_files(root, include_tests=False), root)
    rel = lambda ps: {p.relative_to(root).as_posix() for p in ps}  # noqa: E731
    train, held = rel(train), rel(held)
    for name in spec["files"]:
        assert name not in train
        text = spec["texts"][name].encode()
        assert 0 < len(text) <= 2048
        if name in held:
            assert (root / name).read_bytes()[:len(text)] == text


def test_ballast_target_streams_its_matrix_and_keeps_the_tokens():
    """``BallastTarget`` (``--ballast-gb``): the demo's greedy tokens unchanged; its matrix
    wired into the output (a nonzero ``zero`` changes the tokens), so no compiler drops it."""
    from specjax.cli import demo
    from specjax.engine import Engine, SamplingParams, TargetModel

    prompt = [history_first.BOS_ID] + list(b"def f(x):\n    return")
    target = demo.demo_target()
    wrapped = history_first.BallastTarget.wrap(target, 1e-4)
    assert wrapped.params["weight_ballast"].shape == (1e5 // (4 * 256), 256)
    assert wrapped.model.vocab_size == target.model.vocab_size

    def tokens(t):
        eng = Engine(t, None, max_model_len=demo.MAX_MODEL_LEN, block_size=demo.BLOCK_SIZE,
                     max_num_seqs=1)
        return eng.generate([prompt], SamplingParams(max_tokens=6)).token_ids[0]

    assert tokens(wrapped) == tokens(target)
    live = TargetModel(wrapped.model, {**wrapped.params, "zero": 1.0 + 0 * wrapped.params["zero"]})
    assert tokens(live) != tokens(target)

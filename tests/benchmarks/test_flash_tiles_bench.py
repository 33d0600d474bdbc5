"""``benchmarks/flash_tiles.py`` (the flash kernel's tile sweep, issue 50) on CPU: the cases'
batches and visible-pair counts by brute force, a sweep whose every row is checked against
the reference and timed, the default first, and bad arguments refused by name."""

import suite_paths  # tests/support: where the suite's pieces are
import json
import sys

import numpy as np
import pytest

sys.path.insert(0, str(suite_paths.BENCHMARKS))

import flash_tiles  # noqa: E402


def _pairs_brute(qlens, slens):
    n = 0
    for ql, s in zip(qlens, slens):     # key j < s is seen by the queries at positions >= j
        qpos = np.arange(s - ql, s)
        n += int(np.sum(np.arange(s)[None, :] <= qpos[:, None]))
    return n


@pytest.mark.parametrize("name", ["prefill 40", "chunks", "batch", "chunk 16/100"])
def test_case_batches_and_pairs(name):
    qlens, slens = flash_tiles.case_batch(name)
    assert all(q <= s for q, s in zip(qlens, slens))
    assert flash_tiles.visible_pairs(qlens, slens) == _pairs_brute(qlens, slens)
    if name != "prefill 40":
        return
    import jax.numpy as jnp
    q, cache, md, pairs = flash_tiles.make_inputs(name, jnp.float32)
    assert q.shape == (40, flash_tiles.NH, flash_tiles.HD)
    assert pairs == _pairs_brute(qlens, slens) == 40 * 41 // 2
    assert int(md.seq_lens[0]) == 40 and int(md.block_table[0, 0]) == 1


def test_pairs_of_a_chunk_after_context():
    # 3 queries at the end of a 5-token context: 3, 4, 5 keys
    assert _pairs_brute([3], [5]) == 12 == 3 * (5 - 3) + 3 * 4 // 2


def test_sweep_rows_checked_and_timed(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(flash_tiles, "QUICK", dict(rows=(64,), block_k=(32,), num_warps=(4,),
                                                   num_stages=(2, 3)))
    out = tmp_path / "tiles.json"
    assert flash_tiles.main(["--cases", "prefill 24", "--backends", "pallas", "--quick",
                             "--iters", "1", "--dtype", "float32", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [r["knobs"] for r in rows][0] == "default" and len(rows) == 3
    for r in rows:
        assert "error" not in r, r
        assert r["ms"] > 0 and r["max_err"] < 1e-5
    assert "| prefill 24 | pallas |" in capsys.readouterr().out


def test_bad_arguments_are_refused():
    with pytest.raises(SystemExit):
        flash_tiles.main(["--backends", "cuda"])
    with pytest.raises(ValueError, match="unknown case 'nope'"):
        flash_tiles.case_batch("nope")
    for bad in ("chunk 64/32", "chunk x"):
        with pytest.raises(ValueError, match="0 < T <= C"):
            flash_tiles.case_batch(bad)
    with pytest.raises(SystemExit):
        flash_tiles.main(["--cases", "prefill 8,chunk 9/3"])

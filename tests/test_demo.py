"""``specjax demo``'s output: the check and tokens per target forward lead the table, the
wall-clock columns follow; other work's load is printed, and a loaded machine (at
``LOAD_THRESHOLD`` per core or more) gets one line that the timings are not meaningful; a CPU device
gets one line on why its speed-ups are smaller than a GPU's; the help is current."""

from __future__ import annotations

import io
import types

import jax
import pytest

from specjax.cli import demo, main as cli

HEAD = ("method", "check", "tokens/fwd", "k", "per-position acceptance", "tokens/s", "spread",
        "sync", "speed-up")




def demo_table(out: str) -> dict[str, dict[str, str]]:
    """The printed table as ``{method: {column: cell}}``, cut at the header's column starts
    (cells and method names may hold spaces)."""
    lines = out.splitlines()
    i = next(i for i, line in enumerate(lines) if line.startswith("method "))
    head, starts, end = lines[i], [], 0
    for h in HEAD:
        starts.append(head.index(h, end))
        end = starts[-1] + len(h)
    rows = {}
    for line in lines[i + 2:]:
        if not line.endswith("x"):           # every row ends with its speed-up
            break
        cells = [line[a:b].strip() for a, b in zip(starts, starts[1:] + [len(line) + 1])]
        rows[cells[0]] = dict(zip(HEAD, cells))
    return rows


def _run(monkeypatch, load, device):
    monkeypatch.setattr(demo, "machine_load", lambda own_cores=0.0: load)
    out = io.StringIO()
    with jax.default_device(jax.devices("cpu")[0]):
        rows = demo.run_demo(["ngram"], k=2, max_tokens=6, repeat=1, device=device, out=out,
                             err=io.StringIO())
    return rows, out.getvalue()


def test_table_leads_with_check_and_tokens_per_forward(monkeypatch):
    fake_gpu = types.SimpleNamespace(platform="gpu", device_kind="test")
    rows, out = _run(monkeypatch, 0.1, fake_gpu)
    head = next(line for line in out.splitlines() if line.startswith("method "))
    assert head.split()[:3] == ["method", "check", "tokens/fwd"] and head.endswith("speed-up")
    table = demo_table(out)
    assert list(table) == ["plain", "ngram"] == [r.method for r in rows]
    for r in rows:
        cells = table[r.method]
        assert cells["check"] == "OK" and r.ok                    # greedy: lossless
        assert cells["tokens/fwd"] == f"{r.mean_acceptance_length:.2f}"
        assert cells["speed-up"] == f"{r.speedup:.2f}x"
    assert table["plain"]["tokens/fwd"] == "1.00" and table["ngram"]["k"] == "2"
    assert "all methods reproduce plain greedy decoding: OK" in out
    # light load: the load shown, the timings not flagged; not a CPU device: no CPU line
    assert "load 0.10 per core" in out and "below 0.5, not loaded" in out
    assert "not meaningful" not in out
    assert demo.CPU_NOTE not in out and "smaller than on a GPU" not in out


def test_loaded_machine_and_cpu_lines(monkeypatch):
    _, out = _run(monkeypatch, 0.75, jax.devices("cpu")[0])
    assert demo_table(out)["ngram"]["speed-up"].endswith("x")      # still printed
    loaded = [line for line in out.splitlines() if "not meaningful" in line]
    assert len(loaded) == 1 and loaded[0].startswith("load 0.75 per core")
    assert "read the check and tokens/fwd columns" in loaded[0]
    assert out.count("smaller than on a GPU") == 1 and demo.CPU_NOTE in out.splitlines()
    # the threshold itself counts as loaded; no load average (None): no line
    assert demo.LOAD_THRESHOLD == 0.5
    assert "not meaningful" in demo.load_line(0.5) and "not meaningful" not in demo.load_line(0.49)
    assert demo.load_line(None) is None


def test_machine_load(monkeypatch):
    monkeypatch.setattr(demo.os, "getloadavg", lambda: (3.0, 0.0, 0.0))
    monkeypatch.setattr(demo.os, "cpu_count", lambda: 4)
    assert demo.machine_load() == 0.75
    assert demo.machine_load(own_cores=1.0) == 0.5                 # this process's share out
    assert demo.machine_load(own_cores=5.0) == 0.0

    def no_loadavg():
        raise OSError("no load average")

    monkeypatch.setattr(demo.os, "getloadavg", no_loadavg)
    assert demo.machine_load() is None
    own = demo._OwnLoad()
    assert own() >= 0.0


def test_demo_help_is_current(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["demo", "--help"])
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "random weights" not in text and "until trained" not in text
    assert "shipped demo models" in text and "specjax/demo_models" in text
    assert "tokens per target forward pass" in text
    assert f"{demo.LOAD_THRESHOLD} per core" in text
    assert "random weights" not in demo.__doc__ and "shipped demo models" in demo.__doc__

"""``specjax-convert`` never destroys a user's files: the destination rules (refused before
anything is read, every file left as it was), ``--force`` only over a previous specjax
output, the umask's permissions, and real SIGINT / SIGTERM / SIGKILL sent to a converting
subprocess (exit status, message, no staging directory left, an old DST intact, a killed
run's leftovers removed by the next run). CPU only."""

from __future__ import annotations

import suite_paths  # tests/support: where the suite's pieces are
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from specjax.converters import (
    DestinationError,
    DestinationExistsError,
    cli,
    convert,
    destination,
    pipeline,
)
from specjax.converters.export import export_checkpoint

from converter_cases import CASES, write_layout

DRIVER = suite_paths.SUPPORT / "convert_driver.py"


def _src(root: Path) -> Path:
    case = CASES["llama"]
    src = root / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(case.config))
    write_layout(src, case.arrays(), "safetensors")
    return src


def _snapshot(root: Path) -> dict[str, str]:
    """Every path under ``root`` -> a digest of its content (``dir`` / ``link:...``)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            if rel.startswith("ready-"):      # the signal tests' own handshake files
                continue
            if p.is_symlink():
                out[rel] = "link:" + os.readlink(p)
            elif p.is_dir():
                out[rel] = "dir"
            else:
                out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def _stages(parent: Path) -> list[str]:
    return sorted(n for n in os.listdir(parent) if destination.STAGE_INFIX in n)


@pytest.fixture
def no_read(monkeypatch):
    """Reading the checkpoint fails the test: refusals must come before it."""
    def fail(*a, **k):
        raise AssertionError("the checkpoint was read before the destination was refused")
    monkeypatch.setattr(pipeline, "prepare", fail)


@pytest.fixture
def home(tmp_path, monkeypatch):
    h = tmp_path / "home"
    h.mkdir()
    (h / ".bashrc").write_text("precious")
    monkeypatch.setenv("HOME", str(h))
    return h


# -- refusals -------------------------------------------------------------------------------

REFUSED = {
    # name: (DST relative to tmp_path / a special value, --force, text in the message)
    "dst-is-src": ("src", True, "is the source checkpoint"),
    "dst-is-src-no-force": ("src", False, "is the source checkpoint"),
    "dst-contains-src": (".", True, "refusing to write over the current directory"),
    "dst-is-parent-of-src": ("PARENT", True, "contains the source checkpoint"),
    "dst-is-src-weight-file": ("src/model.safetensors", True, "inside the source checkpoint"),
    "dst-inside-src": ("src/converted", False, "inside the source checkpoint"),
    "dst-empty": ("", False, "DST is empty"),
    "dst-empty-force": ("", True, "DST is empty"),
    "dst-blank": ("  ", True, "DST is empty"),
    "dst-dot": (".", False, "current directory"),
    "dst-cwd-parent": ("..", True, "current directory"),
    "dst-home": ("HOME", True, "home directory"),
    "dst-home-parent": ("HOME/..", True, "refusing to write over"),
}


@pytest.mark.smoke
@pytest.mark.parametrize("case", sorted(REFUSED))
def test_destination_refused_before_reading(tmp_path, monkeypatch, capsys, home, no_read, case):
    rel, force, needle = REFUSED[case]
    work = tmp_path / "work"
    work.mkdir()
    src = _src(work)
    (work / "notes.txt").write_text("keep me")
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    (cwd / "data.txt").write_text("keep me too")
    if case in ("dst-contains-src",):
        monkeypatch.chdir(work)        # "." is the directory holding src
    else:
        monkeypatch.chdir(cwd)
    dst = {"PARENT": str(work), "HOME": str(home), "HOME/..": str(home.parent)}.get(rel)
    if dst is None:
        dst = rel if rel in ("", "  ", ".", "..") else str(work / rel)
    before = _snapshot(tmp_path)
    code = cli.main([str(src), dst, *(["--force"] if force else []), "-q"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert needle in err
    assert "DST" in err
    assert _snapshot(tmp_path) == before
    with pytest.raises(DestinationError, match=needle.split(" (")[0]):
        convert(src, dst, force=force)
    assert _snapshot(tmp_path) == before


def test_symlink_and_unwritable_and_file_parent(tmp_path, monkeypatch, no_read):
    src = _src(tmp_path)
    target = tmp_path / "real"
    target.mkdir()
    link = tmp_path / "link"
    link.symlink_to(target)
    with pytest.raises(DestinationError, match="symbolic link"):
        convert(src, link, force=True)
    blocker = tmp_path / "afile"
    blocker.write_text("x")
    with pytest.raises(DestinationError, match="is not a directory"):
        convert(src, blocker / "out")
    ro = tmp_path / "ro"
    ro.mkdir()
    if os.geteuid() == 0:   # root writes anywhere: make os.access tell the truth of a user
        real_access = os.access
        monkeypatch.setattr(destination.os, "access",
                            lambda p, m: False if Path(p) == ro else real_access(p, m))
    else:
        ro.chmod(0o555)
    with pytest.raises(DestinationError, match=f"{ro} is not writable"):
        convert(src, ro / "out")
    with pytest.raises(DestinationError, match=f"{ro} is not writable"):
        convert(src, ro / "deeper" / "out")
    assert os.listdir(ro) == []
    assert sorted(os.listdir(tmp_path)) == ["afile", "link", "real", "ro", "src"]


@pytest.mark.smoke
def test_force_replaces_only_a_previous_specjax_output(tmp_path, capsys):
    src = _src(tmp_path)
    dst = tmp_path / "out"
    # a file, a directory of other things, a specjax.json not written by specjax
    dst.write_text("a file")
    assert cli.main([str(src), str(dst), "--force", "-q"]) == 1
    assert "is a file" in capsys.readouterr().err
    dst.unlink()
    dst.mkdir()
    for n in ("a.txt", "b.txt", "params"):
        (dst / n).mkdir() if n == "params" else (dst / n).write_text(n)
    before = _snapshot(tmp_path)
    assert cli.main([str(src), str(dst), "--force", "-q"]) == 1
    err = capsys.readouterr().err
    assert "it holds a.txt, b.txt" in err and str(dst) in err
    assert _snapshot(tmp_path) == before
    for n in ("a.txt", "b.txt"):
        (dst / n).unlink()
    (dst / "specjax.json").write_text("{}")
    assert cli.main([str(src), str(dst), "--force", "-q"]) == 1
    assert "not written by specjax" in capsys.readouterr().err
    (dst / "specjax.json").unlink()
    (dst / "params").rmdir()
    # empty: fine without --force; then a previous output: replaced with --force
    assert cli.main([str(src), str(dst), "-q", "--dtype", "fp16"]) == 0
    assert json.loads((dst / "specjax.json").read_text())["dtype"] == "fp16"
    assert cli.main([str(src), str(dst), "-q", "--dtype", "fp32"]) == 1
    assert cli.main([str(src), str(dst), "--force", "-q", "--dtype", "fp32"]) == 0
    assert json.loads((dst / "specjax.json").read_text())["dtype"] == "fp32"
    assert sorted(os.listdir(tmp_path)) == ["out", "src"]


def test_export_follows_the_rules(tmp_path, monkeypatch, home):
    from specjax.models import registry
    case = CASES["llama"]
    config = registry.config_from_hf("llama", case.config)
    params = registry.init_params("llama", config)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DestinationError, match="current directory"):
        export_checkpoint("llama", config, params, ".", format="llama", overwrite=True)
    with pytest.raises(DestinationError, match="home directory"):
        export_checkpoint("llama", config, params, home, format="llama", overwrite=True)
    with pytest.raises(DestinationError, match="DST is empty"):
        export_checkpoint("llama", config, params, "", format="llama", overwrite=True)
    assert (home / ".bashrc").read_text() == "precious"
    out = tmp_path / "hf"
    out.mkdir()
    (out / "x").write_text("x")
    with pytest.raises(DestinationExistsError, match="overwrite=True"):
        export_checkpoint("llama", config, params, out, format="llama")
    export_checkpoint("llama", config, params, out, format="llama", overwrite=True)
    assert "config.json" in os.listdir(out) and not _stages(tmp_path)


def test_failure_removes_the_parents_it_created(tmp_path, monkeypatch):
    src = _src(tmp_path)
    before = _snapshot(tmp_path)

    def fail(*a, **k):
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(pipeline, "save_prepared", fail)
    with pytest.raises(OSError, match="simulated"):
        convert(src, tmp_path / "a" / "b" / "out")
    assert _snapshot(tmp_path) == before         # no a/, no a/b/, no staging directory


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_output_gets_the_umask_permissions(tmp_path, umask):
    src = _src(tmp_path)
    old = os.umask(umask)
    try:
        convert(src, tmp_path / "out")
    finally:
        os.umask(old)
    assert (tmp_path / "out").stat().st_mode & 0o777 == 0o777 & ~umask
    assert (tmp_path / "out" / "specjax.json").stat().st_mode & 0o777 == 0o666 & ~umask


# -- stale staging directories -----------------------------------------------------------------

def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _stage(parent: Path, dst: Path, suffix: str, marker: dict | None, old: bool = False) -> Path:
    stage = parent / f".{dst.name}{destination.STAGE_INFIX}{suffix}"
    (stage / "new" / "params").mkdir(parents=True)
    (stage / "new" / "params" / "half").write_text("half-written")
    if marker is not None:
        (stage / destination.MARKER).write_text(json.dumps(marker))
    if old:
        (stage / "old").mkdir()
        (stage / "old" / "specjax.json").write_text("the old output")
    return stage


def test_stale_stages_removed_only_when_provably_ours(tmp_path):
    dst = tmp_path / "out"
    me = destination._marker(dst)
    dead = {**me, "pid": _dead_pid()}
    reused = {**me, "start_time": "1"}             # this pid, another process's start time
    _stage(tmp_path, dst, "dead", dead)
    _stage(tmp_path, dst, "reused", reused)
    live = _stage(tmp_path, dst, "live", me)                     # a writer still running
    other_host = _stage(tmp_path, dst, "host", {**dead, "host": socket.gethostname() + "x"})
    unmarked = _stage(tmp_path, dst, "nomark", None)
    other_dst = _stage(tmp_path, dst, "otherdst", {**dead, "dst": str(tmp_path / "x")})
    notes: list[str] = []
    removed = destination.remove_stale_stages(dst, notes.append)
    assert sorted(p.name for p in removed) == [f".out{destination.STAGE_INFIX}dead",
                                               f".out{destination.STAGE_INFIX}reused"]
    assert len(notes) == 2 and all("killed" in n and str(tmp_path) in n for n in notes)
    assert sorted(_stages(tmp_path)) == sorted(p.name for p in
                                               (live, other_host, unmarked, other_dst))
    assert not dst.exists()


def test_stale_stage_holding_the_old_output_restores_it(tmp_path):
    dst = tmp_path / "out"
    marker = {**destination._marker(dst), "pid": _dead_pid()}
    _stage(tmp_path, dst, "a", marker, old=True)
    notes: list[str] = []
    destination.remove_stale_stages(dst, notes.append)
    assert (dst / "specjax.json").read_text() == "the old output"
    assert any("restored" in n for n in notes) and not _stages(tmp_path)
    # with DST present (the new output was committed), the old copy just goes
    _stage(tmp_path, dst, "b", marker, old=True)
    (dst / "specjax.json").write_text("the new output")
    destination.remove_stale_stages(dst)
    assert (dst / "specjax.json").read_text() == "the new output" and not _stages(tmp_path)


# -- real signals ---------------------------------------------------------------------------------

def _start(tmp_path: Path, pause: str, src: Path, dst: Path, *args: str,
           sigint=signal.SIG_DFL):
    """The driver, paused at ``pause``. Its SIGINT disposition is ``sigint`` (default: the
    default action, as in a terminal), whatever this process inherited: a shell without
    job control starts `&` jobs with SIGINT ignored, and children inherit that."""
    ready = tmp_path / f"ready-{pause}"
    if ready.exists():
        ready.unlink()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}

    def dispositions():
        signal.signal(signal.SIGINT, sigint)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)

    proc = subprocess.Popen([sys.executable, str(DRIVER), pause, str(ready), str(src),
                             str(dst), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env,
                            cwd=str(tmp_path), preexec_fn=dispositions)
    deadline = time.monotonic() + 180
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            out, err = proc.communicate(timeout=30) if proc.poll() is not None else ("", "")
            proc.kill()
            pytest.fail(f"driver never paused (rc {proc.returncode}): {out}\n{err}")
        time.sleep(0.05)
    ready.unlink()
    return proc


SIGNALS = {"SIGINT": (signal.SIGINT, 130), "SIGTERM": (signal.SIGTERM, 143)}


@pytest.mark.slow
@pytest.mark.parametrize("pause", ["read", "commit"])
@pytest.mark.parametrize("name", [pytest.param("SIGINT", marks=pytest.mark.smoke), "SIGTERM"])
def test_signal_mid_conversion_leaves_nothing(tmp_path, pause, name):
    signum, code = SIGNALS[name]
    src = _src(tmp_path)
    dst = tmp_path / "out"
    before = _snapshot(tmp_path)
    args = [] if pause == "read" else ["-q"]
    proc = _start(tmp_path, pause, src, dst, *args)
    assert _stages(tmp_path), "the staging directory exists while converting"
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == code, err
    assert f"interrupted ({name}); nothing was written to {dst}" in err
    assert "Traceback" not in err
    assert not dst.exists() and not _stages(tmp_path)
    assert _snapshot(tmp_path) == before


@pytest.mark.slow
def test_ignored_sigint_stays_ignored(tmp_path):
    """A conversion started with SIGINT ignored (a `&` job of a shell without job control)
    ignores it, as the process was told to: it completes (exit 0, the output written) and
    says nothing about a SIGINT it will not act on."""
    src = _src(tmp_path)
    dst = tmp_path / "out"
    proc = _start(tmp_path, "commit", src, dst, "-q", sigint=signal.SIG_IGN)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "SIGINT" not in err and dst.exists() and not _stages(tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SIGNALS))
def test_signal_during_forced_replace_keeps_the_old_output(tmp_path, name):
    signum, code = SIGNALS[name]
    src = _src(tmp_path)
    dst = tmp_path / "out"
    convert(src, dst, dtype="fp16")
    before = _snapshot(tmp_path)
    proc = _start(tmp_path, "commit", src, dst, "--force", "-q", "--dtype", "fp32")
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == code, err
    assert "nothing was written" in err
    assert _snapshot(tmp_path) == before        # the old output, byte for byte


@pytest.mark.slow
@pytest.mark.parametrize("pause", ["read", "commit"])
def test_sigkill_leftovers_removed_by_the_next_run(tmp_path, pause):
    src = _src(tmp_path)
    dst = tmp_path / "out"
    proc = _start(tmp_path, pause, src, dst, *([] if pause == "read" else ["-q"]))
    proc.kill()
    proc.wait(timeout=60)
    left = _stages(tmp_path)
    assert len(left) == 1 and not dst.exists()
    assert (tmp_path / left[0] / destination.MARKER).is_file()
    r = subprocess.run([sys.executable, "-m", "specjax.converters.cli", str(src), str(dst),
                        "-q"], capture_output=True, text=True, timeout=300, cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert f"removed {tmp_path / left[0]}" in r.stderr and "killed" in r.stderr
    assert not _stages(tmp_path) and (dst / "specjax.json").is_file()

"""Where ``specjax-convert`` and ``export_checkpoint`` may write, and how they write there.

DST must be named, must not be, hold or lie inside SRC, the current directory or the home
directory, must not be a symbolic link, and must be new, an empty directory or (with
``force``) the caller's own previous output (:func:`check_destination`). The output is
staged in ``.<DST name>.specjax-tmp-XXXX/`` beside DST and renamed into place
(:func:`write_dir_atomically`); SIGINT / SIGTERM are held through steps that cannot be
undone halfway. Details: docs/converters.md, "The destination".
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Iterator

from specjax.converters.errors import DestinationError, DestinationExistsError, Interrupted

STAGE_INFIX = ".specjax-tmp-"
MARKER = "writer.json"
NEW, OLD = "new", "old"
#: ``log(message)``: where notes about stale staging directories and held signals go.
Log = Callable[[str], None]
_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_SIGNAMES = {signal.SIGINT: "SIGINT", signal.SIGTERM: "SIGTERM"}


def _quiet(_msg: str) -> None:
    pass


# -- destination rules --------------------------------------------------------------------

def check_destination(dst, *, src=None, force: bool = False,
                      replaceable: Callable[[Path], str | None] | None = None,
                      force_flag: str = "--force") -> Path:
    """Apply the destination rules (module docstring) to ``dst`` and return it absolute.

    ``replaceable(dst)``: None when the existing non-empty ``dst`` may be replaced with
    ``force``, else a reason (not given: nothing non-empty is replaceable). Raises
    :class:`DestinationError` (a ``ValueError``) or :class:`DestinationExistsError`.
    """
    if dst is None or not str(os.fspath(dst)).strip():
        raise DestinationError(
            f"DST is empty ({os.fspath(dst) if dst is not None else None!r}: an unset shell "
            "variable?); name the output directory")
    path = Path(os.path.abspath(os.fspath(dst)))
    real = path.resolve()
    for what, p in (("the current directory", Path.cwd()), ("your home directory", Path.home())):
        p = p.resolve()
        if real == p or p.is_relative_to(real):
            raise DestinationError(
                f"DST {path}: refusing to write over {what} ({p}) or a directory containing "
                "it; name a new or dedicated output directory")
    if src is not None:
        s = Path(os.path.abspath(os.fspath(src))).resolve()
        if real == s:
            raise DestinationError(f"DST {path} is the source checkpoint SRC; name another "
                                   "output directory")
        if s.is_relative_to(real):
            raise DestinationError(f"DST {path} contains the source checkpoint SRC ({s}); "
                                   "name an output directory outside it")
        if s.is_dir() and real.is_relative_to(s):
            raise DestinationError(f"DST {path} is inside the source checkpoint SRC ({s}); "
                                   "name an output directory outside it")
    if path.is_symlink():
        raise DestinationError(f"DST {path} is a symbolic link (to {os.readlink(path)}); name "
                               "the directory itself")
    parent = path.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise DestinationError(f"DST {path}: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise DestinationError(f"DST {path}: the directory {parent} is not writable")
    if not path.exists():
        return path
    if not path.is_dir():
        if force:
            raise DestinationExistsError(
                f"DST {path} is a file; {force_flag} replaces only an empty directory or a "
                "previous specjax output")
        raise DestinationExistsError(f"DST {path} already exists and is a file")
    if not os.access(path, os.W_OK | os.X_OK):
        raise DestinationError(f"DST {path} is not writable")
    reason = destination_in_use(path, force, replaceable, force_flag)
    if reason:
        raise DestinationExistsError(reason)
    return path


def destination_in_use(path: Path, force: bool,
                       replaceable: Callable[[Path], str | None] | None,
                       force_flag: str = "--force") -> str | None:
    """None when the existing directory ``path`` may be written over (empty, or ``force``
    and ``replaceable`` accepts it); else the refusal message."""
    entries = sorted(e.name for e in path.iterdir())
    if not entries:
        return None
    if not force:
        return (f"DST {path} already exists and is not empty ({_listing(entries)}); "
                f"pass {force_flag} to replace it")
    reason = replaceable(path) if replaceable is not None else "it is not a specjax output"
    if reason is None:
        return None
    return (f"DST {path}: {force_flag} replaces only an empty directory or a previous "
            f"specjax output, and {reason}")


def _listing(entries: list[str], limit: int = 5) -> str:
    more = f", ... ({len(entries)} entries)" if len(entries) > limit else ""
    return ", ".join(entries[:limit]) + more


# -- signals ------------------------------------------------------------------------------

def _raise_interrupted(signum, _frame):
    raise Interrupted(signum)


@contextlib.contextmanager
def sigterm_raises() -> Iterator[None]:
    """While inside, SIGTERM raises :class:`Interrupted` (exit status 143 if uncaught) when
    its handler is the default one, so that cleanup runs. Main thread only (else no-op)."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return
    signal.signal(signal.SIGTERM, _raise_interrupted)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _deliver(signum: int, handler) -> None:
    """Act on a held signal as ``handler`` (the handler in force before holding) would."""
    if handler is signal.SIG_IGN:
        return
    if callable(handler):
        handler(signum, None)
    elif signum == signal.SIGINT:
        raise KeyboardInterrupt
    else:
        raise Interrupted(signum)


@contextlib.contextmanager
def held_signals(log: Log = _quiet, *, deliver: bool = True,
                 doing: str = "the write in progress") -> Iterator[None]:
    """Hold SIGINT and SIGTERM (unless ignored) while inside; on leaving, deliver the first
    one held as the previous handler would, or drop it when not ``deliver``. Main thread
    only."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []

    def hold(signum, _frame):
        if not held:
            log(f"{_SIGNAMES.get(signum, signum)} received: finishing {doing} so that it "
                "can be removed cleanly")
        held.append(signum)

    # a signal the process ignores (e.g. SIGINT in a job started with `&` by a shell without
    # job control) stays ignored: not held, not reported, not delivered
    previous = {s: signal.signal(s, hold) for s in _SIGNALS
                if signal.getsignal(s) is not signal.SIG_IGN}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    if held and deliver:
        _deliver(held[0], previous[held[0]])


# -- staging directories and stale ones -------------------------------------------------------

def _boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def _start_time(pid: int) -> str | None:
    """The process's start time (clock ticks since boot, /proc/PID/stat field 22); None when
    no such process (or no /proc)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _marker(dst: Path) -> dict:
    pid = os.getpid()
    return {"writer": "specjax", "pid": pid, "start_time": _start_time(pid),
            "boot_id": _boot_id(), "host": socket.gethostname(), "dst": str(dst),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def writer_gone(marker: dict) -> bool:
    """True when the process that wrote ``marker`` has provably exited: same host, and the
    machine rebooted since, or no process has its pid with its start time."""
    if marker.get("writer") != "specjax" or marker.get("host") != socket.gethostname():
        return False
    pid = marker.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    boot = _boot_id()
    if boot is not None and marker.get("boot_id") is not None and marker["boot_id"] != boot:
        return True
    if marker.get("start_time") is not None and _start_time(pid) is not None:
        return _start_time(pid) != marker["start_time"]
    return not _alive(pid)


def _stages(dst: Path) -> list[Path]:
    prefix = f".{dst.name}{STAGE_INFIX}"
    if not dst.parent.is_dir():
        return []
    return sorted(p for p in dst.parent.iterdir()
                  if p.name.startswith(prefix) and p.is_dir() and not p.is_symlink())


def remove_stale_stages(dst: Path, log: Log = _quiet) -> list[Path]:
    """Remove staging directories for ``dst`` whose marker proves the writer is gone,
    first moving an old DST they hold back to a missing ``dst``. Returns those removed."""
    removed = []
    for stage in _stages(dst):
        try:
            marker = json.loads((stage / MARKER).read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(marker, dict) or marker.get("dst") != str(dst) or \
                not writer_gone(marker):
            continue
        with held_signals(log, doing="the cleanup of an interrupted run"):
            if (stage / OLD).is_dir() and not os.path.lexists(dst):
                os.rename(stage / OLD, dst)
                log(f"restored {dst} from {stage.name}: an earlier run (pid {marker['pid']}) "
                    "was killed while replacing it")
            _rmtree(stage, log)
        log(f"removed {stage}, left by an earlier run (pid {marker['pid']}) that was killed")
        removed.append(stage)
    return removed


def _rmtree(path: Path, log: Log) -> None:
    for _ in range(3):
        shutil.rmtree(path, ignore_errors=True)
        if not os.path.lexists(path):
            return
        time.sleep(0.05)
    log(f"could not remove {path}; delete it by hand")


def _make_stage(dst: Path) -> Path:
    stage = Path(tempfile.mkdtemp(prefix=f".{dst.name}{STAGE_INFIX}", dir=dst.parent))
    (stage / MARKER).write_text(json.dumps(_marker(dst)) + "\n")
    return stage


def write_dir_atomically(dst, fill: Callable[[Path], None], *,
                         replace: Callable[[Path], bool], what: str,
                         log: Log = _quiet) -> None:
    """Build directory ``dst`` atomically: ``fill(new)`` writes into a fresh directory in a
    marked staging directory beside ``dst``, then renamed onto it. An existing ``dst`` is
    replaced only when ``replace(dst)`` is True (else :class:`DestinationExistsError`). On
    any failure, Ctrl-C or SIGTERM nothing half-written is left and a replaced ``dst`` is
    put back."""
    dst = Path(os.path.abspath(os.fspath(dst)))
    made = [p for p in [dst.parent, *dst.parent.parents] if not p.exists()]   # deepest first
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        _write_staged(dst, fill, replace, what, log)
    except BaseException:
        for p in made:                 # parents this call created, if still empty
            try:
                p.rmdir()
            except OSError:
                break
        raise


def _write_staged(dst: Path, fill: Callable[[Path], None], replace: Callable[[Path], bool],
                  what: str, log: Log) -> None:
    remove_stale_stages(dst, log)
    stage: Path | None = None
    committed = False
    try:
        with held_signals(log):
            stage = _make_stage(dst)
        new = stage / NEW
        new.mkdir()
        fill(new)
        with held_signals(log):
            if os.path.lexists(dst):
                if not replace(dst):
                    raise DestinationExistsError(f"DST {dst} appeared or changed during {what}")
                os.rename(dst, stage / OLD)
            os.rename(new, dst)
            committed = True
    except BaseException as e:
        if stage is None:
            raise
        with held_signals(log, deliver=False, doing="the cleanup"):
            if committed:
                e.specjax_committed = True  # type: ignore[attr-defined]
            elif (stage / OLD).is_dir() and not os.path.lexists(dst):
                os.rename(stage / OLD, dst)  # put the previous directory back
            _rmtree(stage, log)
        raise
    with held_signals(log, deliver=False, doing="the cleanup"):
        _rmtree(stage, log)

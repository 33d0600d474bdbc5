"""``python convert_driver.py PAUSE READY SRC DST [cli args...]``: runs ``specjax-convert``
(``cli.main``) with a pause, so that a test can send a real signal mid-conversion.

PAUSE is ``read`` (after the 3rd tensor is read: inside the staging directory, before the
orbax save) or ``commit`` (in orbax's background commit thread, while the main thread waits
for it). At the pause the driver creates the file READY and sleeps up to 60 s; the
process's exit status is ``cli.main``'s.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path


def _pause(ready: Path, seconds: float) -> None:
    ready.write_text("ready\n")
    time.sleep(seconds)


def main() -> int:
    pause, ready = sys.argv[1], Path(sys.argv[2])
    argv = sys.argv[3:]
    from specjax.converters import cli

    if pause == "read":
        class PausingProgress:
            def __init__(self, _stream=None):
                pass

            def __call__(self, done, total, key):
                if done == 3:
                    _pause(ready, 60)

        cli.ProgressBar = PausingProgress
    elif pause == "commit":
        # Slow down orbax's background commit thread: the main thread is then inside
        # wait_until_finished, joining it, when the signal arrives.
        from orbax.checkpoint._src.checkpointers import async_checkpointer as ac

        real = ac._background_wait_for_commit_futures

        def slow_commit(*a, **k):
            _pause(ready, 3)
            return real(*a, **k)

        ac._background_wait_for_commit_futures = slow_commit
    else:
        raise SystemExit(f"unknown pause {pause!r}")
    return cli.main(argv)


if __name__ == "__main__":
    sys.exit(main())

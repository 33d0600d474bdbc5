"""``specjax-convert SRC DST [--format F] [--dtype bf16|fp16|fp32] [--force]
[--allow-nonfinite]``.

Converts a checkpoint into orbax params plus ``specjax.json`` and SRC's tokenizer files
(:func:`specjax.converters.pipeline.convert`; docs/converters.md). Exit status 0 on
success, 1 on a conversion error or an existing DST, 2 on bad arguments or a refused DST,
130 on SIGINT, 143 on SIGTERM; nothing is left at DST after a failure.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from specjax.converters.destination import sigterm_raises
from specjax.converters.errors import (
    CheckpointError,
    DestinationError,
    DestinationExistsError,
    Interrupted,
    clip,
)
from specjax.converters.formats import FORMATS

DTYPE_CHOICES = ("bf16", "fp16", "fp32")


class ProgressBar:
    """A plain-text progress bar over the tensors written, with an ETA, on ``stream``
    (redrawn in place on a terminal, one line per 10% otherwise)."""

    def __init__(self, stream=None, width: int = 30, clock=time.monotonic):
        self.stream = stream or sys.stderr
        self.width = width
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.last_decile = -1
        self.clock = clock
        self.t0 = clock()

    def __call__(self, done: int, total: int, key: str) -> None:
        frac = done / total if total else 1.0
        filled = int(self.width * frac)
        elapsed = self.clock() - self.t0
        eta = elapsed * (total - done) / done if done else 0.0
        line = (f"[{'#' * filled}{'.' * (self.width - filled)}] {done}/{total} tensors  "
                f"{_clock(elapsed)} elapsed, ETA {_clock(eta)}  {key}")
        if self.tty:
            self.stream.write("\r" + line[:120].ljust(120))
            if done == total:
                self.stream.write("\n")
        else:
            decile = int(frac * 10)
            if decile == self.last_decile and done != total:
                return
            self.last_decile = decile
            self.stream.write(line + "\n")
        self.stream.flush()


def _clock(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


def build_parser() -> argparse.ArgumentParser:
    formats = "\n".join(f"  {name:20s} {f.description}" for name, f in FORMATS.items())
    p = argparse.ArgumentParser(
        prog="specjax-convert",
        description="Convert a draft-model or target-model checkpoint to a specjax "
                    "(orbax) checkpoint. No torch needed.",
        epilog=f"formats (auto-detected from config.json and tensor names):\n{formats}",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", metavar="SRC",
                   help="checkpoint directory (config.json + weights) or one weight file")
    p.add_argument("dst", metavar="DST", help="output directory (new, or an empty directory)")
    p.add_argument("--format", choices=sorted(FORMATS), default=None,
                   help="source format (default: auto-detect)")
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default=None,
                   help="float dtype of the output (default: the checkpoint's)")
    p.add_argument("--force", action="store_true", help="replace DST if it is a previous specjax output")
    p.add_argument("--allow-nonfinite", action="store_true",
                   help="convert tensors holding NaN / Inf (or overflowing --dtype) instead "
                        "of refusing them")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    return p


def _note(msg: str) -> None:
    print(f"specjax-convert: note: {msg}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from specjax.converters.pipeline import convert  # noqa: PLC0415 (imports jax)

    try:
        with sigterm_raises():
            summary = convert(args.src, args.dst, format=args.format, dtype=args.dtype,
                              force=args.force, log=_note,
                              allow_nonfinite=args.allow_nonfinite,
                              progress=None if args.quiet else ProgressBar(sys.stderr))
    except DestinationError as e:
        print(f"specjax-convert: error: {e}", file=sys.stderr)
        return 2
    except DestinationExistsError as e:
        print(f"specjax-convert: error: {e}", file=sys.stderr)
        return 1
    except (CheckpointError, ValueError, OSError) as e:
        print(f"specjax-convert: error: {clip(_one_line(e), 2000)}", file=sys.stderr)
        print(f"specjax-convert: nothing was written to {args.dst}", file=sys.stderr)
        return 1
    except (KeyboardInterrupt, Interrupted) as e:
        name, code = ("SIGINT", 130) if isinstance(e, KeyboardInterrupt) else ("SIGTERM", e.code)
        if getattr(e, "specjax_committed", False):
            what = f"the conversion had completed: {args.dst} holds it"
        else:
            what = f"nothing was written to {args.dst}"
        print(f"\nspecjax-convert: interrupted ({name}); {what}", file=sys.stderr)
        return code
    except Exception as e:  # noqa: BLE001 (a bug: still one line, no traceback)
        print(f"specjax-convert: error: unexpected {type(e).__name__}: "
              f"{clip(_one_line(e), 500)} (please report it)", file=sys.stderr)
        print(f"specjax-convert: nothing was written to {args.dst}", file=sys.stderr)
        return 1
    print(summary.text())
    return 0


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def entry() -> None:
    """The ``specjax-convert`` command: :func:`main`'s exit code."""
    # a failed run skips the interpreter's teardown, where orbax's worker threads still
    # post to its closed event loop and print tracebacks after the one-line error
    code = main()
    if code:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    entry()

"""``specjax-convert SRC DST [--format F] [--dtype bf16|fp16|fp32] [--force]``.

Converts a checkpoint (HF Llama/Qwen2/Qwen3, EAGLE, EAGLE-3, DFlash, Medusa; safetensors
or PyTorch files, read without torch) into a specjax checkpoint: orbax params plus
``specjax.json``. Exit status 0 on success, 1 on a conversion error (the message names
every unknown, missing or mis-shaped tensor), 2 on bad arguments, 130 when interrupted.
Nothing is left at DST after a failure.
"""

from __future__ import annotations

import argparse
import signal
import sys

from specjax.converters.errors import DestinationExistsError
from specjax.converters.formats import FORMATS

DTYPE_CHOICES = ("bf16", "fp16", "fp32")


class ProgressBar:
    """A plain-text progress bar over tensors on ``stream`` (redrawn in place on a
    terminal, one line per 10% otherwise)."""

    def __init__(self, stream=None, width: int = 30):
        self.stream = stream or sys.stderr
        self.width = width
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.last_decile = -1

    def __call__(self, done: int, total: int, key: str) -> None:
        frac = done / total if total else 1.0
        filled = int(self.width * frac)
        line = f"[{'#' * filled}{'.' * (self.width - filled)}] {done}/{total} tensors  {key}"
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
    p.add_argument("dst", metavar="DST", help="output directory (must not exist)")
    p.add_argument("--format", choices=sorted(FORMATS), default=None,
                   help="source format (default: auto-detect)")
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default=None,
                   help="float dtype of the output (default: the checkpoint's)")
    p.add_argument("--force", action="store_true", help="replace DST if it exists")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    return p


def _on_sigterm(signum, frame):
    raise SystemExit(128 + signum)  # unwinds through the cleanup in convert()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from specjax.converters.pipeline import convert  # noqa: PLC0415 (imports jax)

    try:
        old = signal.signal(signal.SIGTERM, _on_sigterm)
    except ValueError:  # not the main thread
        old = None
    try:
        summary = convert(args.src, args.dst, format=args.format, dtype=args.dtype,
                          force=args.force,
                          progress=None if args.quiet else ProgressBar(sys.stderr))
    except DestinationExistsError as e:
        print(f"specjax-convert: error: {e}", file=sys.stderr)
        return 1
    except (ValueError, OSError) as e:
        print(f"specjax-convert: error: {e}", file=sys.stderr)
        print(f"specjax-convert: nothing was written to {args.dst}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"\nspecjax-convert: interrupted; nothing was written to {args.dst}",
              file=sys.stderr)
        return 130
    finally:
        if old is not None:
            signal.signal(signal.SIGTERM, old)
    print(summary.text())
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The ``specjax`` console script.

``specjax demo``: speculative decoding with every available method on the embedded demo
model, checked against plain decoding (see :mod:`specjax.demo`). Runs on a fresh install
with no network and no GPU.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from specjax.demo import ALL_METHODS


def _positive(v: str) -> int:
    try:
        n = int(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {n}")
    return n


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specjax", description="Speculative decoding for JAX.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo", help="run every method on the embedded demo model and compare with plain decoding",
        description="Speculative decoding with each available method on the embedded default "
                    "model (random weights from a fixed seed until trained demo weights ship), "
                    "checked against plain greedy decoding; prints acceptance and speed.")
    demo.add_argument("--method", nargs="+", choices=ALL_METHODS, metavar="METHOD",
                      help=f"methods to run (default: all available): {', '.join(ALL_METHODS)}")
    demo.add_argument("--device", choices=("auto", "cpu", "gpu"), default="auto",
                      help="cpu: force the CPU; gpu: require JAX's default backend to be a GPU; "
                           "auto (default): JAX's default device")
    demo.add_argument("--max-tokens", type=_positive, default=48,
                      help="new tokens per prompt (default 48)")
    demo.add_argument("--k", type=_positive, default=3,
                      help="speculative tokens per step (default 3; extract_hidden_states uses 1)")
    demo.add_argument("--repeat", type=_positive, default=5,
                      help="timed runs per method; the table prints their median and spread "
                           "(default 5)")
    demo.add_argument("--steps-per-sync", type=_positive, default=None,
                      help="decoding iterations per host sync in the device loop (default: "
                           "specjax.demo.DEFAULT_STEPS_PER_SYNC; 1: one step per sync)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        from specjax.demo import main_demo

        return main_demo(args)
    return 2   # unreachable: argparse requires a command


if __name__ == "__main__":
    sys.exit(main())

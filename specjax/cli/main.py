"""The ``specjax`` console script (also ``python -m specjax``).

``specjax demo``: every available method on the shipped demo models, checked against plain
decoding (:mod:`specjax.cli.demo`); no network, no GPU. ``specjax generate --target DIR
[--speculative-config JSON] --prompt TEXT ...``: your own checkpoint with its tokenizer,
stop ids, an optional vLLM ``speculative_config`` and vLLM's sampling parameters as flags
(:mod:`specjax.cli.generate`). ``specjax --version``.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from specjax.cli.demo import ALL_METHODS, DEFAULT_BATCH, DEFAULT_MAX_TOKENS
from specjax.constants import DEFAULT_LOGPROBS_MODE, LOGPROBS_MODES, MAX_LOGPROBS


def _int_at_least(lo: int, what: str):
    def parse(v: str) -> int:
        try:
            n = int(v)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {v!r}") from None
        if n < lo:
            raise argparse.ArgumentTypeError(f"expected {what}, got {n}")
        return n
    return parse


_positive = _int_at_least(1, "a positive integer")
_non_negative = _int_at_least(0, "an integer >= 0")


def _temperature(v: str) -> float:
    try:
        t = float(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {v!r}") from None
    if not t >= 0 or t == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {v!r}")
    return t


def _number(v: str) -> float:
    try:
        x = float(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {v!r}") from None
    if x != x or x in (float("inf"), float("-inf")):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {v!r}")
    return x


def _int(v: str) -> int:
    try:
        return int(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {v!r}") from None


def _logit_bias(v: str) -> dict[int, float]:
    """``--logit-bias``: a JSON object ``{"TOKEN_ID": BIAS, ...}`` or one ``TOKEN_ID=BIAS``
    (the ranges are ``SamplingParams``')."""
    import json

    how = "a JSON object {\"TOKEN_ID\": BIAS, ...} or TOKEN_ID=BIAS"
    if v.lstrip().startswith("{"):
        try:
            d = json.loads(v)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"expected {how}; not valid JSON ({e})") from None
        if not isinstance(d, dict):
            raise argparse.ArgumentTypeError(f"expected {how}, got {v!r}")
        items: list[tuple[object, object]] = list(d.items())
    else:
        if v.count("=") != 1:
            raise argparse.ArgumentTypeError(f"expected {how}, got {v!r}")
        tid_s, bias_s = v.split("=")
        items = [(tid_s, bias_s)]
    out: dict[int, float] = {}
    for t, b in items:
        try:
            tid = int(str(t).strip())
            if isinstance(b, bool) or not isinstance(b, (int, float, str)):
                raise ValueError
            bias = float(b.strip() if isinstance(b, str) else b)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected {how} (integer token ids, numeric biases), got the entry "
                f"{t!r}: {b!r}") from None
        out[tid] = bias
    return out


def build_parser() -> argparse.ArgumentParser:
    from specjax import __version__

    parser = argparse.ArgumentParser(prog="specjax", description="Speculative decoding for JAX.")
    parser.add_argument("--version", action="version", version=f"specjax {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo", help="run every method on the shipped demo models and check each against plain "
                     "decoding",
        description="Speculative decoding with each available method on the shipped demo models "
                    "(specjax/demo_models: a byte-level Llama target trained on CPython's "
                    "standard library and one trained draft of each kind, loaded from their "
                    "upstream checkpoint layouts), or on your own with --target / --draft. The "
                    "table leads with the check (each method's tokens equal plain greedy "
                    "decoding's) and tokens per target forward pass (the mean acceptance "
                    "length, which does not depend on the machine's speed), then per-position "
                    "acceptance and "
                    "wall-clock tokens/s and speed-up; on a loaded machine (1-minute load "
                    "average of other work at 0.5 per core or more) the timings are flagged as "
                    "not meaningful.")
    demo.add_argument("--method", nargs="+", choices=ALL_METHODS, metavar="METHOD",
                      help=f"methods to run (default: all available): {', '.join(ALL_METHODS)}")
    demo.add_argument("--device", choices=("auto", "cpu", "gpu"), default="auto",
                      help="cpu: force the CPU; gpu: require JAX's default backend to be a GPU; "
                           "auto (default): JAX's default device")
    demo.add_argument("--max-tokens", type=_positive, default=DEFAULT_MAX_TOKENS,
                      help=f"new tokens per prompt (default {DEFAULT_MAX_TOKENS})")
    demo.add_argument("--batch", type=_non_negative, default=DEFAULT_BATCH,
                      help=f"requests decoded at once (default {DEFAULT_BATCH}: one after "
                           "another, the latency-bound case speculative decoding is for; 0: "
                           "every prompt in one batch; at most the number of prompts)")
    demo.add_argument("--k", type=_positive, default=3,
                      help="speculative tokens per step (default 3; extract_hidden_states uses 1)")
    demo.add_argument("--repeat", type=_positive, default=5,
                      help="timed runs per method; the table prints their median and spread "
                           "(default 5)")
    demo.add_argument("--steps-per-sync", type=_positive, default=None,
                      help="decoding iterations per host sync in the device loop (default: "
                           "specjax.cli.demo.DEFAULT_STEPS_PER_SYNC; 1: one step per sync)")
    demo.add_argument("--target", metavar="DIR", default=None,
                      help="your target checkpoint (a specjax-convert output or an original HF "
                           "directory, with its tokenizer: the hf extra) instead of the shipped "
                           "one; --method then picks among ngram, ngram_gpu, suffix, "
                           "extract_hidden_states")
    demo.add_argument("--draft", metavar="DIR", action="append", default=[],
                      help="a draft checkpoint for --target (repeat for more; one row each, the "
                           "method detected from the checkpoint)")
    demo.add_argument("--prompts", metavar="FILE", default=None,
                      help="prompts, one per line (default: the shipped Python-code prompts)")
    demo.add_argument("--temperature", type=_temperature, default=0.0,
                      help="0 (default): greedy, each method checked against plain decoding; "
                           "> 0: seeded sampling, acceptance and speed only")
    gen = sub.add_parser(
        "generate", help="generate text with your own checkpoint (and a speculative_config)",
        description="Load --target (a specjax-convert output or an original HF checkpoint "
                    "directory) with its tokenizer (needs the hf extra: pip install "
                    "\"specjax[hf]\"), encode each prompt (through the chat template when the "
                    "tokenizer has one), generate, and print the text, the mean acceptance "
                    "length and tokens/s.")
    gen.add_argument("--target", required=True, metavar="DIR",
                     help="the target checkpoint: a specjax-convert output (which carries its "
                          "source's tokenizer) or an original HF checkpoint directory")
    gen.add_argument("--tokenizer", metavar="DIR", default=None,
                     help="take the tokenizer (and generation_config.json, when DIR has one) "
                          "from DIR instead of --target, e.g. the original checkpoint of a "
                          "conversion that has no tokenizer")
    gen.add_argument("--speculative-config", metavar="JSON", default=None,
                     help="a vLLM speculative_config as JSON, e.g. '{\"method\": \"eagle3\", "
                          "\"model\": \"DIR2\", \"num_speculative_tokens\": 3}' (default: "
                          "plain decoding)")
    gen.add_argument("--prompt", action="append", default=[], metavar="TEXT",
                     help="a prompt (repeat for a batch)")
    gen.add_argument("--prompts", metavar="FILE", default=None,
                     help="a file of prompts, one per line")
    gen.add_argument("--max-tokens", type=_positive, default=64, help="new tokens per prompt")
    gen.add_argument("--temperature", type=_temperature, default=0.0,
                     help="0 (default) is greedy")
    gen.add_argument("--top-k", type=_int, default=0, help="0 (default) disables")
    gen.add_argument("--top-p", type=_number, default=1.0, help="in (0, 1]; 1 (default) disables")
    gen.add_argument("--seed", type=int, default=0)
    # vLLM's per-request sampling parameters (SamplingParams checks the ranges before any
    # model is loaded; docs/sampling.md)
    gen.add_argument("--min-p", type=_number, default=0.0,
                     help="in [0, 1]: drop tokens below min_p times the top probability "
                          "(0, the default, disables)")
    gen.add_argument("--presence-penalty", type=_number, default=0.0,
                     help="in [-2, 2], subtracted once for each token in the output (0 disables)")
    gen.add_argument("--frequency-penalty", type=_number, default=0.0,
                     help="in [-2, 2], subtracted per occurrence in the output (0 disables)")
    gen.add_argument("--repetition-penalty", type=_number, default=1.0,
                     help="> 0, over prompt and output tokens (1, the default, disables)")
    gen.add_argument("--min-tokens", type=_int, default=0,
                     help="stop and EOS tokens are suppressed until this many were generated "
                          "(<= --max-tokens)")
    gen.add_argument("--stop-token-ids", type=_int, nargs="+", default=[], metavar="ID",
                     help="stop after any of these token ids (added to generation_config.json's "
                          "EOS ids)")
    gen.add_argument("--ignore-eos", action="store_true",
                     help="do not stop on the EOS ids of generation_config.json / the tokenizer")
    gen.add_argument("--bad-words", action="append", default=[], metavar="WORD",
                     help="a word never to complete (repeat for more), tokenized as vLLM does: "
                          "as written and with a leading space")
    gen.add_argument("--allowed-token-ids", type=_int, nargs="+", default=None, metavar="ID",
                     help="only these token ids may be generated")
    gen.add_argument("--logit-bias", type=_logit_bias, action="append", default=[],
                     metavar="ID=BIAS|JSON",
                     help="add BIAS (in [-100, 100]) to token ID's logit: TOKEN_ID=BIAS "
                          "(repeat for more) or a JSON object '{\"TOKEN_ID\": BIAS}'")
    gen.add_argument("--logprobs", type=_int, default=None, metavar="N",
                     help="print each generated token's logprob and rank and the top N "
                          f"(0..{MAX_LOGPROBS}; default: off)")
    gen.add_argument("--logprobs-mode", choices=LOGPROBS_MODES, default=DEFAULT_LOGPROBS_MODE,
                     help=f"what --logprobs returns (vLLM's LogprobsMode): "
                          f"{', '.join(LOGPROBS_MODES)} (default {DEFAULT_LOGPROBS_MODE})")
    gen.add_argument("--json", metavar="FILE", default=None,
                     help="also write the results as JSON: a list with, per prompt, prompt, "
                          "text, token_ids, finish_reason and logprobs")
    gen.add_argument("--max-model-len", type=_positive, default=None,
                     help="context cap (default: min(max_position_embeddings, 4096))")
    gen.add_argument("--no-chat-template", action="store_true",
                     help="encode prompts as plain text even if the tokenizer has a chat template")
    gen.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default=None,
                     help="cast the weights (default: as stored)")
    gen.add_argument("--device", choices=("auto", "cpu"), default="auto")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        from specjax.cli.demo import main_demo

        return main_demo(args)
    if args.command == "generate":
        from specjax.cli.generate import main_generate

        return main_generate(args)
    return 2   # unreachable: argparse requires a command


if __name__ == "__main__":
    sys.exit(main())

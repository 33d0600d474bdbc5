"""``specjax demo``: every available method on an embedded default model, checked against
plain decoding, with a table of acceptance and speed.

The embedded model is a byte-level (vocabulary 256) Llama-shaped decoder, 2 layers of
width 64, **built from a fixed seed**: until trained demo weights ship (issue 7) it is
random, so the draft heads (random too) accept almost nothing, while n-gram / suffix
decoding accept on the repetitive prompts (a random model's greedy output falls into
loops) and the draft model (the target's first layer with the target's embedding and head,
LayerSkip-style self-speculation) accepts some. The point of the demo is that every
method runs end to end and is lossless; the speed column is honest about the tiny model,
where each step costs mostly host time.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from typing import Sequence, TextIO

from specjax.config import SpeculativeConfig

SEED = 0
VOCAB = 256
GEOMETRY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=VOCAB)
TARGET_LAYERS = 2
AUX_LAYER_IDS = (0, 1)
BLOCK_SIZE = 16
MAX_MODEL_LEN = 256
MASK_TOKEN_ID = 0        # DFlash's parallel-drafting token (the NUL byte)

PROMPTS = (
    b"the quick brown fox jumps over the lazy dog. the quick brown fox jumps over the lazy",
    b"def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    b"1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20,",
    b"To be, or not to be, that is the question. To be, or not to be, that is",
)

#: Every method, in table order.
ALL_METHODS = ("ngram", "ngram_gpu", "suffix", "eagle", "eagle3", "dflash", "medusa",
               "draft_model", "extract_hidden_states")

NOTE = ("NOTE: the embedded demo model and every draft head have RANDOM weights, built from "
        f"seed {SEED}; trained demo weights are not shipped yet (issue 7). Random heads accept "
        "~nothing; n-gram / suffix decoding accept on the repetitive prompts; the draft model "
        "is the target's first layer (self-speculation). Every method must still reproduce plain "
        "greedy decoding exactly (the check column).")


@dataclasses.dataclass
class Row:
    method: str
    k: int
    mean_acceptance_length: float
    per_position: list[float]
    tokens_per_s: float
    speedup: float
    ok: bool
    note: str = ""


def demo_target():
    """The embedded target: ``TargetModel`` of a random byte-level 2-layer Llama."""
    from specjax.engine import TargetModel
    from specjax.models import registry

    cfg = registry.config_from_hf("llama", dict(GEOMETRY, num_hidden_layers=TARGET_LAYERS))
    return TargetModel(registry.make_model("llama", cfg), registry.init_params("llama", cfg, SEED))


def demo_proposer(method: str, k: int, target):
    """The demo's proposer of ``method`` (random heads from fixed seeds)."""
    from specjax.models import registry
    from specjax.proposers import make_proposer

    common = dict(max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE)
    if method in ("ngram", "ngram_gpu"):
        cfg = SpeculativeConfig(method=method, num_speculative_tokens=k, prompt_lookup_min=2,
                                prompt_lookup_max=5)
        return make_proposer(cfg, **common)
    if method == "suffix":
        return make_proposer(SpeculativeConfig(method=method, num_speculative_tokens=k), **common)
    tm, tp = target
    common.update(target=tm, target_params=tp)
    if method == "extract_hidden_states":
        return make_proposer(SpeculativeConfig(method=method, num_speculative_tokens=1),
                             aux_layer_ids=AUX_LAYER_IDS, **common)
    if method == "draft_model":
        cfg = registry.config_from_hf("llama", dict(GEOMETRY, num_hidden_layers=1))
        params = {"embed_tokens": tp["embed_tokens"], "layers": {0: tp["layers"][0]},
                  "norm": tp["norm"], "lm_head": tp["lm_head"]}
        spec = SpeculativeConfig(method=method, model="demo-target-layer-0", num_speculative_tokens=k)
        return make_proposer(spec, draft=cfg, draft_params=params, **common)
    head = {
        "eagle": dict(GEOMETRY, num_hidden_layers=1, bias=True),
        "eagle3": dict(GEOMETRY, num_hidden_layers=1, target_hidden_size=GEOMETRY["hidden_size"],
                       eagle_aux_hidden_state_layer_ids=list(AUX_LAYER_IDS)),
        "dflash": dict(GEOMETRY, num_hidden_layers=1, target_hidden_size=GEOMETRY["hidden_size"],
                       aux_hidden_state_layer_ids=list(AUX_LAYER_IDS), mask_token_id=MASK_TOKEN_ID),
        "medusa": dict(num_heads=max(k, 4), num_hidden_layers=1,
                       hidden_size=GEOMETRY["hidden_size"], vocab_size=VOCAB),
    }[method]
    cfg = registry.config_from_hf(method, head)
    params = registry.init_params(method, cfg, SEED + 1)
    return make_proposer(SpeculativeConfig(method=method, num_speculative_tokens=k), draft=cfg,
                         draft_params=params, **common)


def _prompts() -> list[list[int]]:
    return [list(p) for p in PROMPTS]


class _Progress:
    """One status line on stderr (redrawn in place on a terminal)."""

    def __init__(self, err: TextIO, total_methods: int) -> None:
        self.err, self.total = err, total_methods
        self.tty = hasattr(err, "isatty") and err.isatty()
        self.i = 0

    def start(self, label: str) -> None:
        self.i += 1
        self.label = f"[{self.i}/{self.total}] {label}"
        self.t0 = time.perf_counter()
        self._draw("compiling ...")

    def update(self, done: int, total: int, tokens: int) -> None:
        if self.tty:
            width = 20
            fill = int(width * done / max(total, 1))
            self._draw(f"|{'#' * fill}{'.' * (width - fill)}| {done}/{total} requests, {tokens} tokens")

    def finish(self, text: str) -> None:
        self._draw(f"{text} ({time.perf_counter() - self.t0:.1f} s)", end="\n")

    def _draw(self, text: str, end: str = "") -> None:
        if self.tty:
            self.err.write(f"\r\033[K{self.label:<32} {text}{end}")
        elif end:
            self.err.write(f"{self.label:<32} {text}{end}")
        self.err.flush()


def _timed(target, make_proposer, prompts, max_tokens: int, progress: _Progress | None,
           repeats: int = 5):
    """A short warm-up run (compiles the prefill and decode buckets), then the timed run,
    ``repeats`` times; the fastest counts (the tiny model's steps are short and noisy).
    Every run gets a fresh proposer (same configuration, so no new compilation): suffix
    decoding must not draft from its cache of the previous runs' responses."""
    from specjax.engine import Engine, SamplingParams

    def engine():
        return Engine(target, make_proposer(), max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE,
                      max_num_seqs=len(prompts), batch_buckets=(len(prompts),),
                      context_buckets=(MAX_MODEL_LEN // BLOCK_SIZE,))

    engine().generate(prompts, SamplingParams(max_tokens=min(3, max_tokens)))
    best = None
    for _ in range(repeats):
        res = engine().generate(prompts, SamplingParams(max_tokens=max_tokens),
                                progress=None if progress is None else progress.update)
        if best is not None and res.token_ids != best.token_ids:
            raise RuntimeError("greedy decoding gave different tokens on a repeated run")
        if best is None or res.elapsed_s < best.elapsed_s:
            best = res
    return best


def run_demo(methods: Sequence[str] | None = None, *, k: int = 3, max_tokens: int = 48,
             device=None, out: TextIO | None = None, err: TextIO | None = None) -> list[Row]:
    """Run the demo; print the note and the table on ``out``, progress on ``err``.

    Returns one ``Row`` per method that ran (plain decoding first, as ``"plain"``).
    """
    import jax

    from specjax.proposers import available_methods

    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    have = available_methods()
    wanted = list(ALL_METHODS if not methods else methods)
    unknown = [m for m in wanted if m not in ALL_METHODS]
    if unknown:
        raise ValueError(f"unknown method(s) {unknown}; choose from {ALL_METHODS}")
    skipped = [m for m in wanted if m not in have]
    run = [m for m in wanted if m in have]
    prompts = _prompts()
    dev = device if device is not None else jax.devices()[0]
    print(NOTE, file=out)
    print(f"target: byte-level Llama, {TARGET_LAYERS} layers, hidden {GEOMETRY['hidden_size']}, "
          f"vocab {VOCAB}; {len(prompts)} prompts, {max_tokens} new tokens each, k={k}, greedy; "
          f"device: {dev.platform} ({dev.device_kind})", file=out)
    for m in skipped:
        hint = ' (pip install "specjax[suffix]")' if m == "suffix" else ""
        print(f"skipped {m}: not available in this install{hint}", file=out)
    out.flush()

    progress = _Progress(err, len(run) + 1)
    target = demo_target()
    progress.start("plain decoding")
    base = _timed(target, lambda: None, prompts, max_tokens, progress)
    base_tps = base.num_generated_tokens / base.elapsed_s
    progress.finish(f"{base_tps:.0f} tokens/s")
    rows = [Row("plain", 0, 1.0, [], base_tps, 1.0, True)]
    for m in run:
        mk = 1 if m == "extract_hidden_states" else k
        progress.start(m)
        res = _timed(target, lambda: demo_proposer(m, mk, target), prompts, max_tokens, progress)
        tps = res.num_generated_tokens / res.elapsed_s
        ok = res.token_ids == base.token_ids
        progress.finish("OK" if ok else "MISMATCH")
        rows.append(Row(m, mk, res.mean_acceptance_length, res.acceptance_rate_per_position, tps,
                        tps / base_tps, ok))
    print(format_table(rows), file=out)
    print("tokens/s: generated tokens / wall time of the whole batch, best of 5 runs, compilation "
          "excluded. On this tiny model a step costs mostly host time, so the speed-ups say little "
          "about a real model; see benchmarks/e2e.py for step costs on a GPU.", file=out)
    bad = [r.method for r in rows if not r.ok]
    print("all methods reproduce plain greedy decoding: " + ("OK" if not bad else
          f"MISMATCH in {', '.join(bad)}"), file=out)
    out.flush()
    return rows


def format_table(rows: Sequence[Row]) -> str:
    head = ("method", "k", "mean acc. len", "per-position acceptance", "tokens/s", "speed-up", "check")
    body = []
    for r in rows:
        mal = "-" if r.method == "plain" else ("nan" if math.isnan(r.mean_acceptance_length)
                                                else f"{r.mean_acceptance_length:.2f}")
        pp = "-" if not r.per_position else " ".join(f"{p:.2f}" for p in r.per_position)
        body.append((r.method, str(r.k) if r.k else "-", mal, pp, f"{r.tokens_per_s:.0f}",
                     f"{r.speedup:.2f}x", "OK" if r.ok else "MISMATCH"))
    widths = [max(len(x[i]) for x in [head] + body) for i in range(len(head))]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([line(head), line(["-" * w for w in widths])] + [line(b) for b in body])


def main_demo(args, out: TextIO | None = None, err: TextIO | None = None) -> int:
    import contextlib

    import jax

    if args.device == "cpu":
        dev = jax.devices("cpu")[0]
        ctx = jax.default_device(dev)
    else:
        dev = jax.devices()[0]
        if args.device == "gpu" and jax.default_backend() != "gpu":
            print(f"--device gpu: JAX's default backend is {jax.default_backend()!r}, not a GPU "
                  "(install jax[cuda12] or jax[cuda13])", file=err or sys.stderr)
            return 2
        ctx = contextlib.nullcontext()
    with ctx:
        rows = run_demo(args.method, k=args.k, max_tokens=args.max_tokens, device=dev, out=out,
                        err=err)
    return 0 if all(r.ok for r in rows) else 1


__all__ = ["run_demo", "demo_target", "demo_proposer", "format_table", "ALL_METHODS", "PROMPTS",
           "Row", "main_demo"]

"""``specjax demo``: every available method on the shipped demo models
(:mod:`specjax.demo_models`). The table leads with what does not depend on the machine: the
check (each method's output equals plain greedy decoding) and tokens per target forward
pass; then per-position acceptance and the wall-clock columns, with the machine's load
(:func:`machine_load`, flagged at :data:`LOAD_THRESHOLD` per core). ``--target`` /
``--draft`` / ``--prompts`` run the same table on your own checkpoints (docs/demo.md).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import sys
import time
from typing import Sequence, TextIO

from specjax.config import SpeculativeConfig
from specjax.tokenizer import BOS_ID, VOCAB_SIZE

VOCAB = VOCAB_SIZE
BLOCK_SIZE = 16
MAX_MODEL_LEN = 512
#: The demo's decoding iterations per host sync (the device loop; see run_demo).
DEFAULT_STEPS_PER_SYNC = 8
#: Requests decoded at once (``--batch``): one, the latency-bound setting speculative
#: decoding is for. On 2 CPU cores the 4 prompts batched make the products compute-bound
#: (the 16-row verify costs 1.7x the 4-row step alone) and no method gained (EAGLE-3 0.84x;
#: README, "Demo").
DEFAULT_BATCH = 1
#: New tokens per prompt (``--max-tokens``): long enough that the prefill steps, which no
#: method speeds up, are a small part of the run.
DEFAULT_MAX_TOKENS = 128

#: The demo's prompts: starts of Python files (BOS first, as in training).
PROMPTS = (
    b'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n    if n < 2:\n        return n\n',
    b"import os\nimport sys\n\n\ndef main(argv=None):\n    if argv is None:\n        argv = sys.argv[1:]\n",
    b"class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    b'"""Utilities for reading configuration files."""\n\nimport re\n\n__all__ = ["read_config", ',
)

#: Every method, in table order.
ALL_METHODS = ("ngram", "ngram_gpu", "suffix", "eagle", "eagle3", "dflash", "dspark", "medusa",
               "draft_model", "extract_hidden_states")

NOTE = ("Models: the shipped demo weights (specjax/demo_models: a byte-level Llama target trained "
        "on CPython's stdlib sources and one trained draft of each kind, loaded from their upstream "
        "checkpoint layouts). extract_hidden_states is not a drafter: its draft is the token just "
        "sampled, accepted only when a byte repeats. Every method must reproduce plain greedy decoding exactly (the check column).")

#: Load per core (other work's 1-minute load average over ``os.cpu_count()``) at or above
#: which the wall-clock columns are flagged: from there other jobs take a large share of
#: the cores the timed runs use.
LOAD_THRESHOLD = 0.5

#: Printed once on a CPU device: why its speed-ups are smaller than a GPU's.
CPU_NOTE = ("cpu: speed-ups here are smaller than on a GPU. On a few CPU cores this small "
            "model's matrix products are compute-bound and much of its step is XLA:CPU's fixed "
            "cost per op, so the verify's k extra rows add to the step's time and a drafter "
            "pass, which pays the same cost per op, is not cheap next to a target step; on a "
            "GPU a decode step is memory-bound (it reads every weight once, whatever the rows), "
            "so verifying k+1 tokens costs about what one token costs. "
            "benchmarks/demo_pieces.py times each pass here; benchmarks/e2e.py and "
            "benchmarks/loop.py measure GPU costs.")


def _cpu_s() -> float:
    """CPU seconds this process has used (user + system, all its threads)."""
    t = os.times()
    return t.user + t.system


def load_line(load: float | None) -> str | None:
    """The line printed for other work's ``load`` per core (flagged at
    :data:`LOAD_THRESHOLD` or more); None when the load is unknown."""
    if load is None:
        return None
    what = (f"load {load:.2f} per core (other work's 1-minute load average, the larger of "
            f"before and after the timed runs")
    if load < LOAD_THRESHOLD:
        return f"{what}; below {LOAD_THRESHOLD}, not loaded)"
    return (f"{what}; {LOAD_THRESHOLD} or more is loaded): the wall-clock columns (tokens/s, "
            "spread, speed-up) are not meaningful on a loaded machine; read the check and "
            "tokens/fwd columns.")


class _OwnLoad:
    """This process's share of the 1-minute load average: its busy cores between calls,
    decayed as the kernel decays the load average (time constant 60 s)."""

    def __init__(self) -> None:
        t, c = time.monotonic(), _cpu_s()
        self.marks = [(t - c, 0.0), (t, c)]

    def __call__(self) -> float:
        now, c = time.monotonic(), _cpu_s()
        self.marks.append((now, c))
        own = 0.0
        for (t0, c0), (t1, c1) in zip(self.marks, self.marks[1:]):
            if t1 > t0:
                weight = math.exp((t1 - now) / 60) - math.exp((t0 - now) / 60)
                own += (c1 - c0) / (t1 - t0) * weight
        return own


def machine_load(own_cores: float = 0.0) -> float | None:
    """Other work's load per core: ``(os.getloadavg()[0] - own_cores) / os.cpu_count()``,
    at least 0; None where the OS gives no load average."""
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        return None
    return max(load - own_cores, 0.0) / (os.cpu_count() or 1)


@dataclasses.dataclass
class Row:
    method: str
    k: int
    mean_acceptance_length: float
    per_position: list[float]
    tokens_per_s: float
    speedup: float
    ok: bool | None              # None: sampled (the check needs greedy decoding)
    note: str = ""
    spread: float = 0.0          # (max - min) / median tokens/s over the repeated runs
    steps_per_sync: int = 1      # iterations per host sync the method ran with
    tokens_per_iter: float = 1.0  # tokens per request per decoding iteration (after prefill)
    ms_per_iter: float = 0.0     # wall time per decoding iteration (the median run's)


def demo_target():
    """The embedded target: ``TargetModel`` of the shipped byte-level Llama (fp32)."""
    from specjax import demo_models
    from specjax.engine import TargetModel
    from specjax.models import registry

    _, cfg, params = demo_models.load("target")
    return TargetModel(registry.make_model("llama", cfg), params)


def demo_proposer(method: str, k: int, target, *, max_model_len: int = MAX_MODEL_LEN,
                  block_size: int = BLOCK_SIZE, tree: str | None = None, **options):
    """The demo's proposer of ``method`` with ``k`` speculative tokens (shipped weights);
    ``tree``: a ``speculative_token_tree`` for ``eagle`` / ``eagle3`` (``k`` then ignored);
    ``options``: further ``SpeculativeConfig`` fields (model methods, suffix)."""
    from specjax import demo_models
    from specjax.proposers import make_proposer

    common = dict(max_model_len=max_model_len, block_size=block_size)
    if method in ("ngram", "ngram_gpu"):
        cfg = SpeculativeConfig(method=method, num_speculative_tokens=k, prompt_lookup_min=2,
                                prompt_lookup_max=5)
        return make_proposer(cfg, **common)
    if method == "suffix":
        return make_proposer(SpeculativeConfig(method=method, num_speculative_tokens=k,
                                               **options), **common)
    tm, tp = target
    common.update(target=tm, target_params=tp)
    if method == "extract_hidden_states":
        from specjax.training.recipe import AUX_LAYER_IDS

        return make_proposer(SpeculativeConfig(method=method, num_speculative_tokens=1),
                             aux_layer_ids=AUX_LAYER_IDS, **common)
    if method not in demo_models.NAMES:
        raise ValueError(f"method must be one of {ALL_METHODS}, got {method!r}")
    _, cfg, params = demo_models.load(method)
    # draft_model needs a model name; the weights come as draft= (a name, not a path: a
    # relative path that exists from the caller's directory would be loaded as well)
    extra = {"model": "specjax-demo-draft-model"} if method == "draft_model" else {}
    if tree is not None:
        from specjax.token_tree import TokenTree

        extra["speculative_token_tree"] = tree
        k = TokenTree.from_choices(tree).num_nodes
    spec = SpeculativeConfig(method=method, num_speculative_tokens=k, **extra, **options)
    return make_proposer(spec, draft=cfg, draft_params=params, **common)


def _prompts() -> list[list[int]]:
    return [[BOS_ID] + list(p) for p in PROMPTS]


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


class _Timer:
    """One method's timed runs of the whole workload (:meth:`warm` compiles, :meth:`run`
    times one run); ``batch``: requests decoded at once (None: every prompt). Every run
    gets a fresh proposer, so suffix decoding cannot draft from earlier runs' responses."""

    def __init__(self, target, make_proposer, prompts, max_tokens: int, steps_per_sync: int,
                 max_model_len: int, temperature: float, batch: int | None) -> None:
        from specjax.engine import SamplingParams

        self.target, self.make_proposer, self.prompts = target, make_proposer, prompts
        self.steps_per_sync, self.max_model_len = steps_per_sync, max_model_len
        self.batch = len(prompts) if batch is None else batch
        self.sp = SamplingParams(max_tokens=max_tokens, temperature=temperature)
        self.runs: list = []
        self.decode: list[tuple[float, float]] = []
        self.used_steps_per_sync = 1

    def _engine(self):
        import dataclasses

        from specjax.runtime.decode_loop import loop_support
        from specjax.engine import Engine, LoopOptions

        eng = Engine(self.target, self.make_proposer(), max_model_len=self.max_model_len,
                     block_size=BLOCK_SIZE, max_num_seqs=self.batch, options=LoopOptions(
                         batch_buckets=(self.batch,),
                         query_buckets=query_buckets(self.prompts, self.max_model_len),
                         context_buckets=context_buckets(self.max_model_len)))
        if self.steps_per_sync > 1 and loop_support(eng.step) is None:
            eng.options = dataclasses.replace(eng.options, steps_per_sync=self.steps_per_sync)
        return eng

    def warm(self) -> None:
        eng = self._engine()
        eng.generate(self.prompts, self.sp)        # compiles every bucket the timed runs use
        self.used_steps_per_sync = eng.options.steps_per_sync

    def run(self, progress: _Progress | None) -> None:
        marks: list[tuple[float, int]] = []     # (time, generated tokens) after each iteration

        def on_step(done, total, tokens, started):
            if started == total:                # every request past its prefill
                marks.append((time.perf_counter(), tokens))
            if progress is not None:
                progress.update(done, total, tokens)

        res = self._engine().generate(self.prompts, self.sp, progress=on_step)
        if self.runs and res.token_ids != self.runs[0].token_ids:
            raise RuntimeError("a repeated run gave different tokens (greedy or seeded)")
        self.runs.append(res)
        # once every request has its first token: (tokens per request, ms) per iteration
        its = max(len(marks) - 1, 1)
        self.decode.append(((marks[-1][1] - marks[0][1]) / its / self.batch,
                            (marks[-1][0] - marks[0][0]) / its * 1e3))

    def result(self):
        """``(result, median tokens/s, spread (max - min) / median, steps_per_sync, the
        median run's (tokens per request, ms) per decoding iteration)``."""
        import statistics

        tps = [r.num_generated_tokens / r.elapsed_s for r in self.runs]
        med = statistics.median(tps)
        i = tps.index(sorted(tps)[len(tps) // 2])
        return (self.runs[0], med, (max(tps) - min(tps)) / med, self.used_steps_per_sync,
                self.decode[i])


def run_demo(methods: Sequence[str] | None = None, *, k: int = 3,
             max_tokens: int = DEFAULT_MAX_TOKENS, device=None, out: TextIO | None = None,
             err: TextIO | None = None, repeat: int = 5,
             steps_per_sync: int = DEFAULT_STEPS_PER_SYNC, target_dir: str | None = None,
             draft_dirs: Sequence[str] = (), prompts_file: str | None = None,
             temperature: float = 0.0, batch: int | None = DEFAULT_BATCH) -> list[Row]:
    """Run the demo; print the note and the table on ``out``, progress on ``err``. Returns
    one ``Row`` per method that ran, plain decoding (``"plain"``) first.

    Arguments are the CLI flags (docs/demo.md): ``target_dir`` / ``draft_dirs`` /
    ``prompts_file`` are ``--target`` / ``--draft`` / ``--prompts`` (bad paths refused
    before anything loads); ``batch`` None decodes every prompt at once.
    """
    import jax

    from specjax.proposers import available_methods

    own_load = _OwnLoad()
    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    wanted = list(methods or ())
    unknown = [m for m in wanted if m not in ALL_METHODS]
    if unknown:
        raise ValueError(f"unknown method(s) {unknown}; choose from {ALL_METHODS}")
    lines = _check_demo_paths(target_dir, draft_dirs, prompts_file)
    n_prompts = len(PROMPTS) if lines is None else len(lines)
    if batch is not None and (isinstance(batch, bool) or not isinstance(batch, int)
                              or not 1 <= batch <= n_prompts):
        raise ValueError(f"--batch must be an int from 1 to the number of prompts ({n_prompts}) "
                         f"or every prompt at once (--batch 0, batch=None), got {batch!r}")
    have = available_methods()
    if target_dir is None:
        wanted = wanted or list(ALL_METHODS)
    else:
        model_based = [m for m in wanted if m not in _MODEL_FREE]
        if model_based:
            raise ValueError(f"--method {' '.join(model_based)}: with --target, model-based "
                             f"methods come from --draft DIR (their checkpoints); --method picks "
                             f"among {_MODEL_FREE}")
        wanted = wanted or [m for m in _MODEL_FREE if m != "extract_hidden_states"]
    skipped = [m for m in wanted if m not in have]
    run = [m for m in wanted if m in have]
    dev = device if device is not None else jax.devices()[0]
    mode = "greedy" if temperature == 0 else f"temperature {temperature} (seeded)"
    if target_dir is None:
        target = demo_target()
        prompts = _prompts() if lines is None else [[BOS_ID] + list(x.encode()) for x in lines]
        mml = _context(prompts, max_tokens, k)
        rows_spec = [(m, 1 if m == "extract_hidden_states" else k,
                      functools.partial(demo_proposer, m, 1 if m == "extract_hidden_states" else k,
                                        target, max_model_len=mml)) for m in run]
        print(NOTE, file=out)
        print(f"target: byte-level Llama, 4 layers, hidden 256, vocab {VOCAB}; {len(prompts)} "
              f"prompts, {max_tokens} new tokens each, {_batching(batch, len(prompts))}, k={k}, "
              f"{mode}; device: {dev.platform} ({dev.device_kind})", file=out)
    else:
        target, prompts, mml, rows_spec, about = _user_setup(
            target_dir, draft_dirs, lines, run, k, max_tokens)
        print(USER_NOTE, file=out)
        print(f"target: {about}; {len(prompts)} prompts, {max_tokens} new tokens each, "
              f"{_batching(batch, len(prompts))}, k={k}, {mode}; device: {dev.platform} "
              f"({dev.device_kind})", file=out)
    for m in skipped:
        hint = ' (pip install "specjax[suffix]")' if m == "suffix" else ""
        print(f"skipped {m}: not available in this install{hint}", file=out)
    out.flush()

    specs = [("plain", 0, lambda: None)] + list(rows_spec)
    timers = [_Timer(target, make, prompts, max_tokens, steps_per_sync, mml, temperature, batch)
              for _, _, make in specs]
    progress = _Progress(err, len(specs))
    for (label, _, _), t in zip(specs, timers):       # compile every method first
        progress.start("plain decoding" if label == "plain" else label)
        t.warm()
        progress.finish("compiled")
    loads = [machine_load(own_load())]      # other work's, before the timed runs and after
    rounds = _Progress(err, repeat)
    for _ in range(repeat):                           # then one timed run of each a round
        rounds.start(f"timed round (of {repeat})")
        for t in timers:
            t.run(rounds)
        rounds.finish("done")
    loads.append(machine_load(own_load()))
    known = [x for x in loads if x is not None]
    load = max(known) if known else None
    rows = []
    for (label, mk, _), t in zip(specs, timers):
        res, tps, spread, n, mid = t.result()
        if label == "plain":
            base, base_tps = res, tps
            rows.append(Row("plain", 0, 1.0, [], tps, 1.0, True if temperature == 0 else None,
                            spread=spread, steps_per_sync=n, tokens_per_iter=mid[0],
                            ms_per_iter=mid[1]))
            continue
        ok = res.token_ids == base.token_ids if temperature == 0 else None
        rows.append(Row(label, mk, res.mean_acceptance_length, res.acceptance_rate_per_position,
                        tps, tps / base_tps, ok, spread=spread, steps_per_sync=n,
                        tokens_per_iter=mid[0], ms_per_iter=mid[1]))
    print(format_table(rows), file=out)
    bad = [r.method for r in rows if r.ok is False]
    if temperature == 0:
        print("all methods reproduce plain greedy decoding: " + ("OK" if not bad else
              f"MISMATCH in {', '.join(bad)}"), file=out)
    else:
        print(f"temperature {temperature}: seeded sampling, no token check (sampled speculative "
              "decoding keeps the target's distribution, not plain decoding's tokens; the "
              "distribution tests are in tests/test_sampler.py)", file=out)
    print("check: the method's tokens equal plain greedy decoding's (OK / MISMATCH; - when "
          "sampled). tokens/fwd: tokens per target forward pass per request, the mean "
          "acceptance length (plain decoding: 1.00), set by the models and the prompts, not by "
          "the machine's speed.", file=out)
    if (line := load_line(load)) is not None:
        print(line, file=out)
    for line in slow_reasons(rows):
        print(line, file=out)
    print(f"tokens/s: generated tokens / wall time of all the prompts, median of {repeat} runs "
          f"(spread: (max - min) / median, widened by other jobs on the machine), compilation "
          f"excluded, the runs interleaved (one of "
          f"every method a round, so load from other jobs hits every row alike); sync: "
          f"decoding iterations per host sync (the device loop, steps_per_sync={steps_per_sync}; "
          "1: a method that drafts on the host runs one step per sync); speed-up: tokens/s over "
          "plain decoding's.", file=out)
    if dev.platform == "cpu":
        print(CPU_NOTE, file=out)
    out.flush()
    return rows


def _batching(batch: int | None, n: int) -> str:
    if batch is None or batch >= n:
        return f"all {n} in one batch"
    return "one request at a time" if batch == 1 else f"{batch} requests at a time"


def query_buckets(prompts, max_model_len: int = MAX_MODEL_LEN) -> tuple[int, ...]:
    """The demo's query buckets: powers of two (decode steps) and the longest prompt rounded
    up to a multiple of 16 (the prefill step; a smaller bucket than the next power of two)."""
    longest = max(len(p) for p in prompts)
    return tuple(sorted({1 << i for i in range(max_model_len.bit_length())}
                        | {-(-longest // 16) * 16}))


def context_buckets(max_model_len: int = MAX_MODEL_LEN) -> tuple[int, ...]:
    """KV block-table widths the demo compiles for: 8, 16, then powers of two up to
    ``max_model_len`` (attention reads the whole bucket, so narrow ones pay)."""
    top = max_model_len // BLOCK_SIZE
    return tuple(sorted({w for w in (8, 16) if w < top} | {1 << i for i in range(5, top.bit_length())
                                                            if 1 << i < top} | {top}))


def slow_reasons(rows: Sequence[Row]) -> list[str]:
    """One measured reason per method below 1.0x: tokens and cost per decoding iteration
    next to plain decoding's."""
    plain = next(r for r in rows if r.method == "plain")
    out = []
    for r in rows:
        if r.method == "plain" or r.speedup >= 1.0:
            continue
        why = (f"{r.method} {r.speedup:.2f}x: {r.tokens_per_iter:.2f} tokens per request per "
               f"decoding iteration (plain {plain.tokens_per_iter:.2f}) at {r.ms_per_iter:.2f} "
               f"ms per iteration, {r.ms_per_iter / plain.ms_per_iter:.2f}x plain's "
               f"{plain.ms_per_iter:.2f} ms")
        if r.method == "extract_hidden_states":
            why += "; it drafts the token just sampled (accepted only when a byte repeats)"
        elif r.steps_per_sync == 1:
            why += ("; it drafts on the host, so every iteration is a host sync (plain: "
                    f"{plain.steps_per_sync} per sync)")
        elif r.tokens_per_iter * plain.ms_per_iter < r.ms_per_iter:
            why += "; an iteration costs more than the tokens it gains"
        else:
            why += "; the prefill step's fixed cost, or load on the machine (see spread)"
        out.append("slower than plain: " + why)
    return out


#: Methods that need no draft checkpoint (with ``--target`` the others come from ``--draft``).
_MODEL_FREE = ("ngram", "ngram_gpu", "suffix", "extract_hidden_states")

USER_NOTE = ("Models: your checkpoints (--target, one row per --draft, the method detected from "
             "each checkpoint as vLLM's speculative_config does without 'method'). Every method "
             "must reproduce plain greedy decoding exactly (the check column).")


def _check_demo_paths(target_dir, draft_dirs, prompts_file) -> list[str] | None:
    """Refuse bad ``--target`` / ``--draft`` / ``--prompts`` before any work, naming the
    flag; returns the prompt lines (None: the shipped prompts)."""
    from pathlib import Path

    if target_dir is not None and not Path(target_dir).expanduser().is_dir():
        raise FileNotFoundError(f"--target {str(target_dir)!r}: no such checkpoint directory")
    for d in draft_dirs:
        if target_dir is None:
            raise ValueError("--draft needs --target (a draft is trained for its target; the "
                             "shipped demo drafts run without either)")
        if not Path(d).expanduser().is_dir():
            raise FileNotFoundError(f"--draft {str(d)!r}: no such checkpoint directory")
    if prompts_file is None:
        return None
    p = Path(prompts_file).expanduser()
    if not p.is_file():
        raise FileNotFoundError(f"--prompts {str(prompts_file)!r}: no such file")
    lines = [x for x in p.read_text().splitlines() if x.strip()]
    if not lines:
        raise ValueError(f"--prompts {str(prompts_file)!r} holds no prompt (one per line)")
    return lines


def _context(prompts, max_tokens: int, k: int) -> int:
    """The demo's ``max_model_len``: 512, or more when a prompt needs it (block multiple)."""
    need = max(len(p) for p in prompts) + max_tokens + 2 * k + 2
    return max(MAX_MODEL_LEN, -(-need // BLOCK_SIZE) * BLOCK_SIZE)


def _user_setup(target_dir, draft_dirs, lines, methods, k: int, max_tokens: int):
    """``(target, prompts, max_model_len, rows, description)`` for ``--target`` /
    ``--draft`` / ``--prompts``."""
    from pathlib import Path

    from specjax.engine import TargetModel
    from specjax.hf import encode_prompt, load_model, load_tokenizer
    from specjax.models import DecoderLM
    from specjax.proposers import make_proposer

    model, kind, cfg, params = load_model(target_dir)
    if not isinstance(model, DecoderLM):
        raise ValueError(f"--target {str(target_dir)!r} is a {kind!r} checkpoint, not a decoder LM")
    target = TargetModel(model, params)
    if lines is None:
        prompts = [[BOS_ID] + list(p) for p in PROMPTS]
        if any(max(p) >= cfg.vocab_size for p in prompts):
            raise ValueError("--target: give --prompts FILE (the shipped prompts are bytes of the "
                             "demo's byte-level vocabulary)")
        tok_note = "the shipped prompts as byte ids"
    else:
        tok = load_tokenizer(target_dir)
        prompts = [encode_prompt(tok, x) for x in lines]
        tok_note = "prompts through its tokenizer"
    mml = _context(prompts, max_tokens, k)
    rows = []
    for m in methods:
        if m == "extract_hidden_states":
            aux = (0,)
            rows.append((m, 1, functools.partial(
                make_proposer, SpeculativeConfig(method=m, num_speculative_tokens=1),
                target=model, target_params=params, aux_layer_ids=aux, max_model_len=mml,
                block_size=BLOCK_SIZE)))
            continue
        extra = dict(prompt_lookup_min=2, prompt_lookup_max=5) if m.startswith("ngram") else {}
        spec = SpeculativeConfig(method=m, num_speculative_tokens=k, **extra)
        rows.append((m, k, functools.partial(make_proposer, spec, max_model_len=mml,
                                             block_size=BLOCK_SIZE)))
    for d in draft_dirs:
        spec = {"model": str(d), "num_speculative_tokens": k}
        prop = make_proposer(spec, target=model, target_params=params, max_model_len=mml,
                             block_size=BLOCK_SIZE)      # loads and checks it once, up front
        # a device proposer keeps no state between runs (the engine owns its caches): reuse it
        rows.append((f"{prop.method} ({Path(d).name})", k, functools.partial(lambda p: p, prop)))
    about = (f"{Path(target_dir).name} ({kind}, {cfg.num_hidden_layers} layers, hidden "
             f"{cfg.hidden_size}, vocab {cfg.vocab_size}), {tok_note}")
    return target, prompts, mml, rows, about


def format_table(rows: Sequence[Row]) -> str:
    """The demo's table: ``check`` and ``tokens/fwd`` (machine-independent) first, then ``k``,
    per-position acceptance and the wall-clock columns."""
    head = ("method", "check", "tokens/fwd", "k", "per-position acceptance", "tokens/s",
            "spread", "sync", "speed-up")
    body = []
    for r in rows:
        mal = ("nan" if math.isnan(r.mean_acceptance_length)
               else f"{r.mean_acceptance_length:.2f}")
        pp = "-" if not r.per_position else " ".join(f"{p:.2f}" for p in r.per_position)
        body.append((r.method, {True: "OK", False: "MISMATCH", None: "-"}[r.ok], mal,
                     str(r.k) if r.k else "-", pp, f"{r.tokens_per_s:.0f}",
                     f"{100 * r.spread:.0f}%", str(r.steps_per_sync), f"{r.speedup:.2f}x"))
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
        try:
            batch = getattr(args, "batch", DEFAULT_BATCH)
            rows = run_demo(args.method, k=args.k, max_tokens=args.max_tokens, device=dev,
                            batch=None if batch == 0 else batch,
                            out=out, err=err, repeat=getattr(args, "repeat", 5),
                            steps_per_sync=getattr(args, "steps_per_sync", None)
                            or DEFAULT_STEPS_PER_SYNC,
                            target_dir=getattr(args, "target", None),
                            draft_dirs=getattr(args, "draft", None) or (),
                            prompts_file=getattr(args, "prompts", None),
                            temperature=getattr(args, "temperature", 0.0) or 0.0)
        except (ValueError, FileNotFoundError, ImportError) as e:
            print(f"specjax demo: error: {e}", file=err or sys.stderr)
            return 2
    return 0 if all(r.ok is not False for r in rows) else 1


__all__ = ["run_demo", "demo_target", "demo_proposer", "format_table", "ALL_METHODS", "PROMPTS",
           "Row", "main_demo"]

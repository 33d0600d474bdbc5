"""Zero recompiles in a long run with requests joining and leaving (issue 21), logged.

An ``Engine`` (a small random Llama target; plain decoding or EAGLE-3 with a random head;
the device loop at ``--n`` iterations per sync, or per-step with ``--n 1``; ``--overlap``)
is compiled ahead with ``Engine.warmup`` for every bucket it is configured with (one
batch bucket, query buckets for the decode and prefill steps, one context bucket;
greedy and sampled; one or two stop-id columns), then serves a stream of requests
(``--requests``, ``max_num_seqs`` rows: each finished request's row goes to the next
waiting one) with mixed prompt lengths, ``max_tokens``, EOS / extra stop ids, greedy and
seeded-sampled rows, until at least ``--iters`` decoding iterations have run. Every
compilation after the warm-up is counted two ways: JAX's backend-compile events
(``jax.monitoring``, ``/jax/core/compile/backend_compile_duration``) and the
``Compiling ...`` records of ``jax.log_compiles``; both go to the log (``--log``), with
the run's iterations, syncs, requests and joins. Exit status 1 when anything compiled.

Usage::

    python benchmarks/recompiles.py --iters 1000 --log benchmarks/logs/recompiles.log
    python benchmarks/recompiles.py --method plain --n 1 --iters 200
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

import jax
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from specjax.config import SpeculativeConfig  # noqa: E402
from specjax.engine import Engine, LoopOptions, SamplingParams, TargetModel  # noqa: E402
from specjax.models import registry  # noqa: E402
from specjax.models.config import eagle3_default_aux_layer_ids  # noqa: E402
from specjax.proposers import make_proposer  # noqa: E402

GEO = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
           num_key_value_heads=2, head_dim=16, vocab_size=128, rope_theta=10000.0,
           rms_norm_eps=1e-5)
BS, MML, ROWS, K = 16, 128, 4, 3
QUERY_BUCKETS = (K + 1, 32)         # decode steps; prefill steps (prompts up to 31 tokens)
EOS = 3
BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"


def build_engine(method: str, n: int, overlap: bool | None = None) -> Engine:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from e2e import random_params

    cfg = registry.config_from_hf("llama", GEO)
    target = TargetModel(registry.make_model("llama", cfg),
                         random_params("llama", cfg, np.float32, jax.random.key(0)))
    prop = None
    if method == "eagle3":
        aux = eagle3_default_aux_layer_ids(GEO["num_hidden_layers"])
        hcfg = registry.config_from_hf("eagle3", dict(GEO, num_hidden_layers=1,
                                                      target_hidden_size=GEO["hidden_size"],
                                                      eagle_aux_hidden_state_layer_ids=list(aux)))
        prop = make_proposer(SpeculativeConfig(method="eagle3", num_speculative_tokens=K),
                             target=target.model, target_params=target.params, draft=hcfg,
                             draft_params=random_params("eagle3", hcfg, np.float32,
                                                        jax.random.key(1)),
                             max_model_len=MML, block_size=BS)
    return Engine(target, prop, max_model_len=MML, block_size=BS, max_num_seqs=ROWS,
                  options=LoopOptions(batch_buckets=(ROWS,), query_buckets=QUERY_BUCKETS,
                                      context_buckets=(MML // BS,), steps_per_sync=n,
                                      overlap=overlap))


def workload(num: int, seed: int, *, vocab: int = GEO["vocab_size"], max_prompt: int = 31,
             max_tokens: int = 60):
    """``num`` requests: prompts of 2-``max_prompt`` tokens, max_tokens 2-``max_tokens``,
    EOS for most, a second stop id for some, a third of them sampled (seeded)."""
    rng = np.random.default_rng(seed)
    prompts, params = [], []
    for i in range(num):
        prompts.append(rng.integers(4, vocab, int(rng.integers(2, max_prompt + 1))).tolist())
        sampled = i % 3 == 1
        params.append(SamplingParams(
            max_tokens=int(rng.integers(2, max_tokens + 1)), temperature=0.9 if sampled else 0.0,
            top_k=8 if sampled and i % 2 else 0, seed=i if sampled else None,
            stop_token_ids=[int(rng.integers(4, vocab))] if i % 4 == 0 else [],
            ignore_eos=i % 5 == 0))
    return prompts, params


class _Counter(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if msg.startswith("Compiling"):
            self.records.append(msg.splitlines()[0][:300])


def run(eng: Engine, *, iters: int = 1000, requests: int | None = None, seed: int = 0,
        log=None, **work) -> dict:
    """Warm ``eng`` up (its one batch bucket, its query buckets, greedy and sampled, one or
    two stop-id columns), then serve ``workload(**work)`` streams until ``iters`` iterations
    ran. Returns counts (``compiles``: backend compiles after the warm-up;
    ``compile_logs``: the ``Compiling`` log lines)."""
    say = (lambda s: None) if log is None else (lambda s: (log.write(s + "\n"), log.flush()))
    rows = eng.max_num_seqs
    t = time.perf_counter()
    variants = eng.warmup(list(eng.options.batch_buckets), list(eng.options.query_buckets),
                          all_greedy=(True, False), stop_pads=(1, 2))
    method = "plain" if eng.proposer is None else eng.proposer.method
    say(f"# warm-up: {variants} compiled variants in {time.perf_counter() - t:.1f} s "
        f"({method}, steps_per_sync={eng.options.steps_per_sync}, overlap={eng.options.overlap})")
    events: list[tuple[str, float]] = []
    listening = [True]

    def listener(name, secs, **kw):
        if listening[0] and name == BACKEND_COMPILE:
            events.append((name, secs))

    jax.monitoring.register_event_duration_secs_listener(listener)
    handler = _Counter()
    jlog = logging.getLogger("jax")
    old_level = jlog.level
    jlog.addHandler(handler)
    jlog.setLevel(logging.DEBUG)
    total = dict(iterations=0, syncs=0, requests=0, joins=0, tokens=0, generate_calls=0)
    t = time.perf_counter()
    try:
        with jax.log_compiles():
            round_ = 0
            while total["iterations"] < iters:
                num = requests or 3 * rows
                prompts, params = workload(num, seed + round_, **work)
                syncs0 = eng.num_syncs
                res = eng.generate(prompts, params, eos_token_id=EOS, seed=seed + round_)
                total["iterations"] += res.num_steps
                total["syncs"] += eng.num_syncs - syncs0
                total["requests"] += num
                total["joins"] += max(0, num - rows)
                total["tokens"] += res.num_generated_tokens
                total["generate_calls"] += 1
                say(f"generate {round_}: {num} requests ({max(0, num - rows)} joined a running "
                    f"batch), {res.num_steps} iterations, {eng.num_syncs - syncs0} syncs, "
                    f"{res.num_generated_tokens} tokens; compiles so far: {len(events)}")
                round_ += 1
    finally:
        listening[0] = False
        unregister = getattr(jax.monitoring, "_unregister_event_duration_listener_by_callback", None)
        if unregister is not None:
            unregister(listener)
        jlog.removeHandler(handler)
        jlog.setLevel(old_level)
    total.update(compiles=len(events), compile_logs=handler.records, method=method,
                 n=eng.options.steps_per_sync, overlap=eng.options.overlap, warmup_variants=variants,
                 wall_s=time.perf_counter() - t)
    for line in handler.records:
        say(f"RECOMPILE: {line}")
    say(f"# {total['iterations']} iterations, {total['syncs']} syncs, {total['requests']} requests "
        f"({total['joins']} joined a running batch), {total['tokens']} tokens in "
        f"{total['wall_s']:.1f} s; backend compiles after warm-up: {total['compiles']}; "
        f"'Compiling' log records: {len(handler.records)}")
    return total


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--method", choices=("plain", "eagle3"), default="eagle3")
    ap.add_argument("--n", type=int, default=8, help="steps_per_sync (1: per-step)")
    ap.add_argument("--overlap", type=int, choices=(0, 1), default=None,
                    help="LoopOptions(overlap=...); default: the engine's own (on for --n > 1), "
                         "with its default loop form")
    ap.add_argument("--iters", type=int, default=1000)
    ap.add_argument("--requests", type=int, default=None, help="requests per generate call "
                    "(default 3 * rows); calls repeat until --iters")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log", default=None, help="write the log here (default: stdout)")
    args = ap.parse_args(argv)
    f = open(args.log, "w") if args.log else sys.stdout
    try:
        f.write(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; jax {jax.__version__}; "
                f"{jax.devices()[0].platform}; argv {sys.argv[1:] if argv is None else argv}\n")
        eng = build_engine(args.method, args.n, None if args.overlap is None else bool(args.overlap))
        out = run(eng, iters=args.iters, requests=args.requests, seed=args.seed, log=f)
    finally:
        if args.log:
            f.close()
    return 1 if out["compiles"] or out["compile_logs"] else 0


if __name__ == "__main__":
    sys.exit(main())

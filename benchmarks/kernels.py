"""Time every index kernel on every available backend.

Two numbers per (op, backend, batch):
  * ``call_us``: one standalone jitted call, 200 launched back to back then one sync
    (host dispatch included, as a caller that jits only the op would see it);
  * ``step_us``: inside a jitted step: 32 dependent calls unrolled in one program (outputs
    fed back as the next inputs), time divided by the calls.
``empty_us`` is the same loop around a trivial dependent op: the launch floor of a jitted
step on this device. The byte floor (bytes read + written / 4.3 TB/s) is printed too;
at these sizes it is nanoseconds, so the launch floor is the real one.

Usage: python benchmarks/kernels.py [--batches 1,8,64,256,1024] [--backends xla,pallas,triton]
       [--iters 200] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import specjax.kernels as K

K_SPEC = 3           # drafts per request
BLOCK = 16
MAX_BLOCKS = 64      # max_model_len 1024
MML = MAX_BLOCKS * BLOCK
from floors import HBM_BPS  # noqa: E402  (benchmarks/floors.py: the floor, defined once)


def make_inputs(b: int, rng: np.random.Generator) -> dict:
    q = K_SPEC + 1
    t = b * q
    qsl = np.arange(b + 1, dtype=np.int32) * q
    rejected = rng.integers(0, K_SPEC + 1, b).astype(np.int32)
    return dict(
        positions=rng.integers(0, MML - 1, b).astype(np.int32),
        block_table=rng.permutation(b * MAX_BLOCKS).astype(np.int32).reshape(b, MAX_BLOCKS),
        seq_lens=rng.integers(1, MML, b).astype(np.int32),
        cu=np.cumsum(np.full(b, K_SPEC, np.int32)).astype(np.int32),
        valid=(K_SPEC + 1 - rejected).astype(np.int32),
        qsl=qsl,
        qel=(qsl[1:] - 1 - rejected).astype(np.int32),
        sampled=np.where(np.arange(q)[None, :] < (q - rejected)[:, None],
                         rng.integers(0, 32000, (b, q)), -1).astype(np.int32),
        discard=rng.random(b) < 0.1,
        backup=rng.integers(0, 32000, b).astype(np.int32),
        next_ids=rng.integers(0, 32000, b).astype(np.int32),
        token_ids=rng.integers(0, 32000, t).astype(np.int32),
        token_pos=(np.repeat(rng.integers(0, MML - 2 * q, b), q) + np.tile(np.arange(q), b)).astype(np.int32),
        rejected=rejected,
        num_reqs=np.int32(b),
    )


def ops(backend: str, b: int):
    """(name, fn(x) -> outputs, feedback(x, out) -> x, bytes moved)."""
    t = b * (K_SPEC + 1)
    p = K_SPEC
    n_out = t + b * (p - 1)
    i4 = 4
    return [
        ("eagle_step",
         lambda x: K.eagle_step_update_slot_mapping_and_metadata(
             x["positions"], x["block_table"], x["seq_lens"], block_size=BLOCK, max_model_len=MML,
             num_reqs=x["num_reqs"], backend=backend),
         lambda x, o: {**x, "positions": o[0], "seq_lens": o[2]},
         b * i4 * 6),
        ("prepare_inputs_padded",
         lambda x: K.eagle_prepare_inputs_padded(x["cu"], x["valid"], x["qsl"], num_reqs=x["num_reqs"],
                                                 backend=backend),
         lambda x, o: {**x, "valid": o[1]},
         b * i4 * 5),
        ("prepare_next_token_padded",
         lambda x: K.eagle_prepare_next_token_padded(x["sampled"], x["discard"], x["backup"],
                                                     vocab_size=32000, num_reqs=x["num_reqs"],
                                                     backend=backend),
         lambda x, o: {**x, "backup": o[0]},
         b * (i4 * (K_SPEC + 1) + 1 + 3 * i4)),
        ("copy_and_expand_eagle",
         lambda x: K.copy_and_expand_eagle_inputs(
             x["token_ids"], x["token_pos"], x["next_ids"], x["qsl"], x["qel"], padding_token_id=0,
             parallel_drafting_token_id=7, num_padding_slots_per_request=p, shift_input_ids=True,
             num_output_tokens=n_out, num_reqs=x["num_reqs"], backend=backend),
         lambda x, o: {**x, "token_pos": o[1][:t]},
         t * i4 * 3 + b * i4 * 2 + n_out * (2 * i4 + 2) + b * p * i4),
        ("copy_and_expand_dflash",
         lambda x: K.copy_and_expand_dflash_inputs(
             x["next_ids"], x["token_pos"], x["block_table"], x["qsl"], x["rejected"],
             parallel_drafting_token_id=7, block_size=BLOCK, num_speculative_tokens=K_SPEC,
             num_reqs=x["num_reqs"], backend=backend),
         lambda x, o: {**x, "token_pos": o[1]},
         t * i4 * 3 + b * i4 * 3 + b * (K_SPEC + 1) * i4 * 3 + b * K_SPEC * i4),
    ]


def _time(fn, reps: int = 5) -> float:
    fn()
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


UNROLL = 32


def bench_loop(step, x, iters: int) -> float:
    """Device time per call inside one jitted step: ``UNROLL`` dependent calls unrolled in
    one program (a ``fori_loop`` would add a while loop, whose predicate the GPU runtime
    syncs to the host every iteration: ~10 us, more than the ops), run ``iters // UNROLL``
    times back to back. The barrier stops XLA hoisting or merging the calls."""

    def chain(x):
        for _ in range(UNROLL):
            x = step(jax.lax.optimization_barrier(x))
        return x

    loop = jax.jit(chain)
    reps = max(iters // UNROLL, 1)

    def run():
        y = x
        for _ in range(reps):
            y = loop(y)
        jax.block_until_ready(y)

    jax.block_until_ready(loop(x))
    return _time(run) / (reps * UNROLL) * 1e6


def bench_calls(fn, x, iters: int) -> float:
    jitted = jax.jit(fn)
    jax.block_until_ready(jitted(x))

    def run():
        out = None
        for _ in range(iters):
            out = jitted(x)
        jax.block_until_ready(out)

    return _time(run) / iters * 1e6


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,8,64,256,1024")
    ap.add_argument("--backends", default="xla,pallas,triton")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    batches = [int(s) for s in args.batches.split(",")]
    backends = []
    for be in args.backends.split(","):
        try:
            K.resolve_backend(be)
            backends.append(be)
        except ValueError as e:
            print(f"# skipping backend {be}: {e}")
    print(f"# jax {jax.__version__}, device {jax.devices()[0].device_kind}, iters {args.iters}")
    rng = np.random.default_rng(0)
    rows = []
    for b in batches:
        x = {k: jnp.asarray(v) for k, v in make_inputs(b, rng).items()}
        empty = bench_loop(lambda x: {**x, "positions": x["positions"] + 1}, x, args.iters)
        for be in backends:
            for name, fn, feedback, nbytes in ops(be, b):
                try:
                    step_us = bench_loop(lambda x: feedback(x, fn(x)), x, args.iters)
                    call_us = bench_calls(fn, x, args.iters)
                except Exception as e:  # a backend that fails to lower is reported, not fatal
                    print(f"# {name} {be} B={b}: FAILED {type(e).__name__}: {str(e)[:200]}")
                    continue
                rows.append(dict(op=name, backend=be, batch=b, call_us=call_us, step_us=step_us,
                                 empty_us=empty, bytes=nbytes, byte_floor_us=nbytes / HBM_BPS * 1e6))
    print(f"{'op':<28}{'backend':<8}{'B':>6}{'call us':>10}{'step us':>10}{'empty us':>10}{'bytes':>9}{'floor us':>10}")
    for r in rows:
        print(f"{r['op']:<28}{r['backend']:<8}{r['batch']:>6}{r['call_us']:>10.2f}{r['step_us']:>10.2f}"
              f"{r['empty_us']:>10.2f}{r['bytes']:>9}{r['byte_floor_us']:>10.4f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()

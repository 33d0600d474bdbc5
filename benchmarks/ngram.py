"""n-gram proposer timings: CPU (numba) and device (jit-compiled JAX).

Usage::

    python benchmarks/ngram.py --quick              # a few sizes, CPU and device
    python benchmarks/ngram.py --cpu --baseline     # full CPU grid + vLLM-algorithm baseline
    python benchmarks/ngram.py --gpu --json out.json

Grid: requests in {1, 16, 64, 256, 1024} x context tokens in {1k, 4k, 8k, 32k}; n-gram sizes
3..5, k = 5 (the reference setting). Every row of a batch has the full context length.

Texts (``--texts``):

* ``repeat``: a 512-token random passage (vocabulary 32k) repeated, with 0.1% of tokens
  replaced at random: repetitive text, the reference workload.
* ``copy``: random text whose last 256 tokens copy a passage from the middle.
* ``random``: i.i.d. tokens from a 32k vocabulary; nothing recurs, every token is scanned.
* ``random20``: i.i.d. tokens from a vocabulary of 20; many short partial matches.

CPU: ``NgramProposer.propose`` (vLLM's list-in / list-out API, all requests sampled), with
``max_num_threads`` 1 and 2 (the thread policy still runs one thread below 8192 tokens).
``--baseline`` also times vLLM's algorithm (KMP over the reversed context, restated from
research/vllm_spec_decode.md §1.4) compiled with the same numba on the same input, for a
same-machine ratio.

Device: ``NgramGPUProposer.propose_arrays`` on a resident ``[B, T]`` buffer, on whatever JAX
backend is present. ``latency`` is the median of single calls each followed by
``block_until_ready`` (dispatch included); ``pipelined`` is the mean per call over
back-to-back calls with one final sync (device time when dispatch overlaps). ``step`` times
the stateful ``propose`` (scatter one sampled token per row, then draft; state donated).
``floor`` is the buffer read once at 4.3 TB/s (the H200 copy rate); ``jax a+1`` is JAX's own
per-call floor on the machine, a one-op program (``x + 1`` on a ``[B]`` array) timed the same
two ways: what no standalone JAX call can go below. ``--profile DIR`` also prints the
matcher's kernels (device time per call) from a profiler trace.

References (256 requests x 8k tokens of repetitive text, min 3, max 5, k 5): vLLM's numba
proposer 4.61 ms on one core of the dev machine; vLLM's GPU proposer 180 us on the H200.
Goals: CPU <= 0.8x (3.7 ms), GPU <= 0.3x (54 us).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

K, MIN_N, MAX_N = 5, 3, 5
REQUESTS = [1, 16, 64, 256, 1024]
CONTEXTS = [1024, 4096, 8192, 32768]
TEXTS = ["repeat", "copy", "random", "random20"]
QUICK = dict(requests=[1, 64, 256], contexts=[1024, 8192], texts=["repeat", "random"])
REFERENCE = dict(cpu_ms=4.61, gpu_us=180.0, cpu_goal_ms=0.8 * 4.61, gpu_goal_us=0.3 * 180.0)
from floors import HBM_BPS as COPY_RATE_BYTES_PER_S  # noqa: E402  (benchmarks/floors.py)


def make_tokens(text: str, requests: int, context: int, seed: int = 0) -> np.ndarray:
    """[requests, context] int32 token ids of the given kind."""
    rng = np.random.default_rng(seed)
    if text == "repeat":
        base = rng.integers(0, 32000, (requests, 512), dtype=np.int32)
        tokens = np.tile(base, (1, context // 512 + 1))[:, :context].copy()
        flips = rng.random((requests, context)) < 0.001
        tokens[flips] = rng.integers(0, 32000, int(flips.sum()), dtype=np.int32)
        return tokens
    if text == "copy":
        tokens = rng.integers(0, 32000, (requests, context), dtype=np.int32)
        n = min(256, context // 4)
        at = context // 2 - n
        tokens[:, context - n :] = tokens[:, at : at + n]
        return tokens
    if text == "random":
        return rng.integers(0, 32000, (requests, context), dtype=np.int32)
    if text == "random20":
        return rng.integers(0, 20, (requests, context), dtype=np.int32)
    raise ValueError(f"text must be one of {TEXTS}, got {text!r}")


def median_time(fn, repeats: int, budget_s: float = 2.0) -> float:
    """Median seconds of ``fn()`` after one warm-up call; fewer repeats for slow calls."""
    t0 = time.perf_counter()
    fn()
    first = time.perf_counter() - t0
    repeats = int(max(3, min(repeats, budget_s / max(first, 1e-9))))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# ---------------------------------------------------------------------- CPU


def kmp_baseline_kernels():
    """vLLM's algorithm (restated from the research notes), numba-compiled like vLLM's."""
    from numba import njit, prange

    @njit(nogil=True)
    def find(origin, min_n, max_n, max_model_len, k):
        total = origin.shape[0]
        if total < min_n:
            return np.empty((0,), dtype=origin.dtype)
        k = min(k, max_model_len - total)
        if k <= 0:
            return np.empty((0,), dtype=origin.dtype)
        tokens = origin[::-1]
        lps = np.zeros(max_n, dtype=np.int32)
        longest, position, prev, i = 0, 0, 0, 1
        while i < total:
            if tokens[prev] == tokens[i]:
                prev += 1
                if prev >= longest:
                    longest, position = prev, i
                if i < max_n:
                    lps[i] = prev
                if prev == max_n:
                    prev = lps[max_n - 1]
                i += 1
            elif prev != 0:
                prev = lps[prev - 1]
            else:
                i += 1
        if longest < min_n:
            return np.empty((0,), dtype=origin.dtype)
        start = total - 1 - position + longest
        k = min(k, total - start)
        return origin[start : start + k]

    @njit(parallel=True)
    def batch(valid, num_tokens, token_ids, min_n, max_n, max_model_len, k, drafts, counts):
        for i in prange(len(valid)):
            idx = valid[i]
            out = find(token_ids[idx, : num_tokens[idx]], min_n, max_n, max_model_len, k)
            counts[idx] = out.shape[0]
            if out.shape[0]:
                drafts[idx, : out.shape[0]] = out

    return batch


def run_cpu(args, rows: list[dict]) -> None:
    import numba

    from specjax.proposers.ngram_cpu import NgramProposer

    threads_list = [t for t in args.threads if t <= numba.config.NUMBA_NUM_THREADS]
    baseline = kmp_baseline_kernels() if args.baseline else None
    for text in args.texts:
        for requests in args.requests:
            for context in args.contexts:
                tokens = make_tokens(text, requests, context)
                num_tokens = np.full((requests,), context, dtype=np.int32)
                sampled = [[1]] * requests
                mml = context + 64
                for threads in threads_list:
                    proposer = NgramProposer(
                        num_speculative_tokens=K,
                        prompt_lookup_min=MIN_N,
                        prompt_lookup_max=MAX_N,
                        max_model_len=mml,
                        max_num_threads=threads,
                    )
                    t = median_time(lambda: proposer.propose(sampled, num_tokens, tokens), args.repeats)
                    row = dict(kind="cpu", text=text, requests=requests, context=context, threads=threads, ms=t * 1e3)
                    if baseline is not None:
                        valid = np.arange(requests, dtype=np.int32)
                        drafts = np.zeros((requests, K), np.int32)
                        counts = np.zeros((requests,), np.int32)

                        def call():
                            # vLLM's policy: one thread below 8192 tokens.
                            n = threads if requests * context >= 8192 else 1
                            old = numba.get_num_threads()
                            numba.set_num_threads(min(n, requests))
                            try:
                                baseline(valid, num_tokens, tokens, MIN_N, MAX_N, mml, K, drafts, counts)
                            finally:
                                numba.set_num_threads(old)

                        tb = median_time(call, args.repeats)
                        want = [drafts[i, : counts[i]].tolist() for i in range(requests)]
                        assert proposer.propose(sampled, num_tokens, tokens) == want, "baseline disagrees"
                        row["baseline_ms"] = tb * 1e3
                        row["speedup"] = tb / t
                    rows.append(row)
                    print_row(row)


# ---------------------------------------------------------------------- device


def run_device(args, rows: list[dict]) -> None:
    import jax
    import jax.numpy as jnp

    from specjax.proposers.ngram_gpu import NgramGPUProposer

    backend = jax.default_backend()
    device = str(jax.devices()[0])
    plus_one = jax.jit(lambda x: x + 1)
    for text in args.texts:
        for requests in args.requests:
            for context in args.contexts:
                mml = context + 64
                width = mml
                host = np.zeros((requests, width), np.int32)
                host[:, :context] = make_tokens(text, requests, context)
                proposer = NgramGPUProposer(
                    num_speculative_tokens=K, prompt_lookup_min=MIN_N, prompt_lookup_max=MAX_N, max_model_len=mml
                )
                token_ids = jax.device_put(host)
                num_tokens = jax.device_put(np.full((requests,), context, np.int32))
                valid = jax.device_put(np.ones((requests,), bool))

                def call():
                    return jax.block_until_ready(proposer.propose_arrays(num_tokens, token_ids, valid))

                latency = median_time(call, args.repeats)
                n_pipe = max(5, min(200, int(0.5 / max(latency, 1e-6))))
                call()
                t0 = time.perf_counter()
                outs = [proposer.propose_arrays(num_tokens, token_ids, valid) for _ in range(n_pipe)]
                jax.block_until_ready(outs)
                pipelined = (time.perf_counter() - t0) / n_pipe

                # Stateful step: rows start 40 tokens short and grow by one per call.
                state = proposer.init_state(requests, width)
                prefix = np.full((requests,), context - 40, np.int32)
                state = proposer.add_requests(
                    state, jnp.arange(requests, dtype=jnp.int32), jnp.asarray(host), jnp.asarray(prefix)
                )
                sampled = jnp.asarray(host[:, context - 40 : context - 39].copy())
                pad = jnp.full((requests, K), -1, jnp.int32)
                sampled = jnp.concatenate([sampled, pad], axis=1)  # [B, k + 1]
                ones = jnp.ones((requests,), jnp.int32)
                holder = {"state": state}

                def step():
                    out, holder["state"] = proposer.propose(holder["state"], sampled, ones)
                    jax.block_until_ready(out)

                step_t = median_time(step, min(args.repeats, 30))
                # JAX's own per-call cost on this machine: a one-op program on a [B] array
                one = jax.device_put(np.zeros((requests,), np.int32))

                def trivial():
                    return jax.block_until_ready(plus_one(one))

                trivial_lat = median_time(trivial, args.repeats)
                trivial()
                t0 = time.perf_counter()
                jax.block_until_ready([plus_one(one) for _ in range(n_pipe)])
                trivial_pipe = (time.perf_counter() - t0) / n_pipe
                if args.profile:
                    from profile_step import _table, _trace
                    r = _trace(os.path.join(args.profile, f"{text}_{requests}x{context}"), 20,
                               lambda: [call() for _ in range(20)])
                    print(_table(f"propose_arrays {requests} x {context} ({text})",
                                 dict(r, step_ms=latency * 1e3), 12), flush=True)
                floor = requests * width * 4 / COPY_RATE_BYTES_PER_S
                extra = {}
                if args.torch:
                    extra = time_torch_matcher(host, context, requests, args.repeats)
                    extra["latency_ratio"] = latency * 1e6 / extra["torch_latency_us"]
                    extra["pipelined_ratio"] = pipelined * 1e6 / extra["torch_pipelined_us"]
                row = dict(
                    kind="device",
                    backend=backend,
                    device=device,
                    text=text,
                    requests=requests,
                    context=context,
                    latency_us=latency * 1e6,
                    pipelined_us=pipelined * 1e6,
                    step_us=step_t * 1e6,
                    jax_floor_latency_us=trivial_lat * 1e6,
                    jax_floor_pipelined_us=trivial_pipe * 1e6,
                    floor_us=floor * 1e6,
                    **extra,
                )
                rows.append(row)
                print_row(row)


def time_torch_matcher(host: np.ndarray, context: int, requests: int, repeats: int) -> dict:
    """vLLM's GPU matcher (``benchmarks/ngram_torch.py``, torch.compile'd as vLLM does) on
    the same buffer: single synced calls and back-to-back calls, as specjax's rows."""
    import torch

    from ngram_torch import compiled

    fn = compiled()
    tok = torch.tensor(host, device="cuda")
    lens = torch.full((requests,), context, dtype=torch.int32, device="cuda")
    mask = torch.ones((requests,), dtype=torch.bool, device="cuda")
    for _ in range(3):                                   # vLLM's _dummy_run: 3 calls
        fn(lens, tok, mask, MIN_N, MAX_N, K)
    torch.cuda.synchronize()

    def call():
        fn(lens, tok, mask, MIN_N, MAX_N, K)
        torch.cuda.synchronize()

    latency = median_time(call, repeats)
    n_pipe = max(5, min(200, int(0.5 / max(latency, 1e-6))))
    t0 = time.perf_counter()
    for _ in range(n_pipe):
        fn(lens, tok, mask, MIN_N, MAX_N, K)
    torch.cuda.synchronize()
    return dict(torch_latency_us=latency * 1e6,
                torch_pipelined_us=(time.perf_counter() - t0) / n_pipe * 1e6)


# ---------------------------------------------------------------------- output


def print_row(row: dict) -> None:
    if row["kind"] == "cpu":
        line = (
            f"cpu  {row['text']:>8} B={row['requests']:>5} T={row['context']:>6} threads={row['threads']}"
            f"  {row['ms']:9.3f} ms"
        )
        if "baseline_ms" in row:
            line += f"   vLLM-KMP {row['baseline_ms']:9.3f} ms   speedup {row['speedup']:6.1f}x"
    else:
        line = (
            f"dev  {row['text']:>8} B={row['requests']:>5} T={row['context']:>6} [{row['backend']}]"
            f"  latency {row['latency_us']:10.1f} us  pipelined {row['pipelined_us']:10.1f} us"
            f"  step {row['step_us']:10.1f} us  floor {row['floor_us']:8.1f} us"
            f"  jax a+1 {row['jax_floor_latency_us']:6.1f} / {row['jax_floor_pipelined_us']:6.1f} us"
        )
        if "torch_latency_us" in row:
            line += (f"  | vLLM torch latency {row['torch_latency_us']:8.1f} us pipelined "
                     f"{row['torch_pipelined_us']:8.1f} us  ratio {row['latency_ratio']:.2f} / "
                     f"{row['pipelined_ratio']:.2f}")
    print(line, flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a few sizes only")
    parser.add_argument("--cpu", action="store_true", help="CPU proposer only")
    parser.add_argument("--gpu", action="store_true", help="device proposer only")
    parser.add_argument("--baseline", action="store_true", help="also time vLLM's KMP algorithm (CPU)")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--requests", type=int, nargs="+")
    parser.add_argument("--contexts", type=int, nargs="+")
    parser.add_argument("--texts", nargs="+", choices=TEXTS)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--torch", action="store_true",
                        help="device rows: also time vLLM's GPU matcher restated in torch "
                             "(benchmarks/ngram_torch.py; checked against specjax's first)")
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--profile", metavar="DIR",
                        help="device rows: also trace 20 synced propose_arrays calls under the "
                             "JAX profiler (traces under DIR) and print kernel time by name")
    args = parser.parse_args(argv)
    grid = QUICK if args.quick else dict(requests=REQUESTS, contexts=CONTEXTS, texts=TEXTS)
    args.requests = args.requests or grid["requests"]
    args.contexts = args.contexts or grid["contexts"]
    args.texts = args.texts or grid["texts"]
    do_cpu = args.cpu or not args.gpu
    do_gpu = args.gpu or not args.cpu

    print(
        f"reference (256 x 8192 repeat, min {MIN_N} max {MAX_N} k {K}): vLLM numba {REFERENCE['cpu_ms']} ms "
        f"(1 core), vLLM GPU {REFERENCE['gpu_us']} us (H200); goals CPU <= {REFERENCE['cpu_goal_ms']:.2f} ms, "
        f"GPU <= {REFERENCE['gpu_goal_us']:.0f} us",
        flush=True,
    )
    rows: list[dict] = []
    if do_cpu:
        run_cpu(args, rows)
    if do_gpu:
        if args.torch:
            from ngram_torch import check
            print(f"torch matcher == specjax's on {check()} random rows", flush=True)
        run_device(args, rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(reference=REFERENCE, k=K, min_n=MIN_N, max_n=MAX_N, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

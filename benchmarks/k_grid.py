"""The best static k per (batch size, acceptance rate) from one measured cost table (issue 55).

For each batch size B and each k in 0..``--kmax`` the engine's device loop runs EAGLE-3
(k = 0: plain decoding) with synthetic acceptance and ``loop.measure`` gives the
iteration time ``t(B, k)``; the time of an iteration does not depend on how many drafts
are accepted, so one table serves every acceptance rate. For a constant conditional
acceptance rate a at every position an iteration emits
``E(a, k) = (1 - a^(k+1)) / (1 - a)`` tokens a request, so

    predicted tokens/s (B, k, a) = B * E(a, k) / t(B, k)

and the best static k of a cell is its argmax. The printed schedule per a is the
``num_speculative_tokens_per_batch_size`` that picks it (ranges of equal best k).
``--check B:a ...`` runs those cells directly (synthetic rates ``a, a^2, ...``) and
prints measured tokens/s beside the prediction. ``--policies`` runs every (B, a) cell with
k = ``--kmax`` under each adaptive policy and prints its tokens/s against the cell's best
static k (predicted from the table) and plain decoding (issue 55's 0.95x / 0.98x goals).
``--mixed a1,a2 ...`` runs issue 55's mixed cell at every B >= 2: even rows at conditional
rate a1, odd rows at a2 (one synthetic rate row per row class), under ``adaptive_k`` and
at the best single static k for that mix, ``B * E_mix(k) / t(B, k)`` with ``E_mix`` the
rows' mean ``E``. ``--falling a1,a2`` runs one generate call under ``adaptive_k`` whose
rate drops from a1 to a2 mid-run (issue 55: within 0.95x of each phase's best static k after
at most 50 iterations) and prints tokens/s per window after the switch, the K chosen
(``K@T``: K drafts at most per request in T flat token slots) and each phase against static K
forced on the same engine in the same call (a table from another call can be off by the
machine). Before a policy's timed
window every choice it may make is compiled, each forced for one sync (``--forced-costs``:
then timed beside its profiled cost), and the policy runs ``--policy-warmup`` iterations of
the window's own requests from prompts shorter by what that generates: every comparison runs
at one context (docs/adaptive_k.md).

Usage (GPU)::

    python benchmarks/k_grid.py --batch 1,8,32,64,128,256 --kmax 7 --check 1:0.7 32:0.5 128:0.9
    python benchmarks/k_grid.py --batch 1,32 --policies adaptive_k adaptive_verification
    python benchmarks/k_grid.py --batch 8,32 --mixed 0.9,0.3
    python benchmarks/k_grid.py --batch 1,32 --falling 0.9,0.3
    python benchmarks/k_grid.py --batch 1 --cost k_grid.log --policies adaptive_k   # table reused
    python benchmarks/k_grid.py --batch 32,64,128 --query-buckets exact   # rows not padded
    python benchmarks/k_grid.py --target tiny --batch 1,2 --kmax 2 --iters 2   # CPU
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402


def expected_tokens(a: float, k: int) -> float:
    """Tokens an iteration emits per request at conditional acceptance ``a`` with k drafts."""
    return float(k + 1) if a == 1 else (1 - a ** (k + 1)) / (1 - a)


def tokens_bound(a: float, k: int, iters: int) -> int:
    """Tokens a request emits in ``iters`` iterations with k drafts at conditional acceptance
    ``a`` (position j accepted with probability a^j, one bonus token an iteration), bounded
    by the mean plus six standard deviations (exceeded with probability below 1e-9) and by
    ``iters * (k + 1)``: the KV a benchmark request needs, not the worst case's."""
    u = np.asarray([a ** (j + 1) for j in range(k)], float)
    var = float(((2 * np.arange(1, k + 1) - 1) * u).sum() - u.sum() ** 2)
    mean = iters * (1 + u.sum()) + 6 * np.sqrt(iters * max(var, 0.0)) + k + 1
    return int(min(iters * (k + 1), np.ceil(mean)))


def best_k(cost_ms: dict, batch: int, a: float) -> tuple[int, float]:
    """``(k, predicted tokens/s)`` maximising ``batch * E(a, k) / t(batch, k)``."""
    scores = {k: batch * expected_tokens(a, k) / (t / 1e3) for k, t in cost_ms[batch].items()}
    k = max(scores, key=scores.get)
    return k, scores[k]


def schedule(cost_ms: dict, a: float) -> list[list[int]]:
    """``[lo, hi, K]`` ranges over the measured batch sizes (each range up to the next
    measured size minus one; the last open to 2**16), K the best static k."""
    sizes = sorted(cost_ms)
    out: list[list[int]] = []
    for i, b in enumerate(sizes):
        k = best_k(cost_ms, b, a)[0]
        lo = 1 if i == 0 else b
        hi = sizes[i + 1] - 1 if i + 1 < len(sizes) else 1 << 16
        if out and out[-1][2] == k:
            out[-1][1] = hi
        else:
            out.append([lo, hi, k])
    return out


def load_cost(paths, batches, kmax: int, device_kind: str, query_buckets: str = "pow2") -> dict:
    """The ``t(B, k)`` table from earlier ``k_grid`` logs (their ``t(B=.., k=..) = .. ms``
    lines), refused unless each was measured on ``device_kind`` with ``query_buckets`` (a log
    that names none: pow2) and together they hold every (B, k) asked for."""
    import re

    cost: dict[int, dict[int, float]] = {}
    for path in paths:
        text = open(path).read()
        head = re.search(r"^# [^;]*; jax [^;]*; ([^;]+);", text, re.M)
        if head is None or head.group(1) != device_kind:
            raise SystemExit(f"--cost {path}: measured on "
                             f"{head.group(1) if head else 'an unknown device'!r}, this is "
                             f"{device_kind!r}")
        qb = re.search(r"; query buckets (\w+)", text)
        if (qb.group(1) if qb else "pow2") != query_buckets:
            raise SystemExit(f"--cost {path}: measured with query buckets "
                             f"{qb.group(1) if qb else 'pow2'}, not {query_buckets}")
        for b, k, t in re.findall(r"^t\(B=(\d+), k=(\d+)\) = ([0-9.]+) ms", text, re.M):
            cost.setdefault(int(b), {})[int(k)] = float(t)
    missing = [(b, k) for b in batches for k in range(kmax + 1) if k not in cost.get(b, {})]
    if missing:
        raise SystemExit(f"--cost {' '.join(paths)}: no t(B, k) for (B, k) in {missing[:6]}")
    return {b: {k: cost[b][k] for k in range(kmax + 1)} for b in batches}


def run(args) -> dict:
    import jax
    import jax.numpy as jnp

    import loop
    from specjax.engine import step_cache_size
    from specjax.engine.options import (DEFAULT_CPU_MAX_NUM_BATCHED_TOKENS,
                                        DEFAULT_MAX_NUM_BATCHED_TOKENS)
    from specjax.runtime.decode_loop import loop_cache_size

    dtype = jnp.dtype(args.dtype)
    target, geo, _ = loop.build_target(args.target, dtype)
    batches = [int(x) for x in args.batch.split(",")]
    rng = np.random.default_rng(0)
    budget = (DEFAULT_CPU_MAX_NUM_BATCHED_TOKENS if jax.default_backend() == "cpu"
              else DEFAULT_MAX_NUM_BATCHED_TOKENS)

    explore: set = set()        # DeviceLoopDriver.EXPLORE of the adaptive_k runs

    def build(b, k, rates, policy=None, window=args.iters, lead=0, top=None):
        # nobody finishes inside the window: the prefill steps, in which early requests
        # already decode, then the window (rounded up to a sync of at most 64 steps) and spares,
        # at the cell's highest conditional rate ``top`` (default: ``rates``' first); prompts
        # ``lead`` tokens short of --context (a policy's warm-up generates them)
        top = (rates[0] if rates else 0.0) if top is None else top
        max_tokens = tokens_bound(top, len(rates),
                                  window + 3 + 64 + -(-b * args.context // budget))
        mml = -(-(args.context + max_tokens + 2 * args.kmax + 8) // loop.BS) * loop.BS
        prompts = [rng.integers(0, geo["vocab_size"], args.context - lead).tolist()
                   for _ in range(b)]
        spec = dict(enable_adaptive_verification=True) if policy == "adaptive_verification" \
            else {}
        prop = None if k == 0 else loop.drafter("eagle3", target, geo, args.target, k, rates,
                                                mml, dtype, **spec)
        opts = dict(adaptive_k=True) if policy == "adaptive_k" else {}
        if args.query_buckets == "exact":    # rows of exactly K + 1 tokens; prefill: powers of 2
            opts["query_buckets"] = tuple(range(1, args.kmax + 2)) + tuple(
                1 << i for i in range((args.kmax + 1).bit_length(), 16))
        eng = loop.make_engine(target, prop, b, mml, dtype, loop=opts)
        if policy == "adaptive_k":
            if args.explore is not None:
                eng.driver.EXPLORE = args.explore
            explore.add(eng.driver.EXPLORE)
        return eng, prop, prompts, max_tokens

    def conditional(eng, rows):
        """``eng``'s step spec with synthetic conditional rates ``rows`` (``[k]`` or one
        ``[k]`` row per row class): a benchmark's swap (the step reads it at each call)."""
        k = eng.step.k
        rows = tuple(r[:k] for r in rows) if isinstance(rows[0], tuple) else tuple(rows[:k])
        return eng.step._spec._replace(synthetic_rates=rows)

    def precompile(eng, prompts, max_tokens, forced_costs=False):
        """Every program ``adaptive_k`` may choose for these prompts (each K's rows and each
        K's flat token slots, ``DeviceLoopDriver.token_options``), compiled by a sync under
        each choice forced: no policy move compiles inside a timed window. With
        ``forced_costs``, each choice is then timed over ``--iters`` iterations beside its
        profiled cost (the first rows take the drafts). Returns those rows."""
        from specjax.engine.device_loop import RowCaps

        b, n = len(prompts), eng.options.steps_per_sync
        bb = eng.scheduler.buckets(b, 1, 1)[0]
        choices = [RowCaps(kk) for kk in range(eng.k + 1)] + [
            RowCaps(kk, t, tuple(int(np.clip(t - b - kk * i, 0, kk)) for i in range(b)))
            for kk in range(1, eng.k + 1) for t in eng.driver.token_options(bb, kk)]
        if forced_costs:
            eng._costs(b)                                  # the profile, as the policy sees it
        forced = []
        for c in choices:
            eng.driver.policy = lambda rows, c=c: c
            loop.measure(eng, prompts, n, max_tokens)
            if forced_costs:
                r = loop.measure(eng, prompts, -(-args.iters // n) * n, max_tokens)
                prof = (eng.k_costs[bb][c.k] if c.tokens is None
                        else eng.k_token_costs[bb][c.k, c.tokens])
                forced.append(dict(choice=str(c.k if c.tokens is None else f"{c.k}@{c.tokens}"),
                                   profiled_ms=1e3 * float(prof), measured_ms=r["per_iter_ms"],
                                   tokens_per_iter=r["tokens_per_iter"]))
        del eng.driver.policy
        eng.driver.seen_costs.clear()   # the policy times only what it chooses itself
        if forced:
            print(f"# B={b} each choice forced (K or K@T: profiled ms / its calls' ms an "
                  "iteration): " + ", ".join(f"{f['choice']}: {f['profiled_ms']:.3f} / "
                                             f"{f['measured_ms']:.3f}" for f in forced), flush=True)
        return forced

    def timed(b, k, rates, policy=None, rows=None):
        # a policy learns the window's own requests first (adaptive_k's evidence is per
        # request; adaptive verification's estimator refits every 100 steps), from prompts
        # shorter by what its warm-up adds at the cell's best static k, so that its window
        # runs at the context of the table's (an iteration's time grows with the context)
        skip = args.policy_warmup if policy else 0
        lead = 0
        if skip:
            rs = [r[0] for r in rows] if rows is not None else [rates[0]]
            lead = round(skip * float(np.mean([expected_tokens(a, best_k(cost, b, a)[0])
                                               for a in rs])))
            lead = min(lead, args.context - 16)
        eng, prop, prompts, max_tokens = build(
            b, k, rates, policy, args.iters + skip, lead,
            None if rows is None else max(r[0] for r in rows))
        if rows is not None and k:     # per-row-class conditional rates (``--mixed``)
            eng.step._spec = conditional(eng, rows)
        n = eng.options.steps_per_sync
        iters, skip = -(-args.iters // n) * n, -(-skip // n) * n      # start and end on a sync
        loop.measure(eng, prompts, n, max_tokens)                         # compiles
        forced = (precompile(eng, prompts, max_tokens, args.forced_costs)
                  if policy == "adaptive_k" and k else [])
        before = loop_cache_size() + step_cache_size()
        chosen: dict = {}           # adaptive_k's choices in the window: K (K@T) -> calls
        window = []                 # set once the window starts (measure's hook)
        if policy == "adaptive_k" and k:
            real = eng.driver.policy

            def counted(running):
                c = real(running)
                key = None if c is None else str(c.k if c.tokens is None else f"{c.k}@{c.tokens}")
                if window:
                    chosen[key] = chosen.get(key, 0) + 1
                return c

            eng.driver.policy = counted

        def started(i):
            window.append(i)

        def one():
            window.clear()
            return loop.measure(eng, prompts, iters, max_tokens, started, skip=skip)

        r = min((one() for _ in range(args.repeat)), key=lambda x: x["per_iter_ms"])
        r["recompiles"] = loop_cache_size() + step_cache_size() - before
        if r["recompiles"]:
            print(f"# B={b} k={k}: {r['recompiles']} programs compiled inside the timed window",
                  flush=True)
        if forced:
            r["forced"] = forced
        if chosen:
            bb = eng.scheduler.buckets(b, 1, 1)[0]
            r["choices"] = chosen
            print(f"# B={b} adaptive_k's choices (calls): {chosen}; window {r['per_iter_ms']:.3f} "
                  f"ms, {r['tokens_per_iter']:.2f} tokens a request per iteration; step costs ms: "
                  f"{[round(1e3 * float(x), 3) for x in eng.k_costs.get(bb, [])]}, flat "
                  f"{ {f'{kk}@{t}': round(1e3 * v, 3) for (kk, t), v in eng.k_token_costs.get(bb, {}).items()} }"
                  f"; its calls' own ms an iteration "
                  f"{ {f'{kk}' if t is None else f'{kk}@{t}': round(1e3 * v, 3) for (kk, t), v in eng.driver.seen_costs.get(bb, {}).items()} }",
                  flush=True)
        del eng, prop
        gc.collect()
        return r

    def falling_cell(b, a1, a2):
        """Issue 55's falling cell: one generate call under ``adaptive_k`` (k = --kmax) whose
        synthetic conditional rate drops from a1 to a2 after --falling-iters BEFORE iterations;
        tokens/s per window of about 24 iterations against each phase's best static k
        predicted from the cost table, and each phase against static K forced on the same
        engine right after, at the phase's context (``--static-iters``: the table's best k
        and the policy's most frequent rectangle in that phase)."""
        from specjax.engine.device_loop import RowCaps

        n_sw, n_after = (int(x) for x in args.falling_iters.split(","))
        k = args.kmax
        eng, prop, prompts, max_tokens = build(b, k, [a1 ** (j + 1) for j in range(k)],
                                               "adaptive_k", n_sw + n_after, 0, max(a1, a2))
        hi, lo = conditional(eng, (a1,) * k), conditional(eng, (a2,) * k)
        n = eng.options.steps_per_sync
        switch, total = -(-n_sw // n) * n, -(-(n_sw + n_after) // n) * n
        eng.step._spec = lo          # phase 2's programs, every choice (the policy's descent)
        precompile(eng, prompts, max_tokens)
        eng.step._spec = hi          # phase 1's, likewise
        precompile(eng, prompts, max_tokens)
        loop.measure(eng, prompts, -(-args.policy_warmup // n) * n, max_tokens)
        before = loop_cache_size() + step_cache_size()
        ks: list = []                # the policy's K per device-loop call (K@T: flat slots)
        policy = eng.driver.policy

        views: list = []             # what the policy weighed at each call (priced)

        def logged(running):
            c = policy(running)
            ks.append(None if c is None else c.k if c.tokens is None else f"{c.k}@{c.tokens}")
            views.append(eng.driver.priced(running))
            return c

        def hook(i):
            if i == switch:
                eng.step._spec = lo
                ks.append("|")

        eng.driver.policy = logged

        r = loop.measure(eng, prompts, total, max_tokens, hook)
        recompiles = loop_cache_size() + step_cache_size() - before
        marks = r["marks"]

        def tps(i, j):
            return (marks[j][1] - marks[i][1]) / (marks[j][0] - marks[i][0])

        best1, best2 = best_k(cost, b, a1), best_k(cost, b, a2)
        w = -(-24 // n) * n
        windows = [tps(i, min(i + w, total)) / best2[1] for i in range(switch, total, w)]
        settle = switch + -(-50 // n) * n
        p1, p2 = tps(max(0, switch - 2 * w), switch), tps(min(settle, total - n), total)
        # the same engine forced to static K per phase, in this call: the table's best k
        # and the policy's most frequent rectangle of that phase (a flat K@T is not forced)
        cut = ks.index("|")
        for name, (est, _, opts) in (("phase 1", views[cut - 1]), ("the last call", views[-1])):
            rect = " ".join(f"{kk}: {1e3 * c:.2f}" for kk, t, c in opts if t is None)
            flat = min(((c, kk, t) for kk, t, c in opts if t is not None), default=None)
            print(f"# B={b} falling, {name}: estimate {float(np.mean(est)):.3f}; rectangles ms "
                  f"{rect}" + (f"; cheapest flat {flat[1]}@{flat[2]} {1e3 * flat[0]:.2f}"
                               if flat else ""), flush=True)
        static = []        # (phase 2 from the third call on: the first two still carry phase 1)
        s_iters = -(-args.static_iters // n) * n
        for spec, a, best, chosen, (i0, i1) in (
                (hi, a1, best1, ks[:cut], (max(0, switch - 2 * w), switch)),
                (lo, a2, best2, ks[cut + 3:] or ks[cut + 1:], (min(settle, total - n), total))):
            rect = [x for x in chosen if isinstance(x, int)]
            cands = sorted({best[0]} | ({max(set(rect), key=rect.count)} if rect else set()))
            eng.step._spec = spec
            got = {}
            for kk in cands:
                # prompts as long as the requests were at the middle of the phase's window,
                # less half the static window's tokens: both windows centred on one context
                mid = (marks[i0][1] + marks[i1][1]) / 2 / b
                extra = max(0, round(mid - s_iters * expected_tokens(a, kk) / 2))
                longer = [p + rng.integers(0, geo["vocab_size"], extra).tolist() for p in prompts]
                eng.driver.policy = lambda rows, c=RowCaps(kk): c
                got[kk] = loop.measure(eng, longer, s_iters, max_tokens - extra)["tokens_per_s"]
            static.append(got)
        del eng, prop
        gc.collect()
        return dict(batch=b, a=[a1, a2], best_k=[best1[0], best2[0]],
                    phase1_vs_best=p1 / best1[1], phase2_vs_best=p2 / best2[1],
                    static_tps=[{str(kk): v for kk, v in g.items()} for g in static],
                    phase1_vs_static=p1 / max(static[0].values()),
                    phase2_vs_static=p2 / max(static[1].values()),
                    windows_vs_best=windows, k_per_call=ks, switch=switch, iters=total,
                    recompiles=recompiles)

    cost: dict[int, dict[int, float]] = {}
    if args.cost:
        cost = load_cost(args.cost, batches, args.kmax, jax.devices()[0].device_kind,
                         args.query_buckets)
        print(f"# t(B, k) from {' '.join(args.cost)}", flush=True)
    for b in batches if not args.cost else ():
        cost[b] = {}
        for k in range(args.kmax + 1):
            cost[b][k] = timed(b, k, [0.5 ** (j + 1) for j in range(k)])["per_iter_ms"]
            print(f"t(B={b}, k={k}) = {cost[b][k]:.3f} ms", flush=True)
    rates = [float(a) for a in args.rates]
    print("\n| B | " + " | ".join(f"t(k={k}) ms" for k in range(args.kmax + 1)) + " |")
    print("|---|" + "---|" * (args.kmax + 1))
    for b in batches:
        print(f"| {b} | " + " | ".join(f"{cost[b][k]:.3f}" for k in range(args.kmax + 1)) + " |")
    print("\n| B | " + " | ".join(f"a={a}: best k (tok/s, x plain)" for a in rates) + " |")
    print("|---|" + "---|" * len(rates))
    best = {}
    for b in batches:
        cells = []
        for a in rates:
            k, tps = best_k(cost, b, a)
            plain = b / (cost[b][0] / 1e3)
            best[(b, a)] = (k, tps)
            cells.append(f"{k} ({tps:.0f}, {tps / plain:.2f}x)")
        print(f"| {b} | " + " | ".join(cells) + " |")
    scheds = {a: schedule(cost, a) for a in rates}
    for a, s in scheds.items():
        print(f"a={a}: num_speculative_tokens_per_batch_size={s}")
    checks = []
    for spec in args.check:
        b, a = int(spec.split(":")[0]), float(spec.split(":")[1])
        if b not in cost:      # (the suite's default cells: a run of some batches skips the rest)
            print(f"# --check {spec}: batch {b} is not in --batch; skipped")
            continue
        k = best_k(cost, b, a)[0]
        r = timed(b, k, [a ** (j + 1) for j in range(k)])
        pred = best_k(cost, b, a)[1]
        checks.append(dict(batch=b, a=a, k=k, measured_tps=r["tokens_per_s"], predicted_tps=pred))
        print(f"check B={b} a={a} k={k}: measured {r['tokens_per_s']:.0f} tok/s, predicted "
              f"{pred:.0f} ({r['tokens_per_s'] / pred:.2f}x)", flush=True)
    policies = []
    if args.policies:
        print("\n| B | a | policy | tok/s | / best static k (predicted) | / plain (measured t(B, 0)) "
              "| accepted / iteration |")
        print("|---|---|---|---|---|---|---|")
    for b in batches:
        for a in rates if args.policies else ():
            for policy in args.policies:
                r = timed(b, args.kmax, [a ** (j + 1) for j in range(args.kmax)], policy)
                k, tps = best_k(cost, b, a)
                plain = b / (cost[b][0] / 1e3)
                row = dict(batch=b, a=a, policy=policy, tokens_per_s=r["tokens_per_s"],
                           vs_best=r["tokens_per_s"] / tps, best_k=k,
                           vs_plain=r["tokens_per_s"] / plain,
                           tokens_per_iter=r["tokens_per_iter"])
                policies.append(row)
                print(f"| {b} | {a} | {policy} | {row['tokens_per_s']:.0f} | {row['vs_best']:.3f} "
                      f"(k={k}) | {row['vs_plain']:.3f} | {row['tokens_per_iter'] - 1:.2f} |",
                      flush=True)
    mixed = []
    if args.mixed:
        print("\n| B | a1, a2 | best static k (predicted tok/s) | static measured | adaptive_k "
              "| adaptive_k / best static (predicted) |")
        print("|---|---|---|---|---|---|")
    for b in batches:
        for pair in args.mixed if b >= 2 else ():
            a1, a2 = (float(x) for x in pair.split(","))
            n1 = -(-b // 2)
            scores = {k: (n1 * expected_tokens(a1, k) + (b - n1) * expected_tokens(a2, k))
                      / (t / 1e3) for k, t in cost[b].items()}
            k = max(scores, key=scores.get)
            rows = ((a1,) * args.kmax, (a2,) * args.kmax)
            static = (float("nan") if args.mixed_policy_only else
                      timed(b, k, [a1 ** (j + 1) for j in range(k)], None, rows)["tokens_per_s"])
            r = timed(b, args.kmax, [a1 ** (j + 1) for j in range(args.kmax)], "adaptive_k", rows)
            pol = r["tokens_per_s"]
            mixed.append(dict(batch=b, a=[a1, a2], best_k=k, predicted_tps=scores[k],
                              static_tps=static, adaptive_k_tps=pol, choices=r.get("choices"),
                              forced=r.get("forced"),
                              tokens_per_iter=r["tokens_per_iter"], per_iter_ms=r["per_iter_ms"]))
            print(f"| {b} | {a1}, {a2} | {k} ({scores[k]:.0f}) | {static:.0f} | {pol:.0f} | "
                  f"{pol / scores[k]:.3f} |", flush=True)
    falling = []
    if args.falling:
        print("\n| B | a1 -> a2 | phase 1 / best static predicted (k) | phase 2 from +50 / best "
              "static predicted (k) | phase 1 / static measured (k: tok/s) | phase 2 / static "
              "measured (k: tok/s) | windows after the switch / best predicted (a2) | K per call "
              "(\\| = the switch) |")
        print("|---|---|---|---|---|---|---|---|")
    for b in batches:
        for pair in args.falling:
            a1, a2 = (float(x) for x in pair.split(","))
            row = falling_cell(b, a1, a2)
            falling.append(row)
            meas = [", ".join(f"{kk}: {v:.0f}" for kk, v in g.items()) for g in row["static_tps"]]
            print(f"| {b} | {a1} -> {a2} | {row['phase1_vs_best']:.3f} (k={row['best_k'][0]}) | "
                  f"{row['phase2_vs_best']:.3f} (k={row['best_k'][1]}) | "
                  f"{row['phase1_vs_static']:.3f} ({meas[0]}) | "
                  f"{row['phase2_vs_static']:.3f} ({meas[1]}) | "
                  f"{' '.join(f'{x:.2f}' for x in row['windows_vs_best'])} | "
                  f"{' '.join(str(x) for x in row['k_per_call'])} |", flush=True)
    return dict(cost_ms={str(b): v for b, v in cost.items()}, mixed=mixed, falling=falling,
                best={f"{b}:{a}": v for (b, a), v in best.items()},
                schedules={str(a): s for a, s in scheds.items()}, checks=checks,
                policies=policies, explore=sorted(explore))


def main(argv=None) -> int:
    import jax

    gpu = jax.default_backend() == "gpu"
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", choices=("8b", "1b", "tiny"), default="8b" if gpu else "tiny")
    ap.add_argument("--batch", default="1,8,32,64,128,256")
    ap.add_argument("--kmax", type=int, default=7)
    ap.add_argument("--rates", nargs="+", default=["0.3", "0.5", "0.7", "0.9"])
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--check", nargs="*", default=[], metavar="B:a")
    ap.add_argument("--query-buckets", choices=("pow2", "exact"), default="pow2",
                    help="tokens per decode row: the engine's default (K + 1 padded to a power "
                         "of two) or exactly K + 1 (LoopOptions.query_buckets 1..kmax + 1)")
    ap.add_argument("--cost", nargs="+", default=None, metavar="LOG",
                    help="take t(B, k) from earlier k_grid logs of this GPU instead of measuring")
    ap.add_argument("--policies", nargs="*", default=[],
                    choices=("adaptive_k", "adaptive_verification"),
                    help="also run each (B, a) cell with k = --kmax under these policies: "
                         "LoopOptions(adaptive_k=True) (device loop) or vLLM's "
                         "enable_adaptive_verification (step loop)")
    ap.add_argument("--mixed", nargs="*", default=[], metavar="a1,a2",
                    help="mixed cells: even rows at a1, odd rows at a2 (B >= 2)")
    ap.add_argument("--forced-costs", action="store_true",
                    help="adaptive_k cells: time each choice forced beside its profiled cost")
    ap.add_argument("--mixed-policy-only", action="store_true",
                    help="mixed cells: run adaptive_k only (the best static k predicted, not run)")
    ap.add_argument("--falling", nargs="*", default=[], metavar="a1,a2",
                    help="falling cells: adaptive_k with every row at a1, then a2 mid-run")
    ap.add_argument("--falling-iters", default="96,160", metavar="BEFORE,AFTER",
                    help="iterations before and after the falling cell's switch")
    ap.add_argument("--static-iters", type=int, default=48,
                    help="falling cells: iterations of each phase's static k, forced on the "
                         "policy's engine after its run (the same call's comparison)")
    ap.add_argument("--policy-warmup", type=int, default=104,
                    help="iterations a policy runs on the timed requests before their window "
                         "(adaptive_k learns each request and its choices' times; vLLM's "
                         "estimator refits every 100 steps); the KV pool grows with it")
    ap.add_argument("--explore", type=float, default=None,
                    help="adaptive_k runs: DeviceLoopDriver.EXPLORE, the discount on a choice "
                         "not run yet (default: the library's)")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"),
                    default="bfloat16" if gpu else "float32")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.kmax < 1 or args.iters < 2 or args.repeat < 1 or args.static_iters < 1:
        ap.error("--kmax >= 1, --iters >= 2, --repeat >= 1, --static-iters >= 1")
    if args.explore is not None and not 0 <= args.explore < 1:
        ap.error(f"--explore must lie in [0, 1), got {args.explore}")
    if not all(0 <= float(a) < 1 for a in args.rates):
        ap.error("--rates must lie in [0, 1)")
    for pair in args.mixed + args.falling:
        try:
            a1, a2 = (float(x) for x in pair.split(","))
        except ValueError:
            ap.error(f"--mixed / --falling take pairs a1,a2, got {pair!r}")
        if not (0 <= a1 <= 1 and 0 <= a2 <= 1):
            ap.error(f"--mixed / --falling rates must lie in [0, 1], got {pair!r}")
    try:
        before, after = (int(x) for x in args.falling_iters.split(","))
    except ValueError:
        ap.error(f"--falling-iters takes BEFORE,AFTER, got {args.falling_iters!r}")
    if before < 1 or after < 1:
        ap.error(f"--falling-iters: both >= 1, got {args.falling_iters!r}")
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; jax {jax.__version__}; "
          f"{jax.devices()[0].device_kind}; target {args.target} {args.dtype}; context "
          f"{args.context}; iters {args.iters}; query buckets {args.query_buckets}"
          + ("" if args.explore is None else f"; explore {args.explore}"))
    doc = run(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(argv=argv, **doc), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

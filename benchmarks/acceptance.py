"""Held-out acceptance of the shipped demo drafts (issue 7's evaluation table).

Greedy speculative decoding with every method at k = 1..5 on prompts cut from held-out
CPython stdlib files (whole files never seen in training: ``specjax.training.data``'s
hash split), checked token-for-token against plain greedy decoding of the same target.
Prints a markdown table (mean acceptance length = 1 + accepted / drafts, vLLM's; per-
position acceptance = accepted at position i / drafts) and writes JSON with ``--json``.

    python benchmarks/acceptance.py                       # CPU is fine: the models are tiny
    python benchmarks/acceptance.py --methods eagle3 --ks 4 --prompts 8
    python benchmarks/acceptance.py --methods eagle3 --ks 4 --tree "[(0,), (1,), (0, 0), (1, 0)]"
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time

import jax

from specjax.cli import demo
from specjax.engine import Engine, LoopOptions, SamplingParams

METHODS = ("ngram", "suffix", "suffix_arctic", "eagle", "eagle3", "medusa", "draft_model",
           "dflash", "dspark")


def heldout_prompts(num: int, prompt_bytes: int, seed: int) -> tuple[list[list[int]], dict]:
    from specjax.training.data import heldout_prompts as cut
    from specjax.training.data import split_files, stdlib_py_files, stdlib_root

    root = stdlib_root()
    files = stdlib_py_files(root, include_tests=False)
    _, held = split_files(files, root)
    prompts = cut(held, num_prompts=num, prompt_bytes=prompt_bytes, seed=seed)
    return prompts, {"stdlib": str(root), "heldout_files": len(held), "include_tests": False}


def run(methods, ks, prompts, max_tokens, log=print, trees=()) -> dict:
    target = demo.demo_target()

    def engine(prop):
        return Engine(target, prop, max_model_len=demo.MAX_MODEL_LEN, block_size=demo.BLOCK_SIZE,
                      max_num_seqs=len(prompts), options=LoopOptions(
                          batch_buckets=(len(prompts),),
                          context_buckets=(demo.MAX_MODEL_LEN // demo.BLOCK_SIZE,)))

    sp = SamplingParams(max_tokens=max_tokens)
    t0 = time.perf_counter()
    base = engine(None).generate(prompts, sp)
    log(f"plain: {base.num_generated_tokens} tokens ({time.perf_counter() - t0:.0f}s)")
    rows = []
    for m in methods:
        for k in ks:
            t0 = time.perf_counter()
            res = engine(demo.demo_proposer(m.split("_")[0] if m == "suffix_arctic" else m, k,
                                            target, **({"suffix_backend": "arctic"} if m ==
                                                       "suffix_arctic" else {}))).generate(prompts, sp)
            ok = res.token_ids == base.token_ids
            rows.append({"method": m, "k": k, "mean_acceptance_length": res.mean_acceptance_length,
                         "per_position": res.acceptance_rate_per_position, "lossless": ok,
                         "steps": res.num_steps})
            log(f"{m} k={k}: mean acceptance length {res.mean_acceptance_length:.3f} "
                f"{'OK' if ok else 'MISMATCH'} ({time.perf_counter() - t0:.0f}s)")
    for m in [m for m in methods if m in ("eagle", "eagle3")] if trees else []:
        for tree in trees:
            from specjax.token_tree import TokenTree
            t = TokenTree.from_choices(tree)
            t0 = time.perf_counter()
            res = engine(demo.demo_proposer(m, t.num_nodes, target, tree=tree)).generate(prompts, sp)
            ok = res.token_ids == base.token_ids
            rows.append({"method": f"{m} tree {t.num_nodes} nodes", "tree": tree, "k": t.depth,
                         "mean_acceptance_length": res.mean_acceptance_length,
                         "per_position": res.acceptance_rate_per_position, "lossless": ok,
                         "steps": res.num_steps})
            log(f"{m} tree {tree}: mean acceptance length {res.mean_acceptance_length:.3f} "
                f"{'OK' if ok else 'MISMATCH'} ({time.perf_counter() - t0:.0f}s)")
    return {"rows": rows, "plain_tokens": base.num_generated_tokens}


def table(rows) -> str:
    ks = sorted({r["k"] for r in rows})
    methods = list(dict.fromkeys(r["method"] for r in rows))
    by = {(r["method"], r["k"]): r for r in rows}
    out = ["| method | " + " | ".join(f"k={k}" for k in ks) + " | per-position acceptance at k="
           f"{max(ks)} |", "|---|" + "---|" * (len(ks) + 1)]
    for m in methods:
        cells = []
        for k in ks:
            r = by.get((m, k))
            cells.append("-" if r is None else f"{r['mean_acceptance_length']:.2f}"
                         + ("" if r["lossless"] else " (MISMATCH)"))
        last = by.get((m, max(ks)))
        pp = "-" if last is None else " ".join(f"{p:.2f}" for p in last["per_position"])
        out.append(f"| {m} | " + " | ".join(cells) + f" | {pp} |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    ap.add_argument("--ks", nargs="+", type=int, default=[1, 2, 3, 4, 5])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-bytes", type=int, default=192)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tree", action="append", default=[],
                    help="also run eagle / eagle3 with this speculative_token_tree (repeatable; "
                         "its row sits in the column of the tree's depth)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if any(k < 1 or k > 5 for k in a.ks):
        ap.error("--ks must be in 1..5 (Medusa ships 5 heads)")
    prompts, src = heldout_prompts(a.prompts, a.prompt_bytes, a.seed)
    res = run(a.methods, a.ks, prompts, a.max_tokens, log=lambda s: print(s, file=sys.stderr, flush=True),
              trees=a.tree)
    meta = {"date": time.strftime("%Y-%m-%d"), "device": jax.devices()[0].device_kind,
            "python": platform.python_version(), "jax": jax.__version__, "prompts": len(prompts),
            "prompt_bytes": a.prompt_bytes, "max_tokens": a.max_tokens, **src}
    print(table(res["rows"]))
    print(json.dumps(meta))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"meta": meta, **res}, f, indent=1)
    return 0 if all(r["lossless"] for r in res["rows"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())

"""Acceptance of sampled drafts (issue 56): mean acceptance length at a temperature with
``draft_sample_method="greedy"`` (drafts by argmax, verified as certain) against
``"probabilistic"`` (drafts sampled at the request's temperature, verified with their
probabilities), per model method, on the shipped demo models and held-out prompts.
Tokens-per-step figures, not timings: CPU is fine.

    python benchmarks/draft_sampling.py --temperature 1.0 --k 3 --prompts 16
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

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from acceptance import heldout_prompts  # noqa: E402

METHODS = ("eagle", "eagle3", "medusa", "draft_model", "dflash")


def run(methods, k, prompts, max_tokens, temperature, seed=0, log=print) -> list[dict]:
    target = demo.demo_target()
    opts = LoopOptions(batch_buckets=(len(prompts),),
                       context_buckets=(demo.MAX_MODEL_LEN // demo.BLOCK_SIZE,))
    sps = [SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed + i)
           for i in range(len(prompts))]
    rows = []
    for m in methods:
        row = {"method": m, "k": k, "temperature": temperature}
        for how in ("greedy", "probabilistic"):
            t0 = time.perf_counter()
            prop = demo.demo_proposer(m, k, target, draft_sample_method=how)
            eng = Engine(target, prop, max_model_len=demo.MAX_MODEL_LEN,
                         block_size=demo.BLOCK_SIZE, max_num_seqs=len(prompts), options=opts)
            res = eng.generate(prompts, sps)
            row[how] = res.mean_acceptance_length
            row[f"{how}_tokens_per_step"] = res.num_generated_tokens / max(res.num_steps, 1)
            log(f"{m} {how}: mean acceptance length {res.mean_acceptance_length:.3f} "
                f"({time.perf_counter() - t0:.0f}s)")
        rows.append(row)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-bytes", type=int, default=192)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if not 0 < a.temperature:
        ap.error("--temperature must be > 0 (greedy requests draft by argmax either way)")
    prompts, src = heldout_prompts(a.prompts, a.prompt_bytes, a.seed)
    rows = run(a.methods, a.k, prompts, a.max_tokens, a.temperature, a.seed,
               log=lambda s: print(s, file=sys.stderr, flush=True))
    print(f"| method | greedy drafts | sampled drafts (T={a.temperature}) |\n|---|---|---|")
    for r in rows:
        print(f"| {r['method']} | {r['greedy']:.3f} | {r['probabilistic']:.3f} |")
    meta = {"date": time.strftime("%Y-%m-%d"), "device": jax.devices()[0].device_kind,
            "python": platform.python_version(), "jax": jax.__version__, "k": a.k,
            "prompts": len(prompts), "max_tokens": a.max_tokens, **src}
    print(json.dumps(meta))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

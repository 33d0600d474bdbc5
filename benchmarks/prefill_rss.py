"""Peak resident memory of a long-prompt prefill on the CPU (issue 50's CPU goal).

    python benchmarks/prefill_rss.py                       # plain decoding, 16k context
    python benchmarks/prefill_rss.py --methods none,eagle3,draft_model --len 16384

Each method runs in a child process: it imports specjax, reads its peak RSS
(``ru_maxrss``), builds ``Engine(demo target, proposer, max_model_len=--len)`` (the demo's
shipped weights, default ``LoopOptions``), generates ``--new`` tokens after a prompt of
``--len - 64`` tokens, and reads its peak RSS again. The goal: the rise is at most the
weights (target and drafter params) + the KV (target cache and drafter state) + 256 MB.
One JSON line per method on stdout (also ``prefill_rss.json`` under ``$OUT`` when set);
exit status 1 when a method misses the goal.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ALLOWANCE_MB = 256


def child(method: str, length: int, new: int, k: int) -> dict:
    import resource

    import jax
    import jax.numpy as jnp
    import numpy as np

    import specjax.converters  # imports before the baseline: code, not data
    import specjax.proposers  # noqa: F401
    from specjax.cli.demo import demo_proposer, demo_target
    from specjax.engine import Engine, SamplingParams

    jnp.zeros(1).block_until_ready()                   # the backend is up
    mb = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    base = mb()
    target = demo_target()
    proposer = None if method == "none" else demo_proposer(method, k, target,
                                                           max_model_len=length, block_size=16)
    eng = Engine(target, proposer, max_model_len=length, max_num_seqs=1)
    nbytes = lambda tree: sum(x.nbytes for x in jax.tree.leaves(tree)) / 2**20
    weights = nbytes(eng.target.params) + nbytes(eng.step.draft_params)
    kv = nbytes(eng.target_kv) + nbytes(eng.draft_state)
    prompt = (np.arange(length - 64) * 7 % 250).tolist()
    t0 = time.perf_counter()
    out = eng.generate([prompt], SamplingParams(max_tokens=new))
    wall = time.perf_counter() - t0
    rise = mb() - base
    bound = weights + kv + ALLOWANCE_MB
    return dict(method=method, max_model_len=length, prompt_tokens=len(prompt),
                max_num_batched_tokens=eng.options.max_num_batched_tokens, weights_mb=round(weights, 1),
                kv_mb=round(kv, 1), rss_rise_mb=round(rise, 1), bound_mb=round(bound, 1),
                ok=rise <= bound, generate_s=round(wall, 1), steps=out.num_steps,
                tokens=out.outputs[0].token_ids)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--methods", default="none", help="comma-separated: none (plain) or demo "
                    "drafters (eagle, eagle3, draft_model, dflash, medusa)")
    ap.add_argument("--len", type=int, default=16384, help="max_model_len")
    ap.add_argument("--new", type=int, default=8, help="tokens generated after the prompt")
    ap.add_argument("-k", type=int, default=3, help="speculative tokens")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        print(json.dumps(child(a.child, a.len, a.new, a.k)))
        return 0
    rows, ok = [], True
    for m in a.methods.split(","):
        cmd = [sys.executable, __file__, "--child", m, "--len", str(a.len), "--new", str(a.new),
               "-k", str(a.k)]
        p = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if p.returncode:
            sys.stderr.write(p.stderr[-4000:])
            print(json.dumps(dict(method=m, error=p.returncode)))
            ok = False
            continue
        row = json.loads(p.stdout.strip().splitlines()[-1])
        rows.append(row)
        ok &= row["ok"]
        print(json.dumps(row), flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "prefill_rss.json"), "w") as f:
            json.dump(rows, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""``history_first`` (issue 56, "n-gram first") on a repetitive workload with the demo models.

Each prompt is a held-out CPython file (``history_first_workload.json``: the demo models'
held-out split, ``specjax.training.data``) given in full, then its first half again; greedy
decoding continues it (up to the rest of the file). Methods: ``ngram`` (CPU) / ``ngram_gpu``
alone, each demo model drafter alone (``eagle3``, ``draft_model``, ``medusa``, ``dflash``,
``eagle``) and with ``history_first="ngram"`` (``eagle3+ngram``, ...: the host redrafts each
step) or ``"ngram_gpu"`` (``eagle3+ngram_gpu``, ...: merged in the device loop), and suffix
decoding on the device (``suffix``) and with Arctic Inference (``suffix_arctic``), whose
corpus / cache keeps the earlier requests' responses; each checked token-for-token against
plain greedy decoding. One request at a time, so tokens per target forward = generated
tokens / engine steps (the prefill step included).

    python benchmarks/history_first.py                      # CPU: about a minute
    python benchmarks/history_first.py --files 8 --max-file-bytes 320 --k 4 --json hf.json
    python benchmarks/history_first.py --timed ...          # also tokens/s (GPU)
    python benchmarks/history_first.py --timed --ballast-gb 16 ...  # at an 8B-class step

``--ballast-gb G`` makes every target forward also stream G GB of float32 weights
(:class:`BallastTarget`): the demo target's tokens at a step of milliseconds, where the
drafters' and the n-gram match's own time is small beside the forward, as on the targets
speculation is deployed for.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from specjax.cli import demo
from specjax.config import SpeculativeConfig
from specjax.engine import Engine, LoopOptions, SamplingParams
from specjax.proposers import make_proposer
from specjax.tokenizer import BOS_ID

WORKLOAD = Path(__file__).with_name("history_first_workload.json")
#: The model drafters a hybrid can fall back to (the demo's heads).
MODELS = ("eagle3", "draft_model", "medusa", "dflash", "eagle")
METHODS = ("ngram", "ngram_gpu", "suffix", "suffix_arctic") + MODELS + tuple(
    f"{m}+{s}" for s in ("ngram", "ngram_gpu") for m in MODELS)


@dataclasses.dataclass(frozen=True)
class BallastTarget:
    """``inner`` (a ``specjax.Target``) whose ``forward`` also reads a ``[rows, hidden]``
    float32 matrix: ``hidden + zero * sum(ballast @ hidden[0])`` with ``zero`` a 0.0 the
    compiler cannot see, so every forward streams the matrix and returns ``inner``'s values.
    Params: ``{"inner": inner's params, "weight_ballast": [rows, H], "zero": []}``
    (:meth:`wrap`). Everything else is ``inner``'s."""

    inner: object

    def __getattr__(self, name: str):
        if name == "inner":             # not yet set (copy, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)

    @staticmethod
    def wrap(target, gigabytes: float):
        """``TargetModel(BallastTarget(target.model), params)`` with ``gigabytes`` GB of
        ballast (an argument of the compiled step, so its values are not known to the
        compiler)."""
        from specjax.engine import TargetModel

        rows = max(1, int(gigabytes * 1e9) // (4 * target.model.hidden_size))
        ballast = jnp.full((rows, target.model.hidden_size), 1e-3, jnp.float32)
        params = {"inner": target.params, "weight_ballast": ballast,
                  "zero": jnp.zeros((), jnp.float32)}
        return TargetModel(BallastTarget(target.model), params)

    def with_aux_layers(self, ids):
        return BallastTarget(self.inner.with_aux_layers(ids))

    def forward(self, params, input_ids, positions, kv, attn):
        hidden, aux, kv = self.inner.forward(params["inner"], input_ids, positions, kv, attn)
        read = jnp.sum(params["weight_ballast"] @ hidden[0].astype(jnp.float32))
        return hidden + (params["zero"] * read).astype(hidden.dtype), aux, kv

    def compute_logits(self, params, hidden):
        return self.inner.compute_logits(params["inner"], hidden)

    def shared_weights(self, params):
        return self.inner.shared_weights(params["inner"])


def _head(data: bytes, limit: int) -> bytes:
    """``data`` up to ``limit`` bytes, cut after its last whole line when it is longer."""
    if len(data) <= limit:
        return data
    cut = data[:limit]
    return cut[: cut.rfind(b"\n") + 1] or cut


def workload(num_files: int, max_file_bytes: int) -> tuple[list[list[int]], list[int], dict]:
    """``(prompts, max_tokens, meta)``: BOS + file + its first half (cut at a line end);
    ``max_tokens`` the rest of the file. The files' texts come from the workload JSON (held
    out of the demo models' training split: ``tests/benchmarks/test_history_first_bench.py``)."""
    spec = json.loads(WORKLOAD.read_text())
    prompts, max_tokens, names, sizes = [], [], [], []
    for rel in spec["files"][:num_files]:
        data = _head(spec["texts"][rel].encode(), max_file_bytes)
        half = _head(data, len(data) // 2)
        prompts.append([BOS_ID] + list(data) + list(half))
        max_tokens.append(len(data) - len(half))
        names.append(rel)
        sizes.append(len(data))
    return prompts, max_tokens, {"files": names, "file_bytes": sizes}


def chains_tree(k: int, branches: int) -> str:
    """``branches`` chains of depth ``k`` from the root, as a ``speculative_token_tree``."""
    return str([(b,) + (0,) * d for d in range(k) for b in range(branches)])


def proposer(method: str, k: int, target, lookup: tuple[int, int], branches: int = 1):
    lo, hi = lookup
    common = dict(max_model_len=demo.MAX_MODEL_LEN, block_size=demo.BLOCK_SIZE)
    if method in ("ngram", "ngram_gpu"):
        return make_proposer(SpeculativeConfig(method=method, num_speculative_tokens=k,
                                               prompt_lookup_min=lo, prompt_lookup_max=hi), **common)
    if method.startswith("suffix"):     # the device backend (vLLM 0.34) or Arctic Inference's
        backend = "arctic" if method == "suffix_arctic" else "device"
        return make_proposer(SpeculativeConfig(method="suffix", num_speculative_tokens=k,
                                               suffix_backend=backend), **common)
    model, _, first = method.partition("+")
    extra = dict(history_first=first, prompt_lookup_min=lo, prompt_lookup_max=hi) if first else {}
    tree = chains_tree(k, branches) if branches > 1 and model in ("eagle", "eagle3") else None
    return demo.demo_proposer(model, k, (target.model, target.params), tree=tree, **extra)


def run(methods, k, prompts, max_tokens, lookup=(3, 5), log=print, timed: bool = False,
        branches: int = 1, ballast_gb: float = 0.0) -> dict:
    target = demo.demo_target()
    if ballast_gb:
        target = BallastTarget.wrap(target, ballast_gb)
    opts = LoopOptions(batch_buckets=(1,), query_buckets=demo.query_buckets(prompts),
                       context_buckets=demo.context_buckets())

    def decode(prop):
        eng = Engine(target, prop, max_model_len=demo.MAX_MODEL_LEN, block_size=demo.BLOCK_SIZE,
                     max_num_seqs=1, options=opts)
        toks, steps, acc, drafts = [], 0, 0, 0
        for p, m in zip(prompts, max_tokens):
            res = eng.generate([p], SamplingParams(max_tokens=m))
            toks.append(res.token_ids[0])
            steps += res.num_steps
            if res.spec_stats is not None:
                acc += res.spec_stats.num_accepted_tokens
                drafts += res.spec_stats.num_drafts
        extra = {}          # (a hybrid's rows counted over the first pass only)
        if hasattr(prop, "counts"):
            extra.update(first_stage_rows=prop.first_stage_rows, model_rows=prop.model_rows,
                         short_chain_steps=prop.counts.short_steps)
        if timed:            # again, compiled: the requests one after another, wall clock
            t0 = time.perf_counter()
            again = [eng.generate([p], SamplingParams(max_tokens=m)).token_ids[0]
                     for p, m in zip(prompts, max_tokens)]
            wall = time.perf_counter() - t0
            extra.update(tokens_per_s=sum(map(len, again)) / wall, same_output=again == toks)
        return toks, steps, (1 + acc / drafts) if drafts else float("nan"), extra

    t0 = time.perf_counter()
    base, base_steps, _, extra = decode(None)
    n = sum(len(t) for t in base)
    speed = f", {extra['tokens_per_s']:.1f} tok/s" if "tokens_per_s" in extra else ""
    log(f"plain: {n} tokens, {base_steps} steps{speed} ({time.perf_counter() - t0:.0f}s)")
    rows = [{"method": "plain", "tokens": n, "steps": base_steps,
             "tokens_per_forward": n / base_steps, "lossless": extra.get("same_output", True),
             **extra}]
    for m in methods:
        t0 = time.perf_counter()
        prop = proposer(m, k, target, lookup, branches)
        toks, steps, mal, extra = decode(prop)
        row = {"method": m, "tokens": sum(len(t) for t in toks), "steps": steps,
               "tokens_per_forward": sum(len(t) for t in toks) / steps,
               "mean_acceptance_length": mal,
               "lossless": toks == base and extra.get("same_output", True), **extra}
        rows.append(row)
        speed = f", {extra['tokens_per_s']:.1f} tok/s" if "tokens_per_s" in extra else ""
        log(f"{m}: {row['tokens_per_forward']:.3f} tokens / target forward{speed} "
            f"{'OK' if row['lossless'] else 'MISMATCH'} ({time.perf_counter() - t0:.0f}s)")
    return {"rows": rows}


def table(rows) -> str:
    timed = any("tokens_per_s" in r for r in rows)
    out = ["| method | tokens / target forward | steps | mean acceptance length | lossless |"
           + (" tokens/s | vs plain |" if timed else ""),
           "|---|---|---|---|---|" + ("---|---|" if timed else "")]
    plain = next((r.get("tokens_per_s") for r in rows if r["method"] == "plain"), None)
    for r in rows:
        mal = r.get("mean_acceptance_length")
        extra = (f" (n-gram rows {r['first_stage_rows']}, model rows {r['model_rows']}, "
                 f"1-token chains {r.get('short_chain_steps', 0)})") if "first_stage_rows" in r \
            else ""
        out.append(f"| {r['method']}{extra} | {r['tokens_per_forward']:.3f} | {r['steps']} | "
                   f"{'-' if mal is None else f'{mal:.2f}'} | {'yes' if r['lossless'] else 'NO'} |"
                   + (f" {r['tokens_per_s']:.1f} | {r['tokens_per_s'] / plain:.2f}x |"
                      if timed and plain else ""))
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    ap.add_argument("--files", type=int, default=4, help="first N files of the workload (1..8)")
    ap.add_argument("--max-file-bytes", type=int, default=240,
                    help="each file cut to its whole lines within this many bytes")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--prompt-lookup-min", type=int, default=3)
    ap.add_argument("--prompt-lookup-max", type=int, default=5)
    ap.add_argument("--branches", type=int, default=1,
                    help="eagle / eagle3 rows draft a tree of this many chains of depth --k "
                         "(with +ngram the n-gram chain takes the last branch where it matches)")
    ap.add_argument("--timed", action="store_true",
                    help="decode the workload a second time, compiled, for tokens/s (one "
                         "request at a time, each method's default engine path)")
    ap.add_argument("--ballast-gb", type=float, default=0.0,
                    help="every target forward also streams this many GB (BallastTarget)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if not 1 <= a.files <= 8 or a.k < 1 or not 16 <= a.max_file_bytes <= 320 or \
            not 1 <= a.branches <= 4 or not 0 <= a.ballast_gb <= 64:
        ap.error("--files must be in 1..8, --k >= 1, --branches in 1..4, --ballast-gb in "
                 "0..64, --max-file-bytes in "
                 "16..320 (the demo's "
                 f"max_model_len is {demo.MAX_MODEL_LEN})")
    prompts, max_tokens, src = workload(a.files, a.max_file_bytes)
    res = run(a.methods, a.k, prompts, max_tokens, (a.prompt_lookup_min, a.prompt_lookup_max),
              log=lambda s: print(s, file=sys.stderr, flush=True), timed=a.timed,
              branches=a.branches, ballast_gb=a.ballast_gb)
    meta = {"date": time.strftime("%Y-%m-%d"), "device": jax.devices()[0].device_kind,
            "python": platform.python_version(), "jax": jax.__version__, "k": a.k,
            "prompt_lookup": [a.prompt_lookup_min, a.prompt_lookup_max], "branches": a.branches,
            "ballast_gb": a.ballast_gb, "max_file_bytes": a.max_file_bytes, **src}
    print(table(res["rows"]))
    print(json.dumps(meta))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"meta": meta, **res}, f, indent=1)
    return 0 if all(r["lossless"] for r in res["rows"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())

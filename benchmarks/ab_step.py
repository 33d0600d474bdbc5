"""A/B of the reference loop's step between an older commit and this tree, in one process.

The older commit is imported as a second package, ``specjax_parent`` (its ``specjax/``,
``kernels/``, ``models/``, ``converters/`` laid out as one package and its imports renamed),
so both versions time the same steps on the same target params, interleaved round by round
(A B, B A, A B, ...): drift hits both alike. Each round times every ``(method, B)`` with
``engine.diagnostics.time_decode_step`` (median over ``--iters`` calls, each synced on what the loop
fetches); the table gives each version's median over rounds, their spread (max - min) and
the ratio.

    python benchmarks/ab_step.py --prepare 490037b --into .ab      # here (needs git)
    python benchmarks/ab_step.py --parent .ab --target 8b --batch 1,8 --methods eagle3 ngram \\
        --rounds 3                                                   # on the GPU machine

Weights are random (bf16 on the GPU). Plain decoding (``plain``) is always timed.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYOUT = {"specjax": "", "kernels": "kernels", "models": "models", "converters": "converters"}


def prepare(rev: str, into: Path) -> Path:
    """``into/specjax_parent``: commit ``rev`` of this repository as one package."""
    pkg = into / "specjax_parent"
    if pkg.exists():
        shutil.rmtree(pkg)
    with tempfile.TemporaryDirectory() as tmp:
        tar = Path(tmp) / "src.tar"
        subprocess.run(["git", "-C", str(ROOT), "archive", "-o", str(tar), rev], check=True)
        with tarfile.open(tar) as t:
            t.extractall(tmp, filter="data")
        for top, sub in LAYOUT.items():
            shutil.copytree(Path(tmp) / top, pkg / sub, dirs_exist_ok=True,
                            ignore=shutil.ignore_patterns("*.safetensors", "__pycache__"))
    pat = re.compile(r"\bspecjax(?=[.\s,)]|$)")
    for f in pkg.rglob("*.py"):
        f.write_text(pat.sub("specjax_parent", f.read_text()))
    (pkg / "REVISION").write_text(rev + "\n")
    return pkg


def versions(parent: Path):
    sys.path.insert(0, str(parent))
    return {"parent": importlib.import_module("specjax_parent"), "head": importlib.import_module("specjax")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prepare", metavar="REV", help="lay out commit REV as specjax_parent and exit")
    ap.add_argument("--into", default=".ab", help="where --prepare writes (default .ab)")
    ap.add_argument("--parent", default=".ab", help="folder holding specjax_parent/")
    ap.add_argument("--target", choices=("8b", "1b", "tiny"), default="8b",
                    help="tiny: an 8-layer width-64 model for a CPU smoke run")
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--methods", nargs="+", default=["eagle3", "ngram"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--propose", action="store_true",
                    help="time each model method's propose (benchmarks/proposers.py's measure: "
                         "pipelined calls, a k + 1 token target batch each) instead of the step")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.prepare:
        print(prepare(args.prepare, Path(args.into)))
        return 0

    import jax
    import jax.numpy as jnp

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import e2e  # the shapes, random params and proposers of benchmarks/e2e.py

    e2e.TARGETS["tiny"] = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=8,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                               vocab_size=512, rope_theta=10000.0, rms_norm_eps=1e-5)
    mods = versions(Path(args.parent))
    rev = (Path(args.parent) / "specjax_parent" / "REVISION").read_text().strip()
    dtype = jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32
    batches = [int(b) for b in args.batch.split(",")]
    bs, k = e2e.BS, args.k
    mml = -(-(args.context + 2 * k + 8) // bs) * bs
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; jax {jax.__version__}; "
          f"{jax.devices()[0].device_kind}; parent {rev} vs head; target {args.target} "
          f"{jnp.dtype(dtype).name}; context {args.context}; k={k}; rounds {args.rounds}; "
          f"iters {args.iters}; XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}", flush=True)
    models = e2e.Models(args.target, dtype)          # head's registry; the params are plain arrays

    geo = {key: v for key, v in e2e.TARGETS[args.target].items() if key != "tie_word_embeddings"}
    aux = list(models.aux)
    heads = {   # as benchmarks/e2e.py's Models.proposer
        "eagle": dict(geo, num_hidden_layers=1, bias=True),
        "eagle3": dict(geo, num_hidden_layers=1, target_hidden_size=geo["hidden_size"],
                       eagle_aux_hidden_state_layer_ids=aux,
                       **({"draft_vocab_size": 32000, "has_d2t": True} if args.target == "8b" else {})),
        "dflash": dict(geo, num_hidden_layers=1, target_hidden_size=geo["hidden_size"],
                       aux_hidden_state_layer_ids=aux, mask_token_id=0),
    }
    head_reg = importlib.import_module("specjax.models.registry")
    dparams = {m: e2e.random_params(m, head_reg.config_from_hf(m, heads[m]), dtype, jax.random.key(1))
               for m in args.methods if m in heads}

    def engine(name, method, b):
        """The version ``name``'s Engine for ``method`` (its own factory and classes; the
        same target and draft arrays for both versions)."""
        pkg = mods[name].__name__
        sub = lambda s: importlib.import_module(f"{pkg}.{s}")  # noqa: E731
        reg = sub("models.registry")
        target = sub("engine").TargetModel(
            reg.make_model("llama", reg.config_from_hf("llama", e2e.TARGETS[args.target])),
            models.target.params)
        prop = None
        if method in ("ngram", "ngram_gpu"):
            prop = sub("proposers").make_proposer(
                sub("config").SpeculativeConfig(method=method, num_speculative_tokens=k,
                                                prompt_lookup_min=2, prompt_lookup_max=5),
                max_model_len=mml, block_size=bs)
        elif method in heads:
            prop = sub("proposers").make_proposer(
                sub("config").SpeculativeConfig(method=method, num_speculative_tokens=k),
                target=target.model, target_params=target.params,
                draft=reg.config_from_hf(method, heads[method]), draft_params=dparams[method],
                max_model_len=mml, block_size=bs)
        elif method != "plain":
            raise SystemExit(f"--methods: {method!r} is not one of plain, ngram, ngram_gpu, "
                             f"{', '.join(heads)}")
        eng = sub("engine")
        buckets = dict(batch_buckets=(b,), context_buckets=(mml // bs,))
        if hasattr(eng, "LoopOptions"):       # this tree's API (older commits: Engine kwargs)
            buckets = dict(options=eng.LoopOptions(**buckets))
        return eng.Engine(target, prop, max_model_len=mml, block_size=bs, max_num_seqs=b,
                          kv_dtype=dtype, **buckets)

    if args.propose:
        return propose_ab(args, mods, engine, batches, rev)
    cases = [(m, b) for b in batches for m in ["plain"] + list(args.methods)]
    engines = {(v, m, b): engine(v, m, b) for v in ("parent", "head") for m, b in cases}
    times = {key: [] for key in engines}
    for r in range(args.rounds + 1):                 # round 0 compiles (not counted)
        order = ("parent", "head") if r % 2 else ("head", "parent")
        for m, b in cases:
            for v in order:
                e = engines[(v, m, b)]
                t = getattr(e, "diagnostics", e).time_decode_step(b, args.context, iters=args.iters)
                if r:
                    times[(v, m, b)].append((t["step_s"] + t["host_propose_s"]) * 1e3)
    return report(cases, times, args.json)


def report(cases, times, json_path, **extra) -> int:
    """Print the parent / head table (median over rounds, spread, ratio); rows to JSON."""
    import numpy as np

    head = f"{'method':<8} {'B':>3} {'parent ms (spread)':>22} {'head ms (spread)':>22} {'head/parent':>11}"
    print(head)
    print("-" * len(head))
    rows = []
    for m, b in cases:
        p, h = times[("parent", m, b)], times[("head", m, b)]
        mp, mh = float(np.median(p)), float(np.median(h))
        print(f"{m:<8} {b:>3} {mp:>12.3f} ({max(p) - min(p):>6.3f}) {mh:>12.3f} ({max(h) - min(h):>6.3f}) "
              f"{mh / mp:>11.3f}", flush=True)
        rows.append(dict(method=m, batch=b, parent_ms=p, head_ms=h, ratio=mh / mp, **extra))
    if json_path:
        Path(json_path).write_text(json.dumps(rows, indent=1))
    return 0


def propose_inputs(pkg: str, impl, b: int, k: int, ctx: int, vocab: int, dtype):
    """``(state, inputs)`` for ``impl.propose`` in version ``pkg``: ``b`` requests with
    ``ctx``-token contexts and a ``k + 1`` token target batch each (as
    ``benchmarks/proposers.py``'s ``method_case``)."""
    import warnings

    import jax
    import jax.numpy as jnp
    import numpy as np

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)   # old paths: both versions have them
        cam = importlib.import_module(f"{pkg}.attention").CommonAttentionMetadata
        pin = importlib.import_module(f"{pkg}.proposers.base").ProposerInputs
        widths = importlib.import_module(f"{pkg}.proposers.common")._hidden_widths
    q, bs = k + 1, 16
    width = impl.max_model_len // bs
    state = impl.init_state(b * width, dtype)
    table = np.arange(b * width, dtype=np.int32).reshape(b, width)
    md = cam.from_query_lens([q] * b, [ctx] * b, table, block_size=bs)
    rng = np.random.default_rng(0)
    h, aux = widths(impl)
    rand = lambda shape: jax.random.normal(jax.random.key(2), shape, jnp.float32).astype(dtype)  # noqa: E731
    inputs = pin(
        target_token_ids=jnp.asarray(rng.integers(0, vocab, b * q), jnp.int32),
        target_positions=jnp.asarray(np.tile(np.arange(ctx - q, ctx, dtype=np.int32), b)),
        target_hidden_states=None if h is None else rand((b * q, h)),
        aux_hidden_states=None if aux is None else rand((b * q, *aux)),
        next_token_ids=jnp.asarray(rng.integers(0, vocab, b), jnp.int32),
        token_indices_to_sample=jnp.asarray(np.arange(1, b + 1) * q - 1, jnp.int32),
        num_rejected_tokens=jnp.zeros(b, jnp.int32),
        attn_metadata=md)
    return state, inputs


def propose_ab(args, mods, engine, batches, rev) -> int:
    """Each model method's pipelined ``propose``, parent vs head, interleaved rounds."""
    import jax
    import jax.numpy as jnp

    from proposers import time_propose

    dtype = jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32
    methods = [m for m in args.methods if m not in ("plain", "ngram", "ngram_gpu")]
    cases, times = [(m, b) for b in batches for m in methods], {}
    built = {}
    for v in ("parent", "head"):
        for m, b in cases:
            e = engine(v, m, b)
            impl, params = e.proposer.impl, e.proposer.params
            vocab = e.target.model.config.vocab_size
            state, inputs = propose_inputs(mods[v].__name__, impl, b, args.k, args.context, vocab, dtype)
            built[(v, m, b)] = [impl, params, state, inputs]
            times[(v, m, b)] = []
    for r in range(args.rounds + 1):                 # round 0 compiles (not counted)
        order = ("parent", "head") if r % 2 else ("head", "parent")
        for key in cases:
            for v in order:
                impl, params, state, inputs = built[(v, *key)]
                _, pipe, state = time_propose(impl, params, state, inputs, args.iters)
                built[(v, *key)][2] = state
                if r:
                    times[(v, *key)].append(pipe * 1e3)
    print(f"propose (pipelined ms per call), parent {rev} vs head")
    return report(cases, times, args.json, what="propose")


if __name__ == "__main__":
    sys.exit(main())

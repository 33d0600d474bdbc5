"""End-to-end speculative decoding step cost: one speculative step (verify + draft) against
one plain decoding step, per method and batch size, and the speed-up that implies.

For each batch size B, every request holds ``--context`` tokens in the paged KV cache and
(speculative) ``k`` drafts to verify. Timed is the reference loop's jitted step
(``specjax.engine.Engine.diagnostics.time_decode_step``): target forward over the ``B * (k + 1)`` tokens,
rejection sampling, and for device proposers the padded-batch input preparation and the
proposer's ``propose`` (the fused step); for token-history proposers (n-gram, suffix) the
drafting time is measured separately (steady state: one new token per request a call) and
added. Each call is synced on the sampled tokens as the loop is. Weights are random
(timing does not depend on values).

Every row also gives the step's padded token count ``T_pad`` and ``kv copies``: the
instructions of its compiled HLO that copy a whole KV-cache buffer (0 when the donated
caches are updated in place). The engine runs a one-token step unpadded (the default
``LoopOptions(min_tokens_per_step=1)``); at B=1 the step padded to two tokens is timed too
(``plain (T=2, padded)``, the old default, skip with ``--no-t1-check``): the one-token
goal is the unpadded step within 5% of it. ``plain (again)``
re-times the plain step after the methods (no compilation) as a drift check.

    ratio    = t_spec / t_plain   (also the break-even mean acceptance length)
    speed-up = tau / ratio        (tau: mean acceptance length, bonus token included)

``tau`` is measured on the trained demo models (``specjax demo``'s prompts and weights);
the table also gives the speed-up at ``--assume-tau``.

Usage::

    python benchmarks/e2e.py                          # GPU: 8B-shaped target; CPU: demo model
    python benchmarks/e2e.py --target 8b --batch 1,8,32 --context 1024 --k 3 --json out.json
    python benchmarks/e2e.py --target demo --methods ngram eagle --batch 1,8
    python benchmarks/e2e.py --target 8b --tp 2 --methods ngram eagle3   # 2 GPUs, Engine(mesh=)
    python benchmarks/e2e.py --target 8b --no-demo-tau --torch --out anchors.json  # + PyTorch anchors
    python benchmarks/e2e.py --target 8b --device-methods --no-t1-check --out methods.json
    python benchmarks/e2e.py --tiny --device-methods                     # CPU smoke run

``--torch`` times ``benchmarks/torch_anchors.py``'s PyTorch steps of the same shapes
(torch.compile + CUDA graph) after specjax's rows, in the same process, and prints each
specjax step over its anchor (plain -> decode, n-gram -> 4-token verify, EAGLE-3 -> verify +
propose, MTP -> verify + MTP propose) beside the floor (``benchmarks/floors.py``).
``--device-methods`` times every device method's fused step (EAGLE-1, EAGLE-3, DFlash,
Medusa, MTP, draft model, the EAGLE-3 tree step) beside the plain step and ends with a table of ms and ratio to plain per B.

Targets: ``8b`` (Llama-3.1-8B shape; draft model Llama-3.2-1B shape; EAGLE-3 draft vocab
32000), ``1b`` (Llama-3.2-1B shape; draft model 2 layers of it), ``demo`` (the embedded
demo model), ``tiny`` (an 8-layer, 64-wide Llama for CPU smoke runs). Runs on any JAX backend.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import floors  # noqa: E402

from specjax.cli import demo  # noqa: E402
from specjax.config import SpeculativeConfig  # noqa: E402
from specjax.engine import Engine, LoopOptions, SamplingParams, TargetModel, generate  # noqa: E402
from specjax.models import fuse_projections, registry  # noqa: E402
from specjax.models.config import eagle3_default_aux_layer_ids  # noqa: E402
from specjax.proposers import available_methods, make_proposer  # noqa: E402

BS = 16
#: The target geometries (``floors.TARGETS``: 8b, 1b, tiny), shared with the floors and the
#: PyTorch anchors so all three measure the same shapes.
TARGETS = floors.TARGETS
#: Every device method's fused step (``--device-methods``); the tree step is EAGLE-3's with
#: ``DEFAULT_TREE`` unless ``--tree`` names others.
DEVICE_METHODS = ("eagle", "eagle3", "dflash", "medusa", "mtp", "draft_model")
DEFAULT_TREE = "[(0,), (1,), (0, 0), (1, 0), (0, 0, 0), (1, 0, 0)]"
#: specjax rows and the PyTorch anchor each is compared with (``--torch``): method -> anchor.
TORCH_PAIRS = {"plain": "decode", "plain (T=2, padded)": "decode", "ngram": "verify",
               "ngram_gpu": "verify", "suffix": "verify", "eagle3": "fused", "mtp": "mtp_fused"}


def random_params(kind, cfg, dtype, key):
    """Random params built on the device (norm scales 1, integer maps 0)."""
    abstract = registry.abstract_params(kind, cfg, dtype)
    flat, tree = jax.tree_util.tree_flatten_with_path(abstract)
    keys = jax.random.split(key, len(flat))
    out = []
    for k, (path, a) in zip(keys, flat):
        name = jax.tree_util.keystr(path)
        if jnp.issubdtype(a.dtype, jnp.integer):
            out.append(jnp.zeros(a.shape, a.dtype))
        elif "norm" in name:
            out.append(jnp.ones(a.shape, a.dtype))
        else:
            fan_in = a.shape[0] if len(a.shape) == 2 else 1
            scale = 1.0 if "embed" in name else 1.0 / np.sqrt(fan_in)
            out.append((jax.random.normal(k, a.shape, jnp.float32) * scale).astype(a.dtype))
    return jax.tree_util.tree_unflatten(tree, out)


class Models:
    """Target and drafts of one size (params made on demand, dropped after use)."""

    def __init__(self, size: str, dtype):
        self.size, self.dtype = size, dtype
        if size == "demo":
            self.target = demo.demo_target()
            if dtype != jnp.float32:
                self.target = TargetModel(self.target.model, jax.tree.map(lambda x: x.astype(dtype)
                                          if jnp.issubdtype(x.dtype, jnp.floating) else x,
                                          self.target.params))
            self.geo = None                  # the shipped demo drafts (demo.demo_proposer)
            self.aux = None
        else:
            self.geo = TARGETS[size]
            cfg = registry.config_from_hf("llama", self.geo)
            # fused once here, so each engine's place_target_params (which fuses) keeps these
            self.target = TargetModel(registry.make_model("llama", cfg), fuse_projections(
                random_params("llama", cfg, dtype, jax.random.key(0))))
            self.aux = eagle3_default_aux_layer_ids(self.geo["num_hidden_layers"])

    def proposer(self, method: str, k: int, max_model_len: int, tree: str | None = None):
        if self.size == "demo":
            return demo.demo_proposer(method, k, self.target, max_model_len=max_model_len,
                                      block_size=BS, tree=tree)
        common = dict(max_model_len=max_model_len, block_size=BS)
        if method in ("ngram", "ngram_gpu"):
            return make_proposer(SpeculativeConfig(method=method, num_speculative_tokens=k,
                                                   prompt_lookup_min=2, prompt_lookup_max=5), **common)
        if method == "suffix":
            return make_proposer(SpeculativeConfig(method=method, num_speculative_tokens=k), **common)
        tm, tp = self.target
        common.update(target=tm, target_params=tp)
        if method == "extract_hidden_states":
            return make_proposer(SpeculativeConfig(method=method, num_speculative_tokens=1),
                                 aux_layer_ids=self.aux, **common)
        g = {key: v for key, v in self.geo.items() if key != "tie_word_embeddings"}
        h = g["hidden_size"]
        extra = {}
        if method.startswith("dspark-top"):      # dspark-topN: dspark_draft_topk=N
            method, extra = "dspark", {"dspark_draft_topk": int(method[len("dspark-top"):])}
        if method == "draft_model":
            kind = "llama"
            if self.size == "8b":    # Llama-3.2-1B shape, the usual draft of Llama-3.1-8B
                hf = dict(TARGETS["1b"])
            else:
                hf = dict(self.geo, num_hidden_layers=max(1, g["num_hidden_layers"] // 8))
        else:
            kind = method
            hf = {
                "eagle": dict(g, num_hidden_layers=1, bias=True),
                "eagle3": dict(g, num_hidden_layers=1, target_hidden_size=h,
                               eagle_aux_hidden_state_layer_ids=list(self.aux),
                               **({"draft_vocab_size": floors.EAGLE3_DRAFT_VOCAB_8B, "has_d2t": True}
                                  if self.size == "8b" else {})),
                "dflash": dict(g, num_hidden_layers=1, target_hidden_size=h,
                               aux_hidden_state_layer_ids=list(self.aux), mask_token_id=0),
                # SpecForge's Qwen3-8B DSpark: rank 256, confidence head on [h, m]
                "dspark": dict(g, num_hidden_layers=1, target_hidden_size=h,
                               aux_hidden_state_layer_ids=list(self.aux), mask_token_id=0,
                               markov_rank=256, enable_confidence_head=True,
                               confidence_head_with_markov=True),
                "medusa": dict(num_heads=max(k, 4), num_hidden_layers=1, hidden_size=h,
                               vocab_size=g["vocab_size"]),
                # MiMo MTP: one Qwen2 block (q/k/v bias), the target's embedding and lm_head
                "mtp": dict(g, num_hidden_layers=1, num_nextn_predict_layers=1),
            }[method]
        cfg = registry.config_from_hf(kind, hf)
        params = random_params(kind, cfg, self.dtype, jax.random.key(1))
        if tree is not None:
            from specjax.token_tree import TokenTree
            k = TokenTree.from_choices(tree).num_nodes
        spec = SpeculativeConfig(method=method, num_speculative_tokens=k, speculative_token_tree=tree,
                                 **({"model": "draft"} if method == "draft_model" else {}), **extra)
        return make_proposer(spec, draft=cfg, draft_params=params, **common)


def max_model_len(context: int, k: int) -> int:
    """The engines' ``max_model_len``: ``context`` plus room for two steps of ``k`` drafts,
    rounded up to whole blocks."""
    return -(-(context + 2 * k + 8) // BS) * BS


def make_engine(target, prop, b: int, mml: int, dtype, mesh=None, *, loop: dict | None = None,
                **extra) -> Engine:
    """The benchmarks' engine: ``b`` requests in one batch bucket, one context bucket
    (``mml`` tokens), the KV cache in ``dtype``; ``loop``: more ``LoopOptions`` fields;
    ``extra``: more ``Engine`` arguments. A proposer that learns from finished requests
    has that compiled here (no timed window compiles it)."""
    opts = LoopOptions(batch_buckets=(b,), context_buckets=(mml // BS,), **(loop or {}))
    eng = Engine(target, prop, max_model_len=mml, block_size=BS, max_num_seqs=b,
                 kv_dtype=dtype, mesh=mesh, options=opts, **extra)
    if prop is not None:
        prop.warmup_finish(b)
    return eng


def demo_acceptance(methods, k: int) -> dict[str, float]:
    """Mean acceptance length of each method on the demo models (greedy, 48 tokens)."""
    target = demo.demo_target()
    prompts = demo._prompts()
    out = {}
    for m in methods:
        prop = demo.demo_proposer(m, 1 if m == "extract_hidden_states" else k, target)
        res = generate(target, prop, prompts, SamplingParams(max_tokens=48),
                       max_model_len=demo.MAX_MODEL_LEN, block_size=demo.BLOCK_SIZE)
        out[m] = res.mean_acceptance_length
    return out


def step_floor_ms(geo, b: int, context: int, tokens: int, dtype) -> float:
    """The target forward's floor (``floors``) for a ``time_decode_step`` batch: ``context - 1``
    tokens cached per request, ``tokens`` new ones; nan for the demo target."""
    if geo is None:
        return float("nan")
    return floors.floor_ms(floors.target_step_bytes(geo, b, context - 1, tokens, jnp.dtype(dtype).itemsize))


def _torch_pairs(rows: list[dict], torch_rows: list[dict]) -> list[dict]:
    """Each specjax row with a PyTorch anchor (``TORCH_PAIRS``) beside it: specjax ms (the
    device step; host drafting excluded), the anchor's synced / graph ms and floor, and
    the ratios."""
    anchors = {(r["anchor"], r["batch"]): r for r in torch_rows}
    out = []
    for r in rows:
        a = anchors.get((TORCH_PAIRS.get(r["method"]), r["batch"]))
        if a is None:
            continue
        ms = r["spec_ms"] if "spec_ms" in r else r["plain_ms"]
        out.append(dict(method=r["method"], batch=r["batch"], specjax_ms=ms, anchor=a["anchor"],
                        torch_synced_ms=a["synced_ms"], torch_graph_ms=a["graph_ms"],
                        floor_ms=a["floor_ms"], ratio_synced=ms / a["synced_ms"],
                        ratio_graph=ms / a["graph_ms"], specjax_x_floor=ms / a["floor_ms"],
                        torch_x_floor=a["synced_ms"] / a["floor_ms"]))
    return out


def print_torch_table(pairs: list[dict]) -> None:
    print("\n| specjax step | B | specjax ms | PyTorch anchor | torch ms (synced) | torch ms (graph) "
          "| floor ms | specjax / torch (synced) | specjax / torch (graph) | specjax / floor | torch / floor |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for p in pairs:
        print(f"| {p['method']} | {p['batch']} | {p['specjax_ms']:.3f} | {p['anchor']} | "
              f"{p['torch_synced_ms']:.3f} | {p['torch_graph_ms']:.3f} | {p['floor_ms']:.3f} | "
              f"{p['ratio_synced']:.2f} | {p['ratio_graph']:.2f} | {p['specjax_x_floor']:.2f} | "
              f"{p['torch_x_floor']:.2f} |", flush=True)


def print_methods_table(rows: list[dict], batches) -> None:
    """Fused step of each method against the plain step, ms (ratio), one column per B."""
    plain = {r["batch"]: r for r in rows if r["method"] == "plain"}
    spec = [r for r in rows if "spec_ms" in r]
    labels = list(dict.fromkeys(r["method"] for r in rows if "spec_ms" in r or "failed" in r))
    print("\n| step | " + " | ".join(f"B = {b}: ms (x plain)" for b in batches) + " |")
    print("|---|" + "---|" * len(batches))
    print("| plain | " + " | ".join(f"{plain[b]['plain_ms']:.3f}" if b in plain else "" for b in batches)
          + " |")
    for m in labels:
        cells = []
        for b in batches:
            r = next((x for x in spec if x["method"] == m and x["batch"] == b), None)
            cells.append("failed" if r is None else f"{r['spec_ms'] + r['host_ms']:.3f} ({r['ratio']:.2f})")
        print(f"| {m} | " + " | ".join(cells) + " |", flush=True)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--torch" in argv and "XLA_PYTHON_CLIENT_MEM_FRACTION" not in os.environ:
        # before JAX's backend starts: leave PyTorch half the GPU (JAX takes 75% by default)
        os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = "0.5"
    gpu = jax.default_backend() == "gpu"
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", choices=("8b", "1b", "tiny", "demo"), default="8b" if gpu else "demo")
    ap.add_argument("--tiny", action="store_true",
                    help="CPU smoke shapes: --target tiny, context 64, 3 iterations (unless given)")
    ap.add_argument("--batch", default="1,8,32")
    ap.add_argument("--context", type=int, default=None, help="default 1024 (64 with --tiny)")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--methods", nargs="+", default=None,
                    help="default: every available method (ngram eagle3 with --torch)")
    ap.add_argument("--device-methods", action="store_true",
                    help=f"every device method's fused step beside the plain step: {' '.join(DEVICE_METHODS)} "
                         "and the EAGLE-3 tree step (--tree, default DEFAULT_TREE); no demo tau; a "
                         "table of ms and ratio to plain per B at the end")
    ap.add_argument("--torch", action="store_true",
                    help="after specjax's rows, time the PyTorch anchors (benchmarks/torch_anchors.py: "
                         "decode, 4-token verify, EAGLE-3 propose, verify + propose; torch.compile + "
                         "CUDA graph) in this process and print specjax / torch beside the floor")
    ap.add_argument("--torch-reps", type=int, default=50)
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16" if gpu else "float32")
    ap.add_argument("--iters", type=int, default=None, help="default 20 (3 with --tiny)")
    ap.add_argument("--assume-tau", type=float, default=2.5,
                    help="mean acceptance length of a trained head, for the last column")
    ap.add_argument("--json", default=None, help="write every row as JSON lines here")
    ap.add_argument("--out", default=None,
                    help="write one JSON document here: the run's settings, every row, the "
                         "PyTorch anchors and the specjax / torch pairs")
    ap.add_argument("--no-demo-tau", action="store_true",
                    help="skip measuring acceptance on the demo models (tau columns become nan)")
    ap.add_argument("--tree", action="append", default=[],
                    help="also time eagle / eagle3 with this speculative_token_tree (tree "
                         "verification + tree drafting; repeatable)")
    ap.add_argument("--no-t1-check", dest="t1_check", action="store_false",
                    help="at B=1, skip timing the plain step padded to two tokens as well")
    ap.add_argument("--tp", type=int, default=1,
                    help="tensor parallel over this many devices (Engine(mesh=...)): target and "
                         "device proposers sharded with specjax.sharding's rules")
    args = ap.parse_args(argv)
    if args.tiny:
        args.target = "tiny"
    args.context = args.context or (64 if args.tiny else 1024)
    args.iters = args.iters or (3 if args.tiny else 20)
    if args.tp < 1 or args.tp > len(jax.devices()):
        ap.error(f"--tp must be between 1 and the {len(jax.devices())} visible devices, got {args.tp}")
    if args.torch and args.target == "demo":
        ap.error("--torch needs a Llama geometry target (--target 8b, 1b or tiny), not demo")
    if args.torch and args.tp > 1:
        ap.error("--torch compares one device's step: use it with --tp 1")
    mesh = None
    if args.tp > 1:
        from jax.sharding import Mesh

        mesh = Mesh(np.array(jax.devices()[: args.tp]), ("tp",))
    dtype = jnp.dtype(args.dtype)
    batches = [int(b) for b in args.batch.split(",")]
    if args.device_methods:
        if args.methods:
            ap.error("--device-methods picks the methods itself: drop --methods")
        methods = list(DEVICE_METHODS)
        args.no_demo_tau = True
        trees = args.tree or [DEFAULT_TREE]
    else:
        methods = args.methods or (["ngram", "eagle3"] if args.torch else
                                   [m for m in demo.ALL_METHODS if m in available_methods()])
        trees = args.tree
    k = args.k
    mml = max_model_len(args.context, k)
    dev = jax.devices()[0]
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; jax {jax.__version__}; "
          f"{dev.platform} {dev.device_kind}; target {args.target} {args.dtype}; context {args.context}; "
          f"k={k}; block {BS}; iters {args.iters}; tp {args.tp}; "
          f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}; "
          f"XLA_PYTHON_CLIENT_MEM_FRACTION={os.environ.get('XLA_PYTHON_CLIENT_MEM_FRACTION', '')!r}",
          flush=True)
    t0 = time.perf_counter()
    if args.no_demo_tau:
        tau = {m: float("nan") for m in methods}
    else:
        tau = demo_acceptance(methods, k)
        print(f"# demo-model acceptance (trained demo drafts) in {time.perf_counter() - t0:.0f} s: "
              + ", ".join(f"{m} {t:.2f}" for m, t in tau.items()), flush=True)
    models = Models(args.target, dtype)
    sink = open(args.json, "w") if args.json else None
    rows: list[dict] = []
    head = (f"{'method':<22} {'B':>3} {'k':>2} {'plain ms':>9} {'spec ms':>9} {'host ms':>8} "
            f"{'ratio':>6} {'tau(demo)':>9} {'speed-up':>8} {f'@tau={args.assume_tau}':>9} {'compile s':>9} "
            f"{'T_pad':>5} {'kv copies':>9} {'floor ms':>8}")
    print(head)
    print("-" * len(head), flush=True)

    def emit(row):
        rows.append(row)
        if sink:
            sink.write(json.dumps(row) + "\n")
            sink.flush()

    def timed(prop, b, **extra):
        """(time_decode_step dict, padded tokens of the step, KV-cache copies in its HLO)."""
        diag = make_engine(models.target, prop, b, mml, dtype, mesh=mesh, **extra).diagnostics
        t = diag.time_decode_step(b, args.context, iters=args.iters)
        low = diag.lower_decode_step(b, args.context)     # compiled already: a cache hit
        t_pad = diag.decode_step_tokens(b, args.context)
        return t, t_pad, diag.kv_cache_copies(low.compile().as_text())

    def plain_row(label, b, tp, t_pad, copies, **more):
        fl = step_floor_ms(models.geo, b, args.context, 1, dtype)
        print(f"{label:<22} {b:>3} {'-':>2} {tp['step_s'] * 1e3:>9.3f} {'':>9} {'':>8} {'':>6} {'':>9} "
              f"{'':>8} {'':>9} {tp['compile_s']:>9.1f} {t_pad:>5} {copies:>9} {fl:>8.3f}", flush=True)
        emit(dict(method=label, batch=b, k=0, plain_ms=tp["step_s"] * 1e3, compile_s=tp["compile_s"],
                  t_pad=t_pad, kv_copies=copies, floor_ms=fl, **more))

    for b in batches:
        tp, t_pad, copies = timed(None, b)
        gc.collect()
        plain_row("plain", b, tp, t_pad, copies)
        if b == 1 and args.t1_check:
            # The step padded to two tokens (the default until the one-token causes were
            # fixed in the models): 6.9 ms against 12.7 ms unpadded on 2026-11-29.
            t2, t2_pad, c2 = timed(None, b, loop=dict(min_tokens_per_step=2))
            gc.collect()
            plain_row("plain (T=2, padded)", b, t2, t2_pad, c2)
        variants = [(m, None) for m in methods] + [
            (m, t) for m in (["eagle3"] if args.device_methods else methods)
            if m in ("eagle", "eagle3") for t in trees]
        for m, tree in variants:
            mk = 1 if m == "extract_hidden_states" else k
            label = m if tree is None else f"{m} tree"
            if tree is not None:      # a tree verifies up to its depth: that caps tau
                from specjax.token_tree import TokenTree
                mk = TokenTree.from_choices(tree).depth
            try:
                if tree is not None:
                    ts, ts_pad, sc = timed(models.proposer(m, mk, mml, tree=tree), b)
                else:
                    ts, ts_pad, sc = timed(models.proposer(m, mk, mml), b)
            except Exception as e:  # keep the other rows
                print(f"{label:<22} {b:>3} failed: {type(e).__name__}: {e}", flush=True)
                emit(dict(method=label, tree=tree, batch=b, failed=f"{type(e).__name__}: {e}"))
                continue
            finally:
                gc.collect()
            spec = ts["step_s"] + ts["host_propose_s"]
            ratio = spec / tp["step_s"]
            assumed = min(args.assume_tau, mk + 1) / ratio
            tm = tau.get(m, float("nan")) if tree is None else float("nan")
            fl = step_floor_ms(models.geo, b, args.context, mk + 1, dtype)   # the verify forward
            emit(dict(method=label, tree=tree, batch=b, k=mk, plain_ms=tp["step_s"] * 1e3,
                      spec_ms=ts["step_s"] * 1e3, host_ms=ts["host_propose_s"] * 1e3, ratio=ratio,
                      tau_demo=tm, speedup_demo=tm / ratio, speedup_assumed=assumed,
                      compile_s=ts["compile_s"], t_pad=ts_pad, kv_copies=sc, verify_floor_ms=fl))
            print(f"{label:<22} {b:>3} {mk:>2} {tp['step_s'] * 1e3:>9.3f} {ts['step_s'] * 1e3:>9.3f} "
                  f"{ts['host_propose_s'] * 1e3:>8.3f} {ratio:>6.2f} {tm:>9.2f} {tm / ratio:>7.2f}x "
                  f"{assumed:>8.2f}x {ts['compile_s']:>9.1f} {ts_pad:>5} {sc:>9} {fl:>8.3f}", flush=True)
        # The same plain step again after the methods (compiled already): drift / order check.
        again, _, _ = timed(None, b)
        gc.collect()
        plain_row("plain (again)", b, again, t_pad, copies,
                  drift=again["step_s"] / tp["step_s"] - 1)
    if sink:
        sink.close()
    print("\n(floor ms: the target forward's weights + live K/V / 4.3 TB/s, benchmarks/floors.py; "
          "a speculative row's is its verify forward's, drafting not included)")
    if args.device_methods:
        print_methods_table(rows, batches)
    torch_rows: list[dict] = []
    pairs: list[dict] = []
    if args.torch:
        del models
        gc.collect()
        import torch_anchors

        print(f"\n# PyTorch anchors (torch.compile + CUDA graph), B = {args.batch}", flush=True)
        try:
            torch_rows = torch_anchors.measure(
                TARGETS[args.target], batches, args.context, k=k,
                draft_vocab=floors.EAGLE3_DRAFT_VOCAB_8B if args.target == "8b" else None,
                dtype=args.dtype, reps=args.torch_reps)
        except Exception as e:  # keep specjax's rows and the --out document
            print(f"# PyTorch anchors failed: {type(e).__name__}: {e}", flush=True)
        pairs = _torch_pairs(rows, torch_rows)
        print_torch_table(pairs)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(settings=vars(args), methods=methods, trees=trees, jax=jax.__version__,
                           device=dev.device_kind, xla_flags=os.environ.get("XLA_FLAGS", ""),
                           rows=rows, torch=torch_rows, torch_pairs=pairs), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

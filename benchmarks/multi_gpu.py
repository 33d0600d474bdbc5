"""Time one EAGLE-3 ``propose`` on 1 GPU vs tensor parallel (TP) and data parallel (DP).

Head and workload: benchmarks/proposers.py's (Llama-3.1-8B-shaped EAGLE-3 head, random bf16
weights, 1 layer, draft vocab 32000; per request a 1k-token context and a k + 1 = 4 token
target batch; k = 3 drafts), built from that module's constants and ``random_params``.

- ``tp=N``: params and draft KV cache sharded over N devices with ``specjax.sharding``
  (``tensor_parallel``: Megatron column/row split of q/k/v/o and the MLP, lm_head split over
  the draft vocabulary, fc / norms / d2t / embedding replicated, KV cache split over its 8 kv
  heads), ``use_local_argmax_reduction=True`` (``--local-argmax off|both`` to compare).
  N = 1 is the plain single-device proposer (benchmarks/proposers.py's measurement).
- ``dp=N`` (``--dp``): the batch split into N independent shards of B / N requests, each
  with its own KV cache, weights replicated (``specjax.sharding.DataParallel``).
- ``dp x tp2`` (``--dp-tp``, N >= 4 devices): N / 2 data-parallel groups, each a tp=2
  proposer (``DataParallel`` of a ``tensor_parallel`` proposer on one 2-D mesh).

Timing as benchmarks/proposers.py: warm-up calls, then *latency* = median of ``--iters``
single calls each followed by ``block_until_ready``, and *pipelined* = ``--iters``
back-to-back calls then one sync, divided by ``--iters``.

Floor per device = bytes one device must move / 4.3 TB/s: its shard of the head's weights
read once per forward (k forwards; fc once per propose), plus its shard of each forward's
cached K/V. Collectives (two all-reduces of ``[T, H]`` per forward under TP, plus the
argmax pairs) are not in the floor.

Usage:
  python benchmarks/multi_gpu.py [--devices 1,2] [--batches 1,8,64] [--dp] [--out F.json]
  XLA_FLAGS=--xla_force_host_platform_device_count=2 JAX_PLATFORMS=cpu \\
      python benchmarks/multi_gpu.py --small --iters 2        # CPU smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time

# NVLink multicast stays off on the lent multi-GPU machines (see their notes).
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import proposers as single  # noqa: E402  (benchmarks/proposers.py)

from specjax.attention_metadata import CommonAttentionMetadata  # noqa: E402
from specjax.config import SpeculativeConfig  # noqa: E402
from specjax.models import registry, share_target_weights  # noqa: E402
from specjax.proposers.types import ProposerInputs  # noqa: E402
from specjax.proposers.eagle import EagleProposer  # noqa: E402
from specjax.sharding import DataParallel, tensor_parallel  # noqa: E402

BS = single.BS
#: (H, I, heads, kv heads, head_dim, target vocab, draft vocab)
FULL = dict(H=single.H, I=single.I, NH=single.NH, NKV=single.NKV, HD=single.HD, V=single.V,
            VD=single.VD)
SMALL = dict(H=256, I=512, NH=8, NKV=4, HD=32, V=4096, VD=1024)


def build_head(geo: dict, dtype):
    """``(model, params, own_keys)``: the EAGLE-3 head of benchmarks/proposers.py with
    geometry ``geo`` (random weights) and the target's embedding shared in."""
    H, V = geo["H"], geo["V"]
    cfg = registry.config_from_hf("eagle3", dict(
        hidden_size=H, intermediate_size=geo["I"], num_attention_heads=geo["NH"],
        num_key_value_heads=geo["NKV"], head_dim=geo["HD"], num_hidden_layers=1, vocab_size=V,
        draft_vocab_size=geo["VD"], rms_norm_eps=1e-5, rope_theta=500000.0, has_d2t=True,
        eagle_aux_hidden_state_layer_ids=[2, 16, 29]))
    own = single.random_params(registry.abstract_params("eagle3", cfg, dtype), jax.random.key(0))
    target = {"embed_tokens": {"embedding": (jax.random.normal(jax.random.key(1), (V, H), jnp.float32)
                                             * 0.02).astype(dtype)}}
    return registry.make_model("eagle3", cfg), share_target_weights(own, target), tuple(own)


def make_inputs(geo: dict, b: int, k: int, ctx: int, width: int, dtype, seed: int = 0):
    """benchmarks/proposers.py's batch: ``b`` requests, each a 1k-ish context and ``k + 1``
    target tokens, block table ``[b, width]`` over blocks ``0 .. b * width - 1``."""
    q = k + 1
    table = np.arange(b * width, dtype=np.int32).reshape(b, width)
    md = CommonAttentionMetadata.from_query_lens([q] * b, [ctx] * b, table, block_size=BS)
    pos = np.tile(np.arange(ctx - q, ctx, dtype=np.int32), b)
    rng = np.random.default_rng(seed)
    return ProposerInputs(
        target_token_ids=jnp.asarray(rng.integers(0, geo["V"], b * q), jnp.int32),
        target_positions=jnp.asarray(pos),
        target_hidden_states=None,
        aux_hidden_states=(jax.random.normal(jax.random.key(2 + seed), (b * q, 3, geo["H"]), jnp.float32)
                           .astype(dtype)),
        next_token_ids=jnp.asarray(rng.integers(0, geo["V"], b), jnp.int32),
        token_indices_to_sample=jnp.asarray(np.arange(1, b + 1) * q - 1, jnp.int32),
        num_rejected_tokens=jnp.zeros(b, jnp.int32),
        attn_metadata=md)


def time_calls(call, state, iters: int, warmup: int = 3):
    """``call(state) -> (out, state)``; returns (median latency s, pipelined s per call, out)."""
    for _ in range(warmup):
        out, state = call(state)
        jax.block_until_ready(out)
    lat = []
    for _ in range(iters):
        t0 = time.perf_counter()
        out, state = call(state)
        jax.block_until_ready(out)
        lat.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    for _ in range(iters):
        out, state = call(state)
    jax.block_until_ready((out, state))
    return statistics.median(lat), (time.perf_counter() - t0) / iters, out


def bytes_on(tree, device) -> int:
    """Bytes of ``tree``'s leaves held on ``device``."""
    return sum(s.data.nbytes for x in jax.tree.leaves(tree) for s in x.addressable_shards
               if s.device == device)


def floor_s(params, own_keys, state_kv_bytes: float, k: int, device) -> float:
    """Per-device floor: own weights on ``device`` read per forward (fc once) + K/V."""
    own = {key: params[key] for key in own_keys}
    w = bytes_on(own, device)
    fc = bytes_on(own["fc"], device)
    return ((w - fc) * k + fc + state_kv_bytes) / single.HBM_BPS


def kv_read_bytes(geo: dict, b: int, ctx: int, k: int, itemsize: int) -> float:
    """Cached K/V each propose reads in total (1 layer; k forwards over growing contexts)."""
    per_tok = 2 * geo["NKV"] * geo["HD"] * itemsize
    return float(sum(b * (ctx + i) * per_tok for i in range(k)))


_COLLECTIVE = re.compile(r"= ([^=]*?) (all-reduce|all-gather|reduce-scatter|all-to-all|"
                         r"collective-permute)(-start)?\(")


def collectives(compiled) -> list[list[str]]:
    """``[op, result type]`` of every collective in a compiled (partitioned) program."""
    return [[m.group(2), m.group(1).strip()] for m in _COLLECTIVE.finditer(compiled.as_text())]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--devices", default=None,
                    help="comma list of TP sizes (1 = single device); default 1,<all visible>")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--context", type=int, default=None, help="default 1024 (64 with --small)")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--local-argmax", choices=("on", "off", "both"), default="on")
    ap.add_argument("--dp", action="store_true", help="also data parallel over the batch")
    ap.add_argument("--dp-batches", default="64", help="batches split for --dp (default 64)")
    ap.add_argument("--dp-tp", action="store_true",
                    help="also DP x TP: each even device count n >= 4 as (n / 2) data-parallel "
                         "groups of tp=2 (local argmax on), on the --dp-batches")
    ap.add_argument("--small", action="store_true", help="a small head (smoke test, CPU)")
    ap.add_argument("--hlo", action="store_true",
                    help="also compile each multi-device program ahead of time and record its "
                         "collectives (one more compilation per row)")
    ap.add_argument("--out", default=None, help="write the rows as JSON here (after every row)")
    args = ap.parse_args(argv)

    devs = jax.devices()
    sizes = [int(s) for s in args.devices.split(",")] if args.devices else \
        sorted({1, len(devs)})
    if max(sizes) > len(devs) or min(sizes) < 1:
        raise SystemExit(f"--devices {sizes}: {len(devs)} device(s) visible")
    batches = [int(s) for s in args.batches.split(",")]
    dp_batches = [int(s) for s in args.dp_batches.split(",")] if args.dp or args.dp_tp else []
    flags = {"on": [True], "off": [False], "both": [True, False]}[args.local_argmax]
    geo = SMALL if args.small else FULL
    k = args.k
    ctx = args.context or (64 if args.small else 1024)
    dtype = jnp.bfloat16
    itemsize = jnp.dtype(dtype).itemsize

    model, params, own_keys = build_head(geo, dtype)
    own_bytes = sum(x.nbytes for key in own_keys for x in jax.tree.leaves(params[key]))
    from specjax.kernels import get_default_backend

    print(f"# attention backend {get_default_backend()} (SPECJAX_KERNEL_BACKEND); "
          f"jax {jax.__version__}, {len(devs)} x {devs[0].device_kind}; head "
          f"{'small' if args.small else '8B-shaped'} {own_bytes / 1e9:.3f} GB own weights, k={k}, "
          f"context {ctx}, TP sizes {sizes}{', DP' if args.dp else ''}")

    def width_for(c):
        w = -(-(c + k + 8) // BS)
        return 1 << (w - 1).bit_length()            # power-of-two context bucket (proposers.py)

    width = width_for(ctx)
    prop0 = EagleProposer(SpeculativeConfig(method="eagle3", num_speculative_tokens=k), model,
                          block_size=BS, max_model_len=width * BS, kernel_backend="xla")
    rows = []

    meta = dict(jax=jax.__version__, device_kind=devs[0].device_kind, num_devices=len(devs),
                attention_backend=get_default_backend(),
                geometry=geo, small=args.small, iters=args.iters, hbm_bps=single.HBM_BPS)

    def dump():
        if args.out:
            with open(args.out, "w") as f:
                json.dump(dict(meta=meta, rows=rows), f, indent=1)

    def record(mode, n, b, lat, pipe, floor, extra=None):
        r = dict(mode=mode, devices=n, batch=b, k=k, context=ctx, latency_ms=lat * 1e3,
                 pipelined_ms=pipe * 1e3, floor_per_device_ms=floor * 1e3, **(extra or {}))
        rows.append(r)
        print(f"{mode:>14} n={n} B={b:4d}  latency {r['latency_ms']:.3f} ms  pipelined "
              f"{r['pipelined_ms']:.3f} ms  floor/dev {r['floor_per_device_ms']:.3f} ms", flush=True)
        if "collectives" in r:
            counts = {}
            for op, _ in r["collectives"]:
                counts[op] = counts.get(op, 0) + 1
            print(f"{'':>14} collectives {counts}: {sorted({t for _, t in r['collectives']})}")
        dump()

    for b in batches:
        kv_total = kv_read_bytes(geo, b, ctx, k, itemsize)
        inputs = make_inputs(geo, b, k, ctx, width, dtype)
        reference = None
        for n in sizes:
            for flag in (flags if n > 1 else [False]):
                mesh = Mesh(np.array(devs[:n]), ("tp",))
                if n == 1:
                    prop = prop0
                    p = jax.device_put(params, devs[0])
                    state = jax.device_put(prop.init_state(b * width, dtype), devs[0])
                    inp = jax.device_put(inputs, devs[0])
                    kv_dev = kv_total
                else:
                    prop, p, state = tensor_parallel(prop0, params, prop0.init_state(b * width, dtype),
                                                     mesh, local_argmax=flag)
                    inp = jax.device_put(inputs, NamedSharding(mesh, P()))
                    kv_sharded = geo["NKV"] % n == 0
                    kv_dev = kv_total / n if kv_sharded else kv_total
                extra = {}
                if args.hlo and n > 1:
                    extra["collectives"] = collectives(
                        type(prop).propose.lower(prop, p, state, inp).compile())
                lat, pipe, out = time_calls(lambda s, p=p: prop.propose(p, s, inp), state, args.iters)
                drafts = np.asarray(out.token_ids)
                if n == 1:
                    reference = drafts
                elif reference is not None:   # same inputs, same number of calls: same drafts
                    extra["draft_agreement"] = float((drafts == reference).mean())   # up to bf16 ties
                mode = "single" if n == 1 else ("tp" + ("+local-argmax" if flag else ""))
                record(mode, n, b, lat, pipe, floor_s(p, own_keys, kv_dev, k, devs[0]), extra)
                del p, state

    def data_parallel(mode, n, dpp, dparams, kv_split):
        """Time ``dpp.propose`` on each ``--dp-batches`` batch split over its groups."""
        groups = dpp.size
        for b in dp_batches:
            if b % groups:
                print(f"# skip {mode} n={n} B={b}: not divisible")
                continue
            sub = b // groups
            states = dpp.stack([dpp.proposer.init_state(sub * width, dtype) for _ in range(groups)])
            inputs = dpp.stack([make_inputs(geo, sub, k, ctx, width, dtype, seed=i)
                                for i in range(groups)])
            extra = dict(per_device_batch=sub)
            if args.hlo:
                extra["collectives"] = collectives(
                    type(dpp).propose.lower(dpp, dparams, states, inputs).compile())
            lat, pipe, _ = time_calls(lambda s: dpp.propose(dparams, s, inputs), states, args.iters)
            kv_dev = kv_read_bytes(geo, sub, ctx, k, itemsize) / kv_split
            record(mode, n, b, lat, pipe, floor_s(dparams, own_keys, kv_dev, k, devs[0]), extra)
            del states

    for n in [s for s in sizes if s > 1] if args.dp else []:
        mesh = Mesh(np.array(devs[:n]), ("dp",))
        data_parallel("dp", n, DataParallel(prop0, mesh),
                      jax.device_put(params, NamedSharding(mesh, P())), 1)

    for n in [s for s in sizes if s >= 4 and s % 2 == 0] if args.dp_tp else []:
        mesh = Mesh(np.array(devs[:n]).reshape(n // 2, 2), ("dp", "tp"))
        tprop, tparams, _ = tensor_parallel(prop0, params, prop0.init_state(width, dtype), mesh)
        data_parallel("dp x tp2", n, DataParallel(tprop, mesh), tparams,
                      2 if geo["NKV"] % 2 == 0 else 1)

    one = {r["batch"]: r["pipelined_ms"] for r in rows if r["devices"] == 1}
    print("\n| mode | GPUs | B | latency ms | pipelined ms | floor / GPU ms | pipelined / floor "
          "| speed-up vs 1 GPU (pipelined) | drafts = 1 GPU's |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        su = one.get(r["batch"])
        r["speedup_vs_1"] = su / r["pipelined_ms"] if su else None
        speedup = "-" if su is None else f"{r['speedup_vs_1']:.2f}x"
        agree = f"{100 * r['draft_agreement']:.0f}%" if "draft_agreement" in r else "-"
        print(f"| {r['mode']} | {r['devices']} | {r['batch']} | {r['latency_ms']:.3f} | "
              f"{r['pipelined_ms']:.3f} | {r['floor_per_device_ms']:.3f} | "
              f"{r['pipelined_ms'] / r['floor_per_device_ms']:.2f}x | {speedup} | "
              f"{agree} |")
    dump()
    return rows


if __name__ == "__main__":
    main()

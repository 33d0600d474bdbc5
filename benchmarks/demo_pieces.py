"""Where a decoding iteration of ``specjax demo`` goes on the CPU: the demo's model passes
timed alone, in one process, interleaved (so load from other jobs hits every row alike).

Rows, for ``--batch`` B requests (default 1, the demo's default; 4: the demo's prompts in
one batch): the target's forward (+ logits + argmax, q/k/v and gate/up fused as the engine
runs them) over B rows (plain decoding) and over 4 B (the EAGLE-3 verify at k = 3), at
128- and 256-token contexts (8 and 16 blocks of 16); the EAGLE-3 head's first drafting pass
(4 B rows, through ``fc``) and a later one (B rows); and, with ``--products``, one matrix
product of the demo's widest shape (``[R, 256] @ [256, 768]``, R = 1, 4 and 16) chained in
a loop, and a 1024-cube product (the machine's matmul rate). Each figure is the min and the
median over ``--repeat`` rounds of one call of ``--iters`` passes inside a
``lax.fori_loop`` (no host round trip between passes), in ms per pass; the KV caches are
donated and carried from call to call, as the engine runs them. ``--width`` / ``--layers``
time the same passes with random weights at another hidden size / target depth (timing
only: what a larger demo model would cost on this machine).

Usage::

    python benchmarks/demo_pieces.py               # the model passes, one request
    python benchmarks/demo_pieces.py --batch 4     # the 4 demo prompts in one batch
    python benchmarks/demo_pieces.py --products    # and the matmul rates
    python benchmarks/demo_pieces.py --width 512 --layers 8   # a larger target and head

The figures (benchmarks/RESULTS.md; docs/demo.md) say why EAGLE-3 does not reach 1.5x plain decoding on 2 CPU
cores: batched, the products are compute-bound (the 16-row verify costs 1.7x the 4-row
step); one request at a time the verify's 4 rows cost ~1.3-1.6x one row, and each of the
head's passes a third to a half of the whole target step, so the model passes of an
EAGLE-3 iteration alone exceed what 1.5x allows.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from specjax.cli import demo  # noqa: E402
from specjax.attention_metadata import CommonAttentionMetadata  # noqa: E402
from specjax.models import fuse_projections  # noqa: E402

B, BS, NB = 1, demo.BLOCK_SIZE, 200     # B: --batch


def _metadata(q: int, blocks: int) -> CommonAttentionMetadata:
    """``B`` requests of ``q`` query tokens each over ``blocks`` blocks (contexts past the
    previous bucket, so the whole bucket is plausible)."""
    table = jnp.asarray(np.arange(B * blocks).reshape(B, blocks) + 1, jnp.int32)
    lo = (blocks // 2) * BS + 2
    seq = jnp.asarray([lo, lo + 11, lo + 20, lo + 3][:B], jnp.int32)
    qsl = jnp.arange(B + 1, dtype=jnp.int32) * q
    return CommonAttentionMetadata(qsl, seq, table, jnp.full((B * q,), 5, jnp.int32), jnp.int32(B),
                                   jnp.int32(B * q), jnp.max(seq), q)


def _scaled(target, head, width: int | None, layers: int | None):
    """The demo's target and EAGLE-3 head with random weights at ``width`` (hidden size;
    heads, head dim 64, the intermediate 3x as the demo's) and ``layers`` (the target's),
    None keeping the demo's: what a larger demo model's passes would cost (timing only)."""
    from specjax.engine import TargetModel
    from specjax.models import registry, share_target_weights

    if width is None and layers is None:
        return target, head.impl.model, head.params
    tm, _ = target
    hm = head.impl.model
    w = width or tm.config.hidden_size
    geo = dict(hidden_size=w, intermediate_size=3 * w, num_attention_heads=w // 64,
               num_key_value_heads=max(w // 128, 1), head_dim=64)
    tcfg = tm.config.replace(num_hidden_layers=layers or tm.config.num_hidden_layers, **geo)
    hcfg = hm.config.replace(target_hidden_size=w, **geo)
    target = TargetModel(registry.make_model(tcfg.kind, tcfg), registry.init_params(tcfg.kind, tcfg, 0))
    hm = registry.make_model(hcfg.kind, hcfg)
    return target, hm, share_target_weights(registry.init_params(hcfg.kind, hcfg, 1), target.params)


def _carried(run, params, caches, *args):
    """A call of ``run(params, caches, *args) -> (caches, out)`` (``caches`` donated) that
    feeds each call the caches the previous one returned; returns ``out``."""
    held = [caches]

    def call():
        held[0], out = run(params, held[0], *args)
        return out
    return call


def model_cases(iters: int, width: int | None = None, layers: int | None = None) -> dict:
    """Each pass in a ``lax.fori_loop`` of ``iters``, its KV caches donated and carried from
    call to call, as the engine runs them (an undonated cache is copied once per call:
    ~0.2-0.4 ms a call here, which the first version of this script counted per pass)."""
    target = demo.demo_target()
    head = demo.demo_proposer("eagle3", 3, target, max_model_len=demo.MAX_MODEL_LEN)
    target, hm, hp = _scaled(target, head, width, layers)
    tm, tp = target
    tp = fuse_projections(tp)                  # as the engine runs the target (its default)
    hp = fuse_projections(hp)

    def target_pass(q, blocks):
        md = _metadata(q, blocks)
        pos = jnp.full((B * q,), 100, jnp.int32)

        @functools.partial(jax.jit, donate_argnums=(1,))
        def run(p, caches, ids):
            def body(_, c):
                caches, ids = c
                h, _aux, caches = tm.forward(p, ids, pos, caches, md)
                return caches, jnp.argmax(tm.compute_logits(p, h), -1).astype(jnp.int32)
            return jax.lax.fori_loop(0, iters, body, (caches, ids))
        return _carried(run, tp, tm.init_kv_caches(NB, BS), jnp.zeros((B * q,), jnp.int32))

    def head_pass(q, blocks, first):
        md = _metadata(q, blocks)
        pos = jnp.full((B * q,), 100, jnp.int32)
        width = hm.config.num_aux * tm.config.hidden_size if first else hm.config.hidden_size

        @functools.partial(jax.jit, donate_argnums=(1,))
        def run(p, caches, ids, hid):
            def body(_, c):
                caches, ids, hid = c
                normed, pre, caches = hm.forward(p, ids, pos, hid, caches, md)
                ids = jnp.argmax(hm.compute_draft_logits(p, normed), -1).astype(jnp.int32)
                return caches, ids, (hid + 0 * pre.sum()) if first else pre
            caches, ids, _ = jax.lax.fori_loop(0, iters, body, (caches, ids, hid))
            return caches, ids
        return _carried(run, hp, hm.init_kv_caches(NB, BS), jnp.zeros((B * q,), jnp.int32),
                        jnp.full((B * q, width), 0.01, jnp.float32))

    r1, r4 = B, 4 * B
    return {
        f"target, {r1} rows, ctx 128 (plain)": target_pass(1, 8),
        f"target, {r1} rows, ctx 256": target_pass(1, 16),
        f"target, {r4} rows, ctx 128": target_pass(4, 8),
        f"target, {r4} rows, ctx 256 (EAGLE-3 verify)": target_pass(4, 16),
        f"EAGLE-3 head, {r4} rows + fc, ctx 256 (pass 1)": head_pass(4, 16, True),
        f"EAGLE-3 head, {r1} rows, ctx 256 (pass 2, 3)": head_pass(1, 16, False),
    }


def product_cases(iters: int) -> dict:
    rng = np.random.default_rng(0)
    out = {}
    for rows, k, n in ((1, 256, 768), (4, 256, 768), (16, 256, 768), (1024, 1024, 1024)):
        w = jnp.asarray(rng.standard_normal((k, n), dtype=np.float32) * 0.05)
        back = jnp.asarray(rng.standard_normal((n, k), dtype=np.float32) * 0.05)
        x = jnp.ones((rows, k), jnp.float32)

        @jax.jit
        def run(x, w, back):   # x @ w, then back to K wide (a second product, n x k)
            return jax.lax.fori_loop(0, iters, lambda _, x: jnp.tanh((x @ w) @ back), x)
        flop = 2 * 2 * rows * k * n
        out[f"[{rows}, {k}] @ [{k}, {n}] and back ({flop / 1e6:.1f} MFLOP)"] = (
            lambda run=run, x=x, w=w, back=back: run(x, w, back), flop)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=8, help="passes per timed call")
    ap.add_argument("--repeat", type=int, default=25, help="timed rounds (every row once each)")
    ap.add_argument("--products", action="store_true", help="also the matmul rates")
    ap.add_argument("--batch", type=int, choices=(1, 2, 3, 4), default=1,
                    help="requests per step (default 1, the demo's default)")
    ap.add_argument("--width", type=int, default=None,
                    help="random weights at this hidden size (a multiple of 128; timing only)")
    ap.add_argument("--layers", type=int, default=None,
                    help="random weights with this many target layers (timing only)")
    args = ap.parse_args(argv)
    if args.width is not None and (args.width <= 0 or args.width % 128):
        ap.error(f"--width must be a positive multiple of 128, got {args.width}")
    if args.layers is not None and args.layers <= 0:
        ap.error(f"--layers must be positive, got {args.layers}")
    global B
    B = args.batch
    cases = {k: (f, None) for k, f in model_cases(args.iters, args.width, args.layers).items()}
    if args.products:
        cases.update(product_cases(args.iters))
    for f, _ in cases.values():
        f().block_until_ready()            # compile
    times: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(args.repeat):
        for name, (f, _) in cases.items():
            t = time.perf_counter()
            f().block_until_ready()
            times[name].append((time.perf_counter() - t) / args.iters * 1e3)
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, load average "
          f"{' '.join(open('/proc/loadavg').read().split()[:3]) if os.path.exists('/proc/loadavg') else '?'}; "
          f"ms per pass, min / median of {args.repeat}")
    width = max(len(k) for k in cases)
    for name, (_, flop) in cases.items():
        lo, med = min(times[name]), statistics.median(times[name])
        rate = f"  {flop / lo / 1e6:.0f} GFLOP/s at the min" if flop else ""
        print(f"  {name:<{width}}  {lo:7.3f} / {med:7.3f}{rate}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

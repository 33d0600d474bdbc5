"""Time one ``propose`` of the EAGLE-3 proposer with a Llama-3.1-8B-shaped head.

Head: H 4096, I 14336, 32 / 8 heads (head_dim 128), 1 layer, target vocab 128256, draft
vocab 32000, random bf16 weights (timing does not depend on values). Each request carries a
1k-token context and a target batch of k + 1 = 4 tokens (one decode step verifying 3
drafts); k = 3 drafts are proposed: the first pass over the 4B tokens then 2 single-token
steps.

Floor = bytes that must move / 4.3 TB/s: every draft forward reads the layer weights and the
draft lm_head once (the first pass also reads fc), and each forward's attention reads each
request's cached K/V (1 layer, 8 KV heads x 128, bf16).

Tree drafting (``--tree "[(0,), (1,), (0, 0), (1, 0)]"``, repeatable): the first pass, then
one forward per further level over every node drafted so far (vLLM's ``propose_tree``); its
floor counts the weights once per level and each level's context plus nodes.

Every model-based method (``--methods eagle eagle3 dflash dspark medusa mtp draft_model
extract_hidden_states``): built as ``benchmarks/e2e.py`` builds them against an 8B-shaped
target (EAGLE-1 and Medusa read the target's full-vocabulary lm_head; the draft model is
Llama-3.2-1B-shaped); floor per method in ``method_case``.

Usage: python benchmarks/proposers.py [--batches 1,8,64] [--k 3] [--context 1024] [--tree T]
       [--methods M ...] [--json F]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import floors  # noqa: E402
from floors import HBM_BPS  # noqa: E402,F401  (re-exported: benchmarks/multi_gpu.py reads it)
from specjax.attention_metadata import CommonAttentionMetadata  # noqa: E402
from specjax.config import SpeculativeConfig  # noqa: E402
from specjax.models import registry, share_target_weights  # noqa: E402
from specjax.proposers.types import ProposerInputs  # noqa: E402
from specjax.proposers.eagle import EagleProposer  # noqa: E402

H, I, NH, NKV, HD, V, VD = 4096, 14336, 32, 8, 128, 128256, 32000
BS = 16


def random_params(abstract, key):
    leaves, tree = jax.tree_util.tree_flatten(abstract)
    keys = jax.random.split(key, len(leaves))
    out = []
    for k, a in zip(keys, leaves):
        if jnp.issubdtype(a.dtype, jnp.integer):
            out.append(jnp.zeros(a.shape, a.dtype))
        else:
            out.append((jax.random.normal(k, a.shape, jnp.float32) * 0.02).astype(a.dtype))
    return jax.tree_util.tree_unflatten(tree, out)


def eagle3_head(dtype=jnp.bfloat16):
    """``(model, params, head_weight_bytes, fc_bytes)`` of the 8B-shaped EAGLE-3 head (random
    weights; the target's embedding shared in)."""
    cfg = registry.config_from_hf("eagle3", dict(
        hidden_size=H, intermediate_size=I, num_attention_heads=NH, num_key_value_heads=NKV,
        head_dim=HD, num_hidden_layers=1, vocab_size=V, draft_vocab_size=VD, rms_norm_eps=1e-5,
        rope_theta=500000.0, has_d2t=True, eagle_aux_hidden_state_layer_ids=[2, 16, 29]))
    own = random_params(registry.abstract_params("eagle3", cfg, dtype), jax.random.key(0))
    target = {"embed_tokens": {"embedding": (jax.random.normal(jax.random.key(1), (V, H), jnp.float32)
                                             * 0.02).astype(dtype)}}
    params = share_target_weights(own, target)
    model = registry.make_model("eagle3", cfg)
    weight_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(own))
    fc_bytes = own["fc"]["kernel"].size * own["fc"]["kernel"].dtype.itemsize
    return model, params, weight_bytes, fc_bytes


def propose_case(model, b: int, k: int, ctx: int, *, tree: str | None = None, dtype=jnp.bfloat16,
                 **proposer_kwargs):
    """``(proposer, state, inputs)`` for ``b`` requests with ``ctx``-token contexts and a target
    batch of ``k + 1`` tokens each (one decode step verifying ``k`` drafts); ``tree``: a
    ``speculative_token_tree`` (then ``num_speculative_tokens`` = its node count)."""
    q = k + 1
    n_spec = k
    if tree is not None:
        from specjax.token_tree import TokenTree
        n_spec = TokenTree.from_choices(tree).num_nodes
    width = -(-(ctx + max(k, n_spec) + 8) // BS)
    width = 1 << (width - 1).bit_length()          # power-of-two context bucket
    num_blocks = b * width
    prop = EagleProposer(SpeculativeConfig(method="eagle3", num_speculative_tokens=n_spec,
                                           speculative_token_tree=tree), model,
                         block_size=BS, max_model_len=width * BS,
                         **{"kernel_backend": "xla", **proposer_kwargs})
    state = prop.init_state(num_blocks, dtype)
    table = np.arange(num_blocks, dtype=np.int32).reshape(b, width)
    md = CommonAttentionMetadata.from_query_lens([q] * b, [ctx] * b, table, block_size=BS)
    pos = np.tile(np.arange(ctx - q, ctx, dtype=np.int32), b)
    rng = np.random.default_rng(0)
    inputs = ProposerInputs(
        target_token_ids=jnp.asarray(rng.integers(0, V, b * q), jnp.int32),
        target_positions=jnp.asarray(pos),
        target_hidden_states=None,
        aux_hidden_states=(jax.random.normal(jax.random.key(2), (b * q, 3, H), jnp.float32)
                           .astype(dtype)),
        next_token_ids=jnp.asarray(rng.integers(0, V, b), jnp.int32),
        token_indices_to_sample=jnp.asarray(np.arange(1, b + 1) * q - 1, jnp.int32),
        num_rejected_tokens=jnp.zeros(b, jnp.int32),
        attn_metadata=md)
    return prop, state, inputs


def time_propose(prop, params, state, inputs, reps: int):
    """``(median latency s, pipelined s per call, state)``: ``reps`` calls each synced, then
    ``reps`` back-to-back calls synced once (after one compiling call)."""
    out, state = prop.propose(params, state, inputs)
    jax.block_until_ready(out)
    lat = []
    for _ in range(reps):
        t0 = time.perf_counter()
        out, state = prop.propose(params, state, inputs)
        jax.block_until_ready(out)
        lat.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    for _ in range(reps):
        out, state = prop.propose(params, state, inputs)
    jax.block_until_ready(out)
    return statistics.median(lat), (time.perf_counter() - t0) / reps, state


def method_case(models, method: str, b: int, k: int, ctx: int):
    """``(impl, params, state, inputs, floor_bytes)`` for ``method`` built like
    ``benchmarks/e2e.py`` builds it (8B-shaped target, random bf16 weights): ``b`` requests
    with ``ctx``-token contexts, a target batch of ``k + 1`` tokens each.

    Floor bytes: the draft's weights read once per forward (an embedding table only when it
    is also the lm_head; gathered rows are ignored; EAGLE-3's fc only in the first pass;
    Medusa: its first ``k`` heads), times the forwards of the method (chain methods: ``k``;
    DFlash, DSpark, Medusa: 1; DSpark's Markov ``W2`` once per slot), plus each
    forward's cached K/V of the draft's layers (extract-hidden-states: the aux states it
    stores).
    """
    from specjax.proposers.common import _hidden_widths

    q = k + 1
    width = -(-(ctx + 2 * k + 8) // BS)
    width = 1 << (width - 1).bit_length()
    mml = width * BS
    prop = models.proposer(method, 1 if method == "extract_hidden_states" else k, mml)
    impl, params = prop.impl, prop.params
    num_blocks = b * width
    state = impl.init_state(num_blocks, jnp.bfloat16)
    table = np.arange(num_blocks, dtype=np.int32).reshape(b, width)
    md = CommonAttentionMetadata.from_query_lens([q] * b, [ctx] * b, table, block_size=BS)
    rng = np.random.default_rng(0)
    h, aux = _hidden_widths(impl)
    key = jax.random.key(2)
    rand = lambda shape: (jax.random.normal(key, shape, jnp.float32)).astype(jnp.bfloat16)  # noqa: E731
    vocab = models.geo["vocab_size"] if models.geo else models.target.model.config.vocab_size
    inputs = ProposerInputs(
        target_token_ids=jnp.asarray(rng.integers(0, vocab, b * q), jnp.int32),
        target_positions=jnp.asarray(np.tile(np.arange(ctx - q, ctx, dtype=np.int32), b)),
        target_hidden_states=None if h is None else rand((b * q, h)),
        aux_hidden_states=None if aux is None else rand((b * q, *aux)),
        next_token_ids=jnp.asarray(rng.integers(0, vocab, b), jnp.int32),
        token_indices_to_sample=jnp.asarray(np.arange(1, b + 1) * q - 1, jnp.int32),
        num_rejected_tokens=jnp.zeros(b, jnp.int32),
        attn_metadata=md)
    # -- floor
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    names = [(jax.tree_util.keystr(p), x) for p, x in leaves]
    has_head = any(n.startswith("['lm_head") for n, _ in names)     # lm_head or Medusa's lm_heads
    weight = sum(x.size * x.dtype.itemsize for n, x in names
                 if jnp.issubdtype(x.dtype, jnp.floating)
                 and not (n.startswith("['embed_tokens']") and has_head))
    fc = sum(x.size * x.dtype.itemsize for n, x in names if n.startswith("['fc']"))
    cache = jax.tree.leaves(state)
    kv_tok = sum(x.shape[2] * x.shape[3] * x.dtype.itemsize for x in cache if x.ndim == 4)
    if method in ("eagle", "eagle3", "mtp", "draft_model"):
        first_fc = fc if method == "eagle3" else 0       # EAGLE-1's fc (MTP's input_proj) runs every step
        floor = floors.chain_bytes(weight - first_fc, kv_tok, b, [ctx + i for i in range(k)],
                                   once_bytes=first_fc)
    elif method == "extract_hidden_states":
        floor = b * q * aux[0] * aux[1] * 2               # the stored aux states (bf16)
    else:                                        # one forward: dflash, dspark(-topN), medusa
        if method == "medusa":                            # only heads 0 .. k-1 run
            weight = weight * k // impl.model.config.num_heads
        if method == "dspark":                            # W1: rows gathered; W2 read per slot
            # (dspark-topN gathers N rows of W2 per slot: counted as none)
            w1 = sum(x.size * x.dtype.itemsize for n, x in names if "markov_w1" in n)
            w2 = sum(x.size * x.dtype.itemsize for n, x in names if "markov_w2" in n)
            weight += (k - 1) * w2 - w1
        elif method.startswith("dspark-top"):
            weight -= sum(x.size * x.dtype.itemsize for n, x in names
                          if "markov_w1" in n or "markov_w2" in n)
        floor = floors.floor_bytes(weight, kv_tok, b, ctx, q)
    return impl, params, state, inputs, floor


def all_methods(args) -> list[dict]:
    """Every model-based method at each batch size (``--methods``)."""
    from e2e import Models

    models = Models(args.target, jnp.bfloat16)
    rows = []
    print("| method | B | k | latency ms | pipelined ms | floor ms | pipelined / floor |")
    print("|---|---|---|---|---|---|---|", flush=True)
    for m in args.methods:
        for b in [int(x) for x in args.batches.split(",")]:
            impl, params, state, inputs, floor_b = method_case(models, m, b, args.k, args.context)
            lat, pipe, state = time_propose(impl, params, state, inputs, args.reps)
            del state
            kk = 1 if m == "extract_hidden_states" else args.k
            r = dict(method=m, batch=b, k=kk, context=args.context, latency_ms=lat * 1e3,
                     pipelined_ms=pipe * 1e3, floor_ms=floors.floor_ms(floor_b))
            rows.append(r)
            print(f"| {m} | {b} | {kk} | {r['latency_ms']:.3f} | {r['pipelined_ms']:.3f} | "
                  f"{r['floor_ms']:.3f} | {r['pipelined_ms'] / r['floor_ms']:.2f}x |", flush=True)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--tree", action="append", default=None,
                    help="also time tree drafting with this speculative_token_tree (repeatable)")
    ap.add_argument("--target", choices=("8b", "1b"), default="8b",
                    help="with --methods: the target shape the drafts are built for")
    ap.add_argument("--methods", nargs="+", default=None,
                    help="time these methods instead (eagle eagle3 dflash dspark medusa mtp draft_model "
                         "extract_hidden_states), built as benchmarks/e2e.py builds them")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.methods:
        rows = all_methods(args)
        if args.json:
            json.dump(rows, open(args.json, "w"), indent=1)
        return rows
    k, ctx = args.k, args.context
    dtype = jnp.bfloat16
    model, params, weight_bytes, fc_bytes = eagle3_head(dtype)
    print(f"# jax {jax.__version__}, {jax.devices()[0].device_kind}; head weights {weight_bytes / 1e9:.3f} GB "
          f"(fc {fc_bytes / 1e9:.3f} GB), k={k}, context {ctx}")
    rows = []
    kv_read = 2 * NKV * HD * 2                      # K and V, bf16, per token, one layer
    for b in [int(s) for s in args.batches.split(",")]:
        prop, state, inputs = propose_case(model, b, k, ctx, dtype=dtype)
        lat, pipe, state = time_propose(prop, params, state, inputs, args.reps)
        del state
        floor = floors.chain_bytes(weight_bytes - fc_bytes, kv_read, b, [ctx + i for i in range(k)],
                                   once_bytes=fc_bytes)
        r = dict(batch=b, k=k, context=ctx, latency_ms=lat * 1e3,
                 pipelined_ms=pipe * 1e3, floor_ms=floors.floor_ms(floor))
        rows.append(r)
        print(f"B={b:4d}  latency {r['latency_ms']:.3f} ms  pipelined {r['pipelined_ms']:.3f} ms  "
              f"floor {r['floor_ms']:.3f} ms  ({r['pipelined_ms'] / r['floor_ms']:.2f}x)", flush=True)
        for tree in args.tree or ():
            from specjax.token_tree import TokenTree
            t = TokenTree.from_choices(tree)
            prop, state, inputs = propose_case(model, b, k, ctx, tree=tree, dtype=dtype)
            lat, pipe, state = time_propose(prop, params, state, inputs, args.reps)
            del state
            # first pass + one forward per further level over every node so far
            floor = floors.chain_bytes(weight_bytes - fc_bytes, kv_read, b,
                                       [ctx + 1] + [ctx + n for n in t.cu_level_sizes[:-1]],
                                       once_bytes=fc_bytes)
            r = dict(batch=b, k=k, context=ctx, tree=tree, nodes=t.num_nodes, depth=t.depth,
                     latency_ms=lat * 1e3, pipelined_ms=pipe * 1e3, floor_ms=floors.floor_ms(floor))
            rows.append(r)
            print(f"B={b:4d}  tree {tree} ({t.num_nodes} nodes, depth {t.depth})  latency "
                  f"{r['latency_ms']:.3f} ms  pipelined {r['pipelined_ms']:.3f} ms  floor "
                  f"{r['floor_ms']:.3f} ms  ({r['pipelined_ms'] / r['floor_ms']:.2f}x)", flush=True)
    if args.json:
        json.dump(rows, open(args.json, "w"), indent=1)
    return rows


if __name__ == "__main__":
    main()

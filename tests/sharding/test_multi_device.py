"""Multi-device proposers (``specjax.sharding``): tensor parallel over a ``"tp"`` mesh axis
and data parallel over requests give the single-device drafts, for chain drafting and
for EAGLE / EAGLE-3 tree drafting and parallel drafting (P-EAGLE).

The multi-device cases run in subprocesses with fake CPU devices
(``--xla_force_host_platform_device_count``; this process has already initialised JAX
with one), started together so that they overlap (the pattern of test_local_argmax.py).
The sharding rules themselves need no devices and run here.

Tolerances. Drafts must be *equal*. The KV caches are compared with ``assert_allclose``
(rtol = atol = 1e-5, float32): under TP, o_proj / down_proj are row-parallel, so each
device sums its slice of the contraction and an all-reduce adds the slices: a different
summation order than one device's dot, hence ~1e-7 relative rounding per product that
flows into the next step's K/V (measured max |diff| ~1e-6 on values of order 1). The
tiny random models' top-2 logit margins are far larger than that, so greedy drafts match
exactly (the logits themselves are also compared, with the same tolerance). Data
parallelism runs the same single-device program per shard: drafts and caches are equal.
"""

import suite_paths  # tests/support: where the suite's pieces are
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from specjax.models import registry
from specjax.sharding import param_specs, state_specs

ROOT = str(suite_paths.ROOT)

#: XLA:CPU with little LLVM optimisation: compiling is most of these tests' time, and the
#: reference and the sharded runs share the flags.
FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"

PRELUDE = """
import os
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count={n} {fast}"
os.environ["JAX_PLATFORMS"] = "cpu"
import dataclasses, re
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
assert len(jax.devices()) == {n}, jax.devices()
DEV = np.array(jax.devices())
"""

#: (method, tp size, use_local_argmax_reduction) per subprocess. EAGLE and EAGLE-3 each at
#: {2, 4} x {on, off} once between them; the draft model, DFlash and MTP once each. The tiny
#: models have 2 kv heads: at tp=4 attention and caches stay replicated (MLP / vocab split).
TP_CASES = [("eagle", 2, True), ("eagle", 4, False), ("eagle3", 2, False), ("eagle3", 4, True)]
TP_CASES_MORE = [("dflash", 2, True), ("draft_model", 4, False), ("mtp", 2, True)]

#: Shared by the tensor-parallel subprocess bodies.
TP_HELPERS = """
from specjax.sharding import DataParallel, param_specs, state_specs, tensor_parallel
from test_proposers_warmup import BUCKETS, NUM_BLOCKS, build, make_inputs, _tuple

def close(got, want, what):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5, err_msg=what)

def collectives(hlo):
    # (op, element count) of every collective in the partitioned program
    out = []
    for m in re.finditer(r"= (\\w+)\\[([\\d,]*)\\][^ ]* (all-reduce|all-gather|reduce-scatter|"
                         r"all-to-all|collective-permute)(-start)?\\(", hlo):
        out.append((m.group(3), int(np.prod([int(d) for d in m.group(2).split(",") if d]))))
    return out

def run_and_compare(compiled, sp, ss, batches, want, want_state, sspecs, mesh, what):
    # run compiled on each batch (state carried): drafts equal one device's, outputs
    # replicated, the state sharded as declared and, at the end, equal to one device's
    for i, inp in enumerate(batches):
        out, ss = compiled(sp, ss, inp)
        np.testing.assert_array_equal(out.token_ids, want[i].token_ids, err_msg=what)
        np.testing.assert_array_equal(out.num_drafts, want[i].num_drafts, err_msg=what)
        assert out.token_ids.sharding.is_fully_replicated, what
        for x, s in zip(jax.tree.leaves(ss), jax.tree.leaves(sspecs, is_leaf=lambda x: isinstance(x, P))):
            assert x.sharding.is_equivalent_to(NamedSharding(mesh, s), x.ndim), (what, x.sharding)
    close(ss, want_state, what)
    return ss
"""

TP_BODY = TP_HELPERS + """
bucket = _tuple(BUCKETS[1])
rng = np.random.default_rng(11)
for method in dict.fromkeys(m for m, _, _ in CASES):
    prop, params = build(method)
    batches = [make_inputs(method, bucket, n, rng) for n in (4, 2)]
    want, state = [], prop.init_state(NUM_BLOCKS)
    for inp in batches:                     # two calls, the state carried (donated) between
        out, state = prop.propose(params, state, inp)
        want.append(out)
    want_state = state
    for m, n, flag in CASES:
        if m != method:
            continue
        what = f"{method} tp={n} local_argmax={flag}"
        mesh = Mesh(DEV[:n], ("tp",))
        p, sp, ss = tensor_parallel(prop, params, prop.init_state(NUM_BLOCKS), mesh, local_argmax=flag)
        assert p.mesh is mesh and p.vocab_axis == "tp" and p.config.use_local_argmax_reduction == flag
        cfg = prop.model.config
        # params / state are placed as declared, and big weights really are split
        specs = param_specs(params, cfg, n)
        for x, s in zip(jax.tree.leaves(sp), jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))):
            assert x.sharding.is_equivalent_to(NamedSharding(mesh, s), x.ndim), (what, x.sharding, s)
        head = sp["lm_head"]["kernel"]
        assert head.sharding.spec == P(None, "tp"), what
        assert head.addressable_shards[0].data.shape == (head.shape[0], head.shape[1] // n), what
        gate = sp["layers"][0]["mlp"]["gate_proj"]["kernel"]
        assert gate.addressable_shards[0].data.shape == (gate.shape[0], gate.shape[1] // n), what
        kv_split = cfg.num_key_value_heads % n == 0
        q = sp["layers"][0]["self_attn"]["q_proj"]["kernel"]
        assert q.addressable_shards[0].data.shape == (q.shape[0], q.shape[1] // (n if kv_split else 1))
        sspecs = state_specs(ss, n)
        cache_spec = P(None, None, "tp", None) if kv_split else P()
        assert jax.tree.leaves(sspecs, is_leaf=lambda x: isinstance(x, P))[0] == cache_spec, what
        # one compilation: the partitioned program is inspected, then run twice
        compiled = type(p).propose.lower(p, sp, ss, batches[0]).compile()
        coll = collectives(compiled.as_text())
        assert any(op == "all-reduce" for op, _ in coll), (what, coll)     # row-parallel sums
        # Only the row-parallel all-reduces move more than argmax pairs (DFlash's context K/V
        # precompute keeps each kernel's split: no kernel slices move between devices).
        big = [c for c in coll if c[0] != "all-reduce" and c[1] > 64]
        assert not big, f"{what}: something larger than argmax pairs is gathered: {big}"
        if flag:
            assert not any(op == "all-gather" for op, _ in coll), (what, coll)
        ss = run_and_compare(compiled, sp, ss, batches, want, want_state, sspecs, mesh, what)
        # the vocab-sharded head gives the same logits
        h = jnp.asarray(rng.standard_normal((5, cfg.hidden_size)), jnp.float32)
        logits = prop.model.compute_draft_logits if method == "eagle3" else prop.model.compute_logits
        close(jax.jit(logits)(sp, h), logits(params, h), what + " logits")
        print("tp ok", what, flush=True)

    if method == "eagle3":   # data parallel: 2 shards of the same bucket, each its own batch and cache
        dp = DataParallel(prop, Mesh(DEV[:2], ("dp",)))
        outs, states = dp.propose(params, dp.stack([prop.init_state(NUM_BLOCKS)] * 2),
                                  dp.stack(batches))
        assert outs.token_ids.shape == (2,) + want[0].token_ids.shape
        assert outs.token_ids.sharding.spec == P("dp")
        for i in range(2):
            single, single_state = prop.propose(params, prop.init_state(NUM_BLOCKS), batches[i])
            got = dp.unstack(outs)[i]
            np.testing.assert_array_equal(got.token_ids, single.token_ids)
            np.testing.assert_array_equal(got.num_drafts, single.num_drafts)
            for a, b in zip(jax.tree.leaves(dp.unstack(states)[i]), jax.tree.leaves(single_state)):
                np.testing.assert_array_equal(a, b)
        print("dp ok", flush=True)
        # DP x TP on a (2, 2) mesh: each dp group runs the tp=2 proposer (local argmax on)
        mesh2 = Mesh(DEV.reshape(2, 2), ("dp", "tp"))
        p2, sp2, _ = tensor_parallel(prop, params, prop.init_state(NUM_BLOCKS), mesh2)
        dp2 = DataParallel(p2, mesh2)
        states2 = dp2.stack([p2.init_state(NUM_BLOCKS)] * 2)
        cache = jax.tree.leaves(states2)[0]
        assert cache.sharding.is_equivalent_to(
            NamedSharding(mesh2, P("dp", None, None, "tp", None)), cache.ndim), cache.sharding
        inputs2 = dp2.stack(batches)
        compiled = type(dp2).propose.lower(dp2, sp2, states2, inputs2).compile()
        coll = collectives(compiled.as_text())
        assert any(op == "all-reduce" for op, _ in coll), coll
        assert not [c for c in coll if c[0] != "all-reduce" and c[1] > 64], coll
        outs2, states2 = compiled(sp2, states2, inputs2)
        for i in range(2):
            single, single_state = prop.propose(params, prop.init_state(NUM_BLOCKS), batches[i])
            got = dp2.unstack(outs2)[i]
            np.testing.assert_array_equal(got.token_ids, single.token_ids)
            np.testing.assert_array_equal(got.num_drafts, single.num_drafts)
            close(dp2.unstack(states2)[i], single_state, f"dp x tp shard {i}")
        cache = jax.tree.leaves(states2)[0]
        assert cache.sharding.is_equivalent_to(
            NamedSharding(mesh2, P("dp", None, None, "tp", None)), cache.ndim), cache.sharding
        print("dp x tp ok", flush=True)
"""


#: (method, drafting mode, tp size, use_local_argmax_reduction) per tree / parallel case:
#: EAGLE-3 tree drafting and parallel drafting (P-EAGLE) each at {2, 4} x {off, on} once
#: between them (tp=4: attention and caches replicated), an EAGLE-1 tree once.
TP_TREE_PARALLEL_CASES = [("eagle3", "tree", 2, False), ("eagle3", "tree", 4, True),
                          ("eagle", "tree", 2, True),
                          ("eagle3", "parallel", 2, True), ("eagle3", "parallel", 4, False)]

#: The warmup module's tiny heads (2 kv heads, float32), switched to a branching tree
#: (``2-1-2`` of test_proposers_eagle_tree: top-2 at levels 1 and 3, the greedy argmax at
#: level 2, 8 nodes) or to parallel drafting (k = 4, a ``mask_hidden`` in the params).
#: Same checks as TP_BODY: the [B_pad, num_nodes] / [B_pad, k] drafts of two calls on
#: ragged batches with padding rows (the state carried) equal one device's, the states stay
#: sharded as declared and, gathered to the host, match one device's caches.
TP_TREE_PARALLEL_BODY = TP_HELPERS + """
from specjax.config import SpeculativeConfig
from specjax.token_tree import TokenTree
from test_proposers_eagle_parallel import _with_mask
from test_proposers_eagle_tree import TREES

def variant(method, mode):
    prop, params = build(method)
    if mode == "tree":
        tree = TREES["2-1-2"]
        cfg = SpeculativeConfig(method=method, speculative_token_tree=tree,
                                num_speculative_tokens=TokenTree.from_choices(tree).num_nodes)
        return dataclasses.replace(prop, config=cfg), params
    cfg = SpeculativeConfig(method=method, num_speculative_tokens=4, parallel_drafting=True)
    params = _with_mask(method, params, "ckpt")
    # scaled down, the mask slots' drafts differ between requests and slots (at full
    # scale mask_hidden dominates and they are all one token)
    params = dict(params, mask_hidden=0.1 * params["mask_hidden"])
    return dataclasses.replace(prop, config=cfg, parallel_drafting_token_id=7), params

bucket = _tuple(BUCKETS[1])
rng = np.random.default_rng(12)
for method, mode in dict.fromkeys((m, mode) for m, mode, _, _ in CASES):
    prop, params = variant(method, mode)
    k = prop.num_speculative_tokens
    if mode == "tree":
        assert not prop.token_tree.is_chain and k == prop.token_tree.num_nodes == 8
    else:
        assert prop.num_new_slots_per_request == k - 1 and "mask_hidden" in params
    batches = [make_inputs(method, bucket, n, rng) for n in (3, 2)]
    want, state = [], prop.init_state(NUM_BLOCKS)
    for inp, n in zip(batches, (3, 2)):
        out, state = prop.propose(params, state, inp)
        ids = np.asarray(out.token_ids)
        assert ids.shape == (bucket[0], k) and (ids[n:] == -1).all() and (ids[:n] >= 0).all()
        assert len(np.unique(ids[:n])) > 2, ids      # not a degenerate draft
        want.append(out)
    want_state = state
    mc = prop.model.config
    vocab = (mc.draft_vocab_size or mc.vocab_size) if method == "eagle3" else mc.vocab_size
    # Tree levels with c > 1 children take jax.lax.top_k of the vocabulary-sharded logits.
    # Without use_local_argmax_reduction those rows' logits are gathered (vLLM's
    # propose_tree gathers them too). With it, greedy levels / slots reduce argmax pairs
    # and top-k levels gather only each shard's (value, global index) top-c candidates
    # (greedy_top_k): at most rows x c x shards elements per gather, two gathers per level.
    # topk_rows: the most rows of one top-k level (B_pad x the nodes of the level above).
    tree = prop.token_tree
    sizes, children = (1,) + tree.level_sizes, tree.children_per_level
    topk = [sizes[lvl] for lvl in range(tree.depth) if children[lvl] > 1] if mode == "tree" else []
    topk_rows = bucket[0] * max(topk, default=0)
    topk_c = max((cc for cc in children if cc > 1), default=0) if mode == "tree" else 0
    for m, mo, n, flag in CASES:
        if (m, mo) != (method, mode):
            continue
        what = f"{method} {mode} tp={n} local_argmax={flag}"
        mesh = Mesh(DEV[:n], ("tp",))
        p, sp, ss = tensor_parallel(prop, params, prop.init_state(NUM_BLOCKS), mesh, local_argmax=flag)
        assert p.token_tree == prop.token_tree and p.config.parallel_drafting == (mode == "parallel")
        assert sp["lm_head"]["kernel"].sharding.spec == P(None, "tp"), what
        if mode == "parallel":
            assert sp["mask_hidden"].sharding.is_fully_replicated, what
        sspecs = state_specs(ss, n)
        compiled = type(p).propose.lower(p, sp, ss, batches[0]).compile()
        coll = collectives(compiled.as_text())
        assert any(op == "all-reduce" for op, _ in coll), (what, coll)
        if flag:    # rows x c x shards (value, index) candidates of a top-k level
            limit = topk_rows * min(topk_c, vocab // n) * n
            gathers = [size for op, size in coll if op == "all-gather"]
            assert len(gathers) <= 2 * len(topk), (what, coll)
            assert all(size <= limit for size in gathers), (what, limit, coll)
        else:       # those rows' full logits
            limit = topk_rows * vocab
        big = [c for c in coll if c[0] != "all-reduce" and c[1] > max(64, limit)]
        assert not big, f"{what}: more than argmax pairs / top-k candidates (logits without the local reduction) is gathered: {big}"
        ss = run_and_compare(compiled, sp, ss, batches, want, want_state, sspecs, mesh, what)
        print("tp ok", what, flush=True)
"""


#: (method, tp size, use_local_argmax_reduction): the reference loop with ``mesh=``.
ENGINE_TP_CASES = [("eagle3", 2, True), ("eagle3-tree", 2, True), ("draft_model", 4, False),
                   ("ngram", 2, False)]

ENGINE_TP_BODY = """
from specjax.engine import Engine
from specjax.sharding import state_specs
from test_engine import FIXED, PARAMS_B, PROMPTS_B, build, target

def placed_as(tree, n, mesh, what):
    specs = jax.tree.leaves(state_specs(tree, n), is_leaf=lambda v: isinstance(v, P))
    for x, s in zip(jax.tree.leaves(tree), specs, strict=True):
        assert x.sharding.is_equivalent_to(NamedSharding(mesh, s), x.ndim), (what, x.sharding, s)

for method, n, flag in CASES:
    mesh = Mesh(DEV[:n], ("tp",))
    extra = dict(use_local_argmax_reduction=True) if flag else {}
    if method.endswith("-tree"):     # tree verification: the accepted path's KV compacted
        extra["speculative_token_tree"] = [(0,), (1,), (0, 0), (1, 0)]
    prop = build(method.split("-")[0], 4 if "tree" in method else 3, **extra)
    kw = dict(FIXED, max_num_seqs=3)
    want = Engine(target(), prop, **kw).generate(PROMPTS_B, PARAMS_B)
    eng = Engine(target(), prop, mesh=mesh, **kw)
    got = eng.generate(PROMPTS_B, PARAMS_B)
    what = f"{method} tp={n} local_argmax={flag}"
    assert (eng.tree is not None) == method.endswith("-tree"), what
    assert got.token_ids == want.token_ids, what
    assert got.spec_stats.num_accepted_tokens == want.spec_stats.num_accepted_tokens, what
    # the caches stay where they were put through every step; the weights are split
    placed_as(eng.target_kv, n, mesh, what)
    if eng.draft_state is not None:
        placed_as(eng.draft_state, n, mesh, what)
    # no KV-cache-shaped all-gather inside the step ([num_blocks, ...] or [slots, ...])
    hlo = eng.diagnostics.lower_decode_step(3, 20).compile().as_text()
    nb = FIXED["num_blocks"]
    gathers = re.findall(r"= \\w+\\[([\\d,]*)\\][^ ]* all-gather(?:-start)?\\(", hlo)
    big = [g for g in gathers if g.split(",")[0] in (str(nb), str(nb * FIXED["block_size"]))]
    assert not big, (what, big)
    gate = eng.target.params["layers"][0]["mlp"]["gate_proj"]["kernel"]
    assert gate.sharding.is_equivalent_to(NamedSharding(mesh, P(None, "tp")), 2), what
    if prop.params is not None:   # a placed copy; the caller's proposer is left as it was
        assert eng.proposer is not prop and getattr(prop.impl, "mesh", None) is None
        assert getattr(eng.proposer.impl, "mesh", mesh) is mesh
    print("engine tp ok", what, flush=True)

# bad meshes are refused by name before anything is placed
try:
    Engine(target(), None, mesh=Mesh(DEV[:2], ("x",)), **dict(FIXED, max_num_seqs=4))
    raise SystemExit("no error")
except ValueError as e:
    assert "tp_axis 'tp' is not an axis of the mesh" in str(e), e
try:
    Engine(target(), None, mesh=Mesh(DEV[:3], ("tp",)), **dict(FIXED, max_num_seqs=4))
    raise SystemExit("no error")
except ValueError as e:
    assert "not divisible by 3" in str(e), e
print("engine tp errors ok", flush=True)
"""


#: The Pallas attention kernel (interpret mode on CPU) under SPMD partitioning
#: (``kernels/paged_attention/partition.py``'s ``custom_partitioning`` wrapper), called through ``attend`` --
#: with the cache write fused into the kernel and without -- inside one ``jax.jit`` between
#: XLA ops (causal, and at tp = 2 non-causal and tree masks): per-shard results
#: bit-identical to one device's; with the caches split by kv
#: heads (tp = 2 and 4, GQA groups 2 and 1) or replicated, and inside a ``shard_map`` over
#: ``dp`` of a (dp, tp) mesh, the partitioned program has no collective at all (each device
#: attends over its own heads and its own cache shard), and the caches stay as placed.
#: Operand shardings other than the kv-head split run the call whole on every device.
ATTN_BODY = """
from specjax.attention_metadata import CommonAttentionMetadata
from specjax.kernels import default_backend, paged_attention as attn
from jax.sharding import NamedSharding as NS

rng = np.random.default_rng(5)
HD, NB, BS, T = 16, 24, 4, 8
# ragged: a decode row, a 3-token row, an empty request, a 2-token row; 2 padding tokens
md = CommonAttentionMetadata.from_query_lens([1, 3, 0, 2], [5, 9, 0, 3],
                                             rng.permutation(NB)[:16].reshape(4, 4), block_size=BS,
                                             num_reqs_pad=4, num_tokens_pad=T, max_query_len=4)
f32 = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)

def make_step(fused):
    def step(q, k, v, kc, vc, md):
        out, c = attn.attend(jnp.sin(q), k, v, attn.KVCache(kc, vc), md, scale=0.25,
                             fused_kv_write=fused)
        return 2 * out, c.k, c.v
    return step

def same(got, want, what):
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=what)

def no_collectives(compiled, what):
    hlo = compiled.as_text()
    found = re.findall(r"(all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)", hlo)
    assert not found, (what, found)

for nh, nkv in ((4, 2), (4, 4)):
    args = (f32(T, nh, HD), f32(T, nkv, HD), f32(T, nkv, HD), f32(NB, BS, nkv, HD), f32(NB, BS, nkv, HD))
    for fused in (False, True):
        step = make_step(fused)
        with default_backend("pallas"):
            want = jax.jit(step)(*args, md)
            for n, axis in ((2, "tp"), (4, "tp"), (2, None)):
                if axis and nkv % n:
                    continue
                what = f"nh={nh} nkv={nkv} fused={fused} n={n} axis={axis}"
                mesh = Mesh(DEV[:n], ("tp",))
                heads, caches = NS(mesh, P(None, axis, None)), NS(mesh, P(None, None, axis, None))
                placed = [jax.device_put(x, s) for x, s in zip(args, [heads] * 3 + [caches] * 2)]
                md_r = jax.device_put(md, NS(mesh, P()))
                compiled = jax.jit(step).lower(*placed, md_r).compile()
                if axis:
                    no_collectives(compiled, what)
                got = compiled(*placed, md_r)
                same(got, want, what)
                assert got[1].sharding.is_equivalent_to(caches, 4), (what, got[1].sharding)
                print("attn ok", what, flush=True)
            # (dp, tp) mesh: a shard_map over dp, tp left to the partitioner
            if nkv % 2 == 0:
                mesh = Mesh(DEV.reshape(2, 2), ("dp", "tp"))
                two = [jnp.stack([x, x[::-1]]) for x in args]
                want2 = [jax.jit(step)(*[x[i] for x in two], md) for i in range(2)]
                def local(*xs):
                    return tuple(y[None] for y in step(*[x[0] for x in xs], md))
                fn = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=P("dp"), out_specs=P("dp"),
                                           axis_names={"dp"}, check_vma=False))
                specs = [P("dp", None, "tp", None)] * 3 + [P("dp", None, None, "tp", None)] * 2
                placed = [jax.device_put(x, NS(mesh, s)) for x, s in zip(two, specs)]
                compiled = fn.lower(*placed).compile()
                what = f"nh={nh} nkv={nkv} fused={fused} dp x tp"
                no_collectives(compiled, what)
                got = compiled(*placed)
                for i in range(2):
                    same([g[i] for g in got], want2[i], what)
                assert got[1].sharding.is_equivalent_to(NS(mesh, specs[3]), 5), what
                print("attn ok", what, flush=True)

# non-causal (DFlash) and tree masks: the static arguments pass through the partitioning
TREE = ((True, False, False, False), (True, True, False, False), (True, False, True, False),
        (True, True, False, True))
args = (f32(T, 4, HD), f32(T, 2, HD), f32(T, 2, HD), f32(NB, BS, 2, HD), f32(NB, BS, 2, HD))
mesh = Mesh(DEV[:2], ("tp",))
heads, caches = NS(mesh, P(None, "tp", None)), NS(mesh, P(None, None, "tp", None))
placed = [jax.device_put(x, s) for x, s in zip(args, [heads] * 3 + [caches] * 2)]
for name, mdv in (("noncausal", md.replace(causal=False)), ("tree", md.replace(tree_mask=TREE))):
    for fused in (False, True):
        step = make_step(fused)
        with default_backend("pallas"):
            want = jax.jit(step)(*args, mdv)
            compiled = jax.jit(step).lower(*placed, jax.device_put(mdv, NS(mesh, P()))).compile()
            what = f"{name} fused={fused} tp=2"
            no_collectives(compiled, what)
            same(compiled(*placed, jax.device_put(mdv, NS(mesh, P()))), want, what)
            print("attn ok", what, flush=True)

# the partition callback itself: the kv-head split passes through, anything else replicates
mesh = Mesh(DEV[:2], ("tp",))
sds = lambda shape, spec, dt=jnp.float32: jax.ShapeDtypeStruct(shape, dt, sharding=NS(mesh, spec))
partition = attn.partition._partition(False)
static = attn.partition.static("pallas", md, 0.25)
ints = [sds((5,), P(), jnp.int32), sds((4,), P(), jnp.int32), sds((4, 4), P(), jnp.int32)]
for cache_spec, q_spec, split in ((P(None, None, "tp"), P(None, "tp"), True),
                                  (P("tp"), P(), False),                 # blocks split
                                  (P(None, None, "tp"), P(), False)):     # q whole, caches split
    arg_shapes = [sds((T, 4, HD), q_spec)] + [sds((NB, BS, 2, HD), cache_spec)] * 2 + ints
    _, impl, out_sh, arg_sh = partition(static, mesh, arg_shapes, sds((T, 4, HD), q_spec))
    if split:
        assert [s.spec for s in arg_sh[:3]] == [q_spec, cache_spec, cache_spec], arg_sh
        assert out_sh.spec == q_spec
    else:
        assert all(s.is_fully_replicated for s in list(arg_sh) + [out_sh]), (cache_spec, arg_sh)
print("attn partition ok", flush=True)
"""

#: TP_BODY's EAGLE-3 case (tp = 2, then DP and DP x TP) with every attention through the
#: Pallas kernel (interpret mode): head_dim 16 so that the kernel takes the shapes, the
#: backend forced, and a check that it was used; then ragged batches of one bucket through
#: the tensor-parallel ``propose`` without a recompilation.
TP_PALLAS_BODY = """
from specjax.kernels import paged_attention as _attn
import test_proposers_warmup as _warmup
_warmup.GEO["head_dim"] = 16
import specjax.kernels as _K
_K.set_default_backend("pallas")     # the proposers' index ops stay on kernel_backend="xla"
_used = []
_resolve = _attn.resolve_attention_backend
_attn.resolve_attention_backend = lambda *a, **k: _used.append(_resolve(*a, **k)) or _used[-1]
CASES = [("eagle3", 2, True)]
""" + TP_BODY + """
assert _used and set(_used) == {"pallas"}, set(_used)
# ragged batches inside one bucket: no recompilation of the partitioned program
import logging
class _Compiles(logging.Handler):
    n = 0
    def emit(self, record):
        self.n += record.getMessage().startswith("Compiling")
prop, params = build("eagle3")
p, sp, ss = tensor_parallel(prop, params, prop.init_state(NUM_BLOCKS), Mesh(DEV[:2], ("tp",)),
                            local_argmax=True)
rng = np.random.default_rng(3)
for n in (4, 2):     # the first call's state comes back with the step's own output shardings
    _, ss = p.propose(sp, ss, make_inputs("eagle3", bucket, n, rng))
size, counter = type(p).propose._cache_size(), _Compiles()
logging.getLogger("jax").addHandler(counter)
logging.getLogger("jax").setLevel(logging.DEBUG)
with jax.log_compiles():
    for n in (1, 3, 2):
        _, ss = p.propose(sp, ss, make_inputs("eagle3", bucket, n, rng))
assert type(p).propose._cache_size() == size and counter.n == 0, (size, counter.n)
print("tp pallas ok", flush=True)
"""

def _start(body: str, n_devices: int, *args: str) -> subprocess.Popen:
    env = dict(os.environ)
    env["PYTHONPATH"] = suite_paths.pythonpath(ROOT)
    env.pop("XLA_FLAGS", None)
    if body:
        cmd = [sys.executable, "-c", PRELUDE.format(n=n_devices, fast=FAST_COMPILE) + textwrap.dedent(body)]
    else:   # a script: its own command line
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={n_devices} {FAST_COMPILE}"
        env["JAX_PLATFORMS"] = "cpu"
        cmd = [sys.executable, *args]
    return subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _wait(proc: subprocess.Popen) -> str:
    """The subprocess's stdout once it has succeeded (kept: several tests may read one)."""
    if hasattr(proc, "specjax_out"):
        return proc.specjax_out
    try:
        out, err = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    assert proc.returncode == 0, f"subprocess failed:\n{out}\n{err[-6000:]}"
    proc.specjax_out = out
    return out


#: DSpark (DFlash's backbone split as DFlash's; the Markov and confidence heads replicated):
#: tp=2 drafts equal one device's, for a gated and an rnn head with a confidence head.
DSPARK_TP_BODY = TP_HELPERS + """
from specjax.config import SpeculativeConfig
from specjax.models import registry, share_target_weights
from specjax.proposers.dspark import DSparkProposer
from test_proposers_warmup import GEO, HT, K, MML, V, _target
from test_proposers_warmup import BS as PAGE

bucket = _tuple(BUCKETS[1])
rng = np.random.default_rng(12)
mesh = Mesh(DEV[:2], ("tp",))
for head in ("gated", "rnn"):
    mc = registry.config_from_hf("dspark", dict(
        GEO, num_hidden_layers=1, vocab_size=V, target_hidden_size=HT, block_size=4,
        aux_hidden_state_layer_ids=[1, 3, 5], mask_token_id=V - 1, markov_rank=8,
        markov_head_type=head, enable_confidence_head=True, confidence_head_with_markov=True))
    params = share_target_weights(registry.init_params("dspark", mc, 1), _target(mc.hidden_size))
    prop = DSparkProposer(SpeculativeConfig(method="dspark", num_speculative_tokens=K),
                          registry.make_model("dspark", mc), block_size=PAGE, max_model_len=MML,
                          kernel_backend="xla")
    batches = [make_inputs("dflash", bucket, n, rng) for n in (4, 2)]
    want, state = [], prop.init_state(NUM_BLOCKS)
    for inp in batches:
        out, state = prop.propose(params, state, inp)
        want.append(out)
    p, sp, ss = tensor_parallel(prop, params, prop.init_state(NUM_BLOCKS), mesh)
    specs = param_specs(params, mc, 2)
    for x, s in zip(jax.tree.leaves(sp), jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))):
        assert x.sharding.is_equivalent_to(NamedSharding(mesh, s), x.ndim), (head, x.sharding, s)
    for x in jax.tree.leaves((sp["markov_head"], sp["confidence_head"])):
        assert x.sharding.is_fully_replicated, head
    assert sp["lm_head"]["kernel"].sharding.spec == P(None, "tp"), head
    run_and_compare(p.propose, sp, ss, batches, want, state, state_specs(ss, 2), mesh, head)
    print("dspark tp ok", head, flush=True)
"""


#: The subprocess each test of this module reads (the fixture starts only those whose tests
#: were selected: ``-m smoke`` runs one of them).
JOB_OF_TEST = {
    "test_eagle_tensor_and_data_parallel_match_one_device": "tp",
    "test_dflash_and_draft_model_tensor_parallel_match_one_device": "tp_more",
    "test_dspark_tensor_parallel_matches_one_device": "dspark_tp",
    "test_eagle_tree_drafting_tensor_parallel_matches_one_device": "tp_tree_parallel",
    "test_eagle3_parallel_drafting_tensor_parallel_matches_one_device": "tp_tree_parallel",
    "test_engine_tensor_parallel_generates_the_one_device_tokens": "engine_tp",
    "test_pallas_attention_partitioned_by_kv_heads": "attn",
    "test_eagle3_tensor_and_data_parallel_through_the_pallas_kernel": "tp_pallas",
    "test_benchmark_script_smoke": "bench",
}


@pytest.fixture(scope="module")
def jobs(request, tmp_path_factory):
    """The multi-device subprocesses the selected tests need, started at once (they overlap
    on two cores)."""
    out_json = str(tmp_path_factory.mktemp("bench") / "multi_gpu.json")
    starters = {
        "tp": lambda: _start(f"CASES = {TP_CASES!r}\n" + TP_BODY, 4),
        "tp_more": lambda: _start(f"CASES = {TP_CASES_MORE!r}\n" + TP_BODY, 4),
        "dspark_tp": lambda: _start(DSPARK_TP_BODY, 2),
        "tp_tree_parallel": lambda: _start(
            f"CASES = {TP_TREE_PARALLEL_CASES!r}\n" + TP_TREE_PARALLEL_BODY, 4),
        "engine_tp": lambda: _start(f"CASES = {ENGINE_TP_CASES!r}\n" + ENGINE_TP_BODY, 4),
        "attn": lambda: _start(ATTN_BODY, 4),
        "tp_pallas": lambda: _start(TP_PALLAS_BODY, 4),
        "bench": lambda: _start("", 2, os.path.join(ROOT, "benchmarks", "multi_gpu.py"),
                                "--small", "--iters", "2", "--batches", "8", "--dp",
                                "--dp-batches", "8", "--out", out_json),
    }
    assert set(JOB_OF_TEST.values()) == set(starters)
    needed = {JOB_OF_TEST[item.originalname] for item in request.session.items
              if item.module is request.module and item.originalname in JOB_OF_TEST}
    procs = {key: start() for key, start in starters.items() if key in needed}
    yield procs, out_json
    for p in procs.values():
        if p.poll() is None:
            p.kill()
            p.communicate()


def test_eagle_tensor_and_data_parallel_match_one_device(jobs):
    out = _wait(jobs[0]["tp"])
    for m, n, flag in TP_CASES:
        assert f"tp ok {m} tp={n} local_argmax={flag}" in out, out
    assert "dp ok" in out and "dp x tp ok" in out


def test_dflash_and_draft_model_tensor_parallel_match_one_device(jobs):
    out = _wait(jobs[0]["tp_more"])
    for m, n, flag in TP_CASES_MORE:
        assert f"tp ok {m} tp={n} local_argmax={flag}" in out, out


def test_dspark_tensor_parallel_matches_one_device(jobs):
    out = _wait(jobs[0]["dspark_tp"])
    assert "dspark tp ok gated" in out and "dspark tp ok rnn" in out, out


def test_eagle_tree_drafting_tensor_parallel_matches_one_device(jobs):
    out = _wait(jobs[0]["tp_tree_parallel"])
    for m, mode, n, flag in TP_TREE_PARALLEL_CASES:
        if mode == "tree":
            assert f"tp ok {m} tree tp={n} local_argmax={flag}" in out, out


def test_eagle3_parallel_drafting_tensor_parallel_matches_one_device(jobs):
    out = _wait(jobs[0]["tp_tree_parallel"])
    for m, mode, n, flag in TP_TREE_PARALLEL_CASES:
        if mode == "parallel":
            assert f"tp ok {m} parallel tp={n} local_argmax={flag}" in out, out


def test_engine_tensor_parallel_generates_the_one_device_tokens(jobs):
    """``Engine(mesh=...)``: the target (and a device proposer) sharded over ``tp``: the
    same greedy tokens and acceptance as one device (chain and tree verification), the KV
    caches still sharded after the run, no cache-shaped all-gather, bad meshes refused."""
    out = _wait(jobs[0]["engine_tp"])
    for m, n, flag in ENGINE_TP_CASES:
        assert f"engine tp ok {m} tp={n} local_argmax={flag}" in out, out
    assert "engine tp errors ok" in out


@pytest.mark.smoke
def test_pallas_attention_partitioned_by_kv_heads(jobs):
    """The Pallas kernel under tensor parallelism / DP x TP: see ATTN_BODY."""
    out = _wait(jobs[0]["attn"])
    assert out.count("attn ok") == 18 and "attn partition ok" in out, out


def test_eagle3_tensor_and_data_parallel_through_the_pallas_kernel(jobs):
    """TP_BODY's EAGLE-3 checks (drafts equal one device's, no large collective, DP and
    DP x TP) with the attention on the Pallas kernel under partitioning."""
    out = _wait(jobs[0]["tp_pallas"])
    assert "tp ok eagle3 tp=2 local_argmax=True" in out and "dp x tp ok" in out, out
    assert "tp pallas ok" in out, out

def test_benchmark_script_smoke(jobs):
    import json

    out = _wait(jobs[0]["bench"])
    rows = json.load(open(jobs[1]))["rows"]
    assert [(r["mode"], r["devices"], r["batch"]) for r in rows] == [
        ("single", 1, 8), ("tp+local-argmax", 2, 8), ("dp", 2, 8)]
    for r in rows:
        assert r["latency_ms"] > 0 and r["pipelined_ms"] > 0 and r["floor_per_device_ms"] > 0
    # TP halves the split weights and the cache per device: its floor is below one device's
    assert rows[1]["floor_per_device_ms"] < rows[0]["floor_per_device_ms"]
    assert "| tp+local-argmax | 2 | 8 |" in out


# -- the rules (no devices needed) ----------------------------------------------------------


def _cfg(kind, **hf):
    base = dict(hidden_size=48, intermediate_size=48, num_attention_heads=6, num_key_value_heads=3,
                head_dim=8, num_hidden_layers=1, vocab_size=60, rms_norm_eps=1e-5)
    base.update(hf)
    return registry.config_from_hf(kind, base)


def _flat(specs):
    leaves = jax.tree_util.tree_flatten_with_path(specs, is_leaf=lambda x: isinstance(x, P))[0]
    return {".".join(str(getattr(k, "key", k)) for k in path): s for path, s in leaves}


@pytest.mark.smoke
def test_eagle3_rules():
    cfg = _cfg("eagle3", num_key_value_heads=2, draft_vocab_size=32, target_hidden_size=24,
               has_d2t=True, has_embed_tokens=True, eagle_aux_hidden_state_layer_ids=[1, 3, 5])
    specs = _flat(param_specs(registry.abstract_params("eagle3", cfg), cfg, 2))
    L = "layers.0."
    want = {
        "fc.kernel": P(), "d2t": P(), "norm.weight": P(), "embed_tokens.embedding": P(),
        "lm_head.kernel": P(None, "tp"),
        L + "hidden_norm.weight": P(), L + "input_layernorm.weight": P(),
        L + "post_attention_layernorm.weight": P(),
        L + "self_attn.q_proj.kernel": P(None, "tp"), L + "self_attn.k_proj.kernel": P(None, "tp"),
        L + "self_attn.v_proj.kernel": P(None, "tp"), L + "self_attn.o_proj.kernel": P("tp", None),
        L + "mlp.gate_proj.kernel": P(None, "tp"), L + "mlp.up_proj.kernel": P(None, "tp"),
        L + "mlp.down_proj.kernel": P("tp", None),
    }
    assert specs == want
    # P-EAGLE's parallel-drafting hidden state is replicated
    assert _flat(param_specs({"mask_hidden": jnp.zeros((1, 72))}, cfg, 2)) == {"mask_hidden": P()}
    # shard_embedding, another axis name
    specs = _flat(param_specs(registry.abstract_params("eagle3", cfg), cfg, 2, axis="model",
                              shard_embedding=True))
    assert specs["embed_tokens.embedding"] == P("model", None)
    assert specs["lm_head.kernel"] == P(None, "model")
    # vLLM v0.33's pre-fc norms are replicated, as fc is
    cfg = _cfg("eagle3", num_key_value_heads=2, target_hidden_size=24, norm_before_fc=True,
               fc_norm=True, eagle_aux_hidden_state_layer_ids=[1, 3, 5])
    specs = _flat(param_specs(registry.abstract_params("eagle3", cfg), cfg, 2))
    assert {k: v for k, v in specs.items() if "norm" in k and "layers" not in k} == {
        "input_norm.weight": P(), "fc_norm.0.weight": P(), "fc_norm.1.weight": P(),
        "fc_norm.2.weight": P(), "norm.weight": P()}


@pytest.mark.smoke
def test_mtp_rules():
    """MiMo MTP: its own norms and input_proj replicated (MiMo's input_proj is a plain
    nn.Linear in vLLM), the Qwen2 block split as any layer, biases with their columns."""
    cfg = _cfg("mtp", num_key_value_heads=2, num_nextn_predict_layers=1)
    specs = _flat(param_specs(registry.abstract_params("mtp", cfg), cfg, 2))
    L = "layers.0."
    want = {
        "token_layernorm.weight": P(), "hidden_layernorm.weight": P(), "input_proj.kernel": P(),
        "final_layernorm.weight": P(),
        L + "input_layernorm.weight": P(), L + "post_attention_layernorm.weight": P(),
        L + "self_attn.q_proj.kernel": P(None, "tp"), L + "self_attn.q_proj.bias": P("tp"),
        L + "self_attn.k_proj.kernel": P(None, "tp"), L + "self_attn.k_proj.bias": P("tp"),
        L + "self_attn.v_proj.kernel": P(None, "tp"), L + "self_attn.v_proj.bias": P("tp"),
        L + "self_attn.o_proj.kernel": P("tp", None),
        L + "mlp.gate_proj.kernel": P(None, "tp"), L + "mlp.up_proj.kernel": P(None, "tp"),
        L + "mlp.down_proj.kernel": P("tp", None),
    }
    assert specs == want


def test_biases_qk_norm_tied_head_and_kv_replication():
    cfg = _cfg("qwen2", qkv_bias=True, o_bias=True, mlp_bias=True, qk_norm=True, tie_word_embeddings=True)
    params = registry.abstract_params("qwen2", cfg)
    assert "lm_head" not in params
    params = dict(params, lm_head={"embedding": params["embed_tokens"]["embedding"],
                                   "bias": jax.ShapeDtypeStruct((60,), jnp.float32)})
    specs = _flat(param_specs(params, cfg, 3))         # 3 kv heads: split
    a = "layers.0.self_attn."
    assert specs[a + "q_proj.bias"] == P("tp") and specs[a + "k_proj.bias"] == P("tp")
    assert specs[a + "o_proj.bias"] == P() and specs[a + "q_norm.weight"] == P()
    assert specs["layers.0.mlp.up_proj.bias"] == P("tp") and specs["layers.0.mlp.down_proj.bias"] == P()
    assert specs["lm_head.embedding"] == P("tp", None) and specs["lm_head.bias"] == P("tp")
    assert specs["embed_tokens.embedding"] == P()
    # 6 shards > 3 kv heads: the attention block stays whole, the MLP and vocab are split
    specs = _flat(param_specs(params, _cfg("qwen2", qkv_bias=True, o_bias=True, mlp_bias=True,
                                           qk_norm=True, tie_word_embeddings=True), 6))
    for name in ("q_proj.kernel", "k_proj.kernel", "v_proj.bias", "o_proj.kernel"):
        assert specs[a + name] == P(), name
    assert specs["layers.0.mlp.gate_proj.kernel"] == P(None, "tp")
    # the cache follows the kv heads
    caches = jax.eval_shape(lambda: registry.make_model("qwen2", cfg).init_kv_caches(8, 4))
    assert jax.tree.leaves(state_specs(caches, 3), is_leaf=lambda x: isinstance(x, P)) == \
        [P(None, None, "tp", None)] * 2
    assert jax.tree.leaves(state_specs(caches, 2), is_leaf=lambda x: isinstance(x, P)) == [P()] * 2
    assert jax.tree.leaves(state_specs({"other": jnp.zeros(3)}, 2),
                           is_leaf=lambda x: isinstance(x, P)) == [P()]


def test_medusa_rules():
    cfg = registry.config_from_hf("medusa", dict(num_heads=2, num_hidden_layers=1, hidden_size=16,
                                                 vocab_size=64))
    specs = _flat(param_specs(registry.abstract_params("medusa", cfg), cfg, 4))
    assert specs["lm_heads.0.kernel"] == P(None, "tp") and specs["blocks.1.layers.0.kernel"] == P()


@pytest.mark.parametrize("kind, hf, n, kw, match", [
    ("eagle", dict(bias=True, intermediate_size=50), 4, {},
     r"'layers\.0\.mlp\.(down|gate|up)_proj\.kernel' over mesh axis 'tp' of size 4: "
     r"intermediate_size \(50\)"),
    ("llama", dict(intermediate_size=50), 3, {},
     r"'layers\.0\.mlp\.(down|gate|up)_proj\.kernel'.*intermediate_size \(50\) is not divisible by 3"),
    ("llama", dict(vocab_size=64), 3, {},
     r"'lm_head\.kernel'.*vocab size: dimension 1 of shape \(48, 64\) \(64\) is not divisible"),
    ("llama", dict(vocab_size=64, tie_word_embeddings=True), 3, dict(shard_embedding=True),
     r"'embed_tokens\.embedding'.*vocab size: dimension 0"),
    ("eagle3", dict(draft_vocab_size=32, target_hidden_size=24,
                    eagle_aux_hidden_state_layer_ids=[1, 3, 5]), 3, {},
     r"'lm_head\.kernel' over mesh axis 'tp' of size 3"),
])
def test_not_divisible_names_the_parameter(kind, hf, n, kw, match):
    cfg = _cfg(kind, **hf)
    with pytest.raises(ValueError, match=match):
        param_specs(registry.abstract_params(kind, cfg), cfg, n, **kw)


def test_bad_arguments():
    cfg = _cfg("llama")
    params = registry.abstract_params("llama", cfg)
    with pytest.raises(ValueError, match=r"no tensor-parallel rule for params entry 'extra\.w'"):
        param_specs(dict(params, extra={"w": jnp.zeros(3)}), cfg, 3)
    with pytest.raises(ValueError, match="axis_size must be a positive int"):
        param_specs(params, cfg, 0)
    with pytest.raises(ValueError, match="config must be a specjax ModelConfig"):
        param_specs(params, None, 3)
    with pytest.raises(ValueError, match="KV cache leaves"):
        from specjax.kernels.paged_attention import KVCache
        state_specs([KVCache(jnp.zeros((2, 3)), jnp.zeros((2, 3)))], 2)
    # string layer keys (orbax restores) are read as ints
    specs = _flat(param_specs(dict(params, layers={"0": params["layers"][0]}), cfg, 3))
    assert specs["layers.0.mlp.gate_proj.kernel"] == P(None, "tp")


def test_proposer_level_argument_checks():
    import dataclasses

    import numpy as np
    from jax.sharding import Mesh

    from specjax.sharding import DataParallel, tensor_parallel
    from test_proposers_warmup import NUM_BLOCKS, build

    mesh = Mesh(np.array(jax.devices()[:1]), ("tp",))
    medusa, mparams = build("medusa")
    with pytest.raises(ValueError, match="tensor_parallel needs a proposer with mesh"):
        tensor_parallel(medusa, mparams, None, mesh)
    prop, params = build("eagle")
    with pytest.raises(ValueError, match="axis must be one of the mesh's axis names"):
        tensor_parallel(prop, params, prop.init_state(NUM_BLOCKS), mesh, axis="model")
    p, sp, ss = tensor_parallel(prop, params, prop.init_state(NUM_BLOCKS), mesh, local_argmax=False)
    assert p.mesh is mesh and not p.config.use_local_argmax_reduction
    assert prop.mesh is None                      # the original is untouched
    with pytest.raises(ValueError, match="must have mesh=None .* or the DataParallel mesh itself"):
        DataParallel(p, Mesh(np.array(jax.devices()[:1]), ("dp",)))
    with pytest.raises(ValueError, match="vocab_axis is the data-parallel axis 'tp'"):
        DataParallel(p, mesh, axis="tp")
    with pytest.raises(ValueError, match="axis must be one of"):
        DataParallel(prop, mesh)
    dp = DataParallel(dataclasses.replace(prop), Mesh(np.array(jax.devices()[:1]), ("dp",)))
    with pytest.raises(ValueError, match="one pytree per shard"):
        dp.stack([1, 2])


@pytest.mark.smoke
@pytest.mark.parametrize("head", ["vanilla", "gated", "rnn"])
def test_dspark_rules(head):
    """DSpark: the DFlash backbone split as DFlash's (fc and norms replicated, attention and
    MLP Megatron-split); markov_w1, markov_w2, the gate / joint projection and the confidence
    head replicated, as vLLM keeps them; an unknown entry under them is named."""
    cfg = _cfg("dspark", num_key_value_heads=2, aux_hidden_state_layer_ids=[1, 3],
               mask_token_id=59, markov_rank=4, markov_head_type=head,
               enable_confidence_head=True, confidence_head_with_markov=head != "rnn")
    specs = _flat(param_specs(registry.abstract_params("dspark", cfg), cfg, 2))
    L = "layers.0."
    extra = {"gated": "gate_proj", "rnn": "joint_proj"}.get(head)
    want = {
        "fc.kernel": P(), "hidden_norm.weight": P(), "norm.weight": P(),
        L + "input_layernorm.weight": P(), L + "post_attention_layernorm.weight": P(),
        L + "self_attn.q_norm.weight": P(), L + "self_attn.k_norm.weight": P(),
        L + "self_attn.q_proj.kernel": P(None, "tp"), L + "self_attn.k_proj.kernel": P(None, "tp"),
        L + "self_attn.v_proj.kernel": P(None, "tp"), L + "self_attn.o_proj.kernel": P("tp", None),
        L + "mlp.gate_proj.kernel": P(None, "tp"), L + "mlp.up_proj.kernel": P(None, "tp"),
        L + "mlp.down_proj.kernel": P("tp", None),
        "markov_head.markov_w1.embedding": P(), "markov_head.markov_w2.kernel": P(),
        "confidence_head.proj.kernel": P(), "confidence_head.proj.bias": P(),
    }
    if extra:
        want.update({f"markov_head.{extra}.kernel": P(), f"markov_head.{extra}.bias": P()})
    assert specs == want
    # the same tree with the DFlash backbone's own rules: identical outside the two heads
    base = cfg.replace(kind="dflash", markov_rank=0, markov_head_type="vanilla",
                       enable_confidence_head=False, confidence_head_with_markov=False)
    flash = _flat(param_specs(registry.abstract_params("dflash", base), base, 2))
    assert {k: v for k, v in specs.items() if not k.startswith(("markov", "confidence"))} == flash
    bad = {"markov_head": {"markov_w3": {"kernel": jnp.zeros((4, 60))}}}
    with pytest.raises(ValueError, match=r"unknown params entry 'markov_head.markov_w3.kernel' "
                       r"\(a DSpark markov_head holds markov_w1.embedding"):
        param_specs(bad, cfg, 2)

"""The Pallas paged-attention kernel (kernels/paged_attention/pallas.py) against the jnp
reference (kernels/paged_attention/reference.py) and a NumPy brute-force oracle, plus the backend switch.

CPU: the kernel runs in Pallas interpret mode on small random ragged batches (empty
requests, padding rows, GQA groups 1/2/4, causal, non-causal and tree masks, contexts at the
block table's capacity, scattered and out-of-range block-table entries, block sizes below,
at and above the kernel's key tile, split-K). Each configuration compiles once (~5 s on
CPU) and runs several batches of the same shapes. The kernel is not bit-identical to the
reference (its online softmax sums in another order and rescales per tile), so float32 is
compared to 1e-5 and bfloat16 to bfloat16 rounding.

GPU (``-m gpu``): the compiled Triton kernel on H200-sized shapes, and an EAGLE-3 propose
(Llama-3.1-8B-shaped head) with backend pallas vs xla.
"""

from __future__ import annotations

import suite_paths  # tests/support: where the suite's pieces are
import dataclasses
import functools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax.kernels as K
from specjax.attention_metadata import CommonAttentionMetadata
from specjax.kernels.paged_attention import pallas as pk
from specjax.kernels import paged_attention as attn
from specjax.kernels.paged_attention import KVCache

ON_GPU = jax.default_backend() == "gpu"

@pytest.fixture(autouse=True)
def _ieee_float32_matmuls(request):
    """Float32 dots in IEEE precision for the reference (on the GPU XLA's default is TF32,
    while the kernel's float32 dots are IEEE), so the CPU tests also pass there, compiled.
    The GPU tests set precision themselves."""
    if request.node.get_closest_marker("gpu"):
        yield
        return
    with jax.default_matmul_precision("highest"):
        yield


# ----------------------------------------------------------------------------------------
# random ragged batches


@dataclasses.dataclass(frozen=True)
class Cfg:
    nh: int
    nkv: int
    hd: int
    bs: int                 # cache block (page) size
    width: int              # block-table width (context capacity = width * bs)
    qmax: int               # max_query_len
    b_pad: int
    t_pad: int
    causal: bool = True
    tree: bool = False
    dtype: str = "float32"
    block_k: int | None = 16
    num_splits: int | None = 1

    @property
    def num_blocks(self):   # room for scattered tables
        return self.b_pad * self.width + 7


def random_tree(rng, q):
    """A random tree over ``q`` nodes in topological order: node ``i > 0`` has a parent
    ``< i``; the mask row of a node is itself plus its ancestors."""
    parent = [-1] + [int(rng.integers(0, i)) for i in range(1, q)]
    rows = []
    for i in range(q):
        seen, j = set(), i
        while j >= 0:
            seen.add(j)
            j = parent[j]
        rows.append(tuple(j in seen for j in range(q)))
    return tuple(rows)


def make_case(cfg: Cfg, seed: int, tree_mask=None):
    """Random metadata, cache and queries for ``cfg`` (same shapes for every seed)."""
    rng = np.random.default_rng(seed)
    cap = cfg.width * cfg.bs
    n = int(rng.integers(1, cfg.b_pad + 1))
    while True:
        qlens = rng.integers(0, cfg.qmax + 1, size=n)
        qlens[rng.integers(0, n)] = cfg.qmax if seed % 2 else max(1, cfg.qmax - 1)
        if qlens.sum() <= cfg.t_pad:
            break
    seqs = qlens + rng.integers(0, cap - qlens + 1)
    seqs[rng.integers(0, n)] = cap                         # one request at the capacity
    perm = rng.permutation(cfg.num_blocks)[: n * cfg.width].reshape(n, cfg.width)
    md = CommonAttentionMetadata.from_query_lens(
        qlens, seqs, perm, block_size=cfg.bs, num_reqs_pad=cfg.b_pad, num_tokens_pad=cfg.t_pad,
        max_query_len=cfg.qmax, causal=cfg.causal)
    # entries past each request's pages, and padding rows, hold junk (both sides clamp)
    table = np.asarray(md.block_table).copy()
    used = -(-np.asarray(md.seq_lens) // cfg.bs)
    junk = rng.integers(-3, cfg.num_blocks + 5, size=table.shape)
    cols = np.arange(cfg.width)[None, :]
    table = np.where(cols < used[:, None], table, junk).astype(np.int32)
    md = md.replace(block_table=jnp.asarray(table))
    if tree_mask is not None:
        md = md.replace(tree_mask=tree_mask)
    dt = jnp.dtype(cfg.dtype)
    shape = (cfg.num_blocks, cfg.bs, cfg.nkv, cfg.hd)
    k = jnp.asarray(rng.standard_normal(shape), jnp.float32).astype(dt)
    v = jnp.asarray(rng.standard_normal(shape), jnp.float32).astype(dt)
    q = jnp.asarray(rng.standard_normal((cfg.t_pad, cfg.nh, cfg.hd)), jnp.float32).astype(dt)
    return q, KVCache(k, v), md


def oracle(q, cache, md, scale):
    """NumPy brute force in float64, written from the specification, one query at a time."""
    q = np.asarray(q, np.float64)
    k = np.asarray(cache.k, np.float64)
    v = np.asarray(cache.v, np.float64)
    nb, bs, nkv, hd = k.shape
    t_pad, nh, _ = q.shape
    g = nh // nkv
    qsl, seq, bt = (np.asarray(x) for x in (md.query_start_loc, md.seq_lens, md.block_table))
    out = np.zeros_like(q)
    for r in range(len(seq)):
        qlen = qsl[r + 1] - qsl[r]
        for i in range(qlen):
            pos = seq[r] - qlen + i
            keys = []
            for j in range(seq[r]):
                rel = j - (seq[r] - qlen)
                if md.tree_mask is not None:
                    ok = rel < 0 or md.tree_mask[i][rel]
                elif md.causal:
                    ok = j <= pos
                else:
                    ok = True
                if ok:
                    keys.append(j)
            slots = [(bt[r, j // bs], j % bs) for j in keys]
            for h in range(nh):
                kk = np.stack([k[b, o, h // g] for b, o in slots])
                vv = np.stack([v[b, o, h // g] for b, o in slots])
                s = kk @ q[qsl[r] + i, h] * scale
                p = np.exp(s - s.max())
                out[qsl[r] + i, h] = (p / p.sum()) @ vv
    return out


def run_kernel(cfg: Cfg, q, cache, md, scale, **kw):
    kw = dict(dict(block_k=cfg.block_k, num_splits=cfg.num_splits), **kw)
    return pk.paged_attention(q, cache.k, cache.v, md.query_start_loc, md.seq_lens,
                              md.block_table, scale=scale, max_query_len=md.max_query_len,
                              causal=md.causal, tree_mask=md.tree_mask, **kw)


def tolerance(dtype):
    return 1e-5 if jnp.dtype(dtype) == jnp.float32 else 2e-2


def assert_close(got, want, tol, what):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    err = np.max(np.abs(got - want)) if got.size else 0.0
    assert err <= tol, f"{what}: max abs error {err:.3g} > {tol}"


# ----------------------------------------------------------------------------------------
# kernel == reference (interpret mode on CPU)

CPU_CFGS = {
    # GQA 1, causal, block 4 (4 pages per 16-key tile), no split
    "f32-g1-causal": Cfg(nh=2, nkv=2, hd=16, bs=4, width=6, qmax=4, b_pad=5, t_pad=14),
    # GQA 2, non-causal, block 32 > key tile 16, 2 splits
    "f32-g2-noncausal-split2": Cfg(nh=4, nkv=2, hd=32, bs=32, width=2, qmax=3, b_pad=4,
                                   t_pad=10, causal=False, num_splits=2),
    # GQA 4, causal, block 16 == key tile, 3 splits (not a power of two)
    "f32-g4-causal-split3": Cfg(nh=8, nkv=2, hd=16, bs=16, width=4, qmax=2, b_pad=4, t_pad=8,
                                num_splits=3),
    # GQA 2, tree mask, 2 splits
    "f32-g2-tree": Cfg(nh=4, nkv=2, hd=16, bs=4, width=8, qmax=4, b_pad=3, t_pad=12, tree=True,
                       num_splits=2),
    # decode (query length 1), GQA 4, the default split count and key tile
    "f32-g4-decode-default": Cfg(nh=8, nkv=2, hd=16, bs=8, width=32, qmax=1, b_pad=3, t_pad=4,
                                 block_k=None, num_splits=None),
    "bf16-g4-causal": Cfg(nh=8, nkv=2, hd=32, bs=8, width=8, qmax=4, b_pad=4, t_pad=16,
                          dtype="bfloat16", block_k=32),
    # GQA 3 (not a power of two: the merge kernel masks its padded head lanes), 2 splits
    "f32-g3-causal-split2": Cfg(nh=6, nkv=2, hd=16, bs=8, width=4, qmax=2, b_pad=3, t_pad=7,
                                num_splits=2),
    # GQA 3, one split: the kernel stores rows in token order itself (no merge kernel)
    "f32-g3-causal-direct": Cfg(nh=6, nkv=2, hd=16, bs=8, width=4, qmax=3, b_pad=3, t_pad=11),
    "bf16-g2-tree-split4": Cfg(nh=4, nkv=2, hd=16, bs=4, width=8, qmax=3, b_pad=3, t_pad=9,
                               tree=True, dtype="bfloat16", num_splits=4),
}


@pytest.mark.smoke
@pytest.mark.parametrize("name", list(CPU_CFGS))
def test_kernel_matches_reference(name):
    cfg = CPU_CFGS[name]
    scale = cfg.hd ** -0.5
    tree = random_tree(np.random.default_rng(7), cfg.qmax) if cfg.tree else None
    if cfg.num_splits is None:
        assert pk.default_num_splits(cfg.b_pad, cfg.nkv, cfg.width * cfg.bs // 64) > 1
    ref = jax.jit(lambda q, c, m: attn.paged_attention_xla(q, c, m, scale=scale))
    for seed in range(3):
        q, cache, md = make_case(cfg, 100 * seed + len(name), tree)
        got = run_kernel(cfg, q, cache, md, scale)
        want = ref(q, cache, md)
        assert got.shape == q.shape and got.dtype == q.dtype
        assert_close(got, want, tolerance(cfg.dtype), f"{name} seed {seed} vs reference")
        end = int(md.query_start_loc[-1])
        assert np.all(np.asarray(got[end:], np.float32) == 0), "padding tokens must be zeros"
        if seed == 0 and cfg.dtype == "float32":
            assert_close(got, oracle(q, cache, md, scale), 1e-5, f"{name} vs NumPy oracle")


@pytest.mark.parametrize("nh,nkv", [(2, 2), (4, 2), (8, 2)])
def test_reference_decode_form_per_platform(nh, nkv):
    """The XLA reference on one query per request (a decoding step): equal to the NumPy
    oracle, and lowered with its row operands transposed for a CPU when a kv head serves at
    most two query heads (XLA:CPU's own dot instead of YNNPACK), as written for a GPU and
    for wider row blocks. Lowered for CUDA here without a GPU (``lowering_platforms``)."""
    cfg = Cfg(nh=nh, nkv=nkv, hd=16, bs=8, width=6, qmax=1, b_pad=3, t_pad=4)
    scale = cfg.hd ** -0.5
    ref = jax.jit(lambda q, c, m: attn.paged_attention_xla(q, c, m, scale=scale))
    for seed in range(3):
        q, cache, md = make_case(cfg, 40 + seed)
        assert_close(ref(q, cache, md), oracle(q, cache, md, scale), 1e-5, f"seed {seed}")

    def contractions(platform):
        text = ref.trace(q, cache, md).lower(lowering_platforms=(platform,)).as_text()
        return [line.split("contracting_dims = ")[1].split(",")[0]
                for line in text.splitlines() if "stablehlo.dot_general" in line]

    rows = ["[3] x [3]", "[3] x [2]"]              # scores, then probabilities x V
    assert contractions("cuda") == rows
    assert contractions("cpu") == (["[2] x [3]", "[2] x [2]"] if nh // nkv <= 2 else rows)


def with_write_slots(cfg: Cfg, md, seed: int):
    """``md`` with the slot mapping a fused-write test wants: some of a request's tokens
    unwritten (slot -1, as past ``max_model_len``) or out of the cache (dropped), some
    written to an earlier position of the request's own pages, padding tokens with slots in
    pages no request reads (the scatter writes them too)."""
    rng = np.random.default_rng(seed)
    sm = np.asarray(md.slot_mapping).copy()
    end = int(md.query_start_loc[-1])
    cap = cfg.num_blocks * cfg.bs
    drop = rng.random(end) < 0.2
    sm[:end] = np.where(drop, rng.choice([-1, -7, cap, cap + 3], size=end), sm[:end])
    bt = np.asarray(md.block_table)
    qsl, seqs = np.asarray(md.query_start_loc), np.asarray(md.seq_lens)
    for r in range(len(seqs)):
        # every other request: one token's slot moved to an earlier position of its own
        # pages (not vLLM's layout; the fused kernel then checks every tile)
        qlen = qsl[r + 1] - qsl[r]
        if qlen and seqs[r] > qlen and rng.random() < 0.5:
            p = int(rng.integers(0, seqs[r] - qlen))
            sm[qsl[r] + int(rng.integers(0, qlen))] = bt[r, p // cfg.bs] * cfg.bs + p % cfg.bs
    used = -(-seqs // cfg.bs)
    read = {int(bt[r, j]) for r in range(len(used)) for j in range(int(used[r]))}
    free = [b for b in range(cfg.num_blocks) if b not in read]
    tail = np.arange(end, cfg.t_pad)
    if len(tail) and free:
        slots = rng.permutation(len(free) * cfg.bs)[: len(tail)]
        sm[tail] = np.array([free[x // cfg.bs] * cfg.bs + x % cfg.bs for x in slots])
        sm[tail[rng.random(len(tail)) < 0.3]] = -1
    return md.replace(slot_mapping=jnp.asarray(sm, jnp.int32))


@pytest.mark.parametrize("name", list(CPU_CFGS))
def test_fused_write_equals_scatter_then_attention(name):
    """``paged_attention_write`` (the K/V write inside the kernel) == ``write_kv`` then the
    kernel: caches bit-identical, outputs bit-identical to the unfused kernel and close to
    the jnp reference; incl. unwritten (-1) and out-of-range slots, padding tokens that write,
    empty requests, requests at the table's capacity."""
    cfg = CPU_CFGS[name]
    scale = cfg.hd ** -0.5
    tree = random_tree(np.random.default_rng(7), cfg.qmax) if cfg.tree else None
    dt = jnp.dtype(cfg.dtype)
    ref = jax.jit(lambda q, c, m: attn.paged_attention_xla(q, c, m, scale=scale))
    for seed in range(2):
        q, cache, md = make_case(cfg, 200 * seed + len(name), tree)
        md = with_write_slots(cfg, md, seed)
        rng = np.random.default_rng(seed)
        kn = jnp.asarray(rng.standard_normal((cfg.t_pad, cfg.nkv, cfg.hd)), jnp.float32).astype(dt)
        vn = jnp.asarray(rng.standard_normal((cfg.t_pad, cfg.nkv, cfg.hd)), jnp.float32).astype(dt)
        want_cache = attn.write_kv(cache, kn, vn, md.slot_mapping)
        want = run_kernel(cfg, q, want_cache, md, scale)
        got, (gk, gv) = pk.paged_attention_write(
            jnp.concatenate([q, kn, vn], axis=1), cache.k, cache.v, md.slot_mapping,
            md.query_start_loc, md.seq_lens, md.block_table, scale=scale,
            max_query_len=md.max_query_len, causal=md.causal, tree_mask=md.tree_mask,
            block_k=cfg.block_k, num_splits=cfg.num_splits)
        np.testing.assert_array_equal(np.asarray(gk), np.asarray(want_cache.k))
        np.testing.assert_array_equal(np.asarray(gv), np.asarray(want_cache.v))
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        assert_close(got, ref(q, want_cache, md), tolerance(cfg.dtype), f"{name} vs reference")


@pytest.mark.parametrize("name", ["f32-g1-causal", "bf16-g4-causal", "f32-g3-causal-direct"])
def test_write_kv_kernel_equals_scatter(name):
    """``pallas.write_kv`` (both caches in one kernel) == two ``scatter_slots``, bit for bit:
    unwritten (-1) and out-of-range slots dropped, padding tokens written, any tokens per
    program (a partial last program too)."""
    cfg = CPU_CFGS[name]
    dt = jnp.dtype(cfg.dtype)
    for seed in range(2):
        _, cache, md = make_case(cfg, 300 * seed + len(name))
        md = with_write_slots(cfg, md, seed)
        rng = np.random.default_rng(seed)
        kn, vn = (jnp.asarray(rng.standard_normal((cfg.t_pad, cfg.nkv, cfg.hd)),
                              jnp.float32).astype(dt) for _ in range(2))
        want = attn.write_kv(cache, kn, vn, md.slot_mapping)
        for tb in (1, 4, 64):
            gk, gv = pk.write_kv(cache.k, cache.v, kn, vn, md.slot_mapping, tokens_per_program=tb)
            np.testing.assert_array_equal(np.asarray(gk), np.asarray(want.k), f"tb={tb}")
            np.testing.assert_array_equal(np.asarray(gv), np.asarray(want.v), f"tb={tb}")
    with pytest.raises(ValueError, match="dtype"):
        pk.write_kv(cache.k, cache.v, kn.astype(jnp.float16), vn, md.slot_mapping)
    with pytest.raises(ValueError, match="slot_mapping"):
        pk.write_kv(cache.k, cache.v, kn, vn, md.slot_mapping[:2])
    with pytest.raises(ValueError, match="do not fit"):
        pk.write_kv(cache.k, cache.v, kn[:, :1], vn[:, :1], md.slot_mapping)
    assert not pk.write_kv_supported((4, 8, 3, 16), jnp.float32)    # 48-wide rows


def test_fused_write_with_no_request_still_writes():
    """No request (``query_start_loc == [0]``): zeros out, every token with a slot written."""
    cfg = CPU_CFGS["f32-g1-causal"]
    q, cache, _ = make_case(cfg, 4)
    md = CommonAttentionMetadata.from_query_lens(
        [], [], np.zeros((0, cfg.width), np.int32), block_size=cfg.bs, num_reqs_pad=0,
        num_tokens_pad=cfg.t_pad, max_query_len=cfg.qmax)
    slots = jnp.asarray(np.where(np.arange(cfg.t_pad) % 3, np.arange(cfg.t_pad) * 5, -1), jnp.int32)
    kv = jnp.asarray(np.random.default_rng(0).standard_normal((cfg.t_pad, 2 * cfg.nkv, cfg.hd)),
                     jnp.float32)
    out, (gk, gv) = pk.paged_attention_write(
        jnp.concatenate([q, kv], axis=1), cache.k, cache.v, slots, md.query_start_loc,
        md.seq_lens, md.block_table, scale=0.3, max_query_len=cfg.qmax)
    want = attn.write_kv(cache, kv[:, :cfg.nkv], kv[:, cfg.nkv:], slots)
    assert np.all(np.asarray(out) == 0)
    np.testing.assert_array_equal(np.asarray(gk), np.asarray(want.k))
    np.testing.assert_array_equal(np.asarray(gv), np.asarray(want.v))


@pytest.mark.smoke
def test_fused_write_through_attend_and_errors(monkeypatch):
    """With ``fused_kv_write=True``, ``attend`` on the pallas backend takes the fused kernel
    (same caches and outputs as the xla backend); False: the write kernel (or, with
    ``kv_write_kernel=False``, the scatters); ``"auto"``: the fused kernel exactly when
    ``fused_write_pays``. Bad values of either argument are refused by name; the kernel
    refuses mismatched shapes and dtypes by name."""
    cfg = CPU_CFGS["f32-g4-causal-split3"]
    q, cache, md = make_case(cfg, 9)
    rng = np.random.default_rng(1)
    kn = jnp.asarray(rng.standard_normal((cfg.t_pad, cfg.nkv, cfg.hd)), jnp.float32)
    outs = {}
    for backend in ("xla", "pallas"):
        outs[backend] = jax.jit(lambda q, k, c, m: attn.attend(
            q, k, -k, c, m, scale=0.3, backend=backend, fused_kv_write=True))(q, kn, cache, md)
    np.testing.assert_array_equal(np.asarray(outs["pallas"][1].k), np.asarray(outs["xla"][1].k))
    np.testing.assert_array_equal(np.asarray(outs["pallas"][1].v), np.asarray(outs["xla"][1].v))
    assert_close(outs["pallas"][0], outs["xla"][0], 1e-5, "attend fused vs xla")

    def fused(mode, pays=None, write_kernel=True):
        if pays is not None:
            monkeypatch.setattr(attn, "fused_write_pays", lambda *a, **kw: pays)
        text = str(jax.make_jaxpr(lambda q, k, c, m: attn.attend(
            q, k, k, c, m, scale=0.3, backend="pallas", fused_kv_write=mode,
            kv_write_kernel=write_kernel))(q, kn, cache, md))
        # unfused: one write kernel, or (kv_write_kernel=False) two scatters
        unfused = "paged_kv_write" if write_kernel else "scatter"
        assert ("paged_attention_write" in text) != (unfused in text)
        assert not write_kernel or "scatter" not in text
        return "paged_attention_write" in text

    assert fused(True) and not fused(False)
    assert fused("auto", pays=True) and not fused("auto", pays=False)
    assert not fused(False, write_kernel=False)
    for bad in ("1", "0", 1, None, "on"):
        with pytest.raises(ValueError, match="fused_kv_write must be 'auto', True or False"):
            attn.attend(q, kn, kn, cache, md, scale=0.3, fused_kv_write=bad)
    for bad in ("1", 1, None, "auto"):
        with pytest.raises(ValueError, match="kv_write_kernel must be True or False"):
            attn.attend(q, kn, kn, cache, md, scale=0.3, kv_write_kernel=bad)
    # the unfused pallas path (the write kernel, then attention) == the xla backend
    out, wc = jax.jit(lambda q, k, c, m: attn.attend(
        q, k, -k, c, m, scale=0.3, backend="pallas", fused_kv_write=False))(q, kn, cache, md)
    np.testing.assert_array_equal(np.asarray(wc.k), np.asarray(outs["xla"][1].k))
    np.testing.assert_array_equal(np.asarray(wc.v), np.asarray(outs["xla"][1].v))
    assert_close(out, outs["xla"][0], 1e-5, "attend (write kernel) vs xla")
    qkv = jnp.concatenate([q, kn, kn], axis=1)
    args = (cache.k, cache.v, md.slot_mapping, md.query_start_loc, md.seq_lens, md.block_table)
    kw = dict(scale=0.3, max_query_len=cfg.qmax)
    with pytest.raises(ValueError, match="dtype"):
        pk.paged_attention_write(qkv.astype(jnp.bfloat16), *args, **kw)
    with pytest.raises(ValueError, match="num_kv_heads"):
        pk.paged_attention_write(q[:, :2], *args, **kw)
    with pytest.raises(ValueError, match="slot_mapping"):
        pk.paged_attention_write(qkv, cache.k, cache.v, md.slot_mapping[:3], *args[3:], **kw)


def test_oracle_matches_reference_on_a_tree():
    """The oracle itself against the reference (so the tree semantics are pinned twice)."""
    cfg = CPU_CFGS["f32-g2-tree"]
    q, cache, md = make_case(cfg, 5, random_tree(np.random.default_rng(3), cfg.qmax))
    want = oracle(q, cache, md, 0.3)
    got = jax.jit(lambda q, c, m: attn.paged_attention_xla(q, c, m, scale=0.3))(q, cache, md)
    assert_close(got, want, 1e-5, "reference")


def test_splits_agree():
    """Split-K gives the no-split result (the merge is exact up to rounding), also with more
    splits than a request has tiles (empty splits)."""
    cfg = dataclasses.replace(CPU_CFGS["f32-g1-causal"], num_splits=1)
    q, cache, md = make_case(cfg, 11)
    base = run_kernel(cfg, q, cache, md, 0.25)
    for s in (8,):         # 8 splits > the 2 tiles of a full request
        assert_close(run_kernel(cfg, q, cache, md, 0.25, num_splits=s), base, 1e-5, f"splits={s}")


def test_empty_batch_and_all_padding():
    cfg = CPU_CFGS["f32-g1-causal"]
    q, cache, md = make_case(cfg, 1)
    md0 = CommonAttentionMetadata.from_query_lens(
        [], [], np.zeros((0, cfg.width), np.int32), block_size=cfg.bs, num_reqs_pad=cfg.b_pad,
        num_tokens_pad=cfg.t_pad, max_query_len=cfg.qmax)
    out = run_kernel(cfg, q, cache, md0, 0.25)
    assert np.all(np.asarray(out) == 0)


def test_default_num_splits():
    assert pk.default_num_splits(64, 8, 32, num_sms=132) == 1
    assert pk.default_num_splits(8, 8, 32, num_sms=132) == 8      # >= 3 programs per SM
    assert pk.default_num_splits(32, 8, 32, num_sms=132) == 2
    assert pk.default_num_splits(48, 8, 32, num_sms=132) == 2
    # the kernel that also writes the K/V: >= 1 program per SM
    assert pk.default_num_splits(8, 8, 32, num_sms=132, fused_write=True) == 4
    assert pk.default_num_splits(32, 8, 32, num_sms=132, fused_write=True) == 1
    assert pk.default_num_splits(1, 8, 32, num_sms=132, fused_write=True) == 16
    assert pk.default_num_splits(1, 8, 32, num_sms=132) == 16
    assert pk.default_num_splits(1, 8, 4, num_sms=132) == 2     # at least two tiles a split
    assert pk.default_num_splits(1, 8, 1, num_sms=132) == 1
    # the fused K/V write is chosen exactly where a request's context is split (the
    # measured B = 1 / 8 wins, the B = 64 loss of an 8-kv-head model with a 2k context)
    assert pk.fused_write_pays(1, 8, 2048, num_sms=132)
    assert pk.fused_write_pays(8, 8, 2048, num_sms=132)
    assert not pk.fused_write_pays(64, 8, 2048, num_sms=132)
    assert not pk.fused_write_pays(32, 8, 2048, num_sms=132)      # measured: unfused faster
    assert not pk.fused_write_pays(1, 8, 64, num_sms=132)          # one tile: one split
    assert pk.fused_write_pays(16, 8, 2048, num_sms=132) == (
        pk.default_num_splits(16, 8, 32, num_sms=132, fused_write=True) > 1)


def test_unsupported_shapes():
    ok = dict(num_heads=32, num_kv_heads=8, head_dim=128, max_query_len=4)
    assert pk.unsupported_reason(**ok) is None
    assert "head_dim" in pk.unsupported_reason(**dict(ok, head_dim=80))
    assert "rows" in pk.unsupported_reason(**dict(ok, max_query_len=64))
    assert "tree_mask" in pk.unsupported_reason(**ok, tree_mask=((True,),) * 40)
    cfg = CPU_CFGS["f32-g1-causal"]
    q, cache, md = make_case(cfg, 1)
    with pytest.raises(ValueError, match="head_dim"):
        pk.paged_attention(q[..., :8], cache.k[..., :8], cache.v[..., :8], md.query_start_loc,
                           md.seq_lens, md.block_table, scale=1.0, max_query_len=cfg.qmax)


@pytest.mark.smoke
@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")
def test_triton_lowering_on_cpu(monkeypatch):
    """Lower the non-interpreted kernel to Triton IR for an H200 on the CPU (no PTX): catches
    what interpret mode does not check (power-of-two tensors, unsupported primitives)."""
    from triton_lowering import fake_h200

    fake_h200(monkeypatch)     # (JAX 0.10.2 lowers for Hopper when it sees no GPU)
    sds = jax.ShapeDtypeStruct
    for b, qmax, nh, tree, dt in [(64, 4, 32, None, jnp.bfloat16), (1, 1, 32, None, jnp.bfloat16),
                                  (8, 3, 8, ((True, False, False), (True, True, False),
                                             (True, False, True)), jnp.float32)]:
        i32 = lambda *s: sds(s, jnp.int32)  # noqa: E731
        fn = pk.paged_attention.trace(
            sds((b * qmax, nh, 128), dt), sds((b * 128, 16, 8, 128), dt),
            sds((b * 128, 16, 8, 128), dt), i32(b + 1), i32(b), i32(b, 128), scale=0.1,
            max_query_len=qmax, tree_mask=tree, interpret=False)
        text = fn.lower(lowering_platforms=("cuda",)).as_text()
        assert "xla.gpu.triton" in text
        # the fused-write kernel: qkv with 8 + 8 extra heads, the caches aliased to outputs
        fw = pk.paged_attention_write.trace(
            sds((b * qmax, nh + 16, 128), dt), sds((b * 128, 16, 8, 128), dt),
            sds((b * 128, 16, 8, 128), dt), i32(b * qmax), i32(b + 1), i32(b), i32(b, 128),
            scale=0.1, max_query_len=qmax, tree_mask=tree, interpret=False)
        assert "xla.gpu.triton" in fw.lower(lowering_platforms=("cuda",)).as_text()
        kw = pk.write_kv.trace(
            sds((b * 128, 16, 8, 128), dt), sds((b * 128, 16, 8, 128), dt),
            sds((b * qmax, 8, 128), dt), sds((b * qmax, 8, 128), dt), i32(b * qmax),
            interpret=False)
        assert "xla.gpu.triton" in kw.lower(lowering_platforms=("cuda",)).as_text()


# ----------------------------------------------------------------------------------------
# the backend switch in kernels/paged_attention/__init__.py


@pytest.mark.smoke
def test_default_backend_on_cpu_is_xla():
    cfg = CPU_CFGS["f32-g1-causal"]
    q, cache, md = make_case(cfg, 2)
    assert K.get_default_backend() == "auto"
    if not ON_GPU:
        assert attn.resolve_attention_backend(q.shape, cache.k.shape, md) == "xla"
    with K.default_backend("pallas"):
        assert attn.resolve_attention_backend(q.shape, cache.k.shape, md) == "pallas"
        # unsupported shapes fall back to the reference
        assert attn.resolve_attention_backend((4, 2, 8), (9, 4, 2, 8), md) == "xla"
        # past the decode kernel's rows: flash.py's kernel (tests/kernels/test_flash_attention.py)
        big = md.replace(max_query_len=200)
        assert attn.resolve_attention_backend(q.shape, cache.k.shape, big) == "pallas"
        assert attn.resolve_attention_backend((14, 2, 48), (9, 4, 2, 48), big) == "xla"
    with K.default_backend("xla"):
        assert attn.resolve_attention_backend(q.shape, cache.k.shape, md) == "xla"
    # "auto" on the GPU: the flash kernel once a prefill exceeds the decode kernel's rows,
    # the reference between AUTO_MAX_QUERY_LEN and that, and on shapes flash cannot take
    import unittest.mock as um

    with um.patch.object(attn, "_platform", lambda: "gpu"), \
            um.patch.object(attn._compat, "pallas_triton", lambda: (object(), None)):
        big = md.replace(max_query_len=200)
        assert attn.resolve_attention_backend(q.shape, cache.k.shape, big) == "pallas"
        assert attn.resolve_attention_backend(q.shape, cache.k.shape,
                                              md.replace(max_query_len=17)) == "xla"
        assert attn.resolve_attention_backend((14, 2, 48), (9, 4, 2, 48), big) == "xla"
    with K.default_backend("triton"):
        # unsupported shapes fall back to the reference here too; supported ones need a GPU
        assert attn.resolve_attention_backend((4, 2, 8), (9, 4, 2, 8), md) == "xla"
        if ON_GPU:
            assert attn.resolve_attention_backend(q.shape, cache.k.shape, md) == "triton"
        else:
            with pytest.raises(ValueError, match="attention backend 'triton' is unavailable: "
                                                 "no NVIDIA GPU"):
                attn.resolve_attention_backend(q.shape, cache.k.shape, md)
    with pytest.raises(ValueError, match="attention backend must be one of"):
        attn.resolve_attention_backend(q.shape, cache.k.shape, md, backend="mosaic")


def test_kernel_config_defaults_and_errors():
    """The static configuration both kernels (Pallas, Triton) take from ``kernel_config``:
    defaults filled in, bad knobs and shapes refused by name."""
    kw = dict(num_heads=32, num_kv_heads=8, head_dim=128, block_size=16, max_blocks=64,
              max_query_len=1, tree_mask=None, dtype=jnp.bfloat16, block_k=None,
              num_splits=None, num_warps=None)
    # B = 1: 1024 keys = 16 tiles of 64, 8 kv heads -> 8 splits (capped at half the tiles)
    assert pk.kernel_config("pallas", batch=1, **kw) == (4, 16, 64, 8, 4)
    assert pk.kernel_config("pallas", batch=64, **kw) == (4, 16, 64, 1, 4)
    # B = 8: three programs per SM want eight splits (the cap here); the fused write, four
    assert pk.kernel_config("triton", batch=8, **dict(kw, max_query_len=16))[1:] == (64, 64, 8, 8)
    assert pk.kernel_config("pallas", batch=8, fused_write=True,
                            **dict(kw, max_query_len=16))[1:] == (64, 64, 4, 8)
    for bad, match in ((dict(block_k=24), "block_k=24 must be a power of two >= 16"),
                       (dict(block_k=8), "block_k=8 must be a power of two >= 16"),
                       (dict(num_splits=0), "num_splits=0 must be >= 1"),
                       (dict(head_dim=96), r"paged_attention \(triton\): unsupported shapes: head_dim")):
        with pytest.raises(ValueError, match=match):
            pk.kernel_config("triton", batch=1, **dict(kw, **bad))

def _interpreter_ready() -> str | None:
    """Why the Triton interpreter check cannot run here, or None."""
    probe = ("import numpy, triton, torch; "
             "v = tuple(int(x) for x in numpy.__version__.split('.')[:2]); "
             "assert v < (2, 4), 'numpy ' + numpy.__version__")
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    return None if r.returncode == 0 else (r.stderr.strip().splitlines() or ["?"])[-1]


@pytest.mark.skipif(_interpreter_ready() is not None,
                    reason=f"needs triton, torch and numpy < 2.4: {_interpreter_ready()}")
def test_triton_kernel_under_the_interpreter():
    """The jax-triton paged-attention kernels, launched under Triton's interpreter
    (``TRITON_INTERPRET=1``, in a subprocess: it must be set before triton is imported)
    on every float32 CPU configuration: equal to the NumPy oracle to 1e-5, padding tokens
    zero, an empty batch all zeros, and the float32 sliding-window / sink cases of
    test_window_sinks_kernels.py (``tests/support/triton_interpret_paged_attention.py``)."""
    import test_window_sinks_kernels as wsk

    cases = (2 * sum(c.dtype == "float32" for c in CPU_CFGS.values()) + 1
             + sum(w.cfg.dtype == "float32" for w in wsk.CASES.values()))
    run_interpreter("triton_interpret_paged_attention.py", f"triton interpreter: {cases} cases ok")


def run_interpreter(script: str, done: str) -> None:
    """``tests/support/<script>`` under Triton's interpreter (``TRITON_INTERPRET=1`` set
    before triton is imported, so in a subprocess); it must exit 0 and print ``done``."""
    env = dict(os.environ, TRITON_INTERPRET="1", JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, str(suite_paths.SUPPORT / script)], env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert done in r.stdout, r.stdout

@pytest.mark.smoke
def test_switch_retraces_jitted_callers():
    """``attend`` (what the model layers call) under one ``jax.jit``: the backend is part of
    the jit cache key, so switching it retraces and each backend gives its own result."""
    cfg = CPU_CFGS["f32-g1-causal"]
    q, cache, md = make_case(cfg, 3)
    rng = np.random.default_rng(0)
    k_new = jnp.asarray(rng.standard_normal((cfg.t_pad, cfg.nkv, cfg.hd)), jnp.float32)
    traces = []

    @jax.jit
    def step(q, k, v, cache, md):
        traces.append(attn.resolve_attention_backend(q.shape, cache.k.shape, md))
        return attn.attend(q, k, v, cache, md, scale=0.25)

    with K.default_backend("xla"):
        want, c_want = step(q, k_new, k_new, cache, md)
    with K.default_backend("pallas"):
        got, c_got = step(q, k_new, k_new, cache, md)
        step(q, k_new, k_new, cache, md)
    assert traces == ["xla", "pallas"]
    np.testing.assert_array_equal(np.asarray(c_got.k), np.asarray(c_want.k))
    assert_close(got, want, 1e-5, "attend pallas vs xla")


def test_decoder_forward_pallas_equals_xla():
    """A small Qwen3-style decoder (head_dim 16, GQA 2) through the unchanged model call
    sites: a prefill chunk then a decode step, every attention through each backend."""
    from specjax.models import registry

    cfg = registry.config_from_hf("qwen3", dict(
        hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, num_hidden_layers=2, vocab_size=64, rms_norm_eps=1e-5))
    params = registry.params_from_tensors("qwen3", cfg, registry.random_tensors("qwen3", cfg, seed=1),
                                          jnp.float32)
    model = registry.make_model("qwen3", cfg)
    fwd = jax.jit(model.forward)
    rng = np.random.default_rng(0)
    table = rng.permutation(24)[:12].reshape(3, 4)
    steps = [([4, 3, 6], [4, 3, 6]), ([1, 1, 0], [5, 4, 6])]
    ids = [jnp.asarray(rng.integers(0, 64, 16), jnp.int32) for _ in steps]
    outs = {}
    for backend in ("xla", "pallas"):
        caches = model.init_kv_caches(24, 4)
        hs = []
        with K.default_backend(backend):
            for (qlens, seqs), ids_s in zip(steps, ids):
                md = CommonAttentionMetadata.from_query_lens(
                    qlens, seqs, table, block_size=4, num_reqs_pad=4, num_tokens_pad=16,
                    max_query_len=8)
                assert attn.resolve_attention_backend((16, 4, 16), (24, 4, 2, 16), md) == backend
                pos = np.zeros(16, np.int32)
                pos[: sum(qlens)] = np.concatenate([np.arange(s - q, s) for q, s in zip(qlens, seqs)])
                hidden, _, caches = fwd(params, ids_s, jnp.asarray(pos), caches, md)
                hs.append(np.asarray(hidden[: sum(qlens)]))
        outs[backend] = hs
    for i, (got, want) in enumerate(zip(outs["pallas"], outs["xla"])):
        assert_close(got, want, 2e-5 * max(1.0, float(np.abs(want).max())), f"step {i} hidden")


# ----------------------------------------------------------------------------------------
# GPU: the compiled Triton kernel on H200-sized shapes


def _gpu_case(b, qlen, ctx, seed, dtype=jnp.bfloat16, causal=True, tree=None, width=128,
              ragged=True):
    rng = np.random.default_rng(seed)
    nh, nkv, hd, bs = 32, 8, 128, 16
    qlens = np.full(b, qlen)
    if ragged and b > 1:
        qlens[rng.integers(0, b)] = 0                          # an empty request
        seqs = np.clip(ctx + rng.integers(-ctx // 2, ctx // 2 + 1, b), qlens, width * bs)
        seqs[0] = width * bs                                   # one at the capacity
    else:
        seqs = np.full(b, ctx)
    nb = b * width + 3
    table = rng.permutation(nb)[: b * width].reshape(b, width)
    md = CommonAttentionMetadata.from_query_lens(
        qlens, seqs, table, block_size=bs, num_reqs_pad=b + (b > 1), num_tokens_pad=b * qlen + 2,
        max_query_len=qlen, causal=causal)
    if tree is not None:
        md = md.replace(tree_mask=tree)
    k = jax.random.normal(jax.random.key(seed), (nb, bs, nkv, hd), jnp.float32).astype(dtype)
    v = jax.random.normal(jax.random.key(seed + 1), (nb, bs, nkv, hd), jnp.float32).astype(dtype)
    q = jax.random.normal(jax.random.key(seed + 2), (b * qlen + 2, nh, hd), jnp.float32).astype(dtype)
    return q, KVCache(k, v), md


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")
@pytest.mark.parametrize("b", [1, 8, 64])
@pytest.mark.parametrize("qlen", [1, 4])
@pytest.mark.parametrize("mask", ["causal", "noncausal", "tree"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("backend", ["pallas", "triton"])
def test_gpu_kernel_matches_reference(b, qlen, mask, dtype, backend):
    """The compiled kernel of ``backend`` (the Pallas one, or the jax-triton one of
    ``kernels/paged_attention/triton.py``) against the float32 reference; the Triton one
    also against the Pallas kernel."""
    if mask == "tree" and qlen == 1:
        pytest.skip("a one-node tree is the causal case")
    tree = random_tree(np.random.default_rng(b), qlen) if mask == "tree" else None
    q, cache, md = _gpu_case(b, qlen, 1024, seed=b + qlen, dtype=jnp.dtype(dtype),
                             causal=mask != "noncausal", tree=tree)
    scale = 128 ** -0.5
    kw = dict(scale=scale, max_query_len=md.max_query_len, causal=md.causal,
              tree_mask=md.tree_mask)
    with jax.default_matmul_precision("highest"):       # an IEEE float32 reference
        want = jax.jit(lambda q, c, m: attn.paged_attention_xla(q, c, m, scale=scale))(q, cache, md)
    pallas = jax.jit(lambda q, c, m: pk.paged_attention(
        q, c.k, c.v, m.query_start_loc, m.seq_lens, m.block_table, **kw))
    kernel = pallas
    if backend == "triton":
        from specjax.kernels.paged_attention import triton as tk

        kernel = jax.jit(lambda q, c, m: tk.paged_attention(
            q, c.k, c.v, m.query_start_loc, m.seq_lens, m.block_table, **kw))
        assert "triton_kernel_call" in kernel.lower(q, cache, md).as_text()
    got = kernel(q, cache, md)
    tol = 2e-5 if dtype == "float32" else 2e-2
    assert_close(got, want, tol, f"{backend} B={b} q={qlen} {mask} {dtype}")
    end = int(md.query_start_loc[-1])
    assert np.all(np.asarray(got[end:], np.float32) == 0)
    if backend == "triton":
        assert_close(got, pallas(q, cache, md), tol, f"triton vs pallas B={b} q={qlen} {mask} {dtype}")


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")
@pytest.mark.parametrize("b", [1, 32])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_gpu_write_kv_equals_scatter(b, dtype):
    """The compiled cache-write kernel == two scatters, bit for bit, with unwritten (-1) and
    out-of-range slots, under a jit that donates the caches (in place)."""
    q, cache, md = _gpu_case(b, 4, 1024, seed=5 * b, dtype=jnp.dtype(dtype))
    sm = np.asarray(md.slot_mapping).copy()
    rng = np.random.default_rng(b)
    sm[rng.random(sm.shape[0]) < 0.1] = -1
    sm[rng.random(sm.shape[0]) < 0.05] = cache.k.shape[0] * cache.k.shape[1] + 7
    nkv = cache.k.shape[2]
    kv = jax.random.normal(jax.random.key(b), (q.shape[0], 2 * nkv, q.shape[2])).astype(q.dtype)
    want = jax.jit(attn.write_kv)(cache, kv[:, :nkv], kv[:, nkv:], jnp.asarray(sm))
    got = jax.jit(lambda c, k, v, s: pk.write_kv(c.k, c.v, k, v, s), donate_argnums=0)(
        KVCache(jnp.array(cache.k, copy=True), jnp.array(cache.v, copy=True)),
        kv[:, :nkv], kv[:, nkv:], jnp.asarray(sm))
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want.k))
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want.v))


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")
@pytest.mark.parametrize("b", [1, 8, 64])
@pytest.mark.parametrize("qlen", [1, 4])
@pytest.mark.parametrize("mask", ["causal", "tree"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_gpu_fused_write_equals_unfused(b, qlen, mask, dtype):
    """The compiled fused-write kernel == scatter then the compiled kernel, bit for bit
    (caches and outputs), with unwritten (-1) slots among the requests' tokens. Both run
    the fused kernel's default context split (the kernel alone defaults to more splits,
    which sums the context in another order)."""
    if mask == "tree" and qlen == 1:
        pytest.skip("a one-node tree is the causal case")
    tree = random_tree(np.random.default_rng(b), qlen) if mask == "tree" else None
    q, cache, md = _gpu_case(b, qlen, 1024, seed=3 * b + qlen, dtype=jnp.dtype(dtype),
                             tree=tree)
    sm = np.asarray(md.slot_mapping).copy()
    sm[np.random.default_rng(b).random(sm.shape[0]) < 0.1] = -1
    md = md.replace(slot_mapping=jnp.asarray(sm))
    nkv = cache.k.shape[2]
    kv = jax.random.normal(jax.random.key(b), (q.shape[0], 2 * nkv, q.shape[2])).astype(q.dtype)
    scale = 128 ** -0.5
    splits = pk.default_num_splits(md.query_start_loc.shape[0] - 1, nkv,
                                   md.block_table.shape[1] * cache.k.shape[1] // 64,
                                   fused_write=True)
    kw = dict(scale=scale, max_query_len=md.max_query_len, causal=md.causal,
              tree_mask=md.tree_mask, num_splits=splits)

    @jax.jit
    def unfused(q, kv, c, m):
        c = attn.write_kv(c, kv[:, :nkv], kv[:, nkv:], m.slot_mapping)
        return pk.paged_attention(q, c.k, c.v, m.query_start_loc, m.seq_lens, m.block_table,
                                  **kw), c

    @jax.jit
    def fused(q, kv, c, m):
        return pk.paged_attention_write(jnp.concatenate([q, kv], axis=1), c.k, c.v,
                                        m.slot_mapping, m.query_start_loc, m.seq_lens,
                                        m.block_table, **kw)

    want, wc = unfused(q, kv, cache, md)
    got, (gk, gv) = fused(q, kv, cache, md)
    np.testing.assert_array_equal(np.asarray(gk), np.asarray(wc.k))
    np.testing.assert_array_equal(np.asarray(gv), np.asarray(wc.v))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.gpu
@pytest.mark.skipif(jax.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")
@pytest.mark.parametrize("b", [1, 8, 64])
@pytest.mark.parametrize("backend,fused", [("auto", False), ("auto", True), ("triton", False)])
def test_gpu_kernel_split_by_kv_heads_over_two_gpus(b, backend, fused):
    """``attend`` under tensor parallelism on 2 GPUs (q heads and caches split by kv
    heads): no collective in the program, caches still split, and every device's output
    and cache shard bit-identical to the compiled kernel run on that device's heads alone
    (the same kernel configuration: splits follow the local kv-head count)."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    q, cache, md = _gpu_case(b, 1, 1024, seed=40 + b)
    nh, nkv = q.shape[1], cache.k.shape[2]
    kv = jax.random.normal(jax.random.key(b), (q.shape[0], 2 * nkv, q.shape[2])).astype(q.dtype)
    k, v = kv[:, :nkv], kv[:, nkv:]
    scale = 128 ** -0.5

    def step(q, k, v, kc, vc, md):
        out, c = attn.attend(q, k, v, KVCache(kc, vc), md, scale=scale, backend=backend,
                             fused_kv_write=fused)
        return out, c.k, c.v

    mesh = Mesh(np.array(jax.devices()[:2]), ("tp",))
    heads = NamedSharding(mesh, P(None, "tp", None))
    caches = NamedSharding(mesh, P(None, None, "tp", None))
    args = [jax.device_put(x, s) for x, s in
            zip((q, k, v, cache.k, cache.v), [heads] * 3 + [caches] * 2)]
    md2 = jax.device_put(md, NamedSharding(mesh, P()))
    compiled = jax.jit(step).lower(*args, md2).compile()
    got = compiled(*args, md2)
    hlo = compiled.as_text()
    assert ("triton_kernel_call" if backend == "triton" else "xla.gpu.triton") in hlo
    for op in ("all-reduce", "all-gather", "collective-permute", "all-to-all"):
        assert op not in hlo, op
    assert got[1].sharding.is_equivalent_to(caches, 4)
    one = jax.jit(step)
    for i in range(2):
        h, g = slice(i * nh // 2, (i + 1) * nh // 2), slice(i * nkv // 2, (i + 1) * nkv // 2)
        want = one(q[:, h], k[:, g], v[:, g], cache.k[:, :, g], cache.v[:, :, g], md)
        np.testing.assert_array_equal(np.asarray(got[0][:, h]), np.asarray(want[0]))
        np.testing.assert_array_equal(np.asarray(got[1][:, :, g]), np.asarray(want[1]))
        np.testing.assert_array_equal(np.asarray(got[2][:, :, g]), np.asarray(want[2]))
    # and close to the whole attention on one device
    whole = one(q, k, v, cache.k, cache.v, md)
    assert_close(got[0], whole[0], 2e-2, f"B={b} fused={fused} vs one device")

#: Llama-3.1-8B-shaped EAGLE-3 head (as benchmarks/proposers.py): H, I, heads, kv heads,
#: head_dim, target vocab, draft vocab, block size.
EAGLE3_8B = (4096, 14336, 32, 8, 128, 128256, 32000, 16)


@functools.lru_cache(maxsize=None)
def _eagle3_setup(dtype, geo):
    """Model, config and random params of the EAGLE-3 head (cached across batch sizes)."""
    from specjax.models import registry, share_target_weights

    H, I, NH, NKV, HD, V, VD, BS = geo
    cfg = registry.config_from_hf("eagle3", dict(
        hidden_size=H, intermediate_size=I, num_attention_heads=NH, num_key_value_heads=NKV,
        head_dim=HD, num_hidden_layers=1, vocab_size=V, draft_vocab_size=VD, rms_norm_eps=1e-5,
        rope_theta=500000.0, has_d2t=True, eagle_aux_hidden_state_layer_ids=[2, 16, 29]))
    abstract = registry.abstract_params("eagle3", cfg, dtype)
    leaves, tree = jax.tree_util.tree_flatten(abstract)
    keys = jax.random.split(jax.random.key(0), len(leaves))
    own = jax.tree_util.tree_unflatten(tree, [
        jnp.zeros(a.shape, a.dtype) if jnp.issubdtype(a.dtype, jnp.integer)
        else (jax.random.normal(kk, a.shape, jnp.float32) * 0.02).astype(a.dtype)
        for kk, a in zip(keys, leaves)])
    target = {"embed_tokens": {"embedding": (jax.random.normal(jax.random.key(1), (V, H))
                                             * 0.02).astype(dtype)}}
    return registry.make_model("eagle3", cfg), share_target_weights(own, target)


def _eagle3_drafts(b, dtype, backend, k=3, ctx=1024, geo=EAGLE3_8B):
    """Drafts of one EAGLE-3 propose with a Llama-3.1-8B-shaped head (benchmarks/proposers.py's
    setup, random weights), every attention through ``backend``."""
    from specjax.config import SpeculativeConfig
    from specjax.proposers.types import ProposerInputs
    from specjax.proposers.eagle import EagleProposer

    H, I, NH, NKV, HD, V, VD, BS = geo
    model, params = _eagle3_setup(jnp.dtype(dtype), geo)
    q = k + 1
    width = -(-(ctx + k + 8) // BS)
    width = 1 << (width - 1).bit_length()
    prop = EagleProposer(SpeculativeConfig(method="eagle3", num_speculative_tokens=k), model,
                         block_size=BS, max_model_len=width * BS, kernel_backend="xla")
    rng = np.random.default_rng(0)
    # a random context in the draft cache, so that the attention reads real values
    state = prop.init_state(b * width, dtype)
    def rand(a, seed):
        return (jax.random.normal(jax.random.key(seed), a.shape) * 0.5).astype(a.dtype)

    state = state._replace(kv_caches=[KVCache(rand(c.k, 10 + i), rand(c.v, 20 + i))
                                      for i, c in enumerate(state.kv_caches)])
    table = np.arange(b * width, dtype=np.int32).reshape(b, width)
    md = CommonAttentionMetadata.from_query_lens([q] * b, [ctx] * b, table, block_size=BS)
    inputs = ProposerInputs(
        target_token_ids=jnp.asarray(rng.integers(0, V, b * q), jnp.int32),
        target_positions=jnp.asarray(np.tile(np.arange(ctx - q, ctx, dtype=np.int32), b)),
        target_hidden_states=None,
        aux_hidden_states=(jax.random.normal(jax.random.key(2), (b * q, 3, H)).astype(dtype)),
        next_token_ids=jnp.asarray(rng.integers(0, V, b), jnp.int32),
        token_indices_to_sample=jnp.asarray(np.arange(1, b + 1) * q - 1, jnp.int32),
        num_rejected_tokens=jnp.zeros(b, jnp.int32),
        attn_metadata=md)
    with K.default_backend(backend):
        used = attn.resolve_attention_backend((b * q, NH, HD), (b * width, BS, NKV, HD), md, dtype)
        out, _ = prop.propose(params, state, inputs)
    return np.asarray(out.token_ids), used


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")
@pytest.mark.parametrize("b", [1, 8, 64])
@pytest.mark.parametrize("backend", ["pallas", "triton"])
def test_gpu_eagle3_propose_pallas_equals_xla(b, backend):
    # float32 with IEEE matmuls everywhere: the backends agree to ~1e-6, so the greedy drafts
    # must be identical
    with jax.default_matmul_precision("highest"):
        want, used_x = _eagle3_drafts(b, jnp.float32, "xla")
        got, used_p = _eagle3_drafts(b, jnp.float32, backend)
    assert (used_x, used_p) == ("xla", backend)
    np.testing.assert_array_equal(got, want)
    # bfloat16: the attention outputs differ by bf16 rounding, which can flip a near-tied
    # argmax of random weights now and then
    want16, _ = _eagle3_drafts(b, jnp.bfloat16, "xla")
    got16, _ = _eagle3_drafts(b, jnp.bfloat16, backend)
    agree = float(np.mean(got16 == want16))
    print(f"B={b}: bf16 drafts agree on {agree:.1%} of {got16.size}")
    assert agree >= 0.9, f"bf16 drafts agree on only {agree:.1%}"

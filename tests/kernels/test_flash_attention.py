"""The flash-attention kernel over the paged cache (kernels/paged_attention/flash.py) against
the jnp reference (kernels/paged_attention/reference.py) and a NumPy float64 oracle.

CPU: the kernel runs in Pallas interpret mode on random ragged batches built to hit what
matters in one launch: prefill chunks from position 0 and after computed tokens, decode
rows, draft chains and trees, empty requests, padding tokens; query lengths at and around
the query tile (``tq`` tokens) and contexts at and around page and key-block boundaries;
junk block-table entries past each request's pages; float32 and bfloat16 KV, head_dim 32
to 256, GQA groups 1 to 8 (3: not a power of two), block sizes below, at and above the key
block. The sliding window and the sink logits (not in the reference) are checked against
the oracle only. Each configuration compiles once (1-3 s) and runs two batches. Also: the
Triton lowering for an H200 (no PTX), no ``[Q, C]`` array in the traced program, the
backend switch (``backend="pallas"`` past the decode kernel's rows; ``"auto"``
unchanged), and the kv-head split on 2 fake CPU devices.

float32 is compared to 1e-5, bfloat16 to bfloat16 rounding (the kernel sums in another
order than the reference and rescales per key block).
"""

from __future__ import annotations

import suite_paths  # tests/support: where the suite's pieces are
from triton_lowering import fake_h200
import dataclasses
import functools
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax.kernels as K
from specjax.attention_metadata import CommonAttentionMetadata
from specjax.kernels import paged_attention as attn
from specjax.kernels.paged_attention import KVCache
from specjax.kernels.paged_attention import flash
from test_paged_attention import random_tree

ROOT = str(suite_paths.ROOT)


@pytest.fixture(autouse=True)
def _ieee_float32_matmuls():
    """IEEE float32 products for the reference, as the kernel's."""
    with jax.default_matmul_precision("highest"):
        yield


@dataclasses.dataclass(frozen=True)
class Case:
    nh: int
    nkv: int
    hd: int
    bs: int                 # page size
    width: int              # block-table width (context capacity = width * bs)
    t_pad: int
    b_pad: int
    qmax: int
    dtype: str = "float32"
    rows: int | None = None
    block_k: int | None = None
    causal: bool = True
    tree: int = 0           # tree size (0: no tree)
    window: int | None = None
    sinks: bool = False

    @property
    def group(self):
        return self.nh // self.nkv

    @property
    def tq(self):
        rows = flash.flash_config(head_dim=self.hd, group=self.group, rows=self.rows,
                                  max_query_len=self.qmax, block_k=self.block_k,
                                  num_kv_heads=self.nkv)[0]
        return rows // self.group


def make_batch(c: Case, seed: int):
    """``(q, cache, md, sinks)``: a ragged batch of ``c``'s shapes (module docstring)."""
    rng = np.random.default_rng(seed)
    cap = c.width * c.bs
    bk = c.block_k or 64
    tq = c.tq
    qlens, seqs = [], []
    budget = c.t_pad - 2                                   # leave padding tokens
    while len(qlens) < c.b_pad - 1:
        if c.tree:
            qlen = int(rng.choice([c.tree, c.tree, 1, 0, c.tree - 1]))
        else:
            qlen = int(rng.choice([0, 1, 3, tq - 1, tq, tq + 1, 2 * tq, c.qmax]))
        qlen = max(0, min(qlen, c.qmax, budget - sum(qlens)))
        if rng.random() < 0.3:                              # a chunk from position 0
            seq = qlen
        else:                                               # after computed tokens
            edge = int(rng.choice([c.bs, bk, c.bs * 3, bk * 2]))
            seq = qlen + int(rng.choice([edge - 1, edge, edge + 1, int(rng.integers(0, cap))]))
        qlens.append(qlen)
        seqs.append(int(np.clip(seq, qlen, cap)))
    seqs[int(rng.integers(0, len(seqs)))] = cap            # one request at the capacity
    qlens = [min(q_, s) for q_, s in zip(qlens, seqs)]
    nb = c.b_pad * c.width + 5
    perm = rng.permutation(nb)[: len(qlens) * c.width].reshape(len(qlens), c.width)
    md = CommonAttentionMetadata.from_query_lens(
        qlens, seqs, perm, block_size=c.bs, num_reqs_pad=c.b_pad, num_tokens_pad=c.t_pad,
        max_query_len=c.qmax, causal=c.causal)
    table = np.asarray(md.block_table).copy()              # junk past each request's pages
    used = -(-np.asarray(md.seq_lens) // c.bs)
    junk = rng.integers(-3, nb + 5, size=table.shape)
    table = np.where(np.arange(c.width)[None, :] < used[:, None], table, junk)
    md = md.replace(block_table=jnp.asarray(table, jnp.int32))
    if c.tree:
        md = md.replace(tree_mask=random_tree(rng, c.tree))
    dt = jnp.dtype(c.dtype)
    f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32).astype(dt)  # noqa: E731
    cache = KVCache(f(nb, c.bs, c.nkv, c.hd), f(nb, c.bs, c.nkv, c.hd))
    sinks = jnp.asarray(rng.standard_normal(c.nh) + 1.0, jnp.float32) if c.sinks else None
    return f(c.t_pad, c.nh, c.hd), cache, md, sinks


def oracle(q, cache, md, scale, *, window=None, sinks=None):
    """NumPy float64 from the specification: each query's visible keys listed, then a
    softmax over their scores (and the head's sink logit, which has no value)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, cache.k, cache.v))
    bs, g = k.shape[1], q.shape[1] // k.shape[2]
    qsl, seq, bt = (np.asarray(x) for x in (md.query_start_loc, md.seq_lens, md.block_table))
    out = np.zeros_like(q)
    for r in range(len(seq)):
        qlen, s = qsl[r + 1] - qsl[r], int(seq[r])
        keys = np.arange(s)
        kr = k[bt[r, keys // bs], keys % bs]                 # [s, nkv, hd]
        vr = v[bt[r, keys // bs], keys % bs]
        for i in range(qlen):
            pos, rel = s - qlen + i, keys - (s - qlen)
            if md.tree_mask is not None:
                tm = np.asarray(md.tree_mask)
                ok = (rel < 0) | ((rel < len(tm)) & tm[min(i, len(tm) - 1)][np.clip(rel, 0, len(tm) - 1)])
            else:
                ok = keys <= pos if md.causal else np.ones(s, bool)
            if window is not None:
                ok = ok & (keys > pos - window)
            for h in range(q.shape[1]):
                sc = kr[ok, h // g] @ q[qsl[r] + i, h] * scale
                top = max(sc.max(initial=-np.inf), -np.inf if sinks is None else float(sinks[h]))
                den = np.exp(sc - top).sum() + (0 if sinks is None else np.exp(float(sinks[h]) - top))
                out[qsl[r] + i, h] = np.exp(sc - top) @ vr[ok, h // g] / den
    return out


def run(c: Case, q, cache, md, sinks, scale, **kw):
    return flash.paged_attention(
        q, cache.k, cache.v, md.query_start_loc, md.seq_lens, md.block_table, sinks,
        scale=scale, max_query_len=md.max_query_len, causal=md.causal, tree_mask=md.tree_mask,
        sliding_window=c.window, rows=c.rows, block_k=c.block_k, **kw)


def assert_close(got, want, tol, what):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    err = np.max(np.abs(got - want)) if got.size else 0.0
    assert err <= tol, f"{what}: max abs error {err:.3g} > {tol}"


def tolerance(dtype):
    return 1e-5 if dtype == "float32" else 2e-2


CASES = {
    # GQA 4, head_dim 64, 8-token tiles, pages of 8 under key blocks of 16
    "f32-hd64-g4": Case(nh=8, nkv=2, hd=64, bs=8, width=12, t_pad=72, b_pad=6, qmax=40,
                        rows=32, block_k=16),
    # GQA 8 (one kv head), head_dim 128, page == key block
    "bf16-hd128-g8": Case(nh=8, nkv=1, hd=128, bs=32, width=4, t_pad=56, b_pad=5, qmax=24,
                          dtype="bfloat16", rows=64, block_k=32),
    # head_dim 256, non-causal (DFlash), pages of 32 above key blocks of 16
    "f32-hd256-g2-noncausal": Case(nh=4, nkv=2, hd=256, bs=32, width=3, t_pad=40, b_pad=5,
                                   qmax=20, rows=16, block_k=16, causal=False),
    # GQA 3 (a 16-row tile holds 5 tokens), a 5-node tree (drafts), pages of 4
    "bf16-hd64-g3-tree": Case(nh=6, nkv=2, hd=64, bs=4, width=10, t_pad=24, b_pad=6, qmax=5,
                              dtype="bfloat16", rows=16, block_k=16, tree=5),
    # GQA 1, the default tile and key block (one 64-key block), longest chunk 48 tokens
    "f32-hd32-g1-defaults": Case(nh=2, nkv=2, hd=32, bs=16, width=8, t_pad=80, b_pad=4,
                                 qmax=48),
}


@pytest.mark.smoke
@pytest.mark.parametrize("name", list(CASES))
def test_kernel_matches_reference_and_oracle(name):
    c = CASES[name]
    scale = c.hd ** -0.5
    ref = jax.jit(lambda q, cache, md: attn.paged_attention_xla(q, cache, md, scale=scale))
    for seed in range(2):
        q, cache, md, _ = make_batch(c, 10 * seed + len(name))
        got = run(c, q, cache, md, None, scale)
        assert got.shape == q.shape and got.dtype == q.dtype
        assert_close(got, ref(q, cache, md), tolerance(c.dtype), f"{name} seed {seed} vs reference")
        end = int(md.query_start_loc[-1])
        assert np.all(np.asarray(got[end:], np.float32) == 0), "padding tokens must be zeros"
        if seed == 0:
            assert_close(got, oracle(q, cache, md, scale), tolerance(c.dtype), f"{name} vs oracle")


def test_unread_cache_slots_may_hold_nan():
    """Slots no request reads as a key (past each ``seq_len`` in its last page, pages the
    table's junk entries point at) hold NaN: the output is finite and equals the oracle."""
    c = CASES["f32-hd64-g4"]
    q, cache, md, _ = make_batch(c, 5)
    bt, seqs = np.asarray(md.block_table), np.asarray(md.seq_lens)
    read = np.zeros(cache.k.shape[:2], bool)
    for r, s in enumerate(seqs):
        read[bt[r, np.arange(s) // c.bs], np.arange(s) % c.bs] = True
    assert not read.all()
    poison = lambda x: jnp.where(jnp.asarray(read)[:, :, None, None], x, jnp.nan)  # noqa: E731
    cache = KVCache(poison(cache.k), poison(cache.v))
    got = np.asarray(run(c, q, cache, md, None, c.hd ** -0.5))
    assert np.isfinite(got).all()
    assert_close(got, oracle(q, cache, md, c.hd ** -0.5), 1e-5, "NaN in unread slots")


WINDOW_CASES = {
    # causal, a 13-key window (not a key-block multiple), sinks, GQA 2
    "causal-window-sinks": Case(nh=4, nkv=2, hd=32, bs=8, width=8, t_pad=48, b_pad=5,
                                qmax=30, rows=16, block_k=16, window=13, sinks=True),
    # non-causal with a window; a tree with sinks
    "noncausal-window": Case(nh=2, nkv=1, hd=32, bs=8, width=6, t_pad=40, b_pad=4, qmax=20,
                             rows=32, block_k=16, causal=False, window=9),
    "tree-sinks": Case(nh=4, nkv=1, hd=32, bs=8, width=6, t_pad=24, b_pad=6, qmax=4,
                       rows=16, block_k=16, tree=4, sinks=True),
}


@pytest.mark.parametrize("name", list(WINDOW_CASES))
def test_sliding_window_and_sinks_match_the_oracle(name):
    """The sliding window (keys ``> qpos - window``) and per-head sink logits against the
    oracle; without either the same batch equals the reference."""
    c = WINDOW_CASES[name]
    for seed in range(2):
        q, cache, md, sinks = make_batch(c, 7 * seed + 1)
        got = run(c, q, cache, md, sinks, 0.3)
        assert_close(got, oracle(q, cache, md, 0.3, window=c.window, sinks=sinks), 1e-5,
                     f"{name} seed {seed}")
    assert not np.allclose(np.asarray(got), np.asarray(oracle(q, cache, md, 0.3)), atol=1e-3)


@pytest.mark.parametrize("name", list(WINDOW_CASES))
def test_reference_window_and_sinks_match_the_oracle(name):
    """The jnp reference's dense and tiled forms (tiles smaller than the window, so whole
    key chunks are skipped) and ``paged_attention`` on each backend take the window and
    sinks to the oracle."""
    from specjax.kernels.paged_attention import paged_attention
    from specjax.kernels.paged_attention.reference import paged_attention_xla

    c = WINDOW_CASES[name]
    for seed in range(2):
        q, cache, md, sinks = make_batch(c, 7 * seed + 3)
        want = oracle(q, cache, md, 0.3, window=c.window, sinks=sinks)
        for tiled, tile_q, chunk_k in ((False, None, None), (True, 4, 8), (True, 16, 16)):
            got = paged_attention_xla(q, cache, md, scale=0.3, sliding_window=c.window,
                                      sinks=sinks, tiled=tiled, tile_q=tile_q, chunk_k=chunk_k)
            assert_close(got, want, 1e-5, f"{name} seed {seed} tiled={tiled} {tile_q}x{chunk_k}")
        for backend in ("xla", "pallas"):
            got = paged_attention(q, cache, md, scale=0.3, backend=backend,
                                  sliding_window=c.window, sinks=sinks)
            assert_close(got, want, 1e-5, f"{name} seed {seed} backend={backend}")


def test_window_and_sinks_errors():
    from specjax.kernels.paged_attention import paged_attention

    q, cache, md, _ = make_batch(WINDOW_CASES["causal-window-sinks"], 1)
    with pytest.raises(ValueError, match="sliding_window must be None or an int >= 1"):
        paged_attention(q, cache, md, scale=0.3, sliding_window=0)
    with pytest.raises(ValueError, match=r"sinks must have shape \[num_heads\] = \[4\]"):
        paged_attention(q, cache, md, scale=0.3, sinks=jnp.zeros((3,)))


def test_no_query_by_context_array():
    """The traced program (the kernel's body included) holds no array of ``Q x C`` or more
    elements for a 4096-token prompt over 16384 keys: a program holds ``rows x block_k``
    scores."""
    sds = jax.ShapeDtypeStruct
    t, ctx, bs = 4096, 16384, 16
    jaxpr = jax.make_jaxpr(lambda *a: flash.paged_attention(
        *a, scale=0.1, max_query_len=t, interpret=False))(
        sds((t, 8, 64), jnp.bfloat16), sds((ctx // bs, bs, 2, 64), jnp.bfloat16),
        sds((ctx // bs, bs, 2, 64), jnp.bfloat16), sds((2,), jnp.int32), sds((1,), jnp.int32),
        sds((1, ctx // bs), jnp.int32))
    sizes = []

    def walk(jx):
        for eqn in jx.eqns:
            sizes.extend(int(np.prod(v.aval.shape)) for v in eqn.outvars if hasattr(v.aval, "shape"))
            for p in eqn.params.values():
                for sub in (p if isinstance(p, (tuple, list)) else [p]):
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        walk(inner)

    walk(jaxpr.jaxpr)
    assert "paged_flash_attention" in str(jaxpr)
    assert max(sizes) < t * ctx // 8, max(sizes)     # the output: t * 8 * 64
    assert max(sizes) == t * 8 * 64


@pytest.mark.smoke
@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")
def test_triton_lowering_for_h200_on_cpu(monkeypatch):
    """The non-interpreted kernel lowered to Triton IR for an H200 (no PTX): catches what
    interpret mode does not check (power-of-two tensors, unsupported primitives)."""
    fake_h200(monkeypatch)
    sds = jax.ShapeDtypeStruct
    i32 = lambda *s: sds(s, jnp.int32)  # noqa: E731
    tree = random_tree(np.random.default_rng(0), 6)
    for t, nh, nkv, hd, dt, kw in [
            (8192, 32, 8, 128, jnp.bfloat16, {}),                        # an 8B-shaped prefill
            (512, 8, 4, 256, jnp.float32, {}),
            (64, 32, 4, 64, jnp.bfloat16, dict(tree_mask=tree, sliding_window=128)),
            (2048, 16, 2, 128, jnp.float16, dict(sliding_window=4096, causal=False))]:
        sinks = sds((nh,), jnp.float32) if "sliding_window" in kw else None
        fn = flash.paged_attention.trace(
            sds((t, nh, hd), dt), sds((4096, 16, nkv, hd), dt), sds((4096, 16, nkv, hd), dt),
            i32(9), i32(8), i32(8, 512), sinks, scale=0.1, max_query_len=t, interpret=False,
            **kw)
        assert "xla.gpu.triton" in fn.lower(lowering_platforms=("cuda",)).as_text()


def test_errors():
    c = CASES["f32-hd64-g4"]
    q, cache, md, _ = make_batch(c, 0)
    args = (q, cache.k, cache.v, md.query_start_loc, md.seq_lens, md.block_table)
    kw = dict(scale=0.1, max_query_len=c.qmax)
    for extra, match in ((dict(rows=24), "rows=24 must be a power of two"),
                         (dict(rows=2 * flash.MAX_FLASH_ROWS), "rows="),
                         (dict(block_k=8), "block_k=8 must be a power of two"),
                         (dict(sliding_window=0), "sliding_window=0")):
        with pytest.raises(ValueError, match=match):
            flash.paged_attention(*args, **kw, **extra)
    with pytest.raises(ValueError, match=r"sinks \(3,\) must be \[num_heads\]"):
        flash.paged_attention(*args, jnp.zeros(3), **kw)
    with pytest.raises(ValueError, match="head_dim=48 is not a power of two"):
        flash.paged_attention(q[..., :48], cache.k[..., :48], cache.v[..., :48], *args[3:], **kw)
    assert "tree_mask" in flash.unsupported_reason(num_heads=8, num_kv_heads=2, head_dim=64,
                                                   tree_mask=((True,),) * 40)
    md0 = CommonAttentionMetadata.from_query_lens(
        [], [], np.zeros((0, c.width), np.int32), block_size=c.bs, num_reqs_pad=c.b_pad,
        num_tokens_pad=c.t_pad, max_query_len=c.qmax)
    out = flash.paged_attention(q, cache.k, cache.v, md0.query_start_loc, md0.seq_lens,
                                md0.block_table, **kw)
    assert np.all(np.asarray(out) == 0)


# ----------------------------------------------------------------------------------------
# the backend switch


def test_pallas_backend_takes_flash_past_the_decode_rows():
    """``backend="pallas"``: the decode kernel up to ``MAX_ROWS`` rows, this kernel beyond
    (the fused cache write only with the decode kernel); ``"auto"`` still runs the
    reference on the CPU. ``attend`` through it equals the ``xla`` backend."""
    c = CASES["f32-hd64-g4"]                                # 40 queries x G 4 > 128 rows
    q, cache, md, _ = make_batch(c, 3)
    short = md.replace(max_query_len=8)                     # 8 x 4 = 32 rows
    assert flash.takes_over(c.nh, c.nkv, md.max_query_len)
    assert not flash.takes_over(c.nh, c.nkv, short.max_query_len)
    resolve = attn.resolve_attention_backend
    assert resolve(q.shape, cache.k.shape, md, backend="pallas") == "pallas"
    assert resolve(q.shape, cache.k.shape, md, backend="auto") == "xla"
    assert resolve(q.shape, cache.k.shape, md, backend="xla") == "xla"
    with K.default_backend("pallas"):
        assert resolve(q.shape, cache.k.shape, md) == "pallas"
    rng = np.random.default_rng(0)
    kn = jnp.asarray(rng.standard_normal((c.t_pad, c.nkv, c.hd)), jnp.float32)

    def step(backend, fused):
        return lambda q, k, cache, md: attn.attend(q, k, -k, cache, md, scale=0.2,
                                                   backend=backend, fused_kv_write=fused)

    text = str(jax.make_jaxpr(step("pallas", True))(q, kn, cache, md))
    assert "paged_flash_attention" in text and "paged_attention_write" not in text
    short_text = str(jax.make_jaxpr(step("pallas", False))(q, kn, cache, short))
    assert "paged_flash_attention" not in short_text and "paged_attention_r" in short_text
    want, wc = jax.jit(step("xla", "auto"))(q, kn, cache, md)
    got, gc = jax.jit(step("pallas", "auto"))(q, kn, cache, md)
    np.testing.assert_array_equal(np.asarray(gc.k), np.asarray(wc.k))
    assert_close(got, want, 1e-5, "attend pallas (flash) vs xla")


#: 2 fake CPU devices: ``attend`` on the pallas backend with 40-token queries (the flash
#: kernel) under ``jax.jit`` with q heads and caches split by kv heads: no collective, the
#: caches still split, every output bit-identical to one device's.
PARTITION_BODY = """
import os, re
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
os.environ["JAX_PLATFORMS"] = "cpu"
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding as NS, PartitionSpec as P
from specjax.attention_metadata import CommonAttentionMetadata
from specjax.kernels import paged_attention as attn
rng = np.random.default_rng(1)
HD, NB, BS, T = 16, 24, 8, 48
md = CommonAttentionMetadata.from_query_lens([40, 1, 0, 5], [44, 9, 3, 5],
                                             rng.permutation(NB)[:24].reshape(4, 6),
                                             block_size=BS, num_reqs_pad=4, num_tokens_pad=T)
f32 = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
args = (f32(T, 8, HD), f32(T, 2, HD), f32(T, 2, HD), f32(NB, BS, 2, HD), f32(NB, BS, 2, HD))

def step(q, k, v, kc, vc, md):
    out, c = attn.attend(jnp.sin(q), k, v, attn.KVCache(kc, vc), md, scale=0.25,
                         backend="pallas")
    return 2 * out, c.k, c.v

want = jax.jit(step)(*args, md)
assert "paged_flash_attention" in str(jax.make_jaxpr(step)(*args, md))
mesh = Mesh(np.array(jax.devices()), ("tp",))
heads, caches = NS(mesh, P(None, "tp", None)), NS(mesh, P(None, None, "tp", None))
placed = [jax.device_put(x, s) for x, s in zip(args, [heads] * 3 + [caches] * 2)]
md_r = jax.device_put(md, NS(mesh, P()))
compiled = jax.jit(step).lower(*placed, md_r).compile()
found = re.findall(r"(all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)",
                   compiled.as_text())
assert not found, found
got = compiled(*placed, md_r)
for a, b in zip(got, want, strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
assert got[1].sharding.is_equivalent_to(caches, 4), got[1].sharding
print("flash partition ok", flush=True)
"""


def test_flash_split_by_kv_heads_on_two_fake_devices():
    env = dict(os.environ, PYTHONPATH=suite_paths.pythonpath(ROOT))
    env.pop("XLA_FLAGS", None)
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(PARTITION_BODY)], env=env,
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "flash partition ok" in r.stdout, r.stdout + r.stderr[-4000:]


def test_tile_defaults_swept_and_unswept():
    """16-bit operands up to head_dim 128 take the sweep's winner (4 warps, 3 stages);
    other shapes keep the earlier rule (8 warps from 128 x 128 accumulators, 2 stages)."""
    def cfg(**kw):
        return flash.flash_config(group=4, max_query_len=8192, **kw)

    assert cfg(head_dim=128) == (128, 64, 4, 3)
    assert cfg(head_dim=64) == (128, 64, 4, 3)
    assert cfg(head_dim=128, itemsize=4) == (128, 64, 8, 2)
    assert cfg(head_dim=256) == (64, 32, 8, 2)
    assert cfg(head_dim=64, itemsize=4) == (128, 64, 4, 2)        # 8192 accumulators
    assert cfg(head_dim=128, num_warps=2, num_stages=1) == (128, 64, 2, 1)
    # under one wave (WAVE = 132 programs) of the longest request's tiles, rows halve:
    # 512 tokens x G 4 / 128 = 16 tiles x 8 kv heads = 128 < 132 (the chunk-after-32k sweep)
    one = functools.partial(flash.flash_config, head_dim=128, group=4)
    assert one(max_query_len=512, num_kv_heads=8) == (64, 64, 4, 3)
    assert one(max_query_len=544, num_kv_heads=8) == (128, 64, 4, 3)     # 17 x 8 = 136
    assert one(max_query_len=1024, num_kv_heads=8) == (128, 64, 4, 3)
    assert one(max_query_len=8, num_kv_heads=8)[0] == 32                 # a decode tile
    assert one(max_query_len=512, num_kv_heads=8, rows=128)[0] == 128
    with pytest.raises(ValueError, match="num_stages=0"):
        cfg(head_dim=128, num_stages=0)

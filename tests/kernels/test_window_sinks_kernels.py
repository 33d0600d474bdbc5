"""Sliding windows and attention sinks in the decode kernels (kernels/paged_attention/pallas.py,
its fused cache write, triton.py) and their routing, against the NumPy float64 oracle of
tests/kernels/test_flash_attention.py.

CPU: the Pallas kernels in interpret mode on ragged batches (test_paged_attention's
``make_case``: empty requests, padding tokens, junk block-table entries, one request at the
table's capacity) with windows of 5 to 13 keys crossing page and key-tile boundaries,
non-zero sinks, causal / non-causal / tree masks, GQA 1 to 8, head_dim 16 to 256, float32
and bfloat16, 1 to 3 context splits (the sinks then join in the merge kernel); tiles wholly
before every row's window are never read (NaN there stays out); ``paged_attention`` /
``attend`` route a window to the decode kernel where it takes the shape and to the flash
kernel past its rows; two fake CPU devices split it by kv heads (sinks with the query
heads). The Triton kernel: tests/support/triton_interpret_paged_attention.py on CPU
(test_paged_attention.py runs it), compiled to PTX for sm_90 here where ``triton`` is
installed, and ``-m gpu`` here.
"""

from __future__ import annotations

import suite_paths  # tests/support: where the suite's pieces are
from triton_lowering import fake_h200
import dataclasses
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.kernels import paged_attention as attn
from specjax.kernels.paged_attention import KVCache, flash, limits
from specjax.kernels.paged_attention import pallas as pk
from test_flash_attention import oracle
from test_paged_attention import Cfg, assert_close, make_case, random_tree, tolerance

ROOT = str(suite_paths.ROOT)


@pytest.fixture(autouse=True)
def _ieee_float32_matmuls(request):
    if request.node.get_closest_marker("gpu"):
        yield
        return
    with jax.default_matmul_precision("highest"):
        yield


@dataclasses.dataclass(frozen=True)
class WCfg:
    cfg: Cfg
    window: int | None
    sinks: bool = True


#: Contexts up to ``width * bs`` keys; windows shorter, not multiples of the key tile.
CASES = {
    # GQA 1, pages of 4 under 16-key tiles, one split (sinks in the kernel's epilogue)
    "f32-g1-causal-w8": WCfg(Cfg(nh=2, nkv=2, hd=16, bs=4, width=10, qmax=4, b_pad=5,
                                 t_pad=14), 8),
    # GQA 2, non-causal, pages of 32 above the tile, 2 splits (sinks in the merge kernel)
    "f32-g2-noncausal-w13-split2": WCfg(Cfg(nh=4, nkv=2, hd=32, bs=32, width=2, qmax=3,
                                            b_pad=4, t_pad=10, causal=False, num_splits=2), 13),
    # GQA 4, a window shorter than the query block, 3 splits, window without sinks
    "f32-g4-causal-w5-split3": WCfg(Cfg(nh=8, nkv=2, hd=16, bs=16, width=4, qmax=6, b_pad=4,
                                        t_pad=16, num_splits=3), 5, sinks=False),
    # GQA 2, a tree, 2 splits
    "f32-g2-tree-w9-split2": WCfg(Cfg(nh=4, nkv=2, hd=16, bs=4, width=8, qmax=4, b_pad=3,
                                      t_pad=12, tree=True, num_splits=2), 9),
    # GQA 3 (padded merge lanes), sinks without a window
    "f32-g3-causal-sinks-split2": WCfg(Cfg(nh=6, nkv=2, hd=16, bs=8, width=4, qmax=2, b_pad=3,
                                           t_pad=7, num_splits=2), None),
    "bf16-g4-causal-w13": WCfg(Cfg(nh=8, nkv=2, hd=32, bs=8, width=8, qmax=4, b_pad=4,
                                   t_pad=16, dtype="bfloat16", block_k=32), 13),
    # decode rows, the default key tile and split count
    "f32-g4-decode-w13-default": WCfg(Cfg(nh=8, nkv=2, hd=16, bs=8, width=32, qmax=1, b_pad=3,
                                          t_pad=4, block_k=None, num_splits=None), 13),
    # Gemma-3 / gpt-oss shapes: head_dim 256 at GQA 2, GQA 8 (one kv head)
    "f32-hd256-g2-w8": WCfg(Cfg(nh=4, nkv=2, hd=256, bs=8, width=4, qmax=2, b_pad=3, t_pad=6,
                                num_splits=2), 8),
    "bf16-g8-w13": WCfg(Cfg(nh=8, nkv=1, hd=64, bs=8, width=6, qmax=3, b_pad=3, t_pad=9,
                            dtype="bfloat16", num_splits=2), 13),
}


def case(name: str, seed: int):
    w = CASES[name]
    tree = random_tree(np.random.default_rng(seed), w.cfg.qmax) if w.cfg.tree else None
    q, cache, md = make_case(w.cfg, seed, tree)
    rng = np.random.default_rng(seed + 1)
    sinks = jnp.asarray(rng.standard_normal(w.cfg.nh) + 1.0, jnp.float32) if w.sinks else None
    return q, cache, md, sinks


def run_decode(name, q, cache, md, sinks, scale, **kw):
    c = CASES[name].cfg
    return pk.paged_attention(q, cache.k, cache.v, md.query_start_loc, md.seq_lens,
                              md.block_table, sinks, scale=scale, max_query_len=md.max_query_len,
                              causal=md.causal, tree_mask=md.tree_mask,
                              sliding_window=CASES[name].window,
                              **dict(dict(block_k=c.block_k, num_splits=c.num_splits), **kw))


@pytest.mark.parametrize("name", list(CASES))
def test_decode_kernel_matches_the_oracle(name):
    """The decode kernel with a window and / or sinks == the oracle (padding tokens zero);
    the same batch without them differs (the window and sinks matter here)."""
    w = CASES[name]
    scale = w.cfg.hd ** -0.5
    assert limits.unsupported_reason(num_heads=w.cfg.nh, num_kv_heads=w.cfg.nkv,
                                     head_dim=w.cfg.hd, max_query_len=w.cfg.qmax) is None
    for seed in range(2):
        q, cache, md, sinks = case(name, 31 * seed + len(name))
        got = run_decode(name, q, cache, md, sinks, scale)
        assert got.shape == q.shape and got.dtype == q.dtype
        want = oracle(q, cache, md, scale, window=w.window, sinks=sinks)
        assert_close(got, want, tolerance(w.cfg.dtype), f"{name} seed {seed}")
        end = int(md.query_start_loc[-1])
        assert np.all(np.asarray(got[end:], np.float32) == 0), "padding tokens must be zeros"
    assert not np.allclose(want, oracle(q, cache, md, scale), atol=1e-2)


@pytest.mark.parametrize("name", ["f32-g1-causal-w8", "f32-g2-tree-w9-split2",
                                  "bf16-g4-causal-w13"])
def test_fused_write_with_window_and_sinks(name):
    """``paged_attention_write`` with a window and sinks == ``write_kv`` then the kernel,
    bit for bit (caches and outputs), and the oracle on the written cache."""
    w = CASES[name]
    c, scale = w.cfg, w.cfg.hd ** -0.5
    dt = jnp.dtype(c.dtype)
    q, cache, md, sinks = case(name, 5)
    rng = np.random.default_rng(2)
    kn, vn = (jnp.asarray(rng.standard_normal((c.t_pad, c.nkv, c.hd)), jnp.float32).astype(dt)
              for _ in range(2))
    want_cache = attn.write_kv(cache, kn, vn, md.slot_mapping)
    want = run_decode(name, q, want_cache, md, sinks, scale)
    got, (gk, gv) = pk.paged_attention_write(
        jnp.concatenate([q, kn, vn], axis=1), cache.k, cache.v, md.slot_mapping,
        md.query_start_loc, md.seq_lens, md.block_table, sinks, scale=scale,
        max_query_len=md.max_query_len, causal=md.causal, tree_mask=md.tree_mask,
        sliding_window=w.window, block_k=c.block_k, num_splits=c.num_splits)
    np.testing.assert_array_equal(np.asarray(gk), np.asarray(want_cache.k))
    np.testing.assert_array_equal(np.asarray(gv), np.asarray(want_cache.v))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert_close(got, oracle(q, want_cache, md, scale, window=w.window, sinks=sinks),
                 tolerance(c.dtype), f"{name} fused vs oracle")


@pytest.mark.parametrize("splits", [1, 3])
def test_tiles_before_the_window_are_not_read(splits):
    """Keys in key tiles wholly before every row's window hold NaN: the output stays finite
    and equal to the oracle (those tiles are skipped, not loaded and masked)."""
    name = "f32-g1-causal-w8"
    c, window = CASES[name].cfg, CASES[name].window
    q, cache, md, sinks = case(name, 8)
    bt, seqs = np.asarray(md.block_table), np.asarray(md.seq_lens)
    qsl = np.asarray(md.query_start_loc)
    poison = np.zeros(cache.k.shape[:2], bool)
    for r, s in enumerate(seqs):
        qlen = qsl[r + 1] - qsl[r]
        first = max(s - qlen - window + 1, 0) // c.block_k * c.block_k
        p = np.arange(first)
        poison[bt[r, p // c.bs], p % c.bs] = qlen > 0
    assert poison.sum() > 0
    nan = lambda x: jnp.where(jnp.asarray(poison)[:, :, None, None], jnp.nan, x)  # noqa: E731
    cache = KVCache(nan(cache.k), nan(cache.v))
    got = np.asarray(run_decode(name, q, cache, md, sinks, 0.3, num_splits=splits))
    assert np.isfinite(got).all()
    assert_close(got, oracle(q, cache, md, 0.3, window=window, sinks=sinks), 1e-5, "poisoned")


def test_block_k_default_by_head_dim():
    """The decode kernels' default key tile: 64 keys up to head_dim 128, 32 above."""
    kw = dict(num_heads=16, num_kv_heads=2, block_size=16, max_blocks=64, batch=4,
              max_query_len=16, tree_mask=None, dtype=jnp.float32, block_k=None,
              num_splits=None, num_warps=None)
    assert limits.kernel_config("pallas", head_dim=128, **kw)[2] == 64
    assert limits.kernel_config("pallas", head_dim=256, **kw)[2] == 32
    assert limits.kernel_config("pallas", head_dim=256, **dict(kw, block_k=64))[2] == 64


def test_errors():
    q, cache, md, sinks = case("f32-g1-causal-w8", 1)
    args = (q, cache.k, cache.v, md.query_start_loc, md.seq_lens, md.block_table)
    kw = dict(scale=0.3, max_query_len=md.max_query_len)
    with pytest.raises(ValueError, match="sliding_window=0 must be None or >= 1"):
        pk.paged_attention(*args, sliding_window=0, **kw)
    with pytest.raises(ValueError, match=r"sinks \(3,\) must be \[num_heads\] = \[2\]"):
        pk.paged_attention(*args, jnp.zeros(3), **kw)


def _jaxpr(fn, *args) -> str:
    return str(jax.make_jaxpr(fn)(*args))


def test_routing_decode_kernel_then_flash():
    """``backend="pallas"`` with a window / sinks: the decode kernel (its fused write under
    ``attend(fused_kv_write=True)``) up to ``MAX_ROWS`` rows, the flash kernel past them, the
    reference for shapes neither takes; each equal to the oracle. head_dim 256 and GQA 8
    (Gemma 3, gpt-oss) are decode-kernel shapes at decode lengths: ``limits`` refuses
    neither, only their rows past ``MAX_ROWS`` (then the flash kernel)."""
    name = "f32-g2-tree-w9-split2"
    w = CASES[name]
    c = w.cfg
    q, cache, md, sinks = case(name, 3)
    want = oracle(q, cache, md, 0.3, window=w.window, sinks=sinks)

    def pa(md):
        return lambda q, cache, sinks: attn.paged_attention(
            q, cache, md, scale=0.3, backend="pallas", sliding_window=w.window, sinks=sinks)

    text = _jaxpr(pa(md), q, cache, sinks)
    assert f"paged_attention_r16_k64_s1_w{w.window}_sinks" in text, text[-2000:]
    assert "paged_flash_attention" not in text
    assert_close(jax.jit(pa(md))(q, cache, sinks), want, 1e-5, "decode kernel")
    long = md.replace(max_query_len=80)                  # 80 x G 2 > 128 rows: flash
    assert flash.takes_over(c.nh, c.nkv, long.max_query_len)
    text = _jaxpr(pa(long), q, cache, sinks)
    assert "paged_flash_attention" in text and "paged_attention_r" not in text
    assert_close(jax.jit(pa(long))(q, cache, sinks), want, 1e-5, "flash kernel")
    # attend: the fused write with the window and sinks; head_dim 48: the reference
    kn = jnp.asarray(np.random.default_rng(0).standard_normal((c.t_pad, c.nkv, c.hd)),
                     jnp.float32)

    def step(fused):
        return lambda q, k, cache, sinks: attn.attend(
            q, k, -k, cache, md, scale=0.3, backend="pallas", fused_kv_write=fused,
            sliding_window=w.window, sinks=sinks)

    assert "paged_attention_write_r16_k64_s1_w9_sinks" in _jaxpr(step(True), q, kn, cache, sinks)
    got, gc = jax.jit(step(True))(q, kn, cache, sinks)
    assert_close(got, oracle(q, gc, md, 0.3, window=w.window, sinks=sinks), 1e-5, "attend fused")
    got2, _ = jax.jit(step(False))(q, kn, cache, sinks)
    assert_close(got2, got, 1e-5, "attend unfused")
    resolve = attn.resolve_attention_backend
    assert resolve((4, 2, 48), (9, 4, 2, 48), md, backend="pallas") == "xla"
    # Gemma-3 (head_dim 256) and gpt-oss (GQA 8) decode shapes: the decode kernel takes them
    for nh, nkv, hd, qlen, kernel in ((8, 4, 256, 1, "decode"), (64, 8, 64, 4, "decode"),
                                      (64, 8, 64, 16, "decode"), (64, 8, 64, 17, "flash"),
                                      (16, 8, 256, 64, "decode"), (16, 8, 256, 65, "flash")):
        assert limits.unsupported_reason(num_heads=nh, num_kv_heads=nkv, head_dim=hd,
                                         max_query_len=1) is None
        assert flash.takes_over(nh, nkv, qlen) == (kernel == "flash"), (nh, nkv, hd, qlen)
        m = md.replace(max_query_len=qlen)
        assert resolve((qlen, nh, hd), (9, 8, nkv, hd), m, jnp.bfloat16, "pallas") == "pallas"


def test_gqa8_past_the_decode_rows_runs_flash_with_window_and_sinks():
    """GQA 8 with 20-token queries (160 rows > ``MAX_ROWS``): ``backend="pallas"`` runs the
    flash kernel with the window and sinks, equal to the oracle."""
    c = Cfg(nh=8, nkv=1, hd=32, bs=8, width=6, qmax=20, b_pad=3, t_pad=30)
    assert limits.unsupported_reason(num_heads=8, num_kv_heads=1, head_dim=32,
                                     max_query_len=20) is not None
    q, cache, md = make_case(c, 4)
    sinks = jnp.linspace(-1.0, 2.0, 8, dtype=jnp.float32)
    fn = lambda q, cache, sinks: attn.paged_attention(  # noqa: E731
        q, cache, md, scale=0.2, backend="pallas", sliding_window=13, sinks=sinks)
    assert "paged_flash_attention" in _jaxpr(fn, q, cache, sinks)
    assert_close(jax.jit(fn)(q, cache, sinks), oracle(q, cache, md, 0.2, window=13, sinks=sinks),
                 1e-5, "flash")


@pytest.mark.smoke
@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")
def test_triton_lowering_with_window_and_sinks(monkeypatch):
    """The non-interpreted decode kernel, fused write and merge with a window and sinks,
    lowered to Triton IR for an H200 on the CPU (no PTX): head_dim 128 and 256, GQA 4, 8."""
    fake_h200(monkeypatch)
    sds = jax.ShapeDtypeStruct
    i32 = lambda *s: sds(s, jnp.int32)  # noqa: E731
    for b, qmax, nh, nkv, hd, splits in [(1, 1, 32, 8, 128, 8), (8, 4, 64, 8, 64, 1),
                                         (4, 2, 16, 8, 256, 2)]:
        dt = jnp.bfloat16
        cache = sds((b * 128, 16, nkv, hd), dt)
        kw = dict(scale=0.1, max_query_len=qmax, sliding_window=128, num_splits=splits,
                  interpret=False)
        fn = pk.paged_attention.trace(sds((b * qmax, nh, hd), dt), cache, cache, i32(b + 1),
                                      i32(b), i32(b, 128), sds((nh,), jnp.float32), **kw)
        assert "xla.gpu.triton" in fn.lower(lowering_platforms=("cuda",)).as_text()
        fw = pk.paged_attention_write.trace(
            sds((b * qmax, nh + 2 * nkv, hd), dt), cache, cache, i32(b * qmax), i32(b + 1),
            i32(b), i32(b, 128), sds((nh,), jnp.float32), **kw)
        assert "xla.gpu.triton" in fw.lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("window,sinks,tree,hd,group,qlen,dt", [
    (None, False, None, 128, 4, 2, "bf16"), (128, True, None, 128, 4, 2, "bf16"),
    (64, True, ((True, False), (True, True)), 128, 4, 2, "bf16"),
    (128, True, None, 256, 8, 16, "fp32")])                 # 128 rows of head_dim 256
def test_triton_kernel_compiles_for_h200(window, sinks, tree, hd, group, qlen, dt):
    """The jax-triton kernels compiled to PTX for sm_90 on the CPU as jax-triton compiles
    them (``ASTSource``: constexprs only from ``launch_plan``'s meta, no defaults), within
    an H200's 227 KiB of shared memory a block (head_dim 256: 32-key tiles)."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from specjax.kernels.paged_attention import triton as tk

    plan = tk.launch_plan((10, 2 * group, hd), (300, 16, 2, hd), (4, 64), scale=0.1,
                          max_query_len=qlen, tree_mask=tree, num_splits=2,
                          dtype=jnp.bfloat16 if dt == "bf16" else jnp.float32,
                          sliding_window=window, sinks=sinks)
    ptrs = dict(attention=("*i32",) * 4 + (f"*{dt}",) * 3 + ("*fp32",) * 3,
                merge=("*i32",) + ("*fp32",) * 3 + (f"*{dt}",))
    for which, fn in (("attention", tk._attention_kernel), ("merge", tk._merge_kernel)):
        meta, warps = plan[which]["meta"], plan[which]["num_warps"]
        sig = dict(zip(fn.arg_names, ptrs[which]), **{k: "constexpr" for k in meta})
        out = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=dict(meta)),
                             target=GPUTarget("cuda", 90, 32),
                             options=dict(num_warps=warps, num_stages=2))
        assert ".entry" in out.asm["ptx"], which
        assert out.metadata.shared <= 227 * 1024, (which, out.metadata.shared)


#: 2 fake CPU devices: ``attend`` / ``paged_attention`` on the pallas backend with a window
#: and sinks (decode kernel, its fused write, the flash kernel) under ``jax.jit`` with q
#: heads, sinks and caches split by kv heads: no collective, caches still split, every
#: output bit-identical to the unsharded call and close to the reference.
PARTITION_BODY = """
import os, re
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
os.environ["JAX_PLATFORMS"] = "cpu"
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding as NS, PartitionSpec as P
from specjax.attention_metadata import CommonAttentionMetadata
from specjax.kernels import paged_attention as attn
jax.config.update("jax_default_matmul_precision", "highest")
rng = np.random.default_rng(1)
HD, NB, BS, T, W = 16, 24, 8, 48, 13
f32 = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
args = (f32(T, 8, HD), f32(T, 2, HD), f32(T, 2, HD), f32(NB, BS, 2, HD), f32(NB, BS, 2, HD),
        f32(8) + 1.0)
mesh = Mesh(np.array(jax.devices()), ("tp",))
heads, caches = NS(mesh, P(None, "tp", None)), NS(mesh, P(None, None, "tp", None))
table = rng.permutation(NB)[:24].reshape(4, 6)
# (query lens, seq lens, fused write, the kernel, sinks split or replicated)
for qlens, seqs, fused, kernel, sinks_spec in (
        ([1, 3, 0, 2], [30, 44, 3, 20], True, "paged_attention_write", P("tp")),
        ([1, 3, 0, 2], [30, 44, 3, 20], False, "paged_attention_r", P()),
        ([40, 1, 0, 5], [44, 9, 3, 5], True, "paged_flash_attention", P("tp"))):
    shard = [heads] * 3 + [caches] * 2 + [NS(mesh, sinks_spec)]
    placed = [jax.device_put(x, s) for x, s in zip(args, shard)]
    md = CommonAttentionMetadata.from_query_lens(qlens, seqs, table, block_size=BS,
                                                 num_reqs_pad=4, num_tokens_pad=T)

    def step(q, k, v, kc, vc, sinks, md, backend="pallas"):
        out, c = attn.attend(jnp.sin(q), k, v, attn.KVCache(kc, vc), md, scale=0.25,
                             backend=backend, fused_kv_write=fused, sliding_window=W,
                             sinks=sinks)
        return 2 * out, c.k, c.v

    assert kernel in str(jax.make_jaxpr(step)(*args, md)), kernel
    want = jax.jit(step)(*args, md)
    ref = jax.jit(lambda *a: step(*a, backend="xla"))(*args, md)
    np.testing.assert_allclose(np.asarray(want[0]), np.asarray(ref[0]), atol=2e-5)
    md_r = jax.device_put(md, NS(mesh, P()))
    compiled = jax.jit(step).lower(*placed, md_r).compile()
    found = re.findall(r"(all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)",
                       compiled.as_text())
    assert not found, found
    got = compiled(*placed, md_r)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert got[1].sharding.is_equivalent_to(caches, 4), got[1].sharding
    print("window partition ok", kernel, flush=True)
"""


def test_window_and_sinks_split_by_kv_heads_on_two_fake_devices():
    env = dict(os.environ, PYTHONPATH=suite_paths.pythonpath(ROOT))
    env.pop("XLA_FLAGS", None)
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(PARTITION_BODY)], env=env,
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and r.stdout.count("window partition ok") == 3, \
        r.stdout + r.stderr[-4000:]


# ----------------------------------------------------------------------------------------
# GPU: the compiled kernels on H200-sized shapes


def _gpu_case(b, qlen, nh, nkv, hd, dtype, seed, ctx=1024, width=128, bs=16):
    rng = np.random.default_rng(seed)
    qlens = np.full(b, qlen)
    seqs = np.clip(ctx + rng.integers(-ctx // 2, ctx // 2 + 1, b), qlen, width * bs)
    if b > 1:
        qlens[1] = 0
        seqs[0] = width * bs
    nb = b * width + 3
    table = rng.permutation(nb)[: b * width].reshape(b, width)
    from specjax.attention_metadata import CommonAttentionMetadata

    md = CommonAttentionMetadata.from_query_lens(qlens, seqs, table, block_size=bs,
                                                 num_reqs_pad=b + 1, num_tokens_pad=b * qlen + 2,
                                                 max_query_len=qlen)
    f = lambda k, *s: jax.random.normal(jax.random.key(seed + k), s, jnp.float32).astype(dtype)  # noqa: E731
    sinks = jax.random.normal(jax.random.key(seed + 9), (nh,), jnp.float32) + 1.0
    return f(0, b * qlen + 2, nh, hd), KVCache(f(1, nb, bs, nkv, hd), f(2, nb, bs, nkv, hd)), md, sinks


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")
@pytest.mark.parametrize("b", [1, 64])         # several context splits, one split
@pytest.mark.parametrize("qlen", [1, 4])
@pytest.mark.parametrize("shape", [(32, 8, 128), (64, 8, 64), (16, 8, 256)])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("backend", ["pallas", "triton"])
def test_gpu_window_sinks_match_reference(b, qlen, shape, dtype, backend):
    """The compiled kernel of ``backend`` with a 128-key window and sinks against the float32
    reference (Llama / gpt-oss / Gemma-3 head shapes); Pallas also with its fused write."""
    nh, nkv, hd = shape
    q, cache, md, sinks = _gpu_case(b, qlen, nh, nkv, hd, jnp.dtype(dtype), seed=b + qlen)
    with jax.default_matmul_precision("highest"):
        want = jax.jit(lambda q, c, s: attn.paged_attention_xla(
            q, c, md, scale=hd ** -0.5, sliding_window=128, sinks=s))(q, cache, sinks)
    got = jax.jit(lambda q, c, s: attn.paged_attention(
        q, c, md, scale=hd ** -0.5, backend=backend, sliding_window=128, sinks=s))(q, cache, sinks)
    tol = 2e-5 if dtype == "float32" else 2e-2
    assert_close(got, want, tol, f"{backend} B={b} q={qlen} {shape} {dtype}")
    if backend == "pallas":
        kv = jax.random.normal(jax.random.key(b), (q.shape[0], 2 * nkv, hd)).astype(q.dtype)
        got, c = jax.jit(lambda q, kv, c, s: attn.attend(
            q, kv[:, :nkv], kv[:, nkv:], c, md, scale=hd ** -0.5, backend="pallas",
            fused_kv_write=True, sliding_window=128, sinks=s))(q, kv, cache, sinks)
        with jax.default_matmul_precision("highest"):
            want = jax.jit(lambda q, c, s: attn.paged_attention_xla(
                q, c, md, scale=hd ** -0.5, sliding_window=128, sinks=s))(q, c, sinks)
        assert_close(got, want, tol, f"fused B={b} q={qlen} {shape} {dtype}")

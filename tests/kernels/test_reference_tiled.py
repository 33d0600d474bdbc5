"""The tiled form of the jax.numpy paged-attention reference (query tiles x key chunks with
an online softmax, ``reference.paged_attention_tiled``) against the NumPy float64 oracle and
the dense form, and its memory.

Random ragged batches (``test_paged_attention.make_case``): prefill chunks over an earlier
context (``num_computed > 0``), decode rows, draft rows, empty and padding rows, junk past
each request's pages, causal, non-causal and tree masks, fp32 and bf16 KV, GQA groups 1..8,
head_dim 64 / 128. Tiling is forced small (``tile_q`` / ``chunk_k``) so query tiles and key
chunks cross request, block and table-width boundaries. Memory: the compiled 16k-token
attention's temporaries against the dense score tensor's size.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.attention_metadata import CommonAttentionMetadata
from specjax.kernels.paged_attention import KVCache, paged_attention
from specjax.kernels.paged_attention import reference as R
from test_paged_attention import Cfg, assert_close, make_case, oracle, random_tree


@pytest.fixture(autouse=True)
def _ieee_float32_matmuls():
    with jax.default_matmul_precision("highest"):
        yield


CFGS = {
    "g1-hd64-f32": Cfg(nh=2, nkv=2, hd=64, bs=4, width=8, qmax=11, b_pad=4, t_pad=30),
    "g2-hd128-f32": Cfg(nh=4, nkv=2, hd=128, bs=8, width=5, qmax=9, b_pad=3, t_pad=20),
    "g4-hd64-bf16": Cfg(nh=8, nkv=2, hd=64, bs=4, width=7, qmax=10, b_pad=4, t_pad=28,
                        dtype="bfloat16"),
    "g8-hd64-f32": Cfg(nh=8, nkv=1, hd=64, bs=4, width=6, qmax=7, b_pad=3, t_pad=16),
    "g8-hd128-bf16": Cfg(nh=8, nkv=1, hd=128, bs=8, width=4, qmax=6, b_pad=3, t_pad=14,
                         dtype="bfloat16"),
    "g2-hd64-f32-noncausal": Cfg(nh=4, nkv=2, hd=64, bs=4, width=6, qmax=8, b_pad=3,
                                 t_pad=18, causal=False),
    "g2-hd64-f32-tree": Cfg(nh=4, nkv=2, hd=64, bs=4, width=8, qmax=5, b_pad=3, t_pad=14,
                            tree=True),
    "g4-hd128-bf16-tree": Cfg(nh=8, nkv=2, hd=128, bs=4, width=6, qmax=4, b_pad=3, t_pad=12,
                              tree=True, dtype="bfloat16"),
    "g4-hd64-f32-decode": Cfg(nh=8, nkv=2, hd=64, bs=8, width=6, qmax=1, b_pad=5, t_pad=6),
}
#: (tile_q, chunk_k): one query / one block at a time; tiles and chunks that divide
#: neither the query bucket nor the table width (chunks rounded up to whole blocks).
TILES = [(1, 1), (3, 9)]


def tolerance(dtype) -> float:
    return 1e-5 if jnp.dtype(dtype) == jnp.float32 else 2e-2


@pytest.mark.parametrize("name", list(CFGS))
def test_tiled_equals_oracle_and_dense(name):
    cfg = CFGS[name]
    scale = cfg.hd ** -0.5
    tree = random_tree(np.random.default_rng(11), cfg.qmax) if cfg.tree else None
    dense = jax.jit(lambda q, c, m: R.paged_attention_xla(q, c, m, scale=scale, tiled=False))
    tiled = {t: jax.jit(lambda q, c, m, t=t: R.paged_attention_xla(
        q, c, m, scale=scale, tiled=True, tile_q=t[0], chunk_k=t[1])) for t in TILES}
    tol = tolerance(cfg.dtype)
    for seed in range(3):
        q, cache, md = make_case(cfg, 17 * seed + len(name), tree)
        want = oracle(q, cache, md, scale)
        ref = dense(q, cache, md)
        end = int(md.query_start_loc[-1])
        for t, fn in tiled.items():
            got = fn(q, cache, md)
            assert got.shape == q.shape and got.dtype == q.dtype
            assert_close(got, want, tol, f"{name} seed {seed} tiles {t} vs oracle")
            assert_close(got, ref, tol, f"{name} seed {seed} tiles {t} vs dense")
            assert np.all(np.asarray(got[end:], np.float32) == 0), "padding tokens: zeros"


def test_default_tiles_and_all_padding():
    """Default tiles (one query tile, one key chunk here) and a batch of padding rows only."""
    cfg = CFGS["g2-hd128-f32"]
    q, cache, md = make_case(cfg, 3)
    fn = jax.jit(lambda q, c, m: R.paged_attention_tiled(q, c, m, scale=0.1))
    assert_close(fn(q, cache, md), oracle(q, cache, md, 0.1), 1e-5, "default tiles")
    md0 = CommonAttentionMetadata.from_query_lens(
        [], [], np.zeros((0, cfg.width), np.int32), block_size=cfg.bs, num_reqs_pad=cfg.b_pad,
        num_tokens_pad=cfg.t_pad, max_query_len=cfg.qmax)
    assert np.all(np.asarray(fn(q, cache, md0)) == 0)


def test_bad_tiles_are_refused():
    cfg = CFGS["g1-hd64-f32"]
    q, cache, md = make_case(cfg, 0)
    for bad in (0, -2, 2.5, True):
        with pytest.raises(ValueError, match="tile_q"):
            R.paged_attention_tiled(q, cache, md, scale=1.0, tile_q=bad)
        with pytest.raises(ValueError, match="chunk_k"):
            R.paged_attention_tiled(q, cache, md, scale=1.0, chunk_k=bad)


@pytest.mark.parametrize("b,nh,q,c,bs", [(1, 8, 16384, 16384, 16), (64, 32, 1024, 1024, 16),
                                         (1, 4, 7, 40, 8), (3, 2, 1, 4096, 16)])
def test_tile_sizes_fit_the_budget(b, nh, q, c, bs):
    tq, ck = R.tile_sizes(b, nh, q, c, bs)
    assert 1 <= tq <= R.MAX_TILE_Q and ck % bs == 0 and bs <= ck
    assert tq <= 1 << (max(q, 1) - 1).bit_length()
    assert 4 * b * nh * tq * ck <= R.TILE_SCORE_BYTES or (tq, ck) == (1, bs)


def _lowered(b_pad, q_len, ctx, nh, nkv, hd, bs, dtype=jnp.float32):
    """The jitted ``paged_attention`` (backend xla, the static choice) lowered for ``b_pad``
    requests of ``q_len`` queries over ``ctx`` keys, from shapes only."""
    width = ctx // bs
    md = CommonAttentionMetadata.from_query_lens(
        [q_len] * b_pad, [ctx] * b_pad, np.arange(1, b_pad * width + 1).reshape(b_pad, width),
        block_size=bs)
    q = jax.ShapeDtypeStruct((b_pad * q_len, nh, hd), dtype)
    kv = jax.ShapeDtypeStruct((b_pad * width + 1, bs, nkv, hd), dtype)
    fn = jax.jit(lambda q, k, v, m: paged_attention(q, KVCache(k, v), m, scale=0.1,
                                                    backend="xla"))
    return fn.lower(q, kv, kv, md)


def test_static_choice_keeps_small_programs_dense():
    """Below ``TILED_MIN_SCORE_BYTES`` the program is the dense form's (no loop); above, the
    tiled form's."""
    small = _lowered(8, 4, 1024, 4, 2, 64, 16).as_text()
    assert "stablehlo.while" not in small
    assert R.dense_score_bytes(1, 8, 4096, 4096) > R.TILED_MIN_SCORE_BYTES
    assert "stablehlo.while" in _lowered(1, 4096, 4096, 8, 2, 64, 16).as_text()


@pytest.mark.parametrize("b_pad,q_len,nh,nkv,hd,dtype", [
    (1, 16384, 8, 2, 128, jnp.float32),
    (4, 4096, 8, 8, 64, jnp.bfloat16),
])
def test_long_prompt_memory_is_bounded(b_pad, q_len, nh, nkv, hd, dtype):
    """A long-prompt attention compiles to temporaries of a few score tiles: far below the
    dense ``[B, heads, Q, C]`` scores (16 GiB for one 16k-token prompt over 8 heads)."""
    compiled = _lowered(b_pad, q_len, q_len, nh, nkv, hd, 16, dtype).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    dense = R.dense_score_bytes(b_pad, nh, q_len, q_len)
    io = b_pad * q_len * nh * hd * jnp.dtype(dtype).itemsize        # the output
    assert temp <= 4 * R.TILE_SCORE_BYTES + 2 * io, (temp, dense)
    assert temp * 20 < dense, (temp, dense)

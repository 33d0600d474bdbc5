"""The grouped matmul (kernels/grouped_matmul) against a NumPy oracle written from its
contract: rows sorted by group, ``out[i] = lhs[i] @ rhs[g(i)]``, rows past the groups zeros
(Pallas). CPU: the Pallas kernel in interpret mode over random group sizes with empty
groups, groups larger than a row tile, one group holding every row, and rows past the
groups; float32 to 1e-5 and bfloat16 to its rounding; the Triton lowering for an H200 (no
PTX) at Qwen3-30B-A3B's shapes; the backend rule; the errors; the MoE layer on either
backend and either Pallas path (``pair_matmul`` for a few pairs, checked against its own
oracle too)."""

from __future__ import annotations

import functools

import suite_paths  # noqa: F401  tests/support: where the suite's pieces are
from triton_lowering import fake_h200

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax.kernels as K
from specjax.kernels.grouped_matmul import grouped_matmul, pallas, resolve_grouped_backend
from specjax.models import gpt_oss, moe


def oracle(lhs, rhs, sizes):
    """float64 per group, zeros past the last group."""
    out = np.zeros((lhs.shape[0], rhs.shape[2]))
    s = 0
    for g, n in enumerate(sizes):
        out[s:s + n] = lhs[s:s + n].astype(np.float64) @ rhs[g].astype(np.float64)
        s += n
    return out


def case(rng, m, k, n, e, kind):
    if kind == "one":                       # every row in one group (the last)
        sizes = np.zeros(e, np.int32)
        sizes[-1] = m
    else:
        used = m - 5 if kind == "tail" else m
        p = rng.dirichlet(np.full(e, 0.3))  # skewed: empty groups and big ones
        sizes = rng.multinomial(used, p).astype(np.int32)
    lhs = rng.standard_normal((m, k)).astype(np.float32)
    rhs = (rng.standard_normal((e, k, n)) / np.sqrt(k)).astype(np.float32)
    return lhs, rhs, sizes


@pytest.mark.parametrize("m,k,n,e,kind,block_m", [
    (8, 32, 64, 8, "tail", None),           # decode-sized: 1 row a group
    (200, 64, 48, 5, "all", None),          # groups past one 64-row tile
    (130, 16, 32, 3, "one", 16),            # one group, many tiles
    (77, 48, 16, 16, "tail", 32),           # more groups than rows a tile
])
def test_matches_the_oracle_float32(m, k, n, e, kind, block_m):
    rng = np.random.default_rng(m + e)
    lhs, rhs, sizes = case(rng, m, k, n, e, kind)
    out = pallas.grouped_matmul(jnp.asarray(lhs), jnp.asarray(rhs), jnp.asarray(sizes),
                                block_m=block_m)
    np.testing.assert_allclose(np.asarray(out), oracle(lhs, rhs, sizes), atol=1e-5, rtol=1e-5)
    xla = grouped_matmul(jnp.asarray(lhs), jnp.asarray(rhs), jnp.asarray(sizes), backend="xla")
    used = int(sizes.sum())
    np.testing.assert_allclose(np.asarray(out)[:used], np.asarray(xla)[:used], atol=1e-5,
                               rtol=1e-5)


@pytest.mark.parametrize("dtype,tol", [(np.float32, 1e-5), (jnp.bfloat16, 2e-2)])
def test_split_k_matches_the_oracle(dtype, tol):
    """K in 2 and 4 shares (float32 partials summed): the oracle's values, the input dtype,
    zeros past the groups; a ``split_k`` not dividing K's steps is refused by name."""
    rng = np.random.default_rng(3)
    lhs, rhs, sizes = case(rng, 40, 128, 32, 6, "tail")
    lj, rj = jnp.asarray(lhs, dtype), jnp.asarray(rhs, dtype)
    want = oracle(np.asarray(lj, np.float32), np.asarray(rj, np.float32), sizes)
    for split in (2, 4):
        out = pallas.grouped_matmul(lj, rj, jnp.asarray(sizes), block_k=32, split_k=split)
        assert out.dtype == dtype and out.shape == (40, 32)
        np.testing.assert_allclose(np.asarray(out, np.float32), want, atol=tol, rtol=tol)
    with pytest.raises(ValueError, match="split_k=3 must be >= 1 and divide K / block_k = 4"):
        pallas.grouped_matmul(lj, rj, jnp.asarray(sizes), block_k=32, split_k=3)


def test_every_row_stored_once_by_its_group():
    """The program table against brute force: over random group sizes (empty groups, a
    tail of rows past the groups, none) every output row is stored by exactly one program,
    of its own group (-1, zeros, past the last group), within ``ceil(M / block_m) + E``."""
    rng = np.random.default_rng(7)
    for _ in range(200):
        m, e, block_m = int(rng.integers(1, 90)), int(rng.integers(1, 12)), 2 ** int(rng.integers(0, 6))
        used = int(rng.integers(0, m + 1))
        sizes = rng.multinomial(used, rng.dirichlet(np.full(e, 0.3))).astype(np.int32)
        num = -(-m // block_m) + e
        prog = np.asarray(pallas._programs(jnp.asarray(sizes), block_m, num, m))
        group_of = np.concatenate([np.repeat(np.arange(e), sizes), np.full(m - used, -1)])
        stored = np.zeros(m, int)
        for g, first, rows in prog.T:
            assert 0 <= rows <= block_m
            stored[first:first + rows] += 1
            assert (group_of[first:first + rows] == g).all(), (sizes, prog)
        assert (stored == 1).all(), (m, block_m, sizes, prog)


def test_bfloat16_to_its_rounding():
    rng = np.random.default_rng(1)
    lhs, rhs, sizes = case(rng, 96, 64, 128, 6, "tail")
    lb, rb = jnp.asarray(lhs, jnp.bfloat16), jnp.asarray(rhs, jnp.bfloat16)
    out = pallas.grouped_matmul(lb, rb, jnp.asarray(sizes))
    assert out.dtype == jnp.bfloat16
    want = oracle(np.asarray(lb, np.float32), np.asarray(rb, np.float32), sizes)
    np.testing.assert_allclose(np.asarray(out, np.float32), want, atol=2e-2, rtol=1e-2)


@pytest.mark.smoke
@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")
def test_triton_lowering_for_h200_on_cpu(monkeypatch):
    """Lowered to Triton IR for an H200 without a GPU: catches what interpret mode does not
    (power-of-two tensors, unsupported primitives)."""
    fake_h200(monkeypatch)
    sds = jax.ShapeDtypeStruct
    # Qwen3-30B-A3B: H 2048, 128 experts of width 768 (gate_up 1536), top-8; decode and prefill
    for m, k, n, dt in ((8, 2048, 1536, jnp.bfloat16), (256, 768, 2048, jnp.bfloat16),
                        (8192, 2048, 1536, jnp.bfloat16), (64, 64, 48, jnp.float32)):
        for split in (1, 2) if k >= 128 else (1,):
            fn = pallas.grouped_matmul.trace(sds((m, k), dt), sds((128, k, n), dt),
                                             sds((128,), jnp.int32), split_k=split,
                                             interpret=False)
            assert "xla.gpu.triton" in fn.lower(lowering_platforms=("cuda",)).as_text()
        if m <= 256:                     # the pair kernel at decode / verify widths
            for split in (1, 4) if k >= 256 else (1,):
                cases = ((None, None), (moe.swiglu, sds((128, n), dt)))
                for glu, bias in cases[:1 + (n % 32 == 0)]:     # glu: N / 2 tiles of >= 16
                    fn = pallas.pair_matmul.trace(sds((m, k), dt), sds((128, k, n), dt),
                                                  sds((m,), jnp.int32), sds((m,), jnp.int32),
                                                  bias, glu=glu, split_k=split,
                                                  interpret=False)
                    assert "xla.gpu.triton" in fn.lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")
def test_decode_routes_pairs_without_sorting(monkeypatch):
    """At decode (one token, top-8 of 128) the MoE block on the Pallas path lowers to the
    pair kernel with no sort, cumulative sum or scatter; past ``PAIR_MAX_PAIRS`` pairs to the
    sorted grouped matmul (H200 lowering, no GPU)."""
    fake_h200(monkeypatch)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")    # the kernels, not interpreted
    sds = jax.ShapeDtypeStruct
    h, i, e, k = 256, 128, 128, 8

    def hlo(t: int) -> str:
        fn = jax.jit(lambda x, w, ids, gu, dn: moe.grouped_experts(x, w, ids, gu, dn,
                                                                  backend="pallas"))
        return fn.trace(sds((t, h), jnp.bfloat16), sds((t, k), jnp.float32),
                        sds((t, k), jnp.int32), sds((e, h, 2 * i), jnp.bfloat16),
                        sds((e, i, h), jnp.bfloat16)).lower(
                            lowering_platforms=("cuda",)).as_text()

    one = hlo(1)
    assert one.count("pair_matmul") >= 2 and "grouped_matmul_m" not in one
    for op in ("stablehlo.sort", "stablehlo.reduce_window", "stablehlo.scatter"):
        assert op not in one, op
    many = hlo(moe.PAIR_MAX_PAIRS // k + 1)
    assert "grouped_matmul_m" in many and "stablehlo.sort" in many and "pair_matmul" not in many


def test_backend_rule():
    assert resolve_grouped_backend("xla") == "xla"
    assert resolve_grouped_backend("pallas") == "pallas"
    assert resolve_grouped_backend("auto") == ("pallas" if jax.default_backend() == "gpu"
                                               else "xla")
    with K.default_backend("pallas"):
        assert resolve_grouped_backend("auto") == "pallas"
    with K.default_backend("triton"):
        assert resolve_grouped_backend("auto") == "pallas"
    with pytest.raises(ValueError, match="backend='triton': grouped_matmul has no Triton"):
        resolve_grouped_backend("triton")
    with pytest.raises(ValueError, match="backend='cuda' is not one of"):
        resolve_grouped_backend("cuda")


def test_errors():
    lhs, rhs, sizes = jnp.zeros((8, 32)), jnp.zeros((4, 32, 16)), jnp.zeros((4,), jnp.int32)
    with pytest.raises(ValueError, match="do not fit"):
        grouped_matmul(lhs, jnp.zeros((4, 16, 16)), sizes)
    with pytest.raises(ValueError, match="do not fit"):
        grouped_matmul(lhs, rhs, jnp.zeros((3,), jnp.int32))
    with pytest.raises(ValueError, match=r"must be \[M, K\]"):
        grouped_matmul(lhs[0], rhs, sizes)
    with pytest.raises(ValueError, match="block_m=24 must be a power of two"):
        pallas.grouped_matmul(lhs, rhs, sizes, block_m=24)
    with pytest.raises(ValueError, match="not a multiple of 16"):
        pallas.grouped_matmul(jnp.zeros((8, 40)), jnp.zeros((4, 40, 16)), sizes)
    with pytest.raises(ValueError, match="block_n=32 must be a power of two >= 16 dividing 16"):
        pallas.grouped_matmul(lhs, rhs, sizes, block_n=32)


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
@pytest.mark.parametrize("split_k", [1, 3])
def test_pair_matmul_matches_the_oracle(dtype, tol, split_k):
    """``out[p] = lhs[rows[p]] @ rhs[groups[p]]``: rows and groups repeated, a group past E
    and a negative one (zeros), N wider than one column tile, K whole or in shares; a
    ``split_k`` not dividing K's steps is refused by name."""
    rng = np.random.default_rng(5)
    t, k, n, e = 3, 48, 160, 6
    lhs = rng.standard_normal((t, k)).astype(np.float32)
    rhs = (rng.standard_normal((e, k, n)) / np.sqrt(k)).astype(np.float32)
    rows = np.array([0, 0, 1, 2, 2, 1, 0, 2], np.int32)
    groups = np.array([5, 1, 0, 5, 3, e + 2, -1, 5], np.int32)
    lq, rq = jnp.asarray(lhs, dtype), jnp.asarray(rhs, dtype)
    out = pallas.pair_matmul(lq, rq, jnp.asarray(rows), jnp.asarray(groups), block_k=16,
                             split_k=split_k)
    assert out.shape == (8, n) and out.dtype == dtype
    l64, r64 = np.asarray(lq, np.float64), np.asarray(rq, np.float64)
    want = np.stack([l64[r] @ r64[g] if 0 <= g < e else np.zeros(n) for r, g in zip(rows, groups)])
    np.testing.assert_allclose(np.asarray(out, np.float64), want, atol=tol, rtol=tol)
    assert not np.asarray(out[5:7]).any()
    with pytest.raises(ValueError, match="split_k=2 must be >= 1 and divide K / block_k = 3"):
        pallas.pair_matmul(lq, rq, jnp.asarray(rows), jnp.asarray(groups), block_k=16,
                           split_k=2)


@pytest.mark.parametrize("split_k", [1, 3])
def test_pair_matmul_glu_epilogue_matches_the_oracle(split_k):
    """With ``glu``: ``glu(y[2c] + b[g, 2c], y[2c + 1] + b[g, 2c + 1])`` of ``y = lhs[row] @
    rhs[g]``, gpt-oss's clamped activation (limits reached), in the epilogue or after K's
    shares; a bias without ``glu`` is refused."""
    rng = np.random.default_rng(6)
    t, k, n, e, lim = 3, 48, 96, 6, 0.7
    lhs = rng.standard_normal((t, k)).astype(np.float32)
    rhs = (rng.standard_normal((e, k, n)) / np.sqrt(k)).astype(np.float32)
    bias = rng.standard_normal((e, n)).astype(np.float32)
    rows = np.array([0, 0, 1, 2, 2], np.int32)
    groups = np.array([5, 1, 0, 3, e + 1], np.int32)
    glu = functools.partial(gpt_oss.clamped_swiglu, limit=lim)
    out = pallas.pair_matmul(jnp.asarray(lhs), jnp.asarray(rhs), jnp.asarray(rows),
                             jnp.asarray(groups), jnp.asarray(bias), glu=glu, block_k=16,
                             split_k=split_k)
    assert out.shape == (5, n // 2)
    want = []
    for r, g in zip(rows, groups):
        y = lhs[r].astype(np.float64) @ rhs[g] + bias[g] if g < e else np.zeros(n)
        gate, up = np.minimum(y[0::2], lim), np.clip(y[1::2], -lim, lim)
        want.append((up + 1) * gate / (1 + np.exp(-1.702 * gate)))
    np.testing.assert_allclose(np.asarray(out, np.float64), np.stack(want), atol=1e-5)
    with pytest.raises(ValueError, match="bias is taken only with glu"):
        pallas.pair_matmul(jnp.asarray(lhs), jnp.asarray(rhs), jnp.asarray(rows),
                           jnp.asarray(groups), jnp.asarray(bias))


def test_moe_layer_on_either_backend(monkeypatch):
    """The routed experts (with another shard's ids and biases) give the same output."""
    rng = np.random.default_rng(3)
    t, h, i, e, k = 8, 32, 16, 8, 2
    x = jnp.asarray(rng.standard_normal((t, h)), jnp.float32)
    weights, ids = moe.softmax_top_k(jnp.asarray(rng.standard_normal((t, e)), jnp.float32), k,
                                     True)
    ids = ids.at[0, 1].set(e + 3)                            # another shard's expert
    gate_up = jnp.asarray(rng.standard_normal((e, h, 2 * i)) / 6, jnp.float32)
    down = jnp.asarray(rng.standard_normal((e, i, h)) / 4, jnp.float32)
    biases = dict(gate_up_bias=jnp.asarray(rng.standard_normal((e, 2 * i)), jnp.float32),
                  down_bias=jnp.asarray(rng.standard_normal((e, h)), jnp.float32))
    got = {b: np.asarray(moe.grouped_experts(x, weights, ids, gate_up, down, backend=b,
                                             **biases)) for b in ("xla", "pallas")}
    np.testing.assert_allclose(got["pallas"], got["xla"], atol=1e-5, rtol=1e-5)
    assert t * k <= moe.PAIR_MAX_PAIRS          # the Pallas path above ran pair_matmul;
    monkeypatch.setattr(moe, "PAIR_MAX_PAIRS", 0)  # now the sorted grouped matmul
    got["sorted"] = np.asarray(moe.grouped_experts(x, weights, ids, gate_up, down,
                                                   backend="pallas", **biases))
    np.testing.assert_allclose(got["sorted"], got["xla"], atol=1e-5, rtol=1e-5)
    # the oracle: each (token, expert) pair directly
    want = np.zeros((t, h))
    for tok in range(t):
        for j in range(k):
            ex = int(ids[tok, j])
            if ex >= e:
                continue
            gu = np.asarray(x[tok]) @ np.asarray(gate_up[ex]) + np.asarray(biases["gate_up_bias"][ex])
            act = gu[0::2] / (1 + np.exp(-gu[0::2])) * gu[1::2]
            y = act @ np.asarray(down[ex]) + np.asarray(biases["down_bias"][ex])
            want[tok] += float(weights[tok, j]) * y
    for b in ("pallas", "sorted"):
        np.testing.assert_allclose(got[b], want, atol=1e-4, rtol=1e-4)


def test_auto_falls_back_to_xla_for_shapes_the_kernel_does_not_take():
    """A tensor split can leave K or N off the 16 multiple: "auto" (even under a "pallas"
    process default) runs ``ragged_dot``; a call naming "pallas" refuses."""
    rng = np.random.default_rng(4)
    lhs, rhs, sizes = case(rng, 20, 8, 16, 4, "all")
    with K.default_backend("pallas"):
        out = grouped_matmul(jnp.asarray(lhs), jnp.asarray(rhs), jnp.asarray(sizes))
    np.testing.assert_allclose(np.asarray(out), oracle(lhs, rhs, sizes), atol=1e-5, rtol=1e-5)
    assert pallas.unsupported_reason(8, 16) == "K=8 not a multiple of 16"
    with pytest.raises(ValueError, match="not a multiple of 16"):
        grouped_matmul(jnp.asarray(lhs), jnp.asarray(rhs), jnp.asarray(sizes), backend="pallas")

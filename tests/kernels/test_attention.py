"""CommonAttentionMetadata and the XLA-only helpers, against NumPy oracles from the spec."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.attention_metadata import CommonAttentionMetadata
from specjax.kernels import (
    compute_new_slot_mapping,
    extend_all_queries_by_N,
    update_num_computed_tokens_for_batch_change,
)


def _random_cad(rng, n, b_pad, block_size=4, max_blocks=6, t_extra=3):
    q = rng.integers(1, 6, n)
    s = q + rng.integers(0, max_blocks * block_size - 6, n)
    bt = rng.permutation(n * max_blocks).reshape(n, max_blocks) if n else np.zeros((0, max_blocks))
    return CommonAttentionMetadata.from_query_lens(
        q, s, bt, block_size=block_size, num_reqs_pad=b_pad, num_tokens_pad=int(q.sum()) + t_extra,
        max_query_len=8), q, s, bt


def test_from_query_lens_layout():
    cad = CommonAttentionMetadata.from_query_lens([2, 1], [5, 3], [[7, 8], [3, 4]], block_size=4,
                                                  num_reqs_pad=4, num_tokens_pad=5)
    np.testing.assert_array_equal(cad.query_start_loc, [0, 2, 3, 3, 3])
    np.testing.assert_array_equal(cad.seq_lens, [5, 3, 0, 0])
    # request 0 positions 3, 4 -> blocks 7 (offset 3) and 8 (offset 0); request 1 position 2
    np.testing.assert_array_equal(cad.slot_mapping, [31, 32, 14, -1, -1])
    assert (cad.B_pad, cad.T_pad, cad.batch_size(), cad.max_query_len) == (4, 5, 4, 2)
    np.testing.assert_array_equal(cad.naive_query_lens(), [2, 1, 0, 0])
    assert int(cad.num_reqs) == 2 and int(cad.num_actual_tokens) == 3 and int(cad.max_seq_len) == 5


def test_pytree_static_fields_key_the_jit_cache():
    cad = CommonAttentionMetadata.from_query_lens([2, 1], [5, 3], [[7, 8], [3, 4]], block_size=4,
                                                  num_reqs_pad=4, num_tokens_pad=8, max_query_len=4)
    traces = []

    @jax.jit
    def f(c):
        traces.append(1)
        return c.seq_lens.sum() + c.max_query_len

    assert int(f(cad)) == 12
    cad2 = CommonAttentionMetadata.from_query_lens([1, 3, 2], [1, 7, 2], [[0, 1], [2, 3], [4, 5]],
                                                   block_size=4, num_reqs_pad=4, num_tokens_pad=8,
                                                   max_query_len=4)
    assert int(f(cad2)) == 14 and len(traces) == 1      # same bucket: no retrace
    f(cad2.replace(max_query_len=5))
    assert len(traces) == 2                              # static bucket changed
    assert jax.tree_util.tree_structure(cad).num_leaves == 7


@pytest.mark.parametrize("bad, match", [
    (dict(seq_lens=jnp.zeros(3, jnp.int32)), "seq_lens"),
    (dict(block_table=jnp.zeros((2, 2), jnp.int32)), "block_table"),
    (dict(slot_mapping=jnp.zeros((2, 2), jnp.int32)), "slot_mapping"),
    (dict(num_reqs=jnp.zeros(1, jnp.int32)), "num_reqs"),
    (dict(seq_lens=jnp.zeros(4, jnp.float32)), "int32"),
    (dict(max_query_len=-1), "max_query_len"),
])
def test_bad_metadata(bad, match):
    cad = CommonAttentionMetadata.from_query_lens([2, 1], [5, 3], [[7, 8], [3, 4]], block_size=4,
                                                  num_reqs_pad=4)
    with pytest.raises(ValueError, match=match):
        cad.replace(**bad)
    with pytest.raises(ValueError, match="block_table capacity"):
        CommonAttentionMetadata.from_query_lens([1], [9], [[0, 1]], block_size=4)
    with pytest.raises(ValueError, match="num_reqs_pad"):
        CommonAttentionMetadata.from_query_lens([1, 1], [1, 1], [[0], [1]], block_size=4, num_reqs_pad=1)


def _oracle_new_slots(qsl, n, bt, new_positions, rejected, block_size, num_new, max_model_len):
    out = np.full(len(new_positions), -1, np.int64)
    t = 0
    for r in range(n):
        for _ in range(qsl[r + 1] - qsl[r] + num_new):
            p = int(new_positions[t])
            if p < max_model_len and not rejected[t]:
                c = min(p, max_model_len - 1)
                out[t] = bt[r, c // block_size] * block_size + c % block_size
            t += 1
    return out


@pytest.mark.parametrize("seed", range(6))
def test_compute_new_slot_mapping_matches_oracle(seed):
    rng = np.random.default_rng(seed)
    n, num_new, bs, mml = int(rng.integers(0, 6)), int(rng.integers(0, 4)), 4, 20
    cad, q, s, bt = _random_cad(rng, n, 8, block_size=bs)
    t_new = cad.T_pad + 8 * num_new
    pos = rng.integers(0, mml + 4, t_new).astype(np.int32)
    rej = rng.random(t_new) < 0.2
    got = compute_new_slot_mapping(cad, jnp.asarray(pos), jnp.asarray(rej), block_size=bs,
                                   num_new_tokens=num_new, max_model_len=mml)
    want = _oracle_new_slots(np.asarray(cad.query_start_loc), n, np.asarray(cad.block_table), pos, rej,
                             bs, num_new, mml)
    np.testing.assert_array_equal(np.asarray(got), want)
    assert got.dtype == jnp.int32


def test_extend_all_queries_by_N():
    cad = CommonAttentionMetadata.from_query_lens([2, 1], [5, 3], [[7, 8], [3, 4]], block_size=4,
                                                  num_reqs_pad=4, num_tokens_pad=5)
    new_slots = jnp.arange(9, dtype=jnp.int32)
    e = extend_all_queries_by_N(cad, 2, new_slots)
    np.testing.assert_array_equal(e.query_start_loc, [0, 4, 7, 7, 7])
    np.testing.assert_array_equal(e.seq_lens, [7, 5, 0, 0])
    assert int(e.num_actual_tokens) == 7 and e.max_query_len == 4 and int(e.max_seq_len) == 7
    np.testing.assert_array_equal(e.slot_mapping, np.arange(9))
    with pytest.raises(ValueError, match="N must"):
        extend_all_queries_by_N(cad, -1, new_slots)


def test_update_num_computed_tokens_for_batch_change():
    num_computed = jnp.array([10, 20, 30, 40, 50], jnp.int32)
    num_accepted = jnp.array([1, 2, 3, 4, 5], jnp.int32)
    prev_positions = jnp.array([2, -1, 0, 1], jnp.int32)
    valid = jnp.array([3, 1, 2, 0], jnp.int32)
    prev_drafts = jnp.array([2, 0, 4, 1], jnp.int32)
    cpu = jnp.array([100, 200, 300, 400, 500], jnp.int32)
    c, a = update_num_computed_tokens_for_batch_change(num_computed, num_accepted, prev_positions,
                                                       valid, prev_drafts, cpu)
    # row 0 <- prev 2 (drafts 4): 30 + 2; row 1 new: cpu; row 2 <- prev 0 (drafts 2): 10 + 3;
    # row 3 <- prev 1 (no drafts): cpu; row 4 beyond the batch: unchanged
    np.testing.assert_array_equal(c, [32, 200, 13, 400, 50])
    np.testing.assert_array_equal(a, [2, 2, 3, 4, 5])


@pytest.mark.parametrize("t", [1, 2])
def test_one_token_attend_keeps_the_kv_projections_unfused(t):
    """``specjax.kernels.paged_attention.attend`` puts an optimization barrier on ``k`` / ``v`` for a
    one-token step only (on the H200 XLA otherwise fused the V projection, rewritten as a
    reduce, into the cache write: 44.6 ms instead of 7.6 ms for an 8B step); programs of
    two or more tokens carry none."""
    from specjax.kernels.paged_attention import KVCache, attend

    nh, nkv, hd, nb, bs = 4, 2, 8, 4, 4
    md = CommonAttentionMetadata.from_query_lens([t], [t + 2], np.array([[1, 2]]), block_size=bs,
                                                 num_reqs_pad=1, num_tokens_pad=t,
                                                 max_query_len=t)
    q = jnp.ones((t, nh, hd))
    k = v = jnp.ones((t, nkv, hd))
    cache = KVCache(jnp.zeros((nb, bs, nkv, hd)), jnp.zeros((nb, bs, nkv, hd)))
    text = jax.jit(lambda q, k, v, c: attend(q, k, v, c, md, scale=0.1)).lower(q, k, v, cache).as_text()
    assert ("optimization_barrier" in text) == (t == 1)

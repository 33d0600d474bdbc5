"""n-gram proposers (CPU numba and jitted JAX) against a brute-force oracle.

The oracle is written from the rule in research/vllm_spec_decode.md §1.4 and §6, not from
either implementation: try every n from the longest down, every start position from the
left, and take the first hit.
"""

from __future__ import annotations

import numba
import numpy as np
import pytest
import jax
import jax.numpy as jnp
from hypothesis import HealthCheck, given, settings, strategies as st
from numpy.lib.stride_tricks import sliding_window_view

from specjax.proposers.types import DraftOutput
from specjax.proposers.ngram_cpu import NgramProposer
from specjax.proposers.ngram_gpu import NgramGPUProposer, ngram_search


# ---------------------------------------------------------------------- oracle


def oracle_draft(context, min_n: int, max_n: int, k: int, max_model_len: int) -> list[int]:
    """Brute force: longest n first, then the earliest start; the occurrence must end at
    least one token before the context does."""
    ctx = np.asarray(context, dtype=np.int64)
    length = ctx.shape[0]
    if length < min_n:
        return []
    budget = min(k, max_model_len - length)
    if budget <= 0:
        return []
    for n in range(max_n, min_n - 1, -1):
        if n > length - 1:
            continue
        suffix = ctx[length - n :]
        # Windows over ctx[:L-1] start at s = 0 .. L-1-n, so each ends at s+n-1 <= L-2.
        windows = sliding_window_view(ctx[: length - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[0]) + n
            return ctx[start : start + min(budget, length - start)].tolist()
    return []


@pytest.mark.smoke
def test_oracle_on_hand_cases():
    # The oracle itself, on cases worked out by hand.
    assert oracle_draft([1, 2, 3, 9, 1, 2, 3, 8, 1, 2, 3], 3, 3, 2, 100) == [9, 1]
    assert oracle_draft([1, 1, 1], 2, 2, 5, 100) == [1]
    assert oracle_draft([5, 6], 1, 1, 3, 100) == []
    assert oracle_draft([5, 5], 1, 1, 3, 100) == [5]
    assert oracle_draft([5, 5], 1, 1, 3, 2) == []


# ---------------------------------------------------------------------- helpers

CONFIGS = [  # (k, min_n, max_n)
    (1, 1, 1),
    (3, 1, 3),
    (5, 3, 5),
    (4, 2, 4),
    (2, 4, 4),
    (7, 1, 8),
]
BATCH_BUCKET = 8
SHORT_MML, LONG_MML = 64, 4096

_cpu: dict = {}


def cpu_proposer(k, min_n, max_n, mml, threads=1) -> NgramProposer:
    key = (k, min_n, max_n, mml, threads)
    if key not in _cpu:
        _cpu[key] = NgramProposer(
            num_speculative_tokens=k,
            prompt_lookup_min=min_n,
            prompt_lookup_max=max_n,
            max_model_len=mml,
            max_num_threads=threads,
            multithread_min_tokens=0 if threads > 1 else 8192,
        )
    return _cpu[key]


def gpu_proposer(k, min_n, max_n, mml) -> NgramGPUProposer:
    return NgramGPUProposer(
        num_speculative_tokens=k, prompt_lookup_min=min_n, prompt_lookup_max=max_n, max_model_len=mml
    )


def pad_batch(contexts, width: int, rows: int = BATCH_BUCKET):
    """[rows, width] int32 buffer (garbage 7s past each context, to prove it is ignored)."""
    buf = np.full((max(rows, len(contexts)), width), 7, dtype=np.int32)
    lengths = np.zeros((buf.shape[0],), dtype=np.int32)
    for i, ctx in enumerate(contexts):
        buf[i, : len(ctx)] = ctx
        lengths[i] = len(ctx)
    return buf, lengths


def gpu_arrays(prop: NgramGPUProposer, contexts, width: int) -> list[list[int]]:
    buf, lengths = pad_batch(contexts, width)
    valid = np.zeros((buf.shape[0],), dtype=bool)
    valid[: len(contexts)] = True
    out = prop.propose_arrays(jnp.asarray(lengths), jnp.asarray(buf), jnp.asarray(valid))
    return DraftOutput(np.asarray(out.token_ids), np.asarray(out.num_drafts)).to_lists()[: len(contexts)]


def gpu_stateful(prop: NgramGPUProposer, contexts, num_new, width: int) -> list[list[int]]:
    """Write each context minus its last num_new[i] tokens, then propose with those tokens
    as this step's sampled tokens (the scatter path)."""
    rows = BATCH_BUCKET
    state = prop.init_state(rows, width)
    prefixes = [ctx[: len(ctx) - n] for ctx, n in zip(contexts, num_new)]
    buf, lengths = pad_batch(prefixes, width)
    row_ids = np.full((rows,), -1, dtype=np.int32)
    row_ids[: len(contexts)] = np.arange(len(contexts))
    state = prop.add_requests(state, jnp.asarray(row_ids), jnp.asarray(buf), jnp.asarray(lengths))
    sampled = np.full((rows, prop.k + 1), -1, dtype=np.int32)
    counts = np.zeros((rows,), dtype=np.int32)
    for i, (ctx, n) in enumerate(zip(contexts, num_new)):
        sampled[i, :n] = ctx[len(ctx) - n :]
        counts[i] = n
    out, state = prop.propose(state, jnp.asarray(sampled), jnp.asarray(counts))
    got_len = np.asarray(state.num_tokens)[: len(contexts)]
    assert got_len.tolist() == [len(c) for c in contexts]
    for i, ctx in enumerate(contexts):
        assert np.asarray(state.token_ids)[i, : len(ctx)].tolist() == list(ctx)
    lists = DraftOutput(np.asarray(out.token_ids), np.asarray(out.num_drafts)).to_lists()
    return [lists[i] if num_new[i] else [] for i in range(len(contexts))][: len(contexts)]


# ---------------------------------------------------------------------- property tests


def make_context(rng: np.random.Generator, length: int, vocab: int, kind: str) -> np.ndarray:
    if length == 0:
        return np.zeros((0,), dtype=np.int32)
    if kind == "iid":
        return rng.integers(0, vocab, length, dtype=np.int32)
    if kind == "periodic":
        period = int(rng.integers(1, 24))
        ctx = np.tile(rng.integers(0, vocab, period, dtype=np.int32), length // period + 1)[:length]
        flips = rng.integers(0, length, int(rng.integers(0, 4)))
        ctx[flips] = rng.integers(0, vocab, flips.size)
        return ctx
    # "planted": mostly unique tokens with earlier copies of the tail planted at random.
    ctx = rng.integers(0, max(vocab, 1000), length, dtype=np.int32)
    tail = int(rng.integers(1, 10))
    for _ in range(int(rng.integers(1, 4))):
        n = int(rng.integers(1, tail + 1))
        if length > 2 * n + 1:
            at = int(rng.integers(0, length - 2 * n))
            ctx[at : at + n] = ctx[length - n :]
    return ctx


@st.composite
def batch_of_contexts(draw, max_len: int):
    contexts = []
    for _ in range(draw(st.integers(1, BATCH_BUCKET))):
        length = draw(
            st.one_of(st.integers(0, 16), st.integers(0, max_len), st.integers(max(0, max_len - 10), max_len))
        )
        vocab = draw(st.sampled_from([1, 2, 3, 4, 8, 50]))
        kind = draw(st.sampled_from(["iid", "periodic", "planted"]))
        seed = draw(st.integers(0, 2**32 - 1))
        contexts.append(make_context(np.random.default_rng(seed), length, vocab, kind))
    return contexts


def check_all(config, mml, contexts, data):
    k, min_n, max_n = config
    want = [oracle_draft(c, min_n, max_n, k, mml) for c in contexts]
    cpu = cpu_proposer(k, min_n, max_n, mml)
    width = mml
    buf, lengths = pad_batch(contexts, width, rows=len(contexts))
    got_cpu = cpu.propose([[1]] * len(contexts), lengths, buf)
    assert got_cpu == want
    arr = cpu.propose_arrays(lengths, buf)
    assert arr.token_ids.dtype == np.int32 and arr.num_drafts.dtype == np.int32
    assert arr.to_lists() == want
    gpu = gpu_proposer(k, min_n, max_n, mml)
    assert gpu_arrays(gpu, contexts, width) == want
    num_new = [data.draw(st.integers(0, min(len(c), k + 1)), label="num_new") for c in contexts]
    want_stateful = [w if n else [] for w, n in zip(want, num_new)]
    assert gpu_stateful(gpu, contexts, num_new, width) == want_stateful


@pytest.mark.smoke
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=st.sampled_from(CONFIGS), contexts=batch_of_contexts(SHORT_MML), data=st.data())
def test_matches_oracle_short(config, contexts, data):
    check_all(config, SHORT_MML, contexts, data)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(config=st.sampled_from(CONFIGS), contexts=batch_of_contexts(LONG_MML), data=st.data())
def test_matches_oracle_long(config, contexts, data):
    check_all(config, LONG_MML, contexts, data)


@settings(max_examples=150, deadline=None)
@given(
    config=st.sampled_from(CONFIGS),
    context=st.lists(st.integers(0, 3), max_size=SHORT_MML),
)
def test_matches_oracle_small_lists(config, context):
    # Hypothesis shrinks these directly, so a failure comes out as a minimal context.
    k, min_n, max_n = config
    want = oracle_draft(context, min_n, max_n, k, SHORT_MML)
    buf, lengths = pad_batch([context], SHORT_MML, rows=1)
    assert cpu_proposer(k, min_n, max_n, SHORT_MML).propose([[1]], lengths, buf) == [want]
    assert gpu_arrays(gpu_proposer(k, min_n, max_n, SHORT_MML), [context], SHORT_MML) == [want]


# ---------------------------------------------------------------------- exact cases


def both(contexts, k, min_n, max_n, mml=SHORT_MML):
    """Run the CPU and GPU proposers; assert they agree; return the common answer."""
    buf, lengths = pad_batch(contexts, mml, rows=len(contexts))
    got_cpu = cpu_proposer(k, min_n, max_n, mml).propose([[1]] * len(contexts), lengths, buf)
    got_gpu = gpu_arrays(gpu_proposer(k, min_n, max_n, mml), contexts, mml)
    assert got_cpu == got_gpu
    return got_cpu


def test_ties_go_to_earliest_occurrence():
    ctx = [1, 2, 3, 9, 1, 2, 3, 8, 1, 2, 3]
    assert both([ctx], k=2, min_n=3, max_n=3) == [[9, 1]]
    assert both([ctx], k=5, min_n=1, max_n=3) == [[9, 1, 2, 3, 8]]


def test_longest_n_wins_over_earlier_shorter_match():
    # [2, 3] occurs at index 1 (followed by 7); [1, 2, 3] occurs later at 4 (followed by 6).
    ctx = [5, 2, 3, 7, 1, 2, 3, 6, 1, 2, 3]
    assert both([ctx], k=3, min_n=2, max_n=3) == [[6, 1, 2]]
    assert both([ctx], k=3, min_n=2, max_n=2) == [[7, 1, 2]]


def test_n_longer_than_max_is_not_preferred():
    # The full 4-gram [1,2,3,4] recurs at 5, but with max_n = 2 only [3, 4] counts and its
    # earliest occurrence is at 2.
    ctx = [9, 9, 3, 4, 8, 1, 2, 3, 4, 7, 1, 2, 3, 4]
    assert both([ctx], k=2, min_n=1, max_n=2) == [[8, 1]]
    assert both([ctx], k=2, min_n=1, max_n=4) == [[7, 1]]


def test_short_draft_at_end_of_context():
    assert both([[1, 1, 1]], k=5, min_n=2, max_n=2) == [[1]]
    assert both([[4, 5, 6, 4, 5]], k=5, min_n=2, max_n=2) == [[6, 4, 5]]


def test_overlapping_occurrence_counts():
    assert both([[1, 1, 1, 1]], k=5, min_n=2, max_n=3) == [[1]]
    assert both([[2, 1, 1, 1, 1]], k=5, min_n=2, max_n=3) == [[1]]
    assert both([[1, 1, 1, 1, 1]], k=5, min_n=2, max_n=2) == [[1, 1, 1]]


def test_nothing_below_min_n():
    # Shorter than min_n; and a recurring 1-gram with min_n = 2.
    assert both([[1, 2], [1, 2, 1], [], [7]], k=3, min_n=2, max_n=4) == [[], [], [], []]
    assert both([[3, 1, 2, 1]], k=3, min_n=1, max_n=4) == [[2, 1]]


def test_max_model_len_caps_the_draft():
    ctx = [1, 2, 3, 4, 5, 6, 7, 8] * 2  # 16 tokens; the 8-gram tail recurs at 0
    assert both([ctx], k=5, min_n=1, max_n=8, mml=64) == [[1, 2, 3, 4, 5]]
    assert both([ctx], k=5, min_n=1, max_n=8, mml=18) == [[1, 2]]
    assert both([ctx], k=5, min_n=1, max_n=8, mml=17) == [[1]]
    assert both([ctx], k=5, min_n=1, max_n=8, mml=16) == [[]]


def test_buffer_narrower_than_max_n():
    # Buffers of width 1..3 with n-grams up to 4: only short contexts fit.
    for width, ctx, want in [(1, [3], []), (2, [3, 3], [3]), (3, [1, 2, 1], [2, 1])]:
        gpu = gpu_proposer(2, 1, 4, 64)
        assert gpu_arrays(gpu, [ctx], width) == [want]
        buf, lengths = pad_batch([ctx], width, rows=1)
        assert cpu_proposer(2, 1, 4, 64).propose([[1]], lengths, buf) == [want]
        assert oracle_draft(ctx, 1, 4, 2, 64) == want


@pytest.mark.smoke
def test_vllm_request_filtering_cpu():
    cpu = cpu_proposer(3, 1, 3, 16)
    ctx = [1, 2, 3, 1, 2]
    buf, lengths = pad_batch([ctx, ctx, ctx + [0] * 11, ctx], 16, rows=4)
    lengths[2] = 16  # at max_model_len
    sampled = [[2], [], [0], [5, 2]]  # the second request is a partial prefill
    assert cpu.propose(sampled, lengths, buf) == [[3, 1, 2], [], [], [3, 1, 2]]
    # token_ids_cpu may have more rows than there are requests (vLLM's max_num_reqs buffer)
    big = np.vstack([buf, np.zeros((4, 16), np.int32)])
    assert cpu.propose(sampled, lengths, big) == [[3, 1, 2], [], [], [3, 1, 2]]
    assert cpu.propose([], np.zeros((0,), np.int32), big) == []


@pytest.mark.smoke
def test_vllm_request_filtering_gpu():
    gpu = gpu_proposer(3, 1, 3, 16)
    ctx = [1, 2, 3, 1, 2]
    # No sampled tokens -> no draft even though the context has a match.
    assert gpu_stateful(gpu, [ctx, ctx], [0, 2], 16) == [[], [3, 1, 2]]
    # Reaching max_model_len through this step's tokens -> no draft.
    full = [1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3, 1]
    assert gpu_stateful(gpu, [full], [2], 16) == [[]]


def test_int64_and_noncontiguous_inputs_cpu():
    cpu = cpu_proposer(3, 1, 3, 64)
    ctx = [4, 5, 6, 4, 5]
    buf, lengths = pad_batch([ctx, ctx], 64, rows=2)
    want = [[6, 4, 5], [6, 4, 5]]
    assert cpu.propose([[1], [1]], lengths.astype(np.int64), buf.astype(np.int64)) == want
    wide = np.zeros((2, 128), np.int32)
    wide[:, ::2] = buf
    assert cpu.propose([[1], [1]], lengths, wide[:, ::2]) == want
    assert cpu.propose([[1], [1]], lengths.tolist(), buf.tolist()) == want


def test_multithreaded_path_matches_serial():
    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("numba was started with one thread (NUMBA_NUM_THREADS=1)")
    rng = np.random.default_rng(0)
    contexts = [make_context(rng, int(rng.integers(0, 2000)), 3, "iid") for _ in range(37)]
    buf, lengths = pad_batch(contexts, 2048, rows=len(contexts))
    serial = cpu_proposer(5, 2, 4, 2048, threads=1)
    threaded = cpu_proposer(5, 2, 4, 2048, threads=2)
    assert threaded.num_threads_for(int(lengths.sum()), len(contexts)) == 2
    before = numba.get_num_threads()
    got = threaded.propose([[1]] * len(contexts), lengths, buf)
    assert numba.get_num_threads() == before
    assert got == serial.propose([[1]] * len(contexts), lengths, buf)
    assert got == [oracle_draft(c, 2, 4, 5, 2048) for c in contexts]


def test_thread_policy():
    p = NgramProposer(num_speculative_tokens=2, max_model_len=100, max_num_threads=1, warmup=False)
    assert p.num_threads_for(10**6, 100) == 1
    if numba.config.NUMBA_NUM_THREADS >= 2:
        p = NgramProposer(num_speculative_tokens=2, max_model_len=100, max_num_threads=2, warmup=False)
        assert p.num_threads_for(8191, 100) == 1  # vLLM's threshold
        assert p.num_threads_for(8192, 100) == 2
        assert p.num_threads_for(8192, 1) == 1


def test_prompt_lookup_defaults():
    p = NgramProposer(num_speculative_tokens=2, max_model_len=100, warmup=False)
    assert (p.min_n, p.max_n) == (5, 5)
    p = NgramProposer(num_speculative_tokens=2, max_model_len=100, prompt_lookup_max=3, warmup=False)
    assert (p.min_n, p.max_n) == (3, 3)
    g = NgramGPUProposer(num_speculative_tokens=2, max_model_len=100, prompt_lookup_min=2)
    assert (g.prompt_lookup_min, g.prompt_lookup_max) == (2, 2)
    assert hash(g) == hash(NgramGPUProposer(2, 100, 2, 2))


# ---------------------------------------------------------------------- device state


def test_state_add_remove_move_and_donation():
    gpu = gpu_proposer(2, 1, 2, 16)
    state = gpu.init_state(4)
    assert state.token_ids.shape == (4, 16) and state.token_ids.dtype == jnp.int32
    buf = np.zeros((4, 8), np.int32)
    buf[0, :5] = [1, 2, 3, 1, 2]
    buf[1, :4] = [7, 8, 7, 8]
    old = state
    state = gpu.add_requests(
        state, jnp.array([0, 2, -1, -1], jnp.int32), jnp.asarray(buf), jnp.array([5, 4, 0, 0], jnp.int32)
    )
    assert old.token_ids.is_deleted() and old.num_tokens.is_deleted()  # donated
    assert np.asarray(state.num_tokens).tolist() == [5, 0, 4, 0]
    # Swap rows 0 and 2, then move row 0 to the empty row 3 and empty row 0.
    state = gpu.move_requests(state, jnp.array([0, 2], jnp.int32), jnp.array([2, 0], jnp.int32))
    assert np.asarray(state.num_tokens).tolist() == [4, 0, 5, 0]
    state = gpu.move_requests(state, jnp.array([0, -1], jnp.int32), jnp.array([3, 1], jnp.int32))
    state = gpu.remove_requests(state, jnp.array([0, -1], jnp.int32))
    assert np.asarray(state.num_tokens).tolist() == [0, 0, 5, 4]
    assert np.asarray(state.token_ids)[3, :4].tolist() == [7, 8, 7, 8]
    assert np.asarray(state.token_ids)[2, :5].tolist() == [1, 2, 3, 1, 2]
    # Rows 2 and 3 sample one token each; rows 0 and 1 are empty.
    sampled = jnp.array([[-1, -1, -1], [-1, -1, -1], [3, -1, -1], [7, -1, -1]], jnp.int32)
    out, state = gpu.propose(state, sampled, jnp.array([0, 0, 1, 1], jnp.int32))
    assert np.asarray(out.num_drafts).tolist() == [0, 0, 2, 2]
    assert np.asarray(out.token_ids).tolist() == [[-1, -1], [-1, -1], [1, 2], [8, 7]]
    assert np.asarray(state.num_tokens).tolist() == [0, 0, 6, 5]
    # Warm-up leaves the state unchanged.
    before = np.asarray(state.token_ids).copy(), np.asarray(state.num_tokens).copy()
    state = gpu.warmup([1, 4], state)
    assert (np.asarray(state.token_ids) == before[0]).all()
    assert (np.asarray(state.num_tokens) == before[1]).all()


@pytest.mark.smoke
def test_propose_rows_and_packed_match_the_condensed_batch():
    """Requests in arbitrary buffer rows (a slot allocator) draft exactly as in a condensed
    batch; padding rows (-1) and rows not named are left alone; grow_state keeps rows."""
    k, mml = 3, 32
    gpu = gpu_proposer(k, 1, 3, mml)
    rng = np.random.default_rng(5)
    contexts = [make_context(rng, n, 4, "periodic") for n in (9, 14, 3)] + [np.array([2, 2], np.int32)]
    num_new = [2, 4, 1, 0]
    want = gpu_stateful(gpu, [c.tolist() for c in contexts], num_new, mml)
    assert want == [oracle_draft(c, 1, 3, k, mml) if n else [] for c, n in zip(contexts, num_new)]

    where = [5, 1, 6, 2]
    state = gpu.init_state(4)
    state = gpu.grow_state(state, 8)
    assert state.token_ids.shape == (8, mml)
    prefixes = [c[: len(c) - n] for c, n in zip(contexts, num_new)]
    buf, lengths = pad_batch(prefixes, mml, rows=4)
    state = gpu.add_requests(state, jnp.asarray(np.array(where, np.int32)), jnp.asarray(buf),
                             jnp.asarray(lengths[:4]))
    sampled = np.full((6, k + 1), -1, np.int32)
    counts = np.zeros(6, np.int32)
    for i, (c, n) in enumerate(zip(contexts, num_new)):
        sampled[i, :n] = c[len(c) - n :]
        counts[i] = n
    rows = np.array(where + [-1, -1], np.int32)
    counts[4] = 3                          # a padding row's count is ignored
    before = state
    out, state = gpu.propose(state, jnp.asarray(sampled), jnp.asarray(counts), rows=jnp.asarray(rows))
    assert before.token_ids.is_deleted()   # donated
    got = DraftOutput(np.asarray(out.token_ids), np.asarray(out.num_drafts)).to_lists()
    assert got[:4] == want and got[4:] == [[], []]
    lens = np.asarray(state.num_tokens)
    assert [int(lens[r]) for r in where] == [len(c) for c in contexts]
    assert [int(lens[r]) for r in (0, 3, 4, 7)] == [0, 0, 0, 0]
    for r, c in zip(where, contexts):
        assert np.asarray(state.token_ids)[r, : len(c)].tolist() == c.tolist()

    # The packed form (one array each way) on a copy of the state before that step.
    state2 = gpu.grow_state(gpu.init_state(4), 8)
    state2 = gpu.add_requests(state2, jnp.asarray(np.array(where, np.int32)), jnp.asarray(buf),
                              jnp.asarray(lengths[:4]))
    packed = np.concatenate([rows[:, None], counts[:, None], sampled], axis=1)
    out2, state2 = gpu.propose_packed(state2, jnp.asarray(packed))
    out2 = np.asarray(out2)
    assert out2.shape == (6, k + 1)
    np.testing.assert_array_equal(out2[:, :k], np.asarray(out.token_ids))
    np.testing.assert_array_equal(out2[:, k], np.asarray(out.num_drafts))
    np.testing.assert_array_equal(np.asarray(state2.num_tokens), lens)
    with pytest.raises(ValueError, match="packed"):
        gpu.propose_packed(state2, jnp.zeros((2, 2), jnp.int32))
    with pytest.raises(ValueError, match="max_num_seqs"):
        gpu.grow_state(state2, 4)


@pytest.mark.smoke
def test_gpu_signatures_agree_with_the_cpu_proposer():
    """One signature per kind: ``warmup(buckets, state)`` (the model proposers' order, batch
    sizes or ``(B, T)`` buckets), ``propose(..., rows=)`` and ``propose_arrays(num_tokens,
    token_ids)`` (the CPU proposer's and vLLM's order), against the oracle."""
    k, mml = 2, 16
    gpu = gpu_proposer(k, 1, 3, mml)
    rng = np.random.default_rng(9)
    contexts = [make_context(rng, n, 3, "periodic") for n in (7, 10)]
    buf, lengths = pad_batch(contexts, mml, rows=2)
    new = gpu.propose_arrays(jnp.asarray(lengths), jnp.asarray(buf))
    got = DraftOutput(np.asarray(new.token_ids), np.asarray(new.num_drafts)).to_lists()
    assert got == [oracle_draft(c, 1, 3, k, mml) for c in contexts]

    def filled():
        st = gpu.init_state(4)
        return gpu.add_requests(st, jnp.array([2, 0], jnp.int32), jnp.asarray(buf), jnp.asarray(lengths))

    st = gpu.warmup([1, 2], filled())
    assert np.asarray(st.num_tokens).tolist() == np.asarray(filled().num_tokens).tolist()
    st = gpu.warmup([(1, 8), (2, 8)], filled())        # (B, T) buckets as the others take
    assert np.asarray(st.num_tokens).tolist() == np.asarray(filled().num_tokens).tolist()


def test_propose_step_has_no_host_callbacks_and_int32_indices():
    gpu = gpu_proposer(3, 1, 3, 32)
    state = gpu.init_state(4)
    from specjax.proposers.ngram_gpu import _propose_step

    lowered = _propose_step.lower(gpu, state, jnp.zeros((4, 4), jnp.int32), jnp.zeros((4,), jnp.int32))
    hlo = lowered.compile().as_text()
    assert "s32[4,32]" in hlo  # the buffer, to show the dtype spelling checked below
    # Host callbacks would show up as custom calls (xla_python_*_callback).
    assert "custom-call" not in hlo and "s64" not in hlo and "u64" not in hlo
    # The state is donated: the buffer and the lengths alias outputs.
    assert "input_output_alias" in hlo


def test_ngram_search_is_traceable_under_vmap_free_jit():
    toks = jnp.asarray([[1, 2, 1, 2, 0, 0]], jnp.int32)
    out = jax.jit(lambda t, n: ngram_search(t, n, jnp.ones((1,), bool), k=2, min_n=1, max_n=2, max_model_len=10))(
        toks, jnp.array([4], jnp.int32)
    )
    assert np.asarray(out.token_ids).tolist() == [[1, 2]]


# ---------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(num_speculative_tokens=0), "num_speculative_tokens"),
        (dict(num_speculative_tokens=1.5), "num_speculative_tokens"),
        (dict(num_speculative_tokens=True), "num_speculative_tokens"),
        (dict(prompt_lookup_min=3, prompt_lookup_max=2), "prompt_lookup_min"),
        (dict(prompt_lookup_min=0, prompt_lookup_max=2), "prompt_lookup_min"),
        (dict(prompt_lookup_min=1, prompt_lookup_max=0), "prompt_lookup_max"),
        (dict(max_model_len=0), "max_model_len"),
        (dict(max_num_threads=0), "max_num_threads"),
        (dict(max_num_threads=10**6), "max_num_threads"),
        (dict(multithread_min_tokens=-1), "multithread_min_tokens"),
    ],
)
def test_cpu_bad_config(kwargs, field):
    base = dict(num_speculative_tokens=3, max_model_len=64, prompt_lookup_min=1, prompt_lookup_max=3)
    base.update(kwargs)
    with pytest.raises(ValueError, match=field):
        NgramProposer(**base, warmup=False)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(num_speculative_tokens=0), "num_speculative_tokens"),
        (dict(num_speculative_tokens="3"), "num_speculative_tokens"),
        (dict(prompt_lookup_min=4, prompt_lookup_max=2), "prompt_lookup_min"),
        (dict(prompt_lookup_max=-1), "prompt_lookup_max"),
        (dict(max_model_len=-5), "max_model_len"),
        (dict(max_model_len=2**30), "max_model_len"),
    ],
)
def test_gpu_bad_config(kwargs, field):
    base = dict(num_speculative_tokens=3, max_model_len=64, prompt_lookup_min=1, prompt_lookup_max=3)
    base.update(kwargs)
    with pytest.raises(ValueError, match=field):
        NgramGPUProposer(**base)


def test_cpu_bad_inputs():
    cpu = cpu_proposer(3, 1, 3, 16)
    buf = np.zeros((2, 16), np.int32)
    n = np.array([4, 4], np.int32)
    with pytest.raises(TypeError, match="token_ids_cpu"):
        cpu.propose([[1], [1]], n, buf.astype(np.float32))
    with pytest.raises(TypeError, match="num_tokens_no_spec"):
        cpu.propose([[1], [1]], n.astype(float), buf)
    with pytest.raises(ValueError, match="num_tokens_no_spec"):  # lengths disagree
        cpu.propose([[1], [1], [1]], n, buf)
    with pytest.raises(ValueError, match="token_ids_cpu"):  # too few rows
        cpu.propose([[1], [1], [1]], np.array([1, 1, 1]), buf)
    with pytest.raises(ValueError, match="num_tokens_no_spec"):  # longer than the buffer
        cpu.propose([[1], [1]], np.array([4, 17]), buf)
    with pytest.raises(ValueError, match="num_tokens_no_spec"):
        cpu.propose([[1], [1]], np.array([4, -1]), buf)
    with pytest.raises(ValueError, match="token_ids_cpu"):  # ragged rows
        cpu.propose([[1], [1]], n, [[1, 2, 3, 4], [1, 2]])
    with pytest.raises(ValueError, match="token_ids_cpu"):
        cpu.propose([[1], [1]], n, np.zeros((16,), np.int32))
    with pytest.raises(TypeError, match="sampled_token_ids"):
        cpu.propose([1, 2], n, buf)
    with pytest.raises(ValueError, match="valid_mask"):
        cpu.propose_arrays(n, buf, np.array([1, 0]))


def test_gpu_bad_inputs():
    gpu = gpu_proposer(3, 1, 3, 16)
    state = gpu.init_state(2)
    with pytest.raises(TypeError, match="sampled_token_ids"):
        gpu.propose(state, jnp.zeros((2, 4), jnp.float32), jnp.zeros((2,), jnp.int32))
    with pytest.raises(ValueError, match="num_sampled"):
        gpu.propose(state, jnp.zeros((2, 4), jnp.int32), jnp.zeros((3,), jnp.int32))
    with pytest.raises(ValueError, match="batch size"):
        gpu.propose(state, jnp.zeros((3, 4), jnp.int32), jnp.zeros((3,), jnp.int32))
    with pytest.raises(TypeError, match="state"):
        gpu.propose((state.token_ids, state.num_tokens), jnp.zeros((2, 4), jnp.int32), jnp.zeros((2,), jnp.int32))
    with pytest.raises(TypeError, match="token_ids"):
        gpu.propose_arrays(jnp.zeros((2,), jnp.int32), jnp.zeros((2, 4), jnp.float32))
    with pytest.raises(ValueError, match="num_tokens"):
        gpu.propose_arrays(jnp.zeros((3,), jnp.int32), jnp.zeros((2, 4), jnp.int32))
    with pytest.raises(ValueError, match="width"):
        gpu.add_requests(state, jnp.zeros((1,), jnp.int32), jnp.zeros((1, 17), jnp.int32), jnp.zeros((1,), jnp.int32))
    with pytest.raises(TypeError, match="sampled_token_ids"):
        gpu.propose(state, [[1, 2]], jnp.zeros((1,), jnp.int32))
    with pytest.raises(TypeError, match="rows"):
        gpu.remove_requests(state, jnp.zeros((1,), jnp.float32))
    with pytest.raises(ValueError, match="src and dst"):
        gpu.move_requests(state, jnp.zeros((1,), jnp.int32), jnp.zeros((2,), jnp.int32))
    with pytest.raises(ValueError, match="max_num_seqs"):
        gpu.init_state(0)
    with pytest.raises(ValueError, match="width"):
        gpu.init_state(2, width=17)


def test_draft_output_from_lists():
    out = DraftOutput.from_lists([[1, 2], [], [3]], k=3)
    assert out.token_ids.tolist() == [[1, 2, -1], [-1, -1, -1], [3, -1, -1]]
    assert out.num_drafts.tolist() == [2, 0, 1]
    assert out.to_lists() == [[1, 2], [], [3]]
    with pytest.raises(ValueError, match="k=1"):
        DraftOutput.from_lists([[1, 2]], k=1)
    with pytest.raises(ValueError, match="k must be"):
        DraftOutput.from_lists([[1]], k=0)
    leaves = jax.tree_util.tree_leaves(DraftOutput(jnp.zeros((1, 2)), jnp.zeros((1,))))
    assert len(leaves) == 2

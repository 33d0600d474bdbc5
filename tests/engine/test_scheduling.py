"""The engine's scheduling (CPU, fp32): ragged token batches, chunked prefill beside decoding
requests, preemption by recompute, arrival times and request timelines.

Each claim is checked against runs that cannot share the mechanism under test: plain greedy
decoding without chunking or preemption (``baseline``), an unchunked run of the same
proposer (per-step acceptance, drafter KV), a never-preempted run (seeded sampling)."""

from __future__ import annotations

import collections
import dataclasses

import jax
import numpy as np
import pytest

from specjax.checks import ArgumentError
from specjax.engine import Engine, LoopOptions, SamplingParams, generate
from specjax.engine.scheduler import Scheduler, _Request
from test_engine import (BS, FIXED, LOOP, METHODS, PARAMS_A, PROMPTS_A, V, baseline, build,
                         fixed, target)

_rng = np.random.default_rng(11)


def _req(i: int, prompt, max_tokens: int = 8) -> _Request:
    return _Request(index=i, req_id=f"s{i}", prompt=[int(t) for t in prompt],
                    params=SamplingParams(max_tokens=max_tokens), seed=0, stop_ids=frozenset())


def _spy_steps(eng: Engine) -> list[list[tuple[int, int, int, int]]]:
    """Record each per-step call's scheduled requests as ``(index, uncomputed tokens
    scheduled, uncomputed tokens before, drafts)``."""
    log, orig = [], eng._step

    def spy(reqs, running):
        log.append([(r.index, r.sched, r.num_tokens - r.num_computed, len(r.drafts)) for r in reqs])
        return orig(reqs, running)

    eng._step = spy
    return log


# --- ragged token batches -------------------------------------------------------------


def test_a_prompt_beside_decoding_rows_takes_its_tokens_not_rows_times_its_length():
    """The issue's case: an 89-token prompt beside two decoding requests is one batch of
    128 token slots (the next power of two of 91), not 4 rows x 128."""
    eng = Engine(target(), None, max_model_len=256, block_size=16, max_num_seqs=4)
    sched = eng.scheduler
    a, b, c = (_req(i, _rng.integers(0, V, n)) for i, n in enumerate((5, 7, 89)))
    waiting, running = collections.deque([a, b]), []
    assert sched.schedule(waiting, running) == [a, b]
    for r in (a, b):                       # their prompts computed, one token sampled
        r.num_computed, r.output = len(r.prompt), [3]
    waiting.append(c)
    reqs = sched.schedule(waiting, running)
    assert reqs == [a, b, c] and [r.sched for r in reqs] == [1, 1, 89]
    batch, qlens, rows = sched.build_batch(reqs)
    assert qlens == [1, 1, 89] and rows == 4 and batch.attn.max_query_len == 128
    assert batch.input_ids.shape == (128,)          # 4 x 128 = 512 before
    for r in reqs:
        sched.release(r)
    assert len(sched.free_blocks) == eng.num_blocks - 1


def test_a_threshold_bounds_every_row_and_the_ragged_steps_query_tiles():
    """``long_prefill_token_threshold`` 16, k 3: a chunk takes 16 tokens, a resumed request's
    last chunk cuts its kept drafts to 16 tokens in all, decoding rows keep k + 1 = 4; so a
    ragged step's ``Q`` is 16 (the flash tiles see the longest row it can hold), not ``T``."""
    def scheduler(**options):
        return Scheduler(max_model_len=256, block_size=16, max_num_seqs=4, num_blocks=64, k=3,
                         lookahead=0, tree=None,
                         options=LoopOptions(max_num_batched_tokens=256, **options))

    sched = scheduler(long_prefill_token_threshold=16)
    assert sched.row_cap == 16
    a, b, c = (_req(i, _rng.integers(0, V, n)) for i, n in enumerate((5, 7, 89)))
    waiting, running = collections.deque([a, b]), []
    sched.schedule(waiting, running)
    for r in (a, b):                       # prompts computed, one token sampled, 3 drafts
        r.num_computed, r.output, r.drafts = len(r.prompt), [3], [1, 2, 3]
    waiting.append(c)
    reqs = sched.schedule(waiting, running)
    assert [(r.sched, len(r.drafts)) for r in reqs] == [(1, 3), (1, 3), (16, 0)]
    batch, qlens, _ = sched.build_batch(reqs)
    assert qlens == [4, 4, 16] and batch.input_ids.shape == (32,)
    assert batch.attn.max_query_len == 16                    # T = 32 before
    c.num_computed, c.drafts = len(c.prompt) - 10, [1, 2, 3, 4, 5, 6, 7, 8]
    assert sched.schedule(collections.deque(), running) == [a, b, c]
    assert (c.sched, c.drafts) == (10, [1, 2, 3, 4, 5, 6])  # 16 tokens with its drafts
    assert scheduler().ragged_slots(4, 64, 89) == (128, 128)   # no threshold: Q = T


@pytest.mark.parametrize("method", [None] + [m for m in ("eagle3", "draft_model", "ngram")
                                             if m in METHODS])
def test_running_requests_decode_every_step_while_a_long_prompt_prefills(method):
    """Budget 24: the 120-token prompt prefills over several steps, and in every one of them
    both short requests are scheduled (one uncomputed token, their drafts). Output equals
    plain greedy decoding without chunking; every step's batch is ragged."""
    prompts = [list(_rng.integers(0, V, 5)), list(_rng.integers(0, V, 7)),
               list(_rng.integers(0, V, 120))]
    sps = [SamplingParams(max_tokens=40), SamplingParams(max_tokens=40), SamplingParams(max_tokens=6)]
    kw = dict(max_model_len=160, block_size=BS, max_num_seqs=3)
    want = generate(target(), None, prompts, sps, **kw)
    k = 3
    eng = Engine(target(), None if method is None else build(method, k, max_model_len=160),
                 **kw, options=LoopOptions(max_num_batched_tokens=24))
    log = _spy_steps(eng)
    tokens = []
    orig_run = eng._run
    eng._run = lambda batch: (tokens.append(batch.input_ids.shape[0]), orig_run(batch))[1]
    out = eng.generate(prompts, sps)
    assert out.token_ids == want.token_ids
    chunk_steps = [s for s in log if any(i == 2 and n < left for i, n, left, _ in s)]
    assert len(chunk_steps) >= 5
    for s in chunk_steps[1:]:               # after the first step, which prefills all three
        rows = {i: (n, left) for i, n, left, _ in s}
        assert rows[0] == (1, 1) and rows[1] == (1, 1), s
        assert sum(n + d for _, n, _, d in s) <= 24
    assert max(tokens) <= 32                 # never rows x query bucket (4 x 128)


# --- chunk boundaries -----------------------------------------------------------------

P15 = list(_rng.integers(0, V, 15))
BOUNDARY_THRESHOLDS = tuple(range(1, BS + 1)) + (len(P15) - 1,)   # every offset mod BS, last token


def _chunked(method: str, threshold: int, max_tokens: int):
    eng = Engine(target(), build(method, 3), max_num_seqs=1,
                 **fixed(long_prefill_token_threshold=threshold, steps_per_sync=1))
    seen = []
    out = eng.generate([P15], SamplingParams(max_tokens=max_tokens), stat_loggers=[seen.append])
    per_step = [(s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens) for s in seen
                if s.num_drafts]
    return eng, out, per_step


def _prompt_rows(eng: Engine, tree) -> list[np.ndarray]:
    """Each ``[num_blocks, BS, ...]`` leaf's rows of the prompt's positions (blocks 1, 2,
    ... in order: the first blocks the pool hands out)."""
    out = []
    for leaf in jax.tree.leaves(jax.device_get(tree)):
        if leaf.ndim >= 2 and leaf.shape[:2] == (eng.num_blocks, BS):
            out.append(leaf.reshape((-1,) + leaf.shape[2:])[BS: BS + len(P15)])
    return out


@pytest.mark.parametrize("method", [m for m in ("eagle3", "draft_model", "dflash") if m in METHODS])
def test_chunk_boundaries_at_every_block_offset_are_lossless(method):
    """Chunks of 1 .. BS tokens (a boundary at every offset modulo the block size) and of
    ``len - 1`` (the last prompt token alone): greedy output equals plain greedy, each
    verification step accepts what the unchunked run's did, and the drafter's and the
    target's KV of the prompt after prefill equal the unchunked run's."""
    want = generate(target(), None, [P15], SamplingParams(max_tokens=14), **FIXED).token_ids
    eng0, whole, steps0 = _chunked(method, 0, 14)
    assert whole.token_ids == want and steps0
    kv0 = _chunked(method, 0, 1)[0]
    want_kv = _prompt_rows(kv0, kv0.target_kv), _prompt_rows(kv0, kv0.draft_state)
    assert want_kv[1], "the drafter keeps per-block state"
    for t in BOUNDARY_THRESHOLDS:
        _, out, steps = _chunked(method, t, 14)
        assert out.token_ids == want, t
        assert steps == steps0, t
        eng = _chunked(method, t, 1)[0]
        for what, got, ref in (("target", _prompt_rows(eng, eng.target_kv), want_kv[0]),
                               ("drafter", _prompt_rows(eng, eng.draft_state), want_kv[1])):
            for g, w in zip(got, ref):
                np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6,
                                           err_msg=f"{method} {what} chunk {t}")


# --- preemption -----------------------------------------------------------------------

#: eight requests, four running at a time, growing to 2..5 blocks of 8 each in a pool of 8
#: blocks: they preempt each other again and again
PROMPTS_P = [list(_rng.integers(0, V, n)) for n in (3, 5, 2, 7, 4, 6, 3, 5)]
PARAMS_P = [SamplingParams(max_tokens=m) for m in (30, 25, 33, 20, 28, 31, 22, 26)]
SMALL_POOL = dict(FIXED, num_blocks=9, max_num_seqs=4)


def _plain_p():
    return generate(target(), None, PROMPTS_P, PARAMS_P, **dict(FIXED, max_num_seqs=4))


_LOOPS = (dict(steps_per_sync=1), dict(steps_per_sync=4, overlap=False),
          dict(steps_per_sync=4, overlap=True))


@pytest.mark.parametrize("method,loop", [(m, lp) for m in (None, "ngram", "eagle3", "draft_model")
                                         if m is None or m in METHODS
                                         for lp in (_LOOPS[:1] if m == "ngram" else _LOOPS)])
def test_preemption_by_recompute_is_lossless(method, loop):
    """Pools that preempt >= 5 times, per step and in the device loop (preempting at its
    sync points), with and without overlap: greedy output equals plain greedy's (the
    n-gram proposer drafts on the host, so only per step)."""
    prop = None if method is None else build(method, 3)
    opts = dict(SMALL_POOL, options=dataclasses.replace(LOOP, **loop))
    out = generate(target(), prop, PROMPTS_P, PARAMS_P, **opts)
    assert out.num_preemptions >= 5, out.num_preemptions
    assert sum(m.num_preemptions for m in out.request_metrics) == out.num_preemptions
    assert out.token_ids == _plain_p().token_ids


@pytest.mark.parametrize("method", [None] + [m for m in ("eagle3",) if m in METHODS])
def test_preempted_seeded_requests_sample_what_they_would_have(method):
    """Seeded sampling: a preempted request keeps its output and drafts and is prefilled
    again, so its tokens equal the never-preempted run's."""
    sps = [dataclasses.replace(p, temperature=0.8, seed=i) for i, p in enumerate(PARAMS_P)]
    prop = None if method is None else build(method, 3)
    small = generate(target(), prop, PROMPTS_P, sps, **dict(SMALL_POOL, options=dataclasses.replace(
        LOOP, steps_per_sync=1)))
    big = generate(target(), prop, PROMPTS_P, sps, **dict(fixed(steps_per_sync=1), max_num_seqs=4))
    assert small.num_preemptions >= 5 and big.num_preemptions == 0
    assert small.token_ids == big.token_ids


# --- arrivals, timelines, bad input ---------------------------------------------------


def test_arrival_times_and_request_metrics():
    out = generate(target(), None, PROMPTS_A[:2], PARAMS_A[:2], arrival_times=[0.0, 0.25],
                   **FIXED)
    assert out.token_ids == [baseline("A").token_ids[0], baseline("A").token_ids[1]]
    for o, m in zip(out.outputs, out.request_metrics):
        assert len(m.token_times) == len(o.token_ids)
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
        assert m.token_times == sorted(m.token_times) and m.token_times[-1] == m.finished_time
        assert m.num_preemptions == 0
    assert out.request_metrics[1].first_scheduled_time >= 0.25


def test_bad_scheduling_input_is_refused_by_name_before_any_work():
    for bad in ([0.0], [0.0, -1.0], [0.0, float("nan")], "soon"):
        with pytest.raises(ArgumentError, match="arrival_times"):
            generate(target(), None, PROMPTS_A[:2], PARAMS_A[:2], arrival_times=bad, **FIXED)
    with pytest.raises(ValueError, match=r"prompts\[0\] has 48 tokens; max_model_len=48"):
        generate(target(), None, [[1] * 48], **FIXED)
    with pytest.raises(ValueError, match=r"prompts\[0\] may need 6 KV blocks.*num_blocks=4"):
        generate(target(), None, PROMPTS_A[:2], SamplingParams(max_tokens=40),
                 **dict(FIXED, num_blocks=4))
    with pytest.raises(ArgumentError, match="gpu_memory_utilization"):
        Engine(target(), None, gpu_memory_utilization=0.5, max_num_seqs=4, **FIXED)  # num_blocks too
    with pytest.raises(ArgumentError, match="gpu_memory_utilization"):
        Engine(target(), None, max_model_len=48, gpu_memory_utilization=1.5)
    with pytest.raises(ArgumentError, match="gpu_memory_utilization.*num_blocks"):
        Engine(target(), None, max_model_len=48, gpu_memory_utilization=0.5)     # CPU
    for name in ("max_num_partial_prefills", "max_long_partial_prefills"):   # V1 reads neither
        with pytest.raises(TypeError, match=name):
            generate(target(), None, PROMPTS_A[:1], **{name: 1}, **FIXED)


def test_warmup_compiles_the_ragged_steps_of_a_chunked_prompt():
    """``Engine.warmup(num_tokens=)`` compiles the ragged shapes a long prompt's chunks take
    beside decoding rows: serving it afterwards compiles nothing."""
    from specjax.engine import step_cache_size

    eng = Engine(target(), None, max_model_len=160, block_size=BS, max_num_seqs=3,
                 options=LoopOptions(max_num_batched_tokens=24, batch_buckets=(4,),
                                     query_buckets=(1, 32), context_buckets=(20,),
                                     steps_per_sync=1))
    eng.warmup([4], [1, 32], [20], num_tokens=[4, 8, 16, 32])
    before = step_cache_size()
    prompts = [list(_rng.integers(0, V, 5)), list(_rng.integers(0, V, 7)),
               list(_rng.integers(0, V, 100))]
    out = eng.generate(prompts, SamplingParams(max_tokens=12))
    assert step_cache_size() == before
    assert out.token_ids == generate(target(), None, prompts, SamplingParams(max_tokens=12),
                                     max_model_len=160, block_size=BS).token_ids


def test_a_prompt_longer_than_the_largest_query_bucket_prefills_in_bucket_sized_chunks():
    """Issue 59's ``query_buckets=(4,)`` with a 19-token prompt: no request takes more
    tokens per step than the largest query bucket, so the prompt prefills in chunks of 4
    and the output is plain greedy's."""
    prompt = [int(t) for t in _rng.integers(0, V, 19)]
    sp = SamplingParams(max_tokens=6)
    eng = Engine(target(), None, max_model_len=48, block_size=BS, max_num_seqs=1,
                 options=LoopOptions(query_buckets=(4,), steps_per_sync=1))
    log = _spy_steps(eng)
    out = eng.generate([prompt], sp)
    assert out.token_ids == generate(target(), None, [prompt], sp, max_model_len=48,
                                     block_size=BS).token_ids
    assert [s[0][1] for s in log[:5]] == [4, 4, 4, 4, 3]
    from specjax.engine.scheduler import _pick
    with pytest.raises(ValueError, match=r"LoopOptions.query_buckets=\(4,\): no bucket holds 19 "
                                         r"\(tokens of one request"):
        eng.scheduler.buckets(1, 19, 1)
    assert _pick((4, 8), 5) == 8

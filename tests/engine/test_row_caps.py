"""Per-request drafts in a flat token batch (issue 55's mixed cell): ``adaptive_k`` on the
device loop gives each request its own cap and the step only the token slots they fill.

References: brute force over every cap vector for the policy (:func:`choose_caps`); the
host batch builder (``build_batch`` with ``num_tokens_pad``) for the device batch; plain
greedy decoding for the engine's output; the loop's compile cache for zero recompiles."""

import itertools

import jax
import numpy as np
import pytest

from specjax import adaptive_k as ak
from specjax.engine import Engine, SamplingParams
from specjax.runtime.decode_loop import device_batch, loop_cache_size, make_loop_state
from test_decode_loop import host_batch
from test_engine import (
    V, build, fixed, target)


def _gain(a, c):
    return sum((1 - x ** (n + 1)) / (1 - x) for x, n in zip(np.clip(a, 0, 1 - 1e-9), c))


@pytest.mark.parametrize("seed", range(6))
def test_choose_caps_against_brute_force(seed):
    """The best expected tokens a second over every option and every cap vector that fits
    (``c_r <= min(K, cap_r)``; a flat option: ``sum(1 + c) <= T``; a rectangle: ``c_r =
    min(K, cap_r)``) is what ``choose_caps``' choice achieves; with rectangles only it is
    ``choose_k``'s."""
    rng = np.random.default_rng(seed)
    for _ in range(25):
        n = int(rng.integers(1, 5))
        a = rng.choice([0.05, 0.3, 0.6, 0.9, 0.97], n)
        caps = rng.integers(0, 4, n)
        rect = np.sort(rng.uniform(1.0, 2.0, 4))
        opts = [(k, None, rect[k]) for k in range(4)]
        opts += [(k, t, rect[k] * rng.uniform(0.6, 1.0)) for k in range(1, 4)
                 for t in sorted(set(rng.integers(n, 4 * n + 1, 2).tolist()))]
        best = 0.0
        for k, t, cost in opts:
            lim = np.minimum(caps, k)
            if t is None:
                best = max(best, _gain(a, lim) / cost)
                continue
            for c in itertools.product(*(range(x + 1) for x in lim)):
                if n + sum(c) <= t:
                    best = max(best, _gain(a, c) / cost)
        k, t, c = ak.choose_caps(a, caps, opts)
        cost = dict(((kk, tt), co) for kk, tt, co in opts)[k, t]
        assert (c <= np.minimum(caps, k)).all() and (t is None or n + c.sum() <= t)
        assert t is not None or (c == np.minimum(caps, k)).all()
        assert _gain(a, c) / cost == pytest.approx(best, rel=1e-12)
        k0, t0, c0 = ak.choose_caps(a, caps, opts[:4])
        assert t0 is None and k0 == ak.choose_k(a, caps, rect)


def test_mixed_acceptance_splits_the_drafts():
    """Half the requests at 0.9, half at 0.3, the step's cost growing with its token slots
    (0.6 a draft of the chain, more per token bucket): long chains for the first half, one
    draft or none for the rest, in fewer slots than the rectangle."""
    v = {64: 9.37, 128: 9.83, 256: 10.8, 512: 15.56}
    rect = [v[64 * q] + 0.6 * k for k, q in enumerate((1, 2, 4, 4, 8, 8, 8, 8))]
    opts = [(k, None, rect[k]) for k in range(8)] + [
        (k, t, v[t] + 0.6 * k) for k in range(1, 8) for t in (128, 256) if t < 64 * (
            1 << k.bit_length())]
    a = np.array([0.9] * 32 + [0.3] * 32)
    k, t, c = ak.choose_caps(a, np.full(64, 7), opts)
    k0 = ak.choose_k(a, np.full(64, 7), np.array(rect))
    assert t == 256 and k >= 4 and (c[:32] == k).all() and (c[32:] <= 1).all()
    assert _gain(a, c) / dict(((kk, tt), co) for kk, tt, co in opts)[k, t] > \
        1.05 * _gain(a, np.full(64, k0)) / rect[k0]


def test_device_batch_in_flat_token_slots_equals_host_build_batch():
    """Rows with their own caps in ``num_tokens_pad`` slots (fewer than rows x their
    bucket): every leaf of the device batch equals ``build_batch``'s in the same slots;
    ``make_loop_state`` refuses slots below the requests' tokens, naming the argument."""
    rng = np.random.default_rng(3)
    B, C, Q, k, mml, bs = 8, 8, 4, 3, 60, 8
    for trial in range(4):
        n = int(rng.integers(2, B + 1))
        caps = rng.integers(0, k + 1, n)
        t = int(max(n + caps.sum(), B + 1))
        nc, out_n = rng.integers(0, 40, n), rng.integers(0, 10, n)
        maxt = out_n + rng.integers(1, 8, n)
        drafts = [rng.integers(0, V, int(caps[i])).tolist() for i in range(n)]
        last = rng.integers(0, V, n)
        blocks = [rng.permutation(np.arange(1, 70))[:C].tolist() for _ in range(n)]
        st = make_loop_state(last_token=last, num_computed=nc, drafts=drafts, max_tokens=maxt,
                             num_output=out_n, block_ids=blocks, k=k, num_reqs_pad=B,
                             blocks_per_req_pad=C, query_len_pad=Q, max_model_len=mml,
                             block_size=bs, k_cap=caps, num_tokens_pad=t)
        assert st.num_tokens_pad == (None if t == B * Q else t)
        got, nd = jax.jit(lambda s: device_batch(s, k=k, vocab_size=V))(st)
        want, _ = host_batch(st, last, nc, drafts, maxt, out_n, blocks, k=k, mml=mml, bs=bs,
                             num_tokens_pad=t)
        assert got.input_ids.shape == (t,)
        for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    with pytest.raises(ValueError, match="num_tokens_pad"):
        make_loop_state(last_token=last, num_computed=nc, drafts=drafts, max_tokens=maxt,
                        num_output=out_n, block_ids=blocks, k=k, num_reqs_pad=B,
                        blocks_per_req_pad=C, query_len_pad=Q, max_model_len=mml,
                        block_size=bs, k_cap=caps, num_tokens_pad=n + int(caps.sum()) - 1)


@pytest.mark.parametrize("overlap", (False, True))
def test_engine_gives_each_request_its_drafts_in_fewer_slots(monkeypatch, overlap):
    """``adaptive_k`` on the device loop with alternating acceptance estimates (0.95 /
    0.05 by row) and a hand-set cost table where 8 token slots cost less than rows of 4:
    calls run in 8 slots (the four requests: 2 drafts for each high row, none for the low
    ones; fewer requests: slots left over go to the low rows too),
    greedy output equals plain, nothing compiles after warm-up."""
    from specjax.engine import device_loop

    monkeypatch.setattr(device_loop, "acceptance_rate",
                        lambda h, t: np.array([0.95, 0.05] * len(h))[: len(h)])
    seen = []
    real = device_loop.decode_loop

    def spy(*a, **kw):
        st = a[5]
        seen.append((st.num_tokens_pad, int(st.num_reqs), None if st.k_cap is None else
                     tuple(np.asarray(st.k_cap).tolist())))
        return real(*a, **kw)

    monkeypatch.setattr(device_loop, "decode_loop", spy)
    prompts = [[5, 9, 2, 7], [11, 3, 3], [8, 1, 6, 2, 9], [4, 4]]
    sps = [SamplingParams(max_tokens=m) for m in (9, 14, 20, 24)]
    opts = dict(query_buckets=(1, 2, 4, 16), token_buckets=(8, 16), steps_per_sync=4)
    plain = Engine(target(), None, max_num_seqs=4, **fixed(**opts)).generate(prompts, sps)
    eng = Engine(target(), build("draft_model", 3), max_num_seqs=4,
                 **fixed(overlap=overlap, adaptive_k=True, **opts))
    assert eng.driver.token_options(4, 3) == [8] and eng.driver.token_options(4, 1) == []
    eng.warmup([4], [16])
    assert set(eng.k_token_costs[4]) == {(2, 8), (3, 8)}
    eng.k_costs[4] = np.array([1.0, 1.5, 2.0, 2.5])
    eng.k_token_costs[4] = {(2, 8): 1.6, (3, 8): 1.8}
    before = loop_cache_size()
    seen.clear()
    out = eng.generate(prompts, sps)
    assert out.token_ids == plain.token_ids
    assert loop_cache_size() == before
    flat = [(n, caps) for tokens, n, caps in seen if tokens == 8]
    assert all(n + sum(c) <= 8 and c[0] == max(c) >= 2 for n, c in flat), seen
    assert (4, (2, 0, 2, 0)) in flat, seen
    timed = {key: v for table in eng.driver.seen_costs.values() for key, v in table.items()}
    assert timed and all(v > 0 and key[0] <= 3 and key[1] in (None, 8) for key, v in timed.items())


class _Sched:
    @staticmethod
    def buckets(n, q, c, k=None):
        return (4, q, c)


class _Eng:
    """What ``DeviceLoopDriver.policy`` / ``observe_cost`` read of an engine: k = 3, bucket
    4, rectangles of 1.0 / 1.5 / 2.0 / 2.5 s and 8 slots drafting 3 at 1.6 s."""
    k, scheduler = 3, _Sched()
    k_costs = {4: np.array([1.0, 1.5, 2.0, 2.5])}
    k_token_costs = {4: {(3, 8): 1.6}}

    class options:
        adaptive_k = True

    def _costs(self, n):
        return self.k_costs[4]

    def k_for(self, r, n):
        return 3


def test_the_policy_weighs_the_calls_own_times_over_the_profile():
    """``observe_cost``: seconds an iteration from dispatch (or the previous call's results,
    when queued behind it) to the results, averaged per (K, T); compiling or empty calls left
    out. ``policy`` prefers 8 slots (profiled 1.6 s) for two high and two low requests; a
    table set by hand stays as set; with the engine's own profile, a choice run is priced at
    its own time and the others at their profile times the median ratio seen / profiled,
    less ``EXPLORE``."""
    from types import SimpleNamespace

    from specjax.engine.device_loop import DeviceLoopDriver, RowCaps, _InFlight

    eng = _Eng()
    drv = DeviceLoopDriver(eng)

    def call(t0, t1, iters, key):
        drv.observe_cost(_InFlight([0] * 3, None, None, t0, RowCaps(3), key), t1, iters)

    call(10.0, 10.8, 8, (3, None))          # from its dispatch: 0.1 s an iteration
    call(10.5, 11.6, 8, (3, None))          # queued behind the first: from 10.8
    call(11.0, 20.0, 8, None)               # compiled: not timed (but its end counts)
    call(19.0, 21.6, 8, (3, 8))             # from 20.0: 0.2
    call(25.0, 25.0, 0, (3, 8))             # no iteration
    call(30.0, 32.4, 4, (3, None))          # 0.6, averaged with 0.1: 0.35
    assert drv.seen_costs == {4: pytest.approx({(3, None): 0.35, (3, 8): 0.2})}
    rows = [SimpleNamespace(acc_hits=h, acc_trials=10.0) for h in (9.5, 0.5, 9.5, 0.5)]
    drv.seen_costs = {}
    assert drv.policy(rows) == RowCaps(3, 8, (2, 0, 2, 0))
    drv.seen_costs = {4: {(3, 8): 4.0}}
    assert drv.policy(rows) == RowCaps(3, 8, (2, 0, 2, 0))       # no profile: set by hand
    drv.profiled = {4: (eng.k_costs[4], eng.k_token_costs[4])}
    rates = ak.acceptance_rate(np.array([9.5, 0.5] * 2), np.full(4, 10.0))
    drv.seen_costs = {4: {(3, 8): 1.6 * 3, (1, None): 1.5 * 1.1, (2, None): 2.0 * 1.3}}
    pick = drv.policy(rows)      # the rectangles' median ratio, 1.2, prices the others
    assert pick == RowCaps(1) and ak.choose_caps(   # (unscaled: K = 0 would win)
        rates, np.full(4, 3), [(0, None, 1.2), (1, None, 1.65), (2, None, 2.6),
                               (3, None, 3.0), (3, 8, 4.8)])[:2] == (1, None)
    drv.seen_costs = {4: {(3, 8): 4.0}}      # one ratio, 2.5: the flat step wins again
    assert drv.policy(rows) == RowCaps(3, 8, (2, 0, 2, 0))  # (unscaled: K = 1 would win)
    drv.seen_costs = {4: {(3, None): 2.5}}     # rectangles as profiled: so are the flat steps
    assert drv.policy(rows) == RowCaps(3, 8, (2, 0, 2, 0))
    # a choice not run, within EXPLORE of the best, is tried (K = 2: 3.99 / s as profiled,
    # 4.20 discounted, K = 1 4.13), then priced at its own time
    drv.seen_costs = {4: {(0, None): 1.0, (1, None): 1.5, (3, 8): 4.8}}
    assert drv.policy(rows) == RowCaps(2)
    drv.seen_costs[4][2, None] = 2.0
    assert drv.policy(rows) == RowCaps(1)
    eng.k_token_costs = {4: {(3, 8): 1.6, (2, 8): 1.5}}
    drv.profiled = {4: (eng.k_costs[4], eng.k_token_costs[4])}
    drv.seen_costs = {4: {(3, 8): 4.8, (0, None): 1.0, (1, None): 1.5, (2, None): 2.0}}
    # each kind its own ratio: (2, 8) at 1.5 x 3 (over both kinds, 1.0: (2, 8) would win)
    assert drv.policy(rows) == RowCaps(1)


def test_sampling_in_flat_token_slots_keeps_the_target_distribution(monkeypatch):
    """Chi-square at alpha = 1e-3 on the first verified token (temperature 1, the draft model
    the target drafting its argmax) with every device-loop call forced into ``2 x B`` token
    slots, even rows verifying up to 2 drafts and odd rows none."""
    from specjax.constants import next_power_of_2
    from specjax.engine import LoopOptions, device_loop, generate
    from test_engine import BS, N_SAMPLES, SAMPLE_PROMPT, _chi2_first_verified

    calls = []

    def forced(self, rows):
        b = next_power_of_2(len(rows))
        calls.append(b)
        return device_loop.RowCaps(2, 2 * b, tuple(2 - 2 * (i % 2) for i in range(len(rows))))

    monkeypatch.setattr(device_loop.DeviceLoopDriver, "policy", forced)
    tgt = target(4.0)
    prop = build("draft_model", 2, tgt, max_model_len=16)
    sps = [SamplingParams(max_tokens=4, temperature=1.0, seed=i) for i in range(N_SAMPLES)]
    out = generate(tgt, prop, [SAMPLE_PROMPT] * N_SAMPLES, sps, max_model_len=16, block_size=BS,
                   options=LoopOptions(query_buckets=(1, 2, 4, 8), context_buckets=(2,),
                                       steps_per_sync=2, adaptive_k=True))
    assert calls and _chi2_first_verified(out, tgt) > 1e-3
    assert 0 < out.spec_stats.num_draft_tokens

"""A drafter shorter than the target (``speculative_config.max_model_len``, vLLM's draft
``max_model_len``): requests whose drafts would pass the drafter's limit decode without
drafts while the others keep drafting, in the per-step path and the device loop, inside the
compiled buckets; greedy output still equals plain greedy decoding, and a request-step
without drafts is not counted as a draft (vLLM's ``observe_draft`` only sees steps that
verified drafts)."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

from specjax import demo_models
from specjax.runtime.decode_loop import loop_cache_size
from specjax.runtime.step import step_cache_size

K = 3
LIMIT = 50            # the drafter's limit
MAX_MODEL_LEN = 128   # the target's
MAX_TOKENS = 24


@functools.lru_cache(maxsize=None)
def _target():
    from specjax.engine import TargetModel
    from specjax.models import registry

    kind, cfg, params = demo_models.load("target")
    return TargetModel(registry.make_model(kind, cfg), params)


def _prompts():
    short = list(b"import os\n")                               # 10 tokens: 10 -> 34
    long = list(b"def main():\n    x = compute(1)\n    y = 2")  # 40: 40 -> 64, past at 48
    assert len(short) == 10 and len(long) == 40
    return [short, long]


def _proposer(limit):
    from specjax import make_proposer

    tgt = _target()
    d = {"model": str(demo_models.path("eagle3")), "num_speculative_tokens": K}
    if limit is not None:
        d["max_model_len"] = limit
    return make_proposer(d, target=tgt.model, target_params=tgt.params,
                         max_model_len=MAX_MODEL_LEN)


def _record(monkeypatch):
    """Every verification the engine runs, per row: ``(num_tokens, num_drafts)`` with
    ``num_tokens`` the request's committed tokens when the step starts (its drafts sit at
    positions ``num_tokens ..``), read from the step's batch / the loop's output."""
    import specjax.engine.device_loop as device_loop_mod
    import specjax.engine.engine as engine_mod

    seen: list[list[tuple[int, int]]] = []
    shapes: set = set()
    run, dl = engine_mod.Engine._run, device_loop_mod.decode_loop

    def _run(self, batch):
        shapes.add(("step", np.shape(batch.input_ids), np.shape(batch.attn.block_table)))
        nd = np.asarray(batch.sdm.num_draft_tokens)
        seq = np.asarray(batch.attn.seq_lens)
        n = int(np.asarray(batch.attn.num_reqs))
        q = np.diff(np.asarray(batch.attn.query_start_loc))[:n]
        # a decoding row holds its last token then its drafts: seq = num_tokens + nd
        seen.append([(int(seq[i] - nd[i]) if q[i] == 1 + nd[i] else -1, int(nd[i]))
                     for i in range(n)])
        return run(self, batch)

    def decode_loop(step, tp, dp, tkv, ds, state, **kw):
        shapes.add(("loop", kw.get("early_exit"), np.shape(state.drafts),
                    np.shape(state.block_table)))
        nt = np.asarray(jax.device_get(state.num_computed)) + 1
        n = int(np.asarray(state.num_reqs))
        out, tkv, ds, state = dl(step, tp, dp, tkv, ds, state, **kw)
        o = jax.device_get(out)
        for it in range(int(o.num_iters)):
            seen.append([(int(nt[i]), int(o.num_drafts[it, i])) for i in range(n)
                         if o.counts[it, i]])
            nt = nt + o.counts[it]
        return out, tkv, ds, state

    monkeypatch.setattr(engine_mod.Engine, "_run", _run)
    monkeypatch.setattr(device_loop_mod, "decode_loop", decode_loop)   # the engine's loop calls
    return seen, shapes


@pytest.mark.parametrize("steps_per_sync", [1, 4])
def test_drafting_stops_past_the_drafters_limit(monkeypatch, steps_per_sync):
    from specjax import generate
    from specjax.engine import LoopOptions, SamplingParams

    tgt, prompts, sp = _target(), _prompts(), SamplingParams(max_tokens=MAX_TOKENS)
    want = generate(tgt, None, prompts, sp, max_model_len=MAX_MODEL_LEN)
    free = generate(tgt, _proposer(None), prompts, sp, max_model_len=MAX_MODEL_LEN,
                    options=LoopOptions(steps_per_sync=steps_per_sync))
    prop = _proposer(LIMIT)
    assert prop.feed.drafter_max_model_len == LIMIT and prop.feed.max_model_len == MAX_MODEL_LEN
    seen, shapes = _record(monkeypatch)
    c_step, c_loop = step_cache_size(), loop_cache_size()
    got = generate(tgt, prop, prompts, sp, max_model_len=MAX_MODEL_LEN,
                   options=LoopOptions(steps_per_sync=steps_per_sync))
    grew = (step_cache_size() - c_step, loop_cache_size() - c_loop)

    # lossless
    assert got.token_ids == want.token_ids == free.token_ids

    # the oracle: after the prefill, a row verifies min(k, tokens it may still emit - 1)
    # drafts while num_tokens + k <= LIMIT (every draft below the drafter's limit), else none
    per_row = [[], []]
    for rows in seen:
        for nt, nd in rows:
            if nt < 0:              # the prefill
                assert nd == 0
                continue
            i = int(nt >= len(prompts[1]))     # the lengths never overlap: 10..34, 40..64
            left = MAX_TOKENS - (nt - len(prompts[i]))
            want_nd = min(K, left - 1) if nt + K <= LIMIT else 0
            assert nd == want_nd, (i, nt, nd)
            per_row[i].append((nt, nd))
    short, long = per_row
    assert all(nt + K <= LIMIT for nt, _ in short)                  # never reaches it
    assert any(nd == 0 for nt, nd in long) and any(nd == K for nt, nd in long)

    # metrics: a request-step without drafts is no draft (vLLM counts observed drafts only)
    s = got.spec_stats
    rows = [r for step in per_row for r in step]
    assert s.num_drafts == sum(1 for _, nd in rows if nd)
    assert s.num_draft_tokens == sum(nd for _, nd in rows)
    for i, o in enumerate(got.outputs):
        assert o.num_draft_tokens == sum(nd for _, nd in per_row[i])
    assert s.num_draft_tokens < free.spec_stats.num_draft_tokens
    # inside the compiled buckets: the gate is a mask, so at most one compile per bucket
    n_step = sum(1 for x in shapes if x[0] == "step")
    n_loop = sum(1 for x in shapes if x[0] == "loop")
    assert grew[0] <= n_step and grew[1] <= n_loop, (grew, shapes)
    assert (n_loop > 0) == (steps_per_sync > 1)


@pytest.mark.smoke
def test_drafter_limit_longer_than_target_refused():
    from specjax import make_proposer

    tgt = _target()
    d = {"model": str(demo_models.path("eagle3")), "num_speculative_tokens": K,
         "max_model_len": 256}
    with pytest.raises(ValueError, match=r"max_model_len=256.*max_model_len=128"):
        make_proposer(d, target=tgt.model, target_params=tgt.params, max_model_len=128)


@pytest.mark.smoke
def test_history_proposer_feed_carries_the_limit():
    from specjax import make_proposer

    p = make_proposer({"method": "ngram", "num_speculative_tokens": 2, "max_model_len": 32},
                      max_model_len=64)
    assert p.feed.max_model_len == 64 and p.feed.drafter_max_model_len == 32
    same = make_proposer({"method": "ngram", "num_speculative_tokens": 2, "max_model_len": 64},
                         max_model_len=64)
    assert same.feed.drafter_max_model_len is None


TREE = "[(0,), (1,), (0, 0), (1, 0), (0, 0, 0), (1, 0, 0)]"   # 6 nodes, depth 3


@pytest.mark.parametrize("steps_per_sync", [1, 4])
def test_tree_drafting_stops_past_the_drafters_limit(monkeypatch, steps_per_sync):
    """Trees: a request verifies no node once its deepest level would pass the limit
    (``num_tokens + depth > limit``), in both loops; greedy output stays plain greedy's."""
    from specjax import generate, make_proposer
    from specjax.engine import LoopOptions, SamplingParams

    tgt, prompts, sp = _target(), _prompts(), SamplingParams(max_tokens=MAX_TOKENS)
    want = generate(tgt, None, prompts, sp, max_model_len=MAX_MODEL_LEN)
    d = {"model": str(demo_models.path("eagle3")), "num_speculative_tokens": 6,
         "speculative_token_tree": TREE, "max_model_len": LIMIT}
    prop = make_proposer(d, target=tgt.model, target_params=tgt.params,
                         max_model_len=MAX_MODEL_LEN)
    depth = prop.feed.token_tree.depth
    assert depth == 3 and prop.feed.drafter_max_model_len == LIMIT
    seen, _ = _record(monkeypatch)
    got = generate(tgt, prop, prompts, sp, max_model_len=MAX_MODEL_LEN,
                   options=LoopOptions(steps_per_sync=steps_per_sync))
    assert got.token_ids == want.token_ids
    on = off = 0
    for rows in seen:
        for nt, nd in rows:
            if nt < 0:
                continue
            i = int(nt >= len(prompts[1]))
            left = MAX_TOKENS - (nt - len(prompts[i]))
            if nt + depth > LIMIT:
                assert nd == 0, (i, nt, nd)
                off += 1
            elif left > 1:
                assert nd > 0, (i, nt, nd)
                on += 1
    assert on and off

"""The device-resident decode loop (``specjax.runtime.decode_loop``, ``LoopOptions(steps_per_sync=N)``).

The references are independent of the loop: the host batch builder (``build_batch``) for
the batch the loop builds on the device; the per-step loop (``steps_per_sync=1``) and plain
greedy decoding (itself checked against a naive dense loop in ``test_engine.py``) for the
tokens; the plain greedy output cut by hand for the stop rules.
"""

import suite_paths  # tests/support: where the suite's pieces are
import logging
import os

import jax
import numpy as np
import pytest

import specjax
from specjax.runtime.batch import build_batch, trim_drafts
from specjax.runtime.decode_loop import (LoopState, decode_loop, device_batch, loop_blocks_needed,
                                 loop_cache_size, make_loop_state)
from specjax.engine import Engine, LoopOptions, SamplingParams, generate, step_cache_size

try:
    from test_engine import (BS, FIXED, METHODS, MML, PARAMS_A, PARAMS_B, PROMPTS_A, PROMPTS_B,
                             V, baseline, build, eos_b, fixed, target)  # noqa: F401
except ImportError:  # tests/ made a package
    from tests.test_engine import (BS, FIXED, METHODS, MML, PARAMS_A, PARAMS_B, PROMPTS_A,  # noqa: F401
                                   PROMPTS_B, V, baseline, build, eos_b, fixed,
                                   target)

DEVICE_METHODS = [m for m in ("eagle", "eagle3", "dflash", "medusa", "mtp", "draft_model", "ngram_gpu",
                              "extract_hidden_states") if m in METHODS]


def run(proposer, which: str, n: int = 1, params=None, stat_loggers=(), **loop):
    if which == "A":
        return generate(target(), proposer, PROMPTS_A, params or PARAMS_A,
                        stat_loggers=stat_loggers, **fixed(steps_per_sync=n, **loop))
    return generate(target(), proposer, PROMPTS_B, params or PARAMS_B, max_num_seqs=3,
                    eos_token_id=eos_b(), stat_loggers=stat_loggers,
                    **fixed(steps_per_sync=n, **loop))


# --- the batch the loop builds on the device -------------------------------------------


def host_batch(st, last, nc, drafts, maxt, out_n, blocks, *, k, mml, bs, **kw):
    """``(build_batch's batch, the drafts it keeps)`` for the requests of loop state ``st``:
    each one's drafts trimmed by ``trim_drafts``' rule (max_tokens, max_model_len), in
    ``st``'s buckets; ``kw``: more ``build_batch`` arguments."""
    n, B, C = len(last), st.num_reqs_pad, st.block_table.shape[1]
    kept = []
    for i in range(n):
        room = mml - (int(nc[i]) + 1)
        kept.append(trim_drafts(drafts[i], max_new_tokens=min(room, int(maxt[i] - out_n[i])),
                                kv_room=room, k=k, vocab_size=V))
    return build_batch([[int(last[i])] + kept[i] for i in range(n)], num_computed=nc,
                       num_drafts=[len(d) for d in kept], block_ids=blocks, block_size=bs,
                       num_reqs_pad=B, query_len_pad=st.query_len_pad, blocks_per_req_pad=C,
                       max_spec_len=k, seeds=np.asarray(st.sampling.seeds[:n]),
                       num_output_tokens=out_n, **kw), kept


@pytest.mark.smoke
@pytest.mark.parametrize("k", [0, 3])
def test_device_batch_equals_host_build_batch(k):
    """Random decoding requests (drafts trimmed near max_tokens / max_model_len, a draft
    outside the vocabulary): every leaf of the device batch equals build_batch's."""
    rng = np.random.default_rng(k)
    B, C, Q, mml, bs = 8, 8, 4, 60, 8
    for trial in range(4):
        n = int(rng.integers(1, B + 1))
        nc = rng.integers(0, 50, n)
        out_n = rng.integers(0, 10, n)
        maxt = out_n + rng.integers(1, 6, n)
        drafts = [rng.integers(0, V, int(rng.integers(0, k + 1))).tolist() for _ in range(n)]
        if k and n > 1:
            drafts[1] = (drafts[1] + [V + 3])[:k]        # cut there
        last = rng.integers(0, V, n)
        blocks = [rng.permutation(np.arange(1, 70))[:C].tolist() for _ in range(n)]
        temp = rng.choice([0.0, 0.7], n)
        st = make_loop_state(last_token=last, num_computed=nc, drafts=drafts, max_tokens=maxt,
                             num_output=out_n, block_ids=blocks, k=k, num_reqs_pad=B,
                             blocks_per_req_pad=C, query_len_pad=Q, max_model_len=mml,
                             block_size=bs, temperature=temp, seeds=rng.integers(0, 99, n))
        got, nd = jax.jit(lambda s: device_batch(s, k=k, vocab_size=V))(st)
        want, kept = host_batch(st, last, nc, drafts, maxt, out_n, blocks, k=k, mml=mml,
                                bs=bs, temperature=temp)
        assert np.asarray(nd)[:n].tolist() == [len(d) for d in kept]
        assert got.all_greedy == want.all_greedy and got.block_size == want.block_size
        flat_g, tree_g = jax.tree.flatten(got)
        flat_w, tree_w = jax.tree.flatten(want)
        assert tree_g == tree_w
        for a, b in zip(flat_g, flat_w):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_finished_rows_write_no_kv_and_draft_nothing():
    st = make_loop_state(last_token=[5, 6], num_computed=[10, 12], drafts=[[1, 2, 3], [4, 5, 6]],
                         max_tokens=[9, 9], num_output=[1, 1], block_ids=[[1, 2], [3, 4]], k=3,
                         num_reqs_pad=4, blocks_per_req_pad=2, query_len_pad=4, max_model_len=16,
                         block_size=8, finished=[True, False])
    b, nd = device_batch(st, k=3, vocab_size=V)
    assert np.asarray(nd).tolist() == [0, 2, 0, 0]        # row 1: 12 + 1 + 2 = max_model_len - 1
    assert np.asarray(b.attn.slot_mapping)[0] == -1       # the finished row's token writes nothing
    assert np.asarray(b.attn.query_start_loc).tolist() == [0, 1, 4, 4, 4]


def test_make_loop_state_checks():
    kw = dict(last_token=[1], num_computed=[3], drafts=[[1]], max_tokens=[4], num_output=[1],
              block_ids=[[1]], k=2, num_reqs_pad=2, blocks_per_req_pad=2, query_len_pad=4,
              max_model_len=32, block_size=8)
    assert isinstance(make_loop_state(**kw), LoopState)
    with pytest.raises(ValueError, match="drafts\\[0\\]"):
        make_loop_state(**dict(kw, drafts=[[1, 2, 3]]))
    with pytest.raises(ValueError, match="block_ids\\[0\\]"):
        make_loop_state(**dict(kw, num_computed=[20]))
    with pytest.raises(ValueError, match="query_len_pad"):
        make_loop_state(**dict(kw, query_len_pad=2))
    with pytest.raises(ValueError, match="max_tokens"):
        make_loop_state(**dict(kw, max_tokens=[4, 5]))
    assert loop_blocks_needed(10, steps_per_sync=4, k=3, lookahead=4, block_size=8, limit=100) == 4
    assert loop_blocks_needed(10, steps_per_sync=4, k=3, lookahead=4, block_size=8, limit=20) == 3


# --- lossless, every device method -------------------------------------------------------


@pytest.mark.parametrize("method", [pytest.param(m, marks=pytest.mark.smoke)
                                    if m in ("eagle3", "draft_model") else m
                                    for m in DEVICE_METHODS])
def test_greedy_loop_equals_per_step_and_plain(method):
    k = 1 if method == "extract_hidden_states" else 3
    prop = build(method, k)
    for which in ("A", "B"):
        logged: dict = {1: [], 4: []}
        step = run(prop, which, 1, stat_loggers=[logged[1].append])
        loop = run(prop, which, 4, stat_loggers=[logged[4].append])
        assert loop.token_ids == step.token_ids == baseline(which).token_ids, (method, which)
        assert logged[4] == logged[1]              # one SpecDecodingStats per iteration
        assert [o.finish_reason for o in loop.outputs] == [o.finish_reason for o in step.outputs]
        assert loop.spec_stats == step.spec_stats and loop.num_steps == step.num_steps
        assert [(o.num_draft_tokens, o.num_accepted_tokens) for o in loop.outputs] == \
            [(o.num_draft_tokens, o.num_accepted_tokens) for o in step.outputs]


@pytest.mark.smoke
@pytest.mark.parametrize("n", [3, 8])
def test_plain_loop_equals_plain_greedy(n):
    for which in ("A", "B"):
        out = run(None, which, n)
        assert out.token_ids == baseline(which).token_ids
        assert out.num_steps == baseline(which).num_steps


def test_sampled_tokens_equal_per_step():
    """Seeded sampling (temperature, top-k, top-p; greedy requests mixed in): the loop's
    per-request keys advance as the per-step loop's, so the tokens are identical."""
    sps = [SamplingParams(max_tokens=m, temperature=t, top_k=tk, top_p=tp, seed=s)
           for m, t, tk, tp, s in ((9, 1.0, 0, 1.0, 1), (3, 0.0, 0, 1.0, None), (25, 0.8, 5, 1.0, 2),
                                   (14, 1.2, 0, 0.9, 3), (30, 1.0, 0, 1.0, 4), (7, 0.5, 3, 0.8, 5),
                                   (18, 1.0, 0, 1.0, 6))]
    for method in ("draft_model", "eagle3", None):
        prop = None if method is None else build(method, 3)
        step = run(prop, "B", 1, params=sps)
        loop = run(prop, "B", 4, params=sps)
        assert loop.token_ids == step.token_ids, method
        assert loop.spec_stats == step.spec_stats
        if method == "draft_model":    # sampled drafts accepted: several tokens a step
            assert loop.spec_stats.num_accepted_tokens > 0


# --- stops inside a block ----------------------------------------------------------------


def test_stops_mid_block():
    """The draft model (= the target) gets every draft accepted, so each iteration emits
    k + 1 = 4 tokens; stop token ids, EOS, max_tokens and max_model_len falling inside a
    block end the request there and nothing after it is emitted."""
    prop = build("draft_model", 3)
    base = baseline("A").token_ids
    # a stop token first emitted at index 5 (the second token of the second block)
    stop_at = {}
    for i, toks in enumerate(base):
        for j, t in enumerate(toks):
            if j >= 5 and t not in toks[:j]:
                stop_at[i] = (j, t)
                break
    assert stop_at
    sps = [SamplingParams(max_tokens=sp.max_tokens,
                          stop_token_ids=(stop_at[i][1],) if i in stop_at else ())
           for i, sp in enumerate(PARAMS_A)]
    for n in (1, 4):
        out = run(prop, "A", n, params=sps)
        for i, o in enumerate(out.outputs):
            want = base[i][: stop_at[i][0] + 1] if i in stop_at else base[i]
            assert o.token_ids == want, (n, i)
            assert o.finish_reason == ("stop" if i in stop_at else "length")
    # max_tokens not a multiple of k + 1, and max_model_len (prompt 14 + 34 = 48) mid-block
    sps = [SamplingParams(max_tokens=m) for m in (6, 3, 10, 40)]
    out = run(prop, "A", 8, params=sps)
    assert out.token_ids == [b[: sp.max_tokens] for b, sp in zip(base, sps)]
    assert len(out.outputs[3].token_ids) == MML - len(PROMPTS_A[3])
    # EOS mid-block (workload B) is covered by the greedy tests; ignore_eos keeps going
    eos = eos_b()
    sps = [SamplingParams(max_tokens=sp.max_tokens, ignore_eos=True) for sp in PARAMS_B]
    out = run(prop, "B", 4, params=sps)
    ref = generate(target(), None, PROMPTS_B, sps, max_num_seqs=3, eos_token_id=eos, **FIXED)
    assert out.token_ids == ref.token_ids


def test_public_loop_output_and_state():
    """``decode_loop`` on a hand-built state: per-iteration tokens and counts, nothing after a
    stop, the finished flags, and a second call continuing from the returned state."""
    tgt = target()
    prop = build("draft_model", 3)
    step = specjax.make_step(tgt.model, prop)
    kv, ds = step.init_caches(17, BS)
    prompt = PROMPTS_A[0]
    want = baseline("A").token_ids[0]                       # greedy continuation
    # prefill through the per-step path
    b = build_batch([prompt], num_computed=[0], num_drafts=[0], block_ids=[list(range(1, 7))],
                    block_size=BS, num_reqs_pad=2, query_len_pad=16, blocks_per_req_pad=6,
                    max_spec_len=3)
    out, kv, ds = step(tgt.params, step.draft_params, kv, ds, b)
    first = int(out.sampled[0, 0])
    assert first == want[0]
    stop = want[6]
    st = make_loop_state(last_token=[first], num_computed=[len(prompt)],
                         drafts=[np.asarray(out.drafts)[0, : int(out.num_drafts[0])].tolist()],
                         max_tokens=[12], num_output=[1], block_ids=[list(range(1, 7))], k=3,
                         num_reqs_pad=2, blocks_per_req_pad=6, query_len_pad=4, max_model_len=MML,
                         block_size=BS, stop_ids=[[stop]] if stop not in want[:6] else None)
    res, kv, ds, st = decode_loop(step, tgt.params, step.draft_params, kv, ds, st, steps_per_sync=2)
    res = jax.device_get(res)
    assert int(res.num_iters) == 2
    assert res.counts[:, 0].tolist() == [4, 4] and res.counts[:, 1].tolist() == [0, 0]
    assert res.tokens[:, 0].reshape(-1).tolist() == want[1:9]
    assert not res.finished[0] and res.finished[1]          # padding rows count as finished
    res, kv, ds, st = decode_loop(step, tgt.params, step.draft_params, kv, ds, st, steps_per_sync=4)
    res = jax.device_get(res)
    assert int(res.num_iters) == 1 and res.finished[0]      # max_tokens 12: 3 of the 4 tokens
    assert res.tokens[0, 0].tolist() == want[9:12] + [-1] and res.counts[0, 0] == 3


# --- scheduling, compiles, refusals ------------------------------------------------------


def test_joining_leaving_zero_recompiles(caplog, monkeypatch):
    """Workload B (3 rows, 7 requests joining as others leave, EOS and max_tokens stops):
    syncs are fewer than iterations, and a second run with the requests in another order
    compiles nothing (neither the loop nor the per-step prefills)."""
    import specjax.engine.device_loop as loop_mod

    prop = build("eagle3", 3)
    eng = Engine(target(), prop, max_num_seqs=3, **fixed(steps_per_sync=8))
    calls = []
    real = loop_mod.decode_loop
    monkeypatch.setattr(loop_mod, "decode_loop", lambda *a, **k: calls.append(1) or real(*a, **k))
    out = eng.generate(PROMPTS_B, PARAMS_B, eos_token_id=eos_b())
    assert out.token_ids == baseline("B").token_ids
    assert 0 < len(calls) and eng.num_syncs < out.num_steps, (len(calls), eng.num_syncs, out.num_steps)
    before = (loop_cache_size(), step_cache_size())
    with jax.log_compiles(), caplog.at_level(logging.DEBUG, logger="jax"):
        again = eng.generate(PROMPTS_B[::-1], PARAMS_B[::-1], eos_token_id=eos_b())
    assert again.token_ids == baseline("B").token_ids[::-1]
    assert (loop_cache_size(), step_cache_size()) == before
    assert not [r.getMessage() for r in caplog.records if r.getMessage().startswith("Compiling")], [r.getMessage()[:300] for r in caplog.records if r.getMessage().startswith("Compiling")]
    assert len(eng.scheduler.free_blocks) == eng.num_blocks - 1
    assert len(eng.scheduler.free_rows) == 3


@pytest.mark.smoke
def test_refused_by_name():
    def engine(prop, **loop):                # FIXED's one batch bucket holds 4
        return Engine(target(), prop, max_num_seqs=4, **fixed(**loop))

    for method, extra, match in (("ngram", {}, "method='ngram'"), ("suffix", {}, "method='suffix'"),
                                 ("eagle3", dict(disable_padded_drafter_batch=True),
                                  "disable_padded_drafter_batch")):
        if method not in METHODS:
            continue
        with pytest.raises(ValueError, match=match):
            engine(build(method, 3, **extra), steps_per_sync=4)
        engine(build(method, 3, **extra), steps_per_sync=1)   # per-step: fine
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="steps_per_sync"):
            LoopOptions(steps_per_sync=bad)
    step = specjax.make_step(target().model, None)
    st = make_loop_state(last_token=[1], num_computed=[3], drafts=[[]], max_tokens=[4],
                         num_output=[1], block_ids=[[1]], k=0, num_reqs_pad=2,
                         blocks_per_req_pad=2, query_len_pad=2, max_model_len=32, block_size=8)
    kv, ds = step.init_caches(4, 8)
    with pytest.raises(ValueError, match="steps_per_sync"):
        decode_loop(step, target().params, None, kv, ds, st, steps_per_sync=0)
    with pytest.raises(ValueError, match="k=3"):
        decode_loop(specjax.make_step(target().model, build("eagle", 3)), target().params, None,
                    kv, ds, st, steps_per_sync=2)


# --- tree verification in the loop --------------------------------------------------------

TREE = [(0,), (1,), (0, 0), (1, 0), (0, 0, 0), (1, 0, 0)]


def test_device_tree_batch_equals_host_build_batch():
    from specjax.token_tree import TokenTree

    tree = TokenTree.from_choices(TREE)
    k, B, C, Q, mml, bs = tree.num_nodes, 4, 8, 8, 40, 8
    rng = np.random.default_rng(3)
    nc, out_n, maxt = np.array([5, 30, 36, 12]), np.array([1, 3, 2, 4]), np.array([20, 5, 9, 5])
    drafts = [rng.integers(0, V, k).tolist() for _ in range(4)]
    last = rng.integers(0, V, 4)
    blocks = [list(range(1 + 5 * i, 6 + 5 * i)) for i in range(4)]
    st = make_loop_state(last_token=last, num_computed=nc, drafts=drafts, max_tokens=maxt,
                         num_output=out_n, block_ids=blocks, k=k, num_reqs_pad=B,
                         blocks_per_req_pad=C, query_len_pad=Q, max_model_len=mml, block_size=bs)
    got, nd = device_batch(st, k=k, vocab_size=V, tree=tree)
    kept = []
    for i in range(4):
        room = mml - (int(nc[i]) + 1)
        kept.append(trim_drafts(drafts[i], max_new_tokens=min(room, int(maxt[i] - out_n[i])),
                                kv_room=room, k=k, vocab_size=V, tree=tree))
    assert sorted({len(d) for d in kept}) == [0, 2, 3, 6]       # prefixes of every size here
    want = build_batch([[int(last[i])] + kept[i] for i in range(4)], num_computed=nc,
                       num_drafts=[len(d) for d in kept], block_ids=blocks, block_size=bs,
                       num_reqs_pad=B, query_len_pad=Q, blocks_per_req_pad=C, max_spec_len=k,
                       num_output_tokens=out_n, tree=tree)
    assert got.attn.tree_mask == want.attn.tree_mask
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("method", [m for m in ("eagle", "eagle3") if m in METHODS])
def test_tree_loop_equals_per_step(method):
    prop = build(method, len(TREE), speculative_token_tree=str(TREE))
    assert prop.feed.token_tree is not None and not prop.feed.token_tree.is_chain
    for which in ("A", "B"):
        step = run(prop, which, 1)
        loop = run(prop, which, 4)
        assert loop.token_ids == step.token_ids == baseline(which).token_ids, (method, which)
        assert loop.spec_stats == step.spec_stats and loop.num_steps == step.num_steps
    sps = [SamplingParams(max_tokens=sp.max_tokens, temperature=1.0, seed=i)
           for i, sp in enumerate(PARAMS_B)]
    assert run(prop, "B", 4, params=sps).token_ids == run(prop, "B", 1, params=sps).token_ids


# --- benchmarks/loop.py's logic (tiny shapes; the numbers themselves come from the GPU) ----


def test_loop_benchmark_logic(tmp_path):
    import json
    import os
    import sys

    sys.path.insert(0, str(suite_paths.BENCHMARKS))
    import loop as bench

    out = tmp_path / "loop.json"
    assert bench.main(["--target", "tiny", "--batch", "2", "--n", "1,3", "--iters", "4",
                       "--context", "8", "--repeat", "1", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["method"], r["n"]) for r in rows] == [("plain", 1), ("plain", 3), ("eagle3", 1),
                                                     ("eagle3", 3)]
    for r in rows:
        assert r["iters"] == (4 if r["n"] == 1 else 6)          # rounded up to a multiple of N
        assert r["syncs"] == r["iters"] // r["n"]
        assert r["per_iter_ms"] > 0 and r["ttft_ms"] > 0 and r["tokens_per_s"] > 0
        assert r["recompiles"] == 0
        if r["method"] == "plain":
            assert r["tokens_per_iter"] == 1.0 and r["speedup"] == 1.0
        else:   # synthetic acceptance: more than one token an iteration, at most k + 1
            assert 1.0 < r["tokens_per_iter"] <= 4.0


# --- docs/integration.md's device-loop example, run as written -------------------------------


def _doc_serve():
    import re
    from pathlib import Path

    text = (suite_paths.DOCS / "integration.md").read_text()
    m = re.search(r"<!-- device-loop -->\s*```python\n(.*?)```", text, re.S)
    assert m, "docs/integration.md lost its device-loop block"
    ns: dict = {}
    exec(compile(m.group(1), "integration.md", "exec"), ns)  # noqa: S102 (our own documentation)
    return ns["serve_on_device"]


@pytest.mark.parametrize("case", ["eagle3", "ngram_gpu", "plain"])
def test_documented_device_loop_gets_generates_tokens(case):
    if case != "plain" and case not in METHODS:
        pytest.skip(f"{case} is not available")
    serve = _doc_serve()
    tgt = target(4.0)                          # peaked: n-gram drafts get accepted
    prompts = [[5, 9, 2, 17] * 3, [3, 3, 7], list(range(1, 14))]
    ref = generate(tgt, None, prompts, SamplingParams(max_tokens=20), **FIXED)
    stop = ref.token_ids[1][7]                 # one request stops mid-way
    sp = SamplingParams(max_tokens=20, stop_token_ids=(stop,))
    prop = None if case == "plain" else build(case, 3, tgt)
    want = generate(tgt, prop, prompts, sp, **FIXED)
    assert any(o.finish_reason == "stop" for o in want.outputs)
    prop = None if case == "plain" else build(case, 3, tgt)
    got = serve(tgt.model, tgt.params, prop, prompts, max_tokens=20, max_model_len=MML,
                block_size=BS, steps_per_sync=4, stop_ids=(stop,))
    assert got == want.token_ids


@pytest.mark.parametrize("method", [m for m in ("draft_model", "eagle3", "ngram_gpu")
                                    if m in METHODS] + [None])
def test_fixed_trip_count_loop_equals_per_step(method):
    """``early_exit=False``: exactly N iterations a call, the ones after the loop should
    have stopped (a request finished while another waits, or all finished) masked: the
    same tokens, metrics and iteration count as the per-step loop, requests joining."""
    prop = None if method is None else build(method, 3)
    sps = [SamplingParams(max_tokens=sp.max_tokens, temperature=0.9 if i % 2 else 0.0, seed=i)
           for i, sp in enumerate(PARAMS_B)]
    for params in (None, sps):
        step = run(prop, "B", 1, params=params)
        trip = run(prop, "B", 5, params=params, early_exit=False)
        assert trip.token_ids == step.token_ids, method
        assert trip.spec_stats == step.spec_stats and trip.num_steps == step.num_steps
    with pytest.raises(ValueError, match="early_exit"):
        LoopOptions(steps_per_sync=4, early_exit="no")


@pytest.mark.parametrize("on_cpu", [False, True])
def test_warmup_compiles_the_loop(caplog, monkeypatch, on_cpu):
    """``Engine.warmup`` compiles the device loop beside the step (a dummy state of padding
    rows, nothing written): a run afterwards compiles nothing. ``on_cpu``: the target's
    devices as the engine finds them (a CPU target runs the early-exit form only)."""
    import specjax.engine.device_loop as dl

    monkeypatch.setattr(dl, "_on_cpu", lambda params: on_cpu)
    rows = 3 if on_cpu else 2      # a bucket no other test (nor the other case) compiles
    want = generate(target(), None, PROMPTS_A, PARAMS_A, max_num_seqs=rows,
                    **fixed(batch_buckets=(rows,))).token_ids   # compiled outside the window
    for method in ("eagle3", "ngram_gpu"):
        if method not in METHODS:
            continue
        eng = Engine(target(), build(method, 3), max_num_seqs=rows,
                     **fixed(steps_per_sync=4, batch_buckets=(rows,)))
        n = eng.warmup([rows], [16], all_greedy=(True, False), stop_pads=(1,))
        # steps and loops, greedy and not; the loop in both forms (early_exit=None),
        # or the early-exit one on a CPU target
        assert eng.driver.forms() == ((True,) if on_cpu else (False, True))
        assert n == 2 + 2 * (1 if on_cpu else 2), n
        before = (loop_cache_size(), step_cache_size())
        with jax.log_compiles(), caplog.at_level(logging.DEBUG, logger="jax"):
            out = eng.generate(PROMPTS_A, PARAMS_A)
        assert out.token_ids == want
        assert (loop_cache_size(), step_cache_size()) == before, method
        msgs = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Compiling")]
        if method == "ngram_gpu":   # its adapter's own per-step uploads compile on first use
            msgs = [m for m in msgs if "jit(_loop)" in m or "jit(_step)" in m]
        assert not msgs, method
        caplog.clear()


def test_loop_updates_the_caches_in_place():
    """The donated KV caches and proposer state alias the loop's outputs, and no
    instruction of the compiled loop copies a whole KV-cache buffer (per iteration that
    would cost the whole cache's bandwidth).

    Run in a fresh interpreter: compiling this program in a process that had already
    compiled the engine, tree, step and integration-doc test programs crashed XLA's CPU
    compiler (a segmentation fault inside ``low.compile()``): the process's memory mappings
    had crossed ``vm.max_map_count`` (see tests/conftest.py, which now drops the compiled
    programs after each module). The assertions are the same."""
    import subprocess
    import sys

    code = "import test_decode_loop as t; t._caches_in_place_body(); print('ok')"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=suite_paths.pythonpath()))
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-4000:]


def _caches_in_place_body():
    import jax.numpy as jnp

    from specjax.runtime.decode_loop import _loop_jit

    for method in ("eagle3", None):
        if method is not None and method not in METHODS:
            continue
        eng = Engine(target(), None if method is None else build(method, 3), max_num_seqs=4,
                     **fixed(steps_per_sync=4))
        _, q, _ = eng.scheduler.buckets(4, eng.k + 1, 1)
        st = make_loop_state(last_token=[], num_computed=[], drafts=[], max_tokens=[],
                             num_output=[], block_ids=[], k=eng.k, num_reqs_pad=4,
                             blocks_per_req_pad=MML // BS, query_len_pad=q, max_model_len=MML,
                             block_size=BS)
        spec = eng.step._spec
        for early_exit in (True, False):
            low = _loop_jit.lower(spec, 4, None, False, early_exit, eng.target.params,
                                  None if spec.impl is None else eng.step.draft_params,
                                  eng.target_kv, eng.draft_state, st, jnp.asarray(False))
            n_kv = len([x for x in jax.tree.leaves((eng.target_kv, eng.draft_state))
                        if getattr(x, "ndim", 0) == 4])
            assert low.as_text().count("tf.aliasing_output") >= n_kv, method
            assert eng.diagnostics.kv_cache_copies(low.compile().as_text()) == 0, (method, early_exit)

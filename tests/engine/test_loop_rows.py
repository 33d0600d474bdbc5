"""Requests joining and leaving the device loop (``specjax.runtime.loop_rows``) and compiling
ahead of time (``Step.warmup``, ``warmup_loop``, ``specjax.runtime.warmup.Bucket``).

References: ``make_loop_state`` for the rows ``admit`` / ``release`` write (leaf for leaf);
``build_batch`` with no request for ``Step.warmup``'s padding batches; ``generate()``'s
tokens for docs/integration.md's join / leave loop, run as written; the jit caches and
``jax.log_compiles`` for "nothing compiles after warm-up"."""

from __future__ import annotations

import suite_paths  # tests/support: where the suite's pieces are
import dataclasses
import logging
import re

import jax
import numpy as np
import pytest

import specjax
from specjax.engine import SamplingParams, generate, step_cache_size
from specjax.runtime import host_transfer
from specjax.runtime.batch import build_batch
from specjax.runtime.decode_loop import decode_loop, loop_cache_size, make_loop_state
from specjax.runtime.loop_rows import admit, empty_loop_state, release, rows_cache_size, warmup_loop
from specjax.runtime.step import StepBatch
from specjax.runtime.warmup import Bucket, padding_fields
from specjax.token_tree import TokenTree

from test_engine import BS, FIXED, METHODS, MML, build, target

TREE = [(0,), (1,), (0, 0), (1, 0), (0, 0, 0), (1, 0, 0)]


def _doc():
    text = (suite_paths.DOCS / "integration.md").read_text()
    m = re.search(r"<!-- join-leave-loop -->\s*```python\n(.*?)```", text, re.S)
    assert m, "docs/integration.md lost its join-leave-loop block"
    ns: dict = {}
    exec(compile(m.group(1), "integration.md", "exec"), ns)  # noqa: S102 (our own documentation)
    return ns["start"], ns["serve"]


def _compiles(caplog):
    return [r.getMessage()[:200] for r in caplog.records if r.getMessage().startswith("Compiling")]


def _sizes():
    return step_cache_size(), loop_cache_size(), rows_cache_size()


# --- docs/integration.md's join / leave loop, run as written ----------------------------------


@pytest.mark.parametrize("case", [pytest.param("eagle3", marks=pytest.mark.smoke), "eagle3-tree",
                                  "ngram_gpu", "plain"])
def test_documented_join_leave_loop_gets_generates_tokens(case, caplog):
    """Four prompts through two rows: requests wait, join as rows free up (rows reused, in
    the order they free), one stops on a stop id mid-way; a second run in reverse order on
    the same state. generate()'s greedy tokens, and after start()'s warm-up nothing
    compiles: not the prefill step, the loop, admit nor release."""
    method = case.split("-")[0]
    if method != "plain" and method not in METHODS:
        pytest.skip(f"{method} is not available")
    start, serve = _doc()
    tgt = target(4.0)

    def prop():
        if case == "plain":
            return None
        if case == "eagle3-tree":
            return build("eagle3", len(TREE), tgt, speculative_token_tree=str(TREE))
        return build(method, 3, tgt)

    prompts = [[5, 9, 2, 17] * 3, [3, 3, 7], list(range(1, 14)), [40, 41, 40, 41, 40]]
    max_tokens = [12, 20, 30, 9]
    ref = generate(tgt, None, prompts, [SamplingParams(max_tokens=m) for m in max_tokens], **FIXED)
    stop = ref.token_ids[1][7]                    # request 1 stops mid-way
    want = generate(tgt, prop(), prompts, [SamplingParams(max_tokens=m, stop_token_ids=(stop,))
                                          for m in max_tokens], **FIXED)
    assert want.outputs[1].finish_reason == "stop"
    loop = start(tgt.model, tgt.params, prop(), rows=2, max_model_len=MML, prompt_tokens=16,
                 block_size=BS, steps_per_sync=4)
    if case == "eagle3-tree":
        assert loop.step.tree is not None
    pool = sorted(loop.free_blocks)
    before = _sizes()
    with jax.log_compiles(), caplog.at_level(logging.DEBUG, logger="jax"):
        got = serve(loop, prompts, max_tokens=max_tokens, stop_ids=(stop,))
        again = serve(loop, prompts[::-1], max_tokens=max_tokens[::-1], stop_ids=(stop,))
    assert got == want.token_ids
    assert again == want.token_ids[::-1]
    assert _sizes() == before
    assert not _compiles(caplog)
    # every row and block back with the caller; the state has no live row
    assert sorted(loop.free_blocks) == pool and sorted(loop.free_rows) == [0, 1]
    assert int(loop.state.num_reqs) == 0 and np.asarray(loop.state.finished).all()


# --- admit / release: the rows make_loop_state builds -----------------------------------------


REQ = dict(last_token=7, num_computed=10, num_output=3, max_tokens=20, block_ids=[4, 9],
           drafts=[1, 2], stop_ids=[5], temperature=0.7, top_k=4, top_p=0.9, seed=123)
KW = dict(k=3, num_reqs_pad=4, blocks_per_req_pad=3, query_len_pad=4, max_model_len=40,
          block_size=8, stop_pad=2)


def _as_rows(req: dict, n: int = 1) -> dict:
    return dict(last_token=[req["last_token"]] * n, num_computed=[req["num_computed"]] * n,
                num_output=[req["num_output"]] * n, max_tokens=[req["max_tokens"]] * n,
                block_ids=[req["block_ids"]] * n, drafts=[req["drafts"]] * n,
                stop_ids=[req["stop_ids"]] * n, temperature=[req["temperature"]] * n,
                top_k=[req["top_k"]] * n, top_p=[req["top_p"]] * n, seeds=[req["seed"]] * n)


def _leaves_equal(a, b):
    fa, ta = jax.tree.flatten(a)
    fb, tb = jax.tree.flatten(b)
    assert ta == tb
    for x, y in zip(fa, fb):
        assert np.asarray(x).dtype == np.asarray(y).dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _empty(**kw):
    return make_loop_state(last_token=[], num_computed=[], drafts=[], max_tokens=[],
                           num_output=[], block_ids=[], **dict(KW, **kw))


def test_admit_writes_make_loop_states_row_and_release_restores_padding():
    empty = dataclasses.replace(_empty(), all_greedy=False)
    st = admit(empty, 0, **REQ)
    want = make_loop_state(**_as_rows(REQ), **KW)
    _leaves_equal(st, want)
    # a row past a hole: the same values in row 2, num_reqs 3, rows 0-1 still padding
    st = admit(dataclasses.replace(_empty(), all_greedy=False), 2, **REQ)
    assert int(st.num_reqs) == 3
    assert np.asarray(st.finished).tolist() == [True, True, False, True]
    for f in ("last_token", "num_computed", "drafts", "block_table", "stop_ids"):
        np.testing.assert_array_equal(np.asarray(getattr(st, f))[2], np.asarray(getattr(want, f))[0])
        np.testing.assert_array_equal(np.asarray(getattr(st, f))[:2], np.asarray(getattr(empty, f))[:2])
    # admit row 0 too, then release row 2: num_reqs falls to 1; releasing row 0 to 0
    st = admit(st, 0, **REQ)
    assert int(st.num_reqs) == 3
    st = release(st, [2])
    assert int(st.num_reqs) == 1
    st = release(st, [0])
    assert int(st.num_reqs) == 0
    _leaves_equal(dataclasses.replace(st, num_reqs=np.asarray(0, np.int32)), empty)
    # a sampled request without a seed draws a fresh one, a greedy one gets 0
    seeds = {int(np.asarray(admit(dataclasses.replace(_empty(), all_greedy=False), 1,
                                  **dict(REQ, seed=None)).sampling.seeds)[1]) for _ in range(3)}
    assert len(seeds) > 1
    greedy = admit(_empty(), 1, **dict(REQ, seed=None, temperature=0.0))
    assert int(np.asarray(greedy.sampling.seeds)[1]) == 0


def test_admit_and_release_compile_once_per_bucket():
    """Rows, values and counts change: one compile each per state bucket."""
    st = admit(dataclasses.replace(_empty(), all_greedy=False), 0, **REQ)
    st = release(st, [0])
    n = rows_cache_size()
    for row in (3, 1, 2):
        st = admit(st, row, **dict(REQ, last_token=row, drafts=[1] * (row % 3), seed=row))
    st = release(st, [1, 3])
    st = release(st, [])
    assert rows_cache_size() == n


def test_history_rows():
    """A token-history state takes each request's history (prompt + output)."""
    st = _empty(history=[])
    st = admit(st, 1, **dict(REQ, temperature=0.0, seed=None, num_computed=3,
                             history=[9, 8, 6, 7]))
    h = np.asarray(st.history)
    assert h[1, :5].tolist() == [9, 8, 6, 7, 0] and not h[0].any()
    st = release(st, [1])
    assert not np.asarray(st.history).any()


def test_rows_refuse_bad_arguments_by_name():
    greedy = _empty()
    sampled = dataclasses.replace(_empty(), all_greedy=False)
    n = rows_cache_size()
    for kw, match in (
            (dict(row=4), r"row must be an int in \[0, 3\]"),
            (dict(row=-1), "row must be"),
            (dict(drafts=[1, 2, 3, 4]), "drafts has 4 tokens; the state holds k=3"),
            (dict(block_ids=[4, 9, 10, 11]), "block_ids has 4 blocks; the state's bucket holds 3"),
            (dict(block_ids=[4]), "block_ids has 1 blocks; the request's 13 positions need 2"),
            (dict(block_ids=[4, 0]), r"block_ids\[1\] .*null block"),
            (dict(num_blocks=8), r"block_ids\[1\] must be an int in \[1, 7\]"),
            (dict(stop_ids=[1, 2, 3]), "stop_ids has 3 ids; the state holds 2 stop columns"),
            (dict(num_output=20), "num_output must be"),
            (dict(num_computed=39), "num_computed must be"),
            (dict(top_p=0.0), "top_p"),
            (dict(seed=-5), "seed must be"),
            (dict(history=[1] * 11), "history given but the state carries no token history"),
            (dict(last_token=-1), "last_token must be")):
        args = dict(REQ, **kw)
        row = args.pop("row", 0)
        with pytest.raises(ValueError, match=match):
            admit(sampled, row, **args)
    with pytest.raises(ValueError, match="all_greedy"):
        admit(greedy, 0, **REQ)
    with pytest.raises(ValueError, match="pass history="):
        admit(_empty(history=[]), 0, **dict(REQ, temperature=0.0))
    with pytest.raises(ValueError, match=r"rows\[1\] must be an int in \[0, 3\]"):
        release(greedy, [0, 4])
    with pytest.raises(TypeError, match="state must be a LoopState"):
        admit(None, 0, **REQ)
    assert rows_cache_size() == n                      # nothing ran
    st = admit(sampled, 0, **REQ)
    admit(st, 1, **REQ)
    with pytest.raises(ValueError, match="donated"):    # st was donated to the call above
        admit(st, 2, **REQ)


def test_sampled_rows_do_not_depend_on_the_row():
    """The same seeded request in row 0 of one state and row 3 of another: the same tokens."""
    tgt = target(4.0)
    step = specjax.make_step(tgt.model, None)
    bucket = Bucket(4, 4 * 2, MML // BS)
    toks = []
    for row in (0, 3):
        kv, ds = step.init_caches(1 + MML // BS, BS, params=tgt.params)
        prompt = [5, 9, 2, 17, 3]
        blocks = list(range(1, 1 + MML // BS))
        b = build_batch([prompt], num_computed=[0], num_drafts=[0], block_ids=[blocks],
                        block_size=BS, num_reqs_pad=1, query_len_pad=8,
                        blocks_per_req_pad=MML // BS, max_spec_len=0, temperature=[1.0],
                        seeds=[77])
        out, kv, ds = step(tgt.params, None, kv, ds, b)
        first = int(np.asarray(out.sampled)[0, 0])
        st = empty_loop_state(step, bucket, max_model_len=MML, block_size=BS, all_greedy=False)
        st = admit(st, row, last_token=first, num_computed=len(prompt), num_output=1,
                   max_tokens=12, block_ids=blocks, temperature=1.0, seed=77)
        res, kv, ds, st = decode_loop(step, tgt.params, None, kv, ds, st, steps_per_sync=16)
        res = jax.device_get(res)
        toks.append([first] + res.tokens[:, row, 0][res.counts[:, row] > 0].tolist())
    assert toks[0] == toks[1] and len(toks[0]) == 12
    want = generate(tgt, None, [[5, 9, 2, 17, 3]],
                    SamplingParams(max_tokens=12, temperature=1.0, seed=77), **FIXED)
    assert toks[0] == want.token_ids[0]


# --- warm-up ------------------------------------------------------------------------------


@pytest.mark.parametrize("tree", [None, TokenTree.from_choices(TREE)])
def test_padding_batch_is_build_batchs_empty_batch(tree):
    """Leaf for leaf, treedef and packed layout: the program Step.warmup compiles is the one
    a build_batch batch of the bucket runs."""
    k = 6
    bk = Bucket.of(4, 8, 6)
    want = build_batch([], num_computed=[], num_drafts=[], block_ids=[], block_size=BS,
                       num_reqs_pad=4, query_len_pad=8, blocks_per_req_pad=6, max_spec_len=k,
                       tree=tree)
    got = StepBatch(**padding_fields(bk, k=k, block_size=BS, tree=tree), all_greedy=True)
    _leaves_equal(got, want)
    assert host_transfer.pack(got)[1] == host_transfer.pack(want)[1]
    real = build_batch([[1, 2, 3], [4]], num_computed=[0, 5], num_drafts=[0, 0],
                       block_ids=[[1], [2]], block_size=BS, num_reqs_pad=4, query_len_pad=8,
                       blocks_per_req_pad=6, max_spec_len=k)
    if tree is None:
        assert host_transfer.pack(got)[1] == host_transfer.pack(real)[1]
    assert bk == Bucket(4, 32, 6) and bk.query_len_pad == 8


def test_step_warmup_then_calls_compile_nothing(caplog):
    """Every bucket warmed (greedy and sampled): real batches of those buckets, through the
    packed host path, compile nothing."""
    tgt = target()
    prop = build("eagle3", 3, tgt) if "eagle3" in METHODS else None
    step = specjax.make_step(tgt.model, prop)
    kv, ds = step.init_caches(1 + 3 * (MML // BS), BS, params=tgt.params)
    buckets = [Bucket.of(1, 16, MML // BS), Bucket(2, 2 * 8, 3)]
    kv, ds = step.warmup(tgt.params, step.draft_params, kv, ds, buckets, block_size=BS)
    before = step_cache_size()
    with jax.log_compiles(), caplog.at_level(logging.DEBUG, logger="jax"):
        b = build_batch([list(range(1, 12))], num_computed=[0], num_drafts=[0],
                        block_ids=[list(range(1, 7))], block_size=BS, num_reqs_pad=1,
                        query_len_pad=16, blocks_per_req_pad=MML // BS, max_spec_len=step.k)
        out, kv, ds = step(tgt.params, step.draft_params, kv, ds, b)
        b = build_batch([[3, 4], [5, 6, 7]], num_computed=[0, 0], num_drafts=[0, 0],
                        block_ids=[[7], [8]], block_size=BS, num_reqs_pad=2, query_len_pad=8,
                        blocks_per_req_pad=3, max_spec_len=step.k, temperature=[0.5, 0.0],
                        seeds=[1, 2])
        out, kv, ds = step(tgt.params, step.draft_params, kv, ds, b)
        jax.block_until_ready(out)
    assert step_cache_size() == before
    assert not _compiles(caplog)


def test_warmup_refuses_bad_arguments_by_name():
    tgt = target()
    step = specjax.make_step(tgt.model, None)
    kv, ds = step.init_caches(8, BS)
    n = _sizes()
    for buckets, match in (([(2, 5, 3)], r"buckets\[0\]\.tokens=5 is not a multiple of requests=2"),
                           ([(0, 4, 3)], r"buckets\[0\]\.requests must be"),
                           ([], "buckets is empty"),
                           (Bucket(1, 4, 2), "buckets must be a list"),
                           ([(1, 4)], r"buckets\[0\] must be a Bucket")):
        with pytest.raises(ValueError, match=match):
            step.warmup(tgt.params, None, kv, ds, buckets, block_size=BS)
    with pytest.raises(ValueError, match="tree_verify"):
        step.warmup(tgt.params, None, kv, ds, [(1, 4, 2)], block_size=BS, tree_verify=(True,))
    with pytest.raises(ValueError, match="max_model_len"):
        from specjax.sampling.logits_processors import ProcessorLimits

        step.warmup(tgt.params, None, kv, ds, [(1, 4, 2)], block_size=BS,
                    procs=(ProcessorLimits(),))
    with pytest.raises(ValueError, match="all_greedy"):
        step.warmup(tgt.params, None, kv, ds, [(1, 4, 2)], block_size=BS, all_greedy=True)
    if "eagle3" in METHODS:
        with pytest.raises(ValueError, match=r"bucket.tokens=2 gives 1 query slots per row"):
            empty_loop_state(specjax.make_step(tgt.model, build("eagle3", 3, tgt)),
                             Bucket(2, 2, 3), max_model_len=MML, block_size=BS)
    with pytest.raises(ValueError, match="steps_per_sync"):
        warmup_loop(step, tgt.params, None, kv, ds, [(1, 4, 2)], steps_per_sync=0,
                    max_model_len=MML, block_size=BS)
    with pytest.raises(ValueError, match=r"stop_pads\[0\]"):
        warmup_loop(step, tgt.params, None, kv, ds, [(1, 4, 2)], steps_per_sync=2,
                    max_model_len=MML, block_size=BS, stop_pads=(0,))
    assert _sizes() == n                               # refused before any work

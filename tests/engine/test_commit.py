"""The one host commit rule (``specjax.engine.commit.CommitRule``): the per-step path
(``CommitRule.step`` on a ``StepOutput``) and the device-loop path (``CommitRule.loop`` on a
``LoopOutput``) fed the same tokens leave identical request records (outputs, finish
reasons, counters, KV positions, drafts, logprobs, token history) and metrics.

Reference: a hand-written scenario of three iterations (stop token, ``max_tokens`` and
``max_model_len`` each reached in the middle of a block, a request that keeps decoding,
one without drafts) whose expected records are written out below, independently of the
rule; the device side of the loop output is written as the device emits it (nothing
after a stop)."""

from __future__ import annotations

import numpy as np
import pytest

from specjax.engine.commit import CommitRule
from specjax.engine.scheduler import _Request
from specjax.engine.types import SamplingParams
from specjax.runtime.decode_loop import LoopOutput
from specjax.runtime.output import StepOutput
from specjax.sampling.logprobs import Logprobs
from specjax.token_tree import TokenTree

pytestmark = pytest.mark.smoke

MML, STOP, N_LP = 24, 60, 1
TREE = TokenTree.from_choices([(0,), (1,), (0, 0), (1, 0), (0, 0, 0), (1, 0, 0)])
#: request -> (prompt length, max_tokens, logprobs, per iteration: (sampled tokens = the
#: accepted drafts then the bonus / recovered token, drafts verified, tokens the device
#: emits))
SCENARIO = {
    "stop": (4, 20, N_LP, [([11, 12, 13, 14], 3, 4), ([15, STOP, 16, 17], 3, 2)]),
    "max_tokens": (5, 4, None, [([21, 22], 3, 2), ([23, 24, 25], 2, 1)]),
    "max_model_len": (20, 20, None, [([31], 1, 1), ([32, 33, 34], 3, 2)]),
    "decoding": (3, 50, N_LP, [([41, 42], 2, 2), ([43], 0, 1), ([44, 45, 46, 47], 3, 4)]),
}
N_ITERS = 3


def _requests(k: int):
    """Requests one token past their prefill (``num_computed`` = prompt length), each in
    its own token-history row."""
    tok_buf = np.zeros((len(SCENARIO), MML), np.int32)
    reqs = []
    for i, (name, (plen, max_tokens, lp, _)) in enumerate(SCENARIO.items()):
        prompt = list(range(1, plen + 1))
        r = _Request(index=i, req_id=name, prompt=prompt,
                     params=SamplingParams(max_tokens=max_tokens, logprobs=lp), seed=0,
                     stop_ids=frozenset({STOP}), output=[9], num_computed=plen, row=i)
        tok_buf[i, : plen + 1] = prompt + [9]
        reqs.append(r)
    return reqs, tok_buf


def _logprobs(it: int, index: int, k: int, emitted: int | None = None):
    """One request's fake logprobs at iteration ``it`` (``[k+1, n+1]`` ids and values,
    ``[k+1]`` ranks), distinct per (iteration, request, slot); slots from ``emitted`` on are
    padding, as the device loop leaves them."""
    j = np.arange(k + 1)
    ids = np.stack([100 * it + 10 * index + j, 500 + j], axis=1).astype(np.int32)
    vals = -(it + index / 10 + np.stack([j, j + 0.5], axis=1) / 100).astype(np.float32)
    ranks = (j + 1).astype(np.int32)
    if emitted is not None:
        ids[emitted:], vals[emitted:], ranks[emitted:] = -1, -np.inf, -1
    return ids, vals, ranks


def _records(reqs, tok_buf):
    return ({r.req_id: (r.output, r.finish_reason, r.num_computed, r.num_drafted, r.num_accepted,
                        r.drafts, r.logprobs) for r in reqs}, tok_buf.tolist())


def _per_step(rule: CommitRule, k: int):
    """What ``Engine._step`` does: one ``StepOutput`` per iteration over the running
    requests (``len(r.drafts)`` drafts each), finished ones leaving."""
    reqs, tok_buf = _requests(k)
    running, iters = list(reqs), []
    for it in range(N_ITERS):
        b = len(running)
        sampled = np.full((b, k + 1), -1, np.int32)
        lps = [_logprobs(it, r.index, k) for r in running]
        qlens = []
        for i, r in enumerate(running):
            toks, nd, _ = SCENARIO[r.req_id][3][it]
            sampled[i, : len(toks)] = toks
            r.drafts = [7] * nd
            qlens.append(1 + nd)
        packed = np.concatenate([sampled, np.full((b, k), -1, np.int32),
                                 np.zeros((b, 2), np.int32)], axis=1)
        lp = Logprobs(*(np.stack(x) for x in zip(*lps)))
        stats, finished, _ = rule.step(running, StepOutput(packed, k, lp), qlens, tok_buf)
        iters.append((stats, [r.req_id for r in finished]))
        running = [r for r in running if not r.finish_reason]
    return _records(reqs, tok_buf), iters


def _loop_output(k: int, tokens_past_stop: bool = False, finished=None) -> LoopOutput:
    """The scenario as one device-loop call emits it (rows in ``SCENARIO`` order)."""
    b = len(SCENARIO)
    toks = np.full((N_ITERS, b, k + 1), -1, np.int32)
    counts, nds, accs = (np.zeros((N_ITERS, b), np.int32) for _ in range(3))
    ids = np.full((N_ITERS, b, k + 1, N_LP + 1), -1, np.int32)
    vals = np.full((N_ITERS, b, k + 1, N_LP + 1), -np.inf, np.float32)
    ranks = np.full((N_ITERS, b, k + 1), -1, np.int32)
    for i, (_, _, _, iters) in enumerate(SCENARIO.values()):
        for it, (sampled, nd, emit) in enumerate(iters):
            emit = len(sampled) if tokens_past_stop else emit
            toks[it, i, :emit] = sampled[:emit]
            counts[it, i], nds[it, i], accs[it, i] = emit, nd, len(sampled) - 1
            ids[it, i], vals[it, i], ranks[it, i] = _logprobs(it, i, k, emit)
    if finished is None:
        finished = [len(v[3]) < N_ITERS for v in SCENARIO.values()]
    return LoopOutput(toks, counts, nds, accs, np.asarray(finished), np.asarray(N_ITERS),
                      Logprobs(ids, vals, ranks))


def _device_loop(rule: CommitRule, k: int):
    """What ``DeviceLoopDriver.commit`` does with one call's host output."""
    reqs, tok_buf = _requests(k)
    results = rule.loop(reqs, _loop_output(k), tok_buf)
    return _records(reqs, tok_buf), [(s, [r.req_id for r in fin]) for s, fin in results]


@pytest.mark.parametrize("tree", [None, TREE], ids=["chain", "tree"])
def test_both_paths_leave_the_same_records(tree):
    k = 3 if tree is None else tree.num_nodes
    rule = CommitRule(MML, tree, 3)
    (step_recs, step_buf), step_iters = _per_step(rule, k)
    (loop_recs, loop_buf), loop_iters = _device_loop(rule, k)
    assert step_recs == loop_recs
    assert step_buf == loop_buf
    assert step_iters == loop_iters

    # the records themselves (written out, not computed by the rule)
    out = {name: rec[:5] for name, rec in step_recs.items()}
    depth = (lambda nd: nd) if tree is None else (lambda nd: tree.depths[nd - 1])
    assert out["stop"] == ([9, 11, 12, 13, 14, 15, STOP], "stop", 4 + 4 + 4, 2 * depth(3), 3 + 3)
    assert out["max_tokens"] == ([9, 21, 22, 23], "length", 5 + 2 + 3, depth(3) + depth(2), 1 + 2)
    assert out["max_model_len"] == ([9, 31, 32, 33], "length", 20 + 1 + 3, depth(1) + depth(3), 2)
    assert out["decoding"] == ([9, 41, 42, 43, 44, 45, 46, 47], None, 3 + 2 + 1 + 4,
                               depth(2) + depth(3), 1 + 3)
    assert all(rec[5] == [] for rec in step_recs.values())          # drafts cleared
    assert [fin for _, fin in step_iters] == [[], ["stop", "max_tokens", "max_model_len"], []]
    # logprobs: one entry per kept token, the emitted slots' values
    lp = step_recs["stop"][6]
    assert len(lp) == 6 and list(lp[-1]) == [100 + 0 + 1, 500 + 1]
    assert len(step_recs["decoding"][6]) == 7 and step_recs["max_tokens"][6] == []
    # the token history holds prompt + output
    for i, (name, rec) in enumerate(step_recs.items()):
        plen = SCENARIO[name][0]
        assert step_buf[i][: plen + len(rec[0])] == list(range(1, plen + 1)) + rec[0]
    s = step_iters[1][0]
    assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens) == (
        3, depth(3) + depth(2) + depth(3), 3 + 2 + 2)


def test_the_loop_path_refuses_what_the_rule_would_not_emit():
    """Tokens emitted past a stop, or finished flags that disagree with the rule: the
    device and the host would diverge, so the commit raises."""
    rule = CommitRule(MML, None, 3)
    reqs, tok_buf = _requests(3)
    with pytest.raises(RuntimeError, match="past a stop"):
        rule.loop(reqs, _loop_output(3, tokens_past_stop=True), tok_buf)
    reqs, tok_buf = _requests(3)
    with pytest.raises(RuntimeError, match="disagree on request decoding"):
        rule.loop(reqs, _loop_output(3, finished=[True, True, True, True]), tok_buf)

"""What ``feed.lookahead`` protects (docs/integration.md, §3).

A model proposer writes its own KV (``draft_state``, never the target's) at positions past
each request's scheduled tokens while it drafts, through the request's block-table row: up
to ``feed.lookahead`` positions. Where those positions' blocks are missing or not the
request's, the writes land elsewhere:

* in a table column the request was given no block for: the null block 0 (harmless: the
  drafting step reads back what it wrote there);
* past the row's last column (``blocks_per_req_pad``): clipped to that column, over the
  request's own drafter KV of earlier positions (its later drafts get worse);
* in a block the row lists but another request owns (a persistent table's stale id): over
  that request's drafter KV (its drafts get worse).

Verification is lossless, so greedy tokens never change (why leaving the blocks out "changed
no token"); what changes is acceptance (and with it which tokens a seeded sampled request
draws). ``build_batch(..., lookahead=, max_model_len=)`` refuses the table rows behind all
three. The draft model here IS the target, so a clean run accepts every draft: a lost draft
shows corruption. :class:`Loop` is a minimal loop on the public step whose block-table rows
the test picks (also used by ``test_prefix_sharing.py``)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import specjax
from specjax.engine import SamplingParams, generate
from specjax.proposers import TokenHistory

from test_engine import BS, METHODS, MML, V, build, target

NUM_BLOCKS = 16
K = 4


def needs(method):
    if method is not None and method not in METHODS:
        pytest.skip(f"{method} is not available in this install")


class Request:
    """One request of a :class:`Loop`: prompt + output tokens, its block ids, tokens with KV
    (``num_computed``), next step's drafts, and its drafted / accepted counts."""

    def __init__(self, prompt, blocks, max_tokens, *, num_computed=0):
        self.prompt, self.tokens, self.blocks = list(prompt), list(prompt), list(blocks)
        self.max_tokens, self.num_computed = max_tokens, num_computed
        self.output, self.drafts, self.new = [], [], []
        self.drafted = self.accepted = 0

    @property
    def done(self) -> bool:
        return len(self.output) >= self.max_tokens


class Loop:
    """docs/integration.md §5's commit rules (greedy, chains) on ``make_step`` with buckets
    ``b`` x ``q`` x ``c``; :meth:`step` takes the block-table rows to pass (default: each
    request's blocks) and checks them with ``build_batch(lookahead=...)`` unless told not to."""

    def __init__(self, method, *, b=2, q=32, c=MML // BS):
        self.tgt = target()
        self.prop = None if method is None else build(method, K)
        self.step_fn = specjax.make_step(self.tgt.model, self.prop)
        self.kv, self.draft_state = self.step_fn.init_caches(NUM_BLOCKS, BS,
                                                             params=self.tgt.params)
        self.tparams = self.step_fn.place_target_params(self.tgt.params)
        self.b, self.q, self.c = b, q, c
        feed = self.step_fn.feed
        self.lookahead = 0 if feed is None else feed.lookahead

    def step(self, reqs, rows=None, *, c=None, check=True):
        st, feed = self.step_fn, self.step_fn.feed
        sched = [r.tokens[r.num_computed:] + r.drafts for r in reqs]
        batch = specjax.build_batch(
            sched, num_computed=[r.num_computed for r in reqs],
            num_drafts=[len(r.drafts) for r in reqs],
            block_ids=rows or [r.blocks for r in reqs], block_size=BS, num_reqs_pad=self.b,
            query_len_pad=self.q, blocks_per_req_pad=c or self.c, max_spec_len=st.k,
            lookahead=self.lookahead if check else None, max_model_len=MML)
        out, self.kv, self.draft_state = st(self.tparams, st.draft_params, self.kv,
                                            self.draft_state, batch)
        out = jax.device_get(out)
        for j, r in enumerate(reqs):
            new = [int(t) for t in out.sampled[j] if t >= 0]
            r.drafted += len(r.drafts)
            r.accepted += len(new) - 1 if r.drafts else 0
            r.num_computed += len(sched[j]) - (len(r.drafts) - (len(new) - 1))
            new = new[: r.max_tokens - len(r.output)]
            r.output += new
            r.tokens += new
            r.new = new
            r.drafts = out.drafts[j, : out.num_drafts[j]].tolist() if feed and feed.in_step else []
        live = [r for r in reqs if not r.done]
        if feed is not None and feed.drafts_in == "history" and live:
            hist = np.zeros((len(live), MML), np.int32)
            for row, r in enumerate(live):
                hist[row, : len(r.tokens)] = r.tokens
            drafted = self.prop.propose_from_history(TokenHistory(
                req_ids=[id(r) for r in live], token_ids=hist,
                num_tokens=np.array([len(r.tokens) for r in live], np.int32),
                num_prompt_tokens=np.array([len(r.prompt) for r in live], np.int32),
                sampled_token_ids=[r.new for r in live], rows_pad=self.b))
            for row, r in enumerate(live):
                r.drafts = drafted.token_ids[row, : drafted.num_drafts[row]].tolist()
        for r in live:
            room = min(r.max_tokens - len(r.output), MML - len(r.tokens))
            r.drafts = r.drafts[: max(0, min(room - 1, st.k))]
        return out

    def finish(self, reqs):
        while not all(r.done for r in reqs):
            self.step([r for r in reqs if not r.done])

    def drafter_kv(self) -> list[np.ndarray]:
        """The proposer's KV leaves ``[num_blocks, block_size, ...]`` on the host."""
        return [np.asarray(x) for x in jax.tree.leaves(self.draft_state)
                if np.ndim(x) >= 2 and np.shape(x)[:2] == (NUM_BLOCKS, BS)]

    def target_kv(self) -> list[np.ndarray]:
        return [np.asarray(x) for x in jax.tree.leaves(self.kv)]


def greedy(prompt, max_tokens):
    """Plain greedy decoding's tokens (``generate`` without a proposer)."""
    return generate(target(), None, [prompt], [SamplingParams(max_tokens=max_tokens)],
                    max_model_len=MML, block_size=BS).token_ids[0]


def written(leaves, row) -> list[int]:
    """Positions (through ``row``'s blocks) where any leaf is nonzero."""
    return [j * BS + o for j, blk in enumerate(row) for o in range(BS)
            if any(np.any(x[blk, o] != 0) for x in leaves)]


rng = np.random.default_rng(3)
# A's draft model writes positions 0..6, its bonus token's KV at 7, then 8..10 past its block
PA, PB = rng.integers(0, V, 7).tolist(), rng.integers(0, V, 10).tolist()


@pytest.mark.parametrize("method", ["draft_model", "eagle3"])
def test_the_proposer_writes_its_own_kv_within_the_lookahead(method):
    needs(method)
    loop = Loop(method)
    row = [1, 2, 3, 4, 5, 6]
    a = Request(PA, row, 8)
    loop.step([a])
    seq = len(PA)
    assert written(loop.target_kv(), row) == list(range(seq))       # the target: its tokens
    drafter = written(loop.drafter_kv(), row)
    assert max(drafter) >= seq                                      # past the scheduled tokens
    assert max(drafter) < seq + loop.lookahead                      # ... within the lookahead
    kv = loop.drafter_kv()
    assert all(not np.any(x[[0] + list(range(7, NUM_BLOCKS))]) for x in kv)   # nowhere else


def _stale_run(stale: bool):
    """B prefills; then A prefills with B's first block in its row's second column (a
    persistent table's stale id) where its lookahead falls, or with its own block."""
    loop = Loop("draft_model")
    b = Request(PB, [1, 2, 3, 4, 5, 6], 30)
    loop.step([b])
    before = [x[1].copy() for x in loop.drafter_kv()], [x[1].copy() for x in loop.target_kv()]
    a = Request(PA, [7, 8, 9, 10, 11, 12], 20)
    loop.step([a, b], rows=[[7, 1 if stale else 8], b.blocks], check=False)
    after = [x[1] for x in loop.drafter_kv()], [x[1] for x in loop.target_kv()]
    loop.finish([a, b])
    return loop, a, b, before, after


def test_a_foreign_block_in_the_lookahead_corrupts_its_owners_drafter_kv():
    needs("draft_model")
    _, a, b, before, after = _stale_run(stale=False)
    assert all(np.array_equal(x, y) for x, y in zip(before[0], after[0]))
    assert b.drafted > 0 and b.accepted == b.drafted            # the draft model is the target
    _, a2, b2, before, after = _stale_run(stale=True)
    assert not all(np.array_equal(x, y) for x, y in zip(before[0], after[0]))   # B's drafter KV
    assert all(np.array_equal(x, y) for x, y in zip(before[1], after[1]))       # not its target KV
    assert b2.accepted < b2.drafted                             # B's drafts got worse ...
    assert b2.output == b.output == greedy(PB, 30)              # ... its tokens did not
    assert a2.output == a.output == greedy(PA, 20)


def test_missing_lookahead_blocks_go_to_the_null_block_or_over_the_request_itself():
    needs("draft_model")
    ref = Loop("draft_model")
    a = Request(PA, [7, 8, 9, 10, 11, 12], 20)
    ref.step([a])
    ref_kv = ref.drafter_kv()
    ref.finish([a])
    assert a.accepted == a.drafted > 0
    # A's second block left out, the bucket wide enough: the lookahead goes to the null
    # block, which the drafting step reads back: the same drafts
    loop = Loop("draft_model")
    null = Request(PA, [7, 8, 9, 10, 11, 12], 20)
    loop.step([null], rows=[[7]], check=False)
    assert any(np.any(x[0] != 0) for x in loop.drafter_kv())
    loop.finish([null])
    assert (null.drafted, null.accepted, null.output) == (a.drafted, a.accepted, a.output)
    # ... and a bucket one block wide: clipped to A's own block, over its positions 0..2
    loop = Loop("draft_model")
    clip = Request(PA, [7, 8, 9, 10, 11, 12], 20)
    loop.step([clip], rows=[[7]], c=1, check=False)
    kv = loop.drafter_kv()
    for o in range(3):
        assert max(np.abs(x[7, o] - y[7, o]).max() for x, y in zip(kv, ref_kv)) > 1e-2
    for x, y in zip(kv, ref_kv):                                # its positions 3..6 as written
        np.testing.assert_allclose(x[7, 3:len(PA)], y[7, 3:len(PA)], atol=1e-5)
    loop.finish([clip])
    assert clip.accepted < clip.drafted
    assert clip.output == a.output == greedy(PA, 20)


def test_build_batch_refuses_rows_that_leave_out_the_lookahead():
    needs("draft_model")
    lookahead = build("draft_model", K).feed.lookahead
    assert lookahead == K + 2      # k, 1 more slot for a draft model, and 1

    def batch(tokens, computed, rows, c=MML // BS):
        return specjax.build_batch(tokens, num_computed=computed, num_drafts=[0] * len(tokens),
                                   block_ids=rows, block_size=BS, num_reqs_pad=2,
                                   query_len_pad=16, blocks_per_req_pad=c, max_spec_len=K,
                                   lookahead=lookahead, max_model_len=MML)

    a, b = [1] * len(PA), [2] * len(PB)
    batch([a, b], [0, 0], [[7, 8], [1, 2, 3]])                  # 5 + 6 -> 2 blocks; 16 -> 2
    with pytest.raises(ValueError, match=r"block_ids\[0\] gives 1 blocks.*lookahead=6"):
        batch([a, b], [0, 0], [[7], [1, 2, 3]])                 # the null-block case
    with pytest.raises(ValueError, match=r"blocks_per_req_pad=1.*it needs 2"):
        batch([a], [0], [[7, 8]], c=1)                          # the clipped case
    with pytest.raises(ValueError, match=r"block_ids\[0\]\[1\] = 1 is also in block_ids\[1\]"):
        batch([a, b], [0, 0], [[7, 1], [1, 2, 3]])              # the foreign-block case
    with pytest.raises(ValueError, match=r"block_ids\[0\]\[1\] = 2 is also in block_ids\[1\]"):
        batch([[3], [4]], [12, 12], [[1, 2, 3], [1, 2, 4]])     # a partial block shared
    batch([[3], [4] * 3], [16, 16], [[1, 2, 3], [1, 2, 4, 5]])  # full prefix blocks shared
    batch([[5]], [45], [list(range(1, 7))])                     # capped at max_model_len

"""Prefix sharing (docs/integration.md, §3): a request whose first step starts at
``num_computed > 0`` over block ids another request computed.

Request A prefills ``P + a``; request B (``P + b``, ``P`` two full blocks) then joins with
``P``'s blocks in its row and ``num_computed = len(P)``: only its own tokens are computed.
Its tokens are plain greedy decoding's for every proposer (verification is lossless), and
``build_batch(lookahead=...)`` accepts the rows (shared blocks are full and written by
neither request). The drafter's KV over the shared blocks is what A's steps wrote there:
the draft model's is exactly B's own (its KV at a position depends only on the tokens up
to it); EAGLE's at the last shared position is not (it pairs the target's hidden state there
with the NEXT token, A's), unless the shared range ends before the last common token. A
drafter whose KV lacks the prefix drafts worse and loses no token."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from test_engine import BS, V
from test_lookahead import Loop, Request, greedy, needs

rng = np.random.default_rng(11)
P = rng.integers(0, V, 2 * BS).tolist()           # the shared prefix: two full blocks
PA, PB = P + [3, 4, 5, 6], P + [7, 8, 9]          # A's and B's next tokens differ
A_ROW, B_OWN = [1, 2, 3, 4, 5, 6], [9, 10, 11, 12, 13, 14]


def _run(method, shared_blocks: int, *, drop_drafter_prefix=False):
    """A prefills alone; then B joins sharing A's first ``shared_blocks`` blocks (0: B
    computes its whole prompt in its own blocks) and both run to the end. Returns ``(loop,
    a, b, drafter KV leaves right after B's first step)``."""
    loop = Loop(method)
    a = Request(PA, A_ROW, 12)
    loop.step([a])
    s = shared_blocks
    b = Request(PB, A_ROW[:s] + B_OWN[: 6 - s], 12, num_computed=s * BS)
    if drop_drafter_prefix:       # the prefix's target KV came without the drafter's
        loop.draft_state = jax.tree.map(lambda x: x.at[1:1 + s].set(0), loop.draft_state)
    loop.step([a, b])
    kv = loop.drafter_kv()
    loop.finish([a, b])
    return loop, a, b, kv


def _positions(kv, row, n):
    """The drafter KV of positions ``0..n-1`` through ``row``: ``[n, ...]`` per leaf."""
    return [x[row].reshape(len(row) * BS, -1)[:n] for x in kv]


@pytest.mark.parametrize("method", ["draft_model", "eagle3", "ngram", None])
def test_a_shared_prefix_gives_plain_greedy_tokens(method):
    needs(method)
    _, a, b, _ = _run(method, 2)
    assert a.output == greedy(PA, 12)
    assert b.output == greedy(PB, 12)
    if method is not None:
        assert a.drafted > 0 and b.drafted > 0


def test_the_draft_models_kv_of_a_shared_prefix_is_its_own():
    needs("draft_model")
    _, _, alone, kv_alone = _run("draft_model", 0)
    _, _, shared, kv_shared = _run("draft_model", 2)
    for x, y in zip(_positions(kv_shared, A_ROW[:2], len(P)), _positions(kv_alone, B_OWN[:2],
                                                                         len(P))):
        np.testing.assert_allclose(x, y, atol=1e-5)
    assert shared.accepted == shared.drafted == alone.drafted > 0    # every draft accepted
    _, a, lacking, _ = _run("draft_model", 2, drop_drafter_prefix=True)
    assert lacking.accepted < lacking.drafted                         # worse drafts ...
    assert lacking.output == shared.output == greedy(PB, 12)          # ... the same tokens
    assert a.output == greedy(PA, 12)


def test_eagles_kv_at_the_last_shared_position_is_the_writers():
    needs("eagle3")
    _, _, _, kv_alone = _run("eagle3", 0)
    mine = _positions(kv_alone, B_OWN[:2], len(P))
    _, _, _, kv_shared = _run("eagle3", 2)
    got = _positions(kv_shared, A_ROW[:2], len(P))
    for x, y in zip(got, mine):
        np.testing.assert_allclose(x[:-1], y[:-1], atol=1e-5)       # positions 0..14: B's own
    assert max(np.abs(x[-1] - y[-1]).max() for x, y in zip(got, mine)) > 1e-2   # 15: A's
    # the shared range ending before the last common token (one block here): all B's own
    _, _, b, kv_one = _run("eagle3", 1)
    for x, y in zip(_positions(kv_one, A_ROW[:1], BS), mine):
        np.testing.assert_allclose(x, y[:BS], atol=1e-5)
    assert b.output == greedy(PB, 12)

"""The ``ngram_gpu`` adapter keeps the token history on the device.

Per step it uploads only each request's new tokens (accepted drafts + bonus) into the
request's row of ``NgramGPUState``; a request's whole context goes up once, when it joins.
Its drafts must equal, step for step, those of the previous adapter (the whole history
re-uploaded and searched by ``propose_arrays``) and of the CPU n-gram proposer, while
requests join, finish and leave their rows to newcomers.
"""

import jax.numpy as jnp
import numpy as np
import pytest

from specjax.config import SpeculativeConfig
from specjax.proposers import DraftOutput, TokenHistory, make_proposer
from specjax.proposers.ngram_cpu import NgramProposer
from specjax.proposers.ngram_gpu import NgramGPUProposer


def _reupload_drafts(impl: NgramGPUProposer, hist: TokenHistory) -> DraftOutput:
    """The adapter before the device state: the whole history uploaded and searched."""
    b = len(hist.req_ids)
    rows = hist.rows_pad
    tok = np.zeros((rows, hist.token_ids.shape[1]), np.int32)
    tok[:b] = hist.token_ids[:b]
    num = np.zeros(rows, np.int32)
    num[:b] = hist.num_tokens
    valid = np.zeros(rows, np.bool_)
    valid[:b] = [len(s) > 0 for s in hist.sampled_token_ids]
    out = impl.propose_arrays(jnp.asarray(num), jnp.asarray(tok), jnp.asarray(valid))
    return DraftOutput(np.asarray(out.token_ids)[:b], np.asarray(out.num_drafts)[:b])


class _Sim:
    """Requests with token histories that grow like the decoding loop's: a prefill adds one
    token, later steps 1 .. k+1 (copied from earlier in the context half of the time, so
    n-grams match and drafts are long)."""

    def __init__(self, rng, k, mml, vocab):
        self.rng, self.k, self.mml, self.vocab = rng, k, mml, vocab
        self.ctx: dict[str, list[int]] = {}
        self.gained: dict[str, list[int]] = {}
        self.prompt: dict[str, int] = {}
        self.next_id = 0

    def join(self):
        rid = f"r{self.next_id}"
        self.next_id += 1
        n = int(self.rng.integers(1, self.mml // 2))
        self.ctx[rid] = self.rng.integers(0, self.vocab, n).tolist()
        self.prompt[rid] = n
        self.gained[rid] = [int(self.rng.integers(0, self.vocab))]
        self.ctx[rid] += self.gained[rid]

    def grow(self, rid):
        ctx = self.ctx[rid]
        room = self.mml - len(ctx)
        m = min(int(self.rng.integers(1, self.k + 2)), room)
        if self.rng.random() < 0.5 and len(ctx) > m:
            s = int(self.rng.integers(0, len(ctx) - m))
            new = ctx[s : s + m]
        else:
            new = self.rng.integers(0, self.vocab, m).tolist()
        ctx += new
        self.gained[rid] = new

    def history(self, ids, rows_pad):
        buf = np.full((len(ids), self.mml), 7, np.int32)   # garbage past each context
        for i, rid in enumerate(ids):
            buf[i, : len(self.ctx[rid])] = self.ctx[rid]
        return TokenHistory(ids, buf, np.array([len(self.ctx[r]) for r in ids], np.int32),
                            np.array([self.prompt[r] for r in ids], np.int32),
                            [list(self.gained[r]) for r in ids], rows_pad=rows_pad)


@pytest.mark.parametrize("k, min_n, max_n, vocab", [(3, 1, 3, 6), (5, 2, 4, 4), (1, 1, 1, 12)])
def test_device_history_drafts_equal_reupload_and_cpu(k, min_n, max_n, vocab):
    mml, max_seqs = 96, 6
    cfg = SpeculativeConfig(method="ngram_gpu", num_speculative_tokens=k, prompt_lookup_min=min_n,
                            prompt_lookup_max=max_n)
    prop = make_proposer(cfg, max_model_len=mml)
    cpu = NgramProposer(num_speculative_tokens=k, prompt_lookup_min=min_n, prompt_lookup_max=max_n,
                        max_model_len=mml)
    rng = np.random.default_rng(k * 100 + vocab)
    sim = _Sim(rng, k, mml, vocab)
    running: list[str] = []
    joins = total_drafts = 0
    for _step in range(150):
        # some leave (finished, or at max_model_len), some join into the freed rows
        running = [r for r in running if rng.random() > 0.08 and len(sim.ctx[r]) < mml]
        for r in running:
            sim.grow(r)
        while len(running) < max_seqs and rng.random() < 0.5:
            sim.join()
            running.insert(int(rng.integers(0, len(running) + 1)), f"r{sim.next_id - 1}")
            joins += 1
        if not running:
            continue
        order = list(rng.permutation(running))           # the batch order changes freely
        pad = 1 << (len(order) - 1).bit_length()
        hist = sim.history(order, pad)
        got = prop.propose_from_history(hist)
        want = _reupload_drafts(prop.impl, hist)
        np.testing.assert_array_equal(got.num_drafts, want.num_drafts)
        np.testing.assert_array_equal(got.token_ids, want.token_ids)
        ref = cpu.propose_arrays(hist.num_tokens, hist.token_ids)
        assert got.to_lists() == ref.to_lists()
        total_drafts += int(got.num_drafts.sum())
    assert joins > 10 and total_drafts > 50
    # Whole contexts went up only when requests joined; every other step sent new tokens.
    assert prop.num_context_uploads == joins
    # Rows are reused: the buffer never grew past the largest batch bucket.
    assert prop.buffer.token_ids.shape == (8, mml)
    prop.finish_requests(list(prop._slots))
    assert not prop._slots and len(prop._free_rows) == 8


def test_history_not_appended_is_uploaded_again():
    """A request whose history was rewritten (not appended to) is re-synced, not trusted."""
    cfg = SpeculativeConfig(method="ngram_gpu", num_speculative_tokens=2, prompt_lookup_min=1,
                            prompt_lookup_max=2)
    prop = make_proposer(cfg, max_model_len=32)

    def call(ctx, new, rid="a"):
        buf = np.zeros((1, 32), np.int32)
        buf[0, : len(ctx)] = ctx
        h = TokenHistory([rid], buf, np.array([len(ctx)], np.int32), np.array([1], np.int32),
                         [new], rows_pad=1)
        return prop.propose_from_history(h).to_lists()[0]

    assert call([1, 2, 3, 1], [1]) == [2, 3]
    assert call([1, 2, 3, 1, 2], [2]) == [3, 1]                  # appended: 1 token sent
    assert prop.num_context_uploads == 1
    assert call([5, 6, 5, 6, 5], [5]) == [6, 5]                  # same length, other tokens:
    assert prop.num_context_uploads == 2                         # length check -> re-upload
    assert call([5, 6, 5, 6, 5], [5]) == [6, 5]                  # a repeated call re-syncs too
    assert call([9, 9], [], rid="b") == []                       # no new tokens: no draft
    # "a" left (absent from the last call): its row went to "b"; it comes back re-uploaded
    assert call([5, 6, 5, 6, 5, 6], [6]) == [5, 6]
    with pytest.raises(ValueError, match="distinct"):
        prop.propose_from_history(TokenHistory(["x", "x"], np.zeros((2, 4), np.int32),
                                               np.array([1, 1], np.int32), np.array([1, 1], np.int32),
                                               [[1], [1]]))

"""Suffix decoding through real Arctic Inference, over multi-step request lifecycles.

Expected drafts are worked out by hand from the suffix-tree rule: match the longest suffix
of the last ``max_tree_depth`` context tokens in the request's own tree (prompt + response)
or the global tree (cached responses), then follow the most frequent continuation while its
estimated probability (count / count at the parent) is at least ``min_token_prob``, for at
most ``min(max_spec_tokens, floor(max_spec_factor * match_length))`` tokens.
"""

from __future__ import annotations

import importlib.util
import sys

import numpy as np
import pytest

from specjax.proposers.types import DraftOutput
from specjax.proposers.suffix import SuffixDecodingProposer

try:
    import arctic_inference.suffix_decoding  # noqa: F401

    HAVE_ARCTIC, ARCTIC_ERROR = True, None
except ImportError as e:
    HAVE_ARCTIC, ARCTIC_ERROR = False, e

needs_arctic = pytest.mark.skipif(
    not HAVE_ARCTIC,
    reason='arctic_inference is not importable (install with pip install "specjax[suffix]")',
)


def test_installed_arctic_inference_imports():
    """arctic-inference is a test dependency: installed but not importable must fail here,
    not skip every suffix test quietly. Seen: a wheel that pip built and cached for another
    Python (the package's compiled ``_C`` was ``cpython-311`` in a 3.12 venv, because pip ran
    outside an activated venv), reused by every later install."""
    if importlib.util.find_spec("arctic_inference") is None:
        pytest.skip("arctic-inference is not installed")
    assert HAVE_ARCTIC, (
        f"arctic-inference is installed but arctic_inference.suffix_decoding does not import "
        f"({ARCTIC_ERROR}); rebuild it inside the activated venv: pip cache remove "
        f"arctic_inference && pip install --force-reinstall --no-deps arctic-inference")


class Batch:
    """A tiny host-side persistent batch: req id -> context, prompt length."""

    def __init__(self, proposer: SuffixDecodingProposer, width: int = 64):
        self.proposer = proposer
        self.width = width
        self.contexts: dict = {}
        self.prompt_lens: dict = {}

    def add(self, req_id, prompt):
        self.contexts[req_id] = list(prompt)
        self.prompt_lens[req_id] = len(prompt)

    def step(self, sampled: dict):
        """sampled: req id -> this step's tokens, for every request in the batch (in order)."""
        ids = list(sampled)
        for r in ids:
            self.contexts[r] += list(sampled[r])
        buf = np.full((len(ids), self.width), -7, dtype=np.int32)
        for i, r in enumerate(ids):
            buf[i, : len(self.contexts[r])] = self.contexts[r]
        num_tokens = np.array([len(self.contexts[r]) for r in ids], dtype=np.int64)
        prompt_lens = np.array([self.prompt_lens[r] for r in ids], dtype=np.int64)
        drafts = self.proposer.propose(ids, [sampled[r] for r in ids], num_tokens, buf, prompt_lens)
        return dict(zip(ids, drafts))

    @property
    def active(self):
        return set(self.proposer.suffix_cache.active_requests)

    @property
    def cached(self):
        return set(self.proposer.suffix_cache.cached_requests)


@needs_arctic
def test_defaults_match_vllm():
    p = SuffixDecodingProposer(max_model_len=100)
    assert p.max_tree_depth == 24
    assert p.k == 24  # num_speculative_tokens defaults to the tree depth
    assert p.max_cached_requests == 10000
    assert p.max_spec_factor == 1.0
    assert p.min_token_prob == 0.1
    assert p.suffix_cache.max_tree_depth == 24
    assert p.suffix_cache.max_cached_requests == 10000


@pytest.mark.smoke
@needs_arctic
def test_lifecycle_start_add_speculate_stop():
    p = SuffixDecodingProposer(max_model_len=100, num_speculative_tokens=4)
    b = Batch(p)
    b.add("a", [5, 6, 7, 8, 5, 6])
    b.add("b", [1, 2, 3])

    # Step 1: "a" finished its prefill and sampled 7; "b" is mid-prefill (nothing sampled).
    # a's context 5 6 7 8 5 6 7: the tail "5 6 7" (match length 3) recurs at 0 and is
    # followed by 8 5 6 7; prob 1/2 each (the tail occurrence has no continuation); the
    # spec factor 1.0 allows 3 tokens.
    out = b.step({"a": [7], "b": []})
    assert out == {"a": [8, 5, 6], "b": []}
    assert b.active == {"a"}  # "b" is not started before it samples
    assert b.cached == {"a"}

    # Step 2: "a" accepted 8 5 and sampled 6 -> 5 6 7 8 5 6 7 8 5 6: the tail
    # "5 6 7 8 5 6" (match length 6) recurs at 0 and continues 7 8 5 6 -> k = 4 tokens.
    out = b.step({"a": [8, 5, 6], "b": [9]})
    assert out["a"] == [7, 8, 5, 6]
    # b's context 1 2 3 9: 9 is new, nothing matches in its tree or in a's response.
    assert out["b"] == []
    assert b.active == {"a", "b"}

    # Step 3: "a" leaves the batch -> stopped; its response stays cached.
    out = b.step({"b": [1]})
    assert b.active == {"b"}
    assert b.cached == {"a", "b"}
    # b: 1 2 3 9 1 -> "1" recurs once, followed by 2 3 9 1; probability 1/2, factor 1 -> 1.
    assert out["b"] == [2]


@needs_arctic
def test_response_cache_is_shared_across_requests():
    p = SuffixDecodingProposer(max_model_len=100, num_speculative_tokens=4, suffix_decoding_max_spec_factor=4.0)
    b = Batch(p)
    b.add("a", [40, 41])
    b.step({"a": [20]})
    b.step({"a": [21, 22]})
    b.step({"a": [23, 24]})  # a's response: 20 21 22 23 24
    b.add("x", [50, 51])
    out = b.step({"x": [20]})  # "a" leaves (stopped); "x" samples 20
    assert b.active == {"x"}
    # x's own tree: 50 51 20 (20 has no continuation). The global tree holds both
    # responses, so "20" occurs twice and continues 21 (probability 1/2) 22 23 24
    # (probability 1). Match length 1, factor 4 -> up to 4 tokens.
    assert out["x"] == [21, 22, 23, 24]


@needs_arctic
def test_eviction_and_readmission_of_an_id():
    p = SuffixDecodingProposer(
        max_model_len=100,
        num_speculative_tokens=4,
        suffix_decoding_max_cached_requests=1,
        suffix_decoding_max_spec_factor=4.0,
    )
    b = Batch(p)
    b.add("a", [40, 41])
    b.step({"a": [20]})
    b.step({"a": [21, 22, 23]})  # response of the first "a": 20 21 22 23
    assert b.cached == {"a"}

    # "b" joins as "a" leaves: the one-slot cache evicts a's response (FIFO).
    b.add("b", [60, 61])
    out = b.step({"b": [20]})
    assert b.active == {"b"} and b.cached == {"b"}
    assert out["b"] == []  # 20 21 22 23 is gone

    # The id "a" is reused for a new request whose prompt is unrelated to the old one.
    b.add("a", [70, 71])
    b.contexts["a"] = [70, 71]
    out = b.step({"a": [72], "b": [21]})
    assert b.active == {"a", "b"}
    assert b.cached == {"a"}  # the new "a" took the slot; b's response was evicted
    assert out == {"a": [], "b": []}



@needs_arctic
@pytest.mark.parametrize("new_id", ["a", "a2"])
def test_readmission_evicts_the_stale_response(new_id):
    # A roomy cache, so only re-admission (not FIFO pressure) can evict a's response.
    p = SuffixDecodingProposer(
        max_model_len=100,
        num_speculative_tokens=4,
        suffix_decoding_max_cached_requests=10,
        suffix_decoding_max_spec_factor=4.0,
    )
    b = Batch(p)
    b.add("a", [70, 71])
    b.step({"a": [72]})
    b.step({"a": [73, 74, 75, 76]})  # a's response: 72 73 74 75 76
    b.step({})  # an empty batch stops every active request
    assert b.active == set() and b.cached == {"a"}

    b.add(new_id, [90, 72])
    assert b.step({new_id: [91]}) == {new_id: []}  # 90 72 91: 91 is new
    out = b.step({new_id: [72]})
    if new_id == "a":
        # The id is reused: the stale response was evicted before the new request
        # started. In the new request's own tree "72" recurs at 1 and continues 91 72.
        assert b.cached == {"a"}
        assert out["a"] == [91, 72]
    else:
        # A fresh id: a's response is still cached and wins (score 1/2 + 1 + 1 + 1
        # against 1/2 + 1 for the request's own 91 72).
        assert b.cached == {"a", "a2"}
        assert out["a2"] == [73, 74, 75, 76]


@needs_arctic
def test_global_cache_disabled():
    p = SuffixDecodingProposer(
        max_model_len=100, num_speculative_tokens=4, suffix_decoding_max_cached_requests=0,
        suffix_decoding_max_spec_factor=4.0,
    )
    b = Batch(p)
    b.add("a", [40, 41])
    b.step({"a": [20]})
    b.step({"a": [21, 22]})
    b.add("x", [50, 51])
    out = b.step({"x": [20]})
    assert b.cached == set() and b.active == {"x"}
    assert out["x"] == []  # a's response 20 21 22 was never cached


@needs_arctic
def test_max_model_len_and_dynamic_lengths():
    p = SuffixDecodingProposer(max_model_len=12, num_speculative_tokens=5, suffix_decoding_max_spec_factor=8.0)
    b = Batch(p)
    prompt = [1, 2, 3, 4, 1, 2]
    for r in ("a", "b", "c"):
        b.add(r, prompt)
    # Contexts: a = 1 2 3 4 1 2 3 (7 tokens): "1 2 3" recurs -> 4 1 2 3, capped at
    # min(k, 12 - 7 - 1) = 4. b = 1 2 3 4 1 2 5 (5 is new) -> nothing. c: one more token
    # sampled in two steps later.
    out = b.step({"a": [3], "b": [5], "c": [3]})
    assert out == {"a": [4, 1, 2, 3], "b": [], "c": [4, 1, 2, 3]}
    out = b.step({"a": [4, 1, 2], "b": [5], "c": [4]})
    # a: 1 2 3 4 1 2 3 4 1 2 (10 tokens) -> cap 12 - 10 - 1 = 1 -> [3].
    # c: 1 2 3 4 1 2 3 4 (8 tokens) -> cap 3 -> [1, 2, 3].
    assert out["a"] == [3]
    assert out["c"] == [1, 2, 3]
    out = b.step({"a": [3], "b": [5], "c": [1, 2, 3, 4]})
    # a: 11 tokens -> cap 0 -> no draft; c: 12 tokens = max_model_len -> no draft.
    assert out["a"] == [] and out["c"] == []
    padded = DraftOutput.from_lists([[3], [], [1, 2]], p.k)
    assert padded.token_ids.shape == (3, 5) and padded.num_drafts.tolist() == [1, 0, 2]


@pytest.mark.smoke
@needs_arctic
def test_propose_arrays_and_min_token_prob():
    p = SuffixDecodingProposer(max_model_len=100, num_speculative_tokens=3, suffix_decoding_min_token_prob=0.6)
    # Context 5 6 7 8 5 6 7: the continuation of "5 6 7" has probability 1/2 < 0.6.
    buf = np.array([[5, 6, 7, 8, 5, 6, 7, 0]], np.int32)
    out = p.propose_arrays(["r"], [[7]], np.array([7]), buf, np.array([6]))
    assert out.token_ids.tolist() == [[-1, -1, -1]] and out.num_drafts.tolist() == [0]


def test_missing_arctic_inference_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "arctic_inference.suffix_decoding", None)
    with pytest.raises(ImportError, match=r'pip install "specjax\[suffix\]"'):
        SuffixDecodingProposer(max_model_len=100)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(max_model_len=0), "max_model_len"),
        (dict(num_speculative_tokens=0), "num_speculative_tokens"),
        (dict(suffix_decoding_max_tree_depth=0), "suffix_decoding_max_tree_depth"),
        (dict(suffix_decoding_max_cached_requests=-1), "suffix_decoding_max_cached_requests"),
        (dict(suffix_decoding_max_spec_factor=-0.5), "suffix_decoding_max_spec_factor"),
        (dict(suffix_decoding_max_spec_factor=float("nan")), "suffix_decoding_max_spec_factor"),
        (dict(suffix_decoding_min_token_prob=1.5), "suffix_decoding_min_token_prob"),
        (dict(suffix_decoding_min_token_prob="0.1"), "suffix_decoding_min_token_prob"),
    ],
)
def test_bad_config(kwargs, field, monkeypatch):
    # Validation comes before the import, so it is checked without Arctic Inference too.
    monkeypatch.setitem(sys.modules, "arctic_inference.suffix_decoding", None)
    base = dict(max_model_len=100)
    base.update(kwargs)
    with pytest.raises(ValueError, match=field):
        SuffixDecodingProposer(**base)


@needs_arctic
def test_bad_inputs():
    p = SuffixDecodingProposer(max_model_len=100, num_speculative_tokens=3)
    buf = np.zeros((2, 8), np.int32)
    n = np.array([4, 4])
    pl = np.array([2, 2])
    with pytest.raises(ValueError, match="sampled_token_ids"):
        p.propose(["a", "b"], [[1]], n, buf, pl)
    with pytest.raises(ValueError, match="num_tokens_no_spec"):
        p.propose(["a", "b"], [[1], [1]], np.array([4]), buf, pl)
    with pytest.raises(TypeError, match="token_ids_cpu"):
        p.propose(["a", "b"], [[1], [1]], n, buf.astype(float), pl)
    with pytest.raises(ValueError, match="num_prompt_tokens"):
        p.propose(["a", "b"], [[1], [1]], n, buf, np.array([2, 5]))
    with pytest.raises(ValueError, match="distinct"):
        p.propose(["a", "a"], [[1], [1]], n, buf, pl)
    with pytest.raises(TypeError, match=r"sampled_token_ids\[1\]"):
        p.propose(["a", "b"], [[1], [1.5]], n, buf, pl)
    # A rejected call changes nothing.
    assert set(p.suffix_cache.active_requests) == set()
    assert set(p.suffix_cache.cached_requests) == set()

"""Long prompts: the tiled attention reference and chunked prefill (CPU, fp32).

Tiling is forced small (every attention tiled, 128-query tiles, 256-key chunks), so the
target's and each drafter's prefill run many query tiles and key chunks. A draft model
identical to the target then accepts all ``k`` drafts (``k + 1`` tokens) at every step,
after a whole or a chunked prefill; the drafters' and the target's KV of the prompt after
prefill equal the dense reference path's. Chunked prefill (``LoopOptions``'
``long_prefill_token_threshold`` and ``max_num_batched_tokens``) is lossless for every kind of proposer, and each device drafter drafts and accepts exactly
what it does after a whole prefill (its KV right across chunk boundaries).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from specjax.checks import ArgumentError, ArgumentTypeError
from specjax.engine import Engine, LoopOptions, SamplingParams, generate
from specjax.engine.options import DEFAULT_CPU_MAX_NUM_BATCHED_TOKENS
from specjax.kernels.paged_attention import reference as R
from specjax.token_tree import TokenTree
from test_engine import (BS, FIXED, METHODS, PARAMS_A, PARAMS_B, PROMPTS_A, PROMPTS_B, V,
                         baseline, build, eos_b, fixed, target)

L = 2048                                 # max_model_len
PROMPT = [int(t) for t in np.random.default_rng(5).integers(0, V, 1500)]


def _attention(monkeypatch, tiled: bool) -> list[int]:
    """Every paged attention traced from here on tiled small (``tiled``) or dense; the jit
    caches are dropped so nothing traced under the other setting runs. Returns the list the
    query buckets traced tiled are appended to."""
    monkeypatch.setattr(R, "TILED_MIN_SCORE_BYTES", 0 if tiled else 1 << 62)
    monkeypatch.setattr(R, "MAX_TILE_Q", 128)
    monkeypatch.setattr(R, "MAX_CHUNK_K", 256)
    traced, tiled_form = [], R.paged_attention_tiled

    def counted(q, cache, md, **kw):
        traced.append(int(md.max_query_len))
        return tiled_form(q, cache, md, **kw)

    monkeypatch.setattr(R, "paged_attention_tiled", counted)
    jax.clear_caches()
    return traced


@pytest.fixture(autouse=True)
def _fresh_caches():
    yield
    jax.clear_caches()


@pytest.mark.skipif("draft_model" not in METHODS, reason="needs the draft-model proposer")
@pytest.mark.parametrize("k,chunk", [(2, 0), (4, 384)])
def test_identical_draft_model_accepts_every_draft_after_a_long_prefill(monkeypatch, k, chunk):
    traced = _attention(monkeypatch, tiled=True)
    steps = 4
    sp = SamplingParams(max_tokens=1 + steps * (k + 1))     # the prefill's token, then full steps
    seen = []
    kw = dict(max_model_len=L, block_size=BS, options=LoopOptions(
        long_prefill_token_threshold=chunk))
    out = generate(target(), build("draft_model", k, max_model_len=L), [PROMPT], sp,
                   stat_loggers=[seen.append], **kw)
    plain = generate(target(), None, [PROMPT], sp, **kw)
    assert out.token_ids == plain.token_ids
    # the prefill and the verify steps (a query bucket >= k + 1) ran the tiled form
    assert max(traced) >= (chunk or len(PROMPT)) and any(k + 1 <= n < 64 for n in traced)
    drafted = [s for s in seen if s.num_drafts]
    prefill_steps = -(-len(PROMPT) // chunk) if chunk else 1
    assert len(drafted) == steps and out.num_steps == prefill_steps + steps
    for s in drafted:
        assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens) == (1, k, k)


def _prefill_kv(method: str) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """The target's and the drafter's KV rows of the prompt after its prefill (one step):
    each ``[num_blocks, BS, ...]`` leaf's rows of positions ``0 .. len(PROMPT) - 1``
    (blocks 1, 2, ... in order: the scheduler's first blocks)."""
    eng = Engine(target(), build(method, 3, max_model_len=L), max_model_len=L, block_size=BS,
                 max_num_seqs=1)
    eng.generate([PROMPT], SamplingParams(max_tokens=1))

    def rows(tree):
        out = []
        for leaf in jax.tree.leaves(jax.device_get(tree)):
            if leaf.ndim >= 2 and leaf.shape[1] == BS and leaf.shape[0] == eng.num_blocks:
                flat = leaf.reshape((-1,) + leaf.shape[2:])
                out.append(flat[BS: BS + len(PROMPT)])
        return out

    return rows(eng.target_kv), rows(eng.draft_state)


@pytest.mark.parametrize("method", [m for m in ("eagle3", "draft_model") if m in METHODS])
def test_drafter_kv_after_prefill_equals_the_dense_path(monkeypatch, method):
    assert _attention(monkeypatch, tiled=False) == []
    want_target, want_draft = _prefill_kv(method)
    traced = _attention(monkeypatch, tiled=True)
    got_target, got_draft = _prefill_kv(method)
    assert max(traced) >= len(PROMPT)
    assert want_draft and len(got_draft) == len(want_draft)
    for what, got, want in (("target", got_target, want_target),
                            ("drafter", got_draft, want_draft)):
        for i, (g, w) in enumerate(zip(got, want)):
            assert np.abs(w).max() > 0, f"{what} leaf {i}: the prompt's KV was never written"
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5,
                                       err_msg=f"{method}: {what} KV leaf {i}")


# --- chunked prefill ------------------------------------------------------------------

CHUNKED = fixed(long_prefill_token_threshold=5)     # prompts of up to 16 tokens: 1 to 4 chunks
#: device drafters (and n-gram): drafts and acceptances equal the whole-prefill run's
SAME_DRAFTS = ("eagle", "eagle3", "dflash", "medusa", "mtp", "draft_model",
               "extract_hidden_states", "ngram", "ngram_gpu")


def _run(prop, which, **kw):
    if which == "A":
        return generate(target(), prop, PROMPTS_A, PARAMS_A, **kw)
    return generate(target(), prop, PROMPTS_B, PARAMS_B, max_num_seqs=3, eos_token_id=eos_b(),
                    **kw)


@pytest.mark.parametrize("method", [m for m in ("eagle3", "draft_model", "dflash", "ngram",
                                                "suffix", "extract_hidden_states")
                                    if m in METHODS])
def test_chunked_prefill_is_lossless(method):
    k = 1 if method == "extract_hidden_states" else 3
    for which in ("A", "B"):
        whole = _run(build(method, k), which, **FIXED)
        out = _run(build(method, k), which, **CHUNKED)
        assert out.token_ids == baseline(which).token_ids, f"{method} workload {which}"
        assert out.num_steps > whole.num_steps                  # the prompts took several
        if method in SAME_DRAFTS:
            a, b = out.spec_stats, whole.spec_stats
            assert (a.num_drafts, a.num_draft_tokens, a.num_accepted_tokens) == \
                (b.num_drafts, b.num_draft_tokens, b.num_accepted_tokens), which


@pytest.mark.skipif("eagle3" not in METHODS, reason="needs the EAGLE-3 proposer")
def test_chunked_prefill_non_padded_and_tree_drafting_are_lossless():
    tree = "[(0,), (1,), (0, 0), (1, 0), (0, 0, 0), (1, 0, 0)]"
    for prop in (build("eagle3", 3, disable_padded_drafter_batch=True),
                 build("eagle3", TokenTree.from_choices(tree).num_nodes,
                       speculative_token_tree=tree)):
        for which in ("A", "B"):
            assert _run(prop, which, **CHUNKED).token_ids == baseline(which).token_ids


def test_token_budget_default_and_errors():
    eng = Engine(target(), None, max_model_len=L, block_size=BS)
    assert eng.options.max_num_batched_tokens == DEFAULT_CPU_MAX_NUM_BATCHED_TOKENS  # CPU target
    assert eng.options.enable_chunked_prefill and eng.options.long_prefill_token_threshold == 0
    for field, bad, err in (("max_num_batched_tokens", 0, ArgumentError),
                            ("max_num_batched_tokens", 2.0, ArgumentTypeError),
                            ("long_prefill_token_threshold", -1, ArgumentError),
                            ("enable_chunked_prefill", 1, ArgumentTypeError)):
        with pytest.raises(err, match=field):
            LoopOptions(**{field: bad})
    with pytest.raises(ArgumentError, match="max_num_batched_tokens=8 is below one KV block"):
        Engine(target(), None, max_model_len=64, block_size=16,
               options=LoopOptions(max_num_batched_tokens=8))
    with pytest.raises(ArgumentError, match="below max_model_len=64 with enable_chunked_prefill"):
        Engine(target(), None, max_model_len=64, block_size=16,
               options=LoopOptions(max_num_batched_tokens=32, enable_chunked_prefill=False))
    with pytest.raises(ArgumentError, match="long_prefill_token_threshold=8 chunks"):
        Engine(target(), None, max_model_len=64, block_size=16,
               options=LoopOptions(long_prefill_token_threshold=8, enable_chunked_prefill=False))

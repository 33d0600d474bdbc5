"""Bring your own model from a published JAX library (issue 48): penzai's Llama-like
transformer (``penzai.models.transformer``, pinned in ``[test]``) as a ``specjax.Target``
through docs/integration.md's adapter (tests/support/library_target.py holds the same code).
Its layers, parameter layout and math run as they are; the adapter supplies only the paged KV
write and read. Greedy output, plain and with n-gram and EAGLE-3 proposers, equals a
full-recompute loop over penzai's own uncached forward. Skipped where penzai is absent."""

from __future__ import annotations

import dataclasses
import functools
import re

import pytest

pytest.importorskip("penzai")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from penzai import pz  # noqa: E402

import specjax  # noqa: E402
import suite_paths  # noqa: E402
from specjax import LoopOptions, SamplingParams, SpeculativeConfig, TargetModel, make_proposer  # noqa: E402
from specjax.attention_metadata import CommonAttentionMetadata  # noqa: E402
from specjax.models import registry  # noqa: E402

import library_target  # noqa: E402
from library_target import (PagedAttention, PenzaiTarget, full_recompute_greedy, tiny_gemma,  # noqa: E402
                            tiny_llama)

BS, MML, N = 8, 64, 20
PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [1, 2, 3, 1, 2, 3, 1, 2]]
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2,
         "prompt_lookup_max": 4}
DOC = suite_paths.DOCS / "integration.md"
ADAPTER = re.compile(r"^# --- the adapter[^\n]*\n(.*?)^# --- end of the adapter", re.S | re.M)


@functools.lru_cache(maxsize=None)
def lm():
    return tiny_llama(0)


@functools.lru_cache(maxsize=None)
def model():
    return PenzaiTarget.from_penzai(lm())


@functools.lru_cache(maxsize=None)
def reference() -> list[list[int]]:
    out = [full_recompute_greedy(lm(), p, N, length=MML) for p in PROMPTS]
    # no near-ties: paged attention and the full forward (both float32) pick the same argmax
    assert min(margin for _, margin in out) > 1e-3
    return [tokens for tokens, _ in out]


def doc_block() -> str:
    m = re.search(r"<!-- library-target -->\s*```python\n(.*?)```", DOC.read_text(), re.S)
    assert m, "docs/integration.md lost its library-target block"
    return m.group(1)


def eagle3_proposer():
    tgt, params = model()
    hcfg = registry.config_from_hf("eagle3", dict(
        hidden_size=tgt.hidden_size, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=4, rms_norm_eps=1e-5, vocab_size=tgt.vocab_size,
        num_hidden_layers=1, draft_vocab_size=tgt.vocab_size,
        target_hidden_size=tgt.hidden_size, eagle_aux_hidden_state_layer_ids=[0, 1]))
    return make_proposer(SpeculativeConfig(method="eagle3", num_speculative_tokens=3),
                         target=tgt, target_params=params, draft=hcfg,
                         draft_params=registry.init_params("eagle3", hcfg, 1),
                         max_model_len=MML, block_size=BS, kernel_backend="xla")


def proposer(method: str):
    if method == "plain":
        return None
    if method == "ngram":
        return make_proposer(NGRAM, max_model_len=MML, block_size=BS)
    return eagle3_proposer()


def run(prop, options=None, target=None, prompts=PROMPTS):
    tgt, params = target or model()
    return specjax.generate(TargetModel(tgt, params), prop, prompts,
                            SamplingParams(max_tokens=N, ignore_eos=True), max_model_len=MML,
                            block_size=BS, options=options)


@pytest.mark.smoke
def test_the_documented_adapter_is_the_tested_one():
    """docs/integration.md's block is tests/support/library_target.py's adapter, verbatim, and
    at most ~80 lines of code."""
    src = ADAPTER.search(suite_paths.SUPPORT.joinpath("library_target.py").read_text())
    assert src, "tests/support/library_target.py lost its adapter markers"
    assert doc_block().strip() == src.group(1).strip()
    assert sum(1 for line in doc_block().splitlines() if line.strip()) <= 90


def test_the_model_is_penzais_own_but_the_attention_wrapper():
    tgt, params = model()
    assert isinstance(tgt, specjax.Target) and not hasattr(tgt, "config")

    def layer_types(node):
        if isinstance(node, pz.nn.Layer):
            yield type(node)
            for f in dataclasses.fields(node):
                yield from layer_types(getattr(node, f.name))
        elif isinstance(node, (list, tuple)):
            for x in node:
                yield from layer_types(x)

    types = set(layer_types(tgt.model))
    assert PagedAttention in types and pz.nn.Attention in types      # wrapped, not replaced
    assert {t.__module__.split(".")[0] for t in types - {PagedAttention}} == {"penzai"}
    # the parameters: penzai's own labels and named shapes, the same arrays as the model's
    own = {p.label: p.value for p in pz.unbind_params(lm(), freeze=True)[1]}
    assert {k: p.value.named_shape for k, p in params.items()} == \
        {k: v.named_shape for k, v in own.items()}
    assert all(p.value.data_array is own[k].data_array for k, p in params.items())
    assert tgt.num_layers == 2 and tgt.vocab_size == 97 and tgt.hidden_size == 64
    # 2 layers x (K, V) x 8 slots x 2 KV groups x 16 x 4 bytes
    assert tgt.kv_bytes_per_block(BS, np.float32) == 2 * 2 * BS * 2 * 16 * 4
    sw = tgt.shared_weights(params)
    assert sw["embed_tokens"]["embedding"].shape == (97, 64)
    assert sw["lm_head"]["kernel"].shape == (64, 97)


def paged_logits(tgt, params, tokens, chunks):
    """The adapter's logits for ``tokens`` fed in ``chunks`` of one request (blocks 3, 1, 4, ...,
    out of order), each step padded by one token at slot -1 (dropped, its output ignored)."""
    blocks = np.array([3, 1, 4, 6, 2, 5])[:-(-len(tokens) // BS)]
    kv, out, done = tgt.init_kv_caches(8, BS, jnp.float32), [], 0
    for c in chunks:
        pos = np.arange(done, done + c + 1)
        slots = np.where(pos < done + c, blocks[np.minimum(pos // BS, len(blocks) - 1)] * BS
                         + pos % BS, -1)
        attn = CommonAttentionMetadata(
            query_start_loc=jnp.array([0, c], jnp.int32), seq_lens=jnp.array([done + c], jnp.int32),
            block_table=jnp.asarray(blocks[None], jnp.int32),
            slot_mapping=jnp.asarray(slots, jnp.int32), num_reqs=jnp.array(1, jnp.int32),
            num_actual_tokens=jnp.array(c, jnp.int32), max_seq_len=jnp.array(done + c, jnp.int32),
            max_query_len=c + 1)
        ids = jnp.asarray(list(tokens[done:done + c]) + [0], jnp.int32)
        hidden, _, kv = tgt.forward(params, ids, jnp.asarray(pos, jnp.int32), kv, attn)
        out.append(np.asarray(tgt.compute_logits(params, hidden))[:c])
        done += c
    return np.concatenate(out)


@pytest.mark.parametrize("variant", ["llama", "gemma"])
def test_paged_logits_equal_penzais_own_forward(variant):
    """Chunked prefill and decode through the pages give penzai's own full-forward logits
    (the Gemma-like variant: its sliding-window masks read the context's positions too)."""
    lm_ = tiny_llama() if variant == "llama" else tiny_gemma()
    tgt, params = PenzaiTarget.from_penzai(lm_)
    tokens = [int(t) for t in np.random.default_rng(1).integers(0, 97, 30)]
    want = np.asarray(lm_(pz.nx.wrap(jnp.asarray(tokens)).tag("seq")).unwrap("seq", "vocabulary"))
    got = paged_logits(tgt, params, tokens, [11, 1, 1, 9, 4, 1, 3])
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("method, loop", [
    pytest.param("plain", "device_loop", marks=pytest.mark.smoke), ("plain", "per_step"),
    pytest.param("ngram", "device_loop", marks=pytest.mark.smoke), ("ngram", "per_step"),
    ("eagle3", "device_loop"), ("eagle3", "per_step")])
def test_greedy_equals_penzais_full_recompute(method, loop):
    res = run(proposer(method), None if loop == "device_loop" else LoopOptions(steps_per_sync=1))
    assert res.token_ids == reference()
    if method != "plain":
        assert res.spec_stats.num_drafts > 0
    if method == "ngram":        # the outputs repeat: drafts are accepted
        assert res.mean_acceptance_length > 1


def test_the_documented_block_runs_as_written():
    ns: dict = {}
    exec(compile(doc_block(), str(DOC), "exec"), ns)  # noqa: S102 (our own documentation)
    assert ns["PenzaiTarget"] is not library_target.PenzaiTarget
    assert run(None, target=ns["PenzaiTarget"].from_penzai(lm())).token_ids == reference()


def test_a_gemma_like_model_runs_through_the_same_adapter():
    """Multi-query attention, a tied embedder (shared as ``lm_head.embedding``), sliding-window
    layers (their mask also reads the context's positions), soft caps, post-norms."""
    gemma = tiny_gemma()
    tgt, params = PenzaiTarget.from_penzai(gemma)
    assert set(tgt.shared_weights(params)["lm_head"]) == {"embedding"}
    prompts = PROMPTS + [list(range(3, 15))]          # longer than the 4-token window
    out = [full_recompute_greedy(gemma, p, N, length=MML) for p in prompts]
    assert min(margin for _, margin in out) > 1e-3
    for prop in (None, proposer("ngram")):
        assert run(prop, target=(tgt, params), prompts=prompts).token_ids == [t for t, _ in out]

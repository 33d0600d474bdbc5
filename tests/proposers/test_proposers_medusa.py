"""Medusa proposer against a naive reference.

The reference runs the same Flax heads one request at a time on that request's last
accepted hidden state, with the full vocabulary logits (``token_map`` scattered into
``-inf``, as vLLM's ``compute_logits`` does) and a Python loop over heads: no batching, no
head slicing, no padded rows.
"""

import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.attention_metadata import CommonAttentionMetadata
from specjax.config import SpeculativeConfig
from specjax.models import registry
from specjax.proposers.types import ProposerInputs
from specjax.proposers.medusa import MedusaProposer

try:
    from compile_check import assert_no_recompile
except ImportError:  # tests/ made a package
    from tests.compile_check import assert_no_recompile

H = 32
V = 72
HEADS = 4
B_PAD = 4
T_PAD = 64
BS = 4
MAX_BLOCKS = 8

VARIANTS = {
    # per-head lm_heads over a truncated vocabulary with a token_map, ResBlock bias
    "token_map": dict(num_heads=HEADS, num_hidden_layers=2, truncated_vocab_size=40,
                      has_token_map=True, medusa_fc_bias=True),
    # one shared original lm_head over the full vocabulary, scaled logits
    "shared_head": dict(num_heads=HEADS, num_hidden_layers=1, original_lm_head=True, logit_scale=0.5),
}


@functools.lru_cache(maxsize=None)
def heads(variant):
    cfg = registry.config_from_hf("medusa", dict(VARIANTS[variant], hidden_size=H, vocab_size=V))
    return cfg, registry.make_model("medusa", cfg), registry.init_params("medusa", cfg, 7)


@functools.lru_cache(maxsize=None)
def _one_head_logits(model):
    """Logits of every head for one hidden state, ``[num_heads, V]`` (full vocabulary)."""
    return jax.jit(lambda p, h: model.compute_logits(p, model.forward(p, h[None]))[:, 0])


def naive_drafts(model, params, last_hidden, k):
    logits = np.asarray(_one_head_logits(model)(params, jnp.asarray(last_hidden)))
    assert logits.shape == (model.config.num_heads, V)
    return [int(np.argmax(logits[h])) for h in range(k)]


def _requests(rng, n, *, padded, chunked):
    reqs = []
    for _ in range(n):
        L = int(rng.integers(2, 16))
        reqs.append(dict(L=L, hid=(3 * rng.standard_normal((L, H))).astype(np.float32),
                         rej=int(rng.integers(0, 3)) if padded else 0,
                         split=int(rng.integers(1, L)) if chunked else 0))
    return reqs


def _inputs(reqs, lo_hi, with_rejected, rng):
    hid, qlens, seqlens, sample, rej = [], [], [], [], []
    t = 0
    for r, (lo, hi) in zip(reqs, lo_hi):
        j = r["rej"] if with_rejected else 0
        hid += list(r["hid"][lo:hi]) + list(rng.standard_normal((j, H)).astype(np.float32))
        qlens.append(hi - lo + j)
        seqlens.append(hi + j)
        sample.append(t + hi - lo - 1)
        rej.append(j)
        t += hi - lo + j
    n = len(reqs)
    table = np.arange(n * MAX_BLOCKS).reshape(n, MAX_BLOCKS)
    md = CommonAttentionMetadata.from_query_lens(qlens, seqlens, table, block_size=BS,
                                                 num_reqs_pad=B_PAD, num_tokens_pad=T_PAD,
                                                 max_query_len=32)
    h = np.zeros((T_PAD, H), np.float32)
    h[:t] = np.stack(hid)
    padb = lambda a: jnp.asarray(np.concatenate([np.asarray(a, np.int32), np.zeros(B_PAD - n, np.int32)]))  # noqa: E731
    return ProposerInputs(
        target_token_ids=jnp.zeros(T_PAD, jnp.int32), target_positions=jnp.zeros(T_PAD, jnp.int32),
        target_hidden_states=jnp.asarray(h), aux_hidden_states=None,
        next_token_ids=padb([0] * n),
        token_indices_to_sample=padb(sample) if with_rejected else None,
        num_rejected_tokens=padb(rej) if with_rejected else None, attn_metadata=md)


@pytest.mark.smoke
@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("k, chunked, padded", [(3, False, True), (1, True, True), (4, False, False),
                                                (3, True, False)])
def test_propose_matches_naive_reference(variant, k, chunked, padded):
    rng = np.random.default_rng(zlib.crc32(repr((variant, k, chunked, padded)).encode()))
    _, model, params = heads(variant)
    prop = MedusaProposer(SpeculativeConfig(method="medusa", num_speculative_tokens=k), model,
                          kernel_backend="xla")
    n = 3
    reqs = _requests(rng, n, padded=padded, chunked=chunked)
    state = prop.init_state()
    if chunked:   # a first call on a prefix: Medusa keeps nothing from it
        first = _inputs(reqs, [(0, r["split"]) for r in reqs], False, rng)
        out, state = prop.propose(params, state, first)
        for i, r in enumerate(reqs):
            want = naive_drafts(model, params, r["hid"][r["split"] - 1], k)
            np.testing.assert_array_equal(np.asarray(out.token_ids)[i], want)
    inp = _inputs(reqs, [(r["split"], r["L"]) for r in reqs], padded, rng)
    out, state = prop.propose(params, state, inp)
    assert state == ()
    got = np.asarray(out.token_ids)
    assert got.shape == (B_PAD, k) and got.dtype == np.int32
    np.testing.assert_array_equal(out.num_drafts, [k] * n + [0] * (B_PAD - n))
    np.testing.assert_array_equal(got[n:], -1)
    for i, r in enumerate(reqs):
        want = naive_drafts(model, params, r["hid"][r["L"] - 1], k)
        np.testing.assert_array_equal(got[i], want, err_msg=f"request {i}")


def test_token_map_drafts_are_target_ids():
    """With a truncated head every draft is one of the token_map's target ids."""
    rng = np.random.default_rng(3)
    _, model, params = heads("token_map")
    prop = MedusaProposer(SpeculativeConfig(method="medusa", num_speculative_tokens=HEADS), model,
                          kernel_backend="xla")
    reqs = _requests(rng, 4, padded=False, chunked=False)
    out, _ = prop.propose(params, prop.init_state(), _inputs(reqs, [(0, r["L"]) for r in reqs],
                                                             False, rng))
    assert set(np.asarray(out.token_ids).ravel()) <= set(np.asarray(params["token_map"]).tolist())


def test_no_recompile_inside_a_bucket(caplog):
    rng = np.random.default_rng(5)
    _, model, params = heads("token_map")
    prop = MedusaProposer(SpeculativeConfig(method="medusa", num_speculative_tokens=3), model,
                          kernel_backend="xla")
    state = prop.init_state()

    def run(n):
        nonlocal state
        reqs = _requests(rng, n, padded=True, chunked=False)
        out, state = prop.propose(params, state, _inputs(reqs, [(0, r["L"]) for r in reqs], True, rng))
        return np.asarray(out.token_ids)

    assert_no_recompile(prop.propose, run, (2, 1, 4, 3), caplog)


@pytest.mark.parametrize("kwargs, match", [
    (dict(config=SpeculativeConfig(method="medusa", num_speculative_tokens=5)),
     r"num_speculative_tokens=5 exceeds the number of Medusa heads \(4\)"),
    (dict(config=SpeculativeConfig(method="eagle", num_speculative_tokens=2)), "method 'medusa'"),
    (dict(model="heads"), "MedusaHeads"),
    (dict(kernel_backend="cuda"), "backend"),
])
def test_construction_errors(kwargs, match):
    _, model, _ = heads("shared_head")
    args = dict(config=SpeculativeConfig(method="medusa", num_speculative_tokens=2), model=model)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        MedusaProposer(**args)


def test_missing_hidden_states_is_an_error():
    rng = np.random.default_rng(0)
    _, model, params = heads("shared_head")
    prop = MedusaProposer(SpeculativeConfig(method="medusa", num_speculative_tokens=2), model)
    reqs = _requests(rng, 2, padded=False, chunked=False)
    inp = _inputs(reqs, [(0, r["L"]) for r in reqs], False, rng)._replace(target_hidden_states=None)
    with pytest.raises(ValueError, match="target_hidden_states"):
        prop.propose(params, prop.init_state(), inp)

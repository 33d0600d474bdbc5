"""DSpark's Markov chain and confidence head against a NumPy loop of the research note's
formulas (vanilla, gated, rnn; with / without the confidence head and a reduced vocab)."""

import itertools

import numpy as np
import pytest

import jax.numpy as jnp

from specjax.models import registry
from specjax.models.dspark import markov_chain

V, H, R, B, N = 48, 16, 6, 3, 5
GEO = dict(hidden_size=H, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1,
           vocab_size=V, num_hidden_layers=1, target_hidden_size=H,
           aux_hidden_state_layer_ids=[0, 1], mask_token_id=V - 1, markov_rank=R)


def sig(x):
    return 1 / (1 + np.exp(-x))


def oracle(t, c, z, h, anchor, topk=None):
    w1, w2 = t["markov_head.markov_w1.weight"], t["markov_head.markov_w2.weight"]
    d2t = t.get("d2t")
    drafts, confs = np.zeros((B, N), np.int64), np.zeros((B, N))
    for b in range(B):
        prev, s = anchor[b], np.zeros(R)
        for i in range(N):
            e = w1[prev]
            if c.markov_head_type == "gated":
                g = sig(t["markov_head.gate_proj.weight"] @ np.concatenate([h[b, i], e])
                        + t["markov_head.gate_proj.bias"])
                m = g * e
            elif c.markov_head_type == "rnn":
                j = (t["markov_head.joint_proj.weight"] @ np.concatenate([s, e, h[b, i]])
                     + t["markov_head.joint_proj.bias"])
                gt = sig(j[:R])
                s = gt * s + (1 - gt) * np.tanh(j[R:2 * R])
                m = np.tanh(j[2 * R:])
            else:
                m = e
            if topk is None:
                d = int(np.argmax(z[b, i] + w2 @ m))
            else:       # vLLM's dspark_draft_topk: the bias on the base top-k only
                top = np.argsort(-z[b, i], kind="stable")[:topk]
                d = int(top[np.argmax(z[b, i, top] + w2[top] @ m)])
            if d2t is not None:
                d = d + int(d2t[d])
            if c.enable_confidence_head:
                f = np.concatenate([h[b, i], m]) if c.confidence_head_with_markov else h[b, i]
                confs[b, i] = sig(t["confidence_head.proj.weight"][0] @ f
                                  + t["confidence_head.proj.bias"][0])
            drafts[b, i], prev = d, d
    return drafts, confs


@pytest.mark.parametrize("head,conf,reduced", list(itertools.product(
    ("vanilla", "gated", "rnn"), (None, "h", "hm"), (False, True))))
def test_markov_chain_matches_numpy(head, conf, reduced):
    hf = dict(GEO, markov_head_type=head, enable_confidence_head=conf is not None,
              confidence_head_with_markov=conf == "hm")
    if reduced:
        hf.update(draft_vocab_size=20, has_d2t=True)
    c = registry.config_from_hf("dspark", hf)
    t = registry.random_tensors("dspark", c, 3)
    p = registry.params_from_tensors("dspark", c, t)
    rng = np.random.default_rng(0)
    vd = c.draft_vocab_size
    z = rng.standard_normal((B, N, vd)).astype(np.float32)
    h = rng.standard_normal((B, N, H)).astype(np.float32)
    anchor = rng.integers(0, V, B)
    d, _, ci = markov_chain(p, c, jnp.asarray(z), jnp.asarray(h), jnp.asarray(anchor, jnp.int32))
    want_d, want_c = oracle({k: np.asarray(v, np.float64) for k, v in t.items()}, c,
                            z.astype(np.float64), h.astype(np.float64), anchor)
    np.testing.assert_array_equal(np.asarray(d), want_d)
    if conf is None:
        assert ci is None
    else:
        np.testing.assert_allclose(np.asarray(ci), want_c, rtol=1e-4, atol=1e-5)
    assert d.shape == (B, N) and d.dtype == jnp.int32


@pytest.mark.parametrize("head,topk,reduced", [("vanilla", 4, False), ("rnn", 1, True),
                                               ("gated", 7, False)])
def test_topk_markov_matches_numpy(head, topk, reduced):
    """``dspark_draft_topk``: the bias evaluated on each slot's top-k base logits only; with
    a sampler (``choose``) the other logits are -inf."""
    hf = dict(GEO, markov_head_type=head)
    if reduced:
        hf.update(draft_vocab_size=20, has_d2t=True)
    c = registry.config_from_hf("dspark", hf)
    t = registry.random_tensors("dspark", c, 4)
    w2 = "markov_head.markov_w2.weight"          # a strong bias: truncation then matters
    t[w2] = np.asarray(t[w2]) * 20
    p = registry.params_from_tensors("dspark", c, t)
    rng = np.random.default_rng(1)
    z = rng.standard_normal((B, N, c.draft_vocab_size)).astype(np.float32)
    h = rng.standard_normal((B, N, H)).astype(np.float32)
    anchor = rng.integers(0, V, B)
    args = (p, c, jnp.asarray(z), jnp.asarray(h), jnp.asarray(anchor, jnp.int32))
    d, _, _ = markov_chain(*args, topk=topk)
    want, _ = oracle({k: np.asarray(v, np.float64) for k, v in t.items()}, c,
                     z.astype(np.float64), h.astype(np.float64), anchor, topk=topk)
    np.testing.assert_array_equal(np.asarray(d), want)
    full, _, _ = markov_chain(*args)
    if topk > 1:
        assert (np.asarray(full) != want).any()      # the truncation changes drafts here
    d2, seen, _ = markov_chain(*args, topk=topk,
                               choose=lambda lg, i: (d[:, i], jnp.isfinite(lg).sum(-1)))
    assert (np.asarray(seen) == topk).all()


def test_config_roundtrip_and_refusals():
    c = registry.config_from_hf("dspark", dict(GEO, markov_head_type="rnn", sample_from_anchor=False))
    assert registry.config_from_hf("dspark", registry.config_to_dict(c)) == c
    nested = dict(GEO, dflash_config={"mask_token_id": V - 1}, dspark_config={"markov_rank": 4})
    del nested["markov_rank"], nested["mask_token_id"]
    c2 = registry.config_from_hf("dspark", nested)
    assert (c2.markov_rank, c2.mask_token_id, c2.sample_from_anchor) == (4, V - 1, True)
    with pytest.raises(ValueError, match="markov_rank is required"):
        registry.config_from_hf("dspark", {k: v for k, v in GEO.items() if k != "markov_rank"})
    with pytest.raises(ValueError, match="markov_head_type"):
        registry.config_from_hf("dspark", dict(GEO, markov_head_type="lstm"))

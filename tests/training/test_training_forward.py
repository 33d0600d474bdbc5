"""The training forwards (dense, teacher-forced, TTT / DFlash masks) compute exactly what the
inference models compute through the paged cache, step by step, as a real draft chain runs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.attention_metadata import CommonAttentionMetadata
from specjax.models import registry, share_target_weights
from specjax.training import forward as F

V, H, BS = 40, 32, 4
G = dict(hidden_size=H, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
         rms_norm_eps=1e-5, vocab_size=V)
T = 14
AUX = (0, 1, 2)


def md(q, s, causal=True):
    table = np.arange(16)[None]
    return CommonAttentionMetadata.from_query_lens([q], [s], table, block_size=BS, causal=causal)


def close(a, b, tol=2e-5):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    err = np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-6)
    assert err < tol, err


@pytest.fixture(scope="module")
def target():
    cfg = registry.config_from_hf("llama", dict(G, num_hidden_layers=3))
    params = registry.init_params("llama", cfg, 3)
    return cfg, params


def tokens(seed, b=2, t=T):
    return jnp.asarray(np.random.default_rng(seed).integers(0, V, (b, t)), jnp.int32)


def test_decoder_forward_matches_paged(target):
    cfg, params = target
    ids = tokens(0)
    hid, aux = F.decoder_forward(params, cfg, ids, AUX)
    model = registry.make_model("llama", cfg, aux_layer_ids=AUX)
    for b in range(ids.shape[0]):
        caches = model.init_kv_caches(16, BS)
        h, a, _ = model.forward(params, ids[b], jnp.arange(T, dtype=jnp.int32), caches, md(T, T))
        close(hid[b], h)
        close(aux[b], a)


@pytest.mark.parametrize("kind", ["eagle", "eagle3", "eagle3_v033"])
def test_eagle_ttt_matches_a_real_chain(kind, target):
    """Step d of the unroll at position n + d equals the d-th draft step of a chain whose
    first pass covered positions 0..n, run with the paged inference model (``eagle3_v033``:
    vLLM v0.33's pre-fc norms and the normed output recycled)."""
    tcfg, tparams = target
    flags = {}
    if kind == "eagle3_v033":
        kind, flags = "eagle3", dict(norm_before_fc=True, fc_norm=True, norm_output=True)
    if kind == "eagle":
        cfg = registry.config_from_hf("eagle", dict(G, num_hidden_layers=2, bias=True))
    else:
        cfg = registry.config_from_hf("eagle3", dict(G, num_hidden_layers=2, target_hidden_size=H,
                                                     draft_vocab_size=V,
                                                     eagle_aux_hidden_state_layer_ids=list(AUX),
                                                     **flags))
    head = registry.make_model(kind, cfg)
    hp = share_target_weights(registry.init_params(kind, cfg, 5), tparams, kind=kind)
    x = tokens(1, b=1, t=T + 1)
    hid, aux = F.decoder_forward(tparams, tcfg, x, AUX)
    feats = (hid if kind == "eagle" else aux.reshape(1, T + 1, -1))[:, :-1]
    ids = x[:, 1:]                                               # EAGLE shift
    depth = 4
    outs = F.eagle_ttt(kind, hp, cfg, ids, feats, depth)
    for n in (0, 3, T - depth):
        caches = head.init_kv_caches(16, BS)
        pos = jnp.arange(n + 1, dtype=jnp.int32)
        g = feats[0, : n + 1]
        if kind == "eagle3":
            g = head.combine_hidden_states(hp, g)
        out, pre, caches = head.forward(hp, ids[0, : n + 1], pos, g, caches, md(n + 1, n + 1))
        close(outs[0][0][0, n], out[n])
        prev = pre[n]
        for d in range(1, depth):
            p = n + d
            if p >= T:
                break
            out, pre, caches = head.forward(hp, ids[0, p:p + 1], jnp.array([p], jnp.int32),
                                            prev[None], caches, md(1, p + 1))
            close(outs[d][0][0, p], out[0])
            # the model's second output is the recycled hidden: the pre-norm one, or the
            # normed output with norm_output (the unroll returns (normed, pre-norm))
            close(outs[d][0 if cfg.norm_output else 1][0, p], pre[0])
            prev = pre[0]


def test_dflash_blocks_match_inference(target):
    tcfg, tparams = target
    kb = 5
    cfg = registry.config_from_hf("dflash", dict(G, num_hidden_layers=2, target_hidden_size=H,
                                                 aux_hidden_state_layer_ids=list(AUX),
                                                 mask_token_id=V - 1, block_size=kb))
    head = registry.make_model("dflash", cfg)
    hp = share_target_weights(registry.init_params("dflash", cfg, 7), tparams)
    x = tokens(2, b=1, t=T)
    _, aux = F.decoder_forward(tparams, tcfg, x, AUX)
    aux = aux.reshape(1, T, -1)
    anchors = jnp.array([[1, 4, T - kb]], jnp.int32)
    lens = jnp.array([[kb, 2, 3]], jnp.int32)
    got = F.dflash_blocks(hp, cfg, aux, anchors, x[:, anchors[0]], lens)
    for m in range(anchors.shape[1]):
        p, ln = int(anchors[0, m]), int(lens[0, m])
        caches = head.init_kv_caches(16, BS)
        ctx = head.combine_hidden_states(hp, aux[0, :p])
        caches = head.precompute_and_store_context_kv(hp, ctx, jnp.arange(p, dtype=jnp.int32),
                                                      jnp.arange(p, dtype=jnp.int32), caches)
        ids = jnp.array([int(x[0, p])] + [cfg.mask_token_id] * (ln - 1), jnp.int32)
        h, _ = head.forward(hp, ids, jnp.arange(p, p + ln, dtype=jnp.int32), caches,
                            md(ln, p + ln, causal=False))
        close(got[0, m, :ln], h)


def test_medusa_forward_matches(target):
    _, tparams = target
    cfg = registry.config_from_hf("medusa", dict(num_heads=3, num_hidden_layers=2, hidden_size=H,
                                                 vocab_size=V, medusa_fc_bias=True))
    heads = registry.make_model("medusa", cfg)
    hp = registry.init_params("medusa", cfg, 9)
    h = jax.random.normal(jax.random.key(0), (2, 6, H))
    got = F.medusa_forward(hp, cfg, h)
    for b in range(2):
        close(got[:, b], heads.forward(hp, h[b]))


def test_ttt_masks_depth_pattern():
    m = F.ttt_masks(6, 2)
    # query at t=4, step 2: context keys s <= 2, step-1 key at s=3, step-2 key at s=4
    assert np.flatnonzero(m[0][0, 4]).tolist() == [0, 1, 2]
    assert np.flatnonzero(m[1][0, 4]).tolist() == [3]
    assert np.flatnonzero(m[2][0, 4]).tolist() == [4]


@pytest.mark.parametrize("hf", [dict(markov_head_type="rnn"),
                                dict(enable_confidence_head=True, confidence_head_with_markov=True,
                                     markov_head_type="gated")])
def test_dspark_markov_matches_the_inference_chain(hf):
    """The teacher-forced Markov logits equal what the inference chain computes when it
    drafts the true tokens (a chooser forcing them), slot by slot, state carried."""
    from specjax.models.dspark import markov_chain

    cfg = registry.config_from_hf("dspark", dict(G, num_hidden_layers=1, target_hidden_size=H,
                                                 aux_hidden_state_layer_ids=list(AUX),
                                                 mask_token_id=V - 1, markov_rank=6,
                                                 has_lm_head=True, **hf))
    p = registry.init_params("dspark", cfg, 5)
    rng = np.random.default_rng(0)
    n, s = 3, 5
    h = jnp.asarray(rng.standard_normal((n, s, H)), jnp.float32)
    truth = jnp.asarray(rng.integers(0, V, (n, s + 1)), jnp.int32)   # anchor, then the drafts
    z = registry.make_model("dspark", cfg).compute_draft_logits(p, h)
    _, logits, _ = markov_chain(p, cfg, z, h, truth[:, 0],
                                choose=lambda lg, i: (truth[:, i + 1], lg))
    got, _ = F.dspark_markov(p, cfg, h, truth[:, :-1])
    close(got, logits)

"""RoPE ``yarn``, ``longrope`` and ``dynamic`` against a NumPy oracle written from
transformers' ``modeling_rope_utils.py`` (float64): inverse frequencies, attention
factors, cos/sin below and above ``original_max_position_embeddings``, one forward of a
tiny Llama target and of an EAGLE-3 head, the per-request sequence-length rule, configs
(HF keys, transformers-v5 ``rope_parameters``, the gpt_oss default) and refusals by name.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import models_oracle as ora
from specjax.attention_metadata import CommonAttentionMetadata
from specjax.models import registry, rope, share_target_weights

GEO = dict(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
           rms_norm_eps=1e-5)
BS, NUM_BLOCKS, MAX_BLOCKS, B_PAD, T_PAD = 4, 24, 8, 2, 40


# -- the oracle (transformers' formulas, float64) -----------------------------------------


def oracle_freq(hd, theta, d, max_pos, seq_len):
    """``(inv_freq [hd/2], attention_factor)`` for a forward of ``seq_len`` tokens."""
    d = d or {}
    rtype = d.get("rope_type", d.get("type", "default"))
    expo = np.arange(0, hd, 2) / hd
    base = 1.0 / theta ** expo
    if rtype == "default":
        return base, 1.0
    if rtype == "yarn":
        factor, old = d["factor"], d["original_max_position_embeddings"]
        att = d.get("attention_factor")
        mget = lambda s, m=1: 1.0 if s <= 1 else 0.1 * m * math.log(s) + 1.0  # noqa: E731
        if att is None:
            att = (mget(factor, d["mscale"]) / mget(factor, d["mscale_all_dim"])
                   if d.get("mscale") and d.get("mscale_all_dim") else mget(factor))
        cdim = lambda r: hd * math.log(old / (r * 2 * math.pi)) / (2 * math.log(theta))  # noqa: E731
        low, high = cdim(d.get("beta_fast") or 32), cdim(d.get("beta_slow") or 1)
        if d.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, hd - 1)
        high = high + 0.001 if low == high else high
        ramp = np.clip((np.arange(hd // 2) - low) / (high - low), 0, 1)
        keep = 1 - ramp
        return base / factor * (1 - keep) + base * keep, att
    if rtype == "longrope":
        old = d["original_max_position_embeddings"]
        factor = d.get("factor") or max_pos / old
        att = d.get("attention_factor")
        if att is None:
            att = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(old))
        ext = np.asarray(d["long_factor"] if seq_len > old else d["short_factor"], np.float64)
        return 1.0 / (ext * theta ** expo), att
    if rtype == "dynamic":
        factor, s = d["factor"], max(seq_len, max_pos)
        b = theta * ((factor * s / max_pos) - (factor - 1)) ** (hd / (hd - 2))
        return 1.0 / b ** expo, 1.0
    raise AssertionError(rtype)


def oracle_cos_sin(cfg, pos, seq_len):
    f, att = oracle_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling_dict,
                         cfg.max_position_embeddings, seq_len)
    ang = np.asarray(pos, np.float64)[:, None] * f[None, :]
    emb = np.concatenate([ang, ang], -1)
    return np.cos(emb) * att, np.sin(emb) * att


HD = 8
CASES = {
    "yarn": dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16),
    "yarn_beta_notrunc": dict(rope_type="yarn", factor=8.0, original_max_position_embeddings=16,
                              beta_fast=16, beta_slow=2, truncate=False),
    "yarn_mscale": dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16,
                        mscale=0.707, mscale_all_dim=1.0),
    "yarn_attention_factor": dict(rope_type="yarn", factor=2.0, attention_factor=1.3,
                                  original_max_position_embeddings=16),
    "longrope": dict(rope_type="longrope", original_max_position_embeddings=16,
                     short_factor=[1.0, 1.1, 1.3, 1.9], long_factor=[1.2, 2.5, 4.0, 7.5]),
    "longrope_factor": dict(rope_type="longrope", original_max_position_embeddings=16, factor=3.0,
                            attention_factor=1.1, short_factor=[1, 1, 1, 1],
                            long_factor=[1.5, 2.0, 3.0, 4.0]),
    "dynamic": dict(rope_type="dynamic", factor=2.0),
    "dynamic_big": dict(rope_type="dynamic", factor=8.0),
}


def cfg_of(kind, scaling, **kw):
    """A tiny config; a longrope without ``factor`` gets 64 positions (factor 64/16 = 4)."""
    n_pos = 64 if scaling and "short_factor" in scaling and "factor" not in scaling else 16
    return registry.config_from_hf(kind, {**GEO, "num_hidden_layers": 1, "vocab_size": 64,
                                          "rope_theta": 10000.0, "max_position_embeddings": n_pos,
                                          "rope_scaling": scaling, **kw})


def close(got, want, tol=2e-5):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    err = float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))
    assert err < tol, f"relative error {err:.3g} >= {tol}"


@pytest.mark.parametrize("name", list(CASES))
def test_inv_freq_and_cos_sin_match_the_oracle(name):
    cfg = cfg_of("llama", CASES[name])
    assert cfg.rope_type == CASES[name]["rope_type"]
    for seq_len in (5, 16, 17, 40):                 # below, at and above the original length
        pos = np.arange(seq_len, dtype=np.int32)
        qsl = jnp.asarray([0, seq_len], jnp.int32)  # one request: HF's seq_len of the forward
        cos, sin = rope.cos_sin_for(cfg, jnp.asarray(pos), qsl)
        want_cos, want_sin = oracle_cos_sin(cfg, pos, seq_len)
        close(cos, want_cos, 1e-5)
        close(sin, want_sin, 1e-5)
    t = rope.tables(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings)
    f, att = oracle_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling_dict,
                         cfg.max_position_embeddings, 1)
    np.testing.assert_allclose(t.freq, f, rtol=2e-6)
    assert t.attention_factor == pytest.approx(att, rel=1e-12)
    if name.startswith("yarn") or name.startswith("longrope"):
        assert t.attention_factor != 1.0            # the factor is exercised


def test_yarn_large_geometry_and_gpt_oss_default():
    # gpt-oss: head_dim 64, theta 150000, factor 32, truncate false (float ramp ends)
    hf = dict(GEO, num_hidden_layers=1, vocab_size=64, head_dim=64, model_type="gpt_oss")
    cfg = registry.config_from_hf("eagle3", hf)
    d = cfg.rope_scaling_dict
    assert cfg.rope_theta == 150000.0 and d["rope_type"] == "yarn" and d["truncate"] is False
    assert (d["factor"], d["beta_fast"], d["beta_slow"], d["original_max_position_embeddings"]) == (
        32.0, 32.0, 1.0, 4096)
    for pos in (np.arange(0, 4096, 97), np.arange(4096, 20000, 613)):
        cos, sin = rope.cos_sin_for(cfg, jnp.asarray(pos, jnp.int32))
        wc, ws = oracle_cos_sin(cfg, pos, 1)
        np.testing.assert_allclose(np.asarray(cos), wc, atol=4e-3)   # float32 angles ~2e4 rad
        np.testing.assert_allclose(np.asarray(sin), ws, atol=4e-3)
    t = rope.tables(64, 150000.0, cfg.rope_scaling, cfg.max_position_embeddings)
    f, att = oracle_freq(64, 150000.0, d, cfg.max_position_embeddings, 1)
    np.testing.assert_allclose(t.freq, f, rtol=2e-6)
    assert t.attention_factor == pytest.approx(0.1 * math.log(32) + 1)
    # explicit rope keys win over the gpt_oss default; a round trip keeps the yarn dict
    assert registry.config_from_hf("eagle3", {**hf, "rope_scaling": None,
                                              "rope_theta": 5e5}).rope_theta == 5e5
    assert registry.config_from_hf("eagle3", registry.config_to_dict(cfg)) == cfg


def test_request_seq_lens_per_request_with_padding():
    pos = jnp.asarray([0, 1, 2, 30, 31, 7, 0, 0], jnp.int32)     # r0: 3, r1: 2, r2: 1, pad: 2
    qsl = jnp.asarray([0, 3, 5, 6, 6], jnp.int32)
    got = np.asarray(rope.request_seq_lens(pos, qsl))
    np.testing.assert_array_equal(got, [3, 3, 3, 32, 32, 8, 1, 1])
    np.testing.assert_array_equal(np.asarray(rope.request_seq_lens(pos, None)), np.asarray(pos) + 1)


def test_longrope_and_dynamic_choose_per_request():
    """Two requests in one step: each gets the frequencies of its own seq_len."""
    for name in ("longrope", "dynamic"):
        cfg = cfg_of("llama", CASES[name])
        pos = np.concatenate([np.arange(20), np.arange(8, 12)]).astype(np.int32)
        qsl = jnp.asarray([0, 20, 24], jnp.int32)
        cos, _ = rope.cos_sin_for(cfg, jnp.asarray(pos), qsl)
        close(np.asarray(cos)[:20], oracle_cos_sin(cfg, pos[:20], 20)[0], 1e-5)
        close(np.asarray(cos)[20:], oracle_cos_sin(cfg, pos[20:], 12)[0], 1e-5)
        long_, _ = oracle_cos_sin(cfg, pos[20:], 20)
        assert np.max(np.abs(np.asarray(cos)[20:] - long_)) > 1e-3   # the rule matters here


def _meta(qlens, table):
    return CommonAttentionMetadata.from_query_lens(
        qlens, qlens, table, block_size=BS, num_reqs_pad=B_PAD, num_tokens_pad=T_PAD,
        max_query_len=32, causal=True)


def _patch_oracle(monkeypatch, cfg):
    """models_oracle's rope -> this file's oracle, ``seq_len = max(pos) + 1`` (HF's rule
    for a forward over one whole sequence)."""
    monkeypatch.setattr(ora, "inv_freq", lambda hd, theta, scaling: None)

    def _rope(x, pos, _freq):
        c, s = oracle_cos_sin(cfg, pos, int(np.max(pos)) + 1)
        h = x.shape[-1] // 2
        rot = np.concatenate([-x[..., h:], x[..., :h]], -1)
        return x * c[:, None, :] + rot * s[:, None, :]

    monkeypatch.setattr(ora, "rope", _rope)


def _geo(cfg):
    return ora.Geo(nh=cfg.num_attention_heads, nkv=cfg.num_key_value_heads, hd=cfg.head_dim,
                   eps=cfg.rms_norm_eps, theta=cfg.rope_theta, scaling=cfg.rope_scaling_dict)


LENS = (22, 9)      # one request past original_max_position_embeddings (16), one below


def _batch(seqs):
    ids = np.zeros(T_PAD, np.int32)
    pos = np.zeros(T_PAD, np.int32)
    ids[: sum(LENS)] = np.concatenate(seqs)
    pos[: sum(LENS)] = np.concatenate([np.arange(n) for n in LENS])
    table = np.arange(B_PAD * MAX_BLOCKS, dtype=np.int32).reshape(B_PAD, MAX_BLOCKS)
    return jnp.asarray(ids), jnp.asarray(pos), _meta(list(LENS), table)


@pytest.mark.parametrize("name", ["yarn", "yarn_mscale", "longrope", "dynamic"])
def test_llama_forward_matches_oracle(name, monkeypatch):
    cfg = cfg_of("llama", CASES[name], num_hidden_layers=2)
    tensors = registry.random_tensors("llama", cfg, seed=3)
    params = registry.params_from_tensors("llama", cfg, tensors)
    model = registry.make_model("llama", cfg)
    rng = np.random.default_rng(4)
    seqs = [rng.integers(0, cfg.vocab_size, size=n).astype(np.int32) for n in LENS]
    ids, pos, md = _batch(seqs)
    hidden, _, _ = jax.jit(model.forward)(params, ids, pos, model.init_kv_caches(NUM_BLOCKS, BS), md)
    _patch_oracle(monkeypatch, cfg)
    off = 0
    for r, s in enumerate(seqs):
        want, _, _ = ora.decoder(tensors, _geo(cfg), s, cfg.num_hidden_layers, cfg.qk_norm,
                                 cfg.tie_word_embeddings)
        close(np.asarray(hidden)[off: off + len(s)], want, 1e-4)
        off += len(s)


@pytest.mark.parametrize("name", ["yarn", "longrope_factor", "dynamic_big"])
def test_eagle3_forward_matches_oracle(name, monkeypatch):
    cfg = cfg_of("eagle3", CASES[name], target_hidden_size=24)
    tensors = registry.random_tensors("eagle3", cfg, seed=8)
    rng = np.random.default_rng(11)
    emb = rng.standard_normal((cfg.vocab_size, cfg.hidden_size)).astype(np.float32)
    params = share_target_weights(registry.params_from_tensors("eagle3", cfg, tensors),
                                  {"embed_tokens": {"embedding": jnp.asarray(emb)}})
    model = registry.make_model("eagle3", cfg)
    seqs = [rng.integers(0, cfg.vocab_size, size=n).astype(np.int32) for n in LENS]
    aux = [rng.standard_normal((n, 3 * 24)).astype(np.float32) for n in LENS]
    ids, pos, md = _batch(seqs)
    a = np.zeros((T_PAD, 3 * 24), np.float32)
    a[: sum(LENS)] = np.concatenate(aux)
    normed, _, _ = jax.jit(model.forward)(params, ids, pos, jnp.asarray(a),
                                 model.init_kv_caches(NUM_BLOCKS, BS), md)
    _patch_oracle(monkeypatch, cfg)
    off = 0
    for r, s in enumerate(seqs):
        want = ora.eagle3(tensors, _geo(cfg), emb.astype(np.float64), s, aux[r].astype(np.float64),
                          cfg.num_hidden_layers, cfg.norm_before_residual, cfg.qk_norm,
                          norm_before_fc=cfg.norm_before_fc, fc_norm=cfg.fc_norm)[0]
        close(np.asarray(normed)[off: off + len(s)], want, 1e-4)
        off += len(s)


def test_config_forms_and_round_trip():
    base = dict(GEO, num_hidden_layers=1, vocab_size=64, max_position_embeddings=64)
    v5 = registry.config_from_hf("llama", dict(base, rope_parameters=dict(
        rope_type="yarn", rope_theta=5e5, factor=4.0, original_max_position_embeddings=16)))
    old = registry.config_from_hf("llama", dict(base, rope_theta=5e5, rope_scaling=dict(
        type="yarn", factor=4.0, original_max_position_embeddings=16)))
    assert v5 == old and v5.rope_type == "yarn" and v5.rope_theta == 5e5
    # original_max_position_embeddings defaults as transformers' standardize_rope_params
    c = registry.config_from_hf("llama", dict(base, rope_scaling=dict(rope_type="yarn", factor=2.0)))
    assert c.rope_scaling_dict["original_max_position_embeddings"] == 64
    c = registry.config_from_hf("llama", dict(base, original_max_position_embeddings=32,
                                              rope_scaling=dict(CASES["longrope"])))
    assert c.rope_scaling_dict["original_max_position_embeddings"] == 16
    for case in CASES.values():
        c = registry.config_from_hf("llama", dict(base, rope_scaling=dict(case)))
        assert registry.config_from_hf("llama", registry.config_to_dict(c)) == c
    with pytest.raises(ValueError, match="rope.cos_sin_for"):
        rope.inv_freq(HD, 1e4, c.rope_scaling)


@pytest.mark.parametrize("scaling, exc, match", [
    (dict(rope_type="yarn"), ValueError, "needs 'factor'"),
    (dict(rope_type="yarn", factor=None), ValueError, "needs 'factor'"),
    (dict(rope_type="dynamic"), ValueError, "needs 'factor'"),
    (dict(rope_type="yarn", factor=4.0, truncate="no"), TypeError, "truncate"),
    (dict(rope_type="yarn", factor=4.0, beta_fast="32"), TypeError, "beta_fast"),
    (dict(rope_type="longrope", long_factor=[1.0] * 4), ValueError, "short_factor"),
    (dict(rope_type="longrope", short_factor=[1.0] * 3, long_factor=[1.0] * 4), ValueError,
     "short_factor must hold head_dim/2=4"),
    (dict(rope_type="longrope", short_factor=[1.0] * 4, long_factor=[1.0] * 8), ValueError,
     "long_factor must hold head_dim/2=4"),
    (dict(rope_type="longrope", short_factor=1.0, long_factor=[1.0] * 4), TypeError,
     "short_factor must be a list"),
    (dict(rope_type="mrope", mrope_section=[1, 1, 2]), ValueError, "M-RoPE"),
    (dict(rope_type="default", mrope_section=[1, 1, 2]), ValueError, "mrope_section"),
    (dict(type="mrope"), ValueError, "M-RoPE"),
    (dict(rope_type="su", factor=2.0), ValueError, "rope_type"),
])
def test_bad_rope_keys_refused_by_name(scaling, exc, match):
    with pytest.raises(exc, match=match):
        cfg_of("llama", scaling)
    with pytest.raises(exc, match=match):       # the same through rope_parameters (v5)
        registry.config_from_hf("eagle3", dict(GEO, num_hidden_layers=1, vocab_size=64,
                                               rope_parameters=dict(scaling, rope_theta=1e4)))

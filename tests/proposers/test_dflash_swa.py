"""DFlash drafts with sliding-window layers, per-layer causality and attention sinks.

(a) the head's paged forward against a NumPy oracle written from the spec (dense attention,
explicit per-layer masks over context + block); (b) the proposer: its drafts over a context
fed in two calls equal the oracle's, and greedy speculative decoding with such a draft
emits plain greedy's tokens; (c) config parsing as vLLM 0.34's ``qwen3_dflash.py``
(``_resolve_layer_attention``, ``_dflash_layer_causal``) resolves it.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.attention_metadata import CommonAttentionMetadata
from specjax.config import SpeculativeConfig
from specjax.engine import LoopOptions, SamplingParams, TargetModel, generate
from specjax.models import registry, share_target_weights
from specjax.models.hf_config import config_from_hf, config_to_dict
from specjax.proposers import make_proposer
from specjax.proposers.dflash import DFlashProposer
from specjax.proposers.types import ProposerInputs

V, HT, BS = 64, 24, 4
GEO = dict(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
           head_dim=8, rms_norm_eps=1e-5, rope_theta=10000.0, vocab_size=V,
           target_hidden_size=HT, aux_hidden_state_layer_ids=[1, 2], mask_token_id=V - 1)
SW, FA = "sliding_attention", "full_attention"
HEADS = {
    # z-lab mixed layers: causal exactly on the sliding ones (vLLM's default), sinks
    "mixed": dict(GEO, num_hidden_layers=3, layer_types=[SW, FA, SW],
                  dflash_config=dict(swa_window_size=8, attention_sink_bias=True)),
    # use_swa: every layer sliding, non-causal (MiMo-style)
    "use_swa": dict(GEO, num_hidden_layers=2, dflash_config=dict(use_swa=True,
                                                                 swa_window_size=12)),
    # is_causal overrides: every layer causal, windows on layers >= max_window_layers
    "is_causal": dict(GEO, num_hidden_layers=2, is_causal=True, use_sliding_window=True,
                      sliding_window=8, max_window_layers=1, add_swa_attention_sink_bias=True),
}


def _target_weights(seed=0):
    rng = np.random.default_rng(seed)
    return {"embed_tokens": {"embedding": jnp.asarray(rng.standard_normal((V, 32)), jnp.float32)},
            "lm_head": {"kernel": jnp.asarray(rng.standard_normal((32, V)) / 6, jnp.float32)}}


@functools.lru_cache(maxsize=None)
def head(name):
    """``(cfg, model, params)``: every weight random (norms and sinks too)."""
    cfg = config_from_hf("dflash", HEADS[name])
    own = registry.init_params("dflash", cfg, 1)
    rng = np.random.default_rng(2)
    own = jax.tree.map(lambda x: jnp.asarray(x + 0.3 * rng.standard_normal(x.shape), x.dtype), own)
    return cfg, registry.make_model("dflash", cfg), share_target_weights(own, _target_weights(),
                                                                  kind="dflash")


# --- (a) the NumPy oracle --------------------------------------------------------------


def _rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * w


def _rope(x, pos, theta):
    hd = x.shape[-1]
    ang = pos[:, None] * theta ** (-np.arange(0, hd, 2) / hd)[None, :]
    cos, sin = np.cos(np.concatenate([ang, ang], -1)), np.sin(np.concatenate([ang, ang], -1))
    x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
    return x * cos[:, None] + np.concatenate([-x2, x1], -1) * sin[:, None]


def oracle_hidden(cfg, params, aux, ids, L):
    """One request: ``aux [L, n_aux*Ht]`` context at positions 0..L-1, block ``ids [q]`` at
    L..L+q-1 -> post-norm hidden ``[q, H]``. Layer i: keys ``kpos > qpos - window`` when
    sliding, ``kpos <= qpos`` when causal; a sink logit per head in the softmax."""
    p = jax.tree.map(np.asarray, params)
    nh, nkv, hd, eps = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps
    ctx = _rms(aux @ p["fc"]["kernel"], p["hidden_norm"]["weight"], eps)
    x = p["embed_tokens"]["embedding"][ids]
    q_len = len(ids)
    qpos = L + np.arange(q_len)
    kpos = np.arange(L + q_len)
    for i in range(cfg.num_hidden_layers):
        lp = p["layers"][i]
        a = lp["self_attn"]
        u = _rms(x, lp["input_layernorm"]["weight"], eps)
        src = np.concatenate([ctx, u])
        q = _rope(_rms((u @ a["q_proj"]["kernel"]).reshape(q_len, nh, hd), a["q_norm"]["weight"], eps),
                  qpos, cfg.rope_theta)
        k = _rope(_rms((src @ a["k_proj"]["kernel"]).reshape(-1, nkv, hd), a["k_norm"]["weight"], eps),
                  kpos, cfg.rope_theta)
        v = (src @ a["v_proj"]["kernel"]).reshape(-1, nkv, hd)
        mask = np.ones((q_len, len(kpos)), bool)
        if cfg.layer_window(i) is not None:
            mask &= kpos[None] > qpos[:, None] - cfg.layer_window(i)
        if cfg.layer_causal(i):
            mask &= kpos[None] <= qpos[:, None]
        out = np.zeros((q_len, nh, hd))
        for h in range(nh):
            g = h // (nh // nkv)
            s = np.where(mask, q[:, h] @ k[:, g].T * hd ** -0.5, -np.inf)
            sink = a["sinks"][h] if cfg.attention_sinks else -np.inf
            m = np.maximum(s.max(-1), sink)
            e = np.exp(s - m[:, None])
            out[:, h] = (e @ v[:, g]) / (e.sum(-1) + np.exp(sink - m))[:, None]
        x = x + out.reshape(q_len, nh * hd) @ a["o_proj"]["kernel"]
        mp = lp["mlp"]
        hm = _rms(x, lp["post_attention_layernorm"]["weight"], eps)
        gate = hm @ mp["gate_proj"]["kernel"]
        x = x + (gate / (1 + np.exp(-gate)) * (hm @ mp["up_proj"]["kernel"])) @ mp["down_proj"]["kernel"]
    return _rms(x, p["norm"]["weight"], eps)


def _paged_forward(model, params, reqs, table, q_len):
    """Every request's context K/V stored through its block table, then one forward of all
    blocks (non-causal metadata: the head sets each layer's causality)."""
    caches = model.init_kv_caches(int(table.max()) + 1, BS)
    for r, (aux, _, L) in enumerate(reqs):
        pos = np.arange(L)
        slots = table[r, pos // BS] * BS + pos % BS
        caches = model.precompute_and_store_context_kv(
            params, model.combine_hidden_states(params, jnp.asarray(aux)), jnp.asarray(pos, jnp.int32),
            jnp.asarray(slots, jnp.int32), caches)
    md = CommonAttentionMetadata.from_query_lens([q_len] * len(reqs), [L + q_len for *_, L in reqs],
                                                 table, block_size=BS, causal=False)
    ids = np.concatenate([b for _, b, _ in reqs]).astype(np.int32)
    pos = np.concatenate([L + np.arange(q_len) for *_, L in reqs]).astype(np.int32)
    hidden, _ = model.forward(params, jnp.asarray(ids), jnp.asarray(pos), caches, md)
    return np.asarray(hidden)


@pytest.mark.parametrize("name", list(HEADS))
def test_paged_forward_matches_oracle(name):
    cfg, model, params = head(name)
    assert cfg.sliding_window in (8, 12)
    rng = np.random.default_rng(0)
    q_len = 5
    reqs = []
    for L in (21, 6, 14):                        # windows shorter than context + block
        ids = np.r_[rng.integers(0, V - 1), np.full(q_len - 1, V - 1)]
        reqs.append((rng.standard_normal((L, cfg.num_aux * HT)).astype(np.float32), ids, L))
    table = rng.permutation(24)[:24].reshape(3, 8)   # 32-token rows: blocks in any order
    got = _paged_forward(model, params, reqs, table, q_len)
    for r, (aux, ids, L) in enumerate(reqs):
        want = oracle_hidden(cfg, params, aux.astype(np.float64), ids, L)
        np.testing.assert_allclose(got[r * q_len:(r + 1) * q_len], want, atol=2e-5, rtol=1e-5)


def test_oracle_sees_the_window_and_causality():
    """The oracle's masks bind: dropping the window or the causality changes the output."""
    cfg, _, params = head("mixed")
    rng = np.random.default_rng(1)
    aux, ids = rng.standard_normal((21, cfg.num_aux * HT)), np.r_[3, np.full(4, V - 1)]
    base = oracle_hidden(cfg, params, aux, ids, 21)
    for change in (dict(sliding_window=0, layer_types=None), dict(causal_layers=None)):
        assert np.abs(oracle_hidden(cfg.replace(**change), params, aux, ids, 21) - base).max() > 1e-3


# --- (b) the proposer ------------------------------------------------------------------


def test_proposer_drafts_match_oracle_across_calls():
    """Context fed in two calls (the second with rejected junk): the drafts are the
    oracle's argmax over the accepted context, window and causality per layer."""
    cfg, model, params = head("mixed")
    k, nb, width, b_pad, t_pad = 4, 40, 10, 2, 48
    prop = DFlashProposer(SpeculativeConfig(method="dflash", num_speculative_tokens=k), model,
                          block_size=BS, max_model_len=width * BS, kernel_backend="xla")
    rng = np.random.default_rng(3)
    lens, split, rej = [23, 9], [15, 4], [2, 1]
    aux = [rng.standard_normal((L, cfg.num_aux, HT)).astype(np.float32) for L in lens]
    nxt = [7, 11]
    table = rng.permutation(nb)[: 2 * width].reshape(2, width)
    state = prop.init_state(nb)

    def call(lo_hi, junk):
        pos, a, ql, sl = [], [], [], []
        for r, (lo, hi) in enumerate(lo_hi):
            j = rej[r] if junk else 0
            pos += list(range(lo, hi + j))
            a += list(aux[r][lo:hi]) + list(rng.standard_normal((j, cfg.num_aux, HT)).astype(np.float32))
            ql.append(hi - lo + j)
            sl.append(hi + j)
        t = len(pos)
        md = CommonAttentionMetadata.from_query_lens(ql, sl, table, block_size=BS, num_reqs_pad=b_pad,
                                                     num_tokens_pad=t_pad, max_query_len=t_pad)
        pad = lambda x: np.concatenate([np.asarray(x), np.zeros((t_pad - t,) + np.shape(x)[1:], np.asarray(x).dtype)])  # noqa: E731
        return ProposerInputs(
            target_token_ids=jnp.zeros(t_pad, jnp.int32), target_positions=jnp.asarray(pad(np.int32(pos))),
            target_hidden_states=None, aux_hidden_states=jnp.asarray(pad(np.stack(a))),
            next_token_ids=jnp.asarray(nxt, jnp.int32), token_indices_to_sample=None,
            num_rejected_tokens=jnp.asarray(rej, jnp.int32) if junk else None,
            attn_metadata=md)

    _, state = prop.propose(params, state, call([(0, s) for s in split], False))
    out, _ = prop.propose(params, state, call([(s, L) for s, L in zip(split, lens)], True))
    head_w = np.asarray(params["lm_head"]["kernel"])
    for r, L in enumerate(lens):
        ids = np.r_[nxt[r], np.full(k, V - 1)]
        h = oracle_hidden(cfg, params, aux[r].reshape(L, -1).astype(np.float64), ids, L)
        np.testing.assert_array_equal(np.asarray(out.token_ids)[r], (h[1:] @ head_w).argmax(-1))


@functools.lru_cache(maxsize=None)
def _target():
    cfg = registry.config_from_hf("llama", dict(
        hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
        rms_norm_eps=1e-5, vocab_size=V, num_hidden_layers=3))
    return TargetModel(registry.make_model("llama", cfg), registry.init_params("llama", cfg, 0))


@pytest.mark.parametrize("name", ["mixed", "use_swa"])
def test_greedy_speculative_equals_greedy(name):
    mml, bs = 64, 8
    fixed = dict(max_model_len=mml, block_size=bs, num_blocks=1 + 3 * (mml // bs),
                 options=LoopOptions(batch_buckets=(4,), query_buckets=(16,),
                                     context_buckets=(mml // bs,), token_buckets=(64,)))
    tgt = _target()
    rng = np.random.default_rng(5)
    prompts = [list(rng.integers(0, V, n)) for n in (17, 5, 30)]
    params = [SamplingParams(max_tokens=m) for m in (30, 20, 25)]
    dcfg = config_from_hf("dflash", dict(HEADS[name], aux_hidden_state_layer_ids=[0, 1],
                                         target_hidden_size=32))
    prop = make_proposer(SpeculativeConfig(method="dflash", num_speculative_tokens=3), draft=dcfg,
                         draft_params=registry.init_params("dflash", dcfg, 1), target=tgt.model,
                         target_params=tgt.params, max_model_len=mml, block_size=bs,
                         kernel_backend="xla")
    want = generate(tgt, None, prompts, params, **fixed)
    got = generate(tgt, prop, prompts, params, **fixed)
    assert [o.token_ids for o in got.outputs] == [o.token_ids for o in want.outputs]


# --- (c) config parsing ----------------------------------------------------------------

BASE = dict(GEO, num_hidden_layers=3)


def _cfg(**kw):
    return config_from_hf("dflash", dict(BASE, **kw))


def _attn(c):
    return ([c.layer_window(i) for i in range(c.num_hidden_layers)],
            [c.layer_causal(i) for i in range(c.num_hidden_layers)], c.attention_sinks)


MIXED = [SW, FA, SW]


@pytest.mark.parametrize("kw, windows, causal", [
    # plain z-lab: all full, non-causal
    (dict(), [None] * 3, [False] * 3),
    # layer_types: sliding layers causal by default; window from sliding_window
    (dict(layer_types=MIXED, use_sliding_window=True, sliding_window=8), [8, None, 8],
     [True, False, True]),
    # swa_window_size overrides sliding_window
    (dict(layer_types=MIXED, use_sliding_window=True, sliding_window=8,
          dflash_config=dict(swa_window_size=12)), [12, None, 12], [True, False, True]),
    # Qwen3Config drops sliding_window without use_sliding_window; swa_window_size stays
    (dict(layer_types=MIXED, sliding_window=8, dflash_config=dict(swa_window_size=6)),
     [6, None, 6], [True, False, True]),
    # no layer_types: Qwen3Config fills them from max_window_layers
    (dict(use_sliding_window=True, sliding_window=8, max_window_layers=2), [None, None, 8],
     [False, False, True]),
    # use_swa: every layer sliding (also over an all-full layer_types), non-causal
    (dict(dflash_config=dict(use_swa=True, swa_window_size=8)), [8] * 3, [False] * 3),
    (dict(layer_types=[FA] * 3, dflash_config=dict(use_swa=True, swa_window_size=8)), [8] * 3,
     [False] * 3),
    # use_swa with sliding entries in layer_types: layer_types decides
    (dict(layer_types=MIXED, dflash_config=dict(use_swa=True, swa_window_size=8)),
     [8, None, 8], [True, False, True]),
    # dflash_config.causal overrides the default, is_causal overrides dflash_config.causal
    (dict(layer_types=MIXED, dflash_config=dict(swa_window_size=8, causal=False)),
     [8, None, 8], [False] * 3),
    (dict(layer_types=MIXED, is_causal=True, dflash_config=dict(swa_window_size=8, causal=False)),
     [8, None, 8], [True] * 3),
    (dict(is_causal=False, dflash_config=dict(causal=True)), [None] * 3, [False] * 3),
    # speculators: causal = not sliding_window_non_causal (default true: non-causal)
    (dict(speculators_model_type="dflash", transformer_layer_config=dict(
        layer_types=MIXED, use_sliding_window=True, sliding_window=8)), [8, None, 8], [False] * 3),
    (dict(speculators_model_type="dflash", sliding_window_non_causal=False), [None] * 3,
     [True] * 3),
    # a non-Qwen config class keeps a bare sliding_window
    (dict(model_type="llama", layer_types=MIXED, sliding_window=8), [8, None, 8],
     [True, False, True]),
])
def test_layer_attention_precedence(kw, windows, causal):
    c = _cfg(**kw)
    got_w, got_c, _ = _attn(c)
    assert (got_w, got_c) == (windows, causal)
    assert config_from_hf("dflash", config_to_dict(c)) == c


@pytest.mark.parametrize("kw, sinks", [
    (dict(), False),
    (dict(dflash_config=dict(attention_sink_bias=True)), True),
    (dict(add_swa_attention_sink_bias=True), True),
    (dict(add_swa_attention_sink_bias=True, dflash_config=dict(attention_sink_bias=False)), False),
])
def test_attention_sink_bias(kw, sinks):
    c = _cfg(**kw)
    assert c.attention_sinks is sinks
    assert config_from_hf("dflash", config_to_dict(c)) == c


@pytest.mark.parametrize("kw, match", [
    (dict(layer_types=MIXED), "layer_types makes .* no window"),
    (dict(layer_types=MIXED, sliding_window=8), "layer_types .* use_sliding_window"),
    (dict(dflash_config=dict(use_swa=True)), "dflash_config.use_swa makes .* no window"),
    (dict(dflash_config=dict(attention_value_scale=0.707)), "dflash_config.attention_value_scale"),
    (dict(attention_value_scale=0.5), "attention_value_scale"),
    (dict(dflash_config=dict(use_swa="yes")), "dflash_config.use_swa"),
    (dict(dflash_config=dict(causal=1)), "dflash_config.causal"),
    (dict(is_causal="true"), "is_causal"),
    (dict(dflash_config=dict(use_swa=True, swa_window_size=0)), "swa_window_size"),
    (dict(layer_types=[SW, FA]), "layer_types"),
    (dict(attention_sink_bias=True), "attention_sink_bias"),
    (dict(block_size=16, dflash_config=dict(use_swa=True, swa_window_size=8)),
     "sliding_window=8 < block_size=16 on a non-causal DFlash layer"),
])
def test_refusals_name_the_key(kw, match):
    with pytest.raises(ValueError, match=match):
        _cfg(**kw)


def test_value_scale_one_is_accepted():
    assert _cfg(dflash_config=dict(attention_value_scale=1.0)) == _cfg()

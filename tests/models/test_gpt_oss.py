"""The gpt-oss target (kind ``gpt_oss``): its MoE block against a NumPy loop oracle written
from the spec (biased router, top-k then softmax, clamped SwiGLU on interleaved gate/up,
expert biases), its config reader, and the model against its transformers fixture
(tests/support/fixtures/MANIFEST.md): fp32 logits through the paged cache with sinks,
alternating windows and YaRN, greedy generation, and as the target of EAGLE-3 and of a draft
model (greedy speculative == plain greedy).
"""

from __future__ import annotations

import suite_paths  # tests/support: where the suite's pieces are
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

import specjax
import test_sliding_targets as st
from specjax.engine import SamplingParams, generate
from specjax.models import params as mp, registry
from specjax.models.config import ModelConfig
from specjax.models.gpt_oss import GptOssMLP, GptOssRMSNorm

NAME = "gpt_oss"
HF = dict(model_type="gpt_oss", vocab_size=128, hidden_size=64, intermediate_size=32,
          num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
          num_local_experts=8, num_experts_per_tok=2, sliding_window=5, swiglu_limit=7.0)
#: openai/gpt-oss-20b's config.json (copied; shared/research/heads_and_targets_2026-12.md 3.2)
GPT_OSS_20B = dict(
    architectures=["GptOssForCausalLM"], attention_bias=True, attention_dropout=0.0,
    eos_token_id=200002, experts_per_token=4, head_dim=64, hidden_act="silu", hidden_size=2880,
    initial_context_length=4096, initializer_range=0.02, intermediate_size=2880,
    layer_types=["sliding_attention", "full_attention"] * 12, max_position_embeddings=131072,
    model_type="gpt_oss", num_attention_heads=64, num_experts_per_tok=4, num_hidden_layers=24,
    num_key_value_heads=8, num_local_experts=32, output_router_logits=False,
    pad_token_id=199999, rms_norm_eps=1e-05, rope_scaling={
        "beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
        "original_max_position_embeddings": 4096, "rope_type": "yarn", "truncate": False},
    rope_theta=150000, router_aux_loss_coef=0.9, sliding_window=128, swiglu_limit=7.0,
    tie_word_embeddings=False, use_cache=True, vocab_size=201088)

needs_fixture = pytest.mark.skipif(not (st.FIX / NAME / "reference.npz").exists(),
                                   reason="fixtures not generated")


# --- the MoE block -------------------------------------------------------------------


def oracle(x, wr, br, gu, bgu, dn, bdn, k, limit, counts=None):
    """Per token: top-k of ``x wr + br``, softmax over those k; per selected expert e:
    ``gate, up = (x gu[e] + bgu[e])`` even / odd columns, ``gate <= limit``,
    ``|up| <= limit`` (limit 0: none), ``((up + 1) gate sigmoid(1.702 gate)) dn[e] + bdn[e]``."""
    out = np.zeros_like(x, np.float64)
    for t in range(x.shape[0]):
        z = x[t] @ wr + br
        sel = np.argsort(-z, kind="stable")[:k]
        w = np.exp(z[sel] - z[sel].max())
        w /= w.sum()
        for wj, e in zip(w, sel):
            a = x[t] @ gu[e] + bgu[e]
            gate, up = a[0::2], a[1::2]
            if limit:
                if counts is not None:
                    counts.append(int((gate > limit).sum() + (np.abs(up) > limit).sum()))
                gate, up = np.minimum(gate, limit), np.clip(up, -limit, limit)
            y = (up + 1) * gate / (1 + np.exp(-1.702 * gate))
            out[t] += wj * (y @ dn[e] + bdn[e])
    return out


def block_config(limit: float) -> ModelConfig:
    return registry.config_from_hf(NAME, dict(HF, hidden_size=16, intermediate_size=8,
                                              num_local_experts=6, num_experts_per_tok=3,
                                              num_attention_heads=2, num_key_value_heads=1,
                                              head_dim=8)).replace(swiglu_limit=limit)


@pytest.mark.parametrize("limit", (7.0, 0.0))
def test_mlp_matches_loop_oracle(limit):
    c = block_config(limit)
    h, i, e, k, t = 16, 8, 6, 3, 11
    rng = np.random.default_rng(0)
    arrs = dict(wr=rng.standard_normal((h, e)), br=rng.standard_normal(e),
                gu=4 * rng.standard_normal((e, h, 2 * i)) / np.sqrt(h),
                bgu=rng.standard_normal((e, 2 * i)), dn=rng.standard_normal((e, i, h)) / 8,
                bdn=rng.standard_normal((e, h)))
    x = rng.standard_normal((t, h))
    counts: list[int] = []
    want = oracle(x, *arrs.values(), k, limit, counts)
    if limit:
        assert sum(counts) > 10                         # the clamp binds
    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    params = {"router": {"kernel": f32(arrs["wr"]), "bias": f32(arrs["br"])},
              "experts": {"gate_up": f32(arrs["gu"]), "gate_up_bias": f32(arrs["bgu"]),
                          "down": f32(arrs["dn"]), "down_bias": f32(arrs["bdn"])}}
    got = jax.jit(lambda p, x: mp.merge(GptOssMLP, (c,), p)(x))(params, f32(x))
    assert st.relerr(got, want) < 1e-5


def test_rmsnorm_multiplies_the_weight_in_float32():
    """bf16 input: ``cast(w * y)`` with w and y in float32 (Llama casts y first)."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((5, 32)), jnp.bfloat16)
    w = 1 + 0.3 * rng.standard_normal(32).astype(np.float32)
    x32 = np.asarray(x, np.float32)
    y = x32 / np.sqrt(np.mean(x32 * x32, -1, keepdims=True) + 1e-5)
    want = jnp.asarray(w * y, jnp.float32).astype(jnp.bfloat16)
    norm = GptOssRMSNorm(32, 1e-5)
    norm.weight = nnx.Param(jnp.asarray(w))
    got = norm(x)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


# --- config --------------------------------------------------------------------------


def test_config_reads_gpt_oss_20b():
    c = registry.config_from_hf(NAME, GPT_OSS_20B)
    assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size) == (32, 4, 2880)
    assert (c.head_dim, c.sliding_window, c.swiglu_limit) == (64, 128, 7.0)
    assert c.attention_sinks and c.qkv_bias and c.o_bias and not c.tie_word_embeddings
    assert [c.layer_window(i) for i in range(4)] == [128, None, 128, None]
    assert all(c.layer_sparse(i) for i in range(24))
    sc = c.rope_scaling_dict
    assert c.rope_theta == 150000 and sc["rope_type"] == "yarn" and sc["factor"] == 32
    assert sc["truncate"] is False and sc["original_max_position_embeddings"] == 4096
    assert registry.config_from_hf(NAME, registry.config_to_dict(c)) == c
    keys = registry.expected_tensors(NAME, c)
    assert keys["model.layers.0.mlp.experts.gate_up_proj"] == ((32, 2880, 5760), True)
    assert keys["model.layers.0.mlp.experts.down_proj"] == ((32, 2880, 2880), True)
    assert keys["model.layers.0.self_attn.sinks"] == ((64,), True)
    assert keys["model.layers.0.mlp.router.bias"] == ((32,), True)
    assert not any(".mlp.gate_proj" in k or ".mlp.up_proj" in k for k in keys)


def test_config_class_defaults_and_round_trips():
    """Absent keys take GptOssConfig's defaults: layer i slides iff i is even, window 128,
    head_dim 64, YaRN (factor 32) with theta 150000, biases on."""
    bare = {k: v for k, v in HF.items() if k not in ("sliding_window", "head_dim")}
    c = registry.config_from_hf(NAME, bare)
    assert c.layer_types == ("sliding_attention", "full_attention") * 2
    assert (c.sliding_window, c.head_dim, c.rope_theta) == (128, 64, 150000.0)
    assert c.rope_type == "yarn" and c.rope_scaling_dict["factor"] == 32 and c.qkv_bias
    assert registry.config_from_hf(NAME, dict(bare, experts_per_token=2)) == c
    alias = {k: v for k, v in bare.items() if k != "num_local_experts"}
    assert registry.config_from_hf(NAME, dict(alias, num_experts=8)) == c
    full = dict(HF, sliding_window=None, layer_types=["full_attention"] * 4,
                rope_scaling={"rope_type": "default"}, attention_bias=False)
    variants = [c, registry.config_from_hf(NAME, full),
                registry.config_from_hf(NAME, dict(HF, tie_word_embeddings=True,
                                                   num_experts=8, router_aux_loss_coef=0.9,
                                                   output_router_logits=True))]
    assert variants[1].sliding_window == 0 and variants[1].rope_scaling is None
    assert not variants[1].qkv_bias and not variants[1].o_bias
    for v in variants:
        assert registry.config_from_hf(NAME, json.loads(json.dumps(
            registry.config_to_dict(v)))) == v


@pytest.mark.parametrize("change", [
    dict(swiglu_limit=5.0), dict(swiglu_alpha=2.0), dict(experts_per_token=3),
    dict(n_shared_experts=1), dict(mlp_only_layers=[1]), dict(decoder_sparse_step=2),
    dict(moe_intermediate_size=16), dict(sliding_window=None), dict(num_experts_per_tok=9),
    dict(scoring_func="sigmoid"), dict(hidden_act="gelu")])
def test_config_refusals_name_the_key(change):
    key = next(iter(change))
    with pytest.raises(ValueError, match=key):
        registry.config_from_hf(NAME, dict(HF, **change))


# --- against transformers ------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def load():
    """(config, params, reference) of the fixture, read with ``params_from_tensors``."""
    st.KIND.setdefault(NAME, NAME)
    return st.load(NAME)


@needs_fixture
def test_fixture_tensors_are_the_canonical_table():
    cfg = load()[0]
    t = load_file(str(st.FIX / NAME / "model.safetensors"))
    want = registry.expected_tensors(NAME, cfg)
    assert set(t) == set(want)
    assert all(tuple(t[k].shape) == want[k][0] for k in t)


@needs_fixture
def test_logits_hidden_and_aux_match_transformers():
    cfg, params, ref = load()
    n = cfg.num_hidden_layers
    model = registry.make_model(NAME, cfg, aux_layer_ids=tuple(range(n)))
    logits, hidden, aux = st.run_chunks(model, params, ref["input_ids"])
    assert st.relerr(logits, ref["logits"]) < st.TOL
    assert st.relerr(hidden, ref["final_hidden"]) < st.TOL
    for k in range(n):
        assert st.relerr(aux[:, k], ref["hidden_states"][k]) < st.TOL, f"aux layer {k}"


@needs_fixture
@pytest.mark.parametrize("what", ("window", "sinks", "clamp", "yarn"))
def test_each_feature_binds(what):
    """Dropping the window, the sinks, the clamp or YaRN changes the logits: the fixture
    tests each."""
    cfg, params, ref = load()
    if what == "window":
        cfg = cfg.replace(sliding_window=1 << 20)
    elif what == "clamp":
        cfg = cfg.replace(swiglu_limit=0.0)
    elif what == "yarn":
        cfg = cfg.replace(rope_scaling=None)
    else:
        params = jax.tree_util.tree_map_with_path(
            lambda p, a: jnp.full_like(a, -1e30) if "sinks" in jax.tree_util.keystr(p) else a,
            params)
    logits, _, _ = st.run_chunks(registry.make_model(NAME, cfg), params, ref["input_ids"])
    if what == "window":                     # rows inside the window are unchanged
        assert st.relerr(logits[:5], ref["logits"][:5]) < st.TOL
    assert st.relerr(logits, ref["logits"]) > 1e-3


@needs_fixture
def test_converter_load_gives_the_same_logits():
    cfg, _, ref = load()
    pre = specjax.load_pretrained(st.FIX / NAME, "float32")
    assert pre.kind == NAME and pre.config == cfg
    logits, _, _ = st.run_chunks(pre.model, pre.params, ref["input_ids"])
    assert st.relerr(logits, ref["logits"]) < st.TOL


@needs_fixture
def test_greedy_matches_transformers_generate():
    cfg, params, ref = load()
    want = ref["gen_tokens"].tolist()
    assert st.greedy_paged(registry.make_model(NAME, cfg), params, ref["gen_prompt"],
                           len(want)) == want


@needs_fixture
def test_plain_engine_greedy_matches_transformers():
    want = load()[2]["gen_tokens"].tolist()
    assert st.plain(NAME).outputs[0].token_ids[:len(want)] == want


@needs_fixture
@pytest.mark.parametrize("method", ("draft_model", "eagle3"))
def test_greedy_speculative_equals_plain(method):
    load()
    out = generate(st.target(NAME), st.proposer(NAME, method, 3), st.prompts(NAME),
                   SamplingParams(max_tokens=12), **st.FIXED)
    assert out.token_ids == st.plain(NAME).token_ids
    s = out.spec_stats
    if method == "draft_model":            # the draft is the target: every draft accepted
        assert s.num_draft_tokens > 0 and s.num_accepted_tokens == s.num_draft_tokens
        assert s.num_accepted_tokens_per_pos[0] == s.num_drafts

"""The sparse MoE block against a NumPy loop oracle, and the Qwen3-MoE target against its
transformers fixture (tests/support/fixtures/MANIFEST.md): fp32 logits through the paged
cache, greedy generation, and as the target of EAGLE-3 and of a draft model (greedy
speculative == plain greedy).
"""

from __future__ import annotations

import suite_paths  # tests/support: where the suite's pieces are
import functools
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

import specjax
import test_sliding_targets as st
from specjax.engine import SamplingParams, generate
from specjax.models import params as mp, registry
from specjax.models.moe import SparseMoeBlock

NAME = "qwen3_moe"
HF = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
          num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
          num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
          mlp_only_layers=[1])

needs_fixture = pytest.mark.skipif(not (st.FIX / NAME / "reference.npz").exists(),
                                   reason="fixtures not generated")


def oracle(x, router, experts, k, norm):
    """Per token, per selected expert: ``sum_j w_j * down(silu(gate x) * up x)``."""
    out = np.zeros_like(x, np.float64)
    for t in range(x.shape[0]):
        z = x[t] @ router
        p = np.exp(z - z.max())
        p /= p.sum()
        sel = np.argsort(-p)[:k]
        w = p[sel] / p[sel].sum() if norm else p[sel]
        for wj, e in zip(w, sel):
            g, u, d = experts[e]
            a = x[t] @ g
            out[t] += wj * ((a / (1 + np.exp(-a)) * (x[t] @ u)) @ d)
    return out


@pytest.mark.parametrize("norm", (True, False))
@pytest.mark.parametrize("fused", (False, True))
def test_block_matches_loop_oracle(norm, fused):
    h, i, e, k, t = 16, 8, 6, 2, 11
    block = SparseMoeBlock(h, i, e, k, norm, nnx.Rngs(0))
    params = nnx.to_pure_dict(nnx.state(block))
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda a: jnp.asarray(rng.standard_normal(a.shape) / 3, jnp.float32),
                          params)
    x = rng.standard_normal((t, h)).astype(np.float32)
    ex = [tuple(np.asarray(params["experts"][j][n]["kernel"], np.float64)
                for n in ("gate_proj", "up_proj", "down_proj")) for j in range(e)]
    want = oracle(x.astype(np.float64), np.asarray(params["gate"]["kernel"], np.float64), ex,
                  k, norm)
    if fused:
        params = mp.fuse_projections(params)
        assert "gate_up_proj" in params["experts"][0]
    got = jax.jit(lambda p, x: mp.merge(SparseMoeBlock, (h, i, e, k, norm), p)(x))(params, x)
    assert st.relerr(got, want) < 1e-5


def test_config_round_trip_rule_and_refusals():
    c = registry.config_from_hf(NAME, dict(HF, router_aux_loss_coef=0.01))
    assert [c.layer_sparse(i) for i in range(3)] == [True, False, True]
    assert c.qk_norm and registry.config_from_hf(NAME, registry.config_to_dict(c)) == c
    step2 = registry.config_from_hf(NAME, dict(HF, mlp_only_layers=[], decoder_sparse_step=2))
    assert [step2.layer_sparse(i) for i in range(3)] == [False, True, False]
    keys = registry.expected_tensors(NAME, c)
    assert keys["model.layers.0.mlp.experts.7.down_proj.weight"][0] == (64, 32)
    assert "model.layers.1.mlp.gate_proj.weight" in keys and "model.layers.0.mlp.gate_proj.weight" not in keys
    for key, value in (("shared_expert_intermediate_size", 64), ("n_shared_experts", 1),
                       ("scoring_func", "sigmoid")):
        with pytest.raises(ValueError, match=key):
            registry.config_from_hf(NAME, dict(HF, **{key: value}))


@functools.lru_cache(maxsize=None)
def load():
    """The fixture through test_sliding_targets' reader (its helpers key kinds by name)."""
    st.KIND.setdefault(NAME, NAME)
    return st.load(NAME)


@needs_fixture
def test_logits_hidden_and_aux_match_transformers():
    cfg, params, ref = load()
    model = registry.make_model(NAME, cfg, aux_layer_ids=(0, 1, 2))
    logits, hidden, aux = st.run_chunks(model, params, ref["input_ids"])
    assert st.relerr(logits, ref["logits"]) < st.TOL
    assert st.relerr(hidden, ref["final_hidden"]) < st.TOL
    for k in range(3):
        assert st.relerr(aux[:, k], ref["hidden_states"][k]) < st.TOL, f"aux layer {k}"


@needs_fixture
def test_converter_load_gives_the_same_logits():
    cfg, _, ref = load()
    pre = specjax.load_pretrained(st.FIX / NAME, "float32")
    assert pre.kind == NAME and pre.config == cfg
    logits, _, _ = st.run_chunks(pre.model, pre.params, ref["input_ids"])
    assert st.relerr(logits, ref["logits"]) < st.TOL


@needs_fixture
def test_transformers5_fused_experts_read_as_the_hub_layout(tmp_path):
    """``mlp.experts.gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]`` (what
    transformers 5 holds) load to the same params as the Hub's per-expert keys."""
    t = load_file(str(st.FIX / NAME / "model.safetensors"))
    fused = {k: v for k, v in t.items() if ".mlp.experts." not in k}
    for i in (0, 2):
        pre = f"model.layers.{i}.mlp.experts."
        ex = {n: np.stack([t[f"{pre}{e}.{n}.weight"] for e in range(8)])
              for n in ("gate_proj", "up_proj", "down_proj")}
        fused[pre + "gate_up_proj"] = np.concatenate([ex["gate_proj"], ex["up_proj"]], 1)
        fused[pre + "down_proj"] = ex["down_proj"]
    save_file(fused, str(tmp_path / "model.safetensors"))
    shutil.copy(st.FIX / NAME / "config.json", tmp_path / "config.json")
    got = specjax.load_pretrained(tmp_path, "float32")
    want = load()[1]
    assert jax.tree.structure(got.params) == jax.tree.structure(want)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(got.params),
                                                      jax.tree.leaves(want)))


@needs_fixture
def test_greedy_matches_transformers_generate():
    cfg, params, ref = load()
    want = ref["gen_tokens"].tolist()
    assert st.greedy_paged(registry.make_model(NAME, cfg), params, ref["gen_prompt"],
                           len(want)) == want


@needs_fixture
def test_plain_engine_greedy_matches_transformers():
    load()
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

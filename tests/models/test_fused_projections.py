"""``specjax.models.fuse_projections``: q/k/v and gate/up as one GEMM each.

The fused forward itself is checked against the NumPy oracle in test_models.py (the decoder
and the EAGLE-3 head, ``fused`` cases) and, through the engine's default, by every engine
test against plain greedy decoding of the unfused model. Here: the layout round trip, what
is left alone, the errors, and the step / engine options.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from specjax.engine import LoopOptions, SamplingParams, TargetModel, generate
from specjax.models import fuse_projections, registry, unfuse_projections
from specjax.models.params import is_fused
from specjax.sharding import param_specs
from specjax.runtime.step import make_step

GEO = dict(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
           rms_norm_eps=1e-5, vocab_size=64)


def qwen3(layers=2):
    cfg = registry.config_from_hf("qwen3", dict(GEO, num_hidden_layers=layers, head_dim=16,
                                                attention_bias=True, mlp_bias=True))
    return cfg, registry.init_params("qwen3", cfg, 0)


def leaves_equal(a, b):
    fa, ta = jax.tree_util.tree_flatten_with_path(a)
    fb, tb = jax.tree_util.tree_flatten_with_path(b)
    assert ta == tb
    for (pa, x), (pb, y) in zip(fa, fb):
        assert pa == pb and np.array_equal(np.asarray(x), np.asarray(y)), jax.tree_util.keystr(pa)


def test_round_trip_and_layout():
    cfg, params = qwen3()
    fused = fuse_projections(params)
    attn, mlp = fused["layers"][0]["self_attn"], fused["layers"][0]["mlp"]
    assert set(attn) == {"qkv_proj", "o_proj", "q_norm", "k_norm"}
    assert set(mlp) == {"gate_up_proj", "down_proj"}
    a0 = params["layers"][0]["self_attn"]
    want = np.concatenate([np.asarray(a0[p]["kernel"]) for p in ("q_proj", "k_proj", "v_proj")], -1)
    assert np.array_equal(np.asarray(attn["qkv_proj"]["kernel"]), want)
    assert attn["qkv_proj"]["bias"].shape == (16 * 4 + 2 * 16 * 2,)
    assert attn["o_proj"] is a0["o_proj"]                    # the rest: the same objects
    assert fused["embed_tokens"] is params["embed_tokens"]
    assert fuse_projections(fused) is fused                  # already fused: as it is
    assert is_fused(fused) and not is_fused(params)
    leaves_equal(unfuse_projections(fused, cfg), params)
    # exported as the checkpoint's tensors either way
    t1 = registry.tensors_from_params("qwen3", cfg, params)
    t2 = registry.tensors_from_params("qwen3", cfg, fused)
    assert t1.keys() == t2.keys() and all(np.array_equal(t1[k], t2[k]) for k in t1)


def test_numpy_stays_numpy_and_incomplete_groups_are_left_alone():
    _, params = qwen3(layers=1)
    host = jax.tree.map(np.asarray, params)
    fused = fuse_projections(host)
    assert isinstance(fused["layers"][0]["self_attn"]["qkv_proj"]["kernel"], np.ndarray)
    partial = {"q_proj": host["layers"][0]["self_attn"]["q_proj"],
               "k_proj": host["layers"][0]["self_attn"]["k_proj"]}
    assert fuse_projections(partial) is partial              # no v_proj: not a group
    a = host["layers"][0]["self_attn"]
    mixed = dict(a, v_proj={"kernel": a["v_proj"]["kernel"]})  # one bias missing
    assert fuse_projections(mixed) is mixed


def test_unfuse_with_the_wrong_config_names_the_entry():
    cfg, params = qwen3(layers=1)
    other = registry.config_from_hf("qwen3", dict(GEO, num_hidden_layers=1, head_dim=8,
                                                  attention_bias=True, mlp_bias=True))
    with pytest.raises(ValueError, match="qkv_proj has 128 output columns"):
        unfuse_projections(fuse_projections(params), other)


def test_tensor_parallel_rules_refuse_the_fused_layout():
    cfg, params = qwen3(layers=1)
    param_specs(params, cfg, 2)                                # the checkpoint layout shards
    with pytest.raises(ValueError, match=r"fused projection.*unfuse_projections"):
        param_specs(fuse_projections(params), cfg, 2)


def test_step_and_engine_fuse_by_default_and_honour_false():
    cfg, params = qwen3()
    model = registry.make_model("qwen3", cfg)
    assert is_fused(make_step(model, None).place_target_params(params))
    assert make_step(model, None, fuse_projections=False).place_target_params(params) is params
    with pytest.raises(ValueError, match="fuse_projections"):
        make_step(model, None, fuse_projections=1)
    prompts = [[1, 2, 3, 4], [5, 6, 7]]
    sp = [SamplingParams(max_tokens=6), SamplingParams(max_tokens=9)]
    kw = dict(max_model_len=32, block_size=4)
    a = generate(TargetModel(model, params), None, prompts, sp, **kw)
    b = generate(TargetModel(model, params), None, prompts, sp,
                 options=LoopOptions(fuse_projections=False), **kw)
    assert a.token_ids == b.token_ids and all(len(t) for t in a.token_ids)

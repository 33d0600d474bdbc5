"""A catalogue of bad arguments to every public entry point: each raises before any work,
with the error type asserted and a message that names the argument (issue 26)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from specjax.checks import MAX_VALUE_CHARS, show
from specjax.config import SpeculativeConfig
from specjax.models import config_from_hf, registry

BASE = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)

E = dict(method="eagle", num_speculative_tokens=3)


@pytest.mark.smoke
@pytest.mark.parametrize("kwargs, exc, name", [
    (dict(method="eagle", num_speculative_tokens=10000), ValueError, "num_speculative_tokens"),
    (dict(method="ngram", num_speculative_tokens=10**9), ValueError, "num_speculative_tokens"),
    (dict(method="eagle", num_speculative_tokens="3"), TypeError, "num_speculative_tokens"),
    (dict(method="eagle", num_speculative_tokens=True), TypeError, "num_speculative_tokens"),
    (dict(method="ngram", num_speculative_tokens=3, prompt_lookup_max=2.0), TypeError,
     "prompt_lookup_max"),
    (dict(method="ngram", num_speculative_tokens=3, prompt_lookup_min=10**9), ValueError,
     "prompt_lookup_min"),
    (dict(method="eagle", num_speculative_tokens=2, prompt_lookup_min=3), ValueError,
     "prompt_lookup_min"),
    (dict(E, rejection_sample_method="synthetic", synthetic_acceptance_rates="0.5"), TypeError,
     "synthetic_acceptance_rates"),
    (dict(E, rejection_sample_method="synthetic", synthetic_acceptance_rates=[0.5, 0.9, 0.2]),
     ValueError, "synthetic_acceptance_rates"),
    (dict(E, rejection_sample_method="synthetic", synthetic_acceptance_rates=[1.0, "x", 0.1]),
     TypeError, r"synthetic_acceptance_rates\[1\]"),
    (dict(E, rejection_sample_method="synthetic", synthetic_acceptance_length="2"), TypeError,
     "synthetic_acceptance_length"),
    (dict(E, enforce_eager=True), ValueError, "enforce_eager"),
    (dict(E, draft_tensor_parallel_size=2), ValueError, "draft_tensor_parallel_size"),
    (dict(E, parallel_drafting="yes"), TypeError, "parallel_drafting"),
    (dict(E, max_model_len=-5), ValueError, "max_model_len"),
    (dict(E, method=3), TypeError, "method"),
    (dict(E, model=["a"]), TypeError, "model"),
    (dict(E, speculative_token_tree=5), TypeError, "speculative_token_tree"),
    (dict(E, num_speculative_tokens=2000, speculative_token_tree=str([(i,) for i in range(2000)])),
     ValueError, "speculative_token_tree|num_speculative_tokens"),
    (dict(method="suffix", suffix_backend="arctic", suffix_decoding_max_tree_depth=10**6), ValueError,
     "suffix_decoding_max_tree_depth|num_speculative_tokens"),
])
def test_speculative_config(kwargs, exc, name):
    with pytest.raises(exc, match=name):
        SpeculativeConfig(**kwargs)


def test_message_truncates_the_value():
    with pytest.raises(TypeError) as e:
        SpeculativeConfig(method="eagle", num_speculative_tokens="x" * 10_000)
    assert "num_speculative_tokens" in str(e.value) and len(str(e.value)) < 400
    assert len(show("y" * 1000)) == MAX_VALUE_CHARS


@pytest.mark.smoke
@pytest.mark.parametrize("change, exc, name", [
    (dict(num_attention_heads=0), ValueError, "num_attention_heads"),
    (dict(num_attention_heads="4"), TypeError, "num_attention_heads"),
    (dict(rope_theta="big"), TypeError, "rope_theta"),
    (dict(rope_scaling="linear"), TypeError, "rope_scaling"),
    (dict(rope_scaling=[1, 2]), TypeError, "rope_scaling"),
    (dict(rope_scaling={"rope_type": "linear"}), ValueError, "factor"),
    (dict(rope_scaling={"rope_type": "linear", "factor": "2"}), TypeError, "factor"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}), ValueError, "low_freq_factor"),
    (dict(rms_norm_eps="1e-6"), TypeError, "rms_norm_eps"),
    (dict(rms_norm_eps=[1e-6]), TypeError, "rms_norm_eps"),
    (dict(num_hidden_layers=100000), ValueError, "num_hidden_layers"),
    (dict(hidden_size=2**40), ValueError, "hidden_size"),
    (dict(vocab_size=None), ValueError, "vocab_size"),
    (dict(sliding_window=16), ValueError, "sliding_window"),
    (dict(use_sliding_window=True, sliding_window=16, max_window_layers=0), ValueError,
     "use_sliding_window"),
    (dict(use_sliding_window="no"), TypeError, "use_sliding_window"),
    (dict(tie_word_embeddings="false"), TypeError, "tie_word_embeddings"),
    (dict(hidden_size=30, num_attention_heads=4, head_dim=None), ValueError, "hidden_size"),
])
def test_config_from_hf(change, exc, name):
    cfg = {**BASE, **change}
    with pytest.raises(exc, match=name) as e:
        config_from_hf("llama", cfg)
    assert len(str(e.value)) < 600


def test_config_from_hf_windows_that_cannot_bind_are_accepted():
    # a Mistral window as long as the context, Qwen2's flag off or no windowed layer
    config_from_hf("llama", {**BASE, "sliding_window": 256})
    config_from_hf("llama", {**BASE, "sliding_window": None})
    config_from_hf("qwen2", {**BASE, "use_sliding_window": False, "sliding_window": 16})
    config_from_hf("qwen2", {**BASE, "use_sliding_window": True, "sliding_window": 16,
                             "max_window_layers": 2})
    config_from_hf("llama", {**BASE, "rope_scaling": {"rope_type": "linear", "factor": 2.0}})


def test_missing_config_json(tmp_path):
    from specjax.hf import checkpoint_dir, load_model, read_checkpoint_config

    with pytest.raises(FileNotFoundError, match="config.json is missing"):
        read_checkpoint_config(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(tmp_path / "nope")
    (tmp_path / "f").write_text("x")
    with pytest.raises(NotADirectoryError):
        checkpoint_dir(tmp_path / "f")
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="JSON object"):
        read_checkpoint_config(tmp_path)


# --- make_proposer --------------------------------------------------------------------

def _target(**change):
    cfg = config_from_hf("llama", {**BASE, **change})
    return registry.make_model("llama", cfg), registry.init_params("llama", cfg)


def _head(kind="eagle3", **change):
    cfg = config_from_hf(kind, {**BASE, "num_hidden_layers": 1, **change})
    return cfg, registry.init_params(kind, cfg)


@pytest.mark.smoke
def test_make_proposer_bad_arguments():
    from specjax import make_proposer

    tgt, tp = _target()
    hc, hp = _head()
    ok = dict(target=tgt, target_params=tp, draft=hc, draft_params=hp, max_model_len=64)
    cfg = SpeculativeConfig(**E)
    L = tgt.config.num_hidden_layers
    cases = [
        (dict(ok, max_model_len="64"), TypeError, "max_model_len"),
        (dict(ok, max_model_len=None), ValueError, "max_model_len"),
        (dict(ok, block_size=0), ValueError, "block_size"),
        (dict(ok, kernel_backend="cuda"), ValueError, "kernel_backend"),
        (dict(ok, aux_layer_ids=5), TypeError, "aux_layer_ids"),
        # the target has BASE's num_hidden_layers layers: ids in [0, L-1], increasing, 3 of them
        (dict(ok, aux_layer_ids=(0, 1, L)), ValueError, rf"aux_layer_ids.*\[0, {L - 1}\]"),
        (dict(ok, aux_layer_ids=(2, 1, 0)), ValueError, r"aux_layer_ids.*strictly increasing"),
        (dict(ok, aux_layer_ids=(0, 1)), ValueError, r"aux_layer_ids has 2 ids.*give 3"),
        (dict(ok, draft_params=[1]), TypeError, "draft_params"),
        (dict(ok, target="model"), TypeError, "target"),
    ]
    for kw, exc, name in cases:
        with pytest.raises(exc, match=name):
            make_proposer(SpeculativeConfig(method="eagle3", num_speculative_tokens=3), **kw)
    with pytest.raises(TypeError, match="config"):
        make_proposer("eagle3", **ok)
    # a head whose input width is not the target's hidden size
    hc2, hp2 = _head(target_hidden_size=48)
    with pytest.raises(ValueError, match="target_hidden_size"):
        make_proposer(SpeculativeConfig(method="eagle3", num_speculative_tokens=3),
                      **dict(ok, draft=hc2, draft_params=hp2))
    ec, ep = _head("eagle", hidden_size=48, num_attention_heads=4)
    with pytest.raises(ValueError, match="hidden_size"):
        make_proposer(cfg, **dict(ok, draft=ec, draft_params=ep))
    # params built for another config
    other_c, other_p = _head(intermediate_size=96)
    with pytest.raises(ValueError, match="draft_params do not match"):
        make_proposer(SpeculativeConfig(method="eagle3", num_speculative_tokens=3),
                      **dict(ok, draft_params=other_p))
    _, tp_other = _target(hidden_size=48)
    with pytest.raises(ValueError, match="target_params do not match"):
        make_proposer(SpeculativeConfig(method="eagle3", num_speculative_tokens=3),
                      **dict(ok, target_params=tp_other))
    # the wrong kind of draft for the method
    with pytest.raises(ValueError, match="kind"):
        make_proposer(cfg, **ok)


def test_generate_bad_arguments():
    from specjax import generate
    from specjax.engine import LoopOptions, SamplingParams, TargetModel

    tgt, tp = _target()
    t = TargetModel(tgt, tp)
    prompts = [[1, 2, 3]]
    sp = SamplingParams(max_tokens=2)
    cases = [
        (dict(max_model_len=2**30), ValueError, "max_model_len"),
        (dict(max_model_len=2**30, num_blocks=2**24), ValueError, "num_blocks"),
        (dict(eos_token_id="x"), TypeError, "eos_token_id"),
        (dict(eos_token_id=10**6), ValueError, "eos_token_id"),
        (dict(seed="abc"), TypeError, "seed"),
        (dict(seed=-1), ValueError, "seed"),
        (dict(block_size=2.5), TypeError, "block_size"),
        (dict(loop=dict(batch_buckets=(1,)), max_num_seqs=2), ValueError, "batch_buckets"),
        (dict(loop=dict(query_buckets=(0,))), ValueError, "query_buckets"),
        (dict(loop=dict(context_buckets=(2,)), max_model_len=256), ValueError, "context_buckets"),
        (dict(loop=dict(steps_per_sync=0)), ValueError, "steps_per_sync"),
        (dict(loop=dict(overlap="yes")), TypeError, "overlap"),
        (dict(num_blocks=True), TypeError, "num_blocks"),
        (dict(options={"steps_per_sync": 4}), TypeError, "options"),
        (dict(steps_per_sync=4), TypeError, r"steps_per_sync.*allowed: .*'max_model_len'.*"
                                            r"options=LoopOptions\(steps_per_sync=\.\.\.\)"),
        (dict(bogus=1), TypeError, r"unknown option\(s\) \['bogus'\]; allowed: .*'options'"),
    ]
    for kw, exc, name in cases:
        with pytest.raises(exc, match=name):
            loop = kw.pop("loop", None)
            generate(t, None, prompts, sp, **kw,
                     **({} if loop is None else {"options": LoopOptions(**loop)}))
    _, other = _target(intermediate_size=96)
    with pytest.raises(ValueError, match="target params do not match"):
        generate(TargetModel(tgt, other), None, prompts, sp)
    with pytest.raises(TypeError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=5)


def test_make_step_bad_arguments():
    from specjax import make_step

    tgt, _ = _target()
    with pytest.raises(TypeError, match="tp_axis"):
        make_step(tgt, None, tp_axis=3)
    with pytest.raises(ValueError, match="target"):
        make_step("model", None)


def test_from_vllm_bad_arguments(tmp_path):
    cases = [
        ({"method": "eagle3", "num_speculative_tokens": 3, "quantization": "fp8"}, ValueError,
         "quantization"),
        ({"method": "eagle3", "num_speculative_tokens": 3, "revision": "main"}, ValueError,
         "revision"),
        ({"method": "eagle3", "num_speculative_tokens": 3, "tensor_parallel_size": 2}, ValueError,
         "tensor_parallel_size"),
        ({"method": "eagle3", "num_speculative_tokens": 3, "draft_sample_method": "gumbel"},
         ValueError, "draft_sample_method"),
        ({"method": "eagle3", "num_speculative_tokens": 3, "bogus": 1}, ValueError, "bogus"),
        ({"method": "eagle3", "num_speculative_tokens": 3, "enforce_eager": True}, ValueError,
         "enforce_eager"),
        ({"model": str(tmp_path / "missing" / "eagle3"), "num_speculative_tokens": 3},
         FileNotFoundError, "model"),
    ]
    for d, exc, name in cases:
        with pytest.raises(exc, match=name):
            SpeculativeConfig.from_vllm(d)
    with pytest.raises(TypeError, match="speculative_config"):
        SpeculativeConfig.from_vllm(json.dumps({"method": "eagle3"}))
    # vLLM's defaults are accepted
    c = SpeculativeConfig.from_vllm({"method": "eagle3", "num_speculative_tokens": 3,
                                     "quantization": None, "enforce_eager": None,
                                     "draft_sample_method": "greedy", "kv_cache_dtype": "auto"})
    assert c.method == "eagle3"


def test_numpy_ints_are_ints():
    c = SpeculativeConfig(method="eagle", num_speculative_tokens=np.int64(3))
    assert c.num_speculative_tokens == 3 and type(c.num_speculative_tokens) is int

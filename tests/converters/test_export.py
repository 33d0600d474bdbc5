"""``specjax.converters.export``: trained params ->
upstream checkpoint layouts, read back by the converters (``load_pretrained`` with the format
auto-detected, ``specjax-convert``)."""

from __future__ import annotations

import json
import os

import ml_dtypes
import numpy as np
import pytest

import specjax
from specjax.converters import cli
from specjax.converters.readers import read_checkpoint, read_safetensors_header
from specjax.converters.formats import detect_format
from specjax.models import registry
from specjax.converters import export as export_mod
from specjax.converters.export import EXPORT_FORMATS, export_checkpoint

DTYPES = {"fp32": np.dtype(np.float32), "bf16": np.dtype(ml_dtypes.bfloat16)}
BASE = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
            rope_theta=10000.0, max_position_embeddings=512)
MEDUSA = dict(vocab_size=64, hidden_size=32, num_heads=3)

#: format -> (kind, hf config for registry.config_from_hf, weight file written)
CASES = {
    "llama": ("llama", dict(BASE, rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 128}), "model.safetensors"),
    "qwen2": ("qwen2", dict(BASE, tie_word_embeddings=True), "model.safetensors"),
    "qwen3": ("qwen3", dict(BASE, head_dim=16, rms_norm_eps=1e-6, use_sliding_window=True,
                            sliding_window=12, max_window_layers=1), "model.safetensors"),
    "mistral": ("mistral", dict(BASE, head_dim=16, sliding_window=8), "model.safetensors"),
    "ministral": ("ministral", dict(BASE, sliding_window=12,
                                    layer_types=["full_attention", "sliding_attention"]),
                  "model.safetensors"),
    "gemma3": ("gemma3", dict(BASE, head_dim=16, sliding_window=8, query_pre_attn_scalar=12,
                              layer_types=["sliding_attention", "full_attention"],
                              rope_scaling={"rope_type": "linear", "factor": 8.0},
                              rope_local_base_freq=10000.0, final_logit_softcapping=30.0,
                              hidden_activation="gelu_pytorch_tanh"), "model.safetensors"),
    "qwen3_moe": ("qwen3_moe", dict(BASE, head_dim=16, num_experts=4, num_experts_per_tok=2,
                                    moe_intermediate_size=16, decoder_sparse_step=2),
                  "model.safetensors"),
    "gpt_oss": ("gpt_oss", dict(BASE, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                                intermediate_size=16, sliding_window=8), "model.safetensors"),
    "mimo": ("qwen2", dict(BASE), "model.safetensors"),
    "mimo-mtp": ("mtp", dict(BASE, num_hidden_layers=1, num_nextn_predict_layers=1),
                 "model.safetensors"),
    "eagle": ("eagle", dict(BASE, bias=True), "model.safetensors"),
    # vLLM v0.33's EAGLE-3 norm options: all three in the SafeAILab layout and in the
    # speculators layout (vLLM 0.33+'s speculators updater copies them); head_dim != H / nH
    # is kept by both writers
    "eagle3": ("eagle3", dict(BASE, num_hidden_layers=1, draft_vocab_size=40, has_d2t=True,
                              eagle_aux_hidden_state_layer_ids=[1, 4, 7], norm_before_fc=True,
                              fc_norm=True, norm_output=True, head_dim=16),
               "model.safetensors"),
    "eagle3-speculators": ("eagle3", dict(BASE, draft_vocab_size=40, has_d2t=True, head_dim=16,
                                          has_embed_tokens=True, target_hidden_size=24,
                                          norm_before_residual=True, fc_norm=True,
                                          norm_output=True, norm_before_fc=True),
                           "model.safetensors"),
    "dflash": ("dflash", dict(BASE, head_dim=16, block_size=4, mask_token_id=63,
                              aux_hidden_state_layer_ids=[1, 3, 5]), "model.safetensors"),
    "dflash-speculators": ("dflash", dict(BASE, head_dim=16, block_size=8, mask_token_id=60,
                                          aux_hidden_state_layer_ids=[0, 3],
                                          draft_vocab_size=40, has_d2t=True, has_lm_head=True,
                                          causal=True), "model.safetensors"),
    # an rnn Markov head, a confidence head on [h, m], a reduced vocab, anchors not sampled
    "dspark": ("dspark", dict(BASE, head_dim=16, block_size=4, mask_token_id=63,
                              aux_hidden_state_layer_ids=[1, 3, 5], markov_rank=8,
                              markov_head_type="rnn", enable_confidence_head=True,
                              confidence_head_with_markov=True, sample_from_anchor=False,
                              draft_vocab_size=40, has_d2t=True, has_lm_head=True),
               "model.safetensors"),
    "medusa": ("medusa", dict(MEDUSA, num_hidden_layers=1, medusa_fc_bias=True),
               "medusa_lm_head.safetensors"),
    "medusa-vllm": ("medusa", dict(MEDUSA, num_hidden_layers=2, truncated_vocab_size=40,
                                   has_token_map=True), "model.safetensors"),
}


def make(fmt, seed=0):
    kind, hf, _ = CASES[fmt]
    config = registry.config_from_hf(kind, hf)
    return kind, config, registry.init_params(kind, config, seed)


def leaves(params):
    return {registry._dotted(p): np.asarray(v) for p, v in registry._leaf_paths(params).items()}


def assert_bit_equal(got, want, dtype=None):
    got, want = leaves(got), leaves(want)
    assert sorted(got) == sorted(want)
    for k, w in want.items():
        if dtype is not None and not np.issubdtype(w.dtype, np.integer):
            w = w.astype(dtype)
        assert got[k].dtype == w.dtype, k
        assert got[k].shape == w.shape and got[k].tobytes() == w.tobytes(), k


def assert_same_config(got, want):
    a, b = registry.config_to_dict(got), registry.config_to_dict(want)
    # The has_* flags may legitimately differ in one way only: None ("not known", which
    # abstract_params treats as absent) in the config we built by hand, False in the loaded
    # one, because the converter sets every flag from the tensors it found
    # (config_with_tensors). Any other difference is a failure.
    for f in ("has_embed_tokens", "has_lm_head", "has_d2t", "has_token_map"):
        if b.get(f) is None and a.get(f) is False:
            a.pop(f), b.pop(f, None)
    assert a == b


def test_every_converter_format_has_an_exporter():
    from specjax.converters.formats import FORMATS
    assert set(EXPORT_FORMATS) == set(FORMATS) == set(CASES)


@pytest.mark.smoke
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("fmt", list(CASES))
def test_export_round_trip(tmp_path, fmt, dtype):
    kind, config, params = make(fmt)
    out = export_checkpoint(kind, config, params, tmp_path / "out", format=fmt, dtype=dtype)
    assert out == (tmp_path / "out").absolute()
    assert sorted(os.listdir(tmp_path)) == ["out"]  # no temporary directories left
    assert sorted(os.listdir(out)) == sorted(["config.json", CASES[fmt][2]])
    ckpt = read_checkpoint(out)
    assert detect_format(ckpt.config, ckpt.tensors, ckpt.files) == fmt
    for k, ref in ckpt.tensors.items():  # on-disk dtypes as upstream stores them
        want = {"d2t": np.int64, "token_map": np.int64, "t2d": np.bool_}.get(k, DTYPES[dtype])
        assert ref.dtype == np.dtype(want), k

    kind2, config2, params2 = specjax.load_pretrained(out)  # no format argument
    assert kind2 == kind
    assert_same_config(config2, config)
    assert_bit_equal(params2, params, DTYPES[dtype])


def test_layout_details(tmp_path):
    """Upstream names and fields, spot-checked per format."""
    def files(fmt, **kw):
        kind, config, params = make(fmt)
        out = export_checkpoint(kind, config, params, tmp_path / fmt, format=fmt, **kw)
        cfg = json.loads((out / "config.json").read_text())
        return cfg, read_safetensors_header(out / CASES[fmt][2]), config

    cfg, t, _ = files("qwen2")
    assert cfg["architectures"] == ["Qwen2ForCausalLM"] and cfg["tie_word_embeddings"]
    assert cfg["torch_dtype"] == "bfloat16" and "lm_head.weight" not in t
    assert "model.layers.1.self_attn.q_proj.bias" in t and "model.embed_tokens.weight" in t
    cfg, t, _ = files("llama", dtype="fp32")
    assert cfg["torch_dtype"] == "float32" and cfg["rope_scaling"]["rope_type"] == "llama3"
    assert t["lm_head.weight"].shape == (64, 32)
    cfg, t, _ = files("eagle")
    assert cfg["bias"] is True and "fc.bias" in t and t["fc.weight"].shape == (32, 64)
    assert "layers.0.input_layernorm.weight" not in t and "layers.1.input_layernorm.weight" in t
    assert not any(k.startswith("model.") or k == "embed_tokens.weight" for k in t)
    cfg, t, config = files("eagle3")
    assert cfg["draft_vocab_size"] == 40 and cfg["eagle_aux_hidden_state_layer_ids"] == [1, 4, 7]
    assert "midlayer.hidden_norm.weight" in t and not any(k.startswith("layers.") for k in t)
    assert t["midlayer.self_attn.q_proj.weight"].shape == (64, 64)  # doubled input, 4 x 16
    assert cfg["head_dim"] == 16                                     # != H / nH: written
    d2t, t2d = t["d2t"].load(), t["t2d"].load()
    assert d2t.dtype == np.int64 and t2d.shape == (64,) and t2d.sum() == 40
    assert (np.flatnonzero(t2d) == np.arange(40) + d2t).all()
    cfg, t, _ = files("eagle3-speculators")
    assert cfg["speculators_model_type"] == "eagle3" and cfg["target_hidden_size"] == 24
    assert cfg["transformer_layer_config"]["vocab_size"] == 64 and "embed_tokens.weight" in t
    assert t["fc.weight"].shape == (32, 72) and "layers.0.hidden_norm.weight" in t
    cfg, t, _ = files("dflash")
    # z-lab target_layer_ids = output of layer id = vLLM aux id (input of layer k) - 1
    assert cfg["dflash_config"] == {"mask_token_id": 63, "target_layer_ids": [0, 2, 4]}
    assert cfg["block_size"] == 4 and cfg["architectures"] == ["DFlashDraftModel"]
    assert "embed_tokens.weight" not in t and "lm_head.weight" not in t
    cfg, t, _ = files("dflash-speculators")
    assert cfg["aux_hidden_state_layer_ids"] == [0, 3] and cfg["mask_token_id"] == 60
    assert cfg["transformer_layer_config"]["is_causal"] is True and "t2d" in t
    cfg, t, _ = files("medusa")
    assert cfg == {"medusa_num_heads": 3, "medusa_num_layers": 1, "hidden_size": 32,
                   "vocab_size": 64}
    assert sorted(t) == sorted(f"{h}.{k}" for h in range(3)
                               for k in ("0.linear.weight", "0.linear.bias", "1.weight"))
    cfg, t, _ = files("medusa-vllm")
    assert cfg["truncated_vocab_size"] == 40 and t["token_map"].dtype == np.int64
    assert t["lm_heads.2.weight"].shape == (40, 32) and "blocks.1.layers.1.weight" in t


def test_tensors_from_params_is_the_inverse():
    for fmt in CASES:
        kind, config, _ = make(fmt)
        tensors = registry.random_tensors(kind, config, seed=3)
        params = registry.params_from_tensors(kind, config, tensors, dtype=None)
        back = registry.tensors_from_params(kind, config, params)
        assert sorted(back) == sorted(tensors), fmt
        for k, a in tensors.items():
            assert back[k].dtype == a.dtype and np.array_equal(back[k], a), (fmt, k)
        again = registry.params_from_tensors(kind, config, back, dtype=None)
        assert_bit_equal(again, params)


def test_shared_target_arrays_are_skipped(tmp_path):
    """A head's params with the target's embedding / lm_head added (share_target_weights)
    export without them; an unowned optional entry is not silently dropped otherwise."""
    from specjax.models import share_target_weights

    _, _, tparams = make("llama")
    kind, config, params = make("eagle3")
    merged = share_target_weights(params, tparams)
    assert "embed_tokens" in merged
    assert sorted(registry.tensors_from_params(kind, config, merged)) == \
        sorted(registry.tensors_from_params(kind, config, params))
    out = export_checkpoint(kind, config, merged, tmp_path / "o", format="eagle3")
    assert "embed_tokens.weight" not in read_safetensors_header(out / "model.safetensors")
    kind, config, params = make("dflash")
    with pytest.raises(ValueError, match=r"unexpected .*d2t"):
        registry.tensors_from_params(kind, config, {**params, "d2t": np.arange(64)})


def test_hf_export_through_the_cli(tmp_path, capsys):
    kind, config, params = make("llama")
    src = export_checkpoint(kind, config, params, tmp_path / "hf", format="llama", dtype="fp32")
    assert cli.main([str(src), str(tmp_path / "conv"), "-q"]) == 0
    kind2, config2, params2 = specjax.load_pretrained(tmp_path / "conv")
    assert kind2 == "llama"
    assert_same_config(config2, config)
    assert_bit_equal(params2, params)


def test_extra_config_is_merged(tmp_path):
    kind, config, params = make("dflash")
    extra = {"specjax": {"step": 7, "loss": 1.5}, "num_target_layers": 8,
             "dflash_config": {"note": "kept"}}
    out = export_checkpoint(kind, config, params, tmp_path / "o", format="dflash",
                            extra_config=extra)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["specjax"] == {"step": 7, "loss": 1.5} and cfg["num_target_layers"] == 8
    assert cfg["dflash_config"] == {"mask_token_id": 63, "target_layer_ids": [0, 2, 4],
                                    "note": "kept"}  # nested dicts merged
    assert_same_config(specjax.load_pretrained(out)[1], config)
    with pytest.raises(ValueError, match="cannot express .*hidden_size"):
        export_checkpoint(kind, config, params, tmp_path / "x", format="dflash",
                          extra_config={"hidden_size": 16})
    assert sorted(os.listdir(tmp_path)) == ["o"]


@pytest.mark.parametrize("call, exc, needle", [
    (dict(format="safetensors"), ValueError,
     r"format 'safetensors' is not an export format \(allowed: llama, .*medusa-vllm\)"),
    (dict(format="eagle3"), ValueError,
     r"format 'eagle3' is for kind 'eagle3', not 'llama' \(formats for llama: llama\)"),
    (dict(format="llama", dtype="int8"), ValueError,
     r"dtype 'int8' is not supported \(allowed: bf16, fp16, fp32\)"),
    (dict(format="llama", kind="gpt2"), ValueError, r"kind 'gpt2' is not supported"),
    (dict(format="llama", kind="qwen2"), ValueError,
     r"kind 'qwen2' does not match config.kind 'llama'"),
    (dict(format="llama", drop="layers.1.mlp.up_proj.kernel"), ValueError,
     r"missing keys: layers\.1\.mlp\.up_proj\.kernel"),
    (dict(format="llama", add="fc"), ValueError, r"unexpected keys: fc\.kernel"),
    (dict(format="llama", extra_config={"x": object()}), ValueError,
     "extra_config is not JSON-serializable"),
])
def test_bad_arguments(tmp_path, call, exc, needle):
    _, config, params = make("llama")
    params = dict(params, layers={i: dict(v) for i, v in params["layers"].items()})
    if "drop" in call:
        params["layers"][1]["mlp"] = {k: v for k, v in params["layers"][1]["mlp"].items()
                                      if k != "up_proj"}
    if "add" in call:
        params["fc"] = {"kernel": np.zeros((2, 2), np.float32)}
    kwargs = {k: v for k, v in call.items() if k in ("format", "dtype", "extra_config")}
    with pytest.raises(exc, match=needle):
        export_checkpoint(call.get("kind", "llama"), config, params, tmp_path / "out", **kwargs)
    assert os.listdir(tmp_path) == []


def test_unrepresentable_configs_are_refused(tmp_path):
    cases = [
        ("qwen2", dict(BASE, qkv_bias=False), "qwen2", r"qkv_bias=False \(would load back as True\)"),
        ("eagle3", dict(BASE, draft_vocab_size=40), "eagle3",
         r"exactly one decoder layer .*num_hidden_layers=2 .*eagle3-speculators"),
        ("medusa", dict(MEDUSA, num_hidden_layers=1), "medusa",
         r"cannot express fc_bias=False .*medusa-vllm"),
        ("medusa", dict(MEDUSA, num_hidden_layers=1, medusa_fc_bias=True,
                        truncated_vocab_size=40, has_token_map=True), "medusa",
         r"truncated_vocab_size=40, has_token_map=True"),
    ]
    for kind, hf, fmt, needle in cases:
        config = registry.config_from_hf(kind, hf)
        with pytest.raises(ValueError, match=needle):
            export_checkpoint(kind, config, registry.init_params(kind, config), tmp_path / "o",
                              format=fmt)
    assert os.listdir(tmp_path) == []


def test_medusa1_shared_resblock(tmp_path):
    config = registry.config_from_hf("medusa", dict(MEDUSA, num_hidden_layers=2,
                                                    medusa_fc_bias=True))
    params = registry.init_params("medusa", config)
    with pytest.raises(ValueError, match=r"head 0 has different weights in layers 0 and 1"):
        export_checkpoint("medusa", config, params, tmp_path / "o", format="medusa")
    assert os.listdir(tmp_path) == []
    blocks = {h: {"layers": {l: b["layers"][0] for l in b["layers"]}}
              for h, b in params["blocks"].items()}
    shared = dict(params, blocks=blocks)
    blocks[2] = {"layers": {0: params["blocks"][2]["layers"][0],
                            1: params["blocks"][2]["layers"][1]}}
    with pytest.raises(ValueError, match=r"head 2 has different weights"):
        export_checkpoint("medusa", config, shared, tmp_path / "o", format="medusa")
    blocks[2] = {"layers": {0: params["blocks"][2]["layers"][0]} | {
        1: params["blocks"][2]["layers"][0]}}
    out = export_checkpoint("medusa", config, shared, tmp_path / "o", format="medusa",
                            dtype="fp32")
    t = read_safetensors_header(out / "medusa_lm_head.safetensors")
    assert "0.1.linear.weight" in t and "0.2.weight" in t  # every layer index, as torch saves
    kind, config2, params2 = specjax.load_pretrained(out)
    assert_same_config(config2, config)
    assert_bit_equal(params2, shared)
    # the vLLM layout keeps per-layer weights
    out = export_checkpoint("medusa", config, params, tmp_path / "v", format="medusa-vllm")
    assert_bit_equal(specjax.load_pretrained(out)[2], params, DTYPES["bf16"])


def test_existing_directory(tmp_path):
    kind, config, params = make("qwen3")
    out = tmp_path / "out"
    out.mkdir()
    export_checkpoint(kind, config, params, out, format="qwen3")  # empty: fine
    (out / "README.md").write_text("old")
    with pytest.raises(FileExistsError, match=r"exists and is not empty \(README.md, .*\); pass overwrite=True"):
        export_checkpoint(kind, config, params, out, format="qwen3")
    assert (out / "README.md").read_text() == "old"
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileExistsError, match="is a file"):
        export_checkpoint(kind, config, params, tmp_path / "file", format="qwen3",
                          overwrite=True)
    _, _, params2 = make("qwen3", seed=5)
    export_checkpoint(kind, config, params2, out, format="qwen3", overwrite=True, dtype="fp32")
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    assert_bit_equal(specjax.load_pretrained(out)[2], params2)
    assert sorted(os.listdir(tmp_path)) == ["file", "out"]


@pytest.mark.parametrize("exc", [OSError("disk full"), KeyboardInterrupt()])
def test_failed_tensor_write_leaves_nothing(tmp_path, monkeypatch, exc):
    kind, config, params = make("eagle3")

    def failing_save(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"\x00" * 100)  # half a file, then the failure
        raise exc

    monkeypatch.setattr(export_mod, "_save_file", failing_save)
    with pytest.raises(type(exc)):
        export_checkpoint(kind, config, params, tmp_path / "new", format="eagle3")
    assert os.listdir(tmp_path) == []
    old = tmp_path / "old"
    old.mkdir()
    (old / "model.safetensors").write_bytes(b"previous")
    with pytest.raises(type(exc)):
        export_checkpoint(kind, config, params, old, format="eagle3", overwrite=True)
    assert os.listdir(tmp_path) == ["old"]
    assert os.listdir(old) == ["model.safetensors"]
    assert (old / "model.safetensors").read_bytes() == b"previous"
    monkeypatch.undo()
    export_checkpoint(kind, config, params, old, format="eagle3", overwrite=True)
    assert specjax.load_pretrained(old)[0] == "eagle3"


# -- P-EAGLE mask_hidden (parallel drafting) ---------------------------------------------------

#: format -> on-disk shape of mask_hidden for the CASES config (EAGLE-1: [1, H]; EAGLE-3:
#: [1, 1, num_aux * target_hidden_size], speculators' P-EAGLE parameter)
MASK_FORMATS = {"eagle": (1, 32), "eagle3": (1, 1, 96), "eagle3-speculators": (1, 1, 72)}


def with_mask_hidden(kind, config, params, seed=1, dtype=np.float32):
    m = registry.mask_hidden_abstract(kind, config)
    mask = np.random.default_rng(seed).standard_normal(m.shape).astype(dtype)
    return dict(params, mask_hidden=mask)


def test_registry_describes_mask_hidden():
    for fmt, disk in MASK_FORMATS.items():
        kind, config, _ = make(fmt)
        m = registry.mask_hidden_abstract(kind, config)
        assert m.shape == (int(np.prod(disk)),) and m.dtype == np.float32
        assert registry.mask_hidden_size(kind, config) == m.shape[0]
        # abstract_params: unchanged by default, the entry added on request
        plain = registry.abstract_params(kind, config)
        assert registry.MASK_HIDDEN not in plain
        full = registry.abstract_params(kind, config, mask_hidden=True)
        assert full.pop(registry.MASK_HIDDEN) == m and full == plain
    for fmt in ("llama", "dflash", "medusa"):
        kind, config, _ = make(fmt)
        assert registry.mask_hidden_abstract(kind, config) is None
        with pytest.raises(ValueError, match=r"kind '\w+' has no 'mask_hidden' entry .*eagle, eagle3"):
            registry.abstract_params(kind, config, mask_hidden=True)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("fmt", list(MASK_FORMATS))
def test_mask_hidden_round_trip(tmp_path, fmt, dtype):
    """export -> load_pretrained (direct) and specjax-convert -> load_pretrained: the same
    params, mask_hidden included, and the parallel-drafting token in mask_token_id."""
    kind, config, params = make(fmt)
    config = config.replace(mask_token_id=11)
    params = with_mask_hidden(kind, config, params)
    out = export_checkpoint(kind, config, params, tmp_path / "out", format=fmt, dtype=dtype)
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    t = read_safetensors_header(out / "model.safetensors")
    assert t["mask_hidden"].shape == MASK_FORMATS[fmt] and t["mask_hidden"].dtype == DTYPES[dtype]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["pard_token"] == 11 and "ptd_token_id" not in cfg

    kind2, config2, params2 = specjax.load_pretrained(out)
    assert kind2 == kind and config2.mask_token_id == 11
    assert_same_config(config2, config)
    assert_bit_equal(params2, params, DTYPES[dtype])

    assert cli.main([str(out), str(tmp_path / "conv"), "-q"]) == 0
    kind3, config3, params3 = specjax.load_pretrained(tmp_path / "conv")
    assert kind3 == kind and config3.mask_token_id == 11
    assert_same_config(config3, config)
    assert_bit_equal(params3, params, DTYPES[dtype])


def test_converted_extra_params_are_checked_before_restoring(tmp_path):
    """``specjax.json``'s ``extra_params`` must name known entries of the registry's shape:
    an edited / foreign metadata file is refused by name, nothing restored."""
    kind, config, params = make("eagle3")
    params = with_mask_hidden(kind, config, params)
    out = export_checkpoint(kind, config, params, tmp_path / "out", format="eagle3")
    conv = tmp_path / "conv"
    assert cli.main([str(out), str(conv), "-q"]) == 0
    meta_path = conv / "specjax.json"
    meta = json.loads(meta_path.read_text())
    n = registry.mask_hidden_size(kind, config)
    assert meta["extra_params"] == {"mask_hidden": [n]}
    for extra, needle in [({"mask_hidden": [n + 1]}, rf"has shape \[{n + 1}\]; the eagle3 config needs \[{n}\]"),
                          ({"mask_hidden": [n], "lora": [4]}, r"unknown extra_params \['lora'\]")]:
        meta_path.write_text(json.dumps(dict(meta, extra_params=extra)))
        with pytest.raises(specjax.converters.CheckpointError, match=needle):
            specjax.load_pretrained(conv)
    meta_path.write_text(json.dumps(meta))
    assert specjax.load_pretrained(conv)[2]["mask_hidden"].shape == (n,)


def test_without_mask_hidden_nothing_changes(tmp_path):
    for fmt in MASK_FORMATS:
        kind, config, params = make(fmt)
        out = export_checkpoint(kind, config, params, tmp_path / fmt, format=fmt)
        assert "mask_hidden" not in read_safetensors_header(out / "model.safetensors")
        cfg = json.loads((out / "config.json").read_text())
        assert not {"pard_token", "ptd_token_id"} & set(cfg)
        kind2, config2, params2 = specjax.load_pretrained(out)
        assert "mask_hidden" not in params2 and config2.mask_token_id == -1
        assert_same_config(config2, config)


@pytest.mark.parametrize("fmt, mask, needle", [
    ("eagle3", np.zeros((1, 1, 96), np.float32),
     r"params\['mask_hidden'\] has shape \(1, 1, 96\); the eagle3 head needs shape \(96,\) "
     r"\(fc input size = 3 aux states x target_hidden_size 32\); reshape it to \(96,\)"),
    ("eagle3-speculators", np.zeros(96, np.float32),
     r"has shape \(96,\); the eagle3 head needs shape \(72,\) .*target_hidden_size 24\) "
     r"\(96 values\)"),
    ("eagle", np.zeros(33, np.float32),
     r"has shape \(33,\); the eagle head needs shape \(32,\) \(hidden_size\)"),
    ("eagle", np.zeros(32, np.int32), r"params\['mask_hidden'\] has dtype int32, expected a float"),
    ("dflash", np.zeros(32, np.float32),
     r"params\['mask_hidden'\] .* cannot be written in format 'dflash' \(formats that carry "
     r"mask_hidden: eagle, eagle3, eagle3-speculators\)"),
    ("llama", np.zeros(32, np.float32), r"cannot be written in format 'llama' .*eagle3-speculators"),
    ("medusa-vllm", np.zeros(32, np.float32), r"cannot be written in format 'medusa-vllm'"),
])
def test_bad_mask_hidden_is_refused(tmp_path, fmt, mask, needle):
    kind, config, params = make(fmt)
    with pytest.raises(ValueError, match=needle):
        export_checkpoint(kind, config, dict(params, mask_hidden=mask), tmp_path / "out",
                          format=fmt)
    assert os.listdir(tmp_path) == []  # nothing written, not even a temporary directory


def test_parallel_drafting_token_fields(tmp_path):
    kind, config, params = make("eagle3-speculators")
    config = config.replace(mask_token_id=5)
    # a field of the caller's choice replaces the default pard_token
    out = export_checkpoint(kind, config, params, tmp_path / "a", format="eagle3-speculators",
                            extra_config={"ptd_token_id": 5})
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["ptd_token_id"] == 5 and "pard_token" not in cfg
    assert specjax.load_pretrained(out)[1].mask_token_id == 5
    # one that disagrees with the config is refused before anything is written
    with pytest.raises(ValueError, match=r"mask_token_id=5 \(the parallel-drafting token; would "
                                         r"load back as 6\)"):
        export_checkpoint(kind, config, params, tmp_path / "b", format="eagle3-speculators",
                          extra_config={"ptd_token_id": 6})
    assert sorted(os.listdir(tmp_path)) == ["a"]
    # a draft LM (PARD) keeps its token too
    kind, config, params = make("qwen3")
    out = export_checkpoint(kind, config.replace(mask_token_id=9), params, tmp_path / "lm",
                            format="qwen3")
    assert json.loads((out / "config.json").read_text())["pard_token"] == 9
    assert specjax.load_pretrained(out)[1].mask_token_id == 9


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_round_tripped_mask_hidden_drafts_the_same(tmp_path, method):
    """A parallel-drafting proposer drafts the same tokens with the exported-and-reloaded
    head (its mask_hidden, its token id) as with the original params."""
    from test_proposers_eagle_parallel import PARD, _batch, _proposer, _run, _with_mask, head

    cfg, model, params = head(method)
    params = _with_mask(method, params, "flat")
    cfg = cfg.replace(mask_token_id=PARD)
    fmt = "eagle3-speculators" if method == "eagle3" else "eagle"
    # the target's shared embedding / lm_head in params are skipped by the export
    out = export_checkpoint(method, cfg, params, tmp_path / "o", format=fmt, dtype="fp32")
    _, cfg2, back = specjax.load_pretrained(out)
    assert cfg2.mask_token_id == PARD and "mask_hidden" in back
    back = {**params, **back}  # the target's shared embedding / lm_head again
    prop = _proposer(method, 3, model)
    rng = np.random.default_rng(3)
    reqs, table = _batch(method, cfg, rng, 3, chunked=False, padded=True)
    a, _ = _run(prop, params, method, reqs, table, chunked=False, padded=True,
                rng=np.random.default_rng(4))
    b, _ = _run(prop, back, method, reqs, table, chunked=False, padded=True,
                rng=np.random.default_rng(4))
    np.testing.assert_array_equal(np.asarray(a.token_ids), np.asarray(b.token_ids))
    # and the mask state matters: without it (zeros) the drafts differ somewhere
    c, _ = _run(prop, {k: v for k, v in back.items() if k != "mask_hidden"}, method, reqs,
                table, chunked=False, padded=True, rng=np.random.default_rng(4))
    assert not np.array_equal(np.asarray(c.token_ids), np.asarray(b.token_ids))


def test_every_format_record_reads_and_writes():
    """One record per format: name, kind, detect, read and write, the writer being the
    export writer."""
    from specjax.converters.formats import DETECTION_ORDER, FORMATS

    assert sorted(DETECTION_ORDER) == sorted(FORMATS) == sorted(EXPORT_FORMATS)
    for name, f in FORMATS.items():
        assert f.name == name and callable(f.detect) and callable(f.read)
        assert EXPORT_FORMATS[name] is f.write

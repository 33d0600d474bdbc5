"""DFlash heads with sliding-window layers, per-layer causality and sinks through the
z-lab and speculators writers and back through the converters (format auto-detected)."""

from __future__ import annotations

import json

import numpy as np
import pytest

import specjax
from specjax.converters.export import export_checkpoint
from specjax.converters.readers import read_safetensors_header
from specjax.models import registry

SW, FA = "sliding_attention", "full_attention"
BASE = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
            rope_theta=10000.0, block_size=4, mask_token_id=63, aux_hidden_state_layer_ids=[1, 3])
HEADS = {
    # mixed layers, causal on the sliding ones (vLLM's default), sinks
    "mixed": dict(BASE, layer_types=[SW, FA, SW],
                  dflash_config=dict(swa_window_size=8, attention_sink_bias=True)),
    # every layer sliding, non-causal (use_swa)
    "use_swa": dict(BASE, dflash_config=dict(use_swa=True, swa_window_size=12)),
    # every layer causal, one sliding
    "causal": dict(BASE, is_causal=True, layer_types=[FA, FA, SW],
                   dflash_config=dict(swa_window_size=8)),
}


def _flat(params):
    return {registry._dotted(p): np.asarray(v) for p, v in registry._leaf_paths(params).items()}


def _round_trip(tmp_path, name, fmt):
    config = registry.config_from_hf("dflash", HEADS[name])
    params = registry.init_params("dflash", config, 0)
    out = export_checkpoint("dflash", config, params, tmp_path / fmt, format=fmt, dtype="fp32")
    kind, config2, params2 = specjax.load_pretrained(out)
    assert kind == "dflash"
    assert config2.replace(has_embed_tokens=None, has_lm_head=None, has_d2t=None) == config
    got, want = _flat(params2), _flat(params)
    assert sorted(got) == sorted(want)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    return json.loads((out / "config.json").read_text()), read_safetensors_header(
        out / "model.safetensors")


@pytest.mark.parametrize("name", list(HEADS))
def test_zlab_round_trip(tmp_path, name):
    cfg, t = _round_trip(tmp_path, name, "dflash")
    dc = cfg["dflash_config"]
    assert dc["swa_window_size"] == cfg["sliding_window"] and cfg["use_sliding_window"] is True
    if name == "mixed":
        assert cfg["layer_types"] == [SW, FA, SW] and "causal" not in dc
        assert dc["attention_sink_bias"] is True
        assert t["layers.2.self_attn.attention_sink_bias"].shape == (4,)
        assert not any(k.endswith(".sinks") for k in t)
    if name == "use_swa":
        assert cfg["layer_types"] == [SW] * 3 and dc["causal"] is False and cfg["is_causal"] is False


@pytest.mark.parametrize("name", ["use_swa", "causal"])
def test_speculators_round_trip(tmp_path, name):
    cfg, _ = _round_trip(tmp_path, name, "dflash-speculators")
    assert cfg["sliding_window_non_causal"] is (name != "causal")
    assert cfg["transformer_layer_config"]["use_sliding_window"] is True


def test_speculators_refuses_mixed_causality(tmp_path):
    config = registry.config_from_hf("dflash", HEADS["mixed"])
    params = registry.init_params("dflash", config, 0)
    with pytest.raises(ValueError, match="causal_layers"):
        export_checkpoint("dflash", config, params, tmp_path / "x", format="dflash-speculators")


def _rewrite(out, edit):
    cfg = json.loads((out / "config.json").read_text())
    edit(cfg)
    (out / "config.json").write_text(json.dumps(cfg))


def test_hub_use_swa_form(tmp_path):
    """MiMo-style z-lab config: ``use_swa`` + ``swa_window_size`` + ``attention_sink_bias``
    with no window keys of the Qwen config (and a top-level ``causal`` vLLM ignores)."""
    config = registry.config_from_hf("dflash", dict(HEADS["use_swa"], dflash_config=dict(
        use_swa=True, swa_window_size=12, attention_sink_bias=True)))
    params = registry.init_params("dflash", config, 0)
    out = export_checkpoint("dflash", config, params, tmp_path / "o", format="dflash")

    def edit(cfg):
        for k in ("layer_types", "use_sliding_window", "sliding_window", "max_window_layers",
                  "is_causal"):
            cfg.pop(k)
        cfg["dflash_config"].pop("causal")
        cfg["dflash_config"]["use_swa"] = True
        cfg["causal"] = True
    _rewrite(out, edit)
    got = specjax.load_pretrained(out)[1]
    assert got.replace(has_embed_tokens=None, has_lm_head=None, has_d2t=None) == config
    assert got.sliding_window == 12 and not got.causal and got.attention_sinks


def test_speculators_flag_must_be_bool(tmp_path):
    config = registry.config_from_hf("dflash", HEADS["causal"])
    out = export_checkpoint("dflash", config, registry.init_params("dflash", config, 0),
                            tmp_path / "o", format="dflash-speculators")
    _rewrite(out, lambda cfg: cfg.update(sliding_window_non_causal="no"))
    with pytest.raises(ValueError, match="sliding_window_non_causal"):
        specjax.load_pretrained(out)

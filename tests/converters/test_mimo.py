"""MiMo checkpoints (research/vllm_delta_0.33.md section 1): format ``mimo`` (the Qwen2
target, its ``model.mtp_layers.*`` dropped) and ``mimo-mtp`` (the MTP head, module 0), through
the Python API, the ``specjax-convert`` CLI, export and ``specjax.hf.load_draft``. The
checkpoint is written here from NumPy alone, and the head's params are checked against
those raw arrays (independently of the converters' tables)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

import specjax.hf
from specjax.converters import CheckpointError, cli, convert, detect_format, load_pretrained
from specjax.converters.export import export_checkpoint
from specjax.converters.readers import read_checkpoint, read_safetensors_header
from specjax.models import DecoderLM, MTPHead

H, NH, NKV, HD, I, V, L, N_MTP = 32, 4, 2, 8, 48, 64, 2, 2
BASE = dict(hidden_size=H, intermediate_size=I, num_attention_heads=NH, num_key_value_heads=NKV,
            num_hidden_layers=L, vocab_size=V, rms_norm_eps=1e-6, rope_theta=640000.0,
            max_position_embeddings=256, hidden_act="silu", tie_word_embeddings=False,
            torch_dtype="float32", use_sliding_window=False)
MIMO_CONFIG = dict(BASE, architectures=["MiMoForCausalLM"], model_type="mimo",
                   num_nextn_predict_layers=N_MTP)
QWEN2_CONFIG = dict(BASE, architectures=["Qwen2ForCausalLM"], model_type="qwen2")

#: A decoder block's PyTorch-layout shapes (Qwen2: q/k/v bias, o without).
BLOCK = {"input_layernorm.weight": (H,), "post_attention_layernorm.weight": (H,),
         "self_attn.q_proj.weight": (NH * HD, H), "self_attn.q_proj.bias": (NH * HD,),
         "self_attn.k_proj.weight": (NKV * HD, H), "self_attn.k_proj.bias": (NKV * HD,),
         "self_attn.v_proj.weight": (NKV * HD, H), "self_attn.v_proj.bias": (NKV * HD,),
         "self_attn.o_proj.weight": (H, NH * HD), "mlp.gate_proj.weight": (I, H),
         "mlp.up_proj.weight": (I, H), "mlp.down_proj.weight": (H, I)}
#: An MTP module's own tensors.
OWN = {"token_layernorm.weight": (H,), "hidden_layernorm.weight": (H,),
       "input_proj.weight": (H, 2 * H), "final_layernorm.weight": (H,)}


def mimo_arrays(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    shapes = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,),
              "lm_head.weight": (V, H)}
    for i in range(L):
        shapes.update({f"model.layers.{i}.{k}": s for k, s in BLOCK.items()})
    for i in range(N_MTP):
        shapes.update({f"model.mtp_layers.{i}.{k}": s for k, s in {**OWN, **BLOCK}.items()})
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}


def write_dir(d: Path, config: dict, arrays: dict) -> Path:
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps(config))
    save_file(arrays, str(d / "model.safetensors"))
    return d


@pytest.fixture
def mimo(tmp_path):
    arrays = mimo_arrays()
    return write_dir(tmp_path / "mimo", MIMO_CONFIG, arrays), arrays


def leaves(tree, prefix=()):
    if isinstance(tree, dict):
        out = {}
        for k, v in tree.items():
            out.update(leaves(v, prefix + (k,)))
        return out
    return {prefix: np.asarray(tree)}


def assert_params_equal(a, b):
    la, lb = leaves(a), leaves(b)
    assert sorted(la, key=str) == sorted(lb, key=str)
    for k in la:
        assert la[k].dtype == lb[k].dtype and la[k].shape == lb[k].shape, k
        assert la[k].tobytes() == lb[k].tobytes(), k


def expected_head(arrays: dict, module: int = 0) -> dict:
    """The head's params leaves, from the raw arrays: linear weights transposed
    ([out, in] -> [in, out]), norms and biases as they are."""
    src = f"model.mtp_layers.{module}."
    out = {}
    for name in list(OWN) + [f"layers.0.{k}" for k in BLOCK]:
        a = arrays[src + name.removeprefix("layers.0.")]
        parts = name.split(".")
        path = (("layers", 0) + tuple(parts[2:]) if parts[0] == "layers" else tuple(parts))
        if path[-1] == "weight" and a.ndim == 2:
            out[path[:-1] + ("kernel",)] = a.T
        else:
            out[path] = a
    return out


def check_head(params, arrays):
    got, want = leaves(params), expected_head(arrays)
    assert sorted(got, key=str) == sorted(want, key=str)
    for k, w in want.items():
        assert got[k].dtype == np.float32 and np.array_equal(got[k], w), k
    other = expected_head(arrays, 1)  # module 1 is not what was kept
    assert not np.array_equal(got[("input_proj", "kernel")], other[("input_proj", "kernel")])


def test_detection(tmp_path, mimo):
    src, arrays = mimo
    ck = read_checkpoint(src)
    assert detect_format(ck.config, ck.tensors, ck.files) == "mimo"
    # no architectures: model_type decides
    cfg = {k: v for k, v in MIMO_CONFIG.items() if k != "architectures"}
    assert detect_format(cfg, ck.tensors, ck.files) == "mimo"
    # a head-only export: MTP modules and no decoder layers
    head = {k: v for k, v in ck.tensors.items() if k.startswith("model.mtp_layers.")}
    assert detect_format(MIMO_CONFIG, head, ck.files) == "mimo-mtp"


def test_target_is_the_qwen2_trunk(tmp_path, mimo):
    src, arrays = mimo
    trunk = {k: a for k, a in arrays.items() if "mtp_layers" not in k}
    qwen2 = write_dir(tmp_path / "qwen2", QWEN2_CONFIG, trunk)
    summary = convert(src, tmp_path / "out")
    assert (summary.kind, summary.format) == ("qwen2", "mimo")
    assert any("model.mtp_layers.0." in n and "dropped" in n for n in summary.notes)
    meta = json.loads((tmp_path / "out" / "specjax.json").read_text())
    assert not any("mtp_layers" in k for k in meta["arrays"])
    kind, config, params = load_pretrained(tmp_path / "out")
    kind2, config2, params2 = load_pretrained(qwen2)
    assert kind == kind2 == "qwen2" and config == config2
    assert_params_equal(params, params2)
    assert not any("mtp" in str(p) for p in leaves(params))
    # load_model of the original directory: the same target
    model, kind3, _, params3 = specjax.hf.load_model(src)
    assert isinstance(model, DecoderLM) and kind3 == "qwen2"
    assert_params_equal(params3, params2)


def test_head_through_the_api_and_the_cli(tmp_path, mimo, capsys):
    src, arrays = mimo
    summary = convert(src, tmp_path / "api", format="mimo-mtp")
    assert (summary.kind, summary.format) == ("mtp", "mimo-mtp")
    assert any("model.mtp_layers.1." in n and "spec_step_idx" in n for n in summary.notes)
    assert cli.main([str(src), str(tmp_path / "cli"), "--format", "mimo-mtp", "-q"]) == 0
    assert "spec_step_idx" in capsys.readouterr().out
    for out in ("api", "cli"):
        kind, config, params = load_pretrained(tmp_path / out)
        assert kind == "mtp" and config.n_predict == N_MTP and config.num_hidden_layers == 1
        assert config.qkv_bias and not config.o_bias and config.hidden_size == H
        check_head(params, arrays)
    meta = json.loads((tmp_path / "cli" / "specjax.json").read_text())
    assert meta["hf_config"]["num_nextn_predict_layers"] == N_MTP
    assert meta["hf_config"]["num_hidden_layers"] == 1


@pytest.mark.parametrize("edit, needles", [
    (lambda cfg, a: a.pop("model.mtp_layers.0.input_proj.weight"),
     ["model.mtp_layers.0.input_proj.weight", "missing"]),
    (lambda cfg, a: a.pop("model.mtp_layers.0.self_attn.k_proj.bias"),
     ["model.mtp_layers.0.self_attn.k_proj.bias"]),
    (lambda cfg, a: cfg.update(num_nextn_predict_layers=3),
     ["num_nextn_predict_layers=3", "2 modules"]),
    (lambda cfg, a: [a.pop(k) for k in list(a) if k.startswith("model.mtp_layers.1.")],
     ["num_nextn_predict_layers=2", "1 modules"]),
    (lambda cfg, a: [a.pop(k) for k in list(a) if k.startswith("model.mtp_layers.")],
     ["num_nextn_predict_layers=2", "no model.mtp_layers"]),
])
def test_bad_head_is_refused_and_nothing_is_written(tmp_path, capsys, edit, needles):
    arrays, cfg = mimo_arrays(), dict(MIMO_CONFIG)
    edit(cfg, arrays)
    src = write_dir(tmp_path / "src", cfg, arrays)
    dst = tmp_path / "out"
    with pytest.raises(CheckpointError) as e:
        convert(src, dst, format="mimo-mtp")
    assert all(n in str(e.value) for n in needles), str(e.value)
    assert cli.main([str(src), str(dst), "--format", "mimo-mtp", "-q"]) == 1
    err = capsys.readouterr().err
    assert all(n in err for n in needles), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]  # no DST, no staging dir
    with pytest.raises(CheckpointError, match="mimo-mtp"):
        specjax.hf.load_draft(src, "mtp")


def test_head_export_round_trip(tmp_path, mimo):
    src, arrays = mimo
    kind, config, params = load_pretrained(src, format="mimo-mtp")
    with pytest.raises(ValueError, match="n_predict=2"):
        export_checkpoint(kind, config, params, tmp_path / "x", format="mimo-mtp")
    assert not (tmp_path / "x").exists()
    one = config.replace(n_predict=1)
    out = export_checkpoint(kind, one, params, tmp_path / "head", format="mimo-mtp", dtype="fp32")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["MiMoForCausalLM"] and cfg["model_type"] == "mimo"
    assert cfg["num_nextn_predict_layers"] == 1 and cfg["num_hidden_layers"] == 0
    t = read_safetensors_header(out / "model.safetensors")
    head = {k: a for k, a in arrays.items() if k.startswith("model.mtp_layers.0.")}
    assert sorted(t) == sorted(head)
    for k, a in head.items():
        assert np.array_equal(t[k].load(), a), k
    kind2, config2, params2 = load_pretrained(out)  # auto-detected as mimo-mtp
    assert kind2 == "mtp" and config2 == one
    assert_params_equal(params2, params)
    # the target exports as a MiMo checkpoint without MTP modules, and reads back as mimo
    tkind, tconfig, tparams = load_pretrained(src)
    tout = export_checkpoint(tkind, tconfig, tparams, tmp_path / "target", format="mimo")
    ck = read_checkpoint(tout)
    assert detect_format(ck.config, ck.tensors, ck.files) == "mimo"
    assert ck.config["num_nextn_predict_layers"] == 0
    assert not any("mtp_layers" in k for k in ck.tensors)


def test_load_draft(tmp_path, mimo):
    src, arrays = mimo
    convert(src, tmp_path / "conv", format="mimo-mtp")
    runner, params = specjax.hf.load_draft(src, "mtp")  # the target's own directory
    runner2, params2 = specjax.hf.load_draft(tmp_path / "conv", "mtp")
    assert isinstance(runner, MTPHead) and isinstance(runner2, MTPHead)
    assert runner.config == runner2.config and runner.config.n_predict == N_MTP
    assert_params_equal(params, params2)
    check_head(params, arrays)
    assert specjax.hf.DRAFT_KIND_METHODS["mtp"] == "mtp"
    with pytest.raises(ValueError, match=r"'qwen2' checkpoint.*method='eagle'"):
        specjax.hf.load_draft(src, "eagle")
    with pytest.raises(ValueError, match=r"'mtp' checkpoint.*method='eagle'"):
        specjax.hf.load_draft(tmp_path / "conv", "eagle")
    qwen2 = write_dir(tmp_path / "qwen2", QWEN2_CONFIG,
                      {k: a for k, a in arrays.items() if "mtp_layers" not in k})
    with pytest.raises(CheckpointError, match=r"format 'mimo-mtp'.*no model.mtp_layers"):
        specjax.hf.load_draft(qwen2, "mtp")

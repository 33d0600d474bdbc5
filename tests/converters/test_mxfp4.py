"""gpt-oss's MXFP4 experts: ``converters/mxfp4.py`` against a per-element NumPy oracle
written from the OCP MX spec (E2M1 codes, E8M0 scales); a tiny MXFP4 gpt-oss checkpoint
written here, converted and exported back; other quantizations refused by name."""

from __future__ import annotations

import suite_paths  # noqa: F401 (tests/support on the path)
import json
import math
import tracemalloc

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

import specjax
from specjax.converters import CheckpointError, convert, load_pretrained
from specjax.converters.export import export_checkpoint
from specjax.converters.mxfp4 import dequantize_mxfp4, experts_ref
from specjax.converters.readers import read_checkpoint, read_safetensors_header
from specjax.converters.tensor_ref import TensorRef
from specjax.models import registry

BF16 = np.dtype(ml_dtypes.bfloat16)
# tiny gpt-oss: H and I multiples of the 32-value MXFP4 block
H, I, E, NH, NKV, HD, V, L = 64, 32, 4, 4, 2, 16, 48, 2


# -- the oracle: one value at a time, from the spec --------------------------------------------

def e2m1(code: int) -> float:
    """OCP MX E2M1: sign bit 3, exponent bits 2..1 (bias 1), mantissa bit 0; exponent 0 is
    subnormal (0 or 0.5)."""
    sign = -1.0 if code & 0b1000 else 1.0
    exp, man = (code >> 1) & 0b11, code & 1
    mag = man * 0.5 if exp == 0 else 2.0 ** (exp - 1) * (1 + man / 2)
    return sign * mag


def oracle(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """float32 ``[..., G*32]``: value 2j of a block from byte j's low nibble, 2j+1 from its
    high nibble, times 2^(scale - 127) (scale 255: NaN)."""
    *lead, g, nb = blocks.shape
    out = np.zeros((*lead, g * nb * 2), np.float64)
    for idx in np.ndindex(*lead, g):
        s = int(scales[idx])
        for j in range(nb):
            byte = int(blocks[idx + (j,)])
            for half, code in enumerate((byte & 0xF, byte >> 4)):
                v = math.nan if s == 255 else math.ldexp(e2m1(code), s - 127)
                out[idx[:-1] + (idx[-1] * nb * 2 + 2 * j + half,)] = v
    with np.errstate(over="ignore"):   # scale 254 x |v| >= 2 exceeds float32: inf
        return out.astype(np.float32)


def test_e2m1_table():
    assert [e2m1(c) for c in range(16)] == [0, .5, 1, 1.5, 2, 3, 4, 6,
                                            -0., -.5, -1, -1.5, -2, -3, -4, -6]
    assert math.copysign(1, e2m1(8)) == -1.0


def test_dequantize_matches_the_oracle():
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (2, 3, 4, 16), dtype=np.uint8)
    scales = rng.integers(100, 150, (2, 3, 4), dtype=np.uint8)
    scales[0, 0, :] = [0, 1, 254, 255]            # the extremes and the NaN scale
    want = oracle(blocks, scales)
    got = dequantize_mxfp4(blocks, scales)
    assert got.dtype == np.float32 and got.shape == (2, 3, 128)
    np.testing.assert_array_equal(got, want)       # NaN where the oracle has NaN
    assert np.isnan(got[0, 0, 96:]).all() and not np.isnan(got[0, 0, :96]).any()
    assert np.isinf(got[0, 0, 64:96]).any()    # 2^127 x 6 overflows, as in transformers
    # bf16 holds every value exactly (at most 2 mantissa bits, 2^-128 .. 2^127)
    ok = scales[..., None].repeat(32, -1).reshape(got.shape) != 255
    as_bf16 = dequantize_mxfp4(blocks, scales, BF16)
    np.testing.assert_array_equal(as_bf16.astype(np.float32)[ok], want[ok])


def test_checks_name_the_key():
    b, s = np.zeros((2, 3, 16), np.uint8), np.zeros((2, 3), np.uint8)
    with pytest.raises(CheckpointError, match="w_blocks: MXFP4 blocks must be uint8"):
        dequantize_mxfp4(b.astype(np.int8), s, key="w")
    with pytest.raises(CheckpointError, match="w_scales: MXFP4 scales must be uint8"):
        dequantize_mxfp4(b, s.astype(np.float32), key="w")
    with pytest.raises(CheckpointError, match=r"w_blocks \[2, 3, 16\] / w_scales \[2, 4\]"):
        dequantize_mxfp4(b, np.zeros((2, 4), np.uint8), key="w")
    with pytest.raises(CheckpointError, match=r"w_blocks \[2, 3, 8\]"):
        dequantize_mxfp4(np.zeros((2, 3, 8), np.uint8), s, key="w")
    with pytest.raises(CheckpointError, match=r"w_blocks has shape \[2, 3, 16\]"):
        experts_ref(TensorRef.from_array(b), TensorRef.from_array(s), "w")


def test_experts_layout_rows_and_columns_swapped():
    rng = np.random.default_rng(1)
    blocks = rng.integers(0, 256, (3, 5, 2, 16), dtype=np.uint8)
    scales = rng.integers(110, 140, (3, 5, 2), dtype=np.uint8)
    ref = experts_ref(TensorRef.from_array(blocks), TensorRef.from_array(scales), "x")
    assert ref.shape == (3, 64, 5) and ref.dtype == BF16
    got = ref.load()
    want = oracle(blocks, scales).transpose(0, 2, 1)
    np.testing.assert_array_equal(got.astype(np.float32), want)


# -- a tiny MXFP4 gpt-oss checkpoint ------------------------------------------------------------

def hf_config(**kw) -> dict:
    """A config.json as the Hub's gpt-oss-20b (transformers 4 keys), shrunk."""
    cfg = dict(
        architectures=["GptOssForCausalLM"], model_type="gpt_oss", vocab_size=V, hidden_size=H,
        intermediate_size=I, num_hidden_layers=L, num_attention_heads=NH,
        num_key_value_heads=NKV, head_dim=HD, num_local_experts=E, num_experts_per_tok=2,
        experts_per_token=2, sliding_window=8, layer_types=["sliding_attention", "full_attention"],
        attention_bias=True, rms_norm_eps=1e-5, rope_theta=150000.0,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                      "original_max_position_embeddings": 64, "truncate": False},
        max_position_embeddings=256, swiglu_limit=7.0, hidden_act="silu",
        tie_word_embeddings=False, torch_dtype="bfloat16", router_aux_loss_coef=0.9,
        quantization_config={"quant_method": "mxfp4", "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
            "lm_head"]})
    cfg.update(kw)
    return cfg


def mxfp4_tensors(seed: int = 0, *, h=H, i=I, e=E, layers=L, canonical=True):
    """(on-disk tensors, canonical float32 tensors by the oracle, or None)."""
    rng = np.random.default_rng(seed)

    def bf16(*shape):
        return (rng.standard_normal(shape) * 0.5).astype(BF16)

    disk = {"model.embed_tokens.weight": bf16(V, h), "model.norm.weight": bf16(h),
            "lm_head.weight": bf16(V, h)}
    for n in range(layers):
        p = f"model.layers.{n}."
        for x, (o, n_in) in dict(q=(NH * HD, h), k=(NKV * HD, h), v=(NKV * HD, h),
                                 o=(h, NH * HD)).items():
            disk[f"{p}self_attn.{x}_proj.weight"] = bf16(o, n_in)
            disk[f"{p}self_attn.{x}_proj.bias"] = bf16(o)
        disk.update({f"{p}self_attn.sinks": bf16(NH), f"{p}input_layernorm.weight": bf16(h),
                     f"{p}post_attention_layernorm.weight": bf16(h),
                     f"{p}mlp.router.weight": bf16(e, h), f"{p}mlp.router.bias": bf16(e),
                     f"{p}mlp.experts.gate_up_proj_bias": bf16(e, 2 * i),
                     f"{p}mlp.experts.down_proj_bias": bf16(e, h)})
        for name, rows, cols in (("gate_up_proj", 2 * i, h), ("down_proj", h, i)):
            disk[f"{p}mlp.experts.{name}_blocks"] = rng.integers(
                0, 256, (e, rows, cols // 32, 16), dtype=np.uint8)
            disk[f"{p}mlp.experts.{name}_scales"] = rng.integers(
                118, 130, (e, rows, cols // 32), dtype=np.uint8)
    if not canonical:
        return disk, None
    canon = {}
    for k, a in disk.items():
        if k.endswith("_blocks"):
            base = k[: -len("_blocks")]
            canon[base] = oracle(a, disk[base + "_scales"]).transpose(0, 2, 1)
        elif not k.endswith("_scales"):
            canon[k] = a.astype(np.float32)
    return disk, canon


def write(root, cfg=None, disk=None, name="src"):
    d = root / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg or hf_config()))
    save_file(disk if disk is not None else mxfp4_tensors()[0], str(d / "model.safetensors"))
    return d


def assert_params_equal(got, want):
    g = {registry._dotted(p): np.asarray(v) for p, v in registry._leaf_paths(got).items()}
    w = {registry._dotted(p): np.asarray(v) for p, v in registry._leaf_paths(want).items()}
    assert sorted(g) == sorted(w)
    for k in w:
        assert g[k].dtype == w[k].dtype and g[k].shape == w[k].shape, k
        assert g[k].tobytes() == w[k].tobytes(), k


def test_mxfp4_checkpoint_converts_to_the_oracle(tmp_path):
    disk, canon = mxfp4_tensors()
    src = write(tmp_path, disk=disk)
    kind, config, params = specjax.load_pretrained(src, "float32")
    assert kind == "gpt_oss" and config.num_experts == E and config.moe_intermediate_size == I
    want = registry.params_from_tensors("gpt_oss", config, canon, np.float32)
    assert_params_equal(params, want)
    # the streamed conversion: bf16 (the checkpoint's own dtype; the dequantization is exact)
    summary = convert(src, tmp_path / "out")
    assert summary.dtype == "bf16" and summary.format == "gpt_oss"
    assert any("MXFP4" in n for n in summary.notes)
    meta = json.loads((tmp_path / "out" / "specjax.json").read_text())
    assert "quantization_config" not in meta["hf_config"]
    _, _, p16 = load_pretrained(tmp_path / "out", "float32")
    assert_params_equal(p16, want)


def test_conversion_streams_one_tensor_at_a_time(tmp_path):
    """10 layers of MXFP4 experts (60 MiB once dequantized): the conversion's traced peak
    stays near one layer's tensor (4 MiB) plus one part, far below all of them."""
    n, h, i, e = 10, 256, 512, 8
    disk, _ = mxfp4_tensors(h=h, i=i, e=e, layers=n, canonical=False)
    cfg = hf_config(hidden_size=h, intermediate_size=i, num_local_experts=e,
                    num_hidden_layers=n, layer_types=["sliding_attention"] * n)
    src = write(tmp_path, cfg, disk)
    tracemalloc.start()
    try:
        convert(src, tmp_path / "out", piece_bytes=2**20)
        _cur, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 30 * 2**20, peak


def test_bf16_checkpoint_passes_through(tmp_path):
    _, canon = mxfp4_tensors()
    disk = {k: np.ascontiguousarray(v, BF16) for k, v in canon.items()}
    cfg = hf_config()
    cfg.pop("quantization_config")
    _, config, params = load_pretrained(write(tmp_path, cfg, disk), "float32")
    assert_params_equal(params, registry.params_from_tensors("gpt_oss", config, canon,
                                                             np.float32))


@pytest.mark.parametrize("qcfg", [{"quant_method": "fp8", "weight_block_size": [128, 128]},
                                  {"quant_method": "awq", "bits": 4},
                                  {"quant_method": "gptq", "bits": 4}])
def test_other_quantizations_are_refused_by_name(tmp_path, qcfg):
    src = write(tmp_path, hf_config(quantization_config=qcfg))
    with pytest.raises(CheckpointError, match=rf"quantization_config\.quant_method="
                                              rf"'{qcfg['quant_method']}'"):
        convert(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_mxfp4_on_another_format_is_refused(tmp_path):
    from converter_cases import CASES

    case = CASES["llama"]
    cfg = dict(case.config, quantization_config={"quant_method": "mxfp4"})
    d, _ = case.write(tmp_path)
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"quantization_config\.quant_method='mxfp4'"):
        load_pretrained(d)
    with pytest.raises(CheckpointError, match=r"quant_method='mxfp4'"):
        load_pretrained(d, format="qwen3")


@pytest.mark.parametrize("edit,needle", [
    (lambda t: t.pop("model.layers.1.mlp.experts.down_proj_scales"),
     r"model\.layers\.1\.mlp\.experts\.down_proj_blocks: MXFP4 without "
     r"model\.layers\.1\.mlp\.experts\.down_proj_scales"),
    (lambda t: t.pop("model.layers.0.mlp.experts.gate_up_proj_blocks"),
     r"gate_up_proj_scales: MXFP4 without model\.layers\.0\.mlp\.experts\.gate_up_proj_blocks"),
    (lambda t: t.update({"model.layers.0.mlp.experts.down_proj_scales":
                         np.zeros((E, H, I // 32), np.float32)}),
     r"down_proj_scales: MXFP4 scales must be uint8"),
    (lambda t: t.update({"model.layers.0.mlp.experts.down_proj_scales":
                         np.zeros((E, H, 2), np.uint8)}),
     r"down_proj_blocks \[4, 64, 1, 16\] / model\.layers\.0\.mlp\.experts\.down_proj_scales"),
    (lambda t: t.update({"model.layers.0.self_attn.q_proj.weight_blocks":
                         np.zeros((4, 2, 16), np.uint8)}),
     r"q_proj\.weight_blocks: an MXFP4 tensor outside the experts"),
    (lambda t: t.update({"model.layers.0.mlp.experts.down_proj":
                         np.zeros((E, I, H), BF16)}),
     r"experts\.down_proj: stored both dequantized and as MXFP4"),
])
def test_half_quantized_layers_are_refused_by_key(tmp_path, edit, needle):
    disk, _ = mxfp4_tensors()
    edit(disk)
    with pytest.raises(CheckpointError, match=needle):
        load_pretrained(write(tmp_path, disk=disk))


def test_nan_scale_is_refused_as_nonfinite(tmp_path):
    disk, _ = mxfp4_tensors()
    disk["model.layers.1.mlp.experts.gate_up_proj_scales"][2, 3, 0] = 255
    with pytest.raises(CheckpointError, match=r"gate_up_proj.*NaN"):
        load_pretrained(write(tmp_path, disk=disk))


def test_defaults_and_detection(tmp_path):
    """GptOssConfig's defaults fill omitted keys (RoPE: θ 150000, YaRN x32; even layers
    sliding); model_type alone is enough to detect the format."""
    cfg = hf_config(architectures=None)
    for k in ("rope_theta", "rope_scaling", "layer_types", "attention_bias"):
        cfg.pop(k)
    src = write(tmp_path, cfg)
    ckpt = read_checkpoint(src)
    from specjax.converters import detect_format, normalize
    assert detect_format(ckpt.config, ckpt.tensors, ckpt.files) == "gpt_oss"
    norm = normalize("gpt_oss", ckpt.config, ckpt.tensors)
    assert norm.hf_config["rope_theta"] == 150000.0
    assert norm.hf_config["rope_scaling"]["rope_type"] == "yarn"
    assert norm.hf_config["attention_bias"] is True
    assert any("GptOssConfig defaults" in n for n in norm.notes)
    _, config, _ = load_pretrained(src)
    assert config.layer_window(0) == 8 and not config.layer_window(1)


def test_export_round_trip(tmp_path):
    _, config, params = load_pretrained(write(tmp_path), "float32")
    out = export_checkpoint("gpt_oss", config, params, tmp_path / "exp", format="gpt_oss",
                            dtype="bf16")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["GptOssForCausalLM"] and "quantization_config" not in cfg
    assert cfg["num_local_experts"] == E and cfg["intermediate_size"] == I
    assert cfg["layer_types"] == ["sliding_attention", "full_attention"]
    t = read_safetensors_header(out / "model.safetensors")
    assert t["model.layers.0.mlp.experts.gate_up_proj"].shape == (E, H, 2 * I)
    assert t["model.layers.1.mlp.experts.down_proj"].shape == (E, I, H)
    assert t["model.layers.0.self_attn.sinks"].shape == (NH,)
    assert not any(k.endswith(("_blocks", "_scales")) for k in t)
    kind, config2, params2 = load_pretrained(out, "float32")
    assert kind == "gpt_oss" and config2 == config
    assert_params_equal(params2, params)   # bf16 values: exact after a bf16 round trip

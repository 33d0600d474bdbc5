"""Converters: readers (safetensors, torch zip without torch), every format's normalizer,
validation errors, orbax round trip, ``load_pretrained``, the ``specjax-convert`` CLI and
its atomicity, and the refusal of a malicious pickle. CPU only, no torch."""

from __future__ import annotations

import suite_paths  # tests/support: where the suite's pieces are
import json
import os
import pickle
import subprocess
import sys
import zipfile
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

import specjax
from specjax.converters import (
    CheckpointError,
    DestinationExistsError,
    FormatDetectionError,
    TensorMismatchError,
    UnsafePickleError,
    convert,
    detect_format,
    load_pretrained,
    normalize,
    read_checkpoint,
    read_safetensors_header,
    read_torch_file,
)
from specjax.converters import cli, pipeline
from specjax.converters.formats import zlab_default_target_layer_ids
from specjax.models import registry

from converter_cases import (
    CASES,
    H,
    V,
    Storage,
    View,
    llama_config,
    malicious_pickle_zip,
    write_layout,
    write_torch_zip,
)

BF16 = np.dtype(ml_dtypes.bfloat16)


def _eq(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    if a.dtype == BF16 and b.dtype == BF16:  # compare bits
        a, b = np.ascontiguousarray(a).view(np.uint16), np.ascontiguousarray(b).view(np.uint16)
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)


def _canonical_arrays(case, arrays, dtype):
    """The canonical tensors, built from the case's own key table (not the normalizer)."""
    out = {}
    for k, a in arrays.items():
        new = case.canonical[k]
        if new is None:
            continue
        if np.issubdtype(a.dtype, np.integer):
            out[new] = a.astype(np.int32)
        else:
            out[new] = a.astype(dtype)
    return out


def _tree_equal(a, b) -> bool:
    la, ta = jax.tree.flatten(a)
    lb, tb = jax.tree.flatten(b)
    return ta == tb and all(_eq(x, y) for x, y in zip(la, lb))


# -- readers ------------------------------------------------------------------------------

DTYPES = [np.float32, np.float16, ml_dtypes.bfloat16, np.int64, np.int32, np.bool_]


def _sample(dtype, shape=(3, 5), seed=0):
    rng = np.random.default_rng(seed)
    if np.dtype(dtype) == np.bool_:
        return rng.random(shape) < 0.5
    if np.issubdtype(np.dtype(dtype), np.integer):
        return rng.integers(-1000, 1000, size=shape).astype(dtype)
    return rng.standard_normal(shape).astype(np.float32).astype(dtype)


@pytest.mark.smoke
def test_safetensors_reader_every_dtype(tmp_path):
    arrays = {f"t{i}": _sample(dt, seed=i) for i, dt in enumerate(DTYPES)}
    arrays["scalar"] = np.array(7, np.int64)
    save_file(arrays, str(tmp_path / "model.safetensors"))
    refs = read_safetensors_header(tmp_path / "model.safetensors")
    assert set(refs) == set(arrays)
    for k, a in arrays.items():
        assert refs[k].shape == a.shape and refs[k].dtype == a.dtype
        assert _eq(refs[k].load(), a), k


def test_safetensors_reader_refuses_bad_offsets(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file({"w": np.ones((4, 4), np.float32)}, str(path))
    path.write_bytes(path.read_bytes()[:-8])  # truncated data
    with pytest.raises(CheckpointError, match="'w'"):
        read_safetensors_header(path)


@pytest.mark.smoke
def test_torch_zip_reader_every_dtype(tmp_path):
    arrays = {f"t{i}": _sample(dt, seed=i) for i, dt in enumerate(DTYPES)}
    write_torch_zip(tmp_path / "pytorch_model.bin", arrays)
    refs = read_torch_file(tmp_path / "pytorch_model.bin")
    assert list(refs) == list(arrays)
    for k, a in arrays.items():
        assert refs[k].shape == a.shape and refs[k].dtype == a.dtype
        assert _eq(refs[k].load(), a), k


def test_torch_zip_reader_views_follow_rebuild_tensor_v2(tmp_path):
    base = np.arange(60, dtype=np.float32)
    st = Storage("0", base)
    views = {
        "full": View(st, 0, (6, 10), (10, 1)),
        "offset_rows": View(st, 20, (2, 10), (10, 1)),      # a slice w[2:4]
        "transposed": View(st, 0, (10, 6), (1, 10)),         # w.T
        "strided": View(st, 3, (3, 4), (20, 2)),             # w[::2, 3::2]-like
        "broadcast": View(st, 5, (4, 3), (0, 1)),            # expand()
        "empty": View(st, 0, (0, 7), (7, 1)),
    }
    bf = Storage("1", np.arange(12).astype(ml_dtypes.bfloat16))
    views["bf16_T"] = View(bf, 0, (4, 3), (1, 4))
    write_torch_zip(tmp_path / "x.pt", views)
    refs = read_torch_file(tmp_path / "x.pt")
    for k, v in views.items():
        assert _eq(refs[k].load(), v.array()), k


def test_torch_zip_reader_refuses_out_of_bounds_view(tmp_path):
    st = Storage("0", np.zeros(10, np.float32))
    write_torch_zip(tmp_path / "x.pt", {"w": View(st, 4, (3, 3), (3, 1))})
    with pytest.raises(CheckpointError, match="reads past the end of storage 0"):
        read_torch_file(tmp_path / "x.pt")


@pytest.mark.smoke
@pytest.mark.parametrize("module,name", [("os", "system"), ("posix", "system"),
                                         ("subprocess", "check_call"),
                                         ("builtins", "exec")])
def test_malicious_pickle_is_refused_without_running(tmp_path, module, name):
    marker = tmp_path / "pwned"
    payload = f"touch {marker}"
    if name == "exec":
        payload = f"open({str(marker)!r}, 'w').write('x')"
    path = tmp_path / "pytorch_model.bin"
    malicious_pickle_zip(path, payload)
    data = zipfile.ZipFile(path).read("archive/data.pkl").replace(
        b"cos\nsystem\n", f"c{module}\n{name}\n".encode())
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("archive/data.pkl", data)
        zf.writestr("archive/version", "3\n")
    with pytest.raises(UnsafePickleError) as e:
        read_torch_file(path)
    assert f"{module}.{name}" in str(e.value) and e.value.global_name == f"{module}.{name}"
    assert not marker.exists()
    # The same file through the whole pipeline: refused, nothing run, nothing written.
    (tmp_path / "config.json").write_text(json.dumps(llama_config()))
    with pytest.raises(UnsafePickleError):
        load_pretrained(tmp_path)
    assert not marker.exists()


class _Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_malicious_protocol4_pickle_is_refused(tmp_path):
    """A real pickler's output (protocol 4, STACK_GLOBAL) hidden inside a state dict."""
    marker = tmp_path / "pwned"
    path = tmp_path / "model.pt"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("model/data.pkl", pickle.dumps({"w": _Evil(marker)}, protocol=4))
        zf.writestr("model/version", "3\n")
    with pytest.raises(UnsafePickleError, match=r"(posix|os)\.system"):
        read_torch_file(path)
    assert not marker.exists()


def test_malicious_pickle_via_cli(tmp_path, capsys):
    src = tmp_path / "src"
    src.mkdir()
    marker = tmp_path / "pwned"
    malicious_pickle_zip(src / "pytorch_model.bin", f"touch {marker}")
    assert cli.main([str(src), str(tmp_path / "out")]) == 1
    assert "os.system" in capsys.readouterr().err
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_torch_reader_refuses_non_archives(tmp_path):
    (tmp_path / "legacy.bin").write_bytes(b"\x80\x02\x8a\x0alegacy-torch-magic")
    with pytest.raises(CheckpointError, match="legacy"):
        read_torch_file(tmp_path / "legacy.bin")
    with zipfile.ZipFile(tmp_path / "other.bin", "w") as zf:
        zf.writestr("hello.txt", "hi")
    with pytest.raises(CheckpointError, match="not torch.save output"):
        read_torch_file(tmp_path / "other.bin")


def test_weight_file_choice_skips_trainer_state(tmp_path):
    """pytorch_model.bin is read; training_args.bin (a pickle of arbitrary objects, here a
    hostile one) is never opened; safetensors win over .bin when both exist."""
    case = CASES["eagle"]
    src, arrays = case.write(tmp_path)
    marker = tmp_path / "pwned"
    malicious_pickle_zip(src / "training_args.bin", f"touch {marker}")
    ckpt = read_checkpoint(src)
    assert [Path(f).name for f in ckpt.files] == ["pytorch_model.bin"]
    save_file({"fc.weight": arrays["fc.weight"]}, str(src / "model.safetensors"))
    assert [Path(f).name for f in read_checkpoint(src).files] == ["model.safetensors"]
    (src / "model.safetensors").unlink()
    (src / "pytorch_model.bin").rename(src / "eagle_weights.pt")
    assert [Path(f).name for f in read_checkpoint(src).files] == ["eagle_weights.pt"]
    assert not marker.exists()


def test_sharded_index_errors(tmp_path):
    case = CASES["llama"]
    d, _ = case.write(tmp_path)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.ghost.weight"] = "model-00001-of-00002.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="model.ghost.weight"):
        read_checkpoint(d)


# -- formats --------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(CASES))
def test_normalizer(tmp_path, name):
    case = CASES[name]
    d, arrays = case.write(tmp_path)
    ckpt = read_checkpoint(d)
    assert detect_format(ckpt.config, ckpt.tensors, ckpt.files) == case.fmt
    norm = normalize(case.fmt, ckpt.config, ckpt.tensors)
    assert norm.kind == case.kind
    assert set(norm.tensors) == {v for v in case.canonical.values() if v}
    for k, a in arrays.items():
        new = case.canonical[k]
        if new is not None:
            got = norm.tensors[new].load()
            want = a.astype(np.int32) if np.issubdtype(a.dtype, np.integer) else a
            assert _eq(got, want), k
    for field, want in case.hf_checks.items():
        assert norm.hf_config.get(field) == want, field


@pytest.mark.smoke
@pytest.mark.parametrize("name", sorted(CASES))
def test_convert_and_orbax_round_trip_exact(tmp_path, name):
    case = CASES[name]
    src, arrays = case.write(tmp_path)
    dst = tmp_path / "out"
    summary = convert(src, dst)
    assert summary.kind == case.kind and summary.format == case.fmt
    meta = json.loads((dst / "specjax.json").read_text())
    assert meta["kind"] == case.kind and meta["format"] == case.fmt
    dtype = np.dtype(pipeline.DTYPES[meta["dtype"]])
    kind, config, params = load_pretrained(dst)
    assert kind == case.kind
    want = registry.params_from_tensors(kind, config, _canonical_arrays(case, arrays, dtype),
                                        dtype)
    assert _tree_equal(params, want)
    # Straight from the original directory: the same config and params.
    kind2, config2, params2 = load_pretrained(src)
    assert (kind2, config2) == (kind, config)
    assert _tree_equal(params2, want)


def test_dtype_conversion_and_specjax_reexport(tmp_path):
    case = CASES["dflash"]  # bf16 on disk
    src, arrays = case.write(tmp_path)
    assert specjax.load_pretrained is load_pretrained
    kind, config, p32 = specjax.load_pretrained(src, dtype="fp32")
    assert p32["fc"]["kernel"].dtype == np.float32
    convert(src, tmp_path / "out", dtype="fp16")
    assert json.loads((tmp_path / "out" / "specjax.json").read_text())["dtype"] == "fp16"
    _, _, p16 = load_pretrained(tmp_path / "out")
    assert p16["fc"]["kernel"].dtype == np.float16
    _, _, pbf = load_pretrained(tmp_path / "out", dtype="bf16")
    assert pbf["fc"]["kernel"].dtype == BF16
    np.testing.assert_array_equal(np.asarray(p16["fc"]["kernel"]),
                                  arrays["fc.weight"].astype(np.float16).T)


def test_int_maps_stay_int32(tmp_path):
    case = CASES["eagle3"]
    src, arrays = case.write(tmp_path)
    convert(src, tmp_path / "out", dtype="bf16")
    _, config, params = load_pretrained(tmp_path / "out", dtype="fp16")
    assert config.has_d2t and params["d2t"].dtype == np.int32
    np.testing.assert_array_equal(np.asarray(params["d2t"]), arrays["d2t"])
    assert params["lm_head"]["kernel"].dtype == np.float16


def test_explicit_format_overrides_detection(tmp_path):
    case = CASES["llama"]
    cfg = dict(case.config)
    del cfg["architectures"], cfg["model_type"]
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(cfg))
    write_layout(src, case.arrays(), "safetensors")
    with pytest.raises(FormatDetectionError, match="--format"):
        load_pretrained(src)
    kind, config, _ = load_pretrained(src, format="llama")
    assert kind == "llama" and config.num_hidden_layers == 2
    with pytest.raises(FormatDetectionError, match="allowed"):
        load_pretrained(src, format="gpt2")


def test_zlab_default_target_layer_ids():
    # Qwen3-8B-DFlash-b16 ships target_layer_ids [1, 9, 17, 25, 33] for 36 target layers.
    assert zlab_default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert zlab_default_target_layer_ids(32, 1) == [16]


def test_dflash_without_target_layer_ids_uses_zlab_default_plus_one(tmp_path):
    case = CASES["dflash"]
    cfg = json.loads(json.dumps(case.config))
    del cfg["dflash_config"]["target_layer_ids"]
    cfg["num_target_layers"] = 8  # 2 draft layers -> z-lab [1, 5]; fc takes 2 states
    shapes = dict(case.shapes, **{"fc.weight": (H, 2 * H)})
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(cfg))
    arrays = type(case)(**{**case.__dict__, "shapes": shapes}).arrays()
    write_layout(src, arrays, "safetensors")
    _, config, _ = load_pretrained(src)
    assert config.aux_layer_ids == (2, 6)


def test_medusa_shared_resblock_is_repeated(tmp_path):
    """[ResBlock] * 2: both layer indices point at one storage; or only index 0 stored."""
    rng = np.random.default_rng(0)
    tensors, expect = {}, {}
    for h in range(2):
        w = rng.standard_normal((H, H)).astype(np.float16)
        b = rng.standard_normal(H).astype(np.float16)
        sw, sb = Storage(f"w{h}", w.reshape(-1)), Storage(f"b{h}", b)
        for l in range(2):
            if h == 1 and l == 1:
                continue  # head 1 keeps only index 0: repeated by the converter
            tensors[f"{h}.{l}.linear.weight"] = View(sw, 0, (H, H), (H, 1))
            tensors[f"{h}.{l}.linear.bias"] = View(sb, 0, (H,), (1,))
        tensors[f"{h}.2.weight"] = rng.standard_normal((V, H)).astype(np.float16)
        expect[h] = (w, b)
    src = tmp_path / "src"
    src.mkdir()
    write_torch_zip(src / "medusa_lm_head.pt", tensors)
    (src / "config.json").write_text(json.dumps({"medusa_num_heads": 2,
                                                 "medusa_num_layers": 2}))
    kind, config, params = load_pretrained(src / "medusa_lm_head.pt")  # a file path works
    assert kind == "medusa" and config.num_heads == 2 and config.num_hidden_layers == 2
    assert config.fc_bias
    for h, (w, b) in expect.items():
        for l in range(2):
            layer = params["blocks"][h]["layers"][l]
            np.testing.assert_array_equal(np.asarray(layer["kernel"]), w.T)
            np.testing.assert_array_equal(np.asarray(layer["bias"]), b)


def test_medusa_vllm_token_map_and_original_lm_head(tmp_path):
    rng = np.random.default_rng(1)
    token_map = np.sort(rng.choice(V, 20, replace=False)).astype(np.int64)
    lm = rng.standard_normal((V, H)).astype(np.float32)
    arrays = {"medusa_heads.blocks.0.layers.0.weight": rng.standard_normal((H, H)),
              "medusa_heads.blocks.1.layers.0.weight": rng.standard_normal((H, H)),
              "medusa_heads.lm_heads.0.weight": lm, "medusa_heads.token_map": token_map}
    arrays = {k: (v.astype(np.float32) if v.dtype == np.float64 else v)
              for k, v in arrays.items()}
    src = tmp_path / "src"
    src.mkdir()
    save_file(arrays, str(src / "model.safetensors"))
    (src / "config.json").write_text(json.dumps({
        "model_type": "medusa", "hidden_size": H, "vocab_size": V, "num_heads": 2,
        "num_hidden_layers": 1, "truncated_vocab_size": 20, "original_lm_head": True}))
    kind, config, params = load_pretrained(src)
    assert config.truncated_vocab_size == 20 and config.original_lm_head
    np.testing.assert_array_equal(np.asarray(params["lm_head"]["kernel"]), lm[token_map].T)
    np.testing.assert_array_equal(np.asarray(params["token_map"]), token_map)


def test_eagle_without_fc_bias(tmp_path):
    case = CASES["eagle"]
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(case.config))
    arrays = case.arrays()
    del arrays["fc.bias"]
    write_layout(src, arrays, "bin")
    _, config, params = load_pretrained(src)
    assert not config.fc_bias and "bias" not in params["fc"]


@pytest.mark.parametrize("case_name,patch,field", [
    ("dflash", {"dflash_config": {"mask_token_id": 3, "target_layer_ids": [1, 3, 5],
                                  "use_swa": True}}, "use_swa"),
    ("eagle3_spec", {"truncated_vocab_size": 7}, "truncated_vocab_size"),
    ("dflash", {"layer_types": ["sliding_attention", "full_attention"]}, "layer_types"),
    ("llama", {"is_neox_style": False}, "is_neox_style"),
])
def test_unsupported_config_fields_are_named(tmp_path, case_name, patch, field):
    case = CASES[case_name]
    src, _ = case.write(tmp_path)
    (src / "config.json").write_text(json.dumps({**case.config, **patch}))
    with pytest.raises(CheckpointError, match=field):
        load_pretrained(src)


# -- validation errors and the CLI ----------------------------------------------------------

def _src(tmp_path, name="llama", edit=None):
    case = CASES[name]
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(case.config))
    arrays = case.arrays()
    if edit:
        edit(arrays)
    write_layout(src, arrays, "safetensors")
    return src


def test_cli_converts_with_progress_and_summary(tmp_path, capsys):
    src = _src(tmp_path)
    dst = tmp_path / "out"
    assert cli.main([str(src), str(dst), "--dtype", "bf16"]) == 0
    out, err = capsys.readouterr()
    assert "21/21 tensors" in err and "[####" in err          # progress bar on stderr
    assert "converted 21 tensors" in out and "'llama'" in out and "bf16" in out
    assert "rotary_emb.inv_freq" in out                        # notes in the summary
    _, _, params = load_pretrained(dst)
    assert params["lm_head"]["kernel"].dtype == BF16
    assert sorted(os.listdir(tmp_path)) == ["out", "src"]      # no temp dirs left


@pytest.mark.parametrize("edit,needles", [
    (lambda a: a.update({"model.layers.0.mlp.extra.weight": np.ones(3, np.float32)}),
     ["unknown", "model.layers.0.mlp.extra.weight"]),
    (lambda a: a.pop("model.norm.weight"), ["missing", "model.norm.weight"]),
    (lambda a: a.update({"model.layers.1.self_attn.k_proj.weight": np.ones((5, H), np.float32)}),
     ["mis-shaped", "model.layers.1.self_attn.k_proj.weight", "[5, 16]", "[8, 16]"]),
])
def test_cli_names_the_offending_key(tmp_path, capsys, edit, needles):
    src = _src(tmp_path, edit=edit)
    dst = tmp_path / "out"
    assert cli.main([str(src), str(dst)]) == 1
    err = capsys.readouterr().err
    for n in needles:
        assert n in err
    assert not dst.exists()
    assert sorted(os.listdir(tmp_path)) == ["src"]


def test_every_offending_key_is_named(tmp_path):
    def edit(a):
        a.pop("model.norm.weight")
        a.pop("lm_head.weight")
        a["bogus.a"] = np.zeros(2, np.float32)
        a["bogus.b"] = np.zeros(2, np.float32)
        a["model.embed_tokens.weight"] = np.zeros((V + 1, H), np.float32)
        a["model.layers.0.input_layernorm.weight"] = np.ones(H, np.int32)
    with pytest.raises(TensorMismatchError) as e:
        load_pretrained(_src(tmp_path, edit=edit))
    assert e.value.unknown == ["bogus.a", "bogus.b"]
    assert e.value.missing == ["lm_head.weight", "model.norm.weight"]
    assert e.value.mis_shaped == {"model.embed_tokens.weight": ((V + 1, H), (V, H))}
    assert e.value.mis_typed == {"model.layers.0.input_layernorm.weight": ("int32", "float")}
    assert isinstance(e.value, ValueError)


def test_cli_refuses_existing_dst_unless_force(tmp_path, capsys):
    src = _src(tmp_path)
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "keep.txt").write_text("precious")
    assert cli.main([str(src), str(dst)]) == 1
    assert "already exists" in capsys.readouterr().err
    assert (dst / "keep.txt").read_text() == "precious"
    with pytest.raises(DestinationExistsError):
        convert(src, dst)
    # --force replaces only a previous specjax output: keep.txt is not one.
    assert cli.main([str(src), str(dst), "--force", "-q"]) == 1
    assert "keep.txt" in capsys.readouterr().err
    assert (dst / "keep.txt").read_text() == "precious"
    (dst / "keep.txt").unlink()
    assert cli.main([str(src), str(dst), "-q"]) == 0          # an empty directory is fine
    assert cli.main([str(src), str(dst), "-q"]) == 1          # now it holds an output
    assert cli.main([str(src), str(dst), "--force", "-q"]) == 0
    assert sorted(os.listdir(dst)) == ["params", "specjax.json"]


def test_cli_bad_dtype_and_format(tmp_path, capsys):
    src = _src(tmp_path)
    for args in (["--dtype", "int8"], ["--format", "gguf"]):
        with pytest.raises(SystemExit) as e:
            cli.main([str(src), str(tmp_path / "out"), *args])
        assert e.value.code == 2
        assert "invalid choice" in capsys.readouterr().err
    with pytest.raises(ValueError, match="allowed: bf16, fp16, fp32"):
        convert(src, tmp_path / "out", dtype="int8")
    assert not (tmp_path / "out").exists()


def test_failure_midway_leaves_nothing_at_dst(tmp_path, monkeypatch):
    src = _src(tmp_path)
    dst = tmp_path / "out"
    real_save = pipeline.save_prepared

    def save_then_fail(prep, out_dir, log=None):
        real_save(prep, out_dir, log)        # params and metadata fully written to the temp dir
        assert (Path(out_dir) / "params").exists()
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(pipeline, "save_prepared", save_then_fail)
    with pytest.raises(OSError, match="simulated"):
        convert(src, dst)
    assert not dst.exists()
    assert sorted(os.listdir(tmp_path)) == ["src"]

    # With --force over an existing output, a failure keeps the old output intact.
    monkeypatch.setattr(pipeline, "save_prepared", real_save)
    convert(src, dst, dtype="fp16")
    old_meta = (dst / "specjax.json").read_text()
    monkeypatch.setattr(pipeline, "save_prepared", save_then_fail)
    with pytest.raises(OSError, match="simulated"):
        convert(src, dst, force=True)
    assert (dst / "specjax.json").read_text() == old_meta
    assert sorted(os.listdir(tmp_path)) == ["out", "src"]


@pytest.mark.parametrize("exc", [KeyboardInterrupt, SystemExit])  # Ctrl-C; SIGTERM in the CLI
def test_interrupt_during_tensor_loading_leaves_nothing(tmp_path, exc):
    src = _src(tmp_path)
    dst = tmp_path / "out"

    def interrupt(done, total, key):
        if done == 5:
            raise exc

    with pytest.raises(exc):
        convert(src, dst, progress=interrupt)
    assert not dst.exists() and sorted(os.listdir(tmp_path)) == ["src"]


def test_cli_entry_point_subprocess(tmp_path):
    """The installed module runs as a program; an error exits 1 naming the key."""
    src = _src(tmp_path, edit=lambda a: a.pop("model.layers.1.mlp.up_proj.weight"))
    r = subprocess.run([sys.executable, "-m", "specjax.converters.cli", str(src),
                        str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert "model.layers.1.mlp.up_proj.weight" in r.stderr
    assert not (tmp_path / "out").exists()


# -- PyTorch-made fixtures (tests/support/fixtures/, written by real torch.save / save_pretrained) -----

FIXTURES = suite_paths.FIXTURES
FIXTURE_FORMATS = {
    "llama": "llama", "llama3_tied": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
    "eagle": "eagle", "eagle_nobias": "eagle", "eagle3_safeailab": "eagle3",
    "eagle3_speculators": "eagle3-speculators", "dflash": "dflash",
    "medusa_fasterdecoding": "medusa", "medusa_vllm_shared": "medusa-vllm",
    "medusa_vllm_tokenmap": "medusa-vllm", "mistral": "mistral", "ministral": "ministral",
    "gemma3": "gemma3", "gemma3_cg": "gemma3", "gpt_oss": "gpt_oss",
}


def _fixture_dirs(with_file=None):
    if not FIXTURES.is_dir():
        return []
    return sorted(p.name for p in FIXTURES.iterdir()
                  if p.is_dir() and (with_file is None or (p / with_file).is_file()))


needs_fixtures = pytest.mark.skipif(not FIXTURES.is_dir(), reason="no tests/support/fixtures yet")


@pytest.mark.parametrize("name", _fixture_dirs("tensors.json"))
def test_reads_real_torch_save_files(name):
    """Every .bin/.pt fixture made by torch.save reads to what torch.load returned."""
    d = FIXTURES / name
    doc = json.loads((d / "tensors.json").read_text())
    want = np.load(d / "tensors.npz")
    refs = read_torch_file(d / doc["file"])
    assert set(refs) == set(doc["tensors"])
    for k, info in doc["tensors"].items():
        a = refs[k].load()
        assert str(a.dtype) == info["dtype"] and list(a.shape) == info["shape"], k
        w = want[k]
        if a.dtype == BF16:
            a = a.astype(np.float32)  # tensors.npz holds bf16 as its exact float32 upcast
        assert a.dtype == w.dtype and np.array_equal(a, w), k


@pytest.mark.parametrize("name", [n for n in _fixture_dirs("config.json")
                                  if n in FIXTURE_FORMATS])
def test_fixture_converts_and_round_trips(tmp_path, name):
    src = FIXTURES / name
    ckpt = read_checkpoint(src)
    assert detect_format(ckpt.config, ckpt.tensors, ckpt.files) == FIXTURE_FORMATS[name]
    kind, config, direct = load_pretrained(src)
    convert(src, tmp_path / "out")
    kind2, config2, restored = load_pretrained(tmp_path / "out")
    assert (kind2, config2) == (kind, config)
    assert _tree_equal(restored, direct)


def _np(x):
    return np.asarray(x, np.float32)


def _rms(x, w, eps):
    x = x.astype(np.float32)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


@needs_fixtures
@pytest.mark.parametrize("name", ["llama", "llama3_tied", "qwen2", "qwen3"])
def test_fixture_decoder_embedding_and_head(name):
    """The converted embedding gives hidden_states[0]; the head gives the reference logits
    from final_hidden (the tied model through its embedding)."""
    ref = np.load(FIXTURES / name / "reference.npz")
    _, config, p = load_pretrained(FIXTURES / name, dtype="fp32")
    emb = _np(p["embed_tokens"]["embedding"])
    np.testing.assert_array_equal(emb[ref["input_ids"]], ref["hidden_states"][0])
    head = emb.T if config.tie_word_embeddings else _np(p["lm_head"]["kernel"])
    assert config.tie_word_embeddings == (name == "llama3_tied")
    np.testing.assert_allclose(ref["final_hidden"] @ head, ref["logits"], rtol=1e-5, atol=1e-5)
    normed = _rms(ref["prenorm_final"], _np(p["norm"]["weight"]), config.rms_norm_eps)
    np.testing.assert_allclose(normed, ref["final_hidden"], rtol=1e-5, atol=1e-5)


@needs_fixtures
@pytest.mark.parametrize("name", ["medusa_fasterdecoding", "medusa_vllm_shared",
                                  "medusa_vllm_tokenmap"])
def test_fixture_medusa_numpy_forward(name):
    """A NumPy Medusa forward on the converted params matches the PyTorch reference:
    checks head counting, ResBlock layout, the shared lm_head rename and token_map."""
    ref = np.load(FIXTURES / name / "reference.npz")
    _, config, p = load_pretrained(FIXTURES / name, dtype="fp32")
    n = ref["logits"].shape[0]
    assert config.num_heads == n
    for h in range(n):
        z = ref["hidden"].astype(np.float32)
        for l in range(config.num_hidden_layers):
            layer = p["blocks"][h]["layers"][l]
            y = z @ _np(layer["kernel"]) + (_np(layer["bias"]) if config.fc_bias else 0)
            z = z + y / (1 + np.exp(-y))
        head = p["lm_head"] if config.original_lm_head else p["lm_heads"][h]
        logits = z @ _np(head["kernel"])
        if "token_map" in p:
            np.testing.assert_array_equal(np.asarray(p["token_map"]), ref["token_map"])
            np.testing.assert_allclose(logits, ref["logits_truncated"][h], rtol=1e-5, atol=1e-5)
        else:
            np.testing.assert_allclose(logits, ref["logits"][h], rtol=1e-5, atol=1e-5)


@needs_fixtures
def test_fixture_dflash_context_and_aux_ids():
    """z-lab target_layer_ids [0, 1] -> aux ids (1, 2); fc + hidden_norm on the bf16
    weights reproduce the reference context states."""
    ref = np.load(FIXTURES / "dflash" / "reference.npz")
    _, config, p = load_pretrained(FIXTURES / "dflash", dtype="fp32")
    assert config.aux_layer_ids == (1, 2) and config.block_size == 4
    assert config.mask_token_id == 127 and not config.causal
    ctx = _rms(ref["context_hidden"] @ _np(p["fc"]["kernel"]), _np(p["hidden_norm"]["weight"]),
               config.rms_norm_eps)
    np.testing.assert_allclose(ctx, ref["context_states"], rtol=1e-5, atol=1e-5)


@needs_fixtures
@pytest.mark.parametrize("name", ["eagle3_safeailab", "eagle3_speculators"])
def test_fixture_eagle3_head_and_d2t(name):
    ref = np.load(FIXTURES / name / "reference.npz")
    _, config, p = load_pretrained(FIXTURES / name, dtype="fp32")
    np.testing.assert_allclose(ref["normed"] @ _np(p["lm_head"]["kernel"]), ref["logits"],
                               rtol=1e-5, atol=1e-5)
    d2t = np.asarray(p["d2t"])
    assert d2t.dtype == np.int32
    np.testing.assert_array_equal(ref["draft_argmax"] + d2t[ref["draft_argmax"]],
                                  ref["target_argmax"])
    if name == "eagle3_speculators":
        assert config.norm_before_residual and config.aux_layer_ids == (0, 1, 2)
        assert config.rope_theta == 5e5 and config.has_embed_tokens
    else:
        assert config.aux_layer_ids is None and config.rope_theta == 10000.0
        assert not config.has_embed_tokens


@needs_fixtures
def test_fixture_eagle_bias_follows_the_file():
    _, c1, p1 = load_pretrained(FIXTURES / "eagle")
    _, c2, p2 = load_pretrained(FIXTURES / "eagle_nobias")
    assert c1.fc_bias and "bias" in p1["fc"] and p1["fc"]["kernel"].dtype == np.float16
    assert not c2.fc_bias and "bias" not in p2["fc"] and c2.num_hidden_layers == 2

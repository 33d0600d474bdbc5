"""Issue 59, the loader's part of the hostile-input catalogue: a converted directory missing
``specjax.json``, with an edited config, or missing orbax's part metadata, and a disk that
fills in the middle of a write. Each is one exact message naming the file and the key, no
traceback or orbax / asyncio log printed, and nothing half-written left behind."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from specjax.converters import CheckpointError, convert, load_pretrained
from specjax.converters.errors import CorruptOutputError
from specjax.converters.store import METADATA_FILE, PARAMS_DIR

from converter_cases import CASES, write_layout


def _llama_dir(root: Path) -> Path:
    d = root / "src"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(CASES["llama"].config))
    write_layout(d, CASES["llama"].arrays(0), "safetensors")
    return d


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("conv")
    convert(_llama_dir(root), root / "out")
    return root / "out"


def _listing(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def _edit_config(key, value):
    def damage(d: Path):
        f = d / METADATA_FILE
        meta = json.loads(f.read_text())
        meta["config"][key] = value
        f.write_text(json.dumps(meta))
    return damage


def _embed_shape(d: Path) -> list[int]:
    return json.loads((d / METADATA_FILE).read_text())["arrays"]["embed_tokens/embedding"]["shape"]


def _hidden(d):
    v, h = _embed_shape(d)
    return (f"{d}/{METADATA_FILE}: config hidden_size={h + 32} but the checkpoint's "
            f"embed_tokens/embedding is [{v}, {h}]: its last dimension is {h} (the config was "
            "edited after the conversion; restore hidden_size, or run specjax-convert on the "
            "original checkpoint again)")


LOADER_CASES = {
    "specjax-json-missing": (
        lambda d: (d / METADATA_FILE).unlink(), CheckpointError,
        lambda d: (f"{d}: not a converted specjax checkpoint: {METADATA_FILE} is missing (it "
                   f"records the model's kind, config and arrays, and {PARAMS_DIR}/ cannot be "
                   "read without it); run specjax-convert on the original checkpoint again")),
    "config-hidden-size-edited": (
        lambda d: _edit_config("hidden_size", _embed_shape(d)[1] + 32)(d), CorruptOutputError,
        _hidden),
    "config-num-hidden-layers-edited": (
        _edit_config("num_hidden_layers", CASES["llama"].config["num_hidden_layers"] + 1),
        CorruptOutputError,
        lambda d: (f"{d}/{METADATA_FILE}: config num_hidden_layers="
                   f"{CASES['llama'].config['num_hidden_layers'] + 1} but the checkpoint holds "
                   f"{CASES['llama'].config['num_hidden_layers']} decoder layers (layers/0 .. "
                   f"layers/{CASES['llama'].config['num_hidden_layers'] - 1}) (the config was "
                   "edited after the conversion; restore num_hidden_layers, or run "
                   "specjax-convert on the original checkpoint again)")),
    "orbax-metadata-deleted": (
        lambda d: (d / PARAMS_DIR / "00000" / "_METADATA").unlink(), CorruptOutputError,
        lambda d: (f"{d}/{PARAMS_DIR}/00000: orbax's metadata file _METADATA is missing (the "
                   "part is incomplete: it no longer lists its arrays; convert again)")),
}


@pytest.mark.parametrize("name", sorted(LOADER_CASES))
def test_load_names_what_is_wrong(tmp_path, converted, capfd, caplog, name):
    damage, etype, message = LOADER_CASES[name]
    d = tmp_path / "out"
    shutil.copytree(converted, d)
    damage(d)
    before = _listing(d)
    caplog.set_level(logging.WARNING)
    with pytest.raises(CheckpointError) as e:
        load_pretrained(d)
    assert type(e.value) is etype, (type(e.value), str(e.value))
    assert str(e.value) == message(d)
    out, err = capfd.readouterr()
    assert "Traceback" not in out + err, out + err
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    assert _listing(d) == before                  # a load writes nothing
    assert sorted(os.listdir(tmp_path)) == ["out"]


def test_the_undamaged_directory_still_loads(converted):
    load_pretrained(converted)


# -- a disk that fills in the middle of a write ------------------------------------------------

# tmpfs sizes at which the first part fails at different points of orbax's write (the value
# files, the array metadata, the final rename): the tiny llama's output is ~76 KB
@pytest.mark.parametrize("size", ["24k", "40k", "56k"])
def test_disk_full_mid_write_prints_one_clear_error(tmp_path, size):
    mnt = tmp_path / "small"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}",
                                            "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("needs root to mount a small tmpfs")
    try:
        src = _llama_dir(tmp_path)
        dst = mnt / "out"
        # a process of its own: orbax's leftover tasks are logged when the process exits
        r = subprocess.run([sys.executable, "-m", "specjax.converters.cli", str(src), str(dst), "-q"],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 1, r.stderr
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 2, r.stderr
        assert lines[0].startswith("specjax-convert: error: ")
        assert "/params/00000: no space left on the device while writing the params (nothing " \
               "is kept; free some space and run again)" in lines[0], r.stderr
        assert lines[1] == f"specjax-convert: nothing was written to {dst}"
        assert sorted(os.listdir(mnt)) == []
    finally:
        subprocess.run(["umount", str(mnt)], check=True)

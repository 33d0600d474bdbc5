"""``specjax-convert`` carries SRC's tokenizer and generation files into DST byte for byte
(``store.CARRIED_FILES``): recorded in ``specjax.json`` (size, sha256) and checked on load;
refused before any weight is read when over the size cap, a symbolic link out of SRC, or a
tokenizer naming its own code (``auto_map``); written through the staging directory like
the params (nothing left on failure, ``--force`` semantics). The listing test names every
file of a converted directory and which of them a load reads. CPU only."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path

import pytest

from specjax.converters import CheckpointError, cli, convert, load_pretrained, pipeline, store
from specjax.converters.errors import CorruptOutputError, DestinationExistsError

from converter_cases import CASES, write_layout

#: name -> bytes of the carried files the source gets (any bytes: the converter reads only
#: tokenizer_config.json, for auto_map; tokenizer.model is not UTF-8 on purpose)
CARRIED = {
    "tokenizer.json": json.dumps({"version": "1.0", "model": {"type": "WordLevel"}}).encode(),
    "tokenizer_config.json": b'{"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "</s>"}',
    "special_tokens_map.json": b'{"eos_token": "</s>"}\n',
    "tokenizer.model": bytes(range(256)) * 3,
    "generation_config.json": b'{"eos_token_id": [2, 3], "bos_token_id": 1}',
    "chat_template.jinja": "{% for m in messages %}{{ m['content'] }} \u00e9{% endfor %}".encode(),
}
#: in SRC, never carried
NOT_CARRIED = {"README.md": b"# a model\n", "tokenization_custom.py": b"import os\n",
               "training_args.bin": b"\x80\x04."}


def _src(root: Path, name: str = "src", carried: dict | None = None, config: dict | None = None
         ) -> Path:
    d = root / name
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps(config or CASES["llama"].config))
    write_layout(d, CASES["llama"].arrays(), "safetensors")
    for n, b in {**(CARRIED if carried is None else carried), **NOT_CARRIED}.items():
        (d / n).write_bytes(b)
    return d


def _nothing_written(root: Path, dst: Path) -> None:
    assert not os.path.lexists(dst)
    assert not [p for p in root.iterdir() if ".specjax-tmp-" in p.name]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("carry")
    src = _src(root)
    summary = convert(src, root / "out")
    return src, root / "out", summary


@pytest.fixture
def no_read(monkeypatch):
    """Reading the weights fails the test: refusals must come before it."""
    def fail(*a, **k):
        raise AssertionError("the weights were read before the refusal")
    monkeypatch.setattr(pipeline, "plan", fail)


@pytest.mark.smoke
def test_carried_byte_for_byte_and_recorded(converted):
    src, out, summary = converted
    for name, data in CARRIED.items():
        assert (out / name).read_bytes() == data == (src / name).read_bytes(), name
        assert not (out / name).is_symlink()
    for name in [*NOT_CARRIED, "config.json", "model.safetensors"]:
        assert not os.path.lexists(out / name), name
    meta = json.loads((out / store.METADATA_FILE).read_text())
    assert meta["specjax_checkpoint_version"] == store.METADATA_VERSION
    assert meta["carried_files"] == {
        n: {"size": len(b), "sha256": hashlib.sha256(b).hexdigest()} for n, b in CARRIED.items()}
    assert summary.carried == [n for n in store.CARRIED_FILES if n in CARRIED]
    assert "with tokenizer.json, tokenizer_config.json" in summary.text()


# -- the listing: every file of a converted directory, and which ones a load reads ------------

#: What orbax writes in each ``params/NNNNN/`` part (``d/`` names are content hashes).
ORBAX_PART = [r"_CHECKPOINT_METADATA", r"_METADATA", r"_sharding", r"array_metadatas/process_0",
              r"commit_success\.txt", r"manifest\.ocdbt", r"d/[0-9a-f]{32}",
              r"ocdbt\.process_0/manifest\.ocdbt", r"ocdbt\.process_0/d/[0-9a-f]{32}"]
#: Files of a part that a restore may leave unread (docs/converters.md ("The converted directory")): orbax's
#: bookkeeping (_sharding and array_metadatas/ are read only when present), and the
#: per-process OCDBT index (its manifest and b-tree nodes), which
#: orbax's merge into the part's root manifest.ocdbt + d/ leaves unreferenced; the root
#: index points at the value files in ocdbt.process_0/d/ in place. This is the "file the
#: load never reads" of test_hostile_inputs' damage cases: a b-tree node file beside the
#: value files in ocdbt.process_0/d/, orbax's to write, so kept.
ORBAX_UNREAD = [r"_CHECKPOINT_METADATA", r"_sharding", r"array_metadatas/process_0",
                r"commit_success\.txt", r"ocdbt\.process_0/manifest\.ocdbt",
                r"ocdbt\.process_0/d/[0-9a-f]{32}"]


def _files(d: Path) -> list[str]:
    return sorted(str(p.relative_to(d)) for p in d.rglob("*") if not p.is_dir())


def _part_file(rel: str, patterns) -> bool:
    m = re.fullmatch(r"params/\d{5}/(.+)", rel)
    return bool(m) and any(re.fullmatch(p, m[1]) for p in patterns)


def test_listing_names_every_file_and_what_a_load_reads(converted, tmp_path):
    """Exactly specjax.json, the carried files and orbax's parts; every file outside the
    parts is read (checked) by a load, and within a part only orbax's bookkeeping and its
    superseded per-process index can go unread: damaging any other file fails the load."""
    _src_dir, out, _ = converted
    files = _files(out)
    top = sorted({f.split("/")[0] for f in files})
    assert top == sorted([store.METADATA_FILE, store.PARAMS_DIR, *CARRIED])
    meta = json.loads((out / store.METADATA_FILE).read_text())
    assert meta["parts"] == ["00000"]
    strays = [f for f in files if "/" in f and not _part_file(f, ORBAX_PART)]
    assert not strays, strays
    assert not [f for f in files if ".specjax-tmp-" in f or f.endswith("writer.json")]
    unread = []
    for rel in files:
        d = tmp_path / "d"
        shutil.rmtree(d, ignore_errors=True)
        shutil.copytree(out, d)
        f = d / rel
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])     # truncated
        try:
            load_pretrained(d)
        except CheckpointError as e:
            assert isinstance(e, CorruptOutputError) or rel == store.METADATA_FILE, (rel, e)
            continue
        unread.append(rel)
    assert all(_part_file(f, ORBAX_UNREAD) for f in unread), unread
    load_pretrained(out)                               # the original is untouched


# -- checked on load ----------------------------------------------------------------------------

def _copy(converted, tmp_path) -> Path:
    d = tmp_path / "out"
    shutil.copytree(converted[1], d)
    return d


def test_load_checks_the_carried_files(converted, tmp_path):
    d = _copy(converted, tmp_path)
    (d / "tokenizer.json").unlink()
    with pytest.raises(CorruptOutputError, match=r"tokenizer\.json: missing"):
        load_pretrained(d)
    d = _copy(converted, tmp_path / "b")
    data = bytearray((d / "tokenizer.model").read_bytes())
    data[7] ^= 1                                   # same size, other bytes
    (d / "tokenizer.model").write_bytes(bytes(data))
    with pytest.raises(CorruptOutputError, match=r"tokenizer\.model: does not match its "
                                                 r"recorded sha256"):
        load_pretrained(d)
    load_pretrained(d, verify=False)               # sizes only
    (d / "generation_config.json").write_bytes(b"{}")
    with pytest.raises(CorruptOutputError, match=r"generation_config\.json: 2 bytes"):
        load_pretrained(d, verify=False)


def test_carried_files_record_checked(converted, tmp_path):
    d = _copy(converted, tmp_path)
    meta = json.loads((d / store.METADATA_FILE).read_text())
    meta["carried_files"]["../config.json"] = {"size": 1, "sha256": "0" * 64}
    (d / store.METADATA_FILE).write_text(json.dumps(meta))
    with pytest.raises(CorruptOutputError, match="carried_files names '../config.json'"):
        load_pretrained(d)


def test_directory_without_carried_files_still_loads(converted, tmp_path):
    """A version-2 directory written before files were carried has no ``carried_files``."""
    d = _copy(converted, tmp_path)
    meta = json.loads((d / store.METADATA_FILE).read_text())
    del meta["carried_files"]
    (d / store.METADATA_FILE).write_text(json.dumps(meta))
    for n in CARRIED:
        (d / n).unlink()
    load_pretrained(d)


# -- refused before any weight is read, nothing written ----------------------------------------

def _refused(tmp_path, src, needles):
    dst = tmp_path / "out"
    with pytest.raises(CheckpointError) as e:
        convert(src, dst)
    msg = str(e.value)
    for n in needles:
        assert n in msg, (n, msg)
    assert "\n" not in msg and len(msg) < 600
    _nothing_written(tmp_path, dst)
    return msg


@pytest.mark.smoke
def test_tokenizer_auto_map_refused_by_name(tmp_path, no_read):
    cfg = json.loads(CARRIED["tokenizer_config.json"])
    cfg["auto_map"] = {"AutoTokenizer": ["tokenization_custom.CustomTokenizer", None]}
    src = _src(tmp_path, carried={**CARRIED, "tokenizer_config.json": json.dumps(cfg).encode()})
    _refused(tmp_path, src, [str(src / "tokenizer_config.json"), "'auto_map'",
                             "trust_remote_code stays off"])


def test_config_auto_map_naming_a_tokenizer_refused(tmp_path, no_read):
    """config.json's auto_map naming only model code stays accepted (a DFlash z-lab
    config has one; the weights convert into specjax's own model, nothing is run); one
    naming an AutoTokenizer is refused when a tokenizer is carried."""
    config = dict(CASES["llama"].config, auto_map={"AutoTokenizer": "tok.T",
                                                   "AutoModel": "m.M"})
    src = _src(tmp_path, config=config)
    _refused(tmp_path, src, [str(src / "config.json"), "'auto_map.AutoTokenizer'",
                             "trust_remote_code stays off"])


def test_config_auto_map_of_a_model_class_converts(tmp_path):
    config = dict(CASES["llama"].config, auto_map={"AutoModelForCausalLM": "m.M"})
    src = _src(tmp_path, config=config)
    convert(src, tmp_path / "out")
    assert (tmp_path / "out" / "tokenizer_config.json").read_bytes() == \
        CARRIED["tokenizer_config.json"]


def test_over_the_cap_refused_before_reading(tmp_path, monkeypatch, capsys, no_read):
    monkeypatch.setattr(store, "MAX_CARRIED_BYTES", 512)
    src = _src(tmp_path)              # tokenizer.model: 768 bytes, the others under 512
    _refused(tmp_path, src, [str(src / "tokenizer.model"), "768 bytes", "512 bytes limit"])
    assert cli.main([str(src), str(tmp_path / "out"), "-q"]) == 1
    err = capsys.readouterr().err
    assert "tokenizer.model" in err and "512 bytes limit" in err
    assert len(err.strip().splitlines()) == 2     # the error, "nothing was written"
    _nothing_written(tmp_path, tmp_path / "out")


def test_grown_past_the_cap_while_converting_leaves_nothing(tmp_path, monkeypatch):
    """The bytes are read once more, capped, when copied into the staging directory."""
    src = _src(tmp_path)
    real = pipeline.plan

    def grow(*a, **k):
        (src / "tokenizer.json").write_bytes(b"x" * 4096)
        return real(*a, **k)

    monkeypatch.setattr(pipeline, "plan", grow)
    monkeypatch.setattr(store, "MAX_CARRIED_BYTES", 1024)
    _refused(tmp_path, src, [str(src / "tokenizer.json"), "1024 bytes limit"])


def test_symbolic_links(tmp_path, no_read):
    outside = tmp_path / "elsewhere.json"
    outside.write_text("{}")
    src = _src(tmp_path)
    (src / "special_tokens_map.json").unlink()
    (src / "special_tokens_map.json").symlink_to(outside)
    _refused(tmp_path, src, [str(src / "special_tokens_map.json"), "symbolic link",
                             str(outside), "outside"])
    (src / "special_tokens_map.json").unlink()
    (src / "special_tokens_map.json").symlink_to(src / "README.md")   # inside: followed
    assert store.carried_sources(src)["special_tokens_map.json"] == (src / "README.md").resolve()
    (src / "chat_template.json").mkdir()
    _refused(tmp_path, src, [str(src / "chat_template.json"), "not a regular file"])


def test_links_inside_src_and_the_hf_cache_copy_their_targets(tmp_path):
    """The HF cache keeps every file of ``<repo>/snapshots/<rev>/`` as a link into
    ``<repo>/blobs/``: followed, and DST gets the bytes."""
    repo = tmp_path / "models--org--tiny"
    src = _src(repo / "snapshots", name="0123abc")
    (repo / "blobs").mkdir()
    for n in ("tokenizer.json", "generation_config.json"):
        blob = repo / "blobs" / hashlib.sha256(CARRIED[n]).hexdigest()
        (src / n).rename(blob)
        (src / n).symlink_to(os.path.relpath(blob, src))
    (src / "vocab.json").symlink_to("tokenizer.json")        # a link to a link inside SRC
    convert(src, tmp_path / "out")
    out = tmp_path / "out"
    for n in ("tokenizer.json", "generation_config.json"):
        assert not (out / n).is_symlink() and (out / n).read_bytes() == CARRIED[n]
    assert (out / "vocab.json").read_bytes() == CARRIED["tokenizer.json"]
    load_pretrained(out)


# -- the staging directory and --force ---------------------------------------------------------

def test_failure_after_copying_leaves_nothing(tmp_path, monkeypatch):
    src = _src(tmp_path)

    def fail(*a, **k):
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(pipeline, "save_prepared", fail)
    with pytest.raises(OSError, match="simulated"):
        convert(src, tmp_path / "out")
    assert sorted(os.listdir(tmp_path)) == ["src"]


def test_force_replaces_a_previous_output_with_carried_files(tmp_path):
    src = _src(tmp_path)
    dst = tmp_path / "out"
    convert(src, dst)
    with pytest.raises(DestinationExistsError, match="--force"):
        convert(src, dst)
    (src / "tokenizer.json").write_bytes(b'{"new": true}')
    (src / "tokenizer.model").unlink()
    convert(src, dst, force=True)
    assert (dst / "tokenizer.json").read_bytes() == b'{"new": true}'
    assert not (dst / "tokenizer.model").exists()      # the old DST went whole
    (dst / "merges.txt").write_text("not recorded")    # a file specjax.json does not record
    with pytest.raises(DestinationExistsError, match="it holds merges.txt"):
        convert(src, dst, force=True)
    assert sorted(os.listdir(tmp_path)) == ["out", "src"]

"""specjax.training.data: stdlib file listing, split, token shards, window samplers, prompts."""

import hashlib
import os
import random
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.tokenizer import BOS_ID, EOS_ID
from specjax.training import data as D
from specjax.training.data import (
    TokenShard,
    build_shard,
    corpus,
    device_windows,
    heldout_prompts,
    sample_windows,
    split_files,
    stdlib_py_files,
    stdlib_root,
)

FAKE_FILES = {
    "os.py": b"import sys\n",
    "doctest.py": b"def testmod(): pass\n",
    "a/__init__.py": b"",
    "a/b.py": b"x = 1\ny = 2\n",
    "a/__pycache__/b.cpython-312.py": b"cached\n",
    "a/dist-packages/y.py": b"third party\n",
    "site-packages/pkg/x.py": b"third party\n",
    "test/support.py": b"support\n",
    "test/test_foo.py": b"def test(): pass\n",
    "idlelib/editor.py": b"editor\n",
    "idlelib/idle_test/test_x.py": b"idle test\n",
    "lib2to3/tests/data.py": b"fixture\n",
    "email/test_helper.py": b"helper\n",
    "unittest/case.py": b"class TestCase: pass\n",
    "notes.txt": b"not python\n",
    "a/c.pyc": b"\x00\x01",
}
ALL = [
    "a/__init__.py", "a/b.py", "doctest.py", "email/test_helper.py", "idlelib/editor.py",
    "idlelib/idle_test/test_x.py", "lib2to3/tests/data.py", "os.py", "test/support.py",
    "test/test_foo.py", "unittest/case.py",
]
NO_TESTS = ["a/__init__.py", "a/b.py", "doctest.py", "idlelib/editor.py", "os.py", "unittest/case.py"]


@pytest.fixture
def fake_root(tmp_path):
    root = tmp_path / "lib" / "python3.12"
    for rel, content in FAKE_FILES.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(content)
    return root


def rels(files, root):
    return [Path(f).relative_to(root).as_posix() for f in files]


# --------------------------------------------------------------------------- listing


def test_listing_excludes_site_packages_and_pycache(fake_root):
    files = stdlib_py_files(fake_root)
    assert rels(files, fake_root) == ALL
    assert all(f.is_absolute() and f.parent.is_relative_to(fake_root) for f in files)
    assert rels(stdlib_py_files(str(fake_root), include_tests=False), fake_root) == NO_TESTS


def test_listing_validation(fake_root):
    with pytest.raises(ValueError, match="root=.*not an existing directory"):
        stdlib_py_files(fake_root / "missing")
    with pytest.raises(TypeError, match="root must be a path"):
        stdlib_py_files(3)
    with pytest.raises(TypeError, match="include_tests must be a bool"):
        stdlib_py_files(fake_root, include_tests="no")


def test_real_stdlib_listing():
    root = stdlib_root()
    assert (root / "os.py").is_file()
    files = stdlib_py_files()
    rel = rels(files, root)
    assert rel == sorted(rel) and "os.py" in rel and "test/test_grammar.py" in rel
    assert not any(part in D.EXCLUDED_DIRS for r in rel for part in r.split("/"))
    no_tests = rels(stdlib_py_files(include_tests=False), root)
    assert set(no_tests) < set(rel) and "os.py" in no_tests
    assert not any(r.startswith(("test/", "idlelib/idle_test/")) for r in no_tests)


# --------------------------------------------------------------------------- split


def _expected_heldout(rel, fraction, salt="specjax-v1"):
    d = hashlib.sha256((salt + rel).encode()).digest()
    return int.from_bytes(d[:8], "big") < fraction * 2**64


def test_split_deterministic_order_independent_disjoint(tmp_path):
    root = tmp_path / "r"
    rel = [f"pkg{i % 7}/mod_{i}.py" for i in range(600)]
    files = [root / r for r in rel]
    train, held = split_files(files, root, heldout_fraction=0.1)
    assert rels(held, root) == sorted(r for r in rel if _expected_heldout(r, 0.1))
    assert rels(train, root) == sorted(r for r in rel if not _expected_heldout(r, 0.1))
    assert not set(train) & set(held) and set(train) | set(held) == set(files)
    assert 30 <= len(held) <= 90
    shuffled = files[:]
    random.Random(0).shuffle(shuffled)
    assert split_files(shuffled, root, heldout_fraction=0.1) == (train, held)
    # same relative layout under another root -> same split; str paths accepted
    other = tmp_path / "elsewhere"
    t2, h2 = split_files([str(other / r) for r in rel], str(other), heldout_fraction=0.1)
    assert rels(t2, other) == rels(train, root) and rels(h2, other) == rels(held, root)
    # the salt matters; a larger fraction only adds files
    assert split_files(files, root, heldout_fraction=0.1, salt="x")[1] != held
    assert set(held) <= set(split_files(files, root, heldout_fraction=0.3)[1])


@pytest.mark.parametrize("bad", [0, 1, 0.0, 1.0, -0.1, 1.5, float("nan"), float("inf")])
def test_split_fraction_range(bad, tmp_path):
    with pytest.raises(ValueError, match=r"heldout_fraction must be in the open interval \(0, 1\)"):
        split_files([tmp_path / "a.py"], tmp_path, heldout_fraction=bad)


def test_split_validation(tmp_path):
    with pytest.raises(TypeError, match="heldout_fraction"):
        split_files([], tmp_path, heldout_fraction=True)
    with pytest.raises(TypeError, match="heldout_fraction"):
        split_files([], tmp_path, heldout_fraction="0.1")
    with pytest.raises(ValueError, match="must all lie under root"):
        split_files([tmp_path.parent / "x.py"], tmp_path)
    with pytest.raises(ValueError, match="more than once"):
        split_files([tmp_path / "a.py", str(tmp_path / "a.py")], tmp_path)
    with pytest.raises(TypeError, match="files must be an iterable of paths"):
        split_files("a.py", tmp_path)
    with pytest.raises(TypeError, match=r"files\[1\] must be a path"):
        split_files([tmp_path / "a.py", 3], tmp_path)
    with pytest.raises(TypeError, match="salt must be a str"):
        split_files([], tmp_path, salt=1)
    assert split_files([], tmp_path) == ([], [])


# --------------------------------------------------------------------------- shards


def test_shard_layout(fake_root):
    names = ["os.py", "a/__init__.py", "a/b.py"]
    shard = build_shard([fake_root / n for n in names])
    expected = [BOS_ID, *b"import sys\n", EOS_ID, BOS_ID, EOS_ID, BOS_ID, *b"x = 1\ny = 2\n", EOS_ID]
    assert shard.tokens.dtype == np.uint16 and shard.tokens.tolist() == expected
    assert shard.doc_starts.dtype == np.int64 and shard.doc_starts.tolist() == [0, 13, 15]
    assert shard.num_tokens == len(expected) and shard.num_docs == 3
    assert shard.doc(1).tolist() == [BOS_ID, EOS_ID]
    assert (shard.skipped_files, shard.truncated_files) == (0, 0)


def test_shard_skips_unreadable_and_truncates(fake_root):
    files = [fake_root / "missing.py", fake_root / "a", fake_root / "a/b.py", fake_root / "os.py"]
    shard = build_shard(files, max_file_bytes=4)
    assert shard.skipped_files == 2 and shard.truncated_files == 2
    assert shard.tokens.tolist() == [BOS_ID, *b"x = ", EOS_ID, BOS_ID, *b"impo", EOS_ID]
    assert shard.doc_starts.tolist() == [0, 6]
    empty = build_shard([])
    assert empty.num_tokens == 0 and empty.num_docs == 0 and empty.tokens.dtype == np.uint16
    with pytest.raises(ValueError, match="max_file_bytes must be an int >= 1"):
        build_shard([], max_file_bytes=0)
    with pytest.raises(TypeError, match="tokenizer must be a ByteTokenizer"):
        build_shard([], tokenizer=object())


def test_shard_validation():
    with pytest.raises(ValueError, match="doc_starts must start with 0"):
        TokenShard(np.zeros(3, np.uint16), np.array([1]))
    with pytest.raises(ValueError, match="strictly increasing"):
        TokenShard(np.zeros(3, np.uint16), np.array([0, 2, 2]))
    with pytest.raises(ValueError, match="strictly increasing"):
        TokenShard(np.zeros(3, np.uint16), np.array([0, 3]))
    with pytest.raises(ValueError, match="fit uint16"):
        TokenShard(np.array([70000]), np.array([0]))
    with pytest.raises(ValueError, match="1-D"):
        TokenShard(np.zeros((2, 2), np.uint16), np.array([0]))
    s = TokenShard(np.array([256, 1, 257]), [0])
    assert s.tokens.dtype == np.uint16 and s.doc_starts.dtype == np.int64


def test_save_load_round_trip_atomic(fake_root, tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    shard = build_shard([fake_root / "os.py", fake_root / "missing.py", fake_root / "a/b.py"], max_file_bytes=5)
    path = out / "train.npz"
    assert shard.save(path) == path
    assert os.listdir(out) == ["train.npz"]
    back = TokenShard.load(str(path))
    assert back.tokens.dtype == np.uint16 and back.doc_starts.dtype == np.int64
    np.testing.assert_array_equal(back.tokens, shard.tokens)
    np.testing.assert_array_equal(back.doc_starts, shard.doc_starts)
    assert (back.skipped_files, back.truncated_files) == (1, 2)
    # overwrite in place, then a failing write leaves the old file and no temp file behind
    build_shard([fake_root / "os.py"]).save(path)
    before = path.read_bytes()

    def boom(*a, **k):
        raise RuntimeError("disk full")

    monkeypatch.setattr(D.np, "savez", boom)
    with pytest.raises(RuntimeError, match="disk full"):
        shard.save(path)
    assert os.listdir(out) == ["train.npz"] and path.read_bytes() == before
    monkeypatch.undo()
    np.savez(out / "other.npz", x=np.zeros(2))
    with pytest.raises(ValueError, match="not a TokenShard file"):
        TokenShard.load(out / "other.npz")


# --------------------------------------------------------------------------- samplers


def test_sample_windows_contiguous():
    tokens = np.arange(1000, dtype=np.int64).astype(np.uint16)
    w = sample_windows(tokens, np.random.default_rng(0), 64, 17)
    assert w.shape == (64, 17) and w.dtype == np.int32
    starts = w[:, 0]
    np.testing.assert_array_equal(w, starts[:, None] + np.arange(17))
    assert starts.min() >= 0 and starts.max() <= 1000 - 17
    np.testing.assert_array_equal(w, sample_windows(tokens, np.random.default_rng(0), 64, 17))
    assert sample_windows(tokens, np.random.default_rng(0), 2, 1000).tolist() == [list(range(1000))] * 2
    # random token values: every row is some tokens[s:s+L]
    vals = np.random.default_rng(1).integers(0, 260, 300).astype(np.uint16)
    for row in sample_windows(vals, np.random.default_rng(2), 8, 9):
        s = [i for i in range(292) if (vals[i : i + 9] == row).all()]
        assert s


def test_sample_windows_validation():
    t = np.zeros(10, np.uint16)
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match=r"length must be <= len\(tokens\)=10"):
        sample_windows(t, rng, 1, 11)
    with pytest.raises(ValueError, match="batch must be an int >= 1"):
        sample_windows(t, rng, 0, 2)
    with pytest.raises(TypeError, match="length must be an int"):
        sample_windows(t, rng, 1, 2.0)
    with pytest.raises(TypeError, match="rng must be a numpy.random.Generator"):
        sample_windows(t, 0, 1, 2)
    with pytest.raises(ValueError, match="tokens must be 1-D"):
        sample_windows(t.reshape(2, 5), rng, 1, 2)


def test_device_windows_under_jit():
    n = 500
    tokens = jnp.asarray(np.arange(n, dtype=np.uint16))
    f = jax.jit(lambda t, k: device_windows(t, k, batch=32, length=13))
    w = np.asarray(f(tokens, jax.random.key(0)))
    assert w.shape == (32, 13) and w.dtype == np.int32
    np.testing.assert_array_equal(w, w[:, :1] + np.arange(13))
    assert w[:, 0].min() >= 0 and w[:, 0].max() <= n - 13
    np.testing.assert_array_equal(w, np.asarray(f(tokens, jax.random.key(0))))
    assert not np.array_equal(w, np.asarray(f(tokens, jax.random.key(1))))
    # direct call (already jitted, positional static args) and raw uint32 keys agree
    w2 = device_windows(tokens, jax.random.key(0), 32, 13)
    np.testing.assert_array_equal(np.asarray(w2), w)
    assert device_windows(tokens, jax.random.PRNGKey(3), batch=2, length=n).tolist() == [list(range(n))] * 2
    # random values: rows are slices of tokens
    vals = np.random.default_rng(1).integers(0, 260, 200).astype(np.uint16)
    rows = np.asarray(device_windows(jnp.asarray(vals), jax.random.key(5), batch=6, length=7))
    for row in rows:
        assert any((vals[i : i + 7] == row).all() for i in range(194))
    with pytest.raises(ValueError, match=r"length must be <= len\(tokens\)=500"):
        device_windows(tokens, jax.random.key(0), batch=1, length=501)
    with pytest.raises(ValueError, match="batch must be an int >= 1"):
        device_windows(tokens, jax.random.key(0), batch=0, length=2)


# --------------------------------------------------------------------------- prompts and corpus


def test_heldout_prompts(tmp_path):
    texts = {
        "m1.py": b"def f():\n    return 1\n\n\nclass A:\n    pass\n",
        "m2.py": b"import os\nimport sys\nx = [1, 2, 3]\n",
        "tiny.py": b"x\n",
    }
    files = []
    for name, content in texts.items():
        (tmp_path / name).write_bytes(content)
        files.append(tmp_path / name)
    files.append(tmp_path / "missing.py")
    p = heldout_prompts(files, num_prompts=5, prompt_bytes=8, seed=3)
    assert p == heldout_prompts(list(reversed(files)), num_prompts=5, prompt_bytes=8, seed=3)
    assert p[:3] == heldout_prompts(files, num_prompts=3, prompt_bytes=8, seed=3)
    assert len({tuple(q) for q in p}) == 5
    for q in p:
        assert q[0] == BOS_ID and len(q) == 9 and max(q[1:]) < 256
        body = bytes(q[1:])
        hits = [c for c in texts.values() if body in c]
        assert hits and any(c.startswith(body) or b"\n" + body in c for c in hits)
        assert body[:1] not in (b"\n", b"\r")
    # candidates: m1 line starts 0,9,24,33 (not the blank lines), m2 0,10,21; tiny is too short
    assert len(heldout_prompts(files, num_prompts=7, prompt_bytes=8)) == 7
    with pytest.raises(ValueError, match="num_prompts=8 exceeds the 7 available"):
        heldout_prompts(files, num_prompts=8, prompt_bytes=8)
    assert heldout_prompts(files, num_prompts=0, prompt_bytes=8) == []
    with pytest.raises(ValueError, match="prompt_bytes must be an int >= 1"):
        heldout_prompts(files, num_prompts=1, prompt_bytes=0)
    with pytest.raises(TypeError, match="num_prompts must be an int"):
        heldout_prompts(files, num_prompts=None, prompt_bytes=4)
    with pytest.raises(ValueError, match="seed must be an int >= 0"):
        heldout_prompts(files, num_prompts=1, prompt_bytes=4, seed=-1)


def test_corpus_on_fake_tree(fake_root):
    train, held, train_files, held_files = corpus(fake_root, heldout_fraction=0.5)
    assert sorted(rels(train_files + held_files, fake_root)) == ALL
    assert (train.num_docs, held.num_docs) == (len(train_files), len(held_files))
    assert train.num_tokens == sum(f.stat().st_size + 2 for f in train_files)
    assert (train_files, held_files) == split_files(stdlib_py_files(fake_root), fake_root, heldout_fraction=0.5)
    _, _, tf, hf = corpus(fake_root, include_tests=False, heldout_fraction=0.5)
    assert sorted(rels(tf + hf, fake_root)) == NO_TESTS
    with pytest.raises(ValueError, match="heldout_fraction"):
        corpus(fake_root, heldout_fraction=1.0)

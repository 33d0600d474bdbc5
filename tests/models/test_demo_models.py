"""The shipped demo checkpoints (specjax/demo_models): each loads from its upstream layout,
converts with ``specjax-convert``, and reproduces the PyTorch reference outputs of
tests/support/fixtures/demo_models (made by make_demo_reference.py from the same files)."""

from __future__ import annotations

import suite_paths  # tests/support: where the suite's pieces are
import hashlib
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import demo_models
from specjax.attention_metadata import CommonAttentionMetadata
from specjax.converters import load_pretrained
from specjax.converters.cli import main as convert_main
from specjax.models import registry, share_target_weights
from specjax.tokenizer import BOS_ID, MASK_ID, VOCAB_SIZE
from specjax.training.recipe import AUX_LAYER_IDS, HEADS_HF, TARGET_HF

FIX = suite_paths.FIXTURES / "demo_models"
BS = 16
TOL = 1e-5


@pytest.fixture(scope="module")
def ref():
    return dict(np.load(FIX / "reference.npz"))


@pytest.fixture(scope="module")
def loaded():
    return {n: demo_models.load(n) for n in demo_models.NAMES}


def md(q, s, causal=True):
    return CommonAttentionMetadata.from_query_lens([q], [s], np.arange(16)[None], block_size=BS,
                                                   causal=causal)


def close(got, want, tol=TOL):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    err = np.max(np.abs(got - want)) / np.max(np.abs(want))
    assert err < tol, err


def test_every_model_is_shipped_and_small():
    assert demo_models.available() == demo_models.NAMES
    total = sum(f.stat().st_size for f in demo_models.ROOT.rglob("*") if f.is_file()
                and f.suffix in (".safetensors", ".json"))
    assert total < 20 * 2**20, total


def test_reference_was_made_from_the_shipped_files():
    sums = json.loads((FIX / "sha256.json").read_text())["files"]
    for rel, digest in sums.items():
        assert hashlib.sha256((demo_models.ROOT / rel).read_bytes()).hexdigest() == digest, (
            f"{rel} changed: rerun tests/support/fixtures/demo_models/make_demo_reference.py")


def test_kinds_and_configs(loaded):
    kinds = {n: k for n, (k, _, _) in loaded.items()}
    assert kinds == {"target": "llama", "eagle": "eagle", "eagle3": "eagle3", "medusa": "medusa",
                     "draft_model": "llama", "dflash": "dflash", "dspark": "dspark"}
    assert set(demo_models.NAMES) <= {"target", *HEADS_HF}     # the recipe makes every one
    for n in demo_models.NAMES[1:]:
        assert loaded[n][1].vocab_size == VOCAB_SIZE == TARGET_HF["vocab_size"]
    assert loaded["eagle3"][1].aux_layer_ids == AUX_LAYER_IDS == loaded["dflash"][1].aux_layer_ids
    assert loaded["dflash"][1].mask_token_id == MASK_ID
    with pytest.raises(ValueError, match="name must be one of"):
        demo_models.path("nope")


@pytest.fixture(scope="module")
def target_out(loaded, ref):
    _, cfg, params = loaded["target"]
    model = registry.make_model("llama", cfg, aux_layer_ids=AUX_LAYER_IDS)
    ids = jnp.asarray(ref["input_ids"], jnp.int32)
    t = ids.shape[0]
    assert int(ids[0]) == BOS_ID
    hidden, aux, _ = model.forward(params, ids, jnp.arange(t, dtype=jnp.int32),
                                   model.init_kv_caches(16, BS), md(t, t))
    return hidden, aux.reshape(t, -1), model.compute_logits(params, hidden)


@pytest.mark.smoke
def test_target_matches_transformers(target_out, ref):
    hidden, aux, logits = target_out
    close(logits, ref["target_logits"])
    close(hidden, ref["target_hidden"])
    close(aux, ref["target_aux"])


@pytest.mark.smoke
def test_draft_model_matches_transformers(loaded, ref):
    _, cfg, params = loaded["draft_model"]
    model = registry.make_model("llama", cfg)
    ids = jnp.asarray(ref["input_ids"], jnp.int32)
    t = ids.shape[0]
    h, _, _ = model.forward(params, ids, jnp.arange(t, dtype=jnp.int32), model.init_kv_caches(16, BS),
                            md(t, t))
    close(model.compute_logits(params, h), ref["draft_model_logits"])


@pytest.mark.smoke
@pytest.mark.parametrize("name", ["eagle", "eagle3"])
def test_eagle_heads_match_reference(name, loaded, ref, target_out):
    hidden, aux, _ = target_out
    tparams = loaded["target"][2]
    kind, cfg, params = loaded[name]
    head = registry.make_model(kind, cfg)
    p = share_target_weights(params, tparams, kind=kind)
    ids = jnp.asarray(ref["draft_input_ids"], jnp.int32)
    t = ids.shape[0]
    feats = hidden if kind == "eagle" else head.combine_hidden_states(p, aux)
    out, _, _ = head.forward(p, ids, jnp.arange(t, dtype=jnp.int32), feats, head.init_kv_caches(16, BS),
                             md(t, t))
    if kind == "eagle":
        close(head.compute_logits(p, out), ref["eagle_logits"])
    else:
        dl = head.compute_draft_logits(p, out)
        close(dl, ref["eagle3_draft_logits"])
        tid = head.draft_to_target_ids(p, jnp.argmax(dl, axis=-1).astype(jnp.int32))
        np.testing.assert_array_equal(np.asarray(tid), ref["eagle3_target_ids"])


@pytest.mark.smoke
def test_dflash_matches_reference(loaded, ref, target_out):
    _, aux, _ = target_out
    _, cfg, params = loaded["dflash"]
    head = registry.make_model("dflash", cfg)
    p = share_target_weights(params, loaded["target"][2])
    t = aux.shape[0]
    caches = head.precompute_and_store_context_kv(p, head.combine_hidden_states(p, aux),
                                                  jnp.arange(t, dtype=jnp.int32),
                                                  jnp.arange(t, dtype=jnp.int32),
                                                  head.init_kv_caches(16, BS))
    block = jnp.asarray(ref["dflash_block_ids"], jnp.int32)
    k = block.shape[0]
    h, _ = head.forward(p, block, jnp.arange(t, t + k, dtype=jnp.int32), caches, md(k, t + k, causal=False))
    close(head.compute_logits(p, h), ref["dflash_logits"])


@pytest.mark.smoke
def test_medusa_matches_reference(loaded, ref, target_out):
    hidden = target_out[0]
    _, cfg, params = loaded["medusa"]
    heads = registry.make_model("medusa", cfg)
    logits = heads.compute_logits(params, heads.forward(params, hidden))
    close(logits[:, -24:], ref["medusa_logits"])


@pytest.mark.smoke
@pytest.mark.parametrize("name", demo_models.NAMES)
def test_specjax_convert_round_trip(name, loaded, tmp_path):
    dst = tmp_path / name
    assert convert_main([str(demo_models.path(name)), str(dst), "--quiet"]) == 0
    kind, cfg, params = load_pretrained(dst, "fp32")
    k0, cfg0, params0 = loaded[name]
    assert (kind, cfg) == (k0, cfg0)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params0)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

"""``benchmarks/floors.py`` (the one definition of a step's byte floor) against bytes counted
by hand and against specjax's own parameter shapes; the plain-Python shape plan of
``benchmarks/torch_anchors.py`` (torch is not needed for it); and ``benchmarks/e2e.py``'s
``--torch`` wiring with the PyTorch measurement replaced by a fake."""

import suite_paths  # tests/support: where the suite's pieces are
import json
import os
import sys
import types

import jax
import jax.numpy as jnp
import pytest

sys.path.insert(0, str(suite_paths.BENCHMARKS))

import floors  # noqa: E402
import torch_anchors  # noqa: E402

# H 8, I 16, 2 layers, 2 query heads / 1 KV head of 4, vocab 10
GEO = dict(hidden_size=8, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
           num_key_value_heads=1, head_dim=4, vocab_size=10, rope_theta=10000.0, rms_norm_eps=1e-5)


@pytest.mark.smoke
def test_llama_floor_matches_bytes_counted_by_hand():
    # per layer: q|k|v 8 x (2 + 1 + 1) * 4 = 128, o 8 * 8 = 64, gate/up/down 3 * 8 * 16 = 384,
    # two norms 16: 592; 2 layers 1184; final norm 8; lm_head 10 * 8 = 80: 1272 params
    assert floors.llama_weight_bytes(GEO, 2) == 1272 * 2
    assert floors.llama_weight_bytes(GEO, 4) == 1272 * 4
    # K and V, 2 layers, 1 KV head of 4, bf16: 2 * 2 * 1 * 4 * 2
    assert floors.kv_bytes_per_token(GEO, 2) == 32
    assert floors.kv_bytes_per_token(GEO, 2, layers=1) == 16
    # 3 requests, 5 cached tokens, 2 new: 3 * 7 tokens of K/V
    assert floors.floor_bytes(2544, 32, 3, 5, 2) == 2544 + 3 * 7 * 32
    assert floors.target_step_bytes(GEO, 3, 5, 2) == 2544 + 672
    assert floors.floor_ms(4.3e9) == pytest.approx(1.0)
    assert floors.HBM_BPS == 4.3e12
    # head_dim defaults to hidden / heads
    assert floors.head_dim({k: v for k, v in GEO.items() if k != "head_dim"}) == 4


@pytest.mark.smoke
def test_chain_and_eagle3_floor_by_hand():
    # EAGLE-3 head of GEO, draft vocab 6: layer q|k|v from 16 wide: 16 * 16 = 256, o 64,
    # mlp 384, three norms 24 = 728; final norm 8; lm_head 6 * 8 = 48 -> 784 params; fc 3 * 8 * 8
    w, fc = floors.eagle3_weight_bytes(GEO, 6, 2)
    assert (w, fc) == (784 * 2, 192 * 2)
    # k = 3 drafts at B = 2, context 5: forwards read 5, 6, 7 tokens of one layer's K/V (16 B)
    want = fc + 3 * w + 2 * (5 + 6 + 7) * 16
    assert floors.eagle3_propose_bytes(GEO, 2, 5, 3, 6, 2) == want
    assert floors.chain_bytes(w, 16, 2, [5, 6, 7], once_bytes=fc) == want
    with pytest.raises(ValueError, match="batch"):
        floors.floor_bytes(1, 1, -1, 1)


@pytest.mark.smoke
def test_mtp_floor_by_hand():
    # MiMo MTP module of GEO: token / hidden norms 16, input_proj 2 * 8 * 8 = 128; the layer:
    # q|k|v 128 + their bias (2 + 1 + 1) * 4 = 16, o 64, mlp 384, two norms 16 = 608; final
    # norm 8; the target's lm_head 10 * 8 = 80 -> 840 params
    assert floors.mtp_weight_bytes(GEO, 2) == 840 * 2
    # k = 3 drafts at B = 2, context 5: every forward reads the module (input_proj included)
    assert floors.mtp_propose_bytes(GEO, 2, 5, 3, 2) == 3 * 840 * 2 + 2 * (5 + 6 + 7) * 16


def _abstract_bytes(kind, hf, skip=("embed_tokens",)):
    from specjax.models import registry

    cfg = registry.config_from_hf(kind, hf)
    flat = jax.tree_util.tree_flatten_with_path(registry.abstract_params(kind, cfg, jnp.bfloat16))[0]
    return sum(a.size * a.dtype.itemsize for p, a in flat
               if jnp.issubdtype(a.dtype, jnp.floating)
               and not any(s in jax.tree_util.keystr(p) for s in skip))


def test_floor_weights_equal_specjax_parameter_shapes():
    """Every floating parameter of specjax's Llama (embedding aside: gathered rows) and of
    its EAGLE-3 head (fc apart) is one the floor counts, for the tiny and the 8B shapes."""
    for name in ("tiny", "8b"):
        geo = floors.TARGETS[name]
        assert _abstract_bytes("llama", geo) == floors.llama_weight_bytes(geo, 2)
        aux = list(torch_anchors.aux_layer_ids(geo["num_hidden_layers"]))
        hf = dict(geo, num_hidden_layers=1, target_hidden_size=geo["hidden_size"],
                  eagle_aux_hidden_state_layer_ids=aux, draft_vocab_size=geo["vocab_size"] // 4,
                  has_d2t=True)
        w, fc = floors.eagle3_weight_bytes(geo, geo["vocab_size"] // 4, 2)
        assert _abstract_bytes("eagle3", hf) == w + fc
        assert _abstract_bytes("eagle3", hf, skip=("embed_tokens", "['fc']")) == w
        # MTP: the module's own params; the lm_head is the target's (not in its params)
        hf = dict(geo, num_hidden_layers=1, num_nextn_predict_layers=1)
        assert (_abstract_bytes("mtp", hf)
                == floors.mtp_weight_bytes(geo, 2) - 2 * geo["vocab_size"] * geo["hidden_size"])
    # tied embeddings: the lm_head is the embedding, counted once
    geo = floors.TARGETS["1b"]
    assert _abstract_bytes("llama", geo, skip=()) == floors.llama_weight_bytes(geo, 2)


@pytest.mark.smoke
def test_torch_anchor_plan_shapes():
    geo = floors.TARGETS["8b"]
    p = torch_anchors.plan(geo, 8, 1024, 4, k=3, draft_vocab=floors.EAGLE3_DRAFT_VOCAB_8B)
    assert p["cached"] == 1023 and p["positions"] == [1023, 1024, 1025, 1026]
    assert p["cache_len"] == 1088                       # 1024 + 4 rounded up to 64
    assert p["kv_cache_shape"] == (8, 8, 1088, 128)
    assert p["folded_query_shape"] == (8, 8, 16, 128)   # group 4 x 4 tokens
    assert p["mask_shape"] == (16, 1088)
    assert p["qkv_out"] == 6144
    assert p["aux_layers"] == (2, 16, 29)
    assert p["target_bytes"] == floors.target_step_bytes(geo, 8, 1023, 4)
    assert p["propose_bytes"] == floors.eagle3_propose_bytes(geo, 8, 1023, 3, 32000)
    assert p["mtp_bytes"] == floors.mtp_propose_bytes(geo, 8, 1023, 3)
    # the 8B floors: 7.5e9 weights read (embedding rows aside), 128 KiB of K/V a token
    assert floors.llama_weight_bytes(geo) == 2 * (32 * 218_112_000 + 4096 + 128256 * 4096)
    assert floors.kv_bytes_per_token(geo) == 131072
    with pytest.raises(ValueError, match="context"):
        torch_anchors.plan(geo, 1, 1, 1)


def test_e2e_torch_pairs_each_step_with_its_anchor(tmp_path, monkeypatch):
    """``e2e.py --torch`` on CPU with a fake PyTorch measurement: each specjax row gets the
    anchor of ``TORCH_PAIRS`` and the ratios are specjax ms over the anchor's ms."""
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")
    seen = {}

    def measure(geo, batches, context, *, k, draft_vocab, dtype, reps):
        seen.update(geo=geo, batches=batches, context=context, k=k, dtype=dtype)
        return [dict(anchor=a, batch=b, synced_ms=2.0 + i, graph_ms=1.0 + i, floor_ms=0.5, compile_s=0.0)
                for b in batches for i, a in enumerate(torch_anchors.ANCHORS)]

    monkeypatch.setitem(sys.modules, "torch_anchors", types.SimpleNamespace(measure=measure))
    import e2e

    out = tmp_path / "anchors.json"
    assert e2e.main(["--tiny", "--torch", "--methods", "eagle3", "--batch", "1", "--no-t1-check",
                     "--iters", "2", "--out", str(out)]) == 0
    assert seen == dict(geo=floors.TARGETS["tiny"], batches=[1], context=64, k=3, dtype="float32")
    doc = json.loads(out.read_text())
    pairs = {p["method"]: p for p in doc["torch_pairs"]}
    assert set(pairs) == {"plain", "eagle3"}             # "plain (again)" has no anchor
    rows = {r["method"]: r for r in doc["rows"]}
    assert pairs["plain"]["anchor"] == "decode"
    assert pairs["plain"]["ratio_synced"] == pytest.approx(rows["plain"]["plain_ms"] / 2.0)
    assert pairs["eagle3"]["anchor"] == "fused"
    assert pairs["eagle3"]["ratio_graph"] == pytest.approx(rows["eagle3"]["spec_ms"] / 4.0)
    assert pairs["eagle3"]["torch_x_floor"] == pytest.approx(5.0 / 0.5)

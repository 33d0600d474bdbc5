"""The DSpark converter (``converters/format_dspark.py``): the three config styles flatten to
one config, vLLM 0.34's lookup orders, every refusal named, and a converted checkpoint
drafting as the NumPy oracle of tests/models/test_dspark.py. The round trips of every case
are in test_converters.py (``dspark_*`` cases) and test_export.py (format ``dspark``)."""

from __future__ import annotations

import copy
import json

import jax.numpy as jnp
import numpy as np
import pytest
from converter_cases import CASES, VD, H, R, V
from specjax.converters import (
    CheckpointError,
    TensorMismatchError,
    detect_format,
    load_pretrained,
    normalize,
    prepare,
)
from specjax.converters.export import export_checkpoint
from specjax.converters.pipeline import make_config
from specjax.converters.tensor_ref import TensorRef
from specjax.models import registry
from test_dspark import B, N, oracle

STYLES = ("dspark_deepspec", "dspark_specforge", "dspark_qwen36")


def _refs(case, drop=(), **extra_shapes):
    shapes = {k: v for k, v in case.shapes.items() if k not in drop}
    shapes.update(extra_shapes)
    c = copy.copy(case)
    c.shapes = shapes
    return {k: TensorRef.from_array(a, k) for k, a in c.arrays().items()}


def _norm(name, edit=None, drop=(), **extra_shapes):
    """Normalize case ``name`` with its config edited in place by ``edit``."""
    case = CASES[name]
    cfg = copy.deepcopy(case.config)
    if edit is not None:
        edit(cfg)
    refs = _refs(case, drop, **extra_shapes)
    norm = normalize("dspark", cfg, refs)         # detection: test_three_styles_one_config
    return norm, make_config("dspark", norm.hf_config, norm.tensors)


def test_three_styles_one_config():
    """The same head in DeepSpec's, SpecForge's and SpecForge qwen3.6's layouts: one
    canonical config (the nested keys lifted to the top level, as vLLM 0.34 reads them)."""
    deep = copy.deepcopy(CASES["dspark_deepspec"].config)
    keys = ("markov_rank", "markov_head_type", "enable_confidence_head",
            "confidence_head_with_markov")
    nested = {k: deep.pop(k) for k in keys}
    mask, ids = deep.pop("mask_token_id"), deep.pop("target_layer_ids")
    forge = dict(deep, architectures=["DSparkDraftModel"],
                 dflash_config=dict(nested, mask_token_id=mask, target_layer_ids=ids,
                                    projector_type="dspark"))
    q36 = dict(deep, architectures=["DSparkDraftModel"], dspark_config=nested,
               dflash_config={"mask_token_id": mask, "target_layer_ids": ids})
    refs = _refs(CASES["dspark_deepspec"])
    got = []
    for cfg in (CASES["dspark_deepspec"].config, forge, q36):
        assert detect_format(cfg, refs) == "dspark"
        norm = normalize("dspark", cfg, refs)
        got.append(make_config("dspark", norm.hf_config, norm.tensors))
    assert got[0] == got[1] == got[2]
    c = got[0]
    assert (c.markov_rank, c.enable_confidence_head, c.aux_layer_ids) == (R, True, (2, 4, 6))


def test_lookup_orders():
    """mask: dflash_config.mask_token_id, mask_token_id, dspark_noise_token_id, pard_token,
    ptd_token_id; ids: eagle_aux_hidden_state_layer_ids as given, else dflash_config /
    dspark_ / top-level target_layer_ids + 1; block: block_size, dspark_block_size."""
    def without(*keys, **add):
        def edit(cfg):
            for k in keys:
                cfg.pop(k, None)
            cfg.update(add)
        return edit

    name = "dspark_deepspec"
    _, c = _norm(name, without(dspark_noise_token_id=9))
    assert c.mask_token_id == V - 1
    _, c = _norm(name, without("mask_token_id", dspark_noise_token_id=9, pard_token=8))
    assert c.mask_token_id == 9
    _, c = _norm(name, without("mask_token_id", ptd_token_id=7))
    assert c.mask_token_id == 7
    _, c = _norm(name, without(dflash_config={"mask_token_id": 2}))
    assert c.mask_token_id == 2
    _, c = _norm(name, without(dspark_target_layer_ids=[0, 1]))
    assert c.aux_layer_ids == (1, 2)
    _, c = _norm(name, without(eagle_aux_hidden_state_layer_ids=[0, 7]))
    assert c.aux_layer_ids == (0, 7)
    _, c = _norm(name, without("block_size", dspark_block_size=6))
    assert c.block_size == 6
    norm, c = _norm(name, without("block_size"))
    assert c.block_size == 0 and any("no block_size" in n for n in norm.notes)


def test_training_keys_and_unused_confidence_head_are_noted():
    norm, c = _norm("dspark_qwen36")
    notes = "\n".join(norm.notes)
    assert "dropped confidence_head.proj.bias, confidence_head.proj.weight" in notes
    assert "enable_confidence_head is false" in notes
    assert "dflash_config.attention_mode ignored" in notes
    assert "renamed autoregressive_head.* -> markov_head.*" in notes
    assert not c.enable_confidence_head and c.markov_head_type == "rnn"
    norm, _ = _norm("dspark_qwen36", _set(["dspark_config", "markov_dropout"], 0.1))
    assert "config: dspark_config.markov_dropout ignored" in "\n".join(norm.notes)
    norm, _ = _norm("dspark_specforge")
    assert any("dflash_config.confidence_head_alpha ignored" in n for n in norm.notes)
    norm, _ = _norm("dspark_deepspec")
    assert any("num_anchors ignored" in n for n in norm.notes)


def _set(path, value):
    def edit(cfg):
        d = cfg
        for p in path[:-1]:
            d = d.setdefault(p, {})
        if value is None:
            d.pop(path[-1], None)
        else:
            d[path[-1]] = value
    return edit


@pytest.mark.parametrize("name, edit, needle", [
    ("dspark_deepspec", _set(["markov_rank"], None),
     r"markov_rank is missing \(looked at the top level, dspark_config and dflash_config\)"),
    ("dspark_specforge", _set(["dflash_config", "markov_rank"], None), "markov_rank is missing"),
    ("dspark_qwen36", _set(["dspark_config", "markov_rank"], 0), r"dspark_config.markov_rank=0"),
    ("dspark_deepspec", _set(["markov_head_type"], "lstm"),
     r"markov_head_type='lstm' is not a DSpark head type .*vanilla, gated, rnn"),
    ("dspark_deepspec", _set(["enable_confidence_head"], "yes"),
     "enable_confidence_head must be true or false"),
    ("dspark_qwen36", _set(["markov_rank"], 8),
     r"markov_rank=8 and dspark_config.markov_rank=6 disagree"),
    ("dspark_specforge", _set(["dflash_config", "projector_type"], "linear"),
     r"dflash_config.projector_type='linear'.*projector_type 'dspark'"),
    ("dspark_deepspec", _set(["dspark_draft_topk"], 8), "dspark_draft_topk=8: top-k Markov"),
    ("dspark_deepspec", _set(["dspark_draft_input"], "position_specific"), "dspark_draft_input"),
    ("dspark_deepspec", _set(["logit_scale"], 2.0), "logit_scale=2.0"),
    ("dspark_qwen36", _set(["dflash_config", "attention_mode"], "mla"), "attention_mode='mla'"),
    ("dspark_deepspec", _set(["mask_token_id"], None), "no mask token"),
    ("dspark_deepspec", _set(["target_layer_ids"], None), "no target layer ids"),
    ("dspark_deepspec", _set(["target_layer_ids"], [1, "x"]), "target_layer_ids=.* list of ints"),
    ("dspark_deepspec", _set(["transformer_layer_config"], {"hidden_size": H}),
     "a speculators DSpark config"),
])
def test_config_refusals_are_named(name, edit, needle):
    with pytest.raises(CheckpointError, match=needle):
        _norm(name, edit)


def test_tensor_refusals_are_named():
    # a gated projection under a vanilla config changes the drafts: refused
    with pytest.raises(CheckpointError, match=r"'markov_head.gate_proj.bias' is a gated Markov "
                       r"head's, but config markov_head_type='vanilla'"):
        _norm("dspark_deepspec", **{"markov_head.gate_proj.weight": (R, H + R),
                                    "markov_head.gate_proj.bias": (R,)})
    # the confidence input width must agree with confidence_head_with_markov, both ways
    with pytest.raises(CheckpointError, match=r"confidence_head.proj.weight has shape \[1, 22\], "
                       r"but config confidence_head_with_markov=false needs \[1, 16\]"):
        _norm("dspark_deepspec", **{"confidence_head.proj.weight": (1, H + R)})
    with pytest.raises(CheckpointError, match=r"shape \[1, 16\], but config "
                       r"confidence_head_with_markov=true needs \[1, 22\] \(\[1, H \+ r\]"):
        _norm("dspark_specforge", **{"confidence_head.proj.weight": (1, H)})


def test_missing_tensors_and_dflash_reader_refusal(tmp_path):
    """Through ``prepare``: a confidence head the config turns on but the files lack, and a
    Markov table of another rank, are named; ``--format dflash`` still refuses DSpark."""
    case = CASES["dspark_specforge"]
    src, arrays = case.write(tmp_path)
    prepare(src)
    for name in ("confidence_head.proj.weight", "confidence_head.proj.bias"):
        arrays.pop(name)
    from safetensors.numpy import save_file
    save_file(arrays, str(src / "model.safetensors"))
    with pytest.raises(TensorMismatchError, match="confidence_head.proj.weight"):
        prepare(src)
    cfg = json.loads((src / "config.json").read_text())
    cfg["dflash_config"]["markov_rank"] = 4
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(TensorMismatchError, match="markov_head.markov_w1.weight"):
        prepare(src)
    with pytest.raises(CheckpointError, match="DSpark head"):
        prepare(src, format="dflash")


@pytest.mark.parametrize("name", STYLES)
def test_converted_checkpoint_drafts_as_the_oracle(tmp_path, name):
    """Load the case (no format given), check every params leaf is its named tensor, then
    run ``DSparkHead.draft`` (base logits through an lm_head, then the Markov chain) and
    compare with the NumPy oracle fed the same tensors."""
    case = CASES[name]
    src, arrays = case.write(tmp_path)
    kind, c, params = load_pretrained(src, dtype="fp32")
    assert kind == "dspark"
    t = {case.canonical[k]: a.astype(np.float64) for k, a in arrays.items()
         if case.canonical[k] is not None}
    mh = params["markov_head"]
    np.testing.assert_array_equal(mh["markov_w1"]["embedding"], t["markov_head.markov_w1.weight"])
    np.testing.assert_array_equal(mh["markov_w2"]["kernel"], t["markov_head.markov_w2.weight"].T)
    extra = {"gated": "gate_proj", "rnn": "joint_proj"}.get(c.markov_head_type)
    assert sorted(mh) == sorted(["markov_w1", "markov_w2"] + ([extra] if extra else []))
    if extra:
        np.testing.assert_array_equal(mh[extra]["kernel"], t[f"markov_head.{extra}.weight"].T)
        np.testing.assert_array_equal(mh[extra]["bias"], t[f"markov_head.{extra}.bias"])
    assert ("confidence_head" in params) == c.enable_confidence_head
    if c.enable_confidence_head:
        np.testing.assert_array_equal(params["confidence_head"]["proj"]["kernel"],
                                      t["confidence_head.proj.weight"].T)
    rng = np.random.default_rng(1)
    if "lm_head.weight" not in t:                       # the target's head, shared
        t["lm_head.weight"] = rng.standard_normal((V, H))
        params = dict(params, lm_head={"kernel": jnp.asarray(t["lm_head.weight"].T, jnp.float32)})
    if "d2t" in t:
        t["d2t"] = t["d2t"].astype(np.int64)
    head = registry.make_model("dspark", c)
    h = rng.standard_normal((B, N, H)).astype(np.float32)
    anchor = rng.integers(0, V, B)
    out = head.draft(params, jnp.asarray(h), jnp.asarray(anchor, jnp.int32))
    d, ci = out[0], out[-1]                             # drafts first, confidences last
    z = h.astype(np.float64) @ t["lm_head.weight"].T
    assert z.shape[-1] == (VD if name == "dspark_qwen36" else V)
    want_d, want_c = oracle(t, c, z, h.astype(np.float64), anchor)
    np.testing.assert_array_equal(np.asarray(d), want_d)
    if c.enable_confidence_head:
        np.testing.assert_allclose(np.asarray(ci), want_c, rtol=1e-4, atol=1e-5)
    else:
        assert ci is None


def test_export_writes_vllm_034_top_level_layout(tmp_path):
    """``export_checkpoint(format="dspark")``: ``Qwen3DSparkModel``, every DSpark key at the
    top level (vLLM reads ``markov_rank`` only there), ``target_layer_ids`` = aux ids - 1,
    no ``dspark_config``; read back to the same config."""
    _, c, params = load_pretrained(CASES["dspark_specforge"].write(tmp_path)[0], dtype="fp32")
    out = export_checkpoint("dspark", c, params, tmp_path / "out", format="dspark", dtype="fp32")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3DSparkModel"] and "dspark_config" not in cfg
    assert "dflash_config" not in cfg
    assert {k: cfg[k] for k in ("markov_rank", "markov_head_type", "enable_confidence_head",
                                "confidence_head_with_markov", "sample_from_anchor",
                                "mask_token_id", "target_layer_ids", "block_size")} == {
        "markov_rank": R, "markov_head_type": "gated", "enable_confidence_head": True,
        "confidence_head_with_markov": True, "sample_from_anchor": True, "mask_token_id": 3,
        "target_layer_ids": [0, 2], "block_size": 16}
    assert load_pretrained(out)[1] == c

"""specjax.training: schedule, optimizer loop, losses, checkpoints, and the recipe end to end
at smoke scale (train -> export in the upstream layout -> load_pretrained)."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.converters import load_pretrained
from specjax.models import registry
from specjax.training import objectives as O
from specjax.training import recipe as R
from specjax.training.trainer import (TrainConfig, init_params, load_params, lr_at, save_params,
                                      train)

SMALL = dict(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5)


@pytest.mark.smoke
def test_lr_schedule_matches_optax_warmup_cosine():
    import optax

    tc = TrainConfig(steps=50, batch_size=1, seq_len=4, lr=1e-2, warmup_steps=5, final_lr_fraction=0.1)
    ref = optax.warmup_cosine_decay_schedule(0.0, 1e-2, 5, 50, end_value=1e-3)
    got = [float(lr_at(tc, jnp.int32(i), jnp.int32(50))) for i in range(50)]
    np.testing.assert_allclose(got, [float(ref(i)) for i in range(50)], rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("field,value", [("steps", 0), ("batch_size", -1), ("lr", 0.0),
                                         ("warmup_steps", 10), ("final_lr_fraction", 2.0)])
def test_train_config_rejects(field, value):
    kw = dict(steps=10, batch_size=2, seq_len=8, warmup_steps=1)
    kw[field] = value
    with pytest.raises(ValueError, match=field):
        TrainConfig(**kw)


@pytest.mark.smoke
def test_target_lm_learns_a_periodic_sequence():
    """Loss falls from ~log(V) to near 0 on a sequence with period 5 (a test that fails if
    the step, the schedule or the objective is broken)."""
    cfg = registry.config_from_hf("llama", SMALL)
    tokens = np.tile(np.array([3, 1, 4, 1, 5], np.int32), 400)
    tc = TrainConfig(steps=60, batch_size=8, seq_len=16, lr=1e-2, warmup_steps=5, log_every=20)
    params, hist = train(O.target_lm(cfg, "float32"), init_params("llama", cfg, jax.random.key(0)),
                         {}, tokens, tc, log=None)
    assert hist[0]["loss"] > 2.5 and hist[-1]["loss"] < 0.3, [h["loss"] for h in hist]
    assert [h["step"] for h in hist] == [1, 20, 40, 60]


def test_time_budget_shortens_the_schedule():
    cfg = registry.config_from_hf("llama", SMALL)
    tokens = np.arange(1000, dtype=np.int32) % 32
    tc = TrainConfig(steps=100_000, batch_size=2, seq_len=8, lr=1e-3, warmup_steps=2, log_every=10**6)
    _, hist = train(O.target_lm(cfg, "float32"), init_params("llama", cfg, jax.random.key(0)), {},
                    tokens, tc, log=None, time_budget_s=25.0)
    last = hist[-1]
    assert last["step"] == last["total_steps"] < 100_000
    assert last["lr"] == pytest.approx(1e-3 * tc.final_lr_fraction, rel=1e-3)   # schedule ended


def test_init_params_structure_and_values():
    cfg = registry.config_from_hf("medusa", dict(num_heads=2, num_hidden_layers=1, hidden_size=16,
                                                 vocab_size=32, medusa_fc_bias=True))
    p = init_params("medusa", cfg, jax.random.key(0))
    assert jax.tree.structure(p) == jax.tree.structure(registry.abstract_params("medusa", cfg, jnp.float32))
    assert float(jnp.abs(p["blocks"][0]["layers"][0]["kernel"]).max()) == 0.0   # identity start
    lcfg = registry.config_from_hf("llama", SMALL)
    lp = init_params("llama", lcfg, jax.random.key(1))
    assert float(lp["norm"]["weight"].min()) == 1.0
    assert 0.01 < float(lp["layers"][0]["self_attn"]["q_proj"]["kernel"].std()) < 0.03


def test_save_load_params_round_trip(tmp_path):
    p = {"a": {0: jnp.ones((2, 3)), 1: jnp.arange(4, dtype=jnp.int32)}, "b": jnp.zeros(5, jnp.bfloat16)}
    path = save_params(tmp_path / "x.safetensors", p, {"note": "hi"})
    q, meta = load_params(path)
    assert meta == {"note": "hi"}
    assert jax.tree.structure(q) == jax.tree.structure(p)
    for a, b in zip(jax.tree.leaves(q), jax.tree.leaves(p)):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    assert [f.name for f in tmp_path.iterdir()] == ["x.safetensors"]      # no temp file left


def test_soft_cross_entropy_against_numpy():
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(3, 7)), rng.normal(size=(3, 7))
    mask = np.array([True, False, True])
    ce, top1 = O.soft_cross_entropy(jnp.asarray(a), jnp.asarray(b), jnp.asarray(mask))
    p = np.exp(b) / np.exp(b).sum(-1, keepdims=True)
    logq = a - np.log(np.exp(a).sum(-1, keepdims=True))
    want = (-(p * logq).sum(-1))[mask].mean()
    assert float(ce) == pytest.approx(want, rel=1e-5)
    assert float(top1) == pytest.approx((a.argmax(-1) == b.argmax(-1))[mask].mean())


def test_dspark_objective_learns_the_target_and_its_own_confidence():
    """A DSpark head distilled from a target trained on a period-5 sequence: the biased
    logits' cross-entropy falls, and so does the confidence head's BCE in excess of the
    entropy of alpha (>= 0 by Gibbs' inequality, which checks the formula)."""
    cfg = registry.config_from_hf("llama", SMALL)
    tokens = np.tile(np.array([3, 1, 4, 1, 5, 9, 2], np.int32), 400)
    tc = TrainConfig(steps=60, batch_size=8, seq_len=16, lr=1e-2, warmup_steps=5, log_every=60)
    tparams, _ = train(O.target_lm(cfg, "float32"), init_params("llama", cfg, jax.random.key(0)),
                       {}, tokens, tc, log=None)
    hcfg = registry.config_from_hf("dspark", dict(SMALL, num_hidden_layers=1, target_hidden_size=32,
                                                  aux_hidden_state_layer_ids=[0, 1], block_size=4,
                                                  mask_token_id=31, markov_rank=4,
                                                  enable_confidence_head=True,
                                                  confidence_head_with_markov=True))
    obj = O.dspark(hcfg, O.TargetSetup(cfg, (0, 1), "float32"), anchors_per_seq=4)
    tc = dataclasses.replace(tc, steps=80, log_every=10)
    _, hist = train(obj, init_params("dspark", hcfg, jax.random.key(1)), {"target": tparams},
                    tokens, tc, log=None)
    assert all(h["conf_bce_excess"] > -1e-4 for h in hist)
    assert hist[-1]["ce"] < 0.5 * hist[0]["ce"], [h["ce"] for h in hist]
    assert hist[-1]["conf_bce_excess"] < 0.5 * hist[0]["conf_bce_excess"]
    with pytest.raises(ValueError, match="full-vocabulary"):
        O.dspark(dataclasses.replace(hcfg, draft_vocab_size=16), O.TargetSetup(cfg, (0, 1)))


def test_draft_vocab_is_most_frequent_sorted():
    toks = np.array([5] * 10 + [7] * 3 + [2] * 3 + [9], np.int32)
    np.testing.assert_array_equal(R.draft_vocab(toks, 3), [2, 5, 7])     # tie 2 vs 7: both in


@pytest.mark.slow
def test_recipe_smoke_trains_exports_and_loads(tmp_path):
    """Target + EAGLE-3 at smoke scale: each exported in its upstream layout and loaded
    back through load_pretrained (format detected), the d2t map intact."""
    rep = R.run(tmp_path, stage="all", scale="smoke", heads=("eagle3",), log=lambda s: None)
    assert set(rep["models"]) == {"target", "eagle3"}
    kind, cfg, params = load_pretrained(tmp_path / "target")
    assert kind == "llama" and cfg.vocab_size == 260
    kind3, cfg3, p3 = load_pretrained(tmp_path / "eagle3")
    assert kind3 == "eagle3" and cfg3.draft_vocab_size == R.DRAFT_VOCAB_SIZE
    assert cfg3.aux_layer_ids == R.AUX_LAYER_IDS
    ids = np.asarray(p3["d2t"]) + np.arange(R.DRAFT_VOCAB_SIZE)
    assert np.all(np.diff(ids) > 0) and ids.max() < 260
    meta = json.loads((tmp_path / "report_all.json").read_text())
    assert meta["scale"] == "smoke" and meta["models"]["eagle3"]["history"]
    with pytest.raises(ValueError, match="stage"):
        R.run(tmp_path, stage="nope")
    with pytest.raises(ValueError, match="heads must be among"):
        R.run(tmp_path, heads=("nope",))
    assert dataclasses.asdict(R.SCHEDULES["full"]["target"])["steps"] == 3000

"""vLLM v0.20's cases restated: ``test_synthetic_rejection_sampler_utils.py``, the
``SpeculativeConfig.__post_init__`` method resolution, ``test_eagle.py::test_load_model``
(embedding / lm_head sharing), and one call from a ``speculative_config`` dict to a ready
proposer whose greedy output equals plain greedy decoding."""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
import pytest

from specjax import demo_models
from specjax.config import (SpeculativeConfig, acceptance_length_to_rates,
                            resolve_synthetic_acceptance_rates)
from specjax.models import share_target_weights
from specjax.sampling import unconditional_to_conditional_rates
from specjax.vllm_config import detect_method

# --- test_synthetic_rejection_sampler_utils.py ----------------------------------------


@pytest.mark.smoke
def test_unconditional_to_conditional_rates():
    assert unconditional_to_conditional_rates([0.9, 0.5, 0.2]) == pytest.approx(
        [0.9, 0.5 / 0.9, 0.2 / 0.5])
    assert unconditional_to_conditional_rates([1.0, 0.6, 0.0, 0.0]) == pytest.approx(
        [1.0, 0.6, 0.0, 0.0])
    assert unconditional_to_conditional_rates([1.0, 1.0, 1.0]) == pytest.approx([1.0, 1.0, 1.0])


@pytest.mark.smoke
@pytest.mark.parametrize("length,n,expected", [
    (2.6, 3, [1.0, 0.6, 0.0]),
    (1.0, 3, [0.0, 0.0, 0.0]),
    (4.0, 3, [1.0, 1.0, 1.0]),
    (2.0, 3, [1.0, 0.0, 0.0]),
    (3.5, 4, [1.0, 1.0, 0.5, 0.0]),
])
def test_acceptance_length_to_rates(length, n, expected):
    assert acceptance_length_to_rates(length, n) == pytest.approx(expected)


@pytest.mark.parametrize("rates, length", [
    (None, None),                      # exactly one is required
    ([1.0, 0.5, 0.0], 2.0),
    ([1.0, 0.5], None),                # length k
    ([1.0, 0.5, -0.1], None),          # range
    ([1.1, 0.5, 0.0], None),
    ([0.5, 0.9, 0.2], None),           # non-increasing
    (None, 0.5),                       # length in [1, k+1]
    (None, 4.5),
])
def test_resolve_refuses(rates, length):
    with pytest.raises(ValueError):
        resolve_synthetic_acceptance_rates(3, rates, length)
    with pytest.raises(ValueError):
        SpeculativeConfig(method="eagle", num_speculative_tokens=3,
                          rejection_sample_method="synthetic",
                          synthetic_acceptance_rates=rates, synthetic_acceptance_length=length)


def test_resolve_length_produces_minvariance_schedule():
    assert resolve_synthetic_acceptance_rates(3, None, 2.6) == pytest.approx([1.0, 0.6, 0.0])
    c = SpeculativeConfig(method="eagle", num_speculative_tokens=3,
                          rejection_sample_method="synthetic", synthetic_acceptance_length=2.6)
    assert c.synthetic_rates == pytest.approx((1.0, 0.6, 0.0))
    assert c.synthetic_acceptance_rates is None and c.synthetic_acceptance_length == 2.6


# --- method resolution (SpeculativeConfig.__post_init__, section 6.1) -------------------


@pytest.mark.smoke
@pytest.mark.parametrize("d, method", [
    ({"model": "[ngram]", "num_speculative_tokens": 2}, "ngram"),
    ({"model": "ngram", "num_speculative_tokens": 2}, "ngram"),
    ({"method": "ngram_gpu", "num_speculative_tokens": 2}, "ngram_gpu"),
    ({"method": "suffix"}, "suffix"),
    ({"model": "org/tiny-llama", "num_speculative_tokens": 2}, "draft_model"),
    ({"model": "yuhuili/EAGLE-LLaMA3-Instruct-8B", "num_speculative_tokens": 2}, "eagle"),
    ({"model": "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B", "num_speculative_tokens": 2}, "eagle3"),
    ({"model": "z-lab/Qwen3-8B-DFlash-b16", "num_speculative_tokens": 2}, "dflash"),
])
def test_method_resolution_by_name(d, method):
    c = SpeculativeConfig.from_vllm(d)
    assert c.method == method
    if method in ("ngram", "ngram_gpu"):
        assert (c.prompt_lookup_min, c.prompt_lookup_max) == (5, 5)


def test_path_rule_order_and_config_first():
    assert detect_method("a/eagle-x") == "eagle"
    assert detect_method("a/EAGLE3-x") == "eagle3"
    assert detect_method("a/dflash") == "dflash"
    assert detect_method("a/eagle3-dflash") == "eagle3"          # vLLM's order
    # the config wins over the path
    assert detect_method("a/eagle3-x", {"dflash_config": {}}) == "dflash"
    assert detect_method("a/x", {"architectures": ["Eagle3LlamaForCausalLM"]}) == "eagle3"
    assert detect_method("a/x", {"speculators_config": {"algorithm": "eagle3"}}) == "eagle3"
    assert detect_method("a/x", {"model_type": "medusa"}) == "medusa"
    # vLLM's MiMo rule fires on architectures[0]; every MTP model type means "mtp"
    assert detect_method("a/x", {"architectures": ["MiMoForCausalLM"], "model_type": "mimo"}) == "mtp"
    assert detect_method("a/x", {"model_type": "deepseek_mtp"}) == "mtp"
    with pytest.raises(ValueError, match="several methods"):
        detect_method("a/x", {"architectures": ["DFlashDraftModel"],
                              "speculators_config": {"algorithm": "eagle3"}})


@pytest.mark.parametrize("name, method", [("eagle", "eagle"), ("eagle3", "eagle3"),
                                          ("dflash", "dflash"), ("medusa", "medusa"),
                                          ("draft_model", "draft_model")])
def test_method_resolution_from_checkpoint(name, method):
    # the demo EAGLE-1 / EAGLE-3 configs say LlamaForCausalLM: their tensors tell
    d = {"model": str(demo_models.path(name)), "num_speculative_tokens": 2}
    assert SpeculativeConfig.from_vllm(d).method == method


def test_explicit_method_contradicted_by_the_checkpoint():
    with pytest.raises(ValueError, match="eagle3"):
        SpeculativeConfig.from_vllm({"method": "eagle", "model": str(demo_models.path("eagle3")),
                                     "num_speculative_tokens": 2})


# --- test_eagle.py::test_load_model (v0.20): embedding and lm_head sharing -------------


def _weights(seed, v=16, h=8):
    r = np.random.default_rng(seed)
    return jnp.asarray(r.standard_normal((v, h)), jnp.float32)


@pytest.mark.smoke
@pytest.mark.parametrize("own_embed", [None, "same", "distinct"])
@pytest.mark.parametrize("own_head", [None, "same", "distinct"])
@pytest.mark.parametrize("tied", [False, True])
def test_load_model_sharing(own_embed, own_head, tied):
    emb, head = _weights(0), _weights(1)
    target = {"embed_tokens": {"embedding": emb}}
    if not tied:
        target["lm_head"] = {"kernel": head.T}
    target_head = {"embedding": emb} if tied else target["lm_head"]
    draft: dict = {"fc": {"kernel": jnp.zeros((16, 8))}}
    if own_embed is not None:
        draft["embed_tokens"] = {"embedding": emb + 0 if own_embed == "same" else _weights(2)}
    if own_head is not None:
        draft["lm_head"] = ({k: v + 0 for k, v in target_head.items()} if own_head == "same"
                            else {"kernel": _weights(3).T})
    out = share_target_weights(draft, target, kind="eagle")
    if own_embed == "distinct":
        assert out["embed_tokens"] is draft["embed_tokens"]
    else:
        assert out["embed_tokens"] is target["embed_tokens"]
    if own_head == "distinct":
        assert out["lm_head"] is draft["lm_head"]
    else:
        assert out["lm_head"]["embedding" if tied else "kernel"] is \
            target_head["embedding" if tied else "kernel"]


def test_eagle1_checkpoint_keeps_its_own_embedding():
    """An EAGLE-1 checkpoint with its own (different) embedding and lm_head loads them, and
    the proposer drafts with them: its params carry those arrays, not the target's."""
    from specjax.models import config_from_hf, registry

    base = dict(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                num_attention_heads=2)
    cfg = config_from_hf("eagle", base)
    tensors = registry.random_tensors("eagle", cfg, seed=1)
    tensors["embed_tokens.weight"] = np.asarray(_weights(5, 32, 16))
    tensors["lm_head.weight"] = np.asarray(_weights(6, 32, 16))
    cfg = registry.config_with_tensors("eagle", cfg, tensors)
    assert cfg.has_embed_tokens and cfg.has_lm_head
    own = registry.params_from_tensors("eagle", cfg, tensors)
    tcfg = config_from_hf("llama", {**base, "num_hidden_layers": 2})
    tp = registry.init_params("llama", tcfg)
    shared = share_target_weights(own, tp, kind="eagle")
    np.testing.assert_array_equal(shared["embed_tokens"]["embedding"], tensors["embed_tokens.weight"])
    np.testing.assert_array_equal(shared["lm_head"]["kernel"], tensors["lm_head.weight"].T)
    # round trip: the own tensors are exported back
    back = registry.tensors_from_params("eagle", cfg, own)
    assert {"embed_tokens.weight", "lm_head.weight"} <= set(back)


# --- one call from a dict to a ready proposer -------------------------------------------


@functools.lru_cache(maxsize=None)
def _target():
    from specjax.engine import TargetModel
    from specjax.models import registry

    kind, cfg, params = demo_models.load("target")
    return TargetModel(registry.make_model(kind, cfg), params)


@pytest.mark.parametrize("name", ["eagle3", "eagle", "draft_model"])
def test_dict_to_proposer_is_lossless(name):
    from specjax import generate, make_proposer
    from specjax.engine import SamplingParams

    tgt = _target()
    d = {"model": str(demo_models.path(name)), "num_speculative_tokens": 3}
    prop = make_proposer(d, target=tgt.model, target_params=tgt.params, max_model_len=128)
    assert prop.method == name
    prompts = [list(b"def main():\n    "), list(b"import os\n")]
    sp = SamplingParams(max_tokens=12)
    got = generate(tgt, prop, prompts, sp, max_model_len=128)
    want = generate(tgt, None, prompts, sp, max_model_len=128)
    assert [o.token_ids for o in got.outputs] == [o.token_ids for o in want.outputs]
    assert got.mean_acceptance_length > 1.0


def test_dict_model_and_draft_both_refused():
    from specjax import make_proposer
    from specjax.models import registry

    tgt = _target()
    kind, cfg, params = demo_models.load("eagle3")
    d = {"model": str(demo_models.path("eagle3")), "num_speculative_tokens": 3}
    with pytest.raises(ValueError, match="both draft= and config.model"):
        make_proposer(d, target=tgt.model, target_params=tgt.params, max_model_len=128,
                      draft=registry.make_model(kind, cfg), draft_params=params)


@pytest.mark.smoke
def test_v033_spelling_of_the_default_rejection_method():
    """v0.33 renamed the default "strict" to "standard" (the same test with greedy drafts);
    its other new values are not implemented and stay refused by name."""
    d = {"method": "ngram", "num_speculative_tokens": 2}
    c = SpeculativeConfig.from_vllm({**d, "rejection_sample_method": "standard"})
    assert c.rejection_sample_method == "strict"
    assert c == SpeculativeConfig.from_vllm(d)
    for v in ("block", "fly"):
        with pytest.raises(ValueError, match="rejection_sample_method"):
            SpeculativeConfig.from_vllm({**d, "rejection_sample_method": v})


@pytest.mark.smoke
def test_max_num_new_slots_for_drafting_is_a_property():
    """vLLM v0.20: ``k - 1`` with parallel drafting, plus 1 for a draft model, read as a
    property (the earlier call form still answers)."""
    cases = [(dict(method="eagle3"), 0), (dict(method="eagle3", parallel_drafting=True), 3),
             (dict(method="draft_model", model="d"), 1),
             (dict(method="draft_model", model="d", parallel_drafting=True), 4)]
    for kw, want in cases:
        c = SpeculativeConfig(num_speculative_tokens=4, **kw)
        assert c.max_num_new_slots_for_drafting == want and isinstance(
            c.max_num_new_slots_for_drafting, int)
        assert c.max_num_new_slots_for_drafting() == want


# --- vLLM 0.34's SpeculativeConfig keys (shared/research/vllm_delta_0.34.md, section 2) ----

_NGRAM = {"method": "ngram", "num_speculative_tokens": 2}


@pytest.mark.smoke
def test_v034_new_keys():
    import warnings

    # suffix_decoding_corpus_tokens: a field with vLLM's meaning (the device suffix corpus's
    # tokens); 0 (per-request matching only) also empties Arctic's global cache
    c = SpeculativeConfig.from_vllm({**_NGRAM, "suffix_decoding_corpus_tokens": 0})
    assert c.suffix_decoding_max_cached_requests == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        c = SpeculativeConfig.from_vllm({**_NGRAM, "suffix_decoding_corpus_tokens": 1 << 20,
                                         "draft_decode_context_parallel_size": 1,
                                         "parallel_drafting": None, "custom_method": None,
                                         "speculator_options": None})
        assert c == SpeculativeConfig.from_vllm(_NGRAM)
        c = SpeculativeConfig.from_vllm({"method": "suffix", "num_speculative_tokens": 4,
                                         "suffix_decoding_corpus_tokens": 4096})
    assert c.suffix_decoding_corpus_tokens == 4096 and c.suffix_backend == "device"
    with pytest.warns(UserWarning, match="suffix_decoding_corpus_tokens=4096 has no effect with "
                                         "suffix_backend='arctic'"):
        SpeculativeConfig.from_vllm({"method": "suffix", "num_speculative_tokens": 4,
                                     "suffix_backend": "arctic",
                                     "suffix_decoding_corpus_tokens": 4096})
    for bad in (-1, 1 << 31, 1.5):
        with pytest.raises(ValueError, match="suffix_decoding_corpus_tokens"):
            SpeculativeConfig.from_vllm({**_NGRAM, "suffix_decoding_corpus_tokens": bad})
    # draft_decode_context_parallel_size: 1 (the target's, specjax has no DCP) only
    with pytest.raises(ValueError, match="draft_decode_context_parallel_size=2 is not supported: "
                                         "specjax has no decode context parallelism"):
        SpeculativeConfig.from_vllm({**_NGRAM, "draft_decode_context_parallel_size": 2})
    with pytest.raises(ValueError, match="draft_decode_context_parallel_size"):
        SpeculativeConfig.from_vllm({**_NGRAM, "draft_decode_context_parallel_size": 0})
    # speculator_options: only for a registered method that reads them (vLLM's message)
    with pytest.raises(ValueError, match="speculator_options is not supported with speculative "
                                         "method 'eagle3'"):
        SpeculativeConfig.from_vllm({"method": "eagle3", "num_speculative_tokens": 2,
                                     "speculator_options": {"x": 1}})
    # dspark: parallel drafting, with adaptive verification and sampled drafts
    c = SpeculativeConfig.from_vllm({"method": "dspark", "num_speculative_tokens": 2,
                                     "enable_adaptive_verification": True,
                                     "draft_sample_method": "probabilistic"})
    assert c.parallel_drafting and c.enable_adaptive_verification
    assert SpeculativeConfig.from_vllm({"method": "dspark", "num_speculative_tokens": 2,
                                        "dspark_draft_topk": 64}).dspark_draft_topk == 64
    with pytest.raises(ValueError, match="dspark_draft_topk is not supported with speculative "
                                         "method 'eagle3'"):
        SpeculativeConfig.from_vllm({"method": "eagle3", "num_speculative_tokens": 2,
                                     "dspark_draft_topk": 64})
    with pytest.raises(ValueError, match="dspark_draft_topk"):
        SpeculativeConfig(method="dspark", num_speculative_tokens=2, dspark_draft_topk=0)


@pytest.mark.smoke
def test_v034_noop_keys_keep_their_033_meaning():
    """0.34 made ``parallel_drafting`` a deprecated no-op (True refused outside DFlash /
    DSpark) and the suffix factors no-ops; specjax implements them and keeps their meaning."""
    d = {"method": "eagle3", "num_speculative_tokens": 3}
    assert SpeculativeConfig.from_vllm({**d, "parallel_drafting": True}).parallel_drafting
    assert not SpeculativeConfig.from_vllm({**d, "parallel_drafting": None}).parallel_drafting
    c = SpeculativeConfig.from_vllm({"method": "suffix", "num_speculative_tokens": 4,
                                     "suffix_decoding_max_spec_factor": 2.0,
                                     "suffix_decoding_min_token_prob": 0.3})
    assert (c.suffix_decoding_max_spec_factor, c.suffix_decoding_min_token_prob) == (2.0, 0.3)


@pytest.mark.smoke
@pytest.mark.parametrize("key, value, replacement", [
    ("custom_class", "my_pkg.MyProposer", "specjax.register_speculative_method"),
    ("use_heterogeneous_vocab", False, "nothing: vLLM 0.34 removed the V1 TLI path"),
    ("use_heterogeneous_vocab", True, "d2t"),
])
def test_v034_removed_keys_name_their_replacement(key, value, replacement):
    with pytest.raises(ValueError, match=f"key '{key}' was removed in vLLM 0.34.*{replacement}"):
        SpeculativeConfig.from_vllm({**_NGRAM, key: value})
    with pytest.raises(ValueError, match=f"key '{key}' was removed"):      # overrides too
        SpeculativeConfig.from_vllm(_NGRAM, **{key: value})


@pytest.mark.smoke
def test_v034_disable_padded_drafter_batch_stays_specjax_own():
    """0.34 removed the key (MRV2 always pads); specjax keeps its non-padded mode as its own
    field, read from a dict too (docs/vllm_config.md)."""
    d = {"method": "eagle3", "num_speculative_tokens": 3, "disable_padded_drafter_batch": True}
    assert SpeculativeConfig.from_vllm(d).disable_padded_drafter_batch


def test_v034_detection_order_when_the_config_names_several(tmp_path):
    """vLLM 0.34's _CHECKPOINT_DETECTION_ORDER (eagle, eagle3, dflash, dspark, mtp) picks
    among the methods a draft's config names; one signal still wins alone (config first)."""
    import json

    cases = [({"architectures": ["DFlashDraftModel"], "speculators_config": {"algorithm": "eagle3"}},
              "eagle3"),
             ({"model_type": "eagle", "dflash_config": {}}, "eagle"),
             ({"model_type": "deepseek_mtp", "dflash_config": {}}, "dflash"),
             ({"model_type": "medusa", "architectures": ["Eagle3LlamaForCausalLM"]}, "eagle3"),
             ({"dflash_config": {}}, "dflash")]
    for i, (cfg, want) in enumerate(cases):
        d = tmp_path / f"eagle3-{i}"          # the path rule would say eagle3: the config wins
        d.mkdir()
        (d / "config.json").write_text(json.dumps(cfg))
        c = SpeculativeConfig.from_vllm({"model": str(d), "num_speculative_tokens": 2})
        assert c.method == want, (cfg, c.method)
    # detect_method itself still refuses the ambiguity; an explicit method is only checked
    with pytest.raises(ValueError, match="several methods"):
        detect_method(str(tmp_path / "eagle3-0"))
    c = SpeculativeConfig.from_vllm({"method": "dflash", "model": str(tmp_path / "eagle3-0"),
                                     "num_speculative_tokens": 2})
    assert c.method == "dflash"


# --- vLLM 0.34: DSpark checkpoints (issue 57) -------------------------------------------


def _dspark_dirs(tmp_path):
    """The three DSpark config styles (tests/support/converter_cases.py) under a path whose
    own rule would say eagle3: the config and tensors decide."""
    from converter_cases import CASES

    return [CASES[n].write(tmp_path / "eagle3-x")[0]
            for n in ("dspark_deepspec", "dspark_specforge", "dspark_qwen36")]


@pytest.mark.smoke
def test_v034_dspark_path_rule_comes_after_dflash():
    """The draft-path substrings in vLLM 0.34's order: eagle-, eagle3, dflash, dspark."""
    assert detect_method("org/Qwen3-8B-DSpark", {}) == "dspark"
    assert detect_method("org/dflash-or-dspark", {}) == "dflash"
    assert detect_method("org/eagle3-dspark", {}) == "eagle3"
    assert detect_method("org/plain-draft", {}) == "draft_model"


@pytest.mark.smoke
@pytest.mark.parametrize("cfg", [
    {"architectures": ["Qwen3DSparkModel"]},
    {"architectures": ["DSparkDraftModel"], "dflash_config": {"mask_token_id": 1}},
    {"dflash_config": {"markov_rank": 4, "projector_type": "dspark"}},
    {"dflash_config": {"mask_token_id": 1}, "dspark_config": {"markov_rank": 4}},
    {"markov_rank": 4, "dflash_config": {"mask_token_id": 1}},
])
def test_v034_dspark_configs_name_dspark_alone(cfg):
    """A DSpark config names dspark only (its dflash_config is not a DFlash signal)."""
    assert detect_method("org/eagle3-x", cfg) == "dspark"


def test_v034_dspark_checkpoints_are_detected(tmp_path):
    for d in _dspark_dirs(tmp_path):
        assert detect_method(str(d)) == "dspark", d
        c = SpeculativeConfig.from_vllm({"model": str(d), "num_speculative_tokens": 2})
        assert c.method == "dspark", d


def test_v034_configured_method_is_checked_never_changed(tmp_path):
    """dflash on a DSpark checkpoint and dspark on a DFlash one are refused; dspark on a
    DSpark checkpoint stays dspark."""
    from converter_cases import CASES

    spark = _dspark_dirs(tmp_path)[1]
    flash = CASES["dflash"].write(tmp_path / "other")[0]
    with pytest.raises(ValueError, match="method='dflash' but .* is a 'dspark' checkpoint"):
        SpeculativeConfig.from_vllm({"method": "dflash", "model": str(spark),
                                     "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="method='dspark' but .* is a 'dflash' checkpoint"):
        SpeculativeConfig.from_vllm({"method": "dspark", "model": str(flash),
                                     "num_speculative_tokens": 2})
    c = SpeculativeConfig.from_vllm({"method": "dspark", "model": str(spark),
                                     "num_speculative_tokens": 2})
    assert c.method == "dspark"

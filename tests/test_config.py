"""SpeculativeConfig: vLLM's defaults and every construction-time check."""

import pytest

from specjax.config import SpeculativeConfig, parse_token_tree


def test_ngram_defaults_and_copying():
    c = SpeculativeConfig(method="ngram", num_speculative_tokens=3)
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (5, 5)
    assert SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_max=7).prompt_lookup_min == 7
    assert SpeculativeConfig(method="ngram_gpu", num_speculative_tokens=3, prompt_lookup_min=2).prompt_lookup_max == 2
    assert SpeculativeConfig(method="eagle", num_speculative_tokens=3).prompt_lookup_min == 0


def test_method_inference_and_repr():
    assert SpeculativeConfig(model="[ngram]", num_speculative_tokens=2).method == "ngram"
    c = SpeculativeConfig(model="org/draft", num_speculative_tokens=2)
    assert c.method == "draft_model" and c.uses_draft_model()
    assert repr(c) == "SpeculativeConfig(method='draft_model', model='org/draft', num_spec_tokens=2)"


def test_suffix_k_default_and_dflash_forces_parallel():
    with pytest.warns(UserWarning, match="defaults to 8 for suffix decoding"):
        assert SpeculativeConfig(method="suffix").num_speculative_tokens == 8    # vLLM 0.34
    with pytest.warns(UserWarning, match="defaults to 7"):
        assert SpeculativeConfig(method="suffix", suffix_decoding_max_tree_depth=7
                                 ).num_speculative_tokens == 7
    arctic = dict(method="suffix", suffix_backend="arctic")          # vLLM 0.20: the depth
    assert SpeculativeConfig(**arctic).num_speculative_tokens == 24
    assert SpeculativeConfig(**arctic, suffix_decoding_max_tree_depth=7).num_speculative_tokens == 7
    d = SpeculativeConfig(method="dflash", num_speculative_tokens=4)
    assert d.parallel_drafting and d.use_dflash() and d.use_eagle()
    assert d.max_num_new_slots_for_drafting() == 3
    assert SpeculativeConfig(model="m", method="draft_model", num_speculative_tokens=4,
                             parallel_drafting=True).max_num_new_slots_for_drafting() == 4


def test_chain_tree_default_and_hashable():
    c = SpeculativeConfig(method="eagle3", num_speculative_tokens=3)
    assert c.speculative_token_tree == "[(0,), (0, 0), (0, 0, 0)]"
    assert c.token_tree == ((0,), (0, 0), (0, 0, 0))
    hash(c)
    assert SpeculativeConfig(method="ngram", num_speculative_tokens=3).token_tree is None


def test_tree_is_resorted_breadth_first():
    c = SpeculativeConfig(method="eagle", num_speculative_tokens=6,
                          speculative_token_tree="[(1,), (0, 1), (0,), (1, 0), (0, 0), (1, 1)]")
    assert c.token_tree == ((0,), (1,), (0, 0), (0, 1), (1, 0), (1, 1))


@pytest.mark.parametrize("tree, match", [
    ("[(0,), (0,", "does not parse"),
    ("[]", "non-empty"),
    ("[(0,), (0, 0), (0, 0)]", "duplicate"),
    ("[(0,), (1, 0)]", "breadth-first"),            # parent (1,) missing
    ("[(0,), (1,), (0, 0)]", "breadth-first"),      # (1,) has no child while (0,) has one
    ("[(0,), (0, 1)]", "breadth-first"),            # children must start at 0
    ("[(0,), (-1,)]", "non-negative"),
    ("[(0,), (0, 0, 0)]", "breadth-first"),         # level 2 missing
])
def test_bad_trees(tree, match):
    with pytest.raises(ValueError, match=match):
        parse_token_tree(tree)
    with pytest.raises(ValueError, match="speculative_token_tree"):
        SpeculativeConfig(method="eagle", num_speculative_tokens=2, speculative_token_tree=tree)


@pytest.mark.parametrize("kwargs, field", [
    (dict(method="nope", num_speculative_tokens=1), "method"),
    (dict(method="mlp_speculator", num_speculative_tokens=1), "method"),
    (dict(method="mtp"), "num_nextn_predict_layers"),      # vLLM's default needs the checkpoint
    (dict(method="mtp", num_speculative_tokens=2, speculative_token_tree="[(0,), (1,)]"),
     "speculative_token_tree"),
    (dict(method="mtp", num_speculative_tokens=2, parallel_drafting=True), "parallel_drafting"),
    (dict(method="eagle"), "num_speculative_tokens"),
    (dict(method="eagle", num_speculative_tokens=0), "num_speculative_tokens"),
    (dict(method="eagle", num_speculative_tokens=2.0), "num_speculative_tokens"),
    (dict(method="ngram", num_speculative_tokens=2, prompt_lookup_min=4, prompt_lookup_max=3), "prompt_lookup_min"),
    (dict(method="ngram", num_speculative_tokens=2, prompt_lookup_min=0), "prompt_lookup_min"),
    (dict(method="medusa", num_speculative_tokens=2, parallel_drafting=True), "parallel_drafting"),
    (dict(method="ngram", num_speculative_tokens=2, parallel_drafting=True), "parallel_drafting"),
    (dict(method="eagle", num_speculative_tokens=2, parallel_drafting=True,
          disable_padded_drafter_batch=True), "disable_padded_drafter_batch"),
    (dict(method="extract_hidden_states", num_speculative_tokens=2), "num_speculative_tokens"),
    (dict(method="draft_model", num_speculative_tokens=2), "model"),
    (dict(method="medusa", num_speculative_tokens=2, speculative_token_tree="[(0,), (1,)]"), "speculative_token_tree"),
    (dict(method="ngram", num_speculative_tokens=2, speculative_token_tree="[(0,)]"), "speculative_token_tree"),
    (dict(method="eagle", num_speculative_tokens=2, parallel_drafting=True,
          speculative_token_tree="[(0,), (1,)]"), "parallel_drafting"),
    (dict(method="suffix", suffix_decoding_max_tree_depth=0), "suffix_decoding_max_tree_depth"),
    (dict(method="suffix", suffix_decoding_max_cached_requests=-1), "suffix_decoding_max_cached_requests"),
    (dict(method="suffix", suffix_decoding_max_spec_factor=-0.5), "suffix_decoding_max_spec_factor"),
    (dict(method="suffix", suffix_decoding_min_token_prob=1.5), "suffix_decoding_min_token_prob"),
    (dict(method="eagle", num_speculative_tokens=2, rejection_sample_method="fast"), "rejection_sample_method"),
    (dict(method="eagle", num_speculative_tokens=2, rejection_sample_method="synthetic"), "synthetic_acceptance"),
    (dict(method="eagle", num_speculative_tokens=2, rejection_sample_method="synthetic",
          synthetic_acceptance_rates=(0.5,)), "synthetic_acceptance_rates"),
    (dict(method="eagle", num_speculative_tokens=2, rejection_sample_method="synthetic",
          synthetic_acceptance_length=3.5), "synthetic_acceptance_length"),
    (dict(method="eagle", num_speculative_tokens=2, synthetic_acceptance_length=2.0), "synthetic"),
    (dict(method="eagle", num_speculative_tokens=2, draft_tensor_parallel_size=0), "draft_tensor_parallel_size"),
    (dict(method="eagle", num_speculative_tokens=2, max_model_len=2**31), "max_model_len"),
])
def test_errors_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SpeculativeConfig(**kwargs)


def test_synthetic_ok_and_mtp_alias_warns():
    c = SpeculativeConfig(method="eagle", num_speculative_tokens=2, rejection_sample_method="synthetic",
                          synthetic_acceptance_rates=[0.9, 0.5])
    assert c.synthetic_acceptance_rates == (0.9, 0.5)
    hash(c)
    with pytest.warns(DeprecationWarning):       # vLLM rewrites every *_mtp alias to "mtp"
        c = SpeculativeConfig(method="mimo_mtp", num_speculative_tokens=1)
    assert c.method == "mtp" and c.use_eagle()

"""Bring your own model (issue 48, first slice): the step, the engine and the proposers over a
target written from scratch against ``specjax.Target`` (tests/support/foreign_target.py: GPT-2
style, one KV array per model, its own attention), greedy output equal to an independent
full-recompute loop; what is not supported yet is refused by name before anything runs.
Trees (with ``move_kv``), an EAGLE-3 oracle, sampling and a mesh: test_foreign_target_more.py."""

from __future__ import annotations

import dataclasses
import functools

import pytest

import specjax
from specjax import LoopOptions, SamplingParams, SpeculativeConfig, TargetModel, make_proposer
from specjax.models import registry

from foreign_target import ForeignGPT, full_recompute_greedy, greedy_margin, init_params

BS, MML, N = 8, 64, 20
PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [1, 2, 3, 1, 2, 3, 1, 2]]
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2,
         "prompt_lookup_max": 4}
LOOPS = {"per_step": LoopOptions(steps_per_sync=1), "device_loop": None}




@functools.lru_cache(maxsize=None)
def model() -> tuple[ForeignGPT, dict]:
    return ForeignGPT(block_size=BS), init_params(0)


@functools.lru_cache(maxsize=None)
def reference() -> list[list[int]]:
    _, params = model()
    refs = [full_recompute_greedy(params, p, N) for p in PROMPTS]
    # no near-ties: float32 paged attention and the float64 reference pick the same argmax
    assert min(greedy_margin(params, p, r) for p, r in zip(PROMPTS, refs)) > 1e-3
    return refs


def eagle3_proposer(tree: list | None = None, target=None, params=None):
    """A random EAGLE-3 head (aux layers 0 and 1) on ``target`` / ``params`` (default:
    :func:`model`'s), chain (k = 3) or drafting ``tree``."""
    tgt, own = model()
    tgt, params = target or tgt, own if params is None else params
    hcfg = registry.config_from_hf("eagle3", dict(
        hidden_size=tgt.hidden_size, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=4, rms_norm_eps=1e-5, vocab_size=tgt.vocab_size,
        num_hidden_layers=1, draft_vocab_size=tgt.vocab_size,
        target_hidden_size=tgt.hidden_size, eagle_aux_hidden_state_layer_ids=[0, 1]))
    extra = {} if tree is None else {"speculative_token_tree": str(tree)}
    cfg = SpeculativeConfig(method="eagle3", num_speculative_tokens=3 if tree is None
                            else len(tree), **extra)
    return make_proposer(cfg, target=tgt, target_params=params, draft=hcfg,
                         draft_params=registry.init_params("eagle3", hcfg, 1),
                         max_model_len=MML, block_size=BS, kernel_backend="xla")


def mtp_proposer():
    """An MTP-style head without embedding or lm_head: both come from the target's
    ``shared_weights`` (its own arrays)."""
    tgt, params = model()
    dcfg = registry.config_from_hf("mtp", dict(
        hidden_size=tgt.hidden_size, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=4, rms_norm_eps=1e-5, vocab_size=tgt.vocab_size,
        num_hidden_layers=1, num_nextn_predict_layers=1))
    dp = {k: v for k, v in registry.init_params("mtp", dcfg, 1).items()
          if k not in ("embed_tokens", "lm_head")}
    return make_proposer(SpeculativeConfig(method="mtp", num_speculative_tokens=1), target=tgt,
                         target_params=params, draft=dcfg, draft_params=dp, max_model_len=MML,
                         block_size=BS, kernel_backend="xla")


def proposer(method: str):
    if method == "plain":
        return None
    if method == "ngram":
        return make_proposer(NGRAM, max_model_len=MML, block_size=BS)
    if method == "mtp":
        return mtp_proposer()
    return eagle3_proposer()


def run(prop, options=None, target=None, **kw):
    tgt, params = model()
    return specjax.generate(TargetModel(target or tgt, params), prop, PROMPTS,
                            SamplingParams(max_tokens=N, ignore_eos=True), max_model_len=MML,
                            block_size=BS, options=options, **kw)


def test_the_foreign_target_is_a_target_without_config():
    tgt, _ = model()
    assert not hasattr(tgt, "config") and isinstance(tgt, specjax.Target)
    assert not hasattr(tgt, "move_kv")


@pytest.mark.parametrize("loop", sorted(LOOPS))
@pytest.mark.parametrize("method", ["plain", "ngram", "eagle3", "mtp"])
def test_greedy_equals_full_recompute(method, loop):
    res = run(proposer(method), LOOPS[loop])
    assert res.token_ids == reference()
    if method == "ngram":        # the prompts repeat: drafts are accepted
        assert res.mean_acceptance_length > 1


def test_drafters_share_the_targets_own_arrays_and_read_its_aux_layers():
    tgt, params = model()
    mtp = mtp_proposer()
    assert mtp.params["embed_tokens"]["embedding"] is params["wte"]
    assert mtp.params["lm_head"]["kernel"] is params["lm_head"]
    prop = eagle3_proposer()
    assert prop.params["embed_tokens"]["embedding"] is params["wte"]
    assert prop.feed.aux_layer_ids == (0, 1)
    step = specjax.make_step(tgt, prop)
    assert step.target.aux_layer_ids == (0, 1) and isinstance(step.target, ForeignGPT)
    assert step.place_target_params(params) is params


class _NoForward:
    """A ForeignGPT's members, ``forward`` left out."""

    def __init__(self):
        self._t = model()[0]

    def __getattr__(self, name):
        if name == "forward":
            raise AttributeError(name)
        return getattr(self._t, name)


def test_a_target_missing_a_member_is_refused_by_name():
    with pytest.raises(TypeError, match="lacks forward"):
        specjax.make_step(_NoForward(), None)
    with pytest.raises(ValueError, match="lacks forward"):
        run(None, target=_NoForward())
    with pytest.raises(ValueError, match="lacks forward"):
        eagle3_proposer(target=_NoForward())


def test_a_recurrent_target_is_refused():
    rec = dataclasses.replace(model()[0], recurrent=True)
    with pytest.raises(ValueError, match="recurrent"):
        specjax.make_step(rec, None)
    with pytest.raises(ValueError, match="recurrent"):
        run(None, target=rec)


def test_tree_verification_without_move_kv_is_refused():
    prop = eagle3_proposer([(0,), (1,), (0, 0), (1, 0)])
    with pytest.raises(ValueError, match="move_kv"):
        specjax.make_step(model()[0], prop)
    with pytest.raises(ValueError, match="move_kv"):
        run(prop)

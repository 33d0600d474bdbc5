"""The names a user starts from (``specjax.__all__``) and ``Pretrained``: a loaded
checkpoint goes to ``generate`` / ``make_proposer`` as it is, and decodes exactly as the
runner-and-params form does."""

from __future__ import annotations

import numpy as np
import pytest

import specjax
from specjax.engine import TargetModel
from specjax.models import DecoderLM, registry
from specjax.tokenizer import ByteTokenizer

pytestmark = pytest.mark.smoke

PROMPT = b"def add(a, b):\n    return"


def test_all_is_the_user_api():
    want = {"load_pretrained", "load_demo_model", "Pretrained", "SpeculativeConfig",
            "make_proposer", "generate", "Engine", "LoopOptions", "SamplingParams", "make_step",
            "build_batch", "register_speculative_method"}
    assert want <= set(specjax.__all__)
    for internal in ("PADDING_SLOT_ID", "next_power_of_2", "score"):
        assert internal not in specjax.__all__
        with pytest.raises(AttributeError):
            getattr(specjax, internal)


def test_pretrained_unpacks_and_builds_its_runner():
    pre = specjax.load_demo_model("target")
    assert isinstance(pre, specjax.Pretrained)
    kind, cfg, params = pre
    assert kind == "llama" and cfg.kind == "llama"
    assert isinstance(pre.model, DecoderLM) and pre.model.config == cfg
    assert params["embed_tokens"]["embedding"].dtype == np.float32


def test_pretrained_decodes_as_the_runner_and_params_form():
    """Greedy EAGLE-3 through ``Pretrained`` arguments emits the tokens of the explicit
    ``target=runner, target_params=..., draft=config, draft_params=...`` form, which emits
    plain greedy decoding's (the engine's own tests prove that one)."""
    target = specjax.load_demo_model("target")
    draft = specjax.load_demo_model("eagle3")
    prompts = [ByteTokenizer().encode(PROMPT, bos=True)]
    sp = specjax.SamplingParams(max_tokens=24)
    spec = {"method": "eagle3", "num_speculative_tokens": 3}
    new = specjax.generate(target, specjax.make_proposer(spec, target=target, draft=draft,
                                                         max_model_len=256), prompts, sp)
    runner = registry.make_model(target.kind, target.config)
    old = specjax.generate(
        TargetModel(runner, target.params),
        specjax.make_proposer(spec, target=runner, target_params=target.params,
                              draft=draft.config, draft_params=draft.params, max_model_len=256),
        prompts, sp)
    plain = specjax.generate(target, None, prompts, sp, max_model_len=256)
    assert new.token_ids == old.token_ids == plain.token_ids
    assert len(new.token_ids[0]) == 24


def test_pretrained_misuse_is_named():
    target = specjax.load_demo_model("target")
    draft = specjax.load_demo_model("eagle3")
    spec = {"method": "eagle3", "num_speculative_tokens": 3}
    with pytest.raises(ValueError, match=r"target= is a 'eagle3' checkpoint, not a decoder LM"):
        specjax.make_proposer(spec, target=draft, draft=draft, max_model_len=256)
    with pytest.raises(ValueError, match=r"target_params= is given too"):
        specjax.make_proposer(spec, target=target, target_params=target.params, draft=draft,
                              max_model_len=256)
    with pytest.raises(ValueError, match=r"draft_params= is given too"):
        specjax.make_proposer(spec, target=target, draft=draft, draft_params=draft.params,
                              max_model_len=256)
    with pytest.raises(ValueError, match=r"target is a 'eagle3' checkpoint, not a decoder LM"):
        specjax.Engine(draft, None, max_model_len=256)

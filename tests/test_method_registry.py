"""User-defined methods (``specjax.register_speculative_method``, vLLM 0.34's plugin
registry that replaced ``custom_class``): proposers defined here (on the host, from the
token history, and on the device, inside the jitted step), keeping the documented
``Proposer`` / ``Feed`` contract, decode through ``SpeculativeConfig`` /
``make_proposer`` / ``generate`` exactly as plain greedy decoding; the refusals name what is
wrong."""

from __future__ import annotations

import dataclasses
import functools

import pytest

import specjax
from specjax import demo_models
from specjax.config import SpeculativeConfig
from specjax.engine import SamplingParams
from specjax.method_registry import registered_methods, unregister_speculative_method
from specjax.proposers import DraftOutput, Feed, ModelProposer, Proposer, TokenHistory

MML = 128
PROMPTS = [list(b"aaaa bbbb aaaa "), list(b"def f(x):\n    return x\n")]


@dataclasses.dataclass(frozen=True)
class RepeatOptions:
    """The method's ``speculator_options``: how many drafts per step (None: k)."""

    drafts: int | None = None

    def __post_init__(self):
        if self.drafts is not None and (not isinstance(self.drafts, int) or self.drafts < 1):
            raise ValueError(f"drafts must be None or an int >= 1, got {self.drafts!r}")


class RepeatLast(Proposer):
    """Drafts the last committed token ``drafts`` times (from the token history)."""

    def __init__(self, config: SpeculativeConfig, *, max_model_len: int) -> None:
        self.config = config
        k = config.num_speculative_tokens
        self._feed = Feed(drafts_in="history", num_speculative_tokens=k, lookahead=k + 1,
                          max_model_len=max_model_len)

    @property
    def feed(self) -> Feed:
        return self._feed

    def propose_from_history(self, history: TokenHistory) -> DraftOutput:
        k = self.config.num_speculative_tokens
        opts = self.config.speculator_options
        n = min(k, (opts.drafts if opts is not None else None) or k)
        drafts = [[int(history.token_ids[b, history.num_tokens[b] - 1])] * n
                  if len(history.sampled_token_ids[b]) else []
                  for b in range(len(history.req_ids))]
        return DraftOutput.from_lists(drafts, k)


def build_repeat(config, max_model_len):
    """A function builder (instead of a class)."""
    return RepeatLast(config, max_model_len=max_model_len)


@dataclasses.dataclass(frozen=True)
class RepeatImpl:
    """A device drafter (inside the jitted step): each request's new token, ``k`` times."""

    k: int
    needs_hidden_states: bool = False
    needs_aux_hidden_states: bool = False

    def init_state(self, num_blocks, dtype):
        return None

    def prepare_next_token_ids_padded(self, sampled, discard, backup, *, vocab_size,
                                      num_reqs=None):
        import specjax.kernels as K

        return K.eagle_prepare_next_token_padded(sampled, discard, backup, vocab_size=vocab_size,
                                                 num_reqs=num_reqs, backend="xla")

    def prepare_inputs_padded(self, sdm, valid, cad):
        import specjax.kernels as K

        return K.eagle_prepare_inputs_padded(sdm.cu_num_draft_tokens, valid, cad.query_start_loc,
                                             num_reqs=cad.num_reqs, backend="xla")

    def propose(self, params, state, inputs):
        import jax.numpy as jnp

        nxt = inputs.next_token_ids
        ids = jnp.broadcast_to(nxt[:, None], (nxt.shape[0], self.k)).astype(jnp.int32)
        return DraftOutput(ids, jnp.full(nxt.shape, self.k, jnp.int32)), state


def build_device(config, max_model_len, block_size):
    return ModelProposer(config, RepeatImpl(config.num_speculative_tokens), {}, vocab_size=None)


NAMES = ("repeat_last", "repeat_fn", "repeat_named", "repeat_device")


@pytest.fixture
def registered():
    specjax.register_speculative_method("repeat_last", RepeatLast, RepeatOptions)
    specjax.register_speculative_method("repeat_fn", build_repeat)
    specjax.register_speculative_method("repeat_named", f"{__name__}:RepeatLast",
                                        f"{__name__}.RepeatOptions")
    specjax.register_speculative_method("repeat_device", build_device)
    yield
    for name in NAMES:
        unregister_speculative_method(name)
    assert registered_methods() == []


@functools.lru_cache(maxsize=None)
def _target():
    from specjax.engine import TargetModel
    from specjax.models import registry

    kind, cfg, params = demo_models.load("target")
    return TargetModel(registry.make_model(kind, cfg), params)


def _greedy(prop):
    return [o.token_ids for o in specjax.generate(_target(), prop, PROMPTS,
                                                  SamplingParams(max_tokens=16),
                                                  max_model_len=MML).outputs]


@pytest.mark.parametrize("spec", [
    dict(method="repeat_last", num_speculative_tokens=3),     # a SpeculativeConfig's fields
    {"method": "repeat_fn", "num_speculative_tokens": 2},
    {"method": "repeat_named", "num_speculative_tokens": 3, "speculator_options": {"drafts": 1}},
    # a vLLM 0.34 dump: the custom name in custom_method, "method" holding the base method
    {"method": None, "custom_method": "repeat_last", "num_speculative_tokens": 2},
    {"method": "repeat_device", "num_speculative_tokens": 3},
])
def test_registered_method_is_lossless(registered, spec):
    device = spec.get("method") == "repeat_device"
    if "speculator_options" not in spec and spec.get("method"):
        spec = SpeculativeConfig(**spec)
    prop = specjax.make_proposer(spec, max_model_len=MML)
    assert isinstance(prop, ModelProposer if device else RepeatLast)
    assert prop.feed.drafts_in == ("step" if device else "history")
    assert prop.config.custom_method == prop.method
    res = specjax.generate(_target(), prop, PROMPTS, SamplingParams(max_tokens=16),
                           max_model_len=MML)
    assert [o.token_ids for o in res.outputs] == _greedy(None)
    assert res.spec_stats.num_draft_tokens > 0      # it drafted, and the drafts were verified


def test_speculator_options_are_the_config_class_value(registered):
    c = SpeculativeConfig(method="repeat_last", num_speculative_tokens=3,
                          speculator_options={"drafts": 2})
    assert c.speculator_options == RepeatOptions(drafts=2) and hash(c) == hash(
        SpeculativeConfig(method="repeat_last", num_speculative_tokens=3,
                          speculator_options={"drafts": 2}))
    assert dataclasses.replace(c, num_speculative_tokens=4).speculator_options == RepeatOptions(2)
    assert SpeculativeConfig(method="repeat_last", num_speculative_tokens=3).speculator_options \
        == RepeatOptions()
    assert SpeculativeConfig(method="eagle3", num_speculative_tokens=3).custom_method is None
    with pytest.raises(ValueError, match="drafts must be"):
        SpeculativeConfig(method="repeat_last", num_speculative_tokens=3,
                          speculator_options={"drafts": 0})
    with pytest.raises(ValueError, match=r"speculator_options=.*'repeat_last'.*unexpected"):
        SpeculativeConfig(method="repeat_last", num_speculative_tokens=3,
                          speculator_options={"depth": 2})
    # vLLM 0.34: an option the method's config does not read is refused by name
    for method, extra in (("repeat_fn", {}), ("eagle3", {}), ("ngram", {})):
        with pytest.raises(ValueError, match=f"speculator_options is not supported with "
                                             f"speculative method '{method}'"):
            SpeculativeConfig(method=method, num_speculative_tokens=2,
                              speculator_options={"drafts": 1}, **extra)


def test_unknown_method_lists_builtin_and_registered(registered):
    for make in (lambda: SpeculativeConfig(method="my_method", num_speculative_tokens=2),
                 lambda: SpeculativeConfig.from_vllm({"method": "my_method",
                                                      "num_speculative_tokens": 2}),
                 lambda: SpeculativeConfig.from_vllm({"custom_method": "my_method",
                                                      "num_speculative_tokens": 2})):
        with pytest.raises(ValueError, match=r"Unknown speculative method 'my_method'\. "
                           r"Built-in methods: \['ngram'.*registered custom methods: "
                           r"\['repeat_device', 'repeat_fn', 'repeat_last', 'repeat_named'\]"):
            make()
    from specjax.proposers import available_methods
    assert available_methods()[-4:] == ("repeat_device", "repeat_fn", "repeat_last",
                                        "repeat_named")
    assert "ngram" in available_methods()


def test_registration_refusals(registered):
    reg = specjax.register_speculative_method
    for name in ("eagle3", "ngram", "draft_model", "dspark", "mlp_speculator", "deepseek_mtp"):
        with pytest.raises(ValueError, match=f"method '{name}' is built in"):
            reg(name, RepeatLast)
    with pytest.raises(ValueError, match="'repeat_last' is already registered"):
        reg("repeat_last", build_repeat)
    for bad in ("", "my method", 3, None):
        with pytest.raises(TypeError, match="name must be a method name"):
            reg(bad, RepeatLast)
    with pytest.raises(TypeError, match="proposer must be a class, a function"):
        reg("other", 42)
    with pytest.raises(TypeError, match="config_class must be"):
        reg("other", RepeatLast, 42)
    with pytest.raises(ValueError, match="'other' is not registered"):
        unregister_speculative_method("other")
    assert "other" not in registered_methods()


def test_build_refusals(registered):
    cfg = SpeculativeConfig(method="repeat_last", num_speculative_tokens=2)
    with pytest.raises(ValueError, match="max_model_len is required"):
        specjax.make_proposer(cfg)
    with pytest.raises(ValueError, match=r"takes no draft=, window=; it takes: \['max_model_len'\]"):
        specjax.make_proposer(cfg, max_model_len=MML, draft=object(), window=3)
    with pytest.raises(ValueError, match="kernel_backend"):
        specjax.make_proposer(cfg, max_model_len=MML, kernel_backend="cuda")

    def wrong(config, max_model_len):
        return "drafts"

    def other_k(config, max_model_len):
        return RepeatLast(dataclasses.replace(config, num_speculative_tokens=1),
                          max_model_len=max_model_len)

    specjax.register_speculative_method("wrong", wrong)
    specjax.register_speculative_method("other_k", other_k)
    specjax.register_speculative_method("missing", "no_such_module_xyz:Builder")
    try:
        with pytest.raises(TypeError, match="returned str, not a specjax.proposers.Proposer"):
            specjax.make_proposer({"method": "wrong", "num_speculative_tokens": 2},
                                  max_model_len=MML)
        with pytest.raises(ValueError, match="the proposer's config must be"):
            specjax.make_proposer({"method": "other_k", "num_speculative_tokens": 2},
                                  max_model_len=MML)
        with pytest.raises(ImportError, match="no_such_module_xyz"):
            specjax.make_proposer({"method": "missing", "num_speculative_tokens": 2},
                                  max_model_len=MML)
    finally:
        for name in ("wrong", "other_k", "missing"):
            unregister_speculative_method(name)
    # the rules SpeculativeConfig applies to every method hold for registered ones
    with pytest.raises(ValueError, match="speculative_token_tree"):
        SpeculativeConfig(method="repeat_last", num_speculative_tokens=2,
                          speculative_token_tree="[(0,), (0, 0)]")
    with pytest.raises(ValueError, match="parallel_drafting"):
        SpeculativeConfig(method="repeat_last", num_speculative_tokens=2, parallel_drafting=True)

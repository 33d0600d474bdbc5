"""``method="dspark"``: greedy DSpark decoding equals plain greedy decoding (random heads, with
and without the confidence head, both block layouts, a reduced-vocab rnn head)."""

import pytest

from specjax.config import SpeculativeConfig
from specjax.models import registry
from specjax.proposers import make_proposer

import test_engine as te
from compile_check import fast_compiles as _fast_compiles  # noqa: F401 (autouse)

DSPARK = dict(te.HEADS["dflash"][1], markov_rank=8)


def build(k, params=None, **hf):
    tgt = te.target()
    dcfg = registry.config_from_hf("dspark", dict(DSPARK, **hf))
    params = params(dcfg) if params else registry.init_params("dspark", dcfg, 1)
    cfg = SpeculativeConfig(method="dspark", num_speculative_tokens=k)
    return make_proposer(cfg, draft=dcfg, draft_params=params, target=tgt.model,
                         target_params=tgt.params, max_model_len=te.MML, block_size=te.BS,
                         kernel_backend="xla")


def texts(out):
    return [o.token_ids for o in out.outputs]


@pytest.mark.parametrize("k,hf", [
    (3, {}), (3, dict(enable_confidence_head=True, confidence_head_with_markov=True)),
    (2, dict(sample_from_anchor=False)), (1, dict(sample_from_anchor=False)),
    (3, dict(markov_head_type="rnn", draft_vocab_size=40, has_d2t=True,
                                                    has_lm_head=True)),
])
def test_dspark_greedy_is_lossless(k, hf):
    assert texts(te.run(build(k, **hf), "A")) == texts(te.baseline("A"))


def test_one_token_anchored_block_is_refused():
    with pytest.raises(ValueError, match="sample_from_anchor=True needs"):
        build(1)


def test_refusals_by_name():
    for kw in (dict(enable_adaptive_verification=True), dict(draft_sample_method="probabilistic")):
        with pytest.raises(ValueError, match="method='dspark' drafts greedily"):
            SpeculativeConfig(method="dspark", num_speculative_tokens=2, **kw)
    with pytest.raises(ValueError, match="branching"):
        SpeculativeConfig(method="dspark", num_speculative_tokens=2,
                          speculative_token_tree="[(0,), (1,)]")


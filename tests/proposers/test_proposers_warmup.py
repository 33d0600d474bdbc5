"""``warmup(buckets)``: every model-based proposer compiles ``propose`` ahead of time for
each shape bucket, after which calls whose real request / token counts vary inside those
buckets compile nothing (JAX's compile log stays empty, the jit cache does not grow)."""

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import make_proposer
from specjax.attention_metadata import CommonAttentionMetadata
from specjax.config import SpeculativeConfig
from specjax.models import registry, share_target_weights
from specjax.models.extract_hidden_states import ExtractHiddenStates
from specjax.proposers.types import ProposerInputs
from specjax.proposers.common import ProposeBucket
from specjax.proposers.dflash import DFlashProposer
from specjax.proposers.draft_model import DraftModelProposer
from specjax.proposers.eagle import EagleProposer
from specjax.proposers.extract_hidden_states import ExtractHiddenStatesProposer
from specjax.proposers.medusa import MedusaProposer

try:
    from compile_check import assert_no_recompile
except ImportError:  # tests/ made a package
    from tests.compile_check import assert_no_recompile

GEO = dict(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
           rms_norm_eps=1e-5)
V = 64
HT = 24                 # target hidden size (EAGLE-3, DFlash, extract-hidden-states)
BS = 4
MML = 32
C = MML // BS           # block-table width the loop passes (the default one)
NUM_BLOCKS = 64
K = 2
METHODS = ["eagle", "eagle3", "dflash", "draft_model", "medusa", "mtp", "extract_hidden_states"]
#: (B_pad, T_pad, block-table width, max_query_len) buckets the "loop" uses
BUCKETS = [(2, 16, C, 8), ProposeBucket(num_reqs_pad=4, num_tokens_pad=32, max_blocks_per_req=C,
                                        max_query_len=8)]
#: hidden-state input widths by method: (target_hidden_states H, aux (n_aux, Ht)), the
#: layout Engine feeds (written out here, not taken from the code under test)
WIDTHS = {"eagle": (32, None), "eagle3": (HT, (3, HT)), "dflash": (None, (3, HT)),   # DFlash reads the aux states only
          "draft_model": (None, None), "medusa": (32, None), "mtp": (32, None),
          "extract_hidden_states": (None, (3, HT))}


def _target(h):
    rng = np.random.default_rng(0)
    return {"embed_tokens": {"embedding": jnp.asarray(0.1 * rng.standard_normal((V, h)), jnp.float32)},
            "lm_head": {"kernel": jnp.asarray(rng.standard_normal((h, V)) / np.sqrt(h), jnp.float32)}}


@functools.lru_cache(maxsize=None)
def build(method):
    """``(proposer, params)`` of a tiny random model of ``method`` (k = 2, or 1)."""
    k = 1 if method == "extract_hidden_states" else K
    cfg = SpeculativeConfig(method=method, num_speculative_tokens=k,
                            model="tiny-llama" if method == "draft_model" else None)
    if method == "extract_hidden_states":
        return ExtractHiddenStatesProposer(cfg, ExtractHiddenStates(3, HT), block_size=BS,
                                           kernel_backend="xla"), {}
    if method == "medusa":
        mc = registry.config_from_hf("medusa", dict(num_heads=3, num_hidden_layers=1, hidden_size=32,
                                                    vocab_size=V))
        return (MedusaProposer(cfg, registry.make_model("medusa", mc), kernel_backend="xla"),
                registry.init_params("medusa", mc, 1))
    if method == "draft_model":
        mc = registry.config_from_hf("llama", dict(GEO, num_hidden_layers=1, vocab_size=V))
        return (DraftModelProposer(cfg, registry.make_model("llama", mc), target_vocab_size=V,
                                   block_size=BS, max_model_len=MML, kernel_backend="xla"),
                registry.init_params("llama", mc, 1))
    hf = {"eagle": dict(GEO, num_hidden_layers=1, vocab_size=V, bias=True),
          "eagle3": dict(GEO, num_hidden_layers=1, vocab_size=V, draft_vocab_size=32,
                         target_hidden_size=HT, has_d2t=True, eagle_aux_hidden_state_layer_ids=[1, 3, 5]),
          "dflash": dict(GEO, num_hidden_layers=1, vocab_size=V, target_hidden_size=HT,
                         aux_hidden_state_layer_ids=[1, 3, 5], mask_token_id=V - 1, block_size=4),
          "mtp": dict(GEO, num_hidden_layers=1, vocab_size=V, num_nextn_predict_layers=1)}[method]
    mc = registry.config_from_hf(method, hf)
    params = share_target_weights(registry.init_params(method, mc, 1), _target(mc.hidden_size), kind=method)
    cls = DFlashProposer if method == "dflash" else EagleProposer
    return cls(cfg, registry.make_model(method, mc), block_size=BS, max_model_len=MML,
               kernel_backend="xla"), params


def make_inputs(method, bucket, n, rng, *, padded=True):
    """A random ragged batch of ``n`` requests padded to ``bucket = (B, T, C, Q)``."""
    B, T, Cw, Q = bucket
    q = np.ones(n, np.int64)
    for _ in range(int(rng.integers(0, T - n + 1))):      # spread extra tokens, each query <= Q
        i = int(rng.integers(0, n))
        if q[i] < Q:
            q[i] += 1
    s = q + rng.integers(0, MML - Q - K - 2, n)
    table = rng.permutation(NUM_BLOCKS)[: n * Cw].reshape(n, Cw)
    md = CommonAttentionMetadata.from_query_lens(q, s, table, block_size=BS, num_reqs_pad=B,
                                                 num_tokens_pad=T, max_query_len=Q)
    t = int(q.sum())
    qsl = np.concatenate([[0], np.cumsum(q)])
    rej = np.array([int(rng.integers(0, min(int(x) - 1, K) + 1)) for x in q])
    def padb(a):
        return jnp.asarray(np.concatenate([np.asarray(a, np.int32), np.zeros(B - n, np.int32)]))
    ids = np.zeros(T, np.int32)
    ids[:t] = rng.integers(0, V, t)
    pos = np.zeros(T, np.int32)
    pos[:t] = np.concatenate([np.arange(si - qi, si) for qi, si in zip(q, s)])
    h, aux = WIDTHS[method]
    return ProposerInputs(
        target_token_ids=jnp.asarray(ids), target_positions=jnp.asarray(pos),
        target_hidden_states=None if h is None else jnp.asarray(rng.standard_normal((T, h)), jnp.float32),
        aux_hidden_states=None if aux is None else jnp.asarray(rng.standard_normal((T, *aux)), jnp.float32),
        next_token_ids=padb(rng.integers(0, V, n)),
        token_indices_to_sample=padb(qsl[1:] - 1 - rej) if padded else None,
        num_rejected_tokens=padb(rej) if padded else None,
        attn_metadata=md)


def _compiles(caplog):
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("Compiling")]


def _tuple(b):
    return (b.num_reqs_pad, b.num_tokens_pad, b.max_blocks_per_req, b.max_query_len) \
        if isinstance(b, ProposeBucket) else tuple(b)


@pytest.mark.parametrize("method", METHODS)
def test_warmup_then_no_compile_inside_the_buckets(method, caplog):
    prop, params = build(method)
    state = prop.init_state(NUM_BLOCKS)
    got = prop.warmup(BUCKETS, params, state)
    assert [_tuple(b) for b in got] == [_tuple(b) for b in BUCKETS]
    assert all(b.padded_batch for b in got)

    rng = np.random.default_rng(METHODS.index(method))
    # (bucket, real requests): each bucket's first call included, sizes varying inside
    plan = [(0, 1), (1, 3), (0, 2), (1, 1), (1, 4), (0, 1), (1, 2)]
    k = prop.num_speculative_tokens

    # built up front: making inputs compiles small conversions of its own
    inputs = [make_inputs(method, _tuple(BUCKETS[b]), n, rng) for b, n in plan]

    def run(i):
        nonlocal state
        b, n = plan[i]
        bucket = _tuple(BUCKETS[b])
        out, state = prop.propose(params, state, inputs[i])
        assert out.token_ids.shape == (bucket[0], k)
        np.testing.assert_array_equal(out.num_drafts, [k] * n + [0] * (bucket[0] - n))

    with jax.log_compiles(), caplog.at_level(logging.DEBUG, logger="jax"):
        run(0)
        run(1)
    assert not _compiles(caplog), f"{method}: the first call of a warmed-up bucket compiled"
    assert_no_recompile(prop.propose, run, list(range(len(plan))), caplog)


def test_a_bucket_not_warmed_up_does_compile(caplog):
    """The check above can see a compilation: a bucket left out of warmup compiles."""
    prop, params = build("medusa")
    prop.warmup([(2, 16, C, 8)], params)
    inputs = make_inputs("medusa", (2, 16, C, 16), 2, np.random.default_rng(0))
    with jax.log_compiles(), caplog.at_level(logging.DEBUG, logger="jax"):
        prop.propose(params, prop.init_state(), inputs)
    assert _compiles(caplog)


def test_warmup_non_padded_mode_and_abstract_state(caplog):
    """Buckets of the non-padded mode (no rejected counts), state built from num_blocks."""
    prop, params = build("draft_model")
    got = prop.warmup([ProposeBucket(2, 16, C, 8, padded_batch=False)], params, num_blocks=NUM_BLOCKS)
    assert got == (ProposeBucket(2, 16, C, 8, False),)
    state = prop.init_state(NUM_BLOCKS)
    rng = np.random.default_rng(3)
    inputs = [make_inputs("draft_model", (2, 16, C, 8), n, rng, padded=False) for n in (1, 2)]
    with jax.log_compiles(), caplog.at_level(logging.DEBUG, logger="jax"):
        for inp in inputs:
            _, state = prop.propose(params, state, inp)
    assert not _compiles(caplog)


def test_adapter_warmup_defaults(caplog):
    """``make_proposer(...).warmup((B, T))``: block-table width from max_model_len /
    block_size, max_query_len = T, padded mode from the config, state from num_blocks."""
    prop, params = build("eagle")
    p = make_proposer(SpeculativeConfig(method="eagle", num_speculative_tokens=K), draft=prop.model,
                      draft_params=params, block_size=BS, max_model_len=MML, kernel_backend="xla")
    got = p.warmup([(2, 8)], num_blocks=NUM_BLOCKS)
    assert got == (ProposeBucket(2, 8, C, 8, True),)
    state = p.init_state(NUM_BLOCKS)
    rng = np.random.default_rng(4)
    inputs = [make_inputs("eagle", (2, 8, C, 8), n, rng) for n in (2, 1)]
    with jax.log_compiles(), caplog.at_level(logging.DEBUG, logger="jax"):
        for inp in inputs:
            _, state = p.impl.propose(p.params, state, inp)
    assert not _compiles(caplog)
    ngram = make_proposer(SpeculativeConfig(method="ngram", num_speculative_tokens=K), max_model_len=MML)
    assert ngram.warmup([(2, 8)]) == ()


GOOD = (3, 24, C, 8)     # a valid bucket ahead of the bad one: it must not compile either


@pytest.mark.parametrize("buckets, match", [
    ([], "buckets must name at least one"),
    ("2,16", "buckets must be an iterable"),
    (7, "buckets must be an iterable"),
    (ProposeBucket(2, 16), "buckets must be an iterable"),
    ([GOOD, (2,)], r"buckets\[1\] must be a ProposeBucket"),
    ([GOOD, (2, 16, C, 8, 1)], r"buckets\[1\] must be a ProposeBucket"),
    ([(0, 16)], r"buckets\[0\]\.num_reqs_pad"),
    ([GOOD, (2, 16), (2, -1)], r"buckets\[2\]\.num_tokens_pad"),
    ([GOOD, (2, 16.0)], r"buckets\[1\]\.num_tokens_pad"),
    ([GOOD, (True, 16)], r"buckets\[1\]\.num_reqs_pad"),
    ([GOOD, (2, 16, 0)], r"buckets\[1\]\.max_blocks_per_req"),
    ([GOOD, (2, 16, C, 32)], r"buckets\[1\]\.max_query_len .*\[1, 16\]"),
    ([GOOD, (2, 16, C, 0)], r"buckets\[1\]\.max_query_len"),
    ([GOOD, ProposeBucket(2, 16, padded_batch="yes")], r"buckets\[1\]\.padded_batch"),
])
def test_bad_buckets_raise_before_compiling(buckets, match, caplog):
    prop, params = build("eagle")
    before = prop.propose._cache_size()
    with jax.log_compiles(), caplog.at_level(logging.DEBUG, logger="jax"):
        with pytest.raises(ValueError, match=match):
            prop.warmup(buckets, params, num_blocks=NUM_BLOCKS)
    assert not _compiles(caplog)
    assert prop.propose._cache_size() == before


def test_warmup_argument_errors():
    prop, params = build("eagle")
    with pytest.raises(ValueError, match="num_blocks"):
        prop.warmup([(2, 16)], params)            # neither state nor num_blocks
    medusa, mparams = build("medusa")
    with pytest.raises(ValueError, match=r"buckets\[0\]\.max_blocks_per_req is required"):
        medusa.warmup([(2, 16)], mparams)         # no max_model_len to derive the width from
    extract, _ = build("extract_hidden_states")
    with pytest.raises(ValueError, match=r"buckets\[0\]\.max_blocks_per_req is required"):
        extract.warmup([(2, 16)], {}, num_blocks=NUM_BLOCKS)

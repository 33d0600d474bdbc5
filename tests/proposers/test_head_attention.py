"""A stack's own attention in the EAGLE-family heads (issue 48, part 3): ``make_proposer(...,
attention=fn)`` runs every layer of an EAGLE, EAGLE-3, MTP or DFlash head through ``fn`` (the
``AttentionFn`` contract). The jax.numpy reference passed as a custom kernel drafts exactly
what the default backend drafts (same acceptance, output plain greedy's); a wrong one changes
the drafts; a non-callable is refused by name."""

from __future__ import annotations

import dataclasses

import pytest

from specjax.config import SpeculativeConfig
from specjax.engine import generate
from specjax.kernels import paged_attention as attn_lib
from specjax.kernels.paged_attention.reference import paged_attention_xla
from specjax.models import registry
from specjax.proposers import make_proposer
from test_engine import BS, FIXED, HEADS, METHODS, MML, PARAMS_A, PROMPTS_A, baseline, target

HEAD_METHODS = [m for m in ("eagle", "eagle3", "mtp", "dflash") if m in METHODS]


def reference_attention(q, k, v, cache, md, *, scale):
    """The contract from the pure jax.numpy pieces: the KV write, then the xla reference."""
    cache = attn_lib.write_kv(cache, k, v, md.slot_mapping)
    return paged_attention_xla(q, cache, md, scale=scale), cache


def wrong_attention(q, k, v, cache, md, *, scale):
    """The contract's shapes, the wrong values: scores scaled by 1/8 of ``scale``."""
    return reference_attention(q, k, v, cache, md, scale=scale / 8)


class Counted:
    """A hashable ``AttentionFn`` that counts the layers traced through it."""

    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, q, k, v, cache, md, *, scale):
        self.calls += 1
        return self.fn(q, k, v, cache, md, scale=scale)


def head(method: str, **options):
    tgt = target()
    kind, hf = HEADS[method]
    dcfg = registry.config_from_hf(kind, hf)
    extra = dict(aux_layer_ids=(0, 1)) if method == "dflash" else {}
    return make_proposer(SpeculativeConfig(method=method, num_speculative_tokens=3), draft=dcfg,
                         draft_params=registry.init_params(kind, dcfg, 1), target=tgt.model,
                         target_params=tgt.params, max_model_len=MML, block_size=BS,
                         kernel_backend="xla", **extra, **options)


def _stats(out):
    s = out.spec_stats
    return s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens, s.num_accepted_tokens_per_pos


@pytest.mark.parametrize("method", HEAD_METHODS)
def test_a_custom_attention_runs_in_every_head_layer(method):
    default = generate(target(), head(method), PROMPTS_A, PARAMS_A, **FIXED)
    fn = Counted(reference_attention)
    prop = head(method, attention=fn)
    assert prop.impl.model.attention is fn
    custom = generate(target(), prop, PROMPTS_A, PARAMS_A, **FIXED)
    n_layers = prop.impl.model.config.num_hidden_layers
    assert fn.calls >= n_layers and fn.calls % n_layers == 0     # every head layer, traced
    assert custom.token_ids == default.token_ids == baseline("A").token_ids
    assert _stats(custom) == _stats(default)
    wrong = Counted(wrong_attention)
    out = generate(target(), head(method, attention=wrong), PROMPTS_A, PARAMS_A, **FIXED)
    assert wrong.calls >= n_layers and out.token_ids == baseline("A").token_ids   # lossless


def test_a_bad_attention_is_refused_by_name():
    method = HEAD_METHODS[0]
    with pytest.raises(TypeError, match="attention must be None"):
        head(method, attention="xla")
    with pytest.raises(TypeError, match="attention must be None"):
        dataclasses.replace(head(method).impl.model, attention=[reference_attention])

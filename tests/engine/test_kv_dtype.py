"""The KV caches' dtype follows the target's params unless asked: bf16 weights get bf16
caches with no flag (the target's and a drafting model's), fp32 weights fp32, an explicit
``kv_dtype`` wins; ``Step.init_caches`` takes the dtype from ``params=``; ``specjax
generate --dtype bf16`` decodes over a bf16 cache."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from specjax.config import SpeculativeConfig
from specjax.engine import Engine, TargetModel
from specjax.models import registry
from specjax.proposers import make_proposer
from specjax.runtime.step import make_step, params_kv_dtype

GEO = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
           rms_norm_eps=1e-5, vocab_size=64, num_hidden_layers=1)
MML, BS = 32, 8


def target(dtype) -> TargetModel:
    cfg = registry.config_from_hf("llama", GEO)
    params = jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x,
                          registry.init_params("llama", cfg, 0))
    return TargetModel(registry.make_model("llama", cfg), params)


def dtypes(tree) -> set:
    return {jnp.dtype(leaf.dtype) for leaf in jax.tree.leaves(tree)}


def draft_model(tgt: TargetModel):
    """A draft-model proposer whose draft is the target itself (its own KV cache)."""
    spec = SpeculativeConfig(method="draft_model", model="target-copy", num_speculative_tokens=2)
    return make_proposer(spec, draft=tgt.model, draft_params=tgt.params, target=tgt.model,
                         target_params=tgt.params, max_model_len=MML, block_size=BS)


@pytest.mark.parametrize("params_dtype, kv_dtype, want", [
    (jnp.bfloat16, None, jnp.bfloat16),        # the default follows the params
    (jnp.float32, None, jnp.float32),
    (jnp.bfloat16, jnp.float32, jnp.float32),  # asked for
])
def test_engine_kv_dtype(params_dtype, kv_dtype, want):
    tgt = target(params_dtype)
    kw = {} if kv_dtype is None else dict(kv_dtype=kv_dtype)
    plain = Engine(tgt, None, max_model_len=MML, block_size=BS, max_num_seqs=2, **kw)
    assert dtypes(plain.target_kv) == {jnp.dtype(want)} and plain.kv_dtype == want
    spec = Engine(tgt, draft_model(tgt), max_model_len=MML, block_size=BS, max_num_seqs=2, **kw)
    assert dtypes(spec.target_kv) == {jnp.dtype(want)}
    assert jnp.dtype(want) in dtypes(spec.draft_state)   # the draft's KV cache


def test_step_init_caches_dtype():
    bf16, fp32 = target(jnp.bfloat16), target(jnp.float32)
    step = make_step(bf16.model, None)
    assert dtypes(step.init_caches(5, BS, params=bf16.params)[0]) == {jnp.dtype(jnp.bfloat16)}
    assert dtypes(step.init_caches(5, BS, params=fp32.params)[0]) == {jnp.dtype(jnp.float32)}
    assert dtypes(step.init_caches(5, BS)[0]) == {jnp.dtype(jnp.float32)}       # no params
    assert dtypes(step.init_caches(5, BS, jnp.float32, params=bf16.params)[0]) == \
        {jnp.dtype(jnp.float32)}
    # the embedding decides; no floating leaf at all: float32
    assert params_kv_dtype({"embed_tokens": {"embedding": jnp.zeros(2, jnp.float16)},
                            "w": jnp.zeros(2, jnp.float32)}) == jnp.float16
    assert params_kv_dtype({"ids": jnp.zeros(2, jnp.int32)}) == jnp.float32


def test_generate_cli_bf16_uses_a_bf16_cache(tmp_path, monkeypatch, capsys):
    """``specjax generate --dtype bf16`` passes no kv_dtype: the default gives bf16."""
    pytest.importorskip("tokenizers")
    pytest.importorskip("transformers")
    from test_hf_cli import make_checkpoint

    from specjax.cli.main import main
    from specjax.engine import engine

    d = tmp_path / "tiny-llama"
    make_checkpoint(d)
    seen = []
    reset = engine.Engine._reset_cache

    def spy(self):
        reset(self)
        seen.append(dtypes(self.target_kv))

    monkeypatch.setattr(engine.Engine, "_reset_cache", spy)
    rc = main(["generate", "--device", "cpu", "--target", str(d), "--prompt", "the cat",
               "--max-tokens", "3", "--dtype", "bf16"])
    out, err = capsys.readouterr()
    assert rc == 0, out + err
    assert seen and all(s == {jnp.dtype(jnp.bfloat16)} for s in seen)

"""bf16 forward of every model on the GPU against the same model in fp32 (relative error
< 1e-2, the precision of bf16 weights and activations), through the paged cache."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.attention_metadata import CommonAttentionMetadata
from specjax.models import registry, share_target_weights

pytestmark = pytest.mark.gpu   # skipped without a GPU by tests/conftest.py

GEO = dict(hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=2,
           rms_norm_eps=1e-5)
V, BS, WIDTH = 512, 16, 8


def relerr(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _md(qlens, causal=True):
    n = len(qlens)
    table = np.arange(n * WIDTH, dtype=np.int32).reshape(n, WIDTH)
    return CommonAttentionMetadata.from_query_lens(qlens, qlens, table, block_size=BS, causal=causal,
                                                   num_tokens_pad=64, max_query_len=32)


def _cast(tree, dtype):
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def _target():
    rng = np.random.default_rng(0)
    return {"embed_tokens": {"embedding": jnp.asarray(rng.standard_normal((V, GEO["hidden_size"])), jnp.float32)},
            "lm_head": {"kernel": jnp.asarray(rng.standard_normal((GEO["hidden_size"], V)) / 16, jnp.float32)}}


def _run_both(fn, params, *args):
    out32 = fn(params, *args)
    out16 = fn(_cast(params, jnp.bfloat16), *_cast(args, jnp.bfloat16))
    return out32, out16


@pytest.mark.parametrize("kind, extra", [
    ("llama", {}), ("qwen2", {"attention_bias": True}), ("qwen3", {"head_dim": 32}),
])
def test_decoder_bf16(kind, extra):
    cfg = registry.config_from_hf(kind, dict(GEO, num_hidden_layers=2, vocab_size=V, **extra))
    params = registry.init_params(kind, cfg, 1)
    model = registry.make_model(kind, cfg)
    md = _md([20, 7, 30])
    ids = jnp.asarray(np.random.default_rng(1).integers(0, V, 64), jnp.int32)
    pos = jnp.asarray(np.concatenate([np.arange(20), np.arange(7), np.arange(30), np.zeros(7)]), jnp.int32)

    @jax.jit
    def fwd(p, ids, pos, caches):
        h, _, _ = model.forward(p, ids, pos, caches, md)
        return model.compute_logits(p, h[:57])

    c32 = model.init_kv_caches(3 * WIDTH, BS, jnp.float32) if hasattr(model, "init_kv_caches") else None
    c16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), c32)
    l32 = fwd(params, ids, pos, c32)
    l16 = fwd(_cast(params, jnp.bfloat16), ids, pos, c16)
    assert relerr(l16, l32) < 1e-2


def test_eagle3_eagle_and_mtp_bf16():
    rng = np.random.default_rng(2)
    md = _md([12, 5])
    ids = jnp.asarray(rng.integers(0, V, 64), jnp.int32)
    pos = jnp.asarray(np.concatenate([np.arange(12), np.arange(5), np.zeros(47)]), jnp.int32)
    for kind, extra, width in (("eagle", dict(bias=True), GEO["hidden_size"]),
                               ("eagle3", dict(draft_vocab_size=128, has_d2t=True,
                                               eagle_aux_hidden_state_layer_ids=[1, 2, 3]), 3 * GEO["hidden_size"]),
                               ("eagle3", dict(draft_vocab_size=128, has_d2t=True, norm_before_fc=True,
                                               fc_norm=True, norm_output=True,
                                               eagle_aux_hidden_state_layer_ids=[1, 2, 3]), 3 * GEO["hidden_size"]),
                               ("mtp", dict(num_nextn_predict_layers=1), GEO["hidden_size"])):
        cfg = registry.config_from_hf(kind, dict(GEO, num_hidden_layers=1, vocab_size=V, **extra))
        params = share_target_weights(registry.init_params(kind, cfg, 3), _target(), kind=kind)
        model = registry.make_model(kind, cfg)
        hid = jnp.asarray(rng.standard_normal((64, width)), jnp.float32)
        caches = model.init_kv_caches(2 * WIDTH, BS, jnp.float32)

        @jax.jit
        def fwd(p, hid, caches):
            a, b, _ = model.forward(p, ids, pos, hid, caches, md)
            return model.compute_logits(p, a[:17]), b[:17]

        (l32, h32) = fwd(params, hid, caches)
        (l16, h16) = fwd(_cast(params, jnp.bfloat16), hid.astype(jnp.bfloat16),
                         jax.tree.map(lambda x: x.astype(jnp.bfloat16), caches))
        finite = np.isfinite(np.asarray(l32))
        assert relerr(np.asarray(l16)[finite], np.asarray(l32)[finite]) < 1e-2, kind
        assert relerr(h16, h32) < 1e-2, kind


def test_medusa_bf16():
    cfg = registry.config_from_hf("medusa", dict(hidden_size=GEO["hidden_size"], vocab_size=V,
                                                 num_heads=3, num_hidden_layers=1, medusa_fc_bias=True))
    params = registry.init_params("medusa", cfg, 4)
    model = registry.make_model("medusa", cfg)
    h = jnp.asarray(np.random.default_rng(3).standard_normal((16, GEO["hidden_size"])), jnp.float32)
    fwd = jax.jit(lambda p, h: model.compute_logits(p, model.forward(p, h)))
    assert relerr(fwd(_cast(params, jnp.bfloat16), h.astype(jnp.bfloat16)), fwd(params, h)) < 1e-2


def test_dflash_bf16():
    cfg = registry.config_from_hf("dflash", dict(GEO, model_type="qwen3", head_dim=32, num_hidden_layers=2,
                                                 vocab_size=V, block_size=4, mask_token_id=V - 1,
                                                 aux_hidden_state_layer_ids=[1, 2]))
    params = share_target_weights(registry.init_params("dflash", cfg, 5), _target())
    model = registry.make_model("dflash", cfg)
    rng = np.random.default_rng(4)
    ctx_len, q = 10, 4
    aux = jnp.asarray(rng.standard_normal((ctx_len, 2, GEO["hidden_size"])), jnp.float32)
    ctx_pos = jnp.arange(ctx_len, dtype=jnp.int32)
    table = np.arange(WIDTH, dtype=np.int32)[None]
    md = CommonAttentionMetadata.from_query_lens([q], [ctx_len + q], table, block_size=BS, causal=False)
    ids = jnp.asarray([7] + [V - 1] * (q - 1), jnp.int32)
    qpos = jnp.arange(ctx_len, ctx_len + q, dtype=jnp.int32)

    @jax.jit
    def fwd(p, aux, caches):
        ctx = model.combine_hidden_states(p, aux)
        caches = model.precompute_and_store_context_kv(p, ctx, ctx_pos, ctx_pos, caches)
        h, _ = model.forward(p, ids, qpos, caches, md)
        return model.compute_logits(p, h[1:])

    caches = model.init_kv_caches(WIDTH, BS, jnp.float32)
    l32 = fwd(params, aux, caches)
    l16 = fwd(_cast(params, jnp.bfloat16), aux.astype(jnp.bfloat16),
              jax.tree.map(lambda x: x.astype(jnp.bfloat16), caches))
    assert relerr(l16, l32) < 1e-2

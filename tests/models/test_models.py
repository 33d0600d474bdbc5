"""specjax.models against a NumPy oracle (tests/models_oracle.py), CPU, float32.

(1) paged attention == dense attention on random ragged batches; (2) prefill in one call
== token-by-token decoding through the paged cache; (3) the decoder and every head ==
the oracle on random canonical tensors, fed in chunks through the paged cache; (4) the
registry: config round trips, expected tensors, params structure, errors.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import models_oracle as ora
from specjax.attention_metadata import CommonAttentionMetadata
from specjax.models import (
    ExtractHiddenStates,
    KVCache,
    paged_attention,
    registry,
    share_target_weights,
    write_kv,
)
from specjax.models.params import fuse_projections, is_fused, merge, unfuse_projections
from specjax.models.config import ModelConfig

BS = 4            # block size
NUM_BLOCKS = 40
MAX_BLOCKS = 8    # block-table width: 32-token context bucket
B_PAD = 4
T_PAD = 16
QB = 8            # max_query_len bucket


def relerr(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))


def assert_close(got, want, tol=2e-5, what=""):
    e = relerr(got, want)
    assert e < tol, f"{what}: relative error {e:.3g} >= {tol}"


def block_tables(n, seed):
    rng = np.random.default_rng(seed)
    perm = rng.permutation(NUM_BLOCKS)[: n * MAX_BLOCKS]
    return perm.reshape(n, MAX_BLOCKS).astype(np.int32)


def meta(qlens, seqlens, table, causal=True, qb=QB):
    return CommonAttentionMetadata.from_query_lens(
        qlens, seqlens, table, block_size=BS, num_reqs_pad=B_PAD, num_tokens_pad=T_PAD,
        max_query_len=qb, causal=causal)


def slots_for(table_row, positions):
    positions = np.asarray(positions)
    return table_row[positions // BS] * BS + positions % BS


def pad(x, n=T_PAD, fill=0):
    x = np.asarray(x)
    out = np.full((n,) + x.shape[1:], fill, x.dtype)
    out[: len(x)] = x
    return out


@functools.lru_cache(maxsize=None)
def jitted(fn):
    return jax.jit(fn)


def cfg_of(kind, **kw):
    return registry.config_from_hf(kind, kw)


GEO = dict(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
           rms_norm_eps=1e-5)


def geo(cfg: ModelConfig):
    return ora.Geo(nh=cfg.num_attention_heads, nkv=cfg.num_key_value_heads, hd=cfg.head_dim,
                   eps=cfg.rms_norm_eps, theta=cfg.rope_theta, scaling=cfg.rope_scaling_dict)


# ----------------------------------------------------------------------------------------
# (1) paged attention


@pytest.mark.parametrize("causal", [True, False])
def test_paged_attention_matches_dense(causal):
    nh, nkv, hd = 4, 2, 8
    fn = jitted(functools.partial(paged_attention, scale=hd ** -0.5))
    write = jitted(write_kv)
    rng = np.random.default_rng(1 + causal)
    for trial in range(4):
        n = int(rng.integers(1, B_PAD + 1))
        qlens = rng.integers(0 if n > 1 else 1, QB + 1, size=n)
        while qlens.sum() > T_PAD:
            qlens = np.maximum(qlens - 1, 0)
        seqlens = qlens + rng.integers(0, MAX_BLOCKS * BS - QB + 1, size=n)
        table = block_tables(n, trial)
        md = meta(qlens, seqlens, table, causal=causal)
        # dense per-request K/V written through the slot mapping of every position
        kd = [rng.standard_normal((s, nkv, hd)) for s in seqlens]
        vd = [rng.standard_normal((s, nkv, hd)) for s in seqlens]
        cache = KVCache(jnp.full((NUM_BLOCKS, BS, nkv, hd), 7.0, jnp.float32),
                        jnp.full((NUM_BLOCKS, BS, nkv, hd), 7.0, jnp.float32))
        all_slots = np.concatenate([slots_for(table[r], np.arange(seqlens[r])) for r in range(n)]
                                   + [np.array([-1, -1])])
        kk = np.concatenate(kd + [np.full((2, nkv, hd), 99.0)])
        vv = np.concatenate(vd + [np.full((2, nkv, hd), 99.0)])
        cache = write(cache, jnp.asarray(kk, jnp.float32), jnp.asarray(vv, jnp.float32),
                      jnp.asarray(all_slots, jnp.int32))
        assert not np.any(np.asarray(cache.k) == 99.0), "slot -1 must be dropped"
        q = rng.standard_normal((T_PAD, nh, hd))
        out = np.asarray(fn(jnp.asarray(q, jnp.float32), cache, md))
        qsl = np.concatenate([[0], np.cumsum(qlens)])
        for r in range(n):
            if qlens[r] == 0:
                continue
            qr = q[qsl[r]: qsl[r + 1]]
            pos = seqlens[r] - qlens[r] + np.arange(qlens[r])
            mask = (np.arange(seqlens[r])[None, :] <= pos[:, None]) if causal \
                else np.ones((qlens[r], seqlens[r]), bool)
            want = ora.attention(qr, kd[r], vd[r], mask).reshape(-1, nh, hd)
            assert_close(out[qsl[r]: qsl[r + 1]], want, 1e-5, f"request {r}")
        assert np.all(out[qsl[-1]:] == 0), "padding tokens must give zeros"


# ----------------------------------------------------------------------------------------
# (2) + (3) decoder LM


# One synthetic config exercising every decoder feature at once (the fixtures test each real
# model type separately): q/k norms, q/k/v/o and MLP biases, llama3 RoPE scaling, tied head,
# head_dim != H / num_heads, GQA.
DECODER_CASES = {
    "all_features": dict(kind="qwen3", num_hidden_layers=2, vocab_size=96, head_dim=16,
                         attention_bias=True, mlp_bias=True, tie_word_embeddings=True,
                         rope_theta=500000.0,
                         rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                           high_freq_factor=4.0, original_max_position_embeddings=16)),
}


@functools.lru_cache(maxsize=None)
def decoder_setup(name):
    spec = dict(DECODER_CASES[name])
    kind = spec.pop("kind")
    cfg = cfg_of(kind, **{**GEO, **spec})
    tensors = registry.random_tensors(kind, cfg, seed=3)
    params = registry.params_from_tensors(kind, cfg, tensors, jnp.float32)
    model = registry.make_model(kind, cfg, aux_layer_ids=(0, 1))
    return cfg, tensors, params, model


def run_chunks(step, seqs, chunks, table, causal=True, extra=None):
    """Feed each request's tokens in chunks (chunks[s][r] tokens of request r at step s).
    ``step(ids, pos, md, rows)`` runs one padded batch; returns per-request lists of the
    per-token outputs it gives (a tuple of [T_pad, ...] arrays)."""
    n = len(seqs)
    done = [0] * n
    got = [[] for _ in range(n)]
    for chunk in chunks:
        ids, pos, rows = [], [], []
        for r in range(n):
            c = chunk[r]
            ids += list(seqs[r][done[r]: done[r] + c])
            pos += list(range(done[r], done[r] + c))
            rows += [(r, p) for p in range(done[r], done[r] + c)]
            done[r] += c
        md = meta(list(chunk), list(done), table, causal=causal)
        outs = step(jnp.asarray(pad(np.array(ids, np.int32))), jnp.asarray(pad(np.array(pos, np.int32))),
                    md, rows)
        for t, (r, p) in enumerate(rows):
            got[r].append(tuple(np.asarray(o[t]) for o in outs))
    return got


@pytest.mark.parametrize("fused", [False, True], ids=["hf_layout", "fused"])
@pytest.mark.parametrize("name", list(DECODER_CASES))
def test_decoder_matches_oracle_through_cache(name, fused):
    cfg, tensors, params, model = decoder_setup(name)
    if fused:           # q/k/v and gate/up as one GEMM each: the same forward
        params = fuse_projections(params)
        assert "qkv_proj" in params["layers"][0]["self_attn"]
        assert "gate_up_proj" in params["layers"][0]["mlp"]
    fwd = jitted(model.forward)
    logits_fn = jitted(model.compute_logits)
    rng = np.random.default_rng(5)
    lens = [7, 3, 10]
    seqs = [rng.integers(0, cfg.vocab_size, size=n) for n in lens]
    table = block_tables(3, 0)
    state = {"caches": model.init_kv_caches(NUM_BLOCKS, BS)}

    def step(ids, pos, md, rows):
        hidden, aux, state["caches"] = fwd(params, ids, pos, state["caches"], md)
        return hidden, aux, logits_fn(params, hidden)

    got = run_chunks(step, seqs, [[4, 3, 6], [3, 0, 4]], table)
    g = geo(cfg)
    for r, ids in enumerate(seqs):
        hid, inputs, logits = ora.decoder(tensors, g, ids, cfg.num_hidden_layers, cfg.qk_norm,
                                          cfg.tie_word_embeddings)
        assert_close(np.stack([x[0] for x in got[r]]), hid, what=f"{name} hidden r{r}")
        assert_close(np.stack([x[1] for x in got[r]]), np.stack(inputs, 1), what=f"{name} aux r{r}")
        assert_close(np.stack([x[2] for x in got[r]]), logits, what=f"{name} logits r{r}")


def test_prefill_equals_token_by_token_decode():
    cfg, tensors, params, model = decoder_setup("all_features")
    fwd = jitted(model.forward)
    rng = np.random.default_rng(6)
    seqs = [rng.integers(0, cfg.vocab_size, size=n) for n in (6, 5)]
    table = block_tables(2, 1)
    results = []
    for chunks in ([[6, 5]], [[1, 1]] * 5 + [[1, 0]]):
        state = {"caches": model.init_kv_caches(NUM_BLOCKS, BS)}

        def step(ids, pos, md, rows):
            hidden, aux, state["caches"] = fwd(params, ids, pos, state["caches"], md)
            return hidden, aux

        results.append((run_chunks(step, seqs, chunks, table), state["caches"]))
    (pre, c_pre), (dec, c_dec) = results
    for r in range(2):
        assert_close(np.stack([x[0] for x in dec[r]]), np.stack([x[0] for x in pre[r]]), 1e-5)
        assert_close(np.stack([x[1] for x in dec[r]]), np.stack([x[1] for x in pre[r]]), 1e-5)
    for a, b in zip(jax.tree.leaves(c_pre), jax.tree.leaves(c_dec)):
        assert_close(b, a, 1e-5, "kv cache")


# ----------------------------------------------------------------------------------------
# (3) heads


def target_weights(cfg_head, seed=11, tied=False):
    """A target's embed_tokens / lm_head params and their float64 arrays."""
    rng = np.random.default_rng(seed)
    v, h = cfg_head.vocab_size, cfg_head.hidden_size
    emb = rng.standard_normal((v, h)).astype(np.float32)
    head = (rng.standard_normal((v, h)) / np.sqrt(h)).astype(np.float32)
    target = {"embed_tokens": {"embedding": jnp.asarray(emb)}}
    if not tied:
        target["lm_head"] = {"kernel": jnp.asarray(head.T)}
    return target, emb.astype(np.float64), (emb if tied else head).astype(np.float64)


@pytest.mark.parametrize("fused", [False, True], ids=["hf_layout", "fused"])
def test_eagle_matches_oracle(fused):
    cfg = cfg_of("eagle", **GEO, num_hidden_layers=2, vocab_size=80, bias=True, rope_theta=10000.0)
    tensors = registry.random_tensors("eagle", cfg, seed=4)
    target, emb, head = target_weights(cfg)
    own = registry.params_from_tensors("eagle", cfg, tensors)
    assert "embed_tokens" not in own        # no own embedding: the target's is shared
    params = share_target_weights(own, target, kind="eagle")
    if fused:           # layer 0 without its input norm
        params = fuse_projections(params)
        assert "qkv_proj" in params["layers"][0]["self_attn"]
    model = registry.make_model("eagle", cfg)
    fwd, logits_fn = jitted(model.forward), jitted(model.compute_logits)
    rng = np.random.default_rng(7)
    seqs = [rng.integers(0, 80, size=n) for n in (5, 9)]
    hid = [rng.standard_normal((len(s), 32)).astype(np.float32) for s in seqs]
    table = block_tables(2, 2)
    state = {"caches": model.init_kv_caches(NUM_BLOCKS, BS)}

    def step(ids, pos, md, rows):
        h = jnp.asarray(pad(np.stack([hid[r][p] for r, p in rows])))
        out, nxt, state["caches"] = fwd(params, ids, pos, h, state["caches"], md)
        return out, nxt, logits_fn(params, out)

    got = run_chunks(step, seqs, [[3, 4], [2, 5]], table)
    # a tied target shares its embedding as the head (no transposed copy)
    tied_target, _, tied_head = target_weights(cfg, tied=True)
    tied = share_target_weights(own, tied_target, kind="eagle")
    assert tied["lm_head"]["embedding"] is tied_target["embed_tokens"]["embedding"]
    for r in range(2):
        o, lg = ora.eagle(tensors, geo(cfg), emb, head, seqs[r], hid[r].astype(np.float64), 2)
        out = np.stack([x[0] for x in got[r]])
        assert_close(out, o, what="eagle out")
        assert_close(np.stack([x[1] for x in got[r]]), o, what="eagle next hidden")
        assert_close(np.stack([x[2] for x in got[r]]), lg, what="eagle logits")
        assert_close(logits_fn(tied, jnp.asarray(out)), o @ tied_head.T, what="eagle tied logits")


@pytest.mark.parametrize("fused", [False, True], ids=["hf_layout", "fused"])
def test_mtp_matches_oracle(fused):
    """MiMo MTP against the oracle written from vLLM's forward: the hidden-first concat, the
    zeroed embedding at position 0 (the first chunk starts there), q/k/v bias, the final
    norm, the target's embedding and lm_head."""
    cfg = cfg_of("mtp", **GEO, num_hidden_layers=1, vocab_size=80, num_nextn_predict_layers=1)
    assert cfg.qkv_bias and not cfg.o_bias          # the Qwen2 block of MiMo
    tensors = registry.random_tensors("mtp", cfg, seed=14)
    assert "layers.0.self_attn.q_proj.bias" in tensors and "embed_tokens.weight" not in tensors
    target, emb, head = target_weights(cfg, seed=15)
    params = share_target_weights(registry.params_from_tensors("mtp", cfg, tensors), target)
    if fused:
        params = fuse_projections(params)
        assert "qkv_proj" in params["layers"][0]["self_attn"]
    model = registry.make_model("mtp", cfg)
    fwd, logits_fn = jitted(model.forward), jitted(model.compute_logits)
    rng = np.random.default_rng(16)
    seqs = [rng.integers(0, 80, size=n) for n in (6, 8)]
    hid = [rng.standard_normal((len(s), 32)).astype(np.float32) for s in seqs]
    table = block_tables(2, 3)
    state = {"caches": model.init_kv_caches(NUM_BLOCKS, BS)}

    def step(ids, pos, md, rows):
        h = jnp.asarray(pad(np.stack([hid[r][p] for r, p in rows])))
        out, nxt, state["caches"] = fwd(params, ids, pos, h, state["caches"], md)
        return out, nxt, logits_fn(params, out)

    got = run_chunks(step, seqs, [[4, 3], [2, 5]], table)
    for r in range(2):
        o, lg = ora.mtp(tensors, geo(cfg), emb, head, seqs[r], np.arange(len(seqs[r])),
                        hid[r].astype(np.float64))
        assert_close(np.stack([x[0] for x in got[r]]), o, what="mtp out")
        assert_close(np.stack([x[1] for x in got[r]]), o, what="mtp next hidden (post-norm)")
        assert_close(np.stack([x[2] for x in got[r]]), lg, what="mtp logits")
    # the position-0 rule matters: without it the first row differs
    o_nomask, _ = ora.mtp(tensors, geo(cfg), emb, head, seqs[0], np.arange(1, len(seqs[0]) + 1),
                          hid[0].astype(np.float64))
    assert relerr(np.stack([x[0] for x in got[0]])[:1], o_nomask[:1]) > 1e-3


EAGLE3_CASES = {
    # the fixtures cover SafeAILab / speculators layouts; this adds Ht != H, an extra layer,
    # Qwen3-style q/k norms and a reduced vocab with a shared target embedding
    "all_features": dict(num_hidden_layers=2, vocab_size=96, draft_vocab_size=40,
                         target_hidden_size=24, norm_before_residual=True, has_d2t=True,
                         model_type="qwen3", head_dim=16,
                         eagle_aux_hidden_state_layer_ids=[1, 3, 5]),
    # vLLM v0.33's "EAGLE 3.1" options: both pre-fc norms, the normed output recycled
    "v033_norms": dict(num_hidden_layers=1, vocab_size=80, target_hidden_size=24,
                       norm_before_fc=True, fc_norm=True, norm_output=True,
                       eagle_aux_hidden_state_layer_ids=[1, 3, 5]),
}


@pytest.mark.parametrize("fused", [False, True], ids=["hf_layout", "fused"])
@pytest.mark.parametrize("name", list(EAGLE3_CASES))
def test_eagle3_matches_oracle(name, fused):
    cfg = cfg_of("eagle3", **{**GEO, **EAGLE3_CASES[name]})
    tensors = registry.random_tensors("eagle3", cfg, seed=8)
    target, emb, _ = target_weights(cfg)
    params = share_target_weights(registry.params_from_tensors("eagle3", cfg, tensors), target)
    if fused:           # the head's layer reads [embeds | hidden]: q/k/v fused at 2H wide
        params = fuse_projections(params)
        assert is_fused(params)
    assert params["embed_tokens"] is target["embed_tokens"]
    model = registry.make_model("eagle3", cfg)
    fwd, combine = jitted(model.forward), jitted(model.combine_hidden_states)
    logits_fn, draft_fn = jitted(model.compute_logits), jitted(model.compute_draft_logits)
    ht = cfg.target_hidden_size
    rng = np.random.default_rng(9)
    seqs = [rng.integers(0, cfg.vocab_size, size=n) for n in (6, 4)]
    aux = [rng.standard_normal((len(s), 3, ht)).astype(np.float32) for s in seqs]
    table = block_tables(2, 3)
    state = {"caches": model.init_kv_caches(NUM_BLOCKS, BS)}

    def step(ids, pos, md, rows):
        a = jnp.asarray(pad(np.stack([aux[r][p] for r, p in rows])))
        h = combine(params, a)       # the raw-width path (fc inside forward): fixture tests
        normed, pre, state["caches"] = fwd(params, ids, pos, h, state["caches"], md)
        return normed, pre, draft_fn(params, normed), logits_fn(params, normed)

    got = run_chunks(step, seqs, [[4, 1], [2, 3]], table)
    for r in range(2):
        normed, pre, dl = ora.eagle3(tensors, geo(cfg), emb, seqs[r],
                                     aux[r].reshape(len(seqs[r]), -1).astype(np.float64),
                                     cfg.num_hidden_layers, cfg.norm_before_residual, cfg.qk_norm,
                                     norm_before_fc=cfg.norm_before_fc, fc_norm=cfg.fc_norm)
        assert_close(np.stack([x[0] for x in got[r]]), normed, what="eagle3 normed")
        assert_close(np.stack([x[1] for x in got[r]]), normed if cfg.norm_output else pre,
                     what="eagle3 recycled hidden")
        assert_close(np.stack([x[2] for x in got[r]]), dl, what="eagle3 draft logits")
        full = np.stack([x[3] for x in got[r]])
        if "d2t" in tensors:
            tid = np.arange(cfg.draft_vocab_size) + tensors["d2t"]
            want = np.full((len(dl), cfg.vocab_size), -np.inf)
            want[:, tid] = dl
            assert np.array_equal(np.isinf(full), np.isinf(want))
            assert_close(full[:, tid], dl)
            mapped = np.asarray(model.draft_to_target_ids(params, jnp.argmax(jnp.asarray(dl), -1)))
            assert np.array_equal(mapped, np.argmax(want, -1))
        else:
            assert_close(full, dl)


@pytest.mark.parametrize("fused", [False, True], ids=["hf_layout", "fused"])
def test_dflash_matches_oracle_over_two_steps(fused):
    B = 4
    cfg = cfg_of("dflash", **{**GEO, "rms_norm_eps": 1e-6}, num_hidden_layers=2, vocab_size=72, target_hidden_size=24,
                 block_size=B, rope_theta=1e6,
                 dflash_config=dict(mask_token_id=71, target_layer_ids=[0, 2]))
    assert cfg.aux_layer_ids == (1, 3) and cfg.qk_norm and not cfg.causal
    tensors = registry.random_tensors("dflash", cfg, seed=10)
    target, emb, head = target_weights(cfg, tied=True)
    params = share_target_weights(registry.params_from_tensors("dflash", cfg, tensors), target)
    if fused:           # the context K/V read the fused matrix's k and v columns
        params = fuse_projections(params)
        assert "qkv_proj" in params["layers"][0]["self_attn"]
    model = registry.make_model("dflash", cfg)
    combine = jitted(model.combine_hidden_states)
    store = jitted(model.precompute_and_store_context_kv)
    fwd, logits_fn = jitted(model.forward), jitted(model.compute_logits)
    rng = np.random.default_rng(12)
    table = block_tables(2, 4)
    caches = model.init_kv_caches(NUM_BLOCKS, BS)
    ctx_len = [0, 0]
    aux_all = [np.zeros((0, 2 * 24), np.float32) for _ in range(2)]
    for new_ctx in ([5, 9], [3, 1]):            # accepted tokens per step
        rows, aux_rows = [], []
        for r in range(2):
            a = rng.standard_normal((new_ctx[r], 2, 24)).astype(np.float32).reshape(new_ctx[r], -1)
            aux_all[r] = np.concatenate([aux_all[r], a])
            rows += [(r, ctx_len[r] + i) for i in range(new_ctx[r])]
            aux_rows.append(a)
        pos = np.array([p for _, p in rows], np.int32)
        slots = np.array([slots_for(table[r], p) for r, p in rows], np.int32)
        ctx = combine(params, jnp.asarray(pad(np.concatenate(aux_rows))))
        caches = store(params, ctx, jnp.asarray(pad(pos)), jnp.asarray(pad(slots, fill=-1)), caches)
        ctx_len = [ctx_len[r] + new_ctx[r] for r in range(2)]
        bonus = rng.integers(0, 71, size=2)
        ids = np.concatenate([[bonus[r]] + [71] * (B - 1) for r in range(2)]).astype(np.int32)
        bpos = np.concatenate([ctx_len[r] + np.arange(B) for r in range(2)]).astype(np.int32)
        md = meta([B, B], [ctx_len[0] + B, ctx_len[1] + B], table, causal=False, qb=B)
        hidden, caches = fwd(params, jnp.asarray(pad(ids)), jnp.asarray(pad(bpos)), caches, md)
        logits = np.asarray(logits_fn(params, hidden))
        for r in range(2):
            out, lg = ora.dflash(tensors, geo(cfg), emb, head, aux_all[r].astype(np.float64),
                                 ids[r * B:(r + 1) * B], ctx_len[r], 2)
            assert_close(np.asarray(hidden)[r * B:(r + 1) * B], out, what="dflash hidden")
            assert_close(logits[r * B + 1:(r + 1) * B], lg, what="dflash logits")


@pytest.mark.parametrize("variant", ["per_head", "shared_token_map"])
def test_medusa_matches_oracle(variant):
    if variant == "per_head":
        cfg = cfg_of("medusa", hidden_size=32, vocab_size=64, medusa_num_heads=3,
                     medusa_num_layers=2, medusa_fc_bias=True)
    else:
        cfg = cfg_of("medusa", hidden_size=32, vocab_size=64, num_heads=2, num_hidden_layers=1,
                     truncated_vocab_size=40, original_lm_head=True, has_token_map=True)
    assert cfg.num_heads == (3 if variant == "per_head" else 2)
    tensors = registry.random_tensors("medusa", cfg, seed=13)
    params = registry.params_from_tensors("medusa", cfg, tensors)
    model = registry.make_model("medusa", cfg)
    hs = np.random.default_rng(14).standard_normal((6, 32)).astype(np.float32)
    z = jitted(model.forward)(params, jnp.asarray(hs))
    logits = np.asarray(jitted(model.compute_logits)(params, z))
    tm = tensors.get("token_map")
    want = ora.medusa(tensors, hs.astype(np.float64), cfg.num_heads, cfg.num_hidden_layers,
                      cfg.original_lm_head, tm, cfg.vocab_size)
    assert logits.shape == (cfg.num_heads, 6, cfg.vocab_size)
    if tm is None:
        assert_close(logits, want)
    else:
        assert np.array_equal(np.isinf(logits), np.isinf(want))
        assert_close(logits[..., tm], want[..., tm])
        # a full-vocab head in the checkpoint is row-sliced by the token map
        full = dict(tensors)
        big = np.zeros((64, 32), np.float32)
        big[tm] = tensors["lm_head.weight"]
        full["lm_head.weight"] = big
        p2 = registry.params_from_tensors("medusa", cfg, full)
        np.testing.assert_array_equal(np.asarray(p2["lm_head"]["kernel"]),
                                      np.asarray(params["lm_head"]["kernel"]))


def test_extract_hidden_states_writes_cache_only():
    m = ExtractHiddenStates(num_hidden_states=3, hidden_size=8)
    caches = m.init_kv_caches(NUM_BLOCKS, BS)
    table = block_tables(2, 5)
    md = meta([3, 2], [7, 2], table)
    hs = np.random.default_rng(15).standard_normal((T_PAD, 3, 8)).astype(np.float32)
    hs[5:] = 1e9                                   # padding tokens: slot -1, dropped
    (cache,) = jitted(m.forward)({}, jnp.asarray(hs), caches, md)
    flat = np.asarray(cache).reshape(-1, 3, 8)
    slots = np.asarray(md.slot_mapping)
    np.testing.assert_array_equal(flat[slots[:5]], hs[:5])
    assert slots[5:].tolist() == [-1] * (T_PAD - 5)
    assert np.count_nonzero(np.any(flat != 0, axis=(1, 2))) == 5


# ----------------------------------------------------------------------------------------
# (4) registry


def all_configs():
    out = {
        "llama": cfg_of("llama", **GEO, num_hidden_layers=2, vocab_size=96, rope_theta=5e5,
                        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                          high_freq_factor=4.0, original_max_position_embeddings=64)),
        "qwen2": cfg_of("qwen2", **GEO, num_hidden_layers=2, vocab_size=96, tie_word_embeddings=True),
        "qwen3": cfg_of("qwen3", **GEO, num_hidden_layers=2, vocab_size=96, head_dim=16),
    }
    for name, spec in DECODER_CASES.items():
        spec = dict(spec)
        kind = spec.pop("kind")
        out[name] = cfg_of(kind, **{**GEO, **spec})
    out["eagle"] = cfg_of("eagle", **GEO, num_hidden_layers=2, vocab_size=80, bias=False,
                          qkv_bias=True)
    for name, spec in EAGLE3_CASES.items():
        out[f"eagle3_{name}"] = cfg_of("eagle3", **{**GEO, **spec})
    out["eagle3_embed"] = cfg_of("eagle3", **GEO, num_hidden_layers=1, vocab_size=64,
                                 has_embed_tokens=True)
    out["dflash"] = cfg_of("dflash", **GEO, num_hidden_layers=3, vocab_size=72, block_size=8,
                           mask_token_id=70, aux_hidden_state_layer_ids=[2, 5, 8],
                           has_lm_head=True, has_embed_tokens=True, has_d2t=True,
                           draft_vocab_size=50)
    out["mtp"] = cfg_of("mtp", **GEO, num_hidden_layers=1, vocab_size=64,
                        num_nextn_predict_layers=2)
    out["medusa"] = cfg_of("medusa", hidden_size=32, vocab_size=64, num_heads=2,
                           num_hidden_layers=2, medusa_fc_bias=True, logit_scale=2.0,
                           truncated_vocab_size=48, has_token_map=True)
    return out


@pytest.mark.parametrize("name", list(all_configs()))
def test_registry_round_trip_and_structure(name):
    import json

    cfg = all_configs()[name]
    d = registry.config_to_dict(cfg)
    assert registry.config_from_hf(cfg.kind, json.loads(json.dumps(d))) == cfg
    hash(cfg)
    exp = registry.expected_tensors(cfg.kind, cfg)
    tensors = registry.random_tensors(cfg.kind, cfg, seed=0)
    assert set(tensors) == {k for k, (_, req) in exp.items() if req} | {
        k for k in exp if k in tensors}
    for k, t in tensors.items():
        assert t.shape == exp[k][0], k
    params = registry.params_from_tensors(cfg.kind, cfg, tensors, jnp.bfloat16)
    abstract = registry.abstract_params(cfg.kind, cfg, jnp.bfloat16)
    assert jax.tree.structure(params) == jax.tree.structure(abstract)
    for p, a in zip(jax.tree.leaves(params), jax.tree.leaves(abstract)):
        assert (p.shape, p.dtype) == (a.shape, a.dtype)
    # the body of the params is exactly the NNX module's state
    from specjax.models import dflash, eagle, eagle3, llama, medusa, mtp
    body = {"llama": llama.DecoderBody, "qwen2": llama.DecoderBody, "qwen3": llama.DecoderBody,
            "eagle": eagle.EagleBody, "eagle3": eagle3.Eagle3Body, "dflash": dflash.DFlashBody,
            "medusa": medusa.MedusaBody, "mtp": mtp.MTPBody}[cfg.kind]
    merge(body, (cfg,), params)
    # orbax-style string layer keys are accepted
    strkeys = {k: ({str(i): x for i, x in v.items()} if k in ("layers", "blocks") else v)
               for k, v in params.items()}
    merge(body, (cfg,), strkeys)


def test_expected_tensor_shapes_follow_checkpoint_formats():
    c = all_configs()
    h, nh, nkv = 32, 4, 2
    e = registry.expected_tensors("eagle", c["eagle"])
    assert e["fc.weight"] == ((h, 2 * h), True) and "fc.bias" not in e
    assert "layers.0.input_layernorm.weight" not in e and "layers.1.input_layernorm.weight" in e
    assert e["layers.0.self_attn.q_proj.bias"] == ((nh * 8,), True)
    assert "layers.0.self_attn.o_proj.bias" not in e
    assert e["embed_tokens.weight"][1] is False and e["lm_head.weight"][1] is False   # optional
    e = registry.expected_tensors("eagle3", c["eagle3_all_features"])
    assert e["fc.weight"][0] == (h, 3 * 24)
    assert e["layers.0.self_attn.q_proj.weight"][0] == (nh * 16, 2 * h)     # head_dim 16
    assert e["layers.0.self_attn.k_proj.weight"][0] == (nkv * 16, 2 * h)
    assert e["layers.0.self_attn.o_proj.weight"][0] == (h, nh * 16)
    assert e["layers.0.self_attn.q_norm.weight"][0] == (16,)
    assert e["layers.0.hidden_norm.weight"][0] == (h,) and "layers.1.hidden_norm.weight" not in e
    assert e["layers.1.self_attn.q_proj.weight"][0] == (nh * 16, h)
    assert e["lm_head.weight"] == ((40, h), True) and e["d2t"] == ((40,), False)
    assert e["embed_tokens.weight"] == ((96, h), False)
    e = registry.expected_tensors("qwen3", c["qwen3"])
    assert e["model.layers.0.self_attn.q_proj.weight"][0] == (4 * 16, h)
    assert e["model.layers.1.self_attn.k_norm.weight"][0] == (16,)
    e = registry.expected_tensors("qwen2", c["qwen2"])
    assert e["model.layers.0.self_attn.v_proj.bias"][0] == (nkv * 8,)
    assert "model.layers.0.self_attn.o_proj.bias" not in e
    assert e["lm_head.weight"][1] is False           # tied
    e = registry.expected_tensors("dflash", c["dflash"])
    assert e["fc.weight"][0] == (h, 3 * h) and e["hidden_norm.weight"][0] == (h,)
    assert e["layers.2.self_attn.q_norm.weight"][0] == (8,)
    e = registry.expected_tensors("medusa", c["medusa"])
    assert e["blocks.1.layers.1.weight"][0] == (h, h) and e["blocks.1.layers.1.bias"][0] == (h,)
    assert e["lm_heads.1.weight"][0] == (48, h) and e["token_map"] == ((48,), False)


def test_config_from_hf_variants():
    base = dict(GEO, num_hidden_layers=2, vocab_size=64)
    # transformers v5 rope_parameters
    c = cfg_of("llama", **base, rope_parameters=dict(rope_type="llama3", rope_theta=5e5, factor=8.0,
                                                     low_freq_factor=1.0, high_freq_factor=4.0,
                                                     original_max_position_embeddings=64))
    assert c.rope_theta == 5e5 and c.rope_type == "llama3"
    assert cfg_of("llama", **base, rope_scaling=dict(type="linear", factor=2.0)).rope_type == "linear"
    assert cfg_of("qwen2", **base).qkv_bias and not cfg_of("qwen2", **base).o_bias
    assert cfg_of("llama", **base, attention_bias=True).o_bias
    # speculators nested config
    c = cfg_of("eagle3", transformer_layer_config=dict(base, model_type="qwen3", head_dim=16),
               draft_vocab_size=32, norm_before_residual=True,
               eagle_aux_hidden_state_layer_ids=[2, 16, 29])
    assert c.qk_norm and c.head_dim == 16 and c.aux_layer_ids == (2, 16, 29) and c.draft_vocab_size == 32
    assert cfg_of("eagle3", **base).aux_layer_ids is None and cfg_of("eagle3", **base).num_aux == 3
    # z-lab DFlash default layer ids: round(1 + i*(L-4)/(Ld-1)) + 1
    c = cfg_of("dflash", **base, num_target_layers=36, block_size=16,
               dflash_config=dict(mask_token_id=60))
    assert c.aux_layer_ids == (2, 34) and c.mask_token_id == 60 and c.rope_theta == 1e6
    assert cfg_of("eagle", **base).fc_bias is True       # SafeAILab default
    for bad, field in ((dict(rope_scaling=dict(rope_type="mrope", mrope_section=[2, 3, 3])), "rope_type"),
                       (dict(hidden_act="gelu"), "hidden_act"),
                       (dict(use_sliding_window=True), "use_sliding_window"),
                       (dict(partial_rotary_factor=0.5), "partial_rotary_factor"),
                       (dict(rope_parameters=dict(rope_theta=1e4, partial_rotary_factor=0.25)),
                        "rope_parameters.partial_rotary_factor"),
                       (dict(num_key_value_heads=3), "num_key_value_heads")):
        with pytest.raises(ValueError, match=field):
            cfg_of("llama", **{**base, **bad})
    with pytest.raises(ValueError, match="kind"):
        registry.config_from_hf("gpt2", base)
    # vLLM v0.33's EAGLE-3 norm options: read from a plain config, eagle_config.norm_before_fc
    # overriding the top-level key; a speculators config's norm_before_fc is honoured (vLLM
    # 0.33+'s speculators updater copies it); other kinds refuse them by name
    c = cfg_of("eagle3", **base, fc_norm=True, norm_output=True, norm_before_fc=False,
               eagle_config={"norm_before_fc": True})
    assert (c.norm_before_fc, c.fc_norm, c.norm_output) == (True, True, True)
    assert registry.config_from_hf("eagle3", registry.config_to_dict(c)) == c
    plain = cfg_of("eagle3", **base)
    assert not (plain.norm_before_fc or plain.fc_norm or plain.norm_output)
    spec = dict(transformer_layer_config=base, speculators_model_type="eagle3")
    assert cfg_of("eagle3", **spec, fc_norm=True, norm_output=True).fc_norm
    assert cfg_of("eagle3", **spec, norm_before_fc=True).norm_before_fc
    with pytest.raises(ValueError, match="use_aux_hidden_state"):
        cfg_of("eagle3", **base, eagle_config={"use_aux_hidden_state": False})
    with pytest.raises(ValueError, match="fc_norm must be false for a 'dflash' config"):
        cfg_of("dflash", **base, fc_norm=True, block_size=4, aux_hidden_state_layer_ids=[1, 2],
               mask_token_id=3)
    with pytest.raises(TypeError, match="norm_output must be true or false"):
        cfg_of("eagle3", **base, norm_output="yes")


def test_params_from_tensors_errors_name_the_key():
    cfg = all_configs()["eagle3_all_features"]
    t = registry.random_tensors("eagle3", cfg)
    with pytest.raises(ValueError, match="layers.0.hidden_norm.weight"):
        registry.params_from_tensors("eagle3", cfg, {k: v for k, v in t.items()
                                                     if k != "layers.0.hidden_norm.weight"})
    with pytest.raises(ValueError, match="midlayer.bogus"):
        registry.params_from_tensors("eagle3", cfg, {**t, "midlayer.bogus": np.zeros(3)})
    with pytest.raises(ValueError, match="fc.weight"):
        registry.params_from_tensors("eagle3", cfg, {**t, "fc.weight": np.zeros((32, 70))})
    with pytest.raises(ValueError, match="has_d2t"):
        registry.params_from_tensors("eagle3", cfg.replace(has_d2t=False), t)
    # presence flags from the names a converter found
    c2 = registry.config_with_tensors("eagle3", cfg.replace(has_d2t=None, has_embed_tokens=None),
                                      [k for k in t if k != "embed_tokens.weight"])
    assert c2.has_d2t is True and c2.has_embed_tokens is False


def test_missing_shared_weights_error():
    cfg = all_configs()["eagle"]
    model = registry.make_model("eagle", cfg)
    params = registry.params_from_tensors("eagle", cfg, registry.random_tensors("eagle", cfg))
    with pytest.raises(ValueError, match="share_target_weights"):
        model.compute_logits(params, jnp.zeros((2, 32)))


@pytest.mark.parametrize("shape", [(1, 8), (1, 1, 8), (8,)])
def test_one_row_matmul_is_two_rows_on_a_gpu_only(shape):
    """``models.params.two_row_matmul``: a one-row product is lowered on two rows (behind an
    optimization barrier) for a GPU, where XLA's one-row dot strength reduction runs slow,
    and as it is for a CPU, where the one-row product is the faster; the values are the
    product's. Lowered for CUDA here without a GPU (``lowering_platforms``)."""
    from specjax.models.params import two_row_matmul

    w = jnp.asarray(np.random.default_rng(0).standard_normal((8, 5)), jnp.float32)
    x = jnp.asarray(np.random.default_rng(1).standard_normal(shape), jnp.float32)
    f = jax.jit(lambda x: two_row_matmul(lambda r: r @ w, x))
    np.testing.assert_allclose(np.asarray(f(x)), np.asarray(x) @ np.asarray(w), rtol=1e-6)
    cpu = f.trace(x).lower(lowering_platforms=("cpu",)).as_text()
    cuda = f.trace(x).lower(lowering_platforms=("cuda",)).as_text()
    assert "optimization_barrier" not in cpu and "tensor<2x8xf32>" not in cpu
    assert "optimization_barrier" in cuda and "tensor<2x8xf32>" in cuda
    # two rows or more: the product as it is everywhere
    x2 = jnp.ones((2, 8))
    assert "optimization_barrier" not in f.trace(x2).lower(lowering_platforms=("cuda",)).as_text()

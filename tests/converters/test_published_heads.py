"""Published draft heads and target layouts (docs/heads.md): one case per row.

Each supported row writes a config carrying the published keys and values, shrunk in size
only, with random weights in that trainer's layout; specjax's converter reads it, and the
head's one-step output is compared with a NumPy oracle fed the tiny target's hidden states
at the layers the row's key means (HF ``hidden_states``: input of layer i = index i, output
of layer i = index i + 1). Rows that need features of other issues are refused by name.
"""

from __future__ import annotations

import json
import warnings

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import save_file

import models_oracle as ora
from specjax.converters import CheckpointError, FormatDetectionError, prepare
from specjax.models import registry, share_target_weights
from specjax.models.config import ROPE_TYPES
from test_models import BS, NUM_BLOCKS, assert_close, block_tables, geo, jitted, meta, pad

V, H, I_, NH, NKV, EPS = 64, 32, 48, 4, 2, 1e-5
L = 8                                      # target layers
GEO = dict(hidden_size=H, intermediate_size=I_, num_attention_heads=NH,
           num_key_value_heads=NKV, rms_norm_eps=EPS, vocab_size=V)
S = 6                                      # tokens in the one step


# -- the target -------------------------------------------------------------------------------

def _target():
    cfg = registry.config_from_hf("llama", dict(GEO, num_hidden_layers=L, rope_theta=10000.0))
    t = registry.random_tensors("llama", cfg, seed=21)
    return cfg, t, registry.params_from_tensors("llama", cfg, t, jnp.float32)


def target_states(ids, aux_ids):
    """specjax's target aux at ``aux_ids`` (input of layer k) [S, n, H], the oracle's HF
    ``hidden_states`` list (index i = input of layer i; then the post-norm final hidden at
    index L + 1), and the target params."""
    cfg, t, params = _target()
    model = registry.make_model("llama", cfg, aux_layer_ids=tuple(aux_ids))
    caches = model.init_kv_caches(NUM_BLOCKS, BS)
    md = meta([len(ids)], [len(ids)], block_tables(1, 0))
    pos = jnp.asarray(pad(np.arange(len(ids), dtype=np.int32)))
    _, aux, _ = jitted(model.forward)(params, jnp.asarray(pad(np.asarray(ids, np.int32))), pos,
                                      caches, md)
    final, inputs, _ = ora.decoder(t, geo(cfg), ids, L, False, False)
    h = inputs[-1]
    last = ora.layer(t, f"model.layers.{L - 1}.", h, geo(cfg), ora.causal(len(ids)))
    aux = None if aux is None else np.asarray(aux)[: len(ids)]
    return aux, inputs + [last, final], t, params


# -- writing a trainer's layout -----------------------------------------------------------------

def write(tmp_path, config: dict, tensors: dict, rename=None):
    src = tmp_path / "head"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(config))
    out = {}
    for k, a in tensors.items():
        for old, new in (rename or {}).items():
            if k.startswith(old):
                k = new + k[len(old):]
        out[k] = np.asarray(a, np.int64 if k == "d2t" else np.float32)
    if "d2t" in out:
        t2d = np.zeros(config.get("vocab_size") or V, bool)
        t2d[np.arange(len(out["d2t"])) + out["d2t"]] = True
        out["t2d"] = t2d
    save_file(out, str(src / "model.safetensors"))
    return src


def canonical(kind, seed=5, **hf):
    cfg = registry.config_from_hf(kind, dict(GEO, **hf))
    return cfg, registry.random_tensors(kind, cfg, seed=seed)


def convert(src, warn=None, also=None):
    """``prepare(src)``; exactly one aux-ids warning containing ``warn`` (None: none), and
    one containing ``also`` when given."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        prep = prepare(src)
    msgs = [str(w.message) for w in caught]
    if warn is None:
        assert not [m for m in msgs if "aux_hidden_state" in m], msgs
    else:
        assert len([m for m in msgs if warn in m]) == 1, msgs
    if also is not None:
        assert len([m for m in msgs if also in m]) == 1, msgs
    return prep


# -- EAGLE-3 rows --------------------------------------------------------------------------------

def run_eagle3(prep, tensors, oracle_aux_layers):
    """One step of the converted head on the target's aux states vs the oracle on the HF
    hidden states at ``oracle_aux_layers`` (indices into HF ``hidden_states``)."""
    cfg = prep.config
    ids = np.random.default_rng(3).integers(0, V, size=S)
    aux, hs, t_tensors, t_params = target_states(ids, cfg.aux_layer_ids)
    params = share_target_weights(prep.params, t_params)
    model = registry.make_model("eagle3", cfg)
    caches = model.init_kv_caches(NUM_BLOCKS, BS)
    md = meta([S], [S], block_tables(1, 1))
    normed, pre, _ = jitted(model.forward)(
        params, jnp.asarray(pad(ids.astype(np.int32))), jnp.asarray(pad(np.arange(S, dtype=np.int32))),
        jnp.asarray(pad(aux.reshape(S, -1))), caches, md)
    draft = np.asarray(jitted(model.compute_draft_logits)(params, normed))[:S]
    want_aux = np.concatenate([hs[i] for i in oracle_aux_layers], -1)
    emb = np.asarray(t_tensors["model.embed_tokens.weight"], np.float64)
    o_normed, o_pre, o_logits = ora.eagle3(
        tensors, geo(cfg), emb, ids, want_aux, cfg.num_hidden_layers, cfg.norm_before_residual,
        cfg.qk_norm, norm_before_fc=cfg.norm_before_fc, fc_norm=cfg.fc_norm, n_aux=cfg.num_aux)
    assert_close(np.asarray(normed)[:S], o_normed, what="eagle3 normed")
    assert_close(np.asarray(pre)[:S], o_normed if cfg.norm_output else o_pre, what="recycled")
    assert_close(draft, o_logits, what="draft logits")


MIDLAYER = {"layers.0.": "midlayer."}


def test_eagle3_safeailab(tmp_path):
    """LlamaForCausalLMEagle3: draft_vocab_size + d2t/t2d, no rope_theta, midlayer.*; no
    aux ids: vLLM's default taps (2, L//2, L-3), inputs of those layers."""
    cfg, t = canonical("eagle3", num_hidden_layers=1, draft_vocab_size=40, has_d2t=True,
                       max_position_embeddings=2048)
    hf = dict(GEO, architectures=["LlamaForCausalLMEagle3"], model_type="llama",
              num_hidden_layers=1, draft_vocab_size=40, max_position_embeddings=2048,
              torch_dtype="float32")
    prep = convert(write(tmp_path, hf, t, MIDLAYER))
    assert prep.format == "eagle3" and prep.config.rope_theta == 10000.0
    assert prep.config.aux_layer_ids is None
    prep.config = prep.config.replace(aux_layer_ids=(2, L // 2, L - 3))   # the engine's default
    run_eagle3(prep, t, [2, L // 2, L - 3])


SPECFORGE = dict(architectures=["LlamaForCausalLMEagle3"], model_type="llama",
                 num_hidden_layers=1, draft_vocab_size=40, head_dim=16,
                 target_model_type="qwen3_moe", sliding_window=4096, use_sliding_window=False,
                 max_position_embeddings=2048, rope_theta=1000000.0,
                 eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 3, 5],
                               "use_aux_hidden_state": True})


def test_eagle3_specforge_nested_ids(tmp_path):
    """SpecForge (qwen3-235B-A22B-eagle3 shape): nested output-of-layer ids -> the inputs
    of layers id + 1 (SGLang's tap), one warning naming vLLM's default; head_dim != H/nH."""
    cfg, t = canonical("eagle3", num_hidden_layers=1, draft_vocab_size=40, has_d2t=True,
                       head_dim=16, rope_theta=1e6, eagle_aux_hidden_state_layer_ids=[2, 4, 6])
    prep = convert(write(tmp_path, dict(GEO, **SPECFORGE), t, MIDLAYER),
                   warn="eagle_config.eagle_aux_hidden_state_layer_ids=[1, 3, 5]")
    assert prep.config.aux_layer_ids == (2, 4, 6) and prep.config.head_dim == 16
    run_eagle3(prep, t, [2, 4, 6])       # outputs of layers 1, 3, 5


def test_eagle3_specforge_eagle31(tmp_path):
    """SpecForge qwen3-30B-A3B-eagle3.1: fc_norm and norm_output on top of the nested ids."""
    cfg, t = canonical("eagle3", num_hidden_layers=1, draft_vocab_size=40, has_d2t=True,
                       head_dim=16, rope_theta=1e6, fc_norm=True, norm_output=True,
                       eagle_aux_hidden_state_layer_ids=[2, 4, 6])
    hf = dict(GEO, **SPECFORGE, fc_norm=True, norm_output=True)
    prep = convert(write(tmp_path, hf, t, MIDLAYER), warn="vLLM 0.34")
    assert prep.config.fc_norm and prep.config.norm_output
    run_eagle3(prep, t, [2, 4, 6])


def test_eagle3_specforge_gemma3_head(tmp_path):
    """SpecForge gemma3-1b-eagle3: 4 heads x head_dim 256-like (wider than H/nH), a head
    vocab one above the target's (262145 vs 262144) kept as written."""
    cfg, t = canonical("eagle3", num_hidden_layers=1, draft_vocab_size=40, has_d2t=True,
                       num_attention_heads=4, num_key_value_heads=1, head_dim=32,
                       vocab_size=V + 1, eagle_aux_hidden_state_layer_ids=[2, 4, 6])
    hf = dict(GEO, **{**SPECFORGE, "head_dim": 32}, num_key_value_heads=1, vocab_size=V + 1)
    prep = convert(write(tmp_path, hf, t, MIDLAYER), warn="vLLM 0.34")
    assert prep.config.vocab_size == V + 1 and prep.config.head_dim == 32


def test_eagle3_speculators_norm_before_fc(tmp_path):
    """RedHatAI gpt-oss-20b speculator: norm_before_fc true (input_norm over the whole
    concatenation before fc, vLLM 0.33+), top-level input-of-layer ids, norm_before_residual
    defaulting to True, target_hidden_size."""
    cfg, t = canonical("eagle3", num_hidden_layers=1, draft_vocab_size=40, has_d2t=True,
                       target_hidden_size=H, norm_before_fc=True, norm_before_residual=True,
                       eagle_aux_hidden_state_layer_ids=[2, 4, 5])
    assert "input_norm.weight" in t
    t["input_norm.weight"] = 1 + 0.3 * np.random.default_rng(1).standard_normal(3 * H)
    tlc = dict(GEO, model_type="llama", num_hidden_layers=1, rope_theta=10000.0)
    hf = dict(architectures=["Eagle3DraftModel"], speculators_model_type="eagle3",
              speculators_config={"algorithm": "eagle3", "default_proposal_method": "greedy",
                                  "proposal_methods": [{"proposal_type": "greedy",
                                                        "speculative_tokens": 3}],
                                  "verifier": {"name_or_path": "openai/gpt-oss-20b"}},
              transformer_layer_config=tlc, eagle_aux_hidden_state_layer_ids=[2, 4, 5],
              norm_before_fc=True, draft_vocab_size=40, target_hidden_size=H)
    prep = convert(write(tmp_path, hf, t))
    c = prep.config
    assert prep.format == "eagle3-speculators" and c.norm_before_fc and c.norm_before_residual
    assert c.aux_layer_ids == (2, 4, 5)
    run_eagle3(prep, t, [2, 4, 5])
    # without the norm the output differs: the test sees input_norm
    off = dict(t)
    off["input_norm.weight"] = np.ones(3 * H)
    with pytest.raises(AssertionError):
        run_eagle3(prep, off, [2, 4, 5])


def test_eagle3_modelopt(tmp_path):
    """NVIDIA ModelOpt (Llama-4-Maverick-Eagle3 shape): nested ids, its layernorm and
    parallel-draft flags (not read, as in vLLM 0.34), full draft vocabulary without d2t."""
    cfg, t = canonical("eagle3", num_hidden_layers=1, eagle_aux_hidden_state_layer_ids=[2, 4, 6])
    ec = {"eagle_aux_hidden_state_layer_ids": [1, 3, 5], "use_aux_hidden_state": True,
          "use_input_layernorm_in_first_layer": True, "use_last_layernorm": True,
          "use_mtp_layernorm": False, "next_layer_regular": True, "parallel_draft_step": 1,
          "parallel_draft_heads_num_layers": 1}
    hf = dict(GEO, architectures=["LlamaForCausalLMEagle3"], model_type="llama",
              num_hidden_layers=1, rope_theta=500000.0, eagle_config=ec)
    prep = convert(write(tmp_path, hf, t, MIDLAYER), warn="vLLM 0.34")
    assert prep.config.aux_layer_ids == (2, 4, 6) and "d2t" not in prep.params
    run_eagle3(prep, t, [2, 4, 6])


def test_eagle3_nebius_truncated_vocab(tmp_path):
    """nebius LK heads: LlamaForCausalLM with truncated_vocab_size = draft_vocab_size
    (vLLM 0.34 stores the key and sizes the head by draft_vocab_size and d2t)."""
    cfg, t = canonical("eagle3", num_hidden_layers=1, draft_vocab_size=40, has_d2t=True,
                       rope_theta=500000.0)
    hf = dict(GEO, architectures=["LlamaForCausalLM"], model_type="llama", num_hidden_layers=1,
              draft_vocab_size=40, truncated_vocab_size=40, rope_theta=500000.0)
    prep = convert(write(tmp_path, hf, t, MIDLAYER))
    assert prep.format == "eagle3" and prep.config.draft_vocab_size == 40
    prep.config = prep.config.replace(aux_layer_ids=(2, L // 2, L - 3))
    run_eagle3(prep, t, [2, L // 2, L - 3])
    # a truncated_vocab_size saying something else is refused by name
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps(dict(hf, truncated_vocab_size=32)))
    (bad / "model.safetensors").write_bytes((tmp_path / "head" / "model.safetensors").read_bytes())
    with pytest.raises(CheckpointError, match="truncated_vocab_size=32"):
        prepare(bad)


# -- EAGLE-1 -----------------------------------------------------------------------------------

def test_eagle1_safeailab(tmp_path):
    """EAGLE-LLaMA3-Instruct-8B: LlamaForCausalLM, no ``bias`` key (fc bias from the file),
    one layer, max_position_embeddings 2048, no norm or lm_head; fed the target's final
    (post-norm) hidden, as EAGLE-1 was trained."""
    cfg, t = canonical("eagle", num_hidden_layers=1, bias=True, max_position_embeddings=2048)
    hf = dict(GEO, architectures=["LlamaForCausalLM"], model_type="llama", num_hidden_layers=1,
              max_position_embeddings=2048, rope_theta=500000.0)
    t = {k: v for k, v in t.items()}
    prep = convert(write(tmp_path, hf, t))
    c = prep.config
    assert prep.format == "eagle" and c.fc_bias and c.rope_theta == 500000.0
    ids = np.random.default_rng(4).integers(0, V, size=S)
    _, hs, t_tensors, t_params = target_states(ids, ())
    hid = hs[L + 1]
    params = share_target_weights(prep.params, t_params, kind="eagle")
    model = registry.make_model("eagle", c)
    out, _, _ = jitted(model.forward)(
        params, jnp.asarray(pad(ids.astype(np.int32))), jnp.asarray(pad(np.arange(S, dtype=np.int32))),
        jnp.asarray(pad(hid.astype(np.float32))), model.init_kv_caches(NUM_BLOCKS, BS),
        meta([S], [S], block_tables(1, 2)))
    emb = np.asarray(t_tensors["model.embed_tokens.weight"], np.float64)
    head = np.asarray(t_tensors["lm_head.weight"], np.float64)
    o, _ = ora.eagle(t, geo(c), emb, head, ids, hid, 1)
    assert_close(np.asarray(out)[:S], o, what="eagle out")


# -- DFlash rows -------------------------------------------------------------------------------

def run_dflash(prep, tensors, oracle_aux_layers):
    cfg, B = prep.config, prep.config.block_size
    ids = np.random.default_rng(6).integers(0, V, size=S)
    aux, hs, t_tensors, t_params = target_states(ids, cfg.aux_layer_ids)
    params = share_target_weights(prep.params, t_params)
    model = registry.make_model("dflash", cfg)
    table = block_tables(1, 3)
    caches = model.init_kv_caches(NUM_BLOCKS, BS)
    ctx = jitted(model.combine_hidden_states)(params, jnp.asarray(pad(aux.reshape(S, -1))))
    slots = np.array([table[0][p // BS] * BS + p % BS for p in range(S)], np.int32)
    caches = jitted(model.precompute_and_store_context_kv)(
        params, ctx, jnp.asarray(pad(np.arange(S, dtype=np.int32))),
        jnp.asarray(pad(slots, fill=-1)), caches)
    block = np.array([ids[-1]] + [cfg.mask_token_id] * (B - 1), np.int32)
    hidden, _ = jitted(model.forward)(params, jnp.asarray(pad(block)),
                                      jnp.asarray(pad(S + np.arange(B, dtype=np.int32))), caches,
                                      meta([B], [S + B], table, causal=False, qb=B))
    emb = np.asarray(t_tensors["model.embed_tokens.weight"], np.float64)
    head = np.asarray(t_tensors["lm_head.weight"], np.float64)
    want_aux = np.concatenate([hs[i] for i in oracle_aux_layers], -1)
    out, _ = ora.dflash(tensors, geo(cfg), emb, head, want_aux, block, S, cfg.num_hidden_layers)
    assert_close(np.asarray(hidden)[:B], out, what="dflash hidden")


def test_dflash_zlab(tmp_path):
    """z-lab Qwen3-8B-DFlash-b16 shape: dflash_config.target_layer_ids (output of layer)
    -> inputs of layers id + 1; use_swa / causal / attention_sink_bias false, layer_types
    all full attention, is_neox_style true."""
    cfg, t = canonical("dflash", num_hidden_layers=1, block_size=4, mask_token_id=V - 1,
                       head_dim=16, rope_theta=1e6, aux_hidden_state_layer_ids=[2, 5])
    hf = dict(GEO, architectures=["DFlashDraftModel"], model_type="qwen3", num_hidden_layers=1,
              head_dim=16, rope_theta=1000000.0, block_size=4, num_target_layers=L,
              layer_types=["full_attention"], is_neox_style=True, target_hidden_size=H,
              dflash_config={"mask_token_id": V - 1, "target_layer_ids": [1, 4],
                             "use_swa": False, "causal": False, "attention_sink_bias": False},
              auto_map={"AutoModel": "dflash.DFlashDraftModel"})
    prep = convert(write(tmp_path, hf, t))
    assert prep.format == "dflash" and prep.config.aux_layer_ids == (2, 5)
    run_dflash(prep, t, [2, 5])


def test_dflash_speculators(tmp_path):
    """speculators dflash: aux_hidden_state_layer_ids are inputs of layers (as is);
    sample_from_anchor false, sliding_window_non_causal true (non-causal, no window)."""
    cfg, t = canonical("dflash", num_hidden_layers=1, block_size=4, mask_token_id=V - 1,
                       head_dim=16, rope_theta=1e6, aux_hidden_state_layer_ids=[1, 6])
    tlc = dict(GEO, model_type="qwen3", num_hidden_layers=1, head_dim=16, rope_theta=1e6)
    hf = dict(architectures=["DFlashSpeculator"], speculators_model_type="dflash",
              transformer_layer_config=tlc, aux_hidden_state_layer_ids=[1, 6],
              mask_token_id=V - 1, block_size=4, sample_from_anchor=False,
              sliding_window_non_causal=True, draft_vocab_size=V, target_hidden_size=H)
    prep = convert(write(tmp_path, hf, t))
    assert prep.format == "dflash-speculators" and prep.config.aux_layer_ids == (1, 6)
    run_dflash(prep, t, [1, 6])


# -- refused rows ------------------------------------------------------------------------------

def _refused(tmp_path, hf, tensors, needle, exc=(CheckpointError, FormatDetectionError)):
    src = write(tmp_path, hf, tensors)
    with pytest.raises(exc, match=needle):
        prepare(src)


def _e3_tensors():
    return canonical("eagle3", num_hidden_layers=1, draft_vocab_size=40, has_d2t=True)[1]


def test_refused_eagle3_moe_draft(tmp_path):
    hf = dict(GEO, architectures=["GptOssForCausalLMEagle3"], model_type="gpt_oss",
              num_hidden_layers=1, num_local_experts=16, experts_per_token=4,
              intermediate_size=I_, rope_theta=150000.0, draft_vocab_size=40)
    _refused(tmp_path, hf, _e3_tensors(), "GptOssForCausalLMEagle3.*MoE draft layer")


def test_eagle3_gpt_oss_dense_without_rope(tmp_path):
    """SpecForge gpt-oss-20B-eagle3-dense: model_type gpt_oss and no rope keys -> transformers
    v5's GptOssConfig RoPE (theta 150000, YaRN x32), as vLLM 0.34, with a warning; refused
    by name where specjax has no YaRN."""
    from specjax.models import hf_config

    hf = dict(GEO, **{**SPECFORGE, "model_type": "gpt_oss"})
    hf.pop("rope_theta")
    if getattr(hf_config, "GPT_OSS_ROPE", None) is None or "yarn" not in ROPE_TYPES:
        _refused(tmp_path, hf, _e3_tensors(), "model_type='gpt_oss' without rope_theta")
        return
    t = canonical("eagle3", num_hidden_layers=1, draft_vocab_size=40, has_d2t=True,
                  head_dim=16)[1]
    c = convert(write(tmp_path, hf, t, MIDLAYER), warn="aux_hidden_state_layer_ids=[1, 3, 5]",
                also="GptOssConfig defaults").config
    assert c.rope_theta == 150000.0 and c.rope_type == "yarn"
    assert c.rope_scaling_dict["factor"] == 32.0 and c.aux_layer_ids == (2, 4, 6)


def test_eagle3_nebius_gpt_oss_yarn(tmp_path):
    """nebius gpt-oss-20b head: YaRN (issue 52's RoPE part, models/rope.py). Refused by name
    while ``ROPE_TYPES`` lacks it; once there, converted with every YaRN key kept (the RoPE
    numerics are that part's tests)."""
    hf = dict(GEO, architectures=["LlamaForCausalLM"], model_type="llama", num_hidden_layers=1,
              draft_vocab_size=40, truncated_vocab_size=40, rope_theta=150000.0,
              rope_scaling={"rope_type": "yarn", "factor": 32.0,
                            "original_max_position_embeddings": 4096, "truncate": False})
    if "yarn" not in ROPE_TYPES:
        _refused(tmp_path, hf, _e3_tensors(), "rope_type.*yarn")
        return
    c = convert(write(tmp_path, hf, _e3_tensors(), MIDLAYER)).config
    assert c.rope_type == "yarn" and c.rope_theta == 150000.0 and c.draft_vocab_size == 40
    d = c.rope_scaling_dict
    assert (d["factor"], d["original_max_position_embeddings"], d["truncate"]) == (32.0, 4096, False)


def test_refused_eagle3_mla(tmp_path):
    hf = dict(GEO, architectures=["Eagle3DeepseekV2ForCausalLM"], model_type="deepseek_v3",
              num_hidden_layers=1, kv_lora_rank=16, q_lora_rank=16, draft_vocab_size=40,
              norm_before_residual=True, fc_norm=True, norm_output=True)
    _refused(tmp_path, hf, _e3_tensors(), "MLA draft layer")


def _df_tensors():
    return canonical("dflash", num_hidden_layers=1, block_size=4, mask_token_id=1, head_dim=16,
                     aux_hidden_state_layer_ids=[2, 5])[1]


def test_refused_dflash2(tmp_path):
    hf = dict(GEO, architectures=["DFlash2DraftModel"], model_type="qwen3", num_hidden_layers=1,
              head_dim=16, is_causal=False, rope_parameters={"rope_theta": 1e7},
              dflash_config={"block_size": 8, "conv_kernel_size": 4, "conv_group_size": 2,
                             "selector_rank": 8, "selector_top_k": 4, "target_layer_ids": [1, 4],
                             "mask_token_id": 1})
    _refused(tmp_path, hf, _df_tensors(), "DFlash2 head")


def test_refused_dspark(tmp_path):
    hf = dict(GEO, architectures=["Qwen3DSparkModel"], model_type="qwen3", num_hidden_layers=1,
              head_dim=16, block_size=7, mask_token_id=1, target_layer_ids=[1, 4], markov_rank=4,
              markov_head_type="low_rank", enable_confidence_head=True, projector_type="dspark")
    _refused(tmp_path, hf, _df_tensors(), "markov_head_type='low_rank' is not a DSpark head type")
    (tmp_path / "head").rename(tmp_path / "old")
    spec = dict(speculators_model_type="dspark", transformer_layer_config=dict(GEO))
    _refused(tmp_path, spec, _df_tensors(), "speculators model type 'dspark'")


def test_refused_dflash_value_scale(tmp_path):
    hf = dict(GEO, architectures=["DFlashDraftModel"], model_type="qwen3", num_hidden_layers=1,
              head_dim=16, block_size=4, layer_types=["sliding_attention"], sliding_window=2048,
              dflash_config={"mask_token_id": 1, "target_layer_ids": [1, 4], "use_swa": True,
                             "swa_window_size": 2048, "attention_value_scale": 0.707})
    _refused(tmp_path, hf, _df_tensors(), "attention_value_scale")


def _target_refused(tmp_path, arch, model_type, needle, **extra):
    hf = dict(GEO, architectures=[arch], model_type=model_type, num_hidden_layers=2, **extra)
    _refused(tmp_path, hf, {"model.embed_tokens.weight": np.zeros((V, H)),
                            "model.layers.0.input_layernorm.weight": np.ones(H)}, needle)


@pytest.mark.parametrize("arch,model_type,extra", [
    ("Ministral3ForCausalLM", "ministral3", dict(head_dim=16)),
    ("DeepseekV3ForCausalLM", "deepseek_v3", dict(num_nextn_predict_layers=1)),
    ("Gemma4AssistantForCausalLM", "gemma4_assistant", dict()),
])
def test_refused_targets_and_mtp(tmp_path, arch, model_type, extra):
    _target_refused(tmp_path, arch, model_type, f"unsupported model_type '{model_type}'", **extra)


def test_config_from_hf_reads_nested_ids_like_the_converter():
    """``config_from_hf`` on a raw SpecForge config: the same taps and one warning naming
    both lists; a top-level list wins and needs no warning."""
    hf = dict(GEO, **SPECFORGE)
    with pytest.warns(UserWarning, match=r"\[1, 3, 5\].*\[2, 4, 6\].*\(2, L//2, L-3\)"):
        c = registry.config_from_hf("eagle3", hf)
    assert c.aux_layer_ids == (2, 4, 6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        top = registry.config_from_hf("eagle3", dict(hf, eagle_aux_hidden_state_layer_ids=[3, 4, 5]))
    assert top.aux_layer_ids == (3, 4, 5)
    assert registry.config_from_hf("eagle3", registry.config_to_dict(c)) == c

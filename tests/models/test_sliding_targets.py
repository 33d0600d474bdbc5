"""Sliding-window targets (Mistral, Ministral, Gemma 3 text, the language model of a Gemma 3
ConditionalGeneration checkpoint) against their transformers fixtures
(tests/support/fixtures/MANIFEST.md): fp32 logits, aux states and greedy generation through
the paged cache (blocks of 4 tokens, windows of 8 or 12), the converter's load, and each
family as the target of EAGLE-3 and of a draft model (greedy speculative == plain greedy).
"""

from __future__ import annotations

import suite_paths  # tests/support: where the suite's pieces are
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

import specjax
from specjax.attention_metadata import CommonAttentionMetadata
from specjax.config import SpeculativeConfig
from specjax.engine import LoopOptions, SamplingParams, TargetModel, generate
from specjax.models import registry
from specjax.proposers import make_proposer

FIX = suite_paths.FIXTURES
FAMILIES = ("mistral", "ministral", "gemma3", "gemma3_cg")
KIND = {"mistral": "mistral", "ministral": "ministral", "gemma3": "gemma3", "gemma3_cg": "gemma3"}
LM = "language_model.model."     # Gemma3ForConditionalGeneration's language model
TOL = 1e-5
BS, T_PAD = 4, 32
TABLE = np.array([[7, 2, 9, 4, 11, 5, 3, 8]], np.int32)     # 32-token context, scattered blocks
NUM_BLOCKS = 12
# prefill, one decode row, a chunk, one row, the rest: windows cross block boundaries
CHUNKS = ((0, 7), (7, 8), (8, 13), (13, 14), (14, 20))

pytestmark = pytest.mark.skipif(not all((FIX / f / "reference.npz").exists() for f in FAMILIES),
                                reason="fixtures not generated")


def relerr(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))


#: Fixture name -> a NumPy rewrite of its tensors into the canonical form (another test
#: module's, e.g. stacking per-expert tensors), applied by :func:`load`.
PREPARE: dict = {}


@functools.lru_cache(maxsize=None)
def load(name: str):
    """(config, params, reference arrays) of a fixture, read without the converters."""
    d = FIX / name
    hf = json.loads((d / "config.json").read_text())
    t = load_file(str(d / "model.safetensors"))
    if name == "gemma3_cg":        # the text model only; the vision tower is not run
        t = {"model." + k[len(LM):]: v for k, v in t.items() if k.startswith(LM)}
    t = PREPARE.get(name, lambda t: t)(t)
    kind = KIND[name]
    cfg = registry.config_with_tensors(kind, registry.config_from_hf(kind, hf), t)
    params = registry.params_from_tensors(kind, cfg, t, jnp.float32)
    with np.load(d / "reference.npz") as z:
        ref = {k: z[k] for k in z.files}
    return cfg, params, ref


def meta(q: int, s: int) -> CommonAttentionMetadata:
    return CommonAttentionMetadata.from_query_lens([q], [s], TABLE, block_size=BS, num_reqs_pad=2,
                                                   num_tokens_pad=T_PAD, max_query_len=T_PAD)


def pad(x) -> jax.Array:
    out = np.zeros((T_PAD,), np.int32)
    out[: len(x)] = x
    return jnp.asarray(out)


@functools.lru_cache(maxsize=None)
def step_fn(model):
    def step(params, ids, pos, caches, md):
        hidden, aux, caches = model.forward(params, ids, pos, caches, md)
        return model.compute_logits(params, hidden), hidden, aux, caches
    return jax.jit(step)


def run_chunks(model, params, ids, chunks=CHUNKS):
    """Rows of ``ids`` (positions 0..T-1) through the paged cache in ``chunks``;
    returns (logits, hidden, aux) of every row."""
    step = step_fn(model)
    caches = model.init_kv_caches(NUM_BLOCKS, BS, jnp.float32)
    outs = []
    for lo, hi in chunks:
        logits, hidden, aux, caches = step(params, pad(ids[lo:hi]), pad(np.arange(lo, hi)),
                                           caches, meta(hi - lo, hi))
        n = hi - lo
        outs.append((logits[:n], hidden[:n], None if aux is None else aux[:n]))
    cat = lambda i: np.concatenate([np.asarray(o[i]) for o in outs])  # noqa: E731
    return cat(0), cat(1), (cat(2) if outs[0][2] is not None else None)


@pytest.mark.parametrize("name", FAMILIES)
def test_logits_hidden_and_aux_match_transformers(name):
    cfg, params, ref = load(name)
    n_layers = cfg.num_hidden_layers
    model = registry.make_model(cfg.kind, cfg, aux_layer_ids=tuple(range(n_layers)))
    logits, hidden, aux = run_chunks(model, params, ref["input_ids"])
    assert relerr(logits, ref["logits"]) < TOL
    assert relerr(hidden, ref["final_hidden"]) < TOL
    for k in range(n_layers):      # aux state k: the input of layer k = HF hidden_states[k]
        assert relerr(aux[:, k], ref["hidden_states"][k]) < TOL, f"aux layer {k}"


@pytest.mark.parametrize("name", FAMILIES)
def test_window_binds(name):
    """A window longer than the sequence changes the logits past the window: the fixture
    tests the window."""
    cfg, params, ref = load(name)
    full = cfg.replace(sliding_window=1 << 20)
    logits, _, _ = run_chunks(registry.make_model(cfg.kind, full), params, ref["input_ids"])
    assert relerr(logits[:8], ref["logits"][:8]) < TOL
    assert relerr(logits[8:], ref["logits"][8:]) > 1e-3


def greedy_paged(model, params, prompt, n):
    """Prefill ``prompt``, then ``n`` single-row greedy decode steps."""
    step = step_fn(model)
    caches = model.init_kv_caches(NUM_BLOCKS, BS, jnp.float32)
    p = len(prompt)
    logits, _, _, caches = step(params, pad(prompt), pad(np.arange(p)), caches, meta(p, p))
    out = [int(jnp.argmax(logits[p - 1]))]
    while len(out) < n:
        s = p + len(out)
        logits, _, _, caches = step(params, pad([out[-1]]), pad([s - 1]), caches, meta(1, s))
        out.append(int(jnp.argmax(logits[0])))
    return out


@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_matches_transformers_generate(name):
    cfg, params, ref = load(name)
    want = ref["gen_tokens"].tolist()
    model = registry.make_model(cfg.kind, cfg)
    assert greedy_paged(model, params, ref["gen_prompt"], len(want)) == want


@pytest.mark.parametrize("name", FAMILIES)
def test_converter_load_gives_the_same_logits(name):
    cfg, params, ref = load(name)
    pre = specjax.load_pretrained(FIX / name, "float32")
    assert pre.kind == cfg.kind and pre.config == cfg
    logits, _, _ = run_chunks(pre.model, pre.params, ref["input_ids"])
    assert relerr(logits, ref["logits"]) < TOL


# --- as the target of speculative decoding --------------------------------------------

MML = 32
LOOP = LoopOptions(batch_buckets=(2,), query_buckets=(16,), context_buckets=(MML // BS,),
                   token_buckets=(32,))
FIXED = dict(max_model_len=MML, block_size=BS, num_blocks=1 + 2 * (MML // BS), options=LOOP)


def target(name: str) -> TargetModel:
    cfg, params, _ = load(name)
    return TargetModel(registry.make_model(cfg.kind, cfg), params)


def prompts(name: str):
    ref = load(name)[2]
    return [ref["gen_prompt"].tolist(), ref["input_ids"][3:13].tolist()]


@functools.lru_cache(maxsize=None)
def plain(name: str):
    return generate(target(name), None, prompts(name), SamplingParams(max_tokens=12), **FIXED)


def proposer(name: str, method: str, k: int):
    tgt = target(name)
    cfg = tgt.model.config
    common = dict(target=tgt.model, target_params=tgt.params, max_model_len=MML, block_size=BS,
                  kernel_backend="xla")
    if method == "draft_model":
        sc = SpeculativeConfig(method=method, num_speculative_tokens=k, model="target-copy")
        return make_proposer(sc, draft=tgt.model, draft_params=tgt.params, **common)
    h = cfg.hidden_size
    hf = dict(hidden_size=h, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
              vocab_size=cfg.vocab_size, num_hidden_layers=1, draft_vocab_size=cfg.vocab_size,
              target_hidden_size=h, eagle_aux_hidden_state_layer_ids=[0, 1, 2])
    dcfg = registry.config_from_hf("eagle3", hf)
    sc = SpeculativeConfig(method="eagle3", num_speculative_tokens=k)
    return make_proposer(sc, draft=dcfg, draft_params=registry.init_params("eagle3", dcfg, 1),
                         **common)


@pytest.mark.parametrize("name", FAMILIES)
def test_plain_engine_greedy_matches_transformers(name):
    want = load(name)[2]["gen_tokens"].tolist()
    assert plain(name).outputs[0].token_ids[:len(want)] == want


@pytest.mark.parametrize("method", ("draft_model", "eagle3"))
@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_speculative_equals_plain(name, method):
    k = 3
    out = generate(target(name), proposer(name, method, k), prompts(name),
                   SamplingParams(max_tokens=12), **FIXED)
    assert out.token_ids == plain(name).token_ids
    s = out.spec_stats
    if method == "draft_model":            # the draft is the target: every draft accepted
        assert s.num_draft_tokens > 0 and s.num_accepted_tokens == s.num_draft_tokens
        assert s.num_accepted_tokens_per_pos[0] == s.num_drafts


# --- Gemma 3 config reading -----------------------------------------------------------

GEMMA = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8)


def test_gemma3_config_pattern_rope_parameters_and_round_trip():
    c = registry.config_from_hf("gemma3", dict(GEMMA, sliding_window_pattern=2))
    assert c.layer_types == ("sliding_attention", "full_attention") * 2
    assert (c.rope_theta, c.rope_local_base_freq, c.query_pre_attn_scalar) == (1e6, 1e4, 256)
    assert c.tie_word_embeddings and c.qk_norm and c.final_logit_softcapping == 0
    v5 = registry.config_from_hf("gemma3", {
        "model_type": "gemma3", "text_config": dict(GEMMA, layer_types=list(c.layer_types),
                                                    rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}})})
    assert v5 == c.replace(rope_scaling=(("factor", 8.0), ("rope_type", "linear")))
    for cfg in (c, v5, v5.replace(final_logit_softcapping=30.0, sliding_window=0,
                                  layer_types=None)):
        assert registry.config_from_hf("gemma3", registry.config_to_dict(cfg)) == cfg


@pytest.mark.parametrize("key, value", [("attn_logit_softcapping", 50.0),
                                        ("hidden_activation", "silu"),
                                        ("use_bidirectional_attention", True)])
def test_gemma3_config_refusals_name_the_key(key, value):
    with pytest.raises(ValueError, match=key if key != "hidden_activation" else "hidden_act"):
        registry.config_from_hf("gemma3", dict(GEMMA, **{key: value}))


def test_gemma3_tensor_parallel_rules_replicate_the_sandwich_norms():
    from jax.sharding import PartitionSpec as P

    from specjax.sharding import param_specs

    cfg = registry.config_from_hf("gemma3", dict(GEMMA, vocab_size=60))
    specs = param_specs(registry.abstract_params("gemma3", cfg), cfg, 2)
    layer = specs["layers"][0]
    for n in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
              "post_feedforward_layernorm"):
        assert layer[n]["weight"] == P(), n
    assert layer["self_attn"]["q_norm"]["weight"] == P()


def test_eagle3_head_windows_come_from_layer_types_only():
    """vLLM ``llama.py``: an EAGLE-3 head layer ``j`` slides iff ``layer_types[j]`` does
    (a target-length list is cut to the head's layers); a bare ``sliding_window`` is
    ignored; the window reaches the head's attention."""
    base = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                draft_vocab_size=64)
    cfg = registry.config_from_hf
    bare = cfg("eagle3", dict(base, sliding_window=8))
    assert bare.sliding_window == 0 and bare.layer_window(1) is None
    c = cfg("eagle3", dict(base, sliding_window=8,
                           layer_types=["full_attention", "sliding_attention", "full_attention"]))
    assert (c.layer_window(0), c.layer_window(1)) == (None, 8)
    assert cfg("eagle3", registry.config_to_dict(c)) == c
    with pytest.raises(ValueError, match="sliding_window"):
        cfg("eagle3", dict(base, layer_types=["sliding_attention"] * 2))
    with pytest.raises(ValueError, match="layer_types"):
        cfg("eagle3", dict(base, sliding_window=8, layer_types=["sliding_attention"]))
    from flax import nnx
    from specjax.models.eagle3 import Eagle3Body
    body = Eagle3Body(c, rngs=nnx.Rngs(0))
    assert body.layers[1].self_attn.window == 8 and body.layers[0].self_attn.window is None

"""The sparse MoE block against a NumPy loop oracle, and the Qwen3-MoE target against its
transformers fixture (tests/support/fixtures/MANIFEST.md): fp32 logits through the paged
cache, greedy generation, and as the target of EAGLE-3 and of a draft model (greedy
speculative == plain greedy).
"""

from __future__ import annotations

import suite_paths  # tests/support: where the suite's pieces are
import functools
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

import specjax
import test_sliding_targets as st
from specjax.engine import SamplingParams, generate
from specjax.models import params as mp, registry
from specjax.models.moe import SparseMoeBlock, grouped_experts

NAME = "qwen3_moe"
HF = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
          num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
          num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
          mlp_only_layers=[1])

needs_fixture = pytest.mark.skipif(not (st.FIX / NAME / "reference.npz").exists(),
                                   reason="fixtures not generated")


def oracle(x, router, experts, k, norm):
    """Per token, per selected expert: ``sum_j w_j * down(silu(gate x) * up x)``."""
    out = np.zeros_like(x, np.float64)
    for t in range(x.shape[0]):
        z = x[t] @ router
        p = np.exp(z - z.max())
        p /= p.sum()
        sel = np.argsort(-p)[:k]
        w = p[sel] / p[sel].sum() if norm else p[sel]
        for wj, e in zip(w, sel):
            g, u, d = experts[e]
            a = x[t] @ g
            out[t] += wj * ((a / (1 + np.exp(-a)) * (x[t] @ u)) @ d)
    return out


def random_block(h, i, e, seed=0):
    rng = np.random.default_rng(seed)
    ex = [tuple(rng.standard_normal(s) / 3 for s in ((h, i), (h, i), (i, h))) for _ in range(e)]
    gate_up = np.stack([np.stack([g, u], -1).reshape(h, 2 * i) for g, u, _ in ex])  # interleaved
    params = {"gate": {"kernel": rng.standard_normal((h, e)) / 3},
              "experts": {"gate_up": gate_up, "down": np.stack([d for *_, d in ex])}}
    return jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), params), ex


@pytest.mark.parametrize("norm", (True, False))
def test_block_matches_loop_oracle(norm):
    h, i, e, k, t = 16, 8, 6, 2, 11
    params, ex = random_block(h, i, e)
    x = np.random.default_rng(1).standard_normal((t, h)).astype(np.float32)
    want = oracle(x.astype(np.float64), np.asarray(params["gate"]["kernel"], np.float64), ex,
                  k, norm)
    got = jax.jit(lambda p, x: mp.merge(SparseMoeBlock, (h, i, e, k, norm), p)(x))(params, x)
    assert st.relerr(got, want) < 1e-5


def test_grouped_experts_biases_and_foreign_ids():
    """Biases per routed expert; ids outside ``[0, E)`` (another shard's experts) add 0."""
    h, i, e, t = 8, 4, 5, 7
    params, ex = random_block(h, i, e, seed=2)
    rng = np.random.default_rng(3)
    bgu, bd = rng.standard_normal((e, 2 * i)), rng.standard_normal((e, h))
    x = rng.standard_normal((t, h))
    ids = rng.integers(-3, e + 3, (t, 3))
    w = rng.random((t, 3))
    want = np.zeros((t, h))
    for r in range(t):
        for j in range(3):
            q = ids[r, j]
            if 0 <= q < e:
                g, u, d = ex[q]
                a, b = x[r] @ g + bgu[q, 0::2], x[r] @ u + bgu[q, 1::2]
                want[r] += w[r, j] * ((a / (1 + np.exp(-a)) * b) @ d + bd[q])
    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    got = grouped_experts(f32(x), f32(w), jnp.asarray(ids, jnp.int32),
                          params["experts"]["gate_up"], params["experts"]["down"],
                          gate_up_bias=f32(bgu), down_bias=f32(bd))
    assert st.relerr(got, want) < 1e-5


def test_config_round_trip_rule_and_refusals():
    c = registry.config_from_hf(NAME, dict(HF, router_aux_loss_coef=0.01))
    assert [c.layer_sparse(i) for i in range(3)] == [True, False, True]
    assert c.qk_norm and registry.config_from_hf(NAME, registry.config_to_dict(c)) == c
    step2 = registry.config_from_hf(NAME, dict(HF, mlp_only_layers=[], decoder_sparse_step=2))
    assert [step2.layer_sparse(i) for i in range(3)] == [False, True, False]
    keys = registry.expected_tensors(NAME, c)
    assert keys["model.layers.0.mlp.experts.down_proj"][0] == (8, 64, 32)
    assert keys["model.layers.0.mlp.experts.gate_up_proj"][0] == (8, 64, 64)
    assert "model.layers.1.mlp.gate_proj.weight" in keys and "model.layers.0.mlp.gate_proj.weight" not in keys
    for key, value in (("shared_expert_intermediate_size", 64), ("n_shared_experts", 1),
                       ("scoring_func", "sigmoid")):
        with pytest.raises(ValueError, match=key):
            registry.config_from_hf(NAME, dict(HF, **{key: value}))


def stacked(t: dict) -> dict:
    """The Hub's per-expert tensors stacked to the canonical ``gate_up_proj`` / ``down_proj``
    with NumPy (independent of the converter)."""
    out = {k: v for k, v in t.items() if ".mlp.experts." not in k}
    for i in (0, 2):
        pre = f"model.layers.{i}.mlp.experts."
        ex = {n: np.stack([t[f"{pre}{e}.{n}.weight"] for e in range(8)])
              for n in ("gate_proj", "up_proj", "down_proj")}
        out[pre + "gate_up_proj"] = np.concatenate([ex["gate_proj"], ex["up_proj"]], 1)
        out[pre + "down_proj"] = ex["down_proj"]
    return out


@functools.lru_cache(maxsize=None)
def load():
    """(config, params, reference) of the fixture through test_sliding_targets' reader (its
    helpers key kinds by name), the experts stacked by :func:`stacked`."""
    st.KIND.setdefault(NAME, NAME)
    st.PREPARE.setdefault(NAME, stacked)
    return st.load(NAME)


@needs_fixture
def test_logits_hidden_and_aux_match_transformers():
    cfg, params, ref = load()
    model = registry.make_model(NAME, cfg, aux_layer_ids=(0, 1, 2))
    logits, hidden, aux = st.run_chunks(model, params, ref["input_ids"])
    assert st.relerr(logits, ref["logits"]) < st.TOL
    assert st.relerr(hidden, ref["final_hidden"]) < st.TOL
    for k in range(3):
        assert st.relerr(aux[:, k], ref["hidden_states"][k]) < st.TOL, f"aux layer {k}"


@needs_fixture
def test_converter_load_gives_the_same_logits():
    cfg, _, ref = load()
    pre = specjax.load_pretrained(st.FIX / NAME, "float32")
    assert pre.kind == NAME and pre.config == cfg
    logits, _, _ = st.run_chunks(pre.model, pre.params, ref["input_ids"])
    assert st.relerr(logits, ref["logits"]) < st.TOL


@needs_fixture
def test_transformers5_stacked_experts_load_like_the_hub_layout(tmp_path):
    """``mlp.experts.gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]`` (what transformers
    5 holds) load to the same params as the Hub's per-expert keys, and export writes the
    Hub's keys back."""
    t = load_file(str(st.FIX / NAME / "model.safetensors"))
    save_file(stacked(t), str(tmp_path / "model.safetensors"))
    shutil.copy(st.FIX / NAME / "config.json", tmp_path / "config.json")
    got = specjax.load_pretrained(tmp_path, "float32")
    want = load()[1]
    assert jax.tree.structure(got.params) == jax.tree.structure(want)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(got.params),
                                                      jax.tree.leaves(want)))
    from specjax.converters.export import export_checkpoint
    out = export_checkpoint(NAME, got.config, got.params, tmp_path / "out", format=NAME,
                            dtype="fp32")
    back = load_file(str(out / "model.safetensors"))
    assert set(back) == set(t) and all(np.array_equal(back[k], t[k]) for k in t)


@needs_fixture
def test_greedy_matches_transformers_generate():
    cfg, params, ref = load()
    want = ref["gen_tokens"].tolist()
    assert st.greedy_paged(registry.make_model(NAME, cfg), params, ref["gen_prompt"],
                           len(want)) == want


@needs_fixture
def test_plain_engine_greedy_matches_transformers():
    load()
    want = load()[2]["gen_tokens"].tolist()
    assert st.plain(NAME).outputs[0].token_ids[:len(want)] == want


@needs_fixture
@pytest.mark.parametrize("method", ("draft_model", "eagle3"))
def test_greedy_speculative_equals_plain(method):
    load()
    out = generate(st.target(NAME), st.proposer(NAME, method, 3), st.prompts(NAME),
                   SamplingParams(max_tokens=12), **st.FIXED)
    assert out.token_ids == st.plain(NAME).token_ids
    s = out.spec_stats
    if method == "draft_model":            # the draft is the target: every draft accepted
        assert s.num_draft_tokens > 0 and s.num_accepted_tokens == s.num_draft_tokens
        assert s.num_accepted_tokens_per_pos[0] == s.num_drafts


@needs_fixture
def test_cli_generate_plain_and_self_drafted(tmp_path, capsys):
    """``specjax generate`` on the Qwen3-MoE checkpoint with a word-level tokenizer: the
    text equals a naive greedy loop over ``specjax.hf.score``; drafting for itself accepts
    every draft (acceptance length k + 1)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from specjax.cli.main import main
    from specjax.hf import encode_prompt, load_model, load_tokenizer, score

    d = tmp_path / "moe"
    d.mkdir()
    for f in ("config.json", "model.safetensors"):
        shutil.copy(st.FIX / NAME / f, d / f)
    words = "[UNK] [BOS] [EOS] the cat sat on a mat dog ran one two three".split()
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "[BOS]",
         "eos_token": "[EOS]", "unk_token": "[UNK]"}))
    prompt, n = "the cat sat on", 8
    tok = load_tokenizer(d)
    model, _, _, params = load_model(d)
    seq, want = encode_prompt(tok, prompt), []
    for _ in range(n):
        want.append(int(np.argmax(score(model, params, seq)[-1])))
        seq.append(want[-1])
    text = tok.decode(want, skip_special_tokens=True)
    for spec in (None, json.dumps({"model": str(d), "num_speculative_tokens": 2})):
        out = tmp_path / "out.json"
        argv = ["generate", "--target", str(d), "--prompt", prompt, "--max-tokens", str(n),
                "--device", "cpu", "--ignore-eos", "--dtype", "fp32", "--json", str(out)]
        assert main(argv + (["--speculative-config", spec] if spec else [])) == 0
        lines = capsys.readouterr().out.splitlines()
        assert json.loads(out.read_text())[0]["token_ids"] == want, spec
        assert lines[0] == text, spec
        if spec:
            assert "method: draft_model" in lines[1] and "mean acceptance length: 3.00" in lines[1]


def any_proposer(method: str, k: int):
    """Every other proposer over the fixture target, random heads (greedy output must not
    depend on them): n-gram, suffix, EAGLE-1, EAGLE-3 tree, DFlash, Medusa, MTP."""
    from specjax import make_proposer

    tgt = st.target(NAME)
    c = tgt.model.config
    common = dict(max_model_len=st.MML, block_size=st.BS)
    if method in ("ngram", "suffix"):
        extra = {"prompt_lookup_min": 1, "prompt_lookup_max": 3} if method == "ngram" else {}
        return make_proposer({"method": method, "num_speculative_tokens": k, **extra}, **common)
    g = dict(hidden_size=c.hidden_size, intermediate_size=64, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=c.vocab_size, num_hidden_layers=1)
    kind, spec = method.split("-")[0], {"method": method.split("-")[0],
                                        "num_speculative_tokens": k}
    hf = {"eagle": dict(g, bias=True),
          "eagle3": dict(g, target_hidden_size=c.hidden_size,
                         eagle_aux_hidden_state_layer_ids=[0, 1, 2]),
          "dflash": dict(g, target_hidden_size=c.hidden_size, aux_hidden_state_layer_ids=[0, 2],
                         mask_token_id=0, block_size=k + 1),
          "medusa": dict(num_heads=k, num_hidden_layers=1, hidden_size=c.hidden_size,
                         vocab_size=c.vocab_size),
          "mtp": dict(g, num_nextn_predict_layers=1)}[kind]
    if method == "eagle3-tree":
        tree = [(0,), (1,), (0, 0), (1, 0), (0, 0, 0), (1, 0, 0)]
        spec.update(num_speculative_tokens=len(tree), speculative_token_tree=str(tree))
    dcfg = registry.config_from_hf(kind, hf)
    return make_proposer(spec, target=tgt.model, target_params=tgt.params, draft=dcfg,
                         draft_params=registry.init_params(kind, dcfg, 1), kernel_backend="xla",
                         **common)


@needs_fixture
@pytest.mark.parametrize("method", ("ngram", "suffix", "eagle", "eagle3-tree", "dflash",
                                    "medusa", "mtp"))
def test_every_proposer_over_the_moe_target_is_lossless(method):
    load()
    out = generate(st.target(NAME), any_proposer(method, 3), st.prompts(NAME),
                   SamplingParams(max_tokens=12), **st.FIXED)
    assert out.token_ids == st.plain(NAME).token_ids
    assert out.spec_stats.num_draft_tokens > 0

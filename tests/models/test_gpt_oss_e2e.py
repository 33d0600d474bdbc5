"""A published head end to end on the tiny gpt-oss target (issue 54, item 4): the RedHatAI
gpt-oss-20b EAGLE-3 speculators config (``Eagle3DraftModel``, top-level input-of-layer aux
ids, ``norm_before_fc``, a 32000-style reduced draft vocabulary, shrunk here) with random
weights converts with ``specjax.load_pretrained`` and drafts for the gpt-oss fixture target:
greedy speculative output equals plain greedy, and the drafts are verified."""

from __future__ import annotations

import suite_paths  # tests/support: where the suite's pieces are  # noqa: F401
import json

import numpy as np
import pytest
from safetensors.numpy import save_file

import specjax
import test_sliding_targets as st
from specjax.engine import SamplingParams, generate
from specjax.models import registry

NAME = "gpt_oss"
DRAFT_VOCAB = 48

needs_fixture = pytest.mark.skipif(not (st.FIX / NAME / "reference.npz").exists(),
                                   reason="fixtures not generated")


def write_head(d, target_cfg):
    """The speculators layout of the RedHatAI head, geometry of the tiny target."""
    h = target_cfg.hidden_size
    tlc = dict(model_type="llama", hidden_size=h, intermediate_size=2 * h, num_hidden_layers=1,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16,
               vocab_size=target_cfg.vocab_size, rms_norm_eps=1e-5, rope_theta=150000.0,
               max_position_embeddings=4096)
    hf = dict(architectures=["Eagle3DraftModel"], speculators_model_type="eagle3",
              speculators_config={"algorithm": "eagle3", "default_proposal_method": "greedy",
                                  "proposal_methods": [{"proposal_type": "greedy",
                                                        "speculative_tokens": 3}],
                                  "verifier": {"name_or_path": "openai/gpt-oss-20b",
                                               "architectures": ["GptOssForCausalLM"]}},
              transformer_layer_config=tlc, eagle_aux_hidden_state_layer_ids=[1, 2, 3],
              norm_before_fc=True, draft_vocab_size=DRAFT_VOCAB, target_hidden_size=h)
    cfg = registry.config_from_hf("eagle3", dict(
        {k: v for k, v in tlc.items() if k != "model_type"}, draft_vocab_size=DRAFT_VOCAB,
        has_d2t=True, target_hidden_size=h, norm_before_fc=True,
        eagle_aux_hidden_state_layer_ids=[1, 2, 3]))
    t = registry.random_tensors("eagle3", cfg, seed=7)
    t = {k: np.asarray(v, np.int64 if k == "d2t" else np.float32) for k, v in t.items()}
    t2d = np.zeros(target_cfg.vocab_size, bool)
    t2d[np.arange(DRAFT_VOCAB) + t["d2t"]] = True
    d.mkdir()
    (d / "config.json").write_text(json.dumps(hf))
    save_file(dict(t, t2d=t2d), str(d / "model.safetensors"))
    return d


@needs_fixture
def test_gpt_oss_20b_speculators_head_drafts_for_the_gpt_oss_target(tmp_path):
    st.KIND.setdefault(NAME, NAME)
    target = specjax.load_pretrained(st.FIX / NAME, "float32")
    assert target.kind == NAME
    head = specjax.load_pretrained(write_head(tmp_path / "head", target.config), "float32")
    assert head.kind == "eagle3" and head.config.norm_before_fc
    assert head.config.aux_layer_ids == (1, 2, 3)
    prop = specjax.make_proposer({"method": "eagle3", "num_speculative_tokens": 3},
                                 target=target.model, target_params=target.params,
                                 draft=head, max_model_len=st.MML, block_size=st.BS,
                                 kernel_backend="xla")
    tgt = specjax.TargetModel(target.model, target.params)
    out = generate(tgt, prop, st.prompts(NAME), SamplingParams(max_tokens=12), **st.FIXED)
    plain = generate(tgt, None, st.prompts(NAME), SamplingParams(max_tokens=12), **st.FIXED)
    assert out.token_ids == plain.token_ids
    assert out.spec_stats.num_draft_tokens > 0


#: A harmony-format chat template (gpt-oss's message framing, written for this test): a
#: system turn dated with transformers' ``strftime_now``, each message framed as
#: ``<|start|>{role}<|message|>{content}<|end|>``, the generation prompt ``<|start|>assistant``.
HARMONY = ("<|start|>system<|message|>Knowledge cutoff: 2024-06 Current date: "
           "{{ strftime_now('%Y-%m-%d') }}<|end|>"
           "{%- for m in messages %}<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}<|end|>"
           "{%- endfor %}{%- if add_generation_prompt %}<|start|>assistant{%- endif %}")
SPECIAL = ["<|start|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>"]


@needs_fixture
def test_cli_generate_with_a_harmony_chat_template(tmp_path, capsys):
    """``specjax generate`` on the gpt-oss checkpoint directory (an original HF one) with a
    harmony-framed tokenizer and ``<|return|>`` / ``<|call|>`` as end-of-sequence ids:
    the prompt goes through the template, output equals a greedy loop over
    ``specjax.hf.score`` up to the first stop id, self-drafting accepts every draft."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from specjax.cli.main import main
    from specjax.hf import encode_prompt, load_model, load_tokenizer, score

    d = tmp_path / "gpt-oss"
    d.mkdir()
    for f in ("config.json", "model.safetensors"):
        (d / f).write_bytes((st.FIX / NAME / f).read_bytes())
    words = ["[UNK]"] + SPECIAL + ("system user assistant Knowledge cutoff: 2024-06 Current "
                                   "date: the cat sat on a mat").split()
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Split(r"<\|[a-z]+\|>|\s+", "isolated")
    tk.add_special_tokens(SPECIAL)
    tk.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|return|>",
         "unk_token": "[UNK]", "chat_template": HARMONY}))
    stop = [words.index("<|return|>"), words.index("<|call|>")]
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": stop}))
    tok = load_tokenizer(d)
    ids = encode_prompt(tok, "the cat sat")
    assert ids[:3] == [words.index("<|start|>"), words.index("system"), words.index("<|message|>")]
    assert ids[-2:] == [words.index("<|start|>"), words.index("assistant")]
    model, _, _, params = load_model(d)
    seq, want = list(ids), []
    while len(want) < 10:
        want.append(int(np.argmax(score(model, params, seq)[-1])))
        seq.append(want[-1])
        if want[-1] in stop:
            break
    for spec in (None, json.dumps({"model": str(d), "num_speculative_tokens": 2})):
        out = tmp_path / "out.json"
        argv = ["generate", "--target", str(d), "--prompt", "the cat sat", "--max-tokens", "10",
                "--device", "cpu", "--dtype", "fp32", "--json", str(out)]
        assert main(argv + (["--speculative-config", spec] if spec else [])) == 0
        lines = capsys.readouterr().out.splitlines()
        assert json.loads(out.read_text())[0]["token_ids"] == want, spec
        if spec:
            assert "method: draft_model" in lines[-1] and "mean acceptance length: 3.00" in lines[-1]

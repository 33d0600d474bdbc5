"""Real checkpoints end to end, torch-free: a tiny HF Llama checkpoint (safetensors written
with NumPy) and a tokenizer.json written by the ``tokenizers`` library inside the test,
loaded through ``transformers.AutoTokenizer``; ``specjax generate`` prints the decoding of
plain greedy decoding's tokens (a naive loop over :func:`specjax.hf.score`), with and
without a speculative_config."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("transformers")

WORDS = ("the cat dog sat on a mat and ran to it is big small red blue one two three four "
         "five six seven eight nine ten").split()
MAXTOK = 10


def _tokenizer(d, chat: bool):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(["[UNK]", "[BOS]", "[EOS]"] + WORDS)}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.save(str(d / "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "[BOS]",
           "eos_token": "[EOS]", "unk_token": "[UNK]"}
    if chat:
        cfg["chat_template"] = ("{% for m in messages %}[BOS] {{ m['content'] }} the{% endfor %}"
                                "{% if add_generation_prompt %} cat{% endif %}")
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return vocab


def make_checkpoint(d, *, chat: bool = False, seed: int = 0):
    from safetensors.numpy import save_file

    from specjax.models import config_from_hf, registry

    d.mkdir(parents=True, exist_ok=True)
    hf = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=48,
              hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5,
              rope_theta=10000.0, tie_word_embeddings=False, hidden_act="silu")
    (d / "config.json").write_text(json.dumps(hf))
    cfg = config_from_hf("llama", hf)
    tensors = registry.random_tensors("llama", cfg, seed=seed)
    tensors = {k: 3 * v if k == "lm_head.weight" else v for k, v in tensors.items()}
    save_file(tensors, str(d / "model.safetensors"))
    vocab = _tokenizer(d, chat)
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [vocab["[EOS]"]],
                                                          "bos_token_id": vocab["[BOS]"]}))
    return vocab


def naive_greedy(d, ids, max_tokens, stop):
    from specjax.hf import load_model, score

    model, _, _, params = load_model(d)
    seq, out = list(ids), []
    while len(out) < max_tokens:
        tok = int(np.argmax(score(model, params, seq)[-1]))
        out.append(tok)
        seq.append(tok)
        if tok in stop:
            break
    return out


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf") / "tiny-llama"
    make_checkpoint(d)
    return d


def _cli(capsys, *argv):
    from specjax.cli import main

    rc = main(["generate", "--max-tokens", str(MAXTOK), "--device", "cpu", *argv])
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    return cap.out.splitlines()


@pytest.mark.smoke
def test_generation_config_and_tokenizer(ckpt):
    from specjax.hf import encode_prompt, load_generation_config, load_tokenizer

    g = load_generation_config(ckpt)
    assert g["eos_token_ids"] == [2] and g["bos_token_id"] == 1
    tok = load_tokenizer(ckpt)
    assert encode_prompt(tok, "the cat sat") == [3, 4, 6]
    with pytest.raises(FileNotFoundError):
        load_tokenizer(ckpt / "nope")


@pytest.mark.parametrize("spec", [None, '{"method": "ngram", "num_speculative_tokens": 3, '
                                        '"prompt_lookup_min": 1}', "DRAFT"])
def test_cli_text_equals_plain_greedy(ckpt, capsys, spec):
    from specjax.hf import encode_prompt, load_tokenizer

    prompts = ["the cat sat on", "one two three"]
    tok = load_tokenizer(ckpt)
    want = [tok.decode(naive_greedy(ckpt, encode_prompt(tok, p), MAXTOK, {2}),
                       skip_special_tokens=True) for p in prompts]
    argv = ["--target", str(ckpt)] + [a for p in prompts for a in ("--prompt", p)]
    if spec == "DRAFT":   # the checkpoint drafting for itself: method detected (draft_model)
        spec = json.dumps({"model": str(ckpt), "num_speculative_tokens": 2})
    if spec is not None:
        argv += ["--speculative-config", spec]
    lines = _cli(capsys, *argv)
    assert lines[:2] == want
    assert lines[2].startswith("method: " + ("plain" if spec is None else
                                             "ngram" if "ngram" in spec else "draft_model"))
    assert "tokens/s:" in lines[2]
    if spec is not None and "model" in spec:
        assert "mean acceptance length: 3.00" in lines[2]      # a draft equal to its target


def test_cli_chat_template(tmp_path, capsys):
    from specjax.hf import encode_prompt, load_tokenizer

    d = tmp_path / "chat"
    make_checkpoint(d, chat=True, seed=1)
    tok = load_tokenizer(d)
    ids = encode_prompt(tok, "red dog")
    assert ids == [1, 17, 5, 3, 4]            # [BOS] red dog the cat
    assert encode_prompt(tok, "red dog", chat=False) == [17, 5]
    want = tok.decode(naive_greedy(d, ids, MAXTOK, {2}), skip_special_tokens=True)
    assert _cli(capsys, "--target", str(d), "--prompt", "red dog")[0] == want


def test_cli_errors(ckpt, tmp_path, capsys):
    from specjax.cli import main

    for argv, msg in ((["--target", str(tmp_path / "none"), "--prompt", "x"], "does not exist"),
                      (["--target", str(ckpt)], "--prompt"),
                      (["--target", str(ckpt), "--prompt", "x", "--speculative-config", "{"],
                       "not valid JSON"),
                      (["--target", str(ckpt), "--prompt", "x", "--speculative-config",
                        '{"method": "eagle3", "num_speculative_tokens": 3, "quantization": "fp8"}'],
                       "quantization")):
        assert main(["generate", "--device", "cpu", *argv]) == 2
        assert msg in capsys.readouterr().err


def test_version_and_python_m():
    import specjax

    r = subprocess.run([sys.executable, "-m", "specjax", "--version"], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == f"specjax {specjax.__version__}"


def _demo(*argv):
    from specjax.cli import main

    return main(["demo", "--device", "cpu", "--repeat", "1", *argv])


def test_demo_on_own_checkpoints(ckpt, tmp_path, capsys):
    """``specjax demo --target --draft --prompts``: the table on the user's checkpoint and
    prompts; the checkpoint drafting for itself accepts every draft (7 tokens = the prefill's
    one + two steps of k + 1 = 3)."""
    f = tmp_path / "prompts.txt"
    f.write_text("the cat sat on\n\none two three\n")
    rc = _demo("--target", str(ckpt), "--draft", str(ckpt), "--prompts", str(f),
               "--method", "ngram", "--max-tokens", "7", "--k", "2")
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    rows = {line.split()[0]: line.split() for line in cap.out.splitlines()
            if line.split() and line.split()[0] in ("plain", "ngram", "draft_model")}
    assert set(rows) == {"plain", "ngram", "draft_model"}
    assert all(r[-1] == "OK" for r in rows.values())
    assert rows["draft_model"][1] == "(tiny-llama)" and rows["draft_model"][3] == "3.00"
    assert "target: tiny-llama (llama, 2 layers, hidden 32, vocab 48)" in cap.out
    assert "2 prompts" in cap.out
    assert "all methods reproduce plain greedy decoding: OK" in cap.out


def test_demo_bad_paths_refused_before_work(ckpt, tmp_path, capsys, monkeypatch):
    import specjax.demo
    import specjax.hf

    def no_work(*a, **k):
        raise AssertionError("loaded a model before checking the arguments")

    monkeypatch.setattr(specjax.hf, "load_model", no_work)
    monkeypatch.setattr(specjax.demo, "demo_target", no_work)
    f = tmp_path / "p.txt"
    f.write_text("the cat\n")
    empty = tmp_path / "empty.txt"
    empty.write_text("\n \n")
    none = str(tmp_path / "none")
    for argv, msg in ((["--target", none], "--target"),
                      (["--target", str(ckpt), "--draft", none], "--draft"),
                      (["--target", str(ckpt), "--prompts", none], "--prompts"),
                      (["--prompts", none], "--prompts"),
                      (["--prompts", str(empty)], "--prompts"),
                      (["--draft", str(ckpt)], "--draft needs --target"),
                      (["--target", str(ckpt), "--method", "eagle3", "--prompts", str(f)],
                       "--method eagle3")):
        assert _demo(*argv) == 2, argv
        err = capsys.readouterr().err
        assert msg in err and "specjax demo: error" in err, (argv, err)


def test_demo_sampled_on_own_checkpoint(ckpt, tmp_path, capsys):
    """``--temperature``: seeded sampling, no token check (the check column is '-')."""
    f = tmp_path / "prompts.txt"
    f.write_text("the cat sat on\n")
    rc = _demo("--target", str(ckpt), "--draft", str(ckpt), "--prompts", str(f), "--method",
               "ngram", "--max-tokens", "5", "--k", "2", "--temperature", "0.8")
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    rows = [line.split() for line in cap.out.splitlines()
            if line.split() and line.split()[0] in ("plain", "ngram", "draft_model")]
    assert len(rows) == 3 and all(r[-1] == "-" for r in rows)
    assert "temperature 0.8 (seeded)" in cap.out and "no token check" in cap.out

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
    from specjax.cli.main import main

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
    assert lines[:2] == want and len(lines) == 3     # without --logprobs: no other line
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
    from specjax.cli.main import main

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
    from specjax.cli.main import main

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
    from test_demo import demo_table

    rows = demo_table(cap.out)
    assert set(rows) == {"plain", "ngram", "draft_model (tiny-llama)"}
    assert all(r["check"] == "OK" for r in rows.values())
    assert rows["draft_model (tiny-llama)"]["tokens/fwd"] == "3.00"
    assert "target: tiny-llama (llama, 2 layers, hidden 32, vocab 48)" in cap.out
    assert "2 prompts" in cap.out
    assert "all methods reproduce plain greedy decoding: OK" in cap.out


def test_demo_bad_paths_refused_before_work(ckpt, tmp_path, capsys, monkeypatch):
    import specjax.cli.demo
    import specjax.hf

    def no_work(*a, **k):
        raise AssertionError("loaded a model before checking the arguments")

    monkeypatch.setattr(specjax.hf, "load_model", no_work)
    monkeypatch.setattr(specjax.cli.demo, "demo_target", no_work)
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
    from test_demo import demo_table

    rows = demo_table(cap.out)
    assert len(rows) == 3 and all(r["check"] == "-" for r in rows.values())
    assert "temperature 0.8 (seeded)" in cap.out and "no token check" in cap.out


# -- the sampling flags of ``specjax generate`` ------------------------------------------

#: every flag with a non-default value (and the SamplingParams it must give)
FLAG_ARGV = ["--max-tokens", "6", "--temperature", "0.7", "--top-k", "5", "--top-p", "0.9",
             "--min-p", "0.05", "--presence-penalty", "0.5", "--frequency-penalty", "-0.25",
             "--repetition-penalty", "1.3", "--min-tokens", "2", "--stop-token-ids", "7", "9",
             "--ignore-eos", "--allowed-token-ids", "3", "4", "5", "--logit-bias", "4=-1.5",
             "--logit-bias", '{"5": 2, "4": 0.5}', "--logprobs", "3",
             "--logprobs-mode", "processed_logits", "--bad-words", "cat", "--bad-words",
             "dog sat", "--json", "out.json"]
#: SamplingParams fields without a flag, and why
NOT_FLAGS = {"seed": "--seed seeds generate(), which draws each request's seed",
             "logits_processor": "a Python function", "logits_processor_params": "idem",
             "n": "refused", "best_of": "refused", "prompt_logprobs": "refused",
             "structured_outputs": "refused", "stop": "refused",
             "num_speculative_tokens": "--speculative-config's k serves every prompt alike"}


def _parse(*argv):
    from specjax.cli.main import build_parser

    return build_parser().parse_args(["generate", "--target", "DIR", *argv])


@pytest.mark.smoke
def test_generate_flags_reach_sampling_params():
    import dataclasses

    from specjax.cli import generate as generate_cli
    from specjax.engine import SamplingParams

    assert set(generate_cli.FLAGS) | set(NOT_FLAGS) == {
        f.name for f in dataclasses.fields(SamplingParams)}
    assert not set(generate_cli.FLAGS) & set(NOT_FLAGS)
    args = _parse(*FLAG_ARGV)
    assert args.bad_words == ["cat", "dog sat"] and args.json == "out.json"
    assert args.logprobs_mode == "processed_logits"
    sp = generate_cli.sampling_params(args, bad_words=[[4], [5, 6]])
    assert sp == SamplingParams(
        max_tokens=6, temperature=0.7, top_k=5, top_p=0.9, min_p=0.05, presence_penalty=0.5,
        frequency_penalty=-0.25, repetition_penalty=1.3, min_tokens=2, stop_token_ids=(7, 9),
        ignore_eos=True, allowed_token_ids=(3, 4, 5), logit_bias={4: 0.5, 5: 2.0},
        bad_words=((4,), (5, 6)), logprobs=3)
    assert generate_cli.sampling_params(args, stop_token_ids=(7, 9, 2)).stop_token_ids == (7, 9, 2)
    # without the flags: the SamplingParams generate always used
    plain = _parse()
    assert generate_cli.sampling_params(plain) == SamplingParams(max_tokens=64)
    assert plain.logprobs is None and plain.logprobs_mode == "raw_logprobs" and plain.json is None
    assert _parse("--logprobs", "0").logprobs == 0


def test_encode_bad_words_as_vllm(ckpt):
    """vLLM's ``update_from_tokenizer``: the word as written, plus its leading-space form
    when that is a different first token of the same length."""
    from specjax.hf import encode_bad_words, load_tokenizer

    tok = load_tokenizer(ckpt)
    assert encode_bad_words(tok, ["cat", "  dog sat"]) == [[4], [5, 6]]  # " cat" is cat again

    class Tok:
        table = {"ab": [10, 11], " ab": [12, 11], "x": [3], " x": [4, 5], "": [], " ": []}

        def encode(self, text, add_special_tokens=True):
            assert add_special_tokens is False
            return self.table[text]

    assert encode_bad_words(Tok(), [" ab", "x"]) == [[10, 11], [12, 11], [3]]
    with pytest.raises(ValueError, match=r"bad_words\[1\]='' encodes to no token"):
        encode_bad_words(Tok(), ["x", ""])
    with pytest.raises(TypeError, match="bad_words"):
        encode_bad_words(Tok(), "ab")


def test_bad_sampling_flags_refused_before_loading(ckpt, capsys, monkeypatch):
    """A bad value exits 2 naming the flag and what is allowed; the model is never loaded
    (argparse refuses what does not parse, SamplingParams / the engine's request check the
    rest, the vocabulary read from config.json)."""
    import specjax.hf
    from specjax.cli.main import main

    def no_work(*a, **k):
        raise AssertionError("loaded the model before checking the flags")

    monkeypatch.setattr(specjax.hf, "load_model", no_work)
    base = ["generate", "--device", "cpu", "--target", str(ckpt), "--prompt", "the cat",
            "--max-tokens", "10"]
    refused = [(["--min-p", "1.5"], "--min-p: min_p must be a finite number in [0.0, 1.0]"),
               (["--presence-penalty", "2.5"], "--presence-penalty: presence_penalty must be a "
                                               "finite number in [-2.0, 2.0]"),
               (["--frequency-penalty", "-3"], "--frequency-penalty: frequency_penalty"),
               (["--repetition-penalty", "0"], "--repetition-penalty: repetition_penalty must "
                                               "be > 0 (1 disables)"),
               (["--min-tokens", "20"], "--min-tokens: min_tokens=20 must be <= max_tokens=10"),
               (["--min-tokens", "-1"], "--min-tokens: min_tokens must be an int >= 0"),
               (["--stop-token-ids", "3", "-1"], "--stop-token-ids: stop_token_ids[1] must be "
                                                 "an int >= 0"),
               (["--allowed-token-ids", "3", "48"], "--allowed-token-ids: allowed_token_ids "
                                                    "holds a token outside [0, 48)"),
               (["--logit-bias", "5=101"], "--logit-bias: logit_bias[5] must be a finite number "
                                           "in [-100.0, 100.0]"),
               (["--logit-bias", "48=1"], "--logit-bias: logit_bias key 48 is outside the "
                                          "vocabulary [0, 48)"),
               (["--logprobs", "21"], "--logprobs: logprobs must be an int in [0, 20]"),
               (["--logprobs", "-1"], "--logprobs: logprobs=-1 asks for the whole vocabulary"),
               (["--bad-words", "cat", "--bad-words", " "], "--bad-words: bad_words[1]=' ' "
                                                            "encodes to no token"),
               (["--top-p", "0"], "--top-p: top_p must be in (0, 1]"),
               (["--top-k", "-1"], "--top-k: top_k must be an int >= 0")]
    for argv, msg in refused:
        assert main([*base, *argv]) == 2, argv
        err = capsys.readouterr().err
        assert f"specjax generate: error: {msg}" in err, (argv, err)
    unparsable = [(["--min-p", "abc"], "argument --min-p: expected a number, got 'abc'"),
                  (["--min-p", "nan"], "argument --min-p: expected a finite number"),
                  (["--min-tokens", "1.5"], "argument --min-tokens: expected an integer"),
                  (["--stop-token-ids", "a"], "argument --stop-token-ids: expected an integer"),
                  (["--allowed-token-ids"], "argument --allowed-token-ids: expected at least one"),
                  (["--logprobs", "2.5"], "argument --logprobs: expected an integer"),
                  (["--logit-bias", "x=1"], "argument --logit-bias: expected a JSON object"),
                  (["--logit-bias", "5"], "argument --logit-bias: expected a JSON object"),
                  (["--logit-bias", "[1]"], "argument --logit-bias: expected a JSON object"),
                  (["--logit-bias", '{"5": "big"}'], "argument --logit-bias: expected a JSON "
                                                     "object"),
                  (["--logit-bias", "{5: 1}"], "not valid JSON"),
                  (["--logprobs-mode", "nope"], "argument --logprobs-mode: invalid choice: "
                                                "'nope' (choose from"),
                  ]
    for argv, msg in unparsable:
        with pytest.raises(SystemExit) as e:
            main([*base, *argv])
        assert e.value.code == 2, argv
        err = capsys.readouterr().err
        assert msg in err, (argv, err)
    assert "raw_logprobs, raw_logits, processed_logprobs, processed_logits" in err.replace("'", "")


PENALTY_ARGV = ["--repetition-penalty", "1.3", "--presence-penalty", "0.4",
                "--frequency-penalty", "0.2"]


def _log_softmax(x):
    x = np.asarray(x, np.float64)
    m = x.max()
    return x - m - np.log(np.exp(x - m).sum())


def penalized_greedy(d, ids, max_tokens, stop, *, rep, pres, freq):
    """NumPy oracle (docs/sampling.md's steps 6, vLLM's order): repetition over prompt and
    output (``l / r`` if ``l > 0`` else ``l * r``), then ``l - freq * count - pres *
    (count > 0)`` over the output; greedy. Returns the tokens and, per token, the raw and
    the processed log-softmax."""
    from specjax.hf import load_model, score

    model, _, _, params = load_model(d)
    seq, out, raw_lp, proc_lp = list(ids), [], [], []
    while len(out) < max_tokens:
        raw = score(model, params, seq)[-1].astype(np.float64)
        seen = np.zeros(raw.size, bool)
        seen[seq] = True
        lg = np.where(seen, np.where(raw > 0, raw / rep, raw * rep), raw)
        cnt = np.bincount(np.asarray(out, int), minlength=raw.size)
        lg = lg - freq * cnt - pres * (cnt > 0)
        tok = int(np.argmax(lg))
        raw_lp.append(_log_softmax(raw))
        proc_lp.append(_log_softmax(lg))
        out.append(tok)
        seq.append(tok)
        if tok in stop:
            break
    return out, raw_lp, proc_lp


def _generate_json(capsys, tmp_path, *argv, name="out.json"):
    f = tmp_path / name
    lines = _cli(capsys, *argv, "--json", str(f))
    return lines, json.loads(f.read_text())


@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs"])
def test_generate_logprobs_with_penalties(ckpt, capsys, tmp_path, mode):
    """``--logprobs 2`` under penalties: the printed and JSON logprobs are the NumPy
    oracle's (naive forward, penalties, log-softmax) and equal ``Engine.generate``'s for
    the same SamplingParams; tokens are penalized greedy decoding's."""
    import re

    from specjax.cli import generate as generate_cli
    from specjax.engine import Engine, SamplingParams, TargetModel
    from specjax.hf import encode_prompt, load_model, load_tokenizer

    prompts = ["the cat sat on", "one two three"]
    tok = load_tokenizer(ckpt)
    lines, recs = _generate_json(capsys, tmp_path, "--target", str(ckpt), "--logprobs", "2",
                                 "--logprobs-mode", mode, *PENALTY_ARGV,
                                 *[a for p in prompts for a in ("--prompt", p)])
    assert [r["prompt"] for r in recs] == prompts
    ids = [encode_prompt(tok, p) for p in prompts]
    model, _, _, params = load_model(ckpt)
    sp = SamplingParams(max_tokens=MAXTOK, repetition_penalty=1.3, presence_penalty=0.4,
                        frequency_penalty=0.2, stop_token_ids=(2,), logprobs=2)
    eng = Engine(TargetModel(model, params), None, max_model_len=128, logprobs_mode=mode)
    ref = eng.generate(ids, sp).outputs
    row, changed = 0, False
    for p, rec, o in zip(ids, recs, ref):
        want, raw_lp, proc_lp = penalized_greedy(ckpt, p, MAXTOK, {2}, rep=1.3, pres=0.4,
                                                 freq=0.2)
        assert rec["token_ids"] == o.token_ids == want
        changed |= want != naive_greedy(ckpt, p, MAXTOK, {2})
        assert rec["finish_reason"] == o.finish_reason
        assert lines[row] == rec["text"] == tok.decode(want, skip_special_tokens=True)
        # the independent path: Engine.generate's RequestOutput.logprobs
        assert rec["logprobs"] == generate_cli.token_logprobs(tok, o.token_ids, o.logprobs, 2)
        lps = raw_lp if mode == "raw_logprobs" else proc_lp
        assert len(rec["logprobs"]) == len(want)
        for j, (t, e, lp) in enumerate(zip(want, rec["logprobs"], lps)):
            assert e["token_id"] == t
            assert e["token"] == (tok.decode([t]) if t < len(tok) else None)
            assert e["logprob"] == pytest.approx(lp[t], abs=2e-5)
            assert e["rank"] == int((lp >= lp[t] - 1e-6).sum())
            top = np.argsort(-lp, kind="stable")[:2]
            assert [x["token_id"] for x in e["top_logprobs"]] == top.tolist()
            assert [x["rank"] for x in e["top_logprobs"]] == [1, 2]
            assert [x["logprob"] for x in e["top_logprobs"]] == pytest.approx(lp[top], abs=2e-5)
            m = re.fullmatch(r"  \[(\d+)\] (\d+) (None|'.*') logprob (\S+) rank (\d+) \| top: "
                             r"(\d+) .* (\S+), (\d+) .* (\S+)", lines[row + 1 + j])
            assert m, lines[row + 1 + j]
            assert (int(m[1]), int(m[2]), int(m[5])) == (j, t, e["rank"])
            assert float(m[4]) == pytest.approx(lp[t], abs=1e-4)
            assert [int(m[6]), int(m[8])] == top.tolist()
            assert [float(m[7]), float(m[9])] == pytest.approx(lp[top], abs=1e-4)
        row += 1 + len(want)
    assert lines[row].startswith("method: plain") and len(lines) == row + 1
    assert changed                  # the penalties changed greedy decoding's tokens


@pytest.mark.parametrize("spec, penalties", [
    # penalties that make repeats likely: the n-gram drafts are verified (and some accepted)
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
     ["--repetition-penalty", "0.9", "--presence-penalty", "-0.3", "--frequency-penalty", "0.1"]),
    # the checkpoint drafting for itself without penalties: they reject some drafts
    ("DRAFT", PENALTY_ARGV)], ids=["ngram", "draft_model"])
def test_generate_penalties_lossless_under_speculation(ckpt, capsys, tmp_path, spec, penalties):
    """Greedy with penalties: --speculative-config emits the tokens and the logprobs of
    plain decoding under the same penalties."""
    prompts = ["the cat sat on the mat and", "one two three one two three"]
    argv = ["--target", str(ckpt), "--logprobs", "2", *penalties,
            *[a for p in prompts for a in ("--prompt", p)]]
    plain_lines, plain = _generate_json(capsys, tmp_path, *argv, name="plain.json")
    if spec == "DRAFT":
        spec = {"model": str(ckpt), "num_speculative_tokens": 2}
    lines, recs = _generate_json(capsys, tmp_path, *argv, "--speculative-config",
                                 json.dumps(spec), name="spec.json")
    assert [r["token_ids"] for r in recs] == [r["token_ids"] for r in plain]
    assert [r["text"] for r in recs] == [r["text"] for r in plain]
    assert [ln.split(" logprob ")[0] for ln in lines[:-1]] == \
        [ln.split(" logprob ")[0] for ln in plain_lines[:-1]]
    for r, q in zip(recs, plain):
        assert len(r["logprobs"]) == len(q["logprobs"]) == len(q["token_ids"])
        for e, f in zip(r["logprobs"], q["logprobs"]):
            assert (e["token_id"], e["rank"]) == (f["token_id"], f["rank"])
            assert e["logprob"] == pytest.approx(f["logprob"], abs=1e-5)
            assert [x["token_id"] for x in e["top_logprobs"]] == \
                [x["token_id"] for x in f["top_logprobs"]]
            assert [x["logprob"] for x in e["top_logprobs"]] == \
                pytest.approx([x["logprob"] for x in f["top_logprobs"]], abs=1e-5)
    method = "ngram" if "method" in spec else "draft_model"
    assert lines[-1].startswith(f"method: {method}")
    # drafts were verified, some accepted, some rejected (k + 1 would be all accepted)
    mal = float(lines[-1].split("mean acceptance length: ")[1].split()[0])
    assert 1.0 < mal < spec["num_speculative_tokens"] + 1, lines[-1]


def test_generate_stop_and_processing_flags_reach_the_engine(ckpt, capsys, tmp_path):
    """--ignore-eos, --stop-token-ids (the NumPy oracle's tokens) and --bad-words,
    --min-tokens, --logit-bias, --allowed-token-ids (Engine.generate with the
    SamplingParams written by hand) through the whole command."""
    from specjax.engine import Engine, SamplingParams, TargetModel
    from specjax.hf import encode_prompt, load_model, load_tokenizer

    prompt = "one two three one two three"
    tok = load_tokenizer(ckpt)
    ids = encode_prompt(tok, prompt)
    base = ["--target", str(ckpt), "--prompt", prompt, *PENALTY_ARGV]
    pen = dict(rep=1.3, pres=0.4, freq=0.2)
    with_eos = penalized_greedy(ckpt, ids, MAXTOK, {2}, **pen)[0]
    assert with_eos[-1] == 2 and len(with_eos) < MAXTOK          # it stops on EOS ...
    _, [rec] = _generate_json(capsys, tmp_path, *base, "--ignore-eos")
    assert rec["token_ids"] == penalized_greedy(ckpt, ids, MAXTOK, set(), **pen)[0]
    assert len(rec["token_ids"]) == MAXTOK and rec["finish_reason"] == "length"  # ... not here
    stop = with_eos[2]
    _, [rec] = _generate_json(capsys, tmp_path, *base, "--stop-token-ids", "47", str(stop))
    assert rec["token_ids"] == with_eos[:3] and rec["finish_reason"] == "stop"

    allowed = [2, 5, 12, 18, 22, 23, 32, 35, 40, 41]
    _, [rec] = _generate_json(capsys, tmp_path, *base, "--bad-words", "blue", "--min-tokens", "8",
                              "--logit-bias", "5=3", "--logit-bias", '{"40": -2.5}',
                              "--allowed-token-ids", *map(str, allowed))
    model, _, _, params = load_model(ckpt)
    sp = SamplingParams(max_tokens=MAXTOK, repetition_penalty=1.3, presence_penalty=0.4,
                        frequency_penalty=0.2, stop_token_ids=(2,), bad_words=((18,),),
                        min_tokens=8, logit_bias={5: 3.0, 40: -2.5}, allowed_token_ids=allowed)
    [o] = Engine(TargetModel(model, params), None, max_model_len=128).generate([ids], sp).outputs
    assert rec["token_ids"] == o.token_ids
    assert set(o.token_ids) <= set(allowed) - {18} and len(o.token_ids) >= 8
    assert o.token_ids != with_eos


# -- MiMo: the target's own directory drafts with its MTP module (vLLM's method="mtp") ----

def make_mimo_checkpoint(d, *, seed: int = 3):
    """A tiny MiMo checkpoint (``MiMoForCausalLM``: a Qwen2 trunk plus two MTP modules
    ``model.mtp_layers.{0,1}.*``), written with NumPy, and the tokenizer."""
    from safetensors.numpy import save_file

    from specjax.models import config_from_hf, registry

    d.mkdir(parents=True, exist_ok=True)
    hf = dict(architectures=["MiMoForCausalLM"], model_type="mimo", vocab_size=48,
              hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5,
              rope_theta=10000.0, tie_word_embeddings=False, hidden_act="silu",
              use_sliding_window=False, num_nextn_predict_layers=2)
    (d / "config.json").write_text(json.dumps(hf))
    tensors = registry.random_tensors("qwen2", config_from_hf("qwen2", hf), seed=seed)
    tensors = {k: 3 * v if k == "lm_head.weight" else v for k, v in tensors.items()}
    mcfg = config_from_hf("mtp", dict(hf, num_hidden_layers=1))
    for i in range(2):
        for k, v in registry.random_tensors("mtp", mcfg, seed=seed + 1 + i).items():
            name = k[len("layers.0."):] if k.startswith("layers.0.") else k
            tensors[f"model.mtp_layers.{i}.{name}"] = v
    save_file(tensors, str(d / "model.safetensors"))
    _tokenizer(d, False)
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [2], "bos_token_id": 1}))


@pytest.mark.parametrize("spec", ['{"method": "mtp"}', '{"method": "mimo_mtp", "num_speculative_tokens": 4}',
                                  "DIR"])
def test_mimo_mtp_from_the_target_directory(tmp_path, capsys, spec):
    """vLLM's MTP config in one call: ``method="mtp"`` with no ``model`` drafts from the
    target's own directory, ``num_speculative_tokens`` defaults to the checkpoint's
    ``num_nextn_predict_layers`` (2 here), a ``*_mtp`` alias is rewritten to mtp, and the
    MiMo directory as ``model`` is detected as MTP; the text equals plain greedy decoding."""
    from specjax.hf import encode_prompt, load_tokenizer

    d = tmp_path / "tiny-mimo"
    make_mimo_checkpoint(d)
    prompts = ["the cat sat on", "one two three four"]
    tok = load_tokenizer(d)
    want = [tok.decode(naive_greedy(d, encode_prompt(tok, p), MAXTOK, {2}),
                       skip_special_tokens=True) for p in prompts]
    k = 4 if "mimo_mtp" in spec else 2        # else num_nextn_predict_layers
    if spec == "DIR":
        spec = json.dumps({"model": str(d)})
    lines = _cli(capsys, "--target", str(d), "--speculative-config", spec,
                 *[a for p in prompts for a in ("--prompt", p)])
    assert lines[:2] == want and len(lines) == 3
    assert lines[2].startswith("method: mtp"), lines[2]
    from specjax.config import SpeculativeConfig

    cfg = SpeculativeConfig.from_vllm(dict(json.loads(spec), model=str(d)))
    assert cfg.method == "mtp"
    assert cfg.num_speculative_tokens == k


# -- convert, then generate: a specjax-convert output carries its tokenizer ---------------

CHAT_TEMPLATE = ("{% for m in messages %}[BOS] {{ m['content'] }} one{% endfor %}"
                 "{% if add_generation_prompt %} two{% endif %}")


@pytest.fixture(scope="module")
def conversions(tmp_path_factory):
    """``(src, dst, bare)``: a checkpoint whose chat template is a ``chat_template.jinja``
    file, its ``specjax-convert`` output, and the output of the same weights without any
    tokenizer file."""
    from specjax.converters import cli

    root = tmp_path_factory.mktemp("convert")
    src = root / "tiny-chat"
    make_checkpoint(src, seed=2)
    (src / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    weights = root / "weights-only"
    weights.mkdir()
    for n in ("config.json", "model.safetensors"):
        (weights / n).write_bytes((src / n).read_bytes())
    for s, d in ((src, root / "converted"), (weights, root / "converted-bare")):
        assert cli.main([str(s), str(d), "-q"]) == 0
    return src, root / "converted", root / "converted-bare"


def _no_loading(monkeypatch):
    import specjax.hf

    def no_work(*a, **k):
        raise AssertionError("loaded a model or tokenizer before checking the paths")

    monkeypatch.setattr(specjax.hf, "load_model", no_work)
    monkeypatch.setattr(specjax.hf, "load_tokenizer", no_work)


def _refused(capsys, *argv):
    from specjax.cli.main import main

    assert main(["generate", "--device", "cpu", *argv]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("specjax generate: error: "), err
    return err


PROMPTS = ["the cat sat on", "one two three"]


@pytest.mark.smoke
def test_convert_then_generate(conversions, capsys):
    """The converted directory holds the tokenizer, chat template and generation files
    byte for byte, and ``specjax generate --target DST`` prints what ``--target SRC``
    prints (greedy), the chat template applied."""
    from specjax.hf import encode_prompt, load_tokenizer

    src, dst, _ = conversions
    carried = ("tokenizer.json", "tokenizer_config.json", "generation_config.json",
               "chat_template.jinja")
    assert sorted(p.name for p in dst.iterdir()) == sorted(["specjax.json", "params", *carried])
    for n in carried:
        assert (dst / n).read_bytes() == (src / n).read_bytes(), n
    tok = load_tokenizer(dst)
    assert encode_prompt(tok, "red dog") == encode_prompt(load_tokenizer(src), "red dog") \
        == [1, 17, 5, 19, 20]                 # [BOS] red dog one two: the template's
    argv = [a for p in PROMPTS for a in ("--prompt", p)]
    want = _cli(capsys, "--target", str(src), *argv)
    got = _cli(capsys, "--target", str(dst), *argv)
    assert got[:2] == want[:2] and len(got) == 3 and got[2].startswith("method: plain")
    assert got[:2] == [tok.decode(naive_greedy(dst, encode_prompt(tok, p), MAXTOK, {2}),
                                  skip_special_tokens=True) for p in PROMPTS]


def test_checkpoint_without_tokenizer_named(conversions, capsys, monkeypatch):
    _, _, bare = conversions
    _no_loading(monkeypatch)
    err = _refused(capsys, "--target", str(bare), "--prompt", "the cat")
    for needle in (f"--target {str(bare)!r}", "no tokenizer", "tokenizer.json",
                   "tokenizer.model", "vocab.json", "--tokenizer DIR"):
        assert needle in err, (needle, err)


def test_wrong_paths_named_before_loading(conversions, tmp_path, capsys, monkeypatch):
    src, dst, bare = conversions
    _no_loading(monkeypatch)
    none = str(tmp_path / "none")
    f = tmp_path / "afile"
    f.write_text("x")
    empty = tmp_path / "empty"
    empty.mkdir()
    for argv, needle in (
            (["--target", none], f"--target {none!r}: directory does not exist"),
            (["--target", str(f)], f"--target {str(f)!r}: a file, not a checkpoint directory"),
            (["--target", str(empty)], f"--target {str(empty)!r}: not a checkpoint directory"),
            (["--target", str(bare), "--tokenizer", none],
             f"--tokenizer {none!r}: directory does not exist"),
            (["--target", str(bare), "--tokenizer", str(empty)],
             f"--tokenizer {str(empty)!r}: no tokenizer in this directory")):
        err = _refused(capsys, *argv, "--prompt", "the cat")
        assert needle in err, (argv, err)


def test_tokenizer_from_another_directory(conversions, capsys):
    """``--tokenizer SRC``: the tokenizer and generation_config.json of SRC for a
    conversion that has none; the text is ``--target SRC``'s."""
    src, _, bare = conversions
    argv = [a for p in PROMPTS for a in ("--prompt", p)]
    want = _cli(capsys, "--target", str(src), *argv)
    got = _cli(capsys, "--target", str(bare), "--tokenizer", str(src), *argv)
    assert got[:2] == want[:2] and len(got) == 3


def test_changed_carried_file_named(conversions, tmp_path, capsys, monkeypatch):
    import shutil

    import specjax.hf

    d = tmp_path / "dst"
    shutil.copytree(conversions[1], d)
    data = bytearray((d / "tokenizer.json").read_bytes())
    data[len(data) // 2] ^= 1
    (d / "tokenizer.json").write_bytes(bytes(data))
    monkeypatch.setattr(specjax.hf, "load_model", lambda *a, **k: pytest.fail("loaded"))
    err = _refused(capsys, "--target", str(d), "--prompt", "the cat")
    assert f"{d / 'tokenizer.json'}: does not match its recorded sha256" in err, err
    (d / "generation_config.json").unlink()
    with pytest.raises(ValueError, match="generation_config.json: missing"):
        specjax.hf.load_generation_config(d)


def test_no_pytorch_notice(conversions):
    """transformers logs "PyTorch was not found" when first imported without torch;
    specjax imports it for tokenizers only and drops that line."""
    code = "import transformers"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    if "PyTorch was not found" not in r.stderr:
        pytest.skip("this transformers prints no PyTorch notice here (torch installed?)")
    code = ("import sys; from specjax.hf import load_tokenizer; "
            "print(load_tokenizer(sys.argv[1])('the cat')['input_ids'])")
    r = subprocess.run([sys.executable, "-c", code, str(conversions[1])], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[3, 4]" and "PyTorch" not in r.stderr, r.stderr

"""``specjax generate``: a real checkpoint, its tokenizer and a vLLM ``speculative_config``
from the command line.

``--target DIR``: a ``specjax-convert`` output or an original HF directory; ``--tokenizer
DIR`` takes the tokenizer (and ``generation_config.json``) from elsewhere. Paths and the
sampling flags (vLLM's ``SamplingParams`` fields, :data:`FLAGS`) are checked before any
model loads, each error naming its flag. ``--json FILE`` writes :func:`result_records`.
"""

from __future__ import annotations

import json
import math
import re
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from specjax.checks import ArgumentError

#: ``SamplingParams`` field -> the ``specjax generate`` flag that sets it.
FLAGS = {"max_tokens": "--max-tokens", "temperature": "--temperature", "top_k": "--top-k",
         "top_p": "--top-p", "min_p": "--min-p", "presence_penalty": "--presence-penalty",
         "frequency_penalty": "--frequency-penalty",
         "repetition_penalty": "--repetition-penalty", "min_tokens": "--min-tokens",
         "stop_token_ids": "--stop-token-ids", "ignore_eos": "--ignore-eos",
         "bad_words": "--bad-words", "allowed_token_ids": "--allowed-token-ids",
         "logit_bias": "--logit-bias", "logprobs": "--logprobs"}


def _progress(err: TextIO, total_tokens: int):
    t0 = time.perf_counter()

    def show(done: int, total: int, generated: int, started: int) -> None:
        width = 30
        frac = min(1.0, generated / max(1, total_tokens))
        bar = "#" * int(frac * width)
        rate = generated / max(1e-9, time.perf_counter() - t0)
        err.write(f"\r[{bar:<{width}}] {done}/{total} requests, {generated} tokens, "
                  f"{rate:.1f} tok/s")
        err.flush()
    return show


def main_generate(args, out: TextIO | None = None, err: TextIO | None = None) -> int:
    out = out or sys.stdout
    err = err or sys.stderr
    try:
        return _run(args, out, err)
    except (ValueError, TypeError, FileNotFoundError, NotADirectoryError, ImportError) as e:
        err.write(f"specjax generate: error: {e}\n")
        return 2


def sampling_params(args, *, bad_words: Any = (), stop_token_ids: Any = None):
    """The ``SamplingParams`` of parsed ``generate`` arguments (``bad_words``: encoded
    token-id sequences; ``stop_token_ids``: None, or the flag's ids plus EOS); a bad value
    raises ``ArgumentError`` naming its flag."""
    from specjax.engine import SamplingParams

    bias: dict[int, float] = {}
    for d in args.logit_bias:
        bias.update(d)
    fields = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                  top_p=args.top_p, min_p=args.min_p, presence_penalty=args.presence_penalty,
                  frequency_penalty=args.frequency_penalty,
                  repetition_penalty=args.repetition_penalty, min_tokens=args.min_tokens,
                  stop_token_ids=tuple(args.stop_token_ids if stop_token_ids is None
                                       else stop_token_ids),
                  ignore_eos=bool(args.ignore_eos), bad_words=tuple(map(tuple, bad_words)),
                  allowed_token_ids=(None if args.allowed_token_ids is None
                                     else tuple(args.allowed_token_ids)),
                  logit_bias=bias or None, logprobs=args.logprobs)
    for name, value in fields.items():
        kw = {name: value}
        if name == "min_tokens":
            kw["max_tokens"] = fields["max_tokens"]
        try:
            SamplingParams(**kw)
        except (ValueError, TypeError) as e:
            raise ArgumentError(f"{FLAGS[name]}: {e}") from None
    return SamplingParams(**fields)


def check_vocabulary(sp, vocab_size: int) -> None:
    """The engine's request check of ``sp`` (its default ``ProcessorLimits``; stop ids as
    ``min_tokens`` suppresses them) against ``vocab_size``, naming the flag."""
    from specjax.sampling.logits_processors import ProcessorLimits, check_request

    try:
        check_request("sampling", sp.processing(sp.stop_token_ids), ProcessorLimits(),
                      vocab_size, 0)
    except ValueError as e:
        m = re.match(r"sampling\.(\w+)", str(e))
        flag = FLAGS.get(m.group(1), "sampling") if m else "sampling"
        raise ArgumentError(f"{flag}: {str(e).replace('sampling.', '', 1)}") from None


def check_paths(args) -> tuple[str, str]:
    """``(tokenizer directory, generation_config directory)`` of parsed ``generate``
    arguments, after checking ``--target`` / ``--tokenizer`` exist and a tokenizer
    (``specjax.hf.TOKENIZER_FILES``) is there; errors name the flag and directory."""
    from specjax.hf import tokenizer_dir

    target = Path(args.target).expanduser()
    if not target.exists():
        raise FileNotFoundError(f"--target {args.target!r}: directory does not exist (only "
                                "local directories are read; nothing is downloaded)")
    if not target.is_dir():
        raise NotADirectoryError(f"--target {args.target!r}: a file, not a checkpoint directory")
    if not (target / "config.json").is_file() and not (target / "specjax.json").is_file():
        raise FileNotFoundError(f"--target {args.target!r}: not a checkpoint directory (no "
                                "config.json, nor the specjax.json of a specjax-convert output)")
    if args.tokenizer is not None:
        tok = tokenizer_dir(args.tokenizer, "--tokenizer")
        gen = tok if (tok / "generation_config.json").is_file() else target
        return args.tokenizer, str(gen)
    tokenizer_dir(args.target, "--target",
                  hint="; pass --tokenizer DIR naming a directory that holds the checkpoint's "
                       "tokenizer (e.g. the original checkpoint this one was converted from)")
    return args.target, args.target


def _config_vocab_size(target: str) -> int | None:
    """``vocab_size`` of the checkpoint's config (top level or ``text_config``), if any."""
    from specjax.hf import read_checkpoint_config

    d = read_checkpoint_config(target)
    for c in (d, d.get("text_config"), d.get("config")):
        v = c.get("vocab_size") if isinstance(c, dict) else None
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


def _piece(tok, t: int) -> str | None:
    """The text of token ``t`` (None where the tokenizer has no such token)."""
    try:
        if t >= len(tok):
            return None
        return tok.decode([t])
    except Exception:  # noqa: BLE001 - a token the tokenizer cannot show is shown as None
        return None


def _value(v: float) -> float | None:
    return float(v) if math.isfinite(v) else None


def token_logprobs(tok, token_ids, logprobs, n: int) -> list[dict]:
    """Per generated token: ``token_id``, ``token`` (text or None), ``logprob``, ``rank`` and
    ``top_logprobs`` (same fields) from ``RequestOutput.logprobs``; ``-inf`` is None."""
    out = []
    for t, d in zip(token_ids, logprobs):
        items = list(d.items())
        if len(items) == n + 1:      # the emitted token is not in the top n: its own entry
            items = [(i, lp) for i, lp in items if i != t]
        top = sorted(items, key=lambda kv: kv[1].rank)
        e = d[t]
        out.append({"token_id": int(t), "token": _piece(tok, int(t)), "logprob": _value(e.logprob),
                    "rank": int(e.rank),
                    "top_logprobs": [{"token_id": int(i), "token": _piece(tok, int(i)),
                                      "logprob": _value(lp.logprob), "rank": int(lp.rank)}
                                     for i, lp in top]})
    return out


def result_records(tok, prompts, outputs, n: int | None) -> list[dict]:
    """``--json``'s list: per prompt ``prompt``, ``text``, ``token_ids``, ``finish_reason``
    and ``logprobs`` (None without ``--logprobs``, else :func:`token_logprobs`)."""
    return [{"prompt": p, "text": tok.decode(o.token_ids, skip_special_tokens=True),
             "token_ids": [int(t) for t in o.token_ids], "finish_reason": o.finish_reason,
             "logprobs": None if n is None or o.logprobs is None
             else token_logprobs(tok, o.token_ids, o.logprobs, n)} for p, o in zip(prompts, outputs)]


def _show_value(v: float | None) -> str:
    return "-inf" if v is None else f"{v:.4f}"


def _write_logprobs(out: TextIO, rows: list[dict]) -> None:
    for j, r in enumerate(rows):
        top = ", ".join(f"{e['token_id']} {e['token']!r} {_show_value(e['logprob'])}"
                        for e in r["top_logprobs"])
        out.write(f"  [{j}] {r['token_id']} {r['token']!r} logprob {_show_value(r['logprob'])} "
                  f"rank {r['rank']}" + (f" | top: {top}" if top else "") + "\n")


def _run(args, out: TextIO, err: TextIO) -> int:
    import contextlib
    import dataclasses

    import jax

    from specjax import generate, make_proposer
    from specjax.engine import TargetModel
    from specjax.hf import (encode_bad_words, encode_prompt, load_generation_config, load_model,
                            load_tokenizer)
    from specjax.sampling.logprobs import check_logprobs_mode
    from specjax.models import DecoderLM

    tok_dir, gen_dir = check_paths(args)
    prompts = list(args.prompt)
    if args.prompts:
        p = Path(args.prompts)
        if not p.is_file():
            raise FileNotFoundError(f"--prompts {str(p)!r} does not exist")
        prompts += [line for line in p.read_text().splitlines() if line.strip()]
    if not prompts:
        raise ValueError("give at least one --prompt TEXT (or --prompts FILE)")
    spec = None
    if args.speculative_config:
        try:
            spec = json.loads(args.speculative_config)
        except json.JSONDecodeError as e:
            raise ValueError(f"--speculative-config is not valid JSON ({e})") from None
        if not isinstance(spec, dict):
            raise ValueError("--speculative-config must be a JSON object")
        if spec.get("model") is None and (spec.get("method") == "mtp"
                                          or str(spec.get("method") or "").endswith("_mtp")):
            spec = dict(spec, model=args.target)     # vLLM: MTP drafts from the target's checkpoint
    try:
        check_logprobs_mode(args.logprobs_mode)
    except ValueError as e:
        raise ArgumentError(f"--logprobs-mode: {e}") from None
    if args.json is not None and not Path(args.json).expanduser().parent.is_dir():
        raise FileNotFoundError(f"--json {args.json!r}: its directory does not exist")
    sp = sampling_params(args)                       # every flag but --bad-words' text
    ctx = jax.default_device(jax.devices("cpu")[0]) if args.device == "cpu" \
        else contextlib.nullcontext()
    with ctx:
        tok = load_tokenizer(tok_dir, "--tokenizer" if args.tokenizer else "--target")
        try:
            bad = encode_bad_words(tok, list(args.bad_words))
        except ValueError as e:
            raise ArgumentError(f"--bad-words: {e}") from None
        gen_cfg = load_generation_config(gen_dir)
        eos = tuple(gen_cfg.get("eos_token_ids", ()))
        if tok.eos_token_id is not None and tok.eos_token_id not in eos:
            eos += (int(tok.eos_token_id),)
        vocab = _config_vocab_size(args.target)

        def stops(vocab_size: int | None) -> tuple[int, ...]:   # the flag's, then EOS
            e = () if args.ignore_eos else tuple(
                i for i in eos if vocab_size is None or i < vocab_size)
            return tuple(args.stop_token_ids) + tuple(i for i in e if i not in args.stop_token_ids)

        sp = sampling_params(args, bad_words=bad, stop_token_ids=stops(vocab))
        if vocab is not None:
            check_vocabulary(sp, vocab)
        model, kind, cfg, params = load_model(args.target, args.dtype)
        if not isinstance(model, DecoderLM):
            raise ValueError(f"--target {args.target!r} is a {kind!r} checkpoint, not a decoder LM")
        sp = dataclasses.replace(sp, stop_token_ids=stops(cfg.vocab_size))
        check_vocabulary(sp, cfg.vocab_size)
        mml = args.max_model_len or min(cfg.max_position_embeddings, 4096)
        chat = False if args.no_chat_template else None
        ids = [encode_prompt(tok, p, chat=chat) for p in prompts]
        proposer = None
        if spec is not None:
            proposer = make_proposer(spec, target=model, target_params=params, max_model_len=mml)
        total = args.max_tokens * len(ids)
        res = generate(TargetModel(model, params), proposer, ids, sp, max_model_len=mml,
                       seed=args.seed, progress=_progress(err, total),
                       logprobs_mode=args.logprobs_mode)
    err.write("\n")
    records = result_records(tok, prompts, res.outputs, args.logprobs)
    tokens = 0
    for rec in records:
        tokens += len(rec["token_ids"])
        out.write(rec["text"] + "\n")
        if rec["logprobs"] is not None:
            _write_logprobs(out, rec["logprobs"])
    if args.json is not None:
        Path(args.json).expanduser().write_text(json.dumps(records, indent=1) + "\n")
    mal = res.mean_acceptance_length if proposer is not None else None
    method = "plain" if proposer is None else proposer.method
    acc = "-" if mal is None else f"{mal:.2f}"
    out.write(f"method: {method}  mean acceptance length: {acc}  tokens: {tokens}  "
              f"tokens/s: {tokens / max(res.elapsed_s, 1e-9):.1f}\n")
    return 0

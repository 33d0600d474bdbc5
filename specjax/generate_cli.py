"""``specjax generate``: a real checkpoint, its tokenizer and a vLLM ``speculative_config``
from the command line (see :mod:`specjax.cli`)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import TextIO


def _progress(err: TextIO, total_tokens: int):
    t0 = time.perf_counter()

    def show(done: int, total: int, generated: int) -> None:
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


def _run(args, out: TextIO, err: TextIO) -> int:
    import contextlib

    import jax

    from specjax import generate, make_proposer
    from specjax.engine import SamplingParams, TargetModel
    from specjax.hf import encode_prompt, load_generation_config, load_model, load_tokenizer
    from specjax.models import DecoderLM

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
    ctx = jax.default_device(jax.devices("cpu")[0]) if args.device == "cpu" \
        else contextlib.nullcontext()
    with ctx:
        tok = load_tokenizer(args.target)
        model, kind, cfg, params = load_model(args.target, args.dtype)
        if not isinstance(model, DecoderLM):
            raise ValueError(f"--target {args.target!r} is a {kind!r} checkpoint, not a decoder LM")
        gen_cfg = load_generation_config(args.target)
        eos = tuple(gen_cfg.get("eos_token_ids", ()))
        if tok.eos_token_id is not None and tok.eos_token_id not in eos:
            eos += (int(tok.eos_token_id),)
        eos = tuple(i for i in eos if i < cfg.vocab_size)
        mml = args.max_model_len or min(cfg.max_position_embeddings, 4096)
        chat = False if args.no_chat_template else None
        ids = [encode_prompt(tok, p, chat=chat) for p in prompts]
        sp = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_k=args.top_k, top_p=args.top_p, stop_token_ids=eos)
        proposer = None
        if spec is not None:
            proposer = make_proposer(spec, target=model, target_params=params, max_model_len=mml)
        total = args.max_tokens * len(ids)
        res = generate(TargetModel(model, params), proposer, ids, sp, max_model_len=mml,
                       seed=args.seed, progress=_progress(err, total))
    err.write("\n")
    tokens = 0
    for p, o in zip(prompts, res.outputs):
        tokens += len(o.token_ids)
        out.write(tok.decode(o.token_ids, skip_special_tokens=True) + "\n")
    mal = res.mean_acceptance_length if proposer is not None else None
    method = "plain" if proposer is None else proposer.method
    acc = "-" if mal is None else f"{mal:.2f}"
    out.write(f"method: {method}  mean acceptance length: {acc}  tokens: {tokens}  "
              f"tokens/s: {tokens / max(res.elapsed_s, 1e-9):.1f}\n")
    return 0

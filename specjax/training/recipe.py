"""The demo-model recipe: reproduces every shipped demo weight from scratch.

A byte-level Llama target (4 layers, width 256) trained on CPython's standard library, then
every kind of draft distilled from it, each exported in its upstream layout in fp16::

    python -m specjax.training.recipe --out DIR                 # everything
    python -m specjax.training.recipe --out DIR --stage heads --target DIR/target
    python -m specjax.training.recipe --out DIR --scale smoke   # a CPU-sized run

``DIR/<name>/`` gets one checkpoint per model and ``DIR/report_<stage>.json`` the training
history and held-out metrics (the shipped copies: :mod:`specjax.demo_models`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time
import zlib
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from specjax.models import registry
from specjax.tokenizer import BOS_ID, EOS_ID, MASK_ID, VOCAB_SIZE
from specjax.training import forward as F
from specjax.training import objectives as O
from specjax.training.trainer import TrainConfig, evaluate, init_params, train

#: Target layers whose inputs feed EAGLE-3 and DFlash (vLLM meaning: input of layer k).
AUX_LAYER_IDS = (1, 2, 3)
DRAFT_VOCAB_SIZE = 128
DFLASH_BLOCK_SIZE = 8
DSPARK_MARKOV_RANK = 64
MEDUSA_HEADS = 5
TTT_DEPTH = 4

_DECODER = dict(vocab_size=VOCAB_SIZE, rms_norm_eps=1e-5, rope_theta=10000.0,
                max_position_embeddings=2048, bos_token_id=BOS_ID, eos_token_id=EOS_ID)

#: HF configs of every model (the head configs are completed at training time).
TARGET_HF = dict(_DECODER, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                 tie_word_embeddings=False)
_HEAD = dict(_DECODER, hidden_size=256, intermediate_size=768, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64)
HEADS_HF = {
    "eagle": ("eagle", "eagle", dict(_HEAD, num_hidden_layers=1, bias=True)),
    "eagle3": ("eagle3", "eagle3", dict(_HEAD, num_hidden_layers=1, target_hidden_size=256,
                                        draft_vocab_size=DRAFT_VOCAB_SIZE,
                                        eagle_aux_hidden_state_layer_ids=list(AUX_LAYER_IDS))),
    "medusa": ("medusa", "medusa", dict(num_heads=MEDUSA_HEADS, num_hidden_layers=1,
                                        hidden_size=256, vocab_size=VOCAB_SIZE,
                                        medusa_fc_bias=True)),
    "draft_model": ("llama", "llama", dict(_DECODER, hidden_size=128, intermediate_size=384,
                                           num_hidden_layers=2, num_attention_heads=2,
                                           num_key_value_heads=1, head_dim=64,
                                           tie_word_embeddings=False)),
    "dflash": ("dflash", "dflash", dict(_HEAD, num_hidden_layers=2, target_hidden_size=256,
                                        aux_hidden_state_layer_ids=list(AUX_LAYER_IDS),
                                        block_size=DFLASH_BLOCK_SIZE, mask_token_id=MASK_ID,
                                        rope_theta=10000.0)),
    "dspark": ("dspark", "dspark", dict(_HEAD, num_hidden_layers=2, target_hidden_size=256,
                                        aux_hidden_state_layer_ids=list(AUX_LAYER_IDS),
                                        block_size=DFLASH_BLOCK_SIZE, mask_token_id=MASK_ID,
                                        rope_theta=10000.0, markov_rank=DSPARK_MARKOV_RANK,
                                        markov_head_type="vanilla", enable_confidence_head=True,
                                        confidence_head_with_markov=True)),
}
HEAD_NAMES = tuple(HEADS_HF)

#: Training schedules (``full``: the shipped weights, sized for one GPU).
SCHEDULES = {
    "full": {
        "target": TrainConfig(steps=3000, batch_size=128, seq_len=512, lr=3e-3, warmup_steps=200,
                              log_every=250),
        "eagle": TrainConfig(steps=1500, batch_size=64, seq_len=512, lr=2e-3, warmup_steps=100,
                             log_every=250, seed=1),
        "eagle3": TrainConfig(steps=1500, batch_size=64, seq_len=512, lr=2e-3, warmup_steps=100,
                              log_every=250, seed=2),
        "medusa": TrainConfig(steps=1000, batch_size=64, seq_len=512, lr=2e-3, warmup_steps=100,
                              log_every=250, seed=3),
        "draft_model": TrainConfig(steps=1500, batch_size=64, seq_len=512, lr=3e-3,
                                   warmup_steps=100, log_every=250, seed=4),
        "dflash": TrainConfig(steps=1500, batch_size=64, seq_len=512, lr=2e-3, warmup_steps=100,
                              log_every=250, seed=5),
        "dspark": TrainConfig(steps=1500, batch_size=64, seq_len=512, lr=2e-3, warmup_steps=100,
                              log_every=250, seed=6),
    },
    "smoke": {name: TrainConfig(steps=3, batch_size=2, seq_len=64, lr=1e-3, warmup_steps=1,
                                log_every=1, seed=i)
              for i, name in enumerate(("target",) + HEAD_NAMES)},
}
EXPORT_DTYPE = "fp16"


def _versions() -> dict:
    import flax
    import optax

    return {"python": platform.python_version(), "jax": jax.__version__, "flax": flax.__version__,
            "optax": optax.__version__, "device": str(jax.devices()[0].device_kind),
            "platform": jax.default_backend()}


def draft_vocab(tokens: np.ndarray, size: int) -> np.ndarray:
    """The ``size`` most frequent token ids of the corpus (ties: lower id), sorted."""
    counts = np.bincount(np.asarray(tokens, np.int64), minlength=VOCAB_SIZE)
    order = np.lexsort((np.arange(VOCAB_SIZE), -counts))
    return np.sort(order[:size]).astype(np.int32)


@dataclasses.dataclass
class Corpus:
    train: np.ndarray
    heldout: np.ndarray
    stats: dict


def load_corpus(max_file_bytes: int | None = None) -> Corpus:
    from specjax.training.data import corpus, stdlib_root

    tr, ho, trf, hof = corpus(include_tests=True, max_file_bytes=max_file_bytes)
    stats = {"root": str(stdlib_root()), "train_files": len(trf), "heldout_files": len(hof),
             "train_tokens": int(tr.num_tokens), "heldout_tokens": int(ho.num_tokens),
             "include_tests": True}
    return Corpus(np.asarray(tr.tokens), np.asarray(ho.tokens), stats)


def _eval_kw(tc: TrainConfig, smoke: bool) -> dict:
    return dict(batch_size=tc.batch_size, seq_len=tc.seq_len, max_batches=1 if smoke else 16)


def train_target(corp: Corpus, tc: TrainConfig, *, smoke: bool, log=print,
                 time_budget_s: float | None = None):
    cfg = registry.config_from_hf("llama", TARGET_HF)
    obj = O.target_lm(cfg)
    params = init_params("llama", cfg, jax.random.key(tc.seed))
    t0 = time.perf_counter()
    params, hist = train(obj, params, {}, corp.train, tc, log=log, name="target",
                         time_budget_s=time_budget_s)
    held = evaluate(obj, params, {}, corp.heldout, **_eval_kw(tc, smoke))
    report = {"train_s": round(time.perf_counter() - t0, 1), "history": hist,
              "heldout": held, "heldout_bits_per_byte": held["bits_per_token"],
              "params": int(sum(x.size for x in jax.tree.leaves(params))),
              "schedule": dataclasses.asdict(tc)}
    log(f"[target] held-out: {held['bits_per_token']:.4f} bits per byte")
    return cfg, params, report


def head_setup(name: str, target_cfg, target_params, corp: Corpus):
    """``(kind, format, config, objective, init params, frozen)`` of one head."""
    kind, fmt, hf = HEADS_HF[name]
    cfg = registry.config_from_hf(kind, hf)
    if kind == "eagle3":
        cfg = dataclasses.replace(cfg, has_d2t=True)               # reduced draft vocab
    aux = AUX_LAYER_IDS if kind in ("eagle3", "dflash", "dspark") else ()
    tgt = O.TargetSetup(target_cfg, aux)
    frozen = {"target": target_params}
    lm = target_params["lm_head"]["kernel"]                       # [H, V]
    overrides = {}
    if kind == "eagle3":
        ids = draft_vocab(corp.train, DRAFT_VOCAB_SIZE)
        frozen["draft_ids"] = jnp.asarray(ids)
        overrides["lm_head"] = {"kernel": jnp.asarray(lm)[:, ids]}
        obj = O.eagle("eagle3", cfg, tgt, depth=TTT_DEPTH)
    elif kind == "eagle":
        obj = O.eagle("eagle", cfg, tgt, depth=TTT_DEPTH)
    elif kind == "medusa":
        overrides["lm_heads"] = {k: {"kernel": jnp.array(lm)} for k in range(cfg.num_heads)}
        obj = O.medusa(cfg, tgt)
    elif kind == "llama":
        obj = O.draft_model(cfg, tgt)
    elif kind == "dspark":
        obj = O.dspark(cfg, tgt)
    else:
        obj = O.dflash(cfg, tgt)
    params = init_params(kind, cfg, jax.random.key(zlib.crc32(name.encode())), overrides=overrides)
    params.pop("d2t", None)                                       # not trained; set at export
    return kind, fmt, cfg, obj, params, frozen


def train_head(name: str, target_cfg, target_params, corp: Corpus, tc: TrainConfig, *,
               smoke: bool, log=print, time_budget_s: float | None = None):
    kind, fmt, cfg, obj, params, frozen = head_setup(name, target_cfg, target_params, corp)
    t0 = time.perf_counter()
    params, hist = train(obj, params, frozen, corp.train, tc, log=log, name=name,
                         time_budget_s=time_budget_s)
    held = evaluate(obj, params, frozen, corp.heldout, **_eval_kw(tc, smoke))
    if kind == "eagle3":
        ids = np.asarray(frozen["draft_ids"])
        params["d2t"] = jnp.asarray(ids - np.arange(ids.size, dtype=np.int32))
    report = {"train_s": round(time.perf_counter() - t0, 1), "history": hist, "heldout": held,
              "params": int(sum(x.size for x in jax.tree.leaves(params))),
              "schedule": dataclasses.asdict(tc)}
    log(f"[{name}] held-out: " + " ".join(f"{k}={v:.4f}" for k, v in held.items()))
    return kind, fmt, cfg, params, report


def export(name: str, kind: str, fmt: str, cfg, params, out: Path, report: dict) -> Path:
    from specjax.converters.export import export_checkpoint

    extra = {"specjax": {"demo_model": name, "recipe": "python -m specjax.training.recipe",
                         "heldout": report.get("heldout")}}
    if kind == "medusa":
        extra["base_model_name_or_path"] = "specjax/demo_models/target"
    if kind in ("dflash", "dspark"):
        extra["num_target_layers"] = TARGET_HF["num_hidden_layers"]
    return export_checkpoint(kind, cfg, params, out / name, format=fmt, dtype=EXPORT_DTYPE,
                             overwrite=True, extra_config=extra)


def load_target(path: Path):
    from specjax.converters import load_pretrained

    kind, cfg, params = load_pretrained(path)
    if kind != "llama":
        raise ValueError(f"--target must be a llama checkpoint, got kind {kind!r} at {path}")
    return cfg, F.cast(params, jnp.float32)


def run(out: Path, *, stage: str = "all", target: Path | None = None, scale: str = "full",
        heads: tuple[str, ...] = HEAD_NAMES, deadline_s: float | None = None,
        model_budget_s: float | None = None, log: Callable[[str], None] = print) -> dict:
    """Train and export; returns the report (also written to ``out/report_<stage>.json``).

    ``deadline_s``: wall-clock budget of this call; a head that would not fit is skipped
    and listed in ``report["skipped"]``. ``model_budget_s``: per-model training budget
    (schedules shortened, ``trainer.train``).
    """
    if stage not in ("all", "target", "heads"):
        raise ValueError(f"stage must be 'all', 'target' or 'heads', got {stage!r}")
    if scale not in SCHEDULES:
        raise ValueError(f"scale must be one of {tuple(SCHEDULES)}, got {scale!r}")
    bad = [h for h in heads if h not in HEAD_NAMES]
    if bad:
        raise ValueError(f"heads must be among {HEAD_NAMES}, got {bad}")
    if stage == "heads" and target is None:
        raise ValueError("stage 'heads' needs target= (a trained target checkpoint directory)")
    sched = SCHEDULES[scale]
    smoke = scale == "smoke"
    t_start = time.perf_counter()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    corp = load_corpus(max_file_bytes=4096 if smoke else None)
    if smoke:
        corp.train, corp.heldout = corp.train[:20000], corp.heldout[:5000]
    report = {"versions": _versions(), "corpus": corp.stats, "scale": scale, "stage": stage,
              "models": {}, "skipped": []}
    if stage in ("all", "target"):
        cfg, params, rep = train_target(corp, sched["target"], smoke=smoke, log=log,
                                        time_budget_s=model_budget_s)
        export("target", "llama", "llama", cfg, params, out, rep)
        report["models"]["target"] = rep
        target = out / "target"
    if stage in ("all", "heads"):
        tcfg, tparams = load_target(target)          # exactly the exported (fp16) weights
        report["target_checkpoint"] = str(target)
        per_head: list[float] = []
        for name in heads:
            left = None if deadline_s is None else deadline_s - (time.perf_counter() - t_start)
            est = max(per_head) if per_head else 0.0
            if left is not None and est and left < 1.15 * est:
                log(f"[{name}] skipped: {left:.0f}s left, estimate {est:.0f}s")
                report["skipped"].append(name)
                continue
            t0 = time.perf_counter()
            kind, fmt, cfg, params, rep = train_head(name, tcfg, tparams, corp, sched[name],
                                                     smoke=smoke, log=log,
                                                     time_budget_s=model_budget_s)
            export(name, kind, fmt, cfg, params, out, rep)
            report["models"][name] = rep
            per_head.append(time.perf_counter() - t0)
    report["total_s"] = round(time.perf_counter() - t_start, 1)
    (out / f"report_{stage}.json").write_text(json.dumps(report, indent=1))
    return report


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m specjax.training.recipe", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path, help="output directory")
    ap.add_argument("--stage", default="all", choices=("all", "target", "heads"))
    ap.add_argument("--target", type=Path, help="trained target checkpoint (stage heads)")
    ap.add_argument("--scale", default="full", choices=tuple(SCHEDULES))
    ap.add_argument("--heads", default=",".join(HEAD_NAMES),
                    help=f"comma-separated subset of {','.join(HEAD_NAMES)}")
    ap.add_argument("--deadline-s", type=float, default=None,
                    help="skip heads that would not finish within this many seconds")
    ap.add_argument("--model-budget-s", type=float, default=None,
                    help="training-time budget per model (schedules shortened to fit)")
    a = ap.parse_args(argv)
    heads = tuple(h for h in a.heads.split(",") if h)
    try:
        rep = run(a.out, stage=a.stage, target=a.target, scale=a.scale, heads=heads,
                  deadline_s=a.deadline_s, model_budget_s=a.model_budget_s, log=lambda s: print(s, flush=True))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps({k: v.get("heldout") for k, v in rep["models"].items()}, indent=1))
    if rep["skipped"]:
        print("skipped (train them in another call): " + ",".join(rep["skipped"]))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    raise SystemExit(main())

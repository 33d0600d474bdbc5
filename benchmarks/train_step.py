"""Time one optimizer step of the demo recipe's models (GPU): the target LM with the
embedding as a gather vs a one-hot matmul (``forward.ONE_HOT_MAX_VOCAB``), and the
EAGLE-3 head (TTT depth 4) against the shipped target.

    python benchmarks/train_step.py [--steps 30]

ms/step = (elapsed at the last step - elapsed at step 1) / (steps - 1): compile excluded.
"""

from __future__ import annotations

import argparse
import json

import jax
import numpy as np

from specjax.training import forward as F
from specjax.training import recipe as R
from specjax.training.trainer import TrainConfig, train


def ms_per_step(hist) -> float:
    first, last = hist[0], hist[-1]
    return 1e3 * (last["elapsed_s"] - first["elapsed_s"]) / (last["step"] - first["step"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 128, 2_000_000).astype(np.int32)        # byte-like ids
    tokens[rng.random(tokens.size) < 0.3] = 32                        # a skewed, space-heavy mix
    out = {"device": jax.devices()[0].device_kind, "jax": jax.__version__}
    corp = R.Corpus(tokens, tokens[:100_000], {})
    full = R.SCHEDULES["full"]
    for label, vmax in (("target, gather embedding", 0), ("target, one-hot embedding", 4096)):
        F.ONE_HOT_MAX_VOCAB = vmax
        tc = TrainConfig(**{**full["target"].__dict__, "steps": a.steps, "log_every": a.steps - 1,
                            "warmup_steps": 1})
        cfg = R.registry.config_from_hf("llama", R.TARGET_HF)
        obj = R.O.target_lm(cfg)
        params = R.init_params("llama", cfg, jax.random.key(0))
        _, hist = train(obj, params, {}, tokens, tc, log=None)
        out[label] = round(ms_per_step(hist), 2)
        print(label, out[label], "ms/step", flush=True)
    tcfg, tparams = R.load_target(R.Path(R.__file__).parent.parent / "demo_models" / "target")
    for name in ("eagle3", "draft_model"):
        _, _, _, obj, params, frozen = R.head_setup(name, tcfg, tparams, corp)
        tc = TrainConfig(**{**full[name].__dict__, "steps": a.steps, "log_every": a.steps - 1,
                            "warmup_steps": 1})
        _, hist = train(obj, params, frozen, tokens, tc, log=None)
        out[name] = round(ms_per_step(hist), 2)
        print(name, out[name], "ms/step", flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()

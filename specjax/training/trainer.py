"""The training loop: AdamW (optax) with warm-up + cosine decay and gradient clipping, one
``jax.jit`` step with params and optimizer state donated, batches sampled on the device.

Also training initialization (``init_params``) and single-file safetensors params
checkpoints (``save_params`` / ``load_params``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from specjax.models import registry
from specjax.models.config import ModelConfig
from specjax.training.data import device_windows
from specjax.training.objectives import Objective


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Hyper-parameters of one training run: ``batch_size x seq_len`` tokens per step;
    ``lr`` peak after ``warmup_steps``, cosine decay to ``lr * final_lr_fraction``;
    ``weight_decay`` on matrices only; ``grad_clip`` global norm; ``log_every`` steps between
    metric fetches (the only host syncs); ``seed`` of batches and objective randomness."""

    steps: int
    batch_size: int
    seq_len: int
    lr: float = 3e-3
    warmup_steps: int = 100
    final_lr_fraction: float = 0.05
    weight_decay: float = 0.05
    grad_clip: float = 1.0
    b2: float = 0.95
    log_every: int = 100
    seed: int = 0

    def __post_init__(self):
        for name in ("steps", "batch_size", "seq_len", "log_every"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"TrainConfig.{name} must be a positive int, got {v!r}")
        if not self.lr > 0:
            raise ValueError(f"TrainConfig.lr must be > 0, got {self.lr!r}")
        if self.warmup_steps < 0 or self.warmup_steps >= self.steps:
            raise ValueError(f"TrainConfig.warmup_steps must be in [0, steps), got {self.warmup_steps}")
        if not 0 <= self.final_lr_fraction <= 1:
            raise ValueError(f"TrainConfig.final_lr_fraction must be in [0, 1], got {self.final_lr_fraction}")


def lr_at(tc: TrainConfig, step: jax.Array, total: jax.Array) -> jax.Array:
    """Linear warm-up to ``tc.lr`` over ``warmup_steps``, then cosine decay to
    ``lr * final_lr_fraction`` at step ``total`` (traced: ``total`` may be cut short)."""
    step = step.astype(jnp.float32)
    total = jnp.maximum(total.astype(jnp.float32), tc.warmup_steps + 1.0)
    warm = tc.lr * step / max(tc.warmup_steps, 1)
    frac = jnp.clip((step - tc.warmup_steps) / (total - tc.warmup_steps), 0.0, 1.0)
    cos = tc.lr * (tc.final_lr_fraction + (1 - tc.final_lr_fraction) * 0.5 * (1 + jnp.cos(jnp.pi * frac)))
    return jnp.where(step < tc.warmup_steps, warm, cos)


def make_optimizer(tc: TrainConfig):
    """Clip + AdamW at unit learning rate; :func:`train` scales the update by :func:`lr_at`."""
    import optax

    decay_mask = lambda p: jax.tree.map(lambda x: x.ndim >= 2, p)  # noqa: E731
    return optax.chain(optax.clip_by_global_norm(tc.grad_clip),
                       optax.adamw(1.0, b1=0.9, b2=tc.b2, weight_decay=tc.weight_decay,
                                   mask=decay_mask))


def train(objective: Objective, params: dict, frozen: dict, tokens: np.ndarray | jax.Array,
          tc: TrainConfig, *, log: Callable[[str], None] | None = print,
          name: str = "train", time_budget_s: float | None = None) -> tuple[dict, list[dict]]:
    """Train ``params`` on windows of ``tokens`` (1-D token ids) with ``objective``.

    ``time_budget_s``: when ``tc.steps`` would not fit (measured after the first steps),
    the run and its schedule are shortened to fit. Returns ``(params, history)``: the
    metrics of every ``log_every``-th and the last step, with ``step``, ``total_steps``
    and ``elapsed_s``.
    """
    import optax

    tokens = jnp.asarray(np.asarray(tokens).astype(np.int32) if isinstance(tokens, np.ndarray) else tokens)
    if tokens.ndim != 1 or tokens.shape[0] < tc.seq_len:
        raise ValueError(f"tokens must be 1-D with at least seq_len={tc.seq_len} ids, got shape {tokens.shape}")
    params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating)
                          else jnp.asarray(x), params)
    opt = make_optimizer(tc)
    opt_state = opt.init(params)
    base_key = jax.random.key(tc.seed)

    def step(params, opt_state, frozen, tokens, i, total):
        kb, ko = jax.random.split(jax.random.fold_in(base_key, i))
        batch = device_windows(tokens, kb, tc.batch_size, tc.seq_len)
        (loss, metrics), grads = jax.value_and_grad(objective, has_aux=True)(params, frozen, batch, ko)
        updates, opt_state = opt.update(grads, opt_state, params)
        lr = lr_at(tc, i, total)
        updates = jax.tree.map(lambda u: lr * u, updates)
        params = optax.apply_updates(params, updates)
        grad_norm = jnp.sqrt(sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for g in jax.tree.leaves(grads)))
        metrics = dict(metrics, grad_norm=grad_norm, lr=lr)
        return params, opt_state, metrics

    step = jax.jit(step, donate_argnums=(0, 1))
    history: list[dict] = []
    t0 = time.perf_counter()
    total = tc.steps
    probe = min(11, tc.steps - 1)          # steps 1..probe time the compiled step
    t1 = t0
    i = 0
    while i < total:
        params, opt_state, metrics = step(params, opt_state, frozen, tokens, jnp.int32(i),
                                          jnp.int32(total))
        if time_budget_s is not None and i in (1, probe) and probe > 1:
            jax.block_until_ready(metrics)
            now = time.perf_counter()
            if i == 1:
                t1 = now
            else:
                per_step = (now - t1) / (probe - 1)
                fits = int((time_budget_s - (now - t0)) / max(per_step, 1e-9)) + probe + 1
                if fits < total:
                    total = max(fits, tc.warmup_steps + 1, probe + 1)
                    if log is not None:
                        log(f"[{name}] {per_step * 1e3:.0f} ms/step: {tc.steps} steps do not fit "
                            f"in {time_budget_s:.0f}s; shortened to {total} (schedule ends there)")
        i += 1
        if i % tc.log_every == 0 or i == total or i == 1:
            row = {k: float(v) for k, v in metrics.items()}
            row.update(step=i, total_steps=total, elapsed_s=round(time.perf_counter() - t0, 2))
            history.append(row)
            if log is not None:
                show = " ".join(f"{k}={v:.4g}" for k, v in row.items() if k not in ("step", "elapsed_s"))
                log(f"[{name}] step {i}/{total} {row['elapsed_s']:.1f}s {show}")
            if not math.isfinite(row.get("loss", 0.0)):
                raise FloatingPointError(f"[{name}] loss is not finite at step {i}: {row}")
    return params, history


def evaluate(objective: Objective, params: dict, frozen: dict, tokens: np.ndarray, *,
             batch_size: int, seq_len: int, max_batches: int | None = None) -> dict:
    """Mean metrics of ``objective`` over consecutive (non-overlapping) windows of
    ``tokens`` — a deterministic held-out evaluation."""
    n = len(tokens) // seq_len
    wins = np.asarray(tokens[: n * seq_len], np.int32).reshape(n, seq_len)
    nb = n // batch_size
    if max_batches is not None:
        nb = min(nb, max_batches)
    if nb < 1:
        raise ValueError(f"tokens too short for one batch of {batch_size} x {seq_len}")
    fn = jax.jit(lambda p, b, k: objective(p, frozen, b, k)[1])
    sums: dict[str, float] = {}
    for i in range(nb):
        m = fn(params, jnp.asarray(wins[i * batch_size:(i + 1) * batch_size]), jax.random.key(i))
        for k, v in m.items():
            sums[k] = sums.get(k, 0.0) + float(v)
    return {k: v / nb for k, v in sums.items()}


# ------------------------------------------------------------------------------ init


def init_params(kind: str, config: ModelConfig, key: jax.Array, *, std: float = 0.02,
                overrides: dict[str, Any] | None = None) -> dict:
    """Training initialization (``registry.abstract_params`` structure): norms 1, biases 0,
    matrices N(0, std), ``o_proj`` / ``down_proj`` scaled by ``1/sqrt(2 L)``, Medusa
    ResBlocks 0 (identity heads). ``overrides``: top-level entries replaced as given."""
    abstract = registry.abstract_params(kind, config, jnp.float32)
    flat, treedef = jax.tree_util.tree_flatten_with_path(abstract)
    keys = jax.random.split(key, len(flat))
    n_layers = max(config.num_hidden_layers, 1)
    leaves = []
    for (path, leaf), k in zip(flat, keys):
        names = [getattr(p, "key", getattr(p, "idx", None)) for p in path]
        last = names[-1]
        if not jnp.issubdtype(leaf.dtype, jnp.floating):
            leaves.append(jnp.zeros(leaf.shape, leaf.dtype))
        elif last == "weight" or last == "bias":
            leaves.append((jnp.ones if last == "weight" else jnp.zeros)(leaf.shape, leaf.dtype))
        elif kind == "medusa" and "blocks" in names:
            leaves.append(jnp.zeros(leaf.shape, leaf.dtype))
        else:
            s = std / math.sqrt(2 * n_layers) if any(n in ("o_proj", "down_proj") for n in names) else std
            leaves.append(s * jax.random.normal(k, leaf.shape, leaf.dtype))
    params = jax.tree_util.tree_unflatten(treedef, leaves)
    for k, v in (overrides or {}).items():
        params[k] = v
    return params


# ------------------------------------------------------------------------------ checkpoints


def _flat(params: dict) -> dict[str, np.ndarray]:
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        key = "/".join(str(getattr(p, "key", getattr(p, "idx", p))) for p in path)
        out[key] = np.asarray(leaf)
    return out


def save_params(path: str | os.PathLike, params: dict, metadata: dict | None = None) -> Path:
    """Write ``params`` (any nested dict of arrays) as one safetensors file, atomically."""
    from safetensors.numpy import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        meta = {"specjax": json.dumps(metadata or {})}
        save_file(_flat(params), tmp, metadata=meta)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def load_params(path: str | os.PathLike) -> tuple[dict, dict]:
    """``(params, metadata)`` from :func:`save_params` (integer dict keys restored)."""
    from safetensors import safe_open

    params: dict = {}
    with safe_open(str(path), framework="numpy") as f:
        meta = json.loads((f.metadata() or {}).get("specjax", "{}"))
        for key in f.keys():
            node = params
            parts = [int(p) if p.isdigit() else p for p in key.split("/")]
            for p in parts[:-1]:
                node = node.setdefault(p, {})
            node[parts[-1]] = jnp.asarray(f.get_tensor(key))
    return params, meta


__all__ = ["TrainConfig", "train", "evaluate", "init_params", "make_optimizer",
           "save_params", "load_params"]

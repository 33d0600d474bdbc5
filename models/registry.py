"""Canonical checkpoint form -> params, table-driven (the interface of models/CANONICAL.md).

One tensor table per kind (:func:`tensor_table`, written in each model file) maps every
canonical tensor to its params path, PyTorch-layout shape and conversion (linear weights
transposed to ``[in, out]``, integer maps int32); ``expected_tensors``,
``params_from_tensors``, ``abstract_params`` and the random init all read it, so they agree.
Optional tensors follow the config's ``has_*`` flags (:func:`config_with_tensors`). The
P-EAGLE ``mask_hidden`` (:data:`MASK_HIDDEN`, flat ``[size]`` floats) lies outside the table.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from specjax.models import params as mp
from specjax.models.config import DECODER_KINDS, KINDS, ModelConfig
from specjax.models.hf_config import _PRESENCE, config_from_hf, config_to_dict
from specjax.models.tensors import Entry, layer_entries  # noqa: F401 - re-exported

__all__ = [
    "KINDS", "ModelConfig", "config_from_hf", "config_to_dict", "config_with_tensors",
    "expected_tensors", "params_from_tensors", "tensors_from_params", "abstract_params",
    "random_tensors", "init_params", "make_model", "tensor_table", "param_shape", "to_param",
    "from_param",
    "MASK_HIDDEN", "MASK_HIDDEN_KINDS", "mask_hidden_size", "mask_hidden_abstract", "check_params",
    "Pretrained",
]

# ---------------------------------------------------------------------------------------
# tensor table


def tensor_table(kind: str, config: ModelConfig) -> list[Entry]:
    """Every canonical tensor of ``kind`` under ``config``, required and optional."""
    if kind != config.kind:
        raise ValueError(f"kind {kind!r} does not match config.kind {config.kind!r}")
    if kind == "gemma3":
        from specjax.models.gemma3 import tensor_table as table
    elif kind == "qwen3_moe":
        from specjax.models.qwen3_moe import tensor_table as table
    elif kind == "gpt_oss":
        from specjax.models.gpt_oss import tensor_table as table
    elif kind in DECODER_KINDS:
        from specjax.models.llama import tensor_table as table
    elif kind == "eagle":
        from specjax.models.eagle import tensor_table as table
    elif kind in ("eagle3", "dflash"):
        from specjax.models.eagle3 import tensor_table as table
    elif kind == "dspark":
        from specjax.models.dspark import tensor_table as table
    elif kind == "medusa":
        from specjax.models.medusa import tensor_table as table
    elif kind == "mtp":
        from specjax.models.mtp import tensor_table as table
    else:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    return table(config)


def expected_tensors(kind: str, config: ModelConfig) -> dict[str, tuple[tuple[int, ...], bool]]:
    """Canonical key -> (PyTorch-layout shape, required)."""
    return {x.key: (x.shape, x.required) for x in tensor_table(kind, config)}


def config_with_tensors(kind: str, config: ModelConfig, names: Iterable[str]) -> ModelConfig:
    """``config`` with the ``has_*`` flags set from the canonical tensor names present."""
    names = set(names)
    flags = {x.flag: x.key in names for x in tensor_table(kind, config) if x.flag}
    return config.replace(**flags)


def _set(tree: dict, path: tuple, value) -> None:
    for p in path[:-1]:
        tree = tree.setdefault(p, {})
    tree[path[-1]] = value


def _included(x: Entry, config: ModelConfig) -> bool:
    if x.path is None:
        return False
    return x.required or bool(getattr(config, x.flag))


def param_shape(x: Entry) -> tuple[int, ...]:
    """The params-side shape of ``x`` (``linear`` reversed, ``experts*`` last axes swapped)."""
    if x.conv == "linear":
        return x.shape[::-1]
    if x.conv in ("experts", "experts_gate_up"):
        return x.shape[:-2] + (x.shape[-1], x.shape[-2])
    return x.shape


def to_param(w: np.ndarray, conv: str) -> np.ndarray:
    """PyTorch layout -> params layout (:class:`Entry`'s ``conv``); ``experts_gate_up``:
    ``[E, 2I, H]`` gate rows then up rows -> ``[E, H, 2I]`` columns interleaved."""
    if conv == "linear":
        return np.ascontiguousarray(w.T)
    if conv in ("experts", "experts_gate_up"):
        w = np.swapaxes(w, -1, -2)
        if conv == "experts_gate_up":
            e, h, n = w.shape
            w = w.reshape(e, h, 2, n // 2).swapaxes(-1, -2).reshape(e, h, n)
        return np.ascontiguousarray(w)
    return np.ascontiguousarray(w)


def from_param(w: np.ndarray, conv: str) -> np.ndarray:
    """The inverse of :func:`to_param` (params layout -> PyTorch layout)."""
    if conv == "experts_gate_up":
        e, h, n = w.shape
        w = w.reshape(e, h, n // 2, 2).swapaxes(-1, -2).reshape(e, h, n)
    if conv in ("experts", "experts_gate_up"):
        return np.ascontiguousarray(np.swapaxes(w, -1, -2))
    if conv == "linear":
        return np.ascontiguousarray(w.T)
    return np.ascontiguousarray(w)


def abstract_params(kind: str, config: ModelConfig, dtype=jnp.float32, *,
                    mask_hidden: bool = False) -> dict:
    """``jax.ShapeDtypeStruct`` pytree with the structure ``params_from_tensors`` builds.

    ``mask_hidden=True`` adds the optional top-level ``mask_hidden`` entry
    (:func:`mask_hidden_abstract`) of a P-EAGLE head; ValueError for a kind without one."""
    out: dict = {}
    for x in tensor_table(kind, config):
        if _included(x, config):
            _set(out, x.path, jax.ShapeDtypeStruct(param_shape(x),
                                                   jnp.int32 if x.conv == "int" else dtype))
    if mask_hidden:
        m = mask_hidden_abstract(kind, config, dtype)
        if m is None:
            raise ValueError(f"kind {kind!r} has no {MASK_HIDDEN!r} entry (kinds with one: "
                             f"{', '.join(MASK_HIDDEN_KINDS)})")
        out[MASK_HIDDEN] = m
    return out


# ---------------------------------------------------------------------------------------
# optional params entries outside the tensor table

#: The top-level params entry of a P-EAGLE checkpoint's parallel-drafting hidden state
#: (``models/eagle.py`` / ``models/eagle3.py``; the converters' ``extra_params``).
MASK_HIDDEN = "mask_hidden"
#: Kinds whose params may hold :data:`MASK_HIDDEN`.
MASK_HIDDEN_KINDS = ("eagle", "eagle3")


def mask_hidden_size(kind: str, config: ModelConfig) -> int | None:
    """Values ``params["mask_hidden"]`` holds (None for kinds without one): EAGLE-1
    ``hidden_size``, EAGLE-3 the fc input size ``num_aux * target_hidden_size``."""
    if kind != config.kind:
        raise ValueError(f"kind {kind!r} does not match config.kind {config.kind!r}")
    if kind == "eagle":
        return config.hidden_size
    if kind == "eagle3":
        return config.num_aux * (config.target_hidden_size or config.hidden_size)
    return None


def mask_hidden_abstract(kind: str, config: ModelConfig, dtype=jnp.float32):
    """``jax.ShapeDtypeStruct((size,), dtype)`` of ``mask_hidden``, None for kinds without."""
    size = mask_hidden_size(kind, config)
    return None if size is None else jax.ShapeDtypeStruct((size,), dtype)


def params_from_tensors(kind: str, config: ModelConfig, tensors: Mapping[str, np.ndarray],
                        dtype=jnp.float32) -> dict:
    """Canonical tensors (PyTorch layout) -> params dict of ``jax.Array``.

    Linear weights are transposed to ``[in, out]``; float tensors are cast to ``dtype``
    (None keeps each tensor's dtype); integer maps become int32. Raises ValueError naming
    any unknown, missing or mis-shaped key, or an optional tensor that contradicts a
    ``has_*`` flag of the config.
    """
    table = tensor_table(kind, config)
    known = {x.key for x in table}
    unknown = sorted(set(tensors) - known)
    if unknown:
        raise ValueError(f"unknown tensors for kind {kind!r}: {unknown[:10]}")
    missing = sorted(x.key for x in table if x.required and x.key not in tensors)
    if missing:
        raise ValueError(f"missing tensors for kind {kind!r}: {missing[:10]}")
    out: dict = {}
    for x in table:
        if x.key not in tensors:
            if x.flag and getattr(config, x.flag):
                raise ValueError(f"missing tensor {x.key!r} (config sets {x.flag}=True)")
            continue
        if x.flag and getattr(config, x.flag) is False:
            raise ValueError(f"tensor {x.key!r} is present but the config sets {x.flag}=False")
        w = np.asarray(tensors[x.key])
        shape = tuple(w.shape)
        if kind == "medusa" and x.conv == "linear" and "lm_head" in x.key and "token_map" in tensors \
                and shape == (config.vocab_size, config.hidden_size) != x.shape:
            w = w[np.asarray(tensors["token_map"], np.int64)]   # full head sliced to the kept rows
            shape = tuple(w.shape)
        if shape != x.shape:
            raise ValueError(f"tensor {x.key!r} has shape {shape}, expected {x.shape}")
        if x.path is None:
            continue
        # cast and transpose on the host: eager device ops would compile once per shape
        if x.conv == "int":
            w = w.astype(np.int32)
        else:
            if dtype is not None:
                w = w.astype(np.dtype(dtype))
            w = to_param(w, x.conv)
        _set(out, x.path, jnp.asarray(w))
    return out


#: Top-level params entries a head may borrow from its target (``share_target_weights``).
_SHARED = ("embed_tokens", "lm_head")


def _leaf_paths(tree, prefix: tuple = ()) -> dict[tuple, Any]:
    """Flatten a params dict to ``{path: leaf}``; digit-string keys (an orbax restore
    without a target) become ints, as in the tensor table."""
    if not isinstance(tree, Mapping):
        return {prefix: tree}
    out: dict[tuple, Any] = {}
    for k, v in tree.items():
        k = int(k) if isinstance(k, str) and k.isdigit() else k
        out.update(_leaf_paths(v, prefix + (k,)))
    return out


def _dotted(path: tuple) -> str:
    return ".".join(str(p) for p in path)


def tensors_from_params(kind: str, config: ModelConfig, params: Mapping) -> dict[str, np.ndarray]:
    """Params dict -> canonical tensors (PyTorch layout), the exact inverse of
    :func:`params_from_tensors` with ``dtype=None`` (floats keep their dtype).

    Emits exactly the entries :func:`abstract_params` expects; fused projections are split,
    shared target ``embed_tokens`` / ``lm_head`` entries skipped. Any other missing,
    unexpected, mis-shaped or mis-typed leaf raises ValueError naming it.
    """
    if mp.is_fused(params):            # fuse_projections' layout: the checkpoint's again
        params = mp.unfuse_projections(dict(params), config)
    table = tensor_table(kind, config)
    owned = [x for x in table if _included(x, config)]
    owned_roots = {x.path[0] for x in owned}
    leaves = _leaf_paths(params)
    missing = [_dotted(x.path) for x in owned if x.path not in leaves]
    wanted = {x.path for x in owned}
    unexpected = sorted(_dotted(p) for p in leaves
                        if p not in wanted and not (p and p[0] in _SHARED and p[0] not in owned_roots))
    if missing or unexpected:
        parts = ([f"missing {missing}"] if missing else []) + ([f"unexpected {unexpected}"] if unexpected else [])
        raise ValueError(f"params do not match the {kind} config: " + "; ".join(parts))
    out: dict[str, np.ndarray] = {}
    for x in owned:
        w = np.asarray(leaves[x.path])
        want = param_shape(x)
        if tuple(w.shape) != tuple(want):
            raise ValueError(f"param {_dotted(x.path)!r} has shape {tuple(w.shape)}, expected {want} "
                             f"(tensor {x.key!r})")
        is_int = np.issubdtype(w.dtype, np.integer)
        if (x.conv == "int") != is_int or w.dtype == np.bool_:
            raise ValueError(f"param {_dotted(x.path)!r} has dtype {w.dtype}, expected "
                             f"{'an integer' if x.conv == 'int' else 'a float'} dtype")
        if x.conv == "int":
            if w.size and (w.max() > np.iinfo(np.int32).max or w.min() < np.iinfo(np.int32).min):
                raise ValueError(f"param {_dotted(x.path)!r}: values do not fit in int32")
            out[x.key] = w.astype(np.int32)
        else:
            out[x.key] = from_param(w, x.conv)
    return out


# ---------------------------------------------------------------------------------------
# random weights (tests)


def random_tensors(kind: str, config: ModelConfig, seed: int = 0,
                   dtype=np.float32) -> dict[str, np.ndarray]:
    """Random canonical tensors (PyTorch layout) for the tensors :func:`abstract_params`
    expects; norm weights ``1 + 0.1 N(0, 1)`` so a missing norm shows up."""
    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}
    for x in tensor_table(kind, config):
        if not (x.required or (x.flag and getattr(config, x.flag))):
            continue
        if x.conv == "int":
            n = x.shape[0]
            ids = np.sort(rng.choice(config.vocab_size, size=n, replace=False))
            out[x.key] = (ids - np.arange(n) if x.key == "d2t" else ids).astype(np.int32)
        elif x.key.endswith("norm.weight") or "_norm." in x.key or "layernorm" in x.key:
            out[x.key] = (1 + 0.1 * rng.standard_normal(x.shape)).astype(dtype)
        elif x.key.endswith(".bias"):
            out[x.key] = (0.1 * rng.standard_normal(x.shape)).astype(dtype)
        elif x.conv in ("linear", "experts", "experts_gate_up"):
            out[x.key] = (rng.standard_normal(x.shape) / np.sqrt(x.shape[-1])).astype(dtype)
        else:
            out[x.key] = rng.standard_normal(x.shape).astype(dtype)
    return out


def init_params(kind: str, config: ModelConfig, rng: int | jax.Array = 0, dtype=jnp.float32) -> dict:
    """Random params (tests): ``params_from_tensors(random_tensors(...))``. ``rng``: an int
    seed or a PRNG key (its first word seeds NumPy)."""
    if not isinstance(rng, (int, np.integer)):
        rng = int(jax.random.randint(rng, (), 0, 2**31 - 1))
    return params_from_tensors(kind, config, random_tensors(kind, config, int(rng)), dtype)


# ---------------------------------------------------------------------------------------
# models


def make_model(kind: str, config: ModelConfig, **static: Any):
    """The runner of ``kind`` (a frozen, hashable object with ``forward`` / ``compute_logits``).

    ``static``: ``aux_layer_ids=`` for decoder kinds (layers whose input ``forward`` returns).
    """
    from specjax.models.dflash import DFlashHead
    from specjax.models.eagle import EagleHead
    from specjax.models.eagle3 import Eagle3Head
    from specjax.models.llama import DecoderLM
    from specjax.models.medusa import MedusaHeads
    from specjax.models.mtp import MTPHead

    if kind != config.kind:
        raise ValueError(f"kind {kind!r} does not match config.kind {config.kind!r}")
    if kind == "gemma3":
        from specjax.models.gemma3 import Gemma3LM
        return Gemma3LM(config, **static)
    if kind == "qwen3_moe":
        from specjax.models.qwen3_moe import Qwen3MoeLM
        return Qwen3MoeLM(config, **static)
    if kind == "gpt_oss":
        from specjax.models.gpt_oss import GptOssLM
        return GptOssLM(config, **static)
    if kind in DECODER_KINDS:
        return DecoderLM(config, **static)
    if kind == "dspark":
        from specjax.models.dspark import DSparkHead
        return DSparkHead(config, **static)
    cls = {"eagle": EagleHead, "eagle3": Eagle3Head, "dflash": DFlashHead, "medusa": MedusaHeads,
           "mtp": MTPHead}[kind]
    return cls(config, **static)


class Pretrained(NamedTuple):
    """A loaded checkpoint: ``kind`` (a key of ``KINDS``), its ``ModelConfig`` and params;
    what ``specjax.load_pretrained`` returns and ``generate`` / ``make_proposer`` take."""

    kind: str
    config: ModelConfig
    params: Any

    @property
    def model(self):
        """The runner of this checkpoint (:func:`make_model`)."""
        return make_model(self.kind, self.config)


def check_params(kind: str, config: ModelConfig, params: Any, *, name: str = "params",
                 shared_ok: bool = False) -> None:
    """ValueError naming ``name`` and the first leaves that do not match
    :func:`abstract_params` (shapes only). ``shared_ok``: a head's ``embed_tokens`` /
    ``lm_head`` may be absent or present regardless of the config."""
    if not isinstance(params, Mapping):
        raise TypeError(f"{name} must be a params dict, got {type(params).__name__}")
    abstract = abstract_params(kind, config,
                               mask_hidden=MASK_HIDDEN in params and kind in MASK_HIDDEN_KINDS)
    want = _leaf_paths(mp.fuse_projections(abstract) if mp.is_fused(params) else abstract)
    got = _leaf_paths(params)
    skip = lambda p: bool(p) and p[0] in _SHARED and (shared_ok or kind not in DECODER_KINDS)  # noqa: E731
    missing = sorted(_dotted(p) for p in want if p not in got and not skip(p))
    unexpected = sorted(_dotted(p) for p in got if p not in want and not skip(p))
    bad = [f"{_dotted(p)} {tuple(getattr(got[p], 'shape', ()))} != {tuple(want[p].shape)}"
           for p in want if p in got and tuple(getattr(got[p], "shape", ())) != tuple(want[p].shape)]
    if missing or unexpected or bad:
        parts = ([f"missing {missing[:5]}"] if missing else []) + \
                ([f"unexpected {unexpected[:5]}"] if unexpected else []) + \
                ([f"wrong shape {bad[:5]}"] if bad else [])
        raise ValueError(f"{name} do not match the {kind} config (built for another config?): "
                         + "; ".join(parts))

"""Machinery shared by every model: params <-> NNX module, embedding and LM-head math.

Each model's *body* is an NNX module rebuilt from its params sub-dict at trace time
(:func:`merge`). Embedding, LM head and vocabulary maps (:data:`SHARED_KEYS`) stay plain
params entries, because they may be the target's arrays, shared as vLLM shares them.
"""

from __future__ import annotations

import math

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

#: Top-level params entries handled functionally (not part of any NNX body).
SHARED_KEYS = ("embed_tokens", "lm_head", "lm_heads", "d2t", "token_map")


@functools.lru_cache(maxsize=None)
def module_graph(factory: Callable[..., nnx.Module], *args: Any):
    """``(graphdef, treedef, abstract pure dict)`` of ``factory(*args, rngs=...)`` (cached)."""
    module = nnx.eval_shape(lambda: factory(*args, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(module)
    return graphdef, jax.tree.structure(state), nnx.to_pure_dict(state)


def normalize_keys(tree: Any) -> Any:
    """Digit-string dict keys -> int (orbax restores without a target give string keys)."""
    if isinstance(tree, dict):
        return {(int(k) if isinstance(k, str) and k.isdigit() else k): normalize_keys(v)
                for k, v in tree.items()}
    return tree


def body_params(params: dict) -> dict:
    return {k: v for k, v in params.items() if k not in SHARED_KEYS}


def merge(factory: Callable[..., nnx.Module], args: tuple, params: dict) -> nnx.Module:
    """Rebuild the NNX module ``factory(*args)`` with the arrays of ``params`` (its body);
    ValueError naming missing / unexpected entries. A fused group's matrix goes to its first
    projection, the others get empty ``[in, 0]`` kernels ("fused here")."""
    graphdef, treedef, abstract = module_graph(factory, *args)
    body = _spread_fused(normalize_keys(body_params(params)))
    got = jax.tree.structure(body)
    want = jax.tree.structure(abstract)
    if got != want:
        have = {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(body)[0]}
        need = {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(abstract)[0]}
        raise ValueError(
            f"params do not match the {getattr(factory, '__name__', factory)} structure: "
            f"missing {sorted(need - have)[:8]}, unexpected {sorted(have - need)[:8]}"
        )
    return nnx.merge(graphdef, jax.tree.unflatten(treedef, jax.tree.leaves(body)))


#: The projection groups :func:`fuse_projections` concatenates (output columns in this
#: order), under the fused name. vLLM's ``QKVParallelLinear`` / ``MergedColumnParallelLinear``.
FUSED_GROUPS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def fuse_projections(params: Any) -> Any:
    """``params`` with every ``q_proj`` / ``k_proj`` / ``v_proj`` triple as one ``qkv_proj``
    and every ``gate_proj`` / ``up_proj`` pair as one ``gate_up_proj`` (concatenated along the
    output axis; other entries the same objects; NumPy stays NumPy; idempotent).

    The same forward in one GEMM per group (docs/performance.md, "Fused projections"). For
    one device only: ``specjax.sharding`` refuses it; :func:`unfuse_projections` inverts it."""
    if not isinstance(params, dict):
        return params
    out = {k: fuse_projections(v) for k, v in params.items()}
    changed = any(out[k] is not v for k, v in params.items())
    for fused, parts in FUSED_GROUPS.items():
        if not all(isinstance(out.get(p), dict) and "kernel" in out[p] for p in parts):
            continue
        has_bias = ["bias" in out[p] for p in parts]
        if (any(has_bias) and not all(has_bias)) or any(set(out[p]) - {"kernel", "bias"} for p in parts):
            continue                                 # not a plain Linear group: left as it is
        group = {"kernel": _concat([out[p]["kernel"] for p in parts])}
        if all(has_bias):
            group["bias"] = _concat([out[p]["bias"] for p in parts])
        for p in parts:
            del out[p]
        out[fused] = group
        changed = True
    return out if changed else params


def unfuse_projections(params: Any, config) -> Any:
    """The inverse of :func:`fuse_projections` for a model of ``config`` (anything with the
    ModelConfig head and MLP sizes); ValueError for a width that does not match."""
    if not isinstance(params, dict):
        return params
    out = {k: unfuse_projections(v, config) for k, v in params.items()}
    hd = config.head_dim
    widths = {"qkv_proj": (config.num_attention_heads * hd, config.num_key_value_heads * hd,
                           config.num_key_value_heads * hd),
              "gate_up_proj": (config.intermediate_size, config.intermediate_size)}
    for fused, parts in FUSED_GROUPS.items():
        if fused not in out:
            continue
        group = out.pop(fused)
        n = group["kernel"].shape[-1]
        if n != sum(widths[fused]):
            raise ValueError(f"{fused} has {n} output columns; this config's {'/'.join(parts)} "
                             f"need {' + '.join(map(str, widths[fused]))}")
        for name, arr in group.items():
            for p, part in zip(parts, split_fused(arr, widths[fused])):
                out.setdefault(p, {})[name] = part
    return out


def is_fused(params: Any) -> bool:
    """Whether any projection group of ``params`` is fused (:func:`fuse_projections`)."""
    if not isinstance(params, dict):
        return False
    return any(k in FUSED_GROUPS for k in params) or any(is_fused(v) for v in params.values())


def _concat(arrays):
    if all(isinstance(a, jax.ShapeDtypeStruct) for a in arrays):     # abstract params
        return jax.ShapeDtypeStruct(arrays[0].shape[:-1] + (sum(a.shape[-1] for a in arrays),),
                                    arrays[0].dtype)
    xp = np if all(isinstance(a, np.ndarray) for a in arrays) else jnp
    return xp.concatenate(arrays, axis=-1)


def split_fused(y, widths: tuple[int, ...]) -> list:
    """A fused projection's output (or its kernel / bias) ``[..., sum(widths)]`` as its
    parts, in order (NumPy stays NumPy)."""
    bounds = np.cumsum(widths)[:-1].tolist()
    xp = np if isinstance(y, np.ndarray) else jnp
    return xp.split(y, bounds, axis=-1)


def _spread_fused(body: Any) -> Any:
    """Fused groups as the module's structure (see :func:`merge`)."""
    if not isinstance(body, dict):
        return body
    out = {k: _spread_fused(v) for k, v in body.items()}
    for fused, parts in FUSED_GROUPS.items():
        if fused not in out:
            continue
        group = out.pop(fused)
        out[parts[0]] = group
        for p in parts[1:]:
            out[p] = {name: jnp.zeros(arr.shape[:-1] + (0,), arr.dtype)
                      for name, arr in group.items()}
    return out


def is_fused_kernel(linear) -> bool:
    """Whether this ``Linear`` holds an empty ``[in, 0]`` kernel (fused, :func:`merge`)."""
    return linear.kernel[...].shape[-1] == 0


def need(params: dict, key: str, what: str) -> Any:
    if key not in params:
        raise ValueError(
            f"params lack {key!r} ({what}); this checkpoint shares it with the target: "
            "call specjax.models.share_target_weights(head_params, target_params) first"
        )
    return params[key]


def embed_table(params: dict) -> jax.Array:
    return need(params, "embed_tokens", "the token embedding")["embedding"]


def embed(params: dict, input_ids: jax.Array) -> jax.Array:
    """``input_ids [T] int32`` -> ``[T, H]`` rows of ``params['embed_tokens']['embedding']``."""
    return jnp.take(embed_table(params), input_ids, axis=0)


def two_row_matmul(fn, x: jax.Array) -> jax.Array:
    """``fn(x)`` for a row-wise ``fn`` (a matmul over the last axis); when ``x [..., K]``
    holds one row, run on that row duplicated behind an optimization barrier on a GPU.

    XLA:GPU lowers a one-row dot to a slow multiply + reduce; two rows get a GEMM (same
    values). On a CPU the one-row product is faster, so the choice is per platform at
    lowering time (``jax.lax.platform_dependent``; docs/models.md, "One-row products").
    """
    if math.prod(x.shape[:-1]) != 1:
        return fn(x)

    def two_rows(x):
        x2 = jax.lax.optimization_barrier(jnp.concatenate([x.reshape(1, x.shape[-1])] * 2))
        y = fn(x2)[:1]
        return y.reshape(x.shape[:-1] + y.shape[-1:])

    return jax.lax.platform_dependent(x, cpu=fn, default=two_rows)


def lm_head_logits(head: dict, hidden: jax.Array) -> jax.Array:
    """``hidden [..., H]`` -> float32 logits with ``head = {'kernel': [H, V]}`` (own head) or
    ``{'embedding': [V, H]}`` (tied / shared embedding, never transposed in memory)."""
    return two_row_matmul(lambda x: _lm_head_logits(head, x), hidden)


def _lm_head_logits(head: dict, hidden: jax.Array) -> jax.Array:
    if "kernel" in head:
        out = jnp.einsum("...h,hv->...v", hidden, head["kernel"], preferred_element_type=jnp.float32)
        if "bias" in head:
            out = out + head["bias"].astype(jnp.float32)
        return out
    return jnp.einsum("...h,vh->...v", hidden, head["embedding"], preferred_element_type=jnp.float32)


def scatter_vocab(logits: jax.Array, target_ids: jax.Array, vocab_size: int) -> jax.Array:
    """Reduced-vocab logits ``[N, Vd]`` -> ``[N, vocab_size]``, ``-inf`` where no draft id maps."""
    out = jnp.full(logits.shape[:-1] + (vocab_size,), -jnp.inf, logits.dtype)
    return out.at[..., target_ids].set(logits)

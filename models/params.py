"""Machinery shared by every model: params <-> NNX module, embedding and LM-head math.

Params are plain nested dicts of ``jax.Array`` (see the package docstring). Each model
keeps its *body* (layers, norms, fc, ...) as an NNX module; inside a traced function the
body's sub-dict is merged back into the module with :func:`merge` (trace-time only: under
``jax.jit`` nothing of NNX is left in the compiled step). Embedding, LM head and vocabulary
maps (``embed_tokens``, ``lm_head``, ``d2t``, ``token_map``) stay outside the module, as
plain entries of the params dict, because they may be the target's arrays (shared, as
vLLM shares them) rather than the head's own.
"""

from __future__ import annotations

import math

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
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
    """Rebuild the NNX module ``factory(*args)`` with the arrays of ``params`` (its body)."""
    graphdef, treedef, abstract = module_graph(factory, *args)
    body = normalize_keys(body_params(params))
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
    """``fn(x)`` for a row-wise ``fn`` (a matmul over the last axis), run on two rows when
    ``x`` holds one (``x [..., K]`` with one row in all).

    XLA rewrites a dot whose other side has one row (``[1, K] @ [K, N]``) as a multiply and
    a reduce (dot strength reduction), and on the H200 those reduce fusions run far slower
    than the GEMM kernel two rows get: in the 8B-shaped one-token step they cost 1.1 ms of
    5.6 ms of kernels (benchmarks/RESULTS.md). Here the row is duplicated behind an
    optimization barrier (so the simplifier cannot see that the rows are equal) and the
    first row of the result returned: the same values, one GEMM. Every model matmul goes
    through this (:class:`specjax.models.layers.Linear`, :func:`lm_head_logits`), so the
    one-token program is fast for every caller, the models used directly included.
    """
    if math.prod(x.shape[:-1]) != 1:
        return fn(x)
    x2 = jax.lax.optimization_barrier(jnp.concatenate([x.reshape(1, x.shape[-1])] * 2))
    y = fn(x2)[:1]
    return y.reshape(x.shape[:-1] + y.shape[-1:])


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

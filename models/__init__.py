"""Flax NNX models of specjax: the Llama-family decoder and every draft head.

Params are plain nested dicts of ``jax.Array`` (``nnx.to_pure_dict`` form, int layer keys,
linear kernels ``[in, out]``); nothing else crosses a ``jax.jit`` boundary. Every model is a
frozen, hashable runner (``registry.make_model(kind, config)``) whose methods are pure
functions of ``(params, arrays..., kv_caches, attn_metadata)``; KV caches are per-layer
``KVCache(k, v)``, each ``[num_blocks, block_size, num_kv_heads, head_dim]``. Every runner's
methods and shapes: docs/models.md.
"""

from __future__ import annotations

from specjax.kernels.paged_attention import KVCache, init_kv_caches, paged_attention, write_kv
from specjax.models.config import KINDS, ModelConfig
from specjax.models.dflash import DFlashHead
from specjax.models.eagle import EagleHead
from specjax.models.eagle3 import Eagle3Head
from specjax.models.extract_hidden_states import ExtractHiddenStates
from specjax.models.gemma3 import Gemma3LM
from specjax.models.llama import DecoderLM
from specjax.models.medusa import MedusaHeads
from specjax.models.mtp import MTPHead
from specjax.models.params import fuse_projections, unfuse_projections
from specjax.models.registry import (
    Pretrained,
    abstract_params,
    config_from_hf,
    config_to_dict,
    expected_tensors,
    init_params,
    make_model,
    params_from_tensors,
    tensors_from_params,
)


def _same(a, b) -> bool:
    """Both concrete arrays, same shape, equal values (a traced array compares False)."""
    import jax
    import numpy as np

    if isinstance(a, dict) or isinstance(b, dict):
        return (isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys()
                and all(_same(a[k], b[k]) for k in a))
    if a is b:
        return True
    if isinstance(a, jax.core.Tracer) or isinstance(b, jax.core.Tracer):
        return False
    if getattr(a, "shape", None) != getattr(b, "shape", None):
        return False
    if isinstance(a, jax.Array) and isinstance(b, jax.Array):
        import jax.numpy as jnp

        return bool(jnp.array_equal(a, b))      # on the device: no host copy of [V, H]
    return bool(np.array_equal(np.asarray(a), np.asarray(b)))


def share_target_weights(head_params: dict, target_params: dict, *, kind: str | None = None) -> dict:
    """A new head params dict with the target's ``embed_tokens`` / ``lm_head`` (the same
    arrays; a tied target's head as ``{"embedding": [V, H]}``) where the head has none or
    one equal to the target's, as vLLM's ``_maybe_share_embeddings`` /
    ``_maybe_share_lm_head``. ``kind`` is ignored."""
    del kind
    out = dict(head_params)
    emb = target_params["embed_tokens"]
    if "embed_tokens" not in out or _same(out["embed_tokens"], emb):
        out["embed_tokens"] = emb
    head = target_params.get("lm_head") or {"embedding": emb["embedding"]}
    if "lm_head" not in out or _same(out["lm_head"], head):
        out["lm_head"] = head
    return out


__all__ = [
    "KINDS", "ModelConfig", "KVCache", "init_kv_caches", "paged_attention", "write_kv",
    "DecoderLM", "Gemma3LM", "EagleHead", "Eagle3Head", "DFlashHead", "MedusaHeads", "MTPHead",
    "ExtractHiddenStates",
    "config_from_hf", "config_to_dict", "expected_tensors", "params_from_tensors",
    "tensors_from_params",
    "abstract_params", "init_params", "make_model", "share_target_weights", "Pretrained",
    "fuse_projections", "unfuse_projections",
]

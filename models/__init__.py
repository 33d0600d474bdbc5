"""Flax NNX models of specjax: the Llama-family decoder and every draft head.

**Params are plain nested dicts of ``jax.Array``** everywhere in specjax: the pure-dict form
of the NNX body state (``nnx.to_pure_dict``), plus the functional entries
``embed_tokens`` / ``lm_head`` / ``d2t`` / ``token_map``. Layer indices are int keys
(``params["layers"][0]``); digit-string keys (an orbax restore without a target) are
accepted too. Linear kernels are ``[in, out]``. Nothing else (no ``nnx.State``, no
``nnx.Variable``) crosses a ``jax.jit`` boundary: each model merges its params back into
its NNX module inside the traced function, at trace time only.

Every model is a frozen, hashable runner built from a static ``ModelConfig``
(``registry.make_model(kind, config)``) whose methods are pure functions of
``(params, arrays..., kv_caches, attn_metadata)``: jit them with the runner closed over
(or static) and donate the caches. KV caches are lists of per-layer ``KVCache(k, v)``,
each ``[num_blocks, block_size, num_kv_heads, head_dim]``.

=====================  ==================================================================
runner                 methods
=====================  ==================================================================
``DecoderLM``          ``forward(params, input_ids, positions, kv_caches, md)
                       -> (hidden [T,H] post-norm, aux [T,n_aux,H] | None, kv_caches)``;
                       ``compute_logits(params, hidden [N,H]) -> [N,V]``
``EagleHead``          ``forward(params, input_ids, positions, hidden [T,H], kv_caches, md)
                       -> (out, out, kv_caches)``; ``compute_logits``
``Eagle3Head``         ``combine_hidden_states(params, aux) -> g [T,H]``;
                       ``forward(params, input_ids, positions, g, kv_caches, md)
                       -> (normed, prenorm, kv_caches)``; ``compute_logits`` (target vocab),
                       ``compute_draft_logits``, ``draft_to_target_ids``
``DFlashHead``         ``combine_hidden_states``; ``precompute_and_store_context_kv(params,
                       ctx [Tc,H], positions, slot_mapping, kv_caches) -> kv_caches``;
                       ``forward(params, input_ids, positions, kv_caches, md)
                       -> (hidden, kv_caches)``; ``compute_logits``
``MedusaHeads``        ``forward(params, hidden [T,H]) -> [K,T,H]``;
                       ``compute_logits(params, [K,N,H]) -> [K,N,V]``
``MTPHead``            ``forward(params, input_ids, positions, hidden [T,H], kv_caches, md)
                       -> (o, o, kv_caches)`` (MiMo MTP, post-norm ``o``); ``compute_logits``
``ExtractHiddenStates`` ``forward(params, aux [T,n_aux,H], kv_caches, md) -> kv_caches``
=====================  ==================================================================

Heads whose checkpoint lacks the embedding or lm_head (or has a copy equal to the
target's) use the target's, as vLLM v0.20 does: ``share_target_weights(head_params,
target_params)``; a head whose own copy differs keeps it.
"""

from __future__ import annotations

from specjax.kernels.paged_attention import KVCache, init_kv_caches, paged_attention, write_kv
from specjax.models.config import KINDS, ModelConfig
from specjax.models.dflash import DFlashHead
from specjax.models.eagle import EagleHead
from specjax.models.eagle3 import Eagle3Head
from specjax.models.extract_hidden_states import ExtractHiddenStates
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
    arrays, never copied; a tied target's head is its embedding, passed as
    ``{"embedding": [V, H]}``) where the head has none, or has one equal to the target's
    (vLLM v0.20 ``_maybe_share_embeddings`` / ``_maybe_share_lm_head``: a head whose own
    copy differs keeps it, EAGLE-1 included). ``kind`` is accepted for compatibility and
    does not change the rule."""
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
    "DecoderLM", "EagleHead", "Eagle3Head", "DFlashHead", "MedusaHeads", "MTPHead",
    "ExtractHiddenStates",
    "config_from_hf", "config_to_dict", "expected_tensors", "params_from_tensors",
    "tensors_from_params",
    "abstract_params", "init_params", "make_model", "share_target_weights", "Pretrained",
    "fuse_projections", "unfuse_projections",
]

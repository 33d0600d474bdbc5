"""Extract-hidden-states "model" (vLLM ``extract_hidden_states.py``): a cache-only layer.

It has no weights. It stores the target's stacked aux states ``[T, n_aux, H]`` into a
KV-like paged cache ``[num_blocks, block_size, n_aux, H]`` through the slot mapping (slot
-1 dropped) and returns nothing else; a KV connector reads them from there.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax.attention_metadata import CommonAttentionMetadata
from specjax.kernels.paged_attention import scatter_slots


@dataclasses.dataclass(frozen=True)
class ExtractHiddenStates:
    """``num_hidden_states`` = len(eagle_aux_hidden_state_layer_ids); ``hidden_size`` of the target."""

    num_hidden_states: int
    hidden_size: int

    def forward(self, params: dict, hidden_states: jax.Array, kv_caches: list[jax.Array],
                attn_metadata: CommonAttentionMetadata) -> list[jax.Array]:
        """``hidden_states [T, n_aux, H]``; ``kv_caches``: one ``[num_blocks, block_size,
        n_aux, H]`` array. Returns the updated cache list (``params`` is ``{}``)."""
        del params
        return [scatter_slots(kv_caches[0], hidden_states, attn_metadata.slot_mapping)]

    def init_kv_caches(self, num_blocks: int, block_size: int, dtype=jnp.float32) -> list[jax.Array]:
        return [jnp.zeros((num_blocks, block_size, self.num_hidden_states, self.hidden_size), dtype)]

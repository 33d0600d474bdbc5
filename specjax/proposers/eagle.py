"""EAGLE / EAGLE-3 chain drafting (vLLM ``llm_base_proposer.py`` + ``eagle.py``).

A frozen, hashable configuration object plus pure functions. ``propose`` is one
``jax.jit`` (configuration static, state donated): the first forward over the target's
batch, greedy sampling at ``token_indices_to_sample``, then ``k - 1`` single-token steps
in a ``lax.fori_loop`` (slot mapping and seq_lens advanced by
``eagle_step_update_slot_mapping_and_metadata``). No host round trip, no Python loop over
requests, no recompilation inside a shape bucket.

Supported here: chain drafting for ``eagle`` and ``eagle3``, padded-batch mode
(``num_rejected_tokens`` given: rejected tokens stay as padding and ``seq_lens`` shrink
before the chain) and the non-padded mode (``prepare_inputs`` on the host). Parallel
drafting and tree drafting are refused at construction with a clear error until they
exist.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

import specjax.kernels as K
from specjax.attention import CommonAttentionMetadata
from specjax.config import SpeculativeConfig
from specjax.constants import check_index_range
from specjax.metadata import SpecDecodeMetadata
from specjax.models.eagle import EagleHead
from specjax.models.eagle3 import Eagle3Head
from specjax.proposers.base import DRAFT_PADDING_ID, DraftOutput, ProposerInputs

_I32 = jnp.int32


class EagleState(NamedTuple):
    """Every buffer the proposer owns: the draft model's paged KV cache (one
    ``KVCache`` per draft layer, ``[num_blocks, block_size, n_kv, head_dim]``), laid out
    by the same block table as the target's cache."""

    kv_caches: Any


@dataclasses.dataclass(frozen=True)
class EagleProposer:
    """EAGLE-1/2 or EAGLE-3 chain proposer.

    Attributes:
      config: a ``SpeculativeConfig`` with ``method`` ``"eagle"`` or ``"eagle3"``.
      model: the head runner (``EagleHead`` / ``Eagle3Head``), params passed to ``propose``
        with the target's embedding / lm_head shared in where the head has none
        (``specjax.models.share_target_weights``).
      block_size, max_model_len: of the KV cache / the model.
      kernel_backend: backend of the index kernels (``"auto"``, ``"xla"``, ...).
    """

    config: SpeculativeConfig
    model: EagleHead | Eagle3Head
    block_size: int
    max_model_len: int
    kernel_backend: str = "auto"

    #: What a serving loop must feed (see ``ProposerInputs``).
    needs_hidden_states = True
    runs_on = "device"

    def __post_init__(self) -> None:
        cfg = self.config
        if not isinstance(cfg, SpeculativeConfig):
            raise ValueError(f"config must be a SpeculativeConfig, got {type(cfg).__name__}")
        if cfg.method not in ("eagle", "eagle3"):
            raise ValueError(f"EagleProposer needs method 'eagle' or 'eagle3', got {cfg.method!r}")
        want = EagleHead if cfg.method == "eagle" else Eagle3Head
        if not isinstance(self.model, want):
            raise ValueError(f"model must be an {want.__name__} for method={cfg.method!r}, "
                             f"got {type(self.model).__name__}")
        if cfg.parallel_drafting:
            raise ValueError("parallel_drafting=True is not implemented for EAGLE in specjax yet; "
                             "use parallel_drafting=False")
        tree = cfg.token_tree
        if tree != tuple((0,) * i for i in range(1, cfg.num_speculative_tokens + 1)):
            raise ValueError("a branching speculative_token_tree is not implemented in specjax yet; "
                             "leave speculative_token_tree unset (chain drafting)")
        for name in ("block_size", "max_model_len"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        check_index_range("max_model_len", self.max_model_len)
        K.resolve_backend(self.kernel_backend)

    @property
    def num_speculative_tokens(self) -> int:
        return self.config.num_speculative_tokens

    @property
    def needs_aux_hidden_states(self) -> bool:
        return self.config.method == "eagle3"

    # -- state -----------------------------------------------------------------------

    def init_state(self, num_blocks: int, dtype=jnp.float32) -> EagleState:
        """Zero draft KV cache with ``num_blocks`` blocks (the target's block pool size)."""
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks <= 0:
            raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
        check_index_range("num_blocks * block_size", num_blocks * self.block_size)
        return EagleState(self.model.init_kv_caches(num_blocks, self.block_size, dtype))

    # -- host/device input preparation (vLLM's prepare_* methods) --------------------

    def prepare_next_token_ids_padded(self, sampled_token_ids, discard_request_mask,
                                      backup_next_token_ids, *, vocab_size: int, num_reqs=None):
        """``(next_token_ids [B], valid_sampled_tokens_count [B])`` from the verifier's
        ``[B, k+1]`` output; the backup is each request's last committed token."""
        return K.eagle_prepare_next_token_padded(
            sampled_token_ids, discard_request_mask, backup_next_token_ids, vocab_size=vocab_size,
            num_reqs=num_reqs, backend=self.kernel_backend)

    def prepare_inputs_padded(self, spec_decode_metadata: SpecDecodeMetadata,
                              valid_sampled_tokens_count, attn_metadata: CommonAttentionMetadata):
        """``(token_indices_to_sample [B], num_rejected_tokens [B])``; the batch keeps every
        token (rejected ones become padding), so ``attn_metadata`` is used unchanged."""
        return K.eagle_prepare_inputs_padded(
            spec_decode_metadata.cu_num_draft_tokens, valid_sampled_tokens_count,
            attn_metadata.query_start_loc, num_reqs=attn_metadata.num_reqs,
            backend=self.kernel_backend)

    # -- propose ---------------------------------------------------------------------

    @functools.partial(jax.jit, static_argnums=0, donate_argnums=2)
    def propose(self, params: dict, state: EagleState, inputs: ProposerInputs
                ) -> tuple[DraftOutput, EagleState]:
        """Draft ``k`` tokens for every request.

        Returns ``(DraftOutput(token_ids [B_pad, k] int32, num_drafts [B_pad] int32),
        state)``; padding rows (past ``num_reqs``) hold -1 and 0.
        """
        cad = inputs.attn_metadata
        model = self.model
        k = self.config.num_speculative_tokens
        b = cad.query_start_loc.shape[0] - 1
        n = cad.num_reqs
        real = jnp.arange(b, dtype=_I32) < n
        qsl = cad.query_start_loc

        if self.config.method == "eagle3":
            if inputs.aux_hidden_states is None:
                raise ValueError("method='eagle3' needs inputs.aux_hidden_states [T, n_aux, Ht]")
            hidden = model.combine_hidden_states(params, inputs.aux_hidden_states)
        else:
            if inputs.target_hidden_states is None:
                raise ValueError("method='eagle' needs inputs.target_hidden_states [T, H]")
            hidden = inputs.target_hidden_states

        sample_idx = inputs.token_indices_to_sample
        if sample_idx is None:
            sample_idx = qsl[1:] - 1
        sample_idx = jnp.clip(sample_idx, 0, inputs.target_token_ids.shape[0] - 1)

        # First pass: ids shifted left by one, the sampled token written at each request's
        # sampled index; positions and hidden states as the target had them.
        t = inputs.target_token_ids.shape[0]
        ids = jnp.roll(inputs.target_token_ids, -1)
        ids = ids.at[jnp.where(real, sample_idx, t)].set(inputs.next_token_ids, mode="drop")
        logits_h, next_h, caches = model.forward(params, ids, inputs.target_positions, hidden,
                                                 state.kv_caches, cad)
        draft = self._greedy(params, logits_h[sample_idx])
        drafts = jnp.full((b, k), DRAFT_PADDING_ID, _I32).at[:, 0].set(draft)

        if k > 1:
            positions = inputs.target_positions[sample_idx]
            hidden = next_h[sample_idx]
            seq_lens = cad.seq_lens
            if inputs.num_rejected_tokens is not None:
                seq_lens = jnp.where(real, seq_lens - inputs.num_rejected_tokens, seq_lens)
            rows = jnp.arange(b + 1, dtype=_I32)
            step_qsl = jnp.minimum(rows, n)

            def step(i, carry):
                drafts, positions, hidden, seq_lens, max_seq_len, caches = carry
                positions, slots, seq_lens = K.eagle_step_update_slot_mapping_and_metadata(
                    positions, cad.block_table, seq_lens, block_size=self.block_size,
                    max_model_len=self.max_model_len, num_reqs=n, backend=self.kernel_backend)
                max_seq_len = jnp.minimum(max_seq_len + 1, self.max_model_len)
                md = cad.replace(query_start_loc=step_qsl, seq_lens=seq_lens, slot_mapping=slots,
                                 num_actual_tokens=n, max_seq_len=max_seq_len, max_query_len=1,
                                 causal=True)
                prev = jax.lax.dynamic_index_in_dim(drafts, i - 1, axis=1, keepdims=False)
                lh, hidden, caches = model.forward(params, prev, positions, hidden, caches, md)
                tok = self._greedy(params, lh)
                drafts = jax.lax.dynamic_update_index_in_dim(drafts, tok, i, axis=1)
                return drafts, positions, hidden, seq_lens, max_seq_len, caches

            drafts, *_, caches = jax.lax.fori_loop(
                1, k, step, (drafts, positions, hidden, seq_lens, cad.max_seq_len, caches))

        token_ids = jnp.where(real[:, None], drafts, DRAFT_PADDING_ID)
        num_drafts = jnp.where(real, k, 0).astype(_I32)
        return DraftOutput(token_ids, num_drafts), EagleState(caches)

    def _greedy(self, params: dict, hidden: jax.Array) -> jax.Array:
        """Argmax token (target vocabulary) of each row of ``hidden [N, H]``."""
        if self.config.method == "eagle3":
            d = jnp.argmax(self.model.compute_draft_logits(params, hidden), axis=-1).astype(_I32)
            return self.model.draft_to_target_ids(params, d).astype(_I32)
        return jnp.argmax(self.model.compute_logits(params, hidden), axis=-1).astype(_I32)


def prepare_inputs(attn_metadata: CommonAttentionMetadata, sampled_token_ids: Sequence[Sequence[int]],
                   num_draft_tokens: Sequence[int]) -> tuple[CommonAttentionMetadata, np.ndarray]:
    """Non-padded mode (host, NumPy; vLLM's ``prepare_inputs``): drop the rejected tokens.

    ``n_rej[i] = n_draft + 1 - len(sampled)`` (0 when there were no drafts); each request
    keeps its first ``q_i - n_rej_i`` tokens. Returns the new metadata (same padded sizes;
    ``query_start_loc``, ``seq_lens``, ``slot_mapping``, ``num_actual_tokens`` updated) and
    ``token_indices [T_pad] int32``: for each kept token its index in the old batch
    (padding entries point at 0), to gather ``target_*`` arrays with.
    """
    qsl = np.asarray(attn_metadata.query_start_loc).astype(np.int64)
    n = int(attn_metadata.num_reqs)
    if len(sampled_token_ids) != n or len(num_draft_tokens) != n:
        raise ValueError(f"sampled_token_ids and num_draft_tokens need one entry per request ({n}), "
                         f"got {len(sampled_token_ids)} and {len(num_draft_tokens)}")
    nd = np.asarray(num_draft_tokens, np.int64)
    ns = np.array([len(s) for s in sampled_token_ids], np.int64)
    rej = np.where(nd > 0, nd + 1 - ns, 0)
    q = qsl[1 : n + 1] - qsl[:n]
    if (rej < 0).any() or (rej > q).any():
        bad = int(np.argmax((rej < 0) | (rej > q)))
        raise ValueError(f"request {bad}: {int(ns[bad])} sampled tokens do not fit its "
                         f"{int(nd[bad])} drafts and {int(q[bad])} scheduled tokens")
    new_q = q - rej
    b_pad, t_pad = attn_metadata.B_pad, attn_metadata.T_pad
    new_qsl = np.zeros(b_pad + 1, np.int64)
    new_qsl[1 : n + 1] = np.cumsum(new_q)
    new_qsl[n + 1 :] = new_qsl[n]
    idx = np.zeros(t_pad, np.int64)
    kept = np.concatenate([np.arange(qsl[r], qsl[r] + new_q[r]) for r in range(n)]) if n else np.zeros(0)
    idx[: len(kept)] = kept
    seq = np.asarray(attn_metadata.seq_lens).astype(np.int64).copy()
    seq[:n] -= rej
    old_slots = np.asarray(attn_metadata.slot_mapping)
    slots = np.full(t_pad, -1, np.int64)
    slots[: len(kept)] = old_slots[kept.astype(np.int64)] if len(kept) else []
    i32 = lambda a: jnp.asarray(a, _I32)  # noqa: E731
    md = attn_metadata.replace(query_start_loc=i32(new_qsl), seq_lens=i32(seq),
                               slot_mapping=i32(slots), num_actual_tokens=i32(int(new_q.sum())))
    return md, idx.astype(np.int32)

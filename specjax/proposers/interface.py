"""The interface a decoding loop drives: ``Proposer`` (its ``feed`` is all a loop reads),
``ModelProposer`` (device model proposers), ``TokenHistory`` (what token-history proposers
see), the padded-batch helpers and the base of the token-history adapters."""

from __future__ import annotations

from typing import Any, Hashable, Mapping, NamedTuple, Sequence

import numpy as np

from specjax.checks import check_int
from specjax.config import SpeculativeConfig
from specjax.proposers.types import DraftOutput, Feed, ProposerInputs  # noqa: F401


def lookahead(config: SpeculativeConfig) -> int:
    """``Feed.lookahead`` (vLLM's ``num_lookahead_tokens``): KV slots a request may use past
    its scheduled tokens while drafting."""
    return config.num_speculative_tokens + config.max_num_new_slots_for_drafting() + 1


def drafter_limit(config: SpeculativeConfig, max_model_len: int | None) -> int | None:
    """``Feed.drafter_max_model_len``: ``config.max_model_len`` when shorter than the loop's
    ``max_model_len``, else None."""
    limit = config.max_model_len
    if limit is None or max_model_len is None or limit >= max_model_len:
        return None
    return int(limit)


class TokenHistory(NamedTuple):
    """What a token-history proposer sees after a verification step (host arrays).

    ``req_ids``: ``B`` distinct hashable ids, stable over a request's life; ``token_ids
    [B, W] int32``: row ``b``'s context (this step's tokens included) in its first
    ``num_tokens[b]`` columns; ``num_tokens``, ``num_prompt_tokens``: ``[B] int32``;
    ``sampled_token_ids``: ``B`` lists of this step's new tokens (empty: no draft);
    ``rows_pad``: the loop's padded batch size (>= B) or None.
    """

    req_ids: Sequence[Hashable]
    token_ids: np.ndarray
    num_tokens: np.ndarray
    num_prompt_tokens: np.ndarray
    sampled_token_ids: Sequence[Sequence[int]]
    rows_pad: int | None = None


class Proposer:
    """A proposer as the decoding loop sees it: ``feed``, and either ``init_state`` /
    ``impl.propose(params, state, ProposerInputs)`` inside the jitted step or
    ``propose_from_history`` after it."""

    config: SpeculativeConfig
    impl: Any = None
    params: Any = None

    @property
    def feed(self) -> Feed:
        raise NotImplementedError(f"{type(self).__name__} declares no Feed")

    @property
    def method(self) -> str:
        return self.config.method

    @property
    def num_speculative_tokens(self) -> int:
        return self.config.num_speculative_tokens

    @property
    def max_new_slots(self) -> int:
        return self.config.max_num_new_slots_for_drafting()

    @property
    def aux_layer_ids(self) -> tuple[int, ...]:
        return self.feed.aux_layer_ids

    @property
    def vocab_size(self) -> int | None:
        return self.feed.vocab_size

    @property
    def block_size(self) -> int | None:
        return self.feed.block_size

    @property
    def max_model_len(self) -> int | None:
        return self.feed.max_model_len

    def init_state(self, num_blocks: int, dtype=None) -> Any:
        """Device state (draft KV cache, buffers) for ``num_blocks`` KV blocks, or None."""
        return None

    def kv_bytes_per_block(self, block_size: int, dtype=None) -> int:
        """Bytes one KV block adds to :meth:`init_state`'s state (what a stack budgets on
        top of the target's ``kv_bytes_per_block``); 0 for proposers without KV."""
        check_int("block_size", block_size, 1)
        return 0

    def warmup(self, buckets: Any, state: Any = None, *, num_blocks: int | None = None,
               dtype=None, hidden_dtype=None) -> tuple:
        """Compile the device ``propose`` for every shape bucket; ``()`` for token-history
        proposers."""
        return ()

    def propose_from_history(self, history: TokenHistory) -> DraftOutput:
        raise NotImplementedError(f"method={self.method!r} does not draft from token history")

    def finish_requests(self, req_ids: Sequence[Hashable],
                        documents: Mapping[Hashable, tuple[int, Sequence[int]]] | None = None
                        ) -> None:
        """The loop calls this when requests leave for good (per-request host state);
        ``documents``: ``req_id -> (prompt length, prompt + output)`` of those that finished
        (not aborted), for proposers that learn from finished responses."""

    def warmup_finish(self, max_num_seqs: int) -> None:
        """Compile what :meth:`finish_requests` runs for up to ``max_num_seqs`` requests (no
        compile when they finish mid-run); nothing for most proposers."""

    def on_mesh(self, mesh: Any, axis: str = "tp") -> "Proposer":
        """This proposer for tensor parallelism over ``mesh[axis]`` (itself for
        token-history proposers)."""
        return self

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(method={self.method!r}, k={self.num_speculative_tokens}, "
                f"drafts_in={self.feed.drafts_in!r})")


# ---------------------------------------------------------------------------------------
# device model proposers


class ModelProposer(Proposer):
    """A model-based device proposer: ``impl`` is the method's frozen, hashable proposer
    whose ``propose(params, state, ProposerInputs)`` runs inside the jitted step."""

    def __init__(self, config: SpeculativeConfig, impl: Any, params: Any, *, vocab_size: int | None,
                 aux_layer_ids: Sequence[int] = (), mesh_fields: bool = False) -> None:
        self.config = config
        self.impl = impl
        self.params = params
        self.mesh_fields = bool(mesh_fields)
        aux = tuple(int(i) for i in aux_layer_ids) if impl.needs_aux_hidden_states else ()
        if impl.needs_aux_hidden_states and not aux:
            raise ValueError(f"method={config.method!r} needs aux hidden states: give aux_layer_ids "
                             "(the target layers whose inputs it reads)")
        tree = impl.token_tree if config.method in ("eagle", "eagle3") else None
        self._feed = Feed(
            drafts_in="split" if config.disable_padded_drafter_batch else "step",
            num_speculative_tokens=config.num_speculative_tokens,
            hidden_states=bool(impl.needs_hidden_states), aux_layer_ids=aux,
            lookahead=lookahead(config), token_tree=tree, vocab_size=vocab_size,
            block_size=getattr(impl, "block_size", None),
            max_model_len=getattr(impl, "max_model_len", None),
            drafter_max_model_len=drafter_limit(config, getattr(impl, "max_model_len", None)))

    @property
    def feed(self) -> Feed:
        return self._feed

    @property
    def drafts_confidence(self) -> bool:
        """True when the drafts' features are acceptance probabilities (a DSpark
        confidence head), not ``logit(q_max)``."""
        return bool(getattr(self.impl, "drafts_confidence", False))

    def init_state(self, num_blocks: int, dtype=None) -> Any:
        import jax.numpy as jnp

        return self.impl.init_state(num_blocks, jnp.float32 if dtype is None else dtype)

    def kv_bytes_per_block(self, block_size: int, dtype=None) -> int:
        """Bytes one KV block adds to the drafter's state (``dtype`` None: float32): the
        impl's ``kv_bytes_per_block``, else measured from :meth:`init_state`'s shapes at 1
        and 2 blocks (nothing allocated), which needs ``block_size`` equal to the
        proposer's (else ValueError)."""
        import jax
        import jax.numpy as jnp

        block_size = check_int("block_size", block_size, 1)
        dtype = jnp.float32 if dtype is None else dtype
        own = getattr(self.impl, "kv_bytes_per_block", None)
        if own is not None:
            return int(own(block_size, dtype))
        if self.block_size is not None and block_size != self.block_size:
            raise ValueError(f"block_size={block_size}: the proposer was built with "
                             f"block_size={self.block_size}")

        def nbytes(n: int) -> int:
            state = jax.eval_shape(lambda: self.init_state(n, dtype))
            return sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(state))

        return nbytes(2) - nbytes(1)

    def warmup(self, buckets: Any, state: Any = None, *, num_blocks: int | None = None,
               dtype=None, hidden_dtype=None) -> tuple:
        """Compile the standalone ``impl.propose(self.params, state, inputs)`` for every
        bucket (``common.AheadOfTimeCompile.warmup``; ``state`` None: abstract from
        ``num_blocks`` / ``dtype``). Returns the resolved buckets; ``ValueError`` first."""
        import jax.numpy as jnp

        return self.impl.warmup(buckets, self.params, state, num_blocks=num_blocks,
                                dtype=jnp.float32 if dtype is None else dtype,
                                hidden_dtype=hidden_dtype)

    def on_mesh(self, mesh: Any, axis: str = "tp") -> "ModelProposer":
        """A copy for tensor parallelism over ``mesh[axis]``: params placed by
        ``specjax.sharding``'s rules, and ``impl`` given ``mesh`` / ``vocab_axis`` where it
        has them (``specjax.sharding.tensor_parallel``)."""
        import copy

        import jax
        from jax.sharding import NamedSharding, PartitionSpec

        from specjax import sharding as sh

        impl, params = self.impl, self.params
        if self.mesh_fields:
            impl, params, _ = sh.tensor_parallel(
                impl, params, None, mesh, axis=axis,
                local_argmax=impl.config.use_local_argmax_reduction)
        elif params is not None:
            model_cfg = getattr(impl.model, "config", None)
            params = jax.device_put(params, (
                jax.tree.map(lambda _: NamedSharding(mesh, PartitionSpec()), params)
                if model_cfg is None else sh.param_shardings(params, mesh, model_cfg, axis=axis)))
        out = copy.copy(self)
        out.impl, out.params = impl, params
        return out

def prepare_next_token_ids_padded(impl: Any, sampled_token_ids, discard_request_mask,
                                  backup_next_token_ids, *, vocab_size: int, num_reqs=None,
                                  kernel_backend: str = "auto"):
    """``(next_token_ids [B], valid_sampled_tokens_count [B])`` int32, from the proposer's
    own helper or the ``eagle_prepare_next_token_padded`` kernel. Traceable."""
    fn = getattr(impl, "prepare_next_token_ids_padded", None)
    if fn is not None:
        return fn(sampled_token_ids, discard_request_mask, backup_next_token_ids,
                  vocab_size=vocab_size, num_reqs=num_reqs)
    import specjax.kernels as K

    return K.eagle_prepare_next_token_padded(sampled_token_ids, discard_request_mask,
                                             backup_next_token_ids, vocab_size=vocab_size,
                                             num_reqs=num_reqs, backend=kernel_backend)


def prepare_inputs_padded(impl: Any, spec_decode_metadata, valid_sampled_tokens_count,
                          attn_metadata, *, kernel_backend: str = "auto"):
    """``(token_indices_to_sample [B], num_rejected_tokens [B])`` int32 (padded-batch
    mode): the proposer's ``prepare_inputs_padded`` or the kernel. Traceable."""
    fn = getattr(impl, "prepare_inputs_padded", None)
    if fn is not None:
        out = fn(spec_decode_metadata, valid_sampled_tokens_count, attn_metadata)
        return out[-2], out[-1]      # vLLM's form returns (cad, indices, rejected)
    import specjax.kernels as K

    return K.eagle_prepare_inputs_padded(spec_decode_metadata.cu_num_draft_tokens,
                                         valid_sampled_tokens_count,
                                         attn_metadata.query_start_loc,
                                         num_reqs=attn_metadata.num_reqs, backend=kernel_backend)


# ---------------------------------------------------------------------------------------
# token-history adapters


# ---------------------------------------------------------------------------------------
# token-history proposers (the adapters live with their methods)


def history_feed(config: SpeculativeConfig, max_model_len: int) -> Feed:
    return Feed(drafts_in="history", num_speculative_tokens=config.num_speculative_tokens,
                lookahead=lookahead(config), max_model_len=max_model_len,
                drafter_max_model_len=drafter_limit(config, max_model_len))


class HistoryProposer(Proposer):
    """A proposer that drafts from the token history (``feed.drafts_in == "history"``)."""

    _feed: Feed

    @property
    def feed(self) -> Feed:
        return self._feed


def valid_mask(history: TokenHistory) -> np.ndarray:
    return np.fromiter((len(s) > 0 for s in history.sampled_token_ids), dtype=np.bool_,
                       count=len(history.sampled_token_ids))

"""Machinery shared by the device proposers (vLLM keeps it in ``SpecDecodeBaseProposer``):
construction checks, the draft KV state, the padded-batch helpers, the chain of
single-token steps, output padding and ahead-of-time compilation (``warmup``)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import specjax.kernels as K
from specjax.attention_metadata import CommonAttentionMetadata
from specjax.config import SpeculativeConfig
from specjax.constants import check_index_range
from specjax.metadata import SpecDecodeMetadata
from specjax.checks import check_int
from specjax.adaptive_k import draft_feature
from specjax.token_tree import TokenTree
from specjax.proposers.types import DRAFT_PADDING_ID, DraftOutput, ProposerInputs
from specjax.sampling.draft_sample import sample_draft
from specjax.sharding.vocab import proposer_argmax

_I32 = jnp.int32


def set_head_attention(prop: Any, heads: tuple[type, ...]) -> None:
    """Give ``prop.model`` (one of ``heads``) ``prop.attention``, a stack's own
    ``specjax.kernels.paged_attention.AttentionFn``, on a copy; nothing for None. TypeError
    naming ``attention``: not a hashable callable, or a head of another type."""
    from specjax.kernels.paged_attention import check_attention

    if check_attention(prop.attention) is None:
        return
    if not isinstance(prop.model, heads):
        raise TypeError(f"attention= applies to specjax's {' / '.join(h.__name__ for h in heads)}"
                        f", not a {type(prop.model).__name__}")
    object.__setattr__(prop, "model", dataclasses.replace(prop.model, attention=prop.attention))


def check_proposer(proposer: Any, method: str, model_type: type | tuple[type, ...] | None,
                   positive: tuple[str, ...] = ("block_size", "max_model_len")) -> SpeculativeConfig:
    """The checks every device proposer makes at construction: the config and its method,
    the model runner's type (None: checked by the caller), positive int sizes, and a known
    kernel backend."""
    cfg = proposer.config
    name = type(proposer).__name__
    if not isinstance(cfg, SpeculativeConfig):
        raise ValueError(f"config must be a SpeculativeConfig, got {type(cfg).__name__}")
    if cfg.method != method:
        raise ValueError(f"{name} needs method {method!r}, got {cfg.method!r}")
    if model_type is not None and not isinstance(proposer.model, model_type):
        want = model_type.__name__ if isinstance(model_type, type) else \
            " or ".join(t.__name__ for t in model_type)
        raise ValueError(f"model must be a {want} for method={method!r}, "
                         f"got {type(proposer.model).__name__}")
    for field in positive:
        v = getattr(proposer, field)
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ValueError(f"{field} must be a positive int, got {v!r}")
    if "max_model_len" in positive:
        check_index_range("max_model_len", proposer.max_model_len)
    K.resolve_backend(proposer.kernel_backend)
    return cfg


def check_parallel_drafting_token_id(proposer: Any, vocab_size: int, what: str) -> None:
    """With ``config.parallel_drafting``: ``proposer.parallel_drafting_token_id`` must be an
    int in ``[0, vocab_size)`` (``what``: whose mask token, for the message); it is stored
    back as a plain int. Without parallel drafting nothing is checked."""
    if not proposer.config.parallel_drafting:
        return
    pid = proposer.parallel_drafting_token_id
    if pid is None:
        raise ValueError(
            f"parallel_drafting=True needs parallel_drafting_token_id: {what} mask token (vLLM "
            "reads dflash_config.mask_token_id, pard_token or ptd_token_id from the draft config)")
    if isinstance(pid, bool) or not isinstance(pid, (int, np.integer)) or not 0 <= pid < vocab_size:
        raise ValueError(f"parallel_drafting_token_id must be an int in [0, {vocab_size}) "
                         f"({what} input vocabulary), got {pid!r}")
    object.__setattr__(proposer, "parallel_drafting_token_id", int(pid))


def init_kv_caches(model: Any, num_blocks: int, block_size: int, dtype) -> Any:
    """The model's zero paged cache with ``num_blocks`` blocks (the target's pool size)."""
    if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks <= 0:
        raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
    check_index_range("num_blocks * block_size", num_blocks * block_size)
    return model.init_kv_caches(num_blocks, block_size, dtype)


class PaddedBatchHelpers:
    """vLLM's padded-drafter-batch helpers (kernels 2 and 3); needs ``self.kernel_backend``."""

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


#: Chains of up to this many single-token steps are unrolled at trace time (``chain_steps``).
MAX_UNROLLED_STEPS = 8

#: ``step(params, prev_tokens [B], positions [B], hidden, caches, md)
#:  -> (tokens [B] int32, hidden, caches)``: one single-token draft forward + greedy pick.
StepFn = Callable[..., tuple[jax.Array, Any, Any]]


def chain_steps(step: StepFn, params: dict, drafts: jax.Array, positions: jax.Array, hidden: Any,
                seq_lens: jax.Array, cad: CommonAttentionMetadata, caches: Any, *,
                block_size: int, max_model_len: int, backend: str) -> tuple[jax.Array, Any]:
    """Fill columns ``1..k-1`` of ``drafts [B, k]`` (column 0 given) with single-token steps
    of ``step`` on the previous draft, in one ``lax.fori_loop``; positions past
    ``max_model_len`` get slot -1; ``step`` gets the column as ``col``. ``drafts`` may be
    :class:`Drafts`. ``positions [B]`` / ``seq_lens [B]``: each request's last sampled token's.
    """
    b, k = _tokens(drafts).shape
    n = cad.num_reqs
    # One query per row, padding rows included (vLLM's step uses ``arange(B + 1)`` too).
    # Padding rows have seq_len 0 and slot -1: they attend to no key and write nothing.
    step_qsl = jnp.arange(b + 1, dtype=_I32)

    def body(i, carry):
        drafts, positions, hidden, seq_lens, max_seq_len, caches = carry
        positions, slots, seq_lens = K.eagle_step_update_slot_mapping_and_metadata(
            positions, cad.block_table, seq_lens, block_size=block_size,
            max_model_len=max_model_len, num_reqs=n, backend=backend)
        max_seq_len = jnp.minimum(max_seq_len + 1, max_model_len)
        md = cad.replace(query_start_loc=step_qsl, seq_lens=seq_lens, slot_mapping=slots,
                         num_actual_tokens=n, max_seq_len=max_seq_len, max_query_len=1, causal=True)
        prev = jax.lax.dynamic_index_in_dim(_tokens(drafts), i - 1, axis=1, keepdims=False)
        tok, hidden, caches = step(params, prev, positions, hidden, caches, md, col=i)
        drafts = jax.tree.map(lambda d, t: jax.lax.dynamic_update_index_in_dim(d, t, i, axis=1),
                              drafts, tok)
        return drafts, positions, hidden, seq_lens, max_seq_len, caches

    # Unrolled for the usual small k: an XLA while loop costs a device->host predicate
    # check per iteration on the GPU (the unrolled tree levels ran faster than the chain).
    drafts, *_, caches = jax.lax.fori_loop(
        1, k, body, (drafts, positions, hidden, seq_lens, cad.max_seq_len, caches),
        unroll=k - 1 <= MAX_UNROLLED_STEPS)
    return drafts, caches


def _drafts_chain(cfg: Any) -> bool:
    return not cfg.parallel_drafting and TokenTree(cfg.token_tree).is_chain


def check_chain_len(proposer: Any) -> None:
    """``proposer.chain_len``: None, or in ``[1, k]`` on a chain (ValueError naming it)."""
    n, cfg = proposer.chain_len, proposer.config
    if n is None:
        return
    check_int("chain_len", n, 1, cfg.num_speculative_tokens)
    if not _drafts_chain(cfg):
        raise ValueError("chain_len applies to chain drafting only (not parallel_drafting or a "
                         "branching speculative_token_tree)")


def with_chain_len(proposer: Any, n: int) -> Any:
    """``proposer`` drafting chains of ``n`` (1..k); None for a proposer without
    ``chain_len``, parallel drafting or a tree. Cached, so a jit keyed on it compiles once."""
    if not hasattr(proposer, "chain_len") or not _drafts_chain(proposer.config):
        return None
    return proposer if n == proposer.config.num_speculative_tokens else _chain_len_copy(proposer, n)


@functools.lru_cache(maxsize=256)
def _chain_len_copy(proposer: Any, n: int) -> Any:
    return dataclasses.replace(proposer, chain_len=n)


def pad_draft_columns(out: DraftOutput, k: int) -> DraftOutput:
    """``out`` of ``c <= k`` draft columns padded to ``k`` (tokens -1, the rest 0)."""
    c = out.token_ids.shape[1]
    if c == k:
        return out

    def pad(x, fill):
        return None if x is None else jnp.concatenate(
            [x, jnp.full((x.shape[0], k - c) + x.shape[2:], fill, x.dtype)], axis=1)
    return DraftOutput(pad(out.token_ids, DRAFT_PADDING_ID), out.num_drafts,
                       pad(out.features, 0.0), pad(out.probs, 0.0))


def shift_in_next_tokens(token_ids: jax.Array, sample_idx: jax.Array, next_token_ids: jax.Array,
                         real: jax.Array) -> jax.Array:
    """EAGLE's first-pass input ids: ``token_ids [T]`` shifted left by one (the last entry
    wraps), with ``next_token_ids[r]`` at ``sample_idx[r]`` for each request where ``real
    [B]``. A select over a ``[T, B]`` one-hot, not a scatter, so XLA fuses it into the
    embedding gather.
    """
    t = token_ids.shape[0]
    hit = jnp.arange(t, dtype=_I32)[:, None] == jnp.where(real, sample_idx, -1)[None, :]
    new = jnp.max(jnp.where(hit, next_token_ids[None, :].astype(token_ids.dtype),
                            jnp.iinfo(token_ids.dtype).min), axis=1)
    return jnp.where(jnp.any(hit, axis=1), new, jnp.roll(token_ids, -1))


def drafts_with_first(first: Any, k: int) -> Any:
    """``[B, k]`` drafts: column 0 ``first [B]``, the rest -1, for :func:`chain_steps`
    (a concatenate, which fuses); a :class:`Drafts` column by column."""
    def col0(f):
        f = f.astype(_I32) if jnp.issubdtype(f.dtype, jnp.integer) else f
        return jnp.concatenate([f[:, None], jnp.full((f.shape[0], k - 1) + f.shape[1:],
                                                     DRAFT_PADDING_ID, f.dtype)], axis=1)
    return jax.tree.map(col0, first)


class Drafts(NamedTuple):
    """Drafts with what the verifier reads besides the tokens (a pytree; unused: None):
    ``features`` (``enable_adaptive_verification``), ``probs`` over the target vocabulary
    (``draft_sample_method="probabilistic"``)."""

    tokens: Any
    features: Any = None
    probs: Any = None


def _tokens(drafts: Any) -> jax.Array:
    return drafts.tokens if isinstance(drafts, Drafts) else drafts


def pick(proposer: Any, logits: jax.Array, sampling: Any = None, col: Any = 0,
         to_target: Callable | None = None, vocab: int | None = None,
         features: bool | None = None) -> Any:
    """Each row's draft from ``logits [N, Vd]``: the argmax, or with ``sampling``
    (``DraftSampling``, rows as ``logits``) a sample at column ``col`` (int or ``[N]``).
    ``to_target`` maps draft ids to the target's ``vocab`` ids; ``features`` (None: the
    config's ``enable_adaptive_verification``) asks for ``logit(q_max)``. Returns the tokens
    ``[N]``, or :class:`Drafts` when features or probabilities are asked for."""
    av = (getattr(proposer.config, "enable_adaptive_verification", False)
          if features is None else features)
    probs = None
    if sampling is None:
        tok = proposer_argmax(proposer, logits)
    else:
        tok, probs = sample_draft(logits, sampling, col)
    if to_target is not None:
        if probs is not None:
            ids = to_target(jnp.arange(logits.shape[-1], dtype=_I32))
            probs = jnp.zeros((probs.shape[0], vocab), probs.dtype).at[:, ids].set(probs)
        tok = to_target(tok)
    if not av and probs is None:
        return tok
    t = 1.0 if sampling is None else sampling.temperature
    return Drafts(tok, draft_feature(logits, t) if av else None, probs)


def repeat_sampling(sampling: Any, n: int) -> Any:
    """``DraftSampling`` rows repeated ``n`` times each (parallel drafting's ``[B * n]``
    rows), or None."""
    return None if sampling is None else jax.tree.map(lambda x: jnp.repeat(x, n, axis=0), sampling)


def draft_output(drafts: Any, num_reqs: jax.Array) -> DraftOutput:
    """``drafts [B, k]`` (or :class:`Drafts`) -> ``DraftOutput`` with -1 / 0 on rows past
    ``num_reqs``."""
    d = drafts if isinstance(drafts, Drafts) else Drafts(drafts)
    b, k = d.tokens.shape
    real = jnp.arange(b, dtype=_I32) < num_reqs
    return DraftOutput(jnp.where(real[:, None], d.tokens, DRAFT_PADDING_ID).astype(_I32),
                       jnp.where(real, k, 0).astype(_I32),
                       None if d.features is None else jnp.where(real[:, None], d.features, 0.0),
                       d.probs)


# ---------------------------------------------------------------------------------------
# ahead-of-time compilation


@dataclasses.dataclass(frozen=True)
class ProposeBucket:
    """One padded shape a serving loop calls ``propose`` with (every static dimension of
    the compiled step); ``warmup`` takes these or tuples of the leading fields.

    ``num_reqs_pad`` (``B_pad``) and ``num_tokens_pad`` (``T_pad``) >= 1;
    ``max_blocks_per_req``: block-table width (None: ``cdiv(max_model_len, block_size)``;
    required for Medusa / extract-hidden-states); ``max_query_len`` (None:
    ``num_tokens_pad``); ``padded_batch`` (None: ``not
    config.disable_padded_drafter_batch``).
    """

    num_reqs_pad: int
    num_tokens_pad: int
    max_blocks_per_req: int | None = None
    max_query_len: int | None = None
    padded_batch: bool | None = None


def resolve_buckets(proposer: Any, buckets: Iterable[Any]) -> tuple[ProposeBucket, ...]:
    """Validate ``buckets`` and fill every None field from the proposer; raises ValueError
    naming the bad argument (``buckets[i].field``). Duplicates are dropped, order kept."""
    if isinstance(buckets, (str, bytes, ProposeBucket)) or not isinstance(buckets, Iterable):
        raise ValueError("buckets must be an iterable of ProposeBucket or (num_reqs_pad, "
                         f"num_tokens_pad[, max_blocks_per_req[, max_query_len]]) tuples, got {buckets!r}")
    out: list[ProposeBucket] = []
    for i, b in enumerate(buckets):
        where = f"buckets[{i}]"
        if isinstance(b, ProposeBucket):
            pass
        elif isinstance(b, (tuple, list)) and 2 <= len(b) <= 4:
            b = ProposeBucket(*b)
        else:
            raise ValueError(f"{where} must be a ProposeBucket or a tuple (num_reqs_pad, num_tokens_pad"
                             f"[, max_blocks_per_req[, max_query_len]]) of 2 to 4 ints, got {b!r}")
        B = check_int(f"{where}.num_reqs_pad", b.num_reqs_pad, 1)
        T = check_int(f"{where}.num_tokens_pad", b.num_tokens_pad, 1)
        C = b.max_blocks_per_req
        if C is None:
            bs, mml = getattr(proposer, "block_size", None), getattr(proposer, "max_model_len", None)
            if bs is None or mml is None:
                raise ValueError(f"{where}.max_blocks_per_req is required for {type(proposer).__name__} "
                                 "(it lacks the block_size and max_model_len to derive the "
                                 "block-table width from): give (num_reqs_pad, num_tokens_pad, "
                                 "max_blocks_per_req)")
            C = -(-mml // bs)
        C = check_int(f"{where}.max_blocks_per_req", C, 1)
        Q = check_int(f"{where}.max_query_len", T if b.max_query_len is None else b.max_query_len,
                      1, T)
        padded = b.padded_batch
        if padded is None:
            padded = not proposer.config.disable_padded_drafter_batch
        if not isinstance(padded, (bool, np.bool_)):
            raise ValueError(f"{where}.padded_batch must be None or a bool, got {padded!r}")
        r = ProposeBucket(B, T, C, Q, bool(padded))
        if r not in out:
            out.append(r)
    if not out:
        raise ValueError("buckets must name at least one bucket, got none")
    return tuple(out)


def _hidden_widths(proposer: Any) -> tuple[int | None, tuple[int, int] | None]:
    """``(H of target_hidden_states or None, (n_aux, Ht) of aux_hidden_states or None)``
    as the proposer's model reads them."""
    model = proposer.model
    cfg = getattr(model, "config", None)
    needs_hidden = bool(getattr(proposer, "needs_hidden_states", False))
    needs_aux = bool(getattr(proposer, "needs_aux_hidden_states", False))
    if cfg is None:     # ExtractHiddenStates: stores [T, n_aux, H] of the target
        return None, ((model.num_hidden_states, model.hidden_size) if needs_aux else None)
    target_h = cfg.target_hidden_size or cfg.hidden_size
    if needs_aux:       # EAGLE-3 / DFlash: the target's width, n_aux of them into fc
        return (target_h if needs_hidden else None), (cfg.num_aux, target_h)
    return (cfg.hidden_size if needs_hidden else None), None


def abstract_inputs(proposer: Any, bucket: ProposeBucket, hidden_dtype=jnp.float32) -> ProposerInputs:
    """``ProposerInputs`` of ``jax.ShapeDtypeStruct`` leaves for a resolved ``bucket``; the
    hidden-state fields follow ``needs_hidden_states`` / ``needs_aux_hidden_states``."""
    B, T, C, Q = bucket.num_reqs_pad, bucket.num_tokens_pad, bucket.max_blocks_per_req, \
        bucket.max_query_len
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, _I32)  # noqa: E731
    h, aux = _hidden_widths(proposer)
    md = CommonAttentionMetadata(
        query_start_loc=i32(B + 1), seq_lens=i32(B), block_table=i32(B, C), slot_mapping=i32(T),
        num_reqs=i32(), num_actual_tokens=i32(), max_seq_len=i32(), max_query_len=Q, causal=True)
    return ProposerInputs(
        target_token_ids=i32(T), target_positions=i32(T),
        target_hidden_states=None if h is None else jax.ShapeDtypeStruct((T, h), hidden_dtype),
        aux_hidden_states=None if aux is None else jax.ShapeDtypeStruct((T, *aux), hidden_dtype),
        next_token_ids=i32(B),
        token_indices_to_sample=i32(B) if bucket.padded_batch else None,
        num_rejected_tokens=i32(B) if bucket.padded_batch else None,
        attn_metadata=md)


def _first_float_dtype(tree: Any):
    for leaf in jax.tree.leaves(tree):
        dt = getattr(leaf, "dtype", None)
        if dt is not None and jnp.issubdtype(dt, jnp.floating):
            return dt
    return None


class AheadOfTimeCompile:
    """``warmup``: compile ``propose`` for every bucket ahead of time (vLLM's
    ``dummy_run`` under CUDA-graph capture). Needs ``self.propose`` (a ``jax.jit`` with
    the proposer static), ``self.init_state``, ``self.config`` and ``self.model``."""

    def warmup(self, buckets: Iterable[Any], params: Any, state: Any = None, *,
               num_blocks: int | None = None, dtype=jnp.float32,
               hidden_dtype=None) -> tuple[ProposeBucket, ...]:
        """Lower and compile ``propose(params, state, inputs)`` for each bucket
        (``ProposeBucket`` or tuple); nothing runs and nothing is donated.

        ``params`` / ``state`` (possibly abstract): those later passed to ``propose``;
        ``state`` None: built abstractly from ``num_blocks`` and ``dtype``. ``hidden_dtype``:
        of the hidden-state inputs (None: the cache's floating dtype, else float32). Returns
        the resolved buckets in order. Raises ``ValueError`` (naming ``buckets[i].field``,
        or for a missing ``state`` and ``num_blocks``) before anything compiles.
        """
        resolved = resolve_buckets(self, buckets)
        if state is None:
            if num_blocks is None and getattr(self, "block_size", None) is not None:
                raise ValueError(f"{type(self).__name__}.warmup needs state= (the state propose will "
                                 "get) or num_blocks= (the KV pool size) to know the cache shapes")
            state = jax.eval_shape(lambda: self.init_state(num_blocks, dtype))
        if hidden_dtype is None:
            hidden_dtype = _first_float_dtype(state) or jnp.float32
        jitted = type(self).propose   # the jax.jit object: bound access would bind self as params
        for b in resolved:
            jitted.lower(self, params, state, abstract_inputs(self, b, hidden_dtype)).compile()
        return resolved

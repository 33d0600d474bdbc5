"""The fused speculative step, public API: one serving-loop iteration per call.

``make_step(target, proposer)`` returns a :class:`Step`; ``step(target_params, draft_params,
target_kv, draft_state, batch)`` runs the target forward, verification (chain, or tree with
:func:`compact_tree_kv`) and drafting as ``proposer.feed.drafts_in`` says on a padded
:class:`StepBatch`, and returns ``(StepOutput, target_kv, draft_state)``, caches donated;
it compiles once per bucket. docs/integration.md shows a loop around it."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

# Defines the attention-backend jit option and imports the kernels before the step is first
# traced (config states in the trace context; see the end of kernels/paged_attention/__init__.py).
import specjax.kernels.paged_attention  # noqa: F401
from specjax import _compat
from specjax.runtime import host_transfer
from specjax.runtime.output import StepOutput, _output, _with_features
from specjax.runtime.checks import check_call, check_input_ids, record_pool
from specjax.attention_metadata import CommonAttentionMetadata
from specjax.metadata import SpecDecodeMetadata
from specjax.proposers import Proposer, ProposerInputs
from specjax.sampling import (PLACEHOLDER_TOKEN_ID, SamplingMetadata, rejection_sample,
                             tree_rejection_sample, unconditional_to_conditional_rates)
from specjax.sampling.logprobs import (chain_logprobs, check_logprobs_mode, check_num_logprobs,
                              tree_logprobs)
from specjax.runtime.tree import compact_tree_kv, tree_chain_inputs
from specjax.checks import check_int, check_opt_int
from specjax.sampling.draft_sample import (DraftSampling, init_draft_probs, read_draft_probs,
                                          write_draft_probs)
from specjax.token_tree import TokenTree

__all__ = ["StepBatch", "Step", "make_step", "step_cache_size"]


@dataclasses.dataclass(frozen=True)
class StepBatch:
    """The padded inputs of one step (a pytree, from ``build_batch``): ``B`` rows (padding
    included), ``T`` token slots (``num_tokens_pad``; by default ``B * Q``, ``Q =
    attn.max_query_len`` each request's bound).

    Attributes:
      input_ids, positions: ``[T] int32``, each request's uncomputed tokens then its drafts
        (a tree batch: the root then its nodes, at the root's position plus their depth),
        requests back to back, then 0.
      attn: ``CommonAttentionMetadata`` (``tree_mask`` set: a tree batch);
        sdm: ``SpecDecodeMetadata``.
      temperature ``[B] float32`` (0: greedy), top_k ``[B] int32`` (0: off), top_p
        ``[B] float32`` (1: off), seeds ``[B] uint32``, counters ``[B] int32`` (tokens
        generated so far: a seeded request's key, whatever the batch).
      backup_next: ``[B] int32`` last committed tokens; discard: ``[B] bool`` (sampled token
        ignored: a partial prefill).
      procs: ``specjax.sampling.logits_processors.ProcessorState`` or None (the plain program).
      slots: ``[B] int32`` each row's request slot in a probabilistic drafter's
        ``DraftProbState`` (padding rows: past it), else None.
      all_greedy, block_size, num_logprobs: static: every real row greedy; tokens per KV block;
        the top-n bucket of ``StepOutput.logprobs`` (None: none, the program without them)."""

    input_ids: Any
    positions: Any
    attn: CommonAttentionMetadata
    sdm: SpecDecodeMetadata
    temperature: Any
    top_k: Any
    top_p: Any
    seeds: Any
    counters: Any
    backup_next: Any
    discard: Any
    procs: Any = None
    slots: Any = None
    all_greedy: bool = False
    block_size: int = 16
    num_logprobs: int | None = None

    @property
    def num_reqs_pad(self) -> int:
        return int(np.shape(self.temperature)[0])

    @property
    def is_tree(self) -> bool:
        return self.attn.tree_mask is not None


jax.tree_util.register_dataclass(
    StepBatch, data_fields=["input_ids", "positions", "attn", "sdm", "temperature", "top_k",
                            "top_p", "seeds", "counters", "backup_next", "discard", "procs",
                            "slots"],
    meta_fields=["all_greedy", "block_size", "num_logprobs"])


class _Spec(NamedTuple):
    """Static part of a step (hashable; the jit cache key besides the batch's shapes)."""

    target: Any                 # a specjax.Target (with the proposer's aux layers)
    impl: Any                   # the in-step proposer (static) or None
    k: int                      # draft columns (0: plain decoding)
    vocab_size: int
    synthetic_rates: tuple | None   # [k] conditional rates, or [n, k]: row r takes r % n's
    drafts_in: str              # "none" | "step" | "split" | "history"
    hidden: bool
    aux: bool
    tree: Any                   # TokenTree verified on tree batches, else None
    processors: tuple = ()      # user logits processors (static)
    logprobs_mode: str = "raw_logprobs"   # specjax.sampling.logprobs.LOGPROBS_MODES
    accept: bool = False        # call target.accept(kv, num_kept, attn) after verification
    draft_sampling: bool = False  # draft_sample_method="probabilistic": a DraftProbState


def _sampling(b: StepBatch, processors: tuple = ()) -> SamplingMetadata:
    keys = jax.vmap(lambda s, c: jax.random.key_data(jax.random.fold_in(jax.random.key(s), c)))(
        b.seeds, b.counters)
    return SamplingMetadata(b.temperature, b.top_k, b.top_p, keys, b.procs,
                            all_greedy=b.all_greedy,
                            processors=processors if b.procs is not None else ())


def drafting(spec: _Spec, draft_len: int | None) -> _Spec:
    """``spec`` with its chain proposer drafting ``max(draft_len, 1)`` of ``[B, k]``."""
    # (at 0, the drafter's first pass still keeps its KV level with the target: vLLM's K = 0)
    if draft_len is None or spec.impl is None or draft_len >= spec.k:
        return spec
    from specjax.proposers.common import with_chain_len
    impl = with_chain_len(spec.impl, max(int(draft_len), 1))
    return spec if impl is None else spec._replace(impl=impl)


def _propose_padded(spec: _Spec, dparams, draft_state, sampled, b: StepBatch, hidden, aux,
                    sampling=None):
    impl, cad = spec.impl, b.attn
    next_ids, valid = impl.prepare_next_token_ids_padded(
        sampled, b.discard, b.backup_next, vocab_size=spec.vocab_size, num_reqs=cad.num_reqs)
    out = impl.prepare_inputs_padded(b.sdm, valid, cad)
    tis, nrej = out[-2], out[-1]      # vLLM's form returns (cad, indices, rejected)
    ds = DraftSampling(b.temperature, sampling.keys) if spec.draft_sampling else None
    inputs = ProposerInputs(b.input_ids, b.positions, hidden if spec.hidden else None,
                            aux if spec.aux else None, next_ids, tis, nrej, cad, ds)
    if not spec.draft_sampling:
        return impl.propose(dparams, draft_state, inputs)
    drafts, inner = impl.propose(dparams, draft_state.inner, inputs)
    return drafts, write_draft_probs(draft_state, inner, b.slots, drafts.probs)


def _chain_step(spec: _Spec, tparams, dparams, target_kv, draft_state, b: StepBatch,
                first=None):
    hidden, aux, target_kv = spec.target.forward(tparams, b.input_ids, b.positions, target_kv,
                                                 b.attn)
    logits = spec.target.compute_logits(tparams, hidden[chain_logits_indices(b)])
    out, draft_state, extra = verify_chain(spec, dparams, draft_state, b, logits, hidden, aux,
                                           first)
    if spec.accept:
        target_kv = spec.target.accept(target_kv, num_kept(b, out), b.attn)
    return out, target_kv, draft_state, extra


def chain_logits_indices(b: StepBatch):
    """``b.sdm.logits_indices`` cut to its T token slots (past T: padding), ``[<= T] int32``."""
    return b.sdm.logits_indices[: b.input_ids.shape[0]]


def num_kept(b: StepBatch, out: StepOutput):
    """``[B] int32``: each row's scheduled tokens that stay after verification (its query
    length less its rejected drafts; 0 on padding rows), what a recurrent target's ``accept``
    keeps."""
    cad = b.attn
    qlen = cad.query_start_loc[1:] - cad.query_start_loc[:-1]
    real = jnp.arange(qlen.shape[0], dtype=jnp.int32) < cad.num_reqs
    return jnp.where(real, qlen - b.sdm.num_draft_tokens + out.num_accepted, 0).astype(jnp.int32)


def verify_chain(spec: _Spec, dparams, draft_state, b: StepBatch, logits, hidden, aux,
                 first=None):
    """Chain verification, logprobs and (in-step) drafting from the target's ``logits`` at
    ``b.sdm.logits_indices`` and its ``hidden`` / ``aux`` of every scheduled token (traceable).
    Returns ``(StepOutput, draft_state, extra)``; ``extra`` the states a split proposer drafts
    from on the host's kept tokens, else None. ``first(sampled) -> (short, extra)``, in-step
    drafting only: where ``short``, the chain drafts one token (every row's drafts come from
    a history stage; the first pass keeps the drafter's KV)."""
    rates = None if spec.synthetic_rates is None else jnp.asarray(spec.synthetic_rates,
                                                                  jnp.float32)
    if rates is not None and rates.ndim == 2:     # one row of rates per row class r % n
        rows = b.sdm.num_draft_tokens.shape[0]
        rates = rates[jnp.arange(rows) % rates.shape[0]]
    sampling = _sampling(b, spec.processors)
    dprobs = read_draft_probs(draft_state, b.slots) if spec.draft_sampling else None
    sampled = rejection_sample(b.sdm, dprobs, logits, sampling, rates)
    lp = None if b.num_logprobs is None else chain_logprobs(
        b.sdm, logits, sampling, sampled, num_logprobs=b.num_logprobs, mode=spec.logprobs_mode)
    if spec.drafts_in == "step":
        def propose(s, state):
            return _propose_padded(s, dparams, state, sampled, b, hidden, aux, sampling)
        extra, short_spec = None, spec
        if first is not None:
            short, extra = first(sampled)
            short_spec = drafting(spec, 1)
        if short_spec is spec:
            drafts, draft_state = propose(spec, draft_state)
        else:
            drafts, draft_state = jax.lax.cond(
                short, lambda st: propose(short_spec, st), lambda st: propose(spec, st),
                draft_state)
        return _output(sampled, drafts.token_ids, drafts.num_drafts, lp=lp,
                       features=drafts.features), draft_state, extra
    extra = (hidden if spec.hidden else None, aux if spec.aux else None) \
        if spec.drafts_in == "split" else None
    return _output(sampled, k=spec.k, lp=lp), draft_state, extra


def tree_logits_indices(b: StepBatch, num_nodes: int):
    """``(indices [B * (1 + num_nodes)] int32, real [B] bool)``: the token rows whose target
    logits tree verification reads, ``[root, node 0 .. node n-1]`` of each request (clipped
    into the batch past a request's block; masked by its draft count)."""
    cad = b.attn
    bp = cad.query_start_loc.shape[0] - 1
    t_pad = b.input_ids.shape[0]
    qsl = cad.query_start_loc
    qlen = qsl[1:] - qsl[:-1]
    real = jnp.arange(bp, dtype=jnp.int32) < cad.num_reqs
    idx = jnp.clip(qsl[:-1, None] + jnp.arange(num_nodes + 1, dtype=jnp.int32)[None, :], 0, t_pad - 1)
    return idx, qlen, real


def _tree_step(spec: _Spec, tparams, dparams, target_kv, draft_state, b: StepBatch):
    hidden, aux, target_kv = spec.target.forward(tparams, b.input_ids, b.positions, target_kv,
                                                 b.attn)
    idx, qlen, real = tree_logits_indices(b, spec.tree.num_nodes)
    logits = spec.target.compute_logits(tparams, hidden[idx.reshape(-1)])
    out, target_kv, draft_state = verify_tree(spec, dparams, draft_state, b, logits, hidden, aux,
                                              target_kv, spec.target.move_kv, (idx, qlen, real))
    return StepOutput(out.packed, out.k, out.logprobs), target_kv, draft_state, None


def verify_tree(spec: _Spec, dparams, draft_state, b: StepBatch, logits, hidden, aux, kv,
                move_kv, geometry=None):
    """Tree verification (traceable): ``tree_rejection_sample`` over the target's ``logits
    [B * (1 + n), V']`` at :func:`tree_logits_indices`, the accepted nodes' KV compacted in
    ``kv`` by ``move_kv`` (:func:`compact_tree_kv`; both None: left to the caller), then
    drafting from the chain-shaped batch (:func:`tree_chain_inputs`). Returns ``(StepOutput
    with accepted_nodes, kv, draft_state)``."""
    tree = spec.tree
    n_nodes = tree.num_nodes
    cad = b.attn
    idx, qlen, real = tree_logits_indices(b, n_nodes) if geometry is None else geometry
    bp = idx.shape[0]
    logits = logits.reshape(bp, n_nodes + 1, -1)
    num_drafts = jnp.where(real, qlen - 1, 0)
    sampling = _sampling(b, spec.processors)
    out, acc_nodes, n_acc = tree_rejection_sample(logits, b.input_ids[idx[:, 1:]], num_drafts,
                                                  sampling, tree=tree, num_reqs=cad.num_reqs)
    if kv is not None and move_kv is not None:
        root_pos = jnp.where(real, cad.seq_lens - qlen, 0)      # logical position p of the root
        kv = compact_tree_kv(kv, cad.block_table, root_pos, acc_nodes, n_acc, real,
                             block_size=b.block_size, move_kv=move_kv)
    sampled = jnp.concatenate(
        [out, jnp.full((bp, n_nodes - tree.depth), PLACEHOLDER_TOKEN_ID, jnp.int32)], axis=1)
    impl = spec.impl
    next_ids, _ = impl.prepare_next_token_ids_padded(
        sampled, b.discard, b.backup_next, vocab_size=spec.vocab_size, num_reqs=cad.num_reqs)
    padded = spec.drafts_in == "step"
    ids, pos, src, md, tis, nrej = tree_chain_inputs(
        b.input_ids, cad, acc_nodes, n_acc, tree=tree, block_size=b.block_size, padded=padded)
    inputs = ProposerInputs(ids, pos, hidden[src] if spec.hidden else None,
                            aux[src] if spec.aux else None, next_ids, tis, nrej, md)
    drafts, draft_state = impl.propose(dparams, draft_state, inputs)
    lp = None if b.num_logprobs is None else tree_logprobs(
        logits, acc_nodes, sampling, sampled, num_logprobs=b.num_logprobs, mode=spec.logprobs_mode)
    o = _output(sampled, drafts.token_ids, drafts.num_drafts, lp=lp)
    return StepOutput(o.packed, o.k, o.logprobs, acc_nodes), kv, draft_state


def _step(spec: _Spec, tparams, dparams, target_kv, draft_state, b: StepBatch, first=None):
    if b.attn.tree_mask is not None:
        return _tree_step(spec, tparams, dparams, target_kv, draft_state, b)
    return _chain_step(spec, tparams, dparams, target_kv, draft_state, b, first)


_step_jit = jax.jit(_step, static_argnums=0, donate_argnums=(3, 4))


def _packed_step(spec: _Spec, tparams, dparams, target_kv, draft_state, words, layout):
    """``_step`` on a batch sent as one int32 buffer (``specjax.runtime.host_transfer``)."""
    return _step(spec, tparams, dparams, target_kv, draft_state, host_transfer.unpack(words, layout))


_packed_step_jit = jax.jit(_packed_step, static_argnums=(0, 6), donate_argnums=(3, 4))


def _split_propose(impl, dparams, draft_state, out: StepOutput, input_ids, positions, hidden,
                   aux, token_indices, next_token_ids, attn):
    """Non-padded mode: draft from the kept tokens into the step's packed output."""
    take = lambda x: None if x is None else x[token_indices]  # noqa: E731
    inputs = ProposerInputs(take(input_ids), take(positions), take(hidden), take(aux),
                            next_token_ids, None, None, attn)
    drafts, draft_state = impl.propose(dparams, draft_state, inputs)
    k = out.k
    packed = out.packed.at[:, k + 1: 2 * k + 1].set(drafts.token_ids.astype(jnp.int32))
    packed = packed.at[:, 2 * k + 1].set(drafts.num_drafts.astype(jnp.int32))
    return StepOutput(_with_features(packed, drafts.features), k, out.logprobs), draft_state


_split_propose_jit = jax.jit(_split_propose, static_argnums=0, donate_argnums=(2, 3))


def step_cache_size() -> int:
    """Number of compiled variants of the decoding step (for recompilation checks)."""
    return _step_jit._cache_size() + _packed_step_jit._cache_size()


# ---------------------------------------------------------------------------------------
# the public step


class _Verifier:
    """What ``Step`` and ``VerifyStep`` share, set by :func:`configure`."""

    proposer: Proposer | None
    feed: Any
    k: int
    vocab_size: int
    tree: TokenTree | None
    synthetic_rates: tuple[float, ...] | None
    logits_processors: tuple
    logprobs_mode: str
    mesh: Any
    tp_axis: str
    fuse_projections: bool


class Step(_Verifier):
    """One decoding iteration of ``target`` with ``proposer``; build it with :func:`make_step`.

    Attributes: ``target`` (the ``specjax.Target`` run, with the proposer's aux layers),
    ``proposer`` (as the step runs it: placed, or with fused projections; pass
    ``step.draft_params``) or None, ``feed`` (``proposer.feed`` or None), ``k`` (draft
    columns), ``tree`` (verified on tree batches, or None), ``mesh`` / ``tp_axis``,
    ``logits_processors``."""

    def __init__(self, target, proposer: Proposer | None, *, mesh: Any = None,
                 tp_axis: str = "tp", tree_verification: bool | None = None,
                 logits_processors: tuple = (), logprobs_mode: str = "raw_logprobs",
                 fuse_projections: bool = True) -> None:
        from specjax.models import DecoderLM
        from specjax.target import check_target, has_accept, has_move_kv

        check_target(target)
        configure(self, proposer, int(target.vocab_size), mesh=mesh, tp_axis=tp_axis,
                  tree_verification=tree_verification, logits_processors=logits_processors,
                  logprobs_mode=logprobs_mode, fuse_projections=fuse_projections)
        feed = self.feed
        if feed is not None and feed.aux_layer_ids and \
                tuple(target.aux_layer_ids) != feed.aux_layer_ids:
            target = target.with_aux_layers(feed.aux_layer_ids)
        self._own = isinstance(target, DecoderLM)   # fused projections and mesh placement
        accept = has_accept(target)      # a recurrent target's rollback
        if self.tree is not None and accept:
            raise ValueError(f"tree verification is not supported for a recurrent target (the "
                             f"{type(target).__name__} target has accept, a rollback of chain "
                             "steps): use a chain proposer or tree_verification=False")
        if self.tree is not None and not has_move_kv(target):
            raise ValueError(f"tree verification needs the target's move_kv (specjax.Target); "
                             f"the {type(target).__name__} target has none: use a chain "
                             "proposer or tree_verification=False")
        self.target = target
        self._spec = make_spec(self, target, accept=accept)

    # -- placement -----------------------------------------------------------------

    def place_target_params(self, params):
        """``params`` placed for this step: sharded by ``specjax.sharding``'s rules over
        ``tp_axis`` on a mesh (indivisible sizes: ValueError naming them); on one device with
        q/k/v and gate/up fused (a new array per group) unless ``fuse_projections=False``. A
        foreign target's params as given (placed by its stack; never resharded)."""
        if not self._own:
            return params
        if self.mesh is None:
            if self.fuse_projections:
                from specjax.models import fuse_projections

                return fuse_projections(params)
            return params
        from specjax import sharding as sh

        return jax.device_put(params, sh.param_shardings(params, self.mesh, self.target.config,
                                                         axis=self.tp_axis))

    def init_caches(self, num_blocks: int, block_size: int, kv_dtype=None, params=None,
                    max_num_seqs: int | None = None):
        """``(target_kv, draft_state)`` for ``num_blocks`` blocks of ``block_size`` in
        ``kv_dtype`` (None: :func:`params_kv_dtype` of ``params``), sharded by kv head on a mesh
        (a foreign target's KV as its ``init_kv_caches`` places it); ``draft_state`` None
        without a proposer; a probabilistic drafter's wrapped with ``max_num_seqs`` slots. ValueError for another ``block_size`` than the proposer's. The
        pool size is remembered: a call checks a host batch's block ids against it."""
        if self.feed is not None and self.feed.block_size not in (None, block_size):
            raise ValueError(f"the proposer was built with block_size={self.feed.block_size}, "
                             f"got {block_size}")
        if kv_dtype is None:
            kv_dtype = params_kv_dtype(params)
        kv = self.target.init_kv_caches(num_blocks, block_size, kv_dtype)
        state = None if self.proposer is None else self.proposer.init_state(num_blocks, kv_dtype)
        if self._spec.draft_sampling:
            if max_num_seqs is None:
                raise ValueError("init_caches: max_num_seqs is required for a proposer with "
                                 "draft_sample_method='probabilistic' (its draft slots)")
            state = init_draft_probs(state, check_int("max_num_seqs", max_num_seqs, 1), self.k,
                                     self.vocab_size)
        if self.mesh is not None:
            from specjax.sharding import state_shardings

            state = jax.device_put(state, state_shardings(state, self.mesh, axis=self.tp_axis))
            if self._own:
                kv = jax.device_put(kv, state_shardings(kv, self.mesh, axis=self.tp_axis))
        record_pool(self, kv, int(num_blocks))
        return kv, state

    @property
    def draft_params(self):
        """The params to pass as ``draft_params`` (the proposer's, placed on ``mesh``)."""
        return None if self.proposer is None else self.proposer.params

    # -- the call ------------------------------------------------------------------

    def __call__(self, target_params, draft_params, target_kv, draft_state, batch: StepBatch,
                 *, draft_len: int | None = None) -> tuple[StepOutput, Any, Any]:
        """One step; ``target_kv`` and ``draft_state`` are donated (do not reuse the ones
        passed in). Returns ``(StepOutput, target_kv, draft_state)``. ``draft_len``: as
        :func:`drafting`. Before anything runs,
        ValueError naming the argument (``specjax.runtime.checks``): a batch that does not fit
        (:func:`check_batch`), caches donated to an earlier call, ``target_params`` None (or
        not the ``DecoderLM`` target's config), ``draft_params`` None or not shaped as
        ``step.draft_params``, a host batch's block id past the KV pool (its size from the
        KV's leaves or ``init_caches``)."""
        check_batch(self, batch)
        check_call(self, target_params, draft_params, target_kv, draft_state, batch)
        spec = drafting(self._spec, check_opt_int("draft_len", draft_len, 0, self.k))
        dparams = draft_params if spec.impl is not None else None
        with _compat.use_mesh(self.mesh):     # MoE experts read it (models/moe.py)
            if host_transfer.packable(batch):      # a host batch: one transfer, not ~25
                words, layout = host_transfer.pack(batch)
                out, target_kv, draft_state, extra = _packed_step_jit(
                    spec, target_params, dparams, target_kv, draft_state, words, layout)
            else:
                out, target_kv, draft_state, extra = _step_jit(spec, target_params, dparams,
                                                               target_kv, draft_state, batch)
            if extra is not None and not batch.is_tree:
                out, draft_state = split_propose(self.proposer, draft_params, draft_state, batch,
                                                 out, extra)
        return out, target_kv, draft_state

    def lower(self, target_params, draft_params, target_kv, draft_state, batch: StepBatch,
              *, draft_len: int | None = None):
        """The ``jax.stages.Lowered`` of the fused step on ``batch`` (for inspection:
        ``.as_text()``, ``.compile().as_text()``); ``draft_len`` as in :meth:`__call__`."""
        check_batch(self, batch)
        spec = drafting(self._spec, check_opt_int("draft_len", draft_len, 0, self.k))
        dparams = draft_params if spec.impl is not None else None
        with _compat.use_mesh(self.mesh):
            if host_transfer.packable(batch):      # the program __call__ runs
                words, layout = host_transfer.pack(batch)
                return _packed_step_jit.lower(spec, target_params, dparams, target_kv,
                                              draft_state, words, layout)
            return _step_jit.lower(spec, target_params, dparams, target_kv, draft_state, batch)

    def warmup(self, target_params, draft_params, target_kv, draft_state, buckets, *,
               block_size: int, all_greedy=(True, False), tree_verify=None,
               num_logprobs=(None,), procs=(None,), max_model_len: int | None = None):
        """Compile the step for every bucket ahead of time, so that no later call compiles:
        a padding batch (no request: nothing written, nothing emitted) per bucket and variant,
        run through ``__call__`` (the packed host program a ``build_batch`` batch of that
        bucket runs). ``buckets``: ``specjax.runtime.warmup.Bucket(requests, tokens, blocks[,
        query_len])`` or 3- / 4-tuples; variants: ``all_greedy``, ``tree_verify`` (None:
        chain, and tree when ``self.tree`` is set), ``num_logprobs`` (request ``logprobs``),
        ``procs`` (None or a ``ProcessorLimits``; with ``max_model_len``). The caches are
        donated: returns ``(target_kv, draft_state)``. ValueError / TypeError naming a bad
        argument first."""
        from specjax.runtime.warmup import padding_batches

        for fields in padding_batches(self, buckets, block_size=block_size,
                                      all_greedy=all_greedy, tree_verify=tree_verify,
                                      num_logprobs=num_logprobs, procs=procs,
                                      max_model_len=max_model_len):
            out, target_kv, draft_state = self(target_params, draft_params, target_kv,
                                               draft_state, StepBatch(**fields))
            jax.block_until_ready(out)
        return target_kv, draft_state


def check_batch(step, batch: StepBatch) -> None:
    """ValueError unless ``batch`` fits ``step`` (a ``Step`` or ``VerifyStep``): a
    ``StepBatch`` of its tree or chain kind, block size, logprobs bucket and draft count; a
    host batch's token ids within ``step.vocab_size`` (a device batch is not read)."""
    if not isinstance(batch, StepBatch):
        raise ValueError(f"batch must be a StepBatch (specjax.runtime.batch.build_batch), got "
                         f"{type(batch).__name__}")
    if batch.is_tree and step.tree is None:
        raise ValueError("batch is a tree-verification batch (attn.tree_mask set) but this "
                         "step verifies chains (no branching token tree, or "
                         "tree_verification=False)")
    if step.feed is not None and step.feed.block_size not in (None, batch.block_size):
        raise ValueError(f"batch was built with block_size={batch.block_size}; the proposer "
                         f"uses {step.feed.block_size}")
    check_num_logprobs("batch.num_logprobs", batch.num_logprobs)
    if batch.sdm.max_spec_len != step.k:
        raise ValueError(f"batch was built for max_spec_len={batch.sdm.max_spec_len}; this "
                         f"step verifies k={step.k} drafts")
    check_input_ids(batch, step.vocab_size)


def split_propose(proposer, draft_params, draft_state, batch: StepBatch, out: StepOutput, extra):
    """Non-padded mode: the host's ``prepare_inputs`` drops the rejected tokens, then the
    proposer drafts from the kept ones (a second jitted call; the packed output is donated),
    a discarded row (a partial prefill) from ``backup_next``. ``extra``: the ``(hidden,
    aux)`` the verification returned. Returns ``(out, draft_state)``."""
    from specjax.proposers.eagle import prepare_inputs

    attn = jax.tree.map(np.asarray, batch.attn)
    n = int(attn.num_reqs)
    sampled = np.asarray(out.sampled)
    lists = [[int(t) for t in sampled[i] if t != PLACEHOLDER_TOKEN_ID] for i in range(n)]
    num_drafts = np.asarray(batch.sdm.num_draft_tokens)[:n].tolist()
    md, idx = prepare_inputs(attn, lists, num_drafts)
    nxt = np.zeros(batch.num_reqs_pad, np.int32)
    discard, backup = np.asarray(batch.discard)[:n], np.asarray(batch.backup_next)[:n]
    nxt[:n] = [int(b) if d else lst[-1] for lst, d, b in zip(lists, discard, backup)]
    hidden, aux = extra
    return _split_propose_jit(proposer.impl, draft_params, draft_state, out,
                              batch.input_ids, batch.positions, hidden, aux, idx, nxt, md)


def params_kv_dtype(params) -> Any:
    """The KV-cache dtype for a target's ``params``: its embedding's dtype when floating,
    else its first floating leaf's; float32 for None or no floating leaf (a cache wider than
    the weights costs memory and bandwidth for precision they lack)."""
    if params is None:
        return jnp.dtype(jnp.float32)
    try:
        emb = params["embed_tokens"]["embedding"]
    except (KeyError, TypeError, IndexError):
        emb = None
    for leaf in ([emb] if emb is not None else []) + jax.tree.leaves(params):
        dt = getattr(leaf, "dtype", None)
        if dt is not None and jnp.issubdtype(dt, jnp.floating):
            return jnp.dtype(dt)
    return jnp.dtype(jnp.float32)


def make_step(target, proposer: Proposer | None, *, mesh: Any = None, tp_axis: str = "tp",
              tree_verification: bool | None = None, logits_processors: tuple = (),
              logprobs_mode: str = "raw_logprobs", fuse_projections: bool = True) -> Step:
    """The fused speculative step of ``target`` (a ``specjax.Target``, e.g. a ``DecoderLM``)
    with ``proposer`` (None: plain decoding). ``mesh`` / ``tp_axis``: tensor parallelism.
    ``tree_verification``: None verifies trees when the proposer's tree branches, True forces
    the tree path, False chains. ``logits_processors``: pure JAX functions ``fn(logits [T, V], params [T, P],
    (token_ids [T, L], num_tokens [T], position [T])) -> [T, V]`` (docs/sampling.md).
    ``logprobs_mode``: vLLM's ``LogprobsMode``. ``fuse_projections``: fuse q/k/v and gate/up
    on one device. Raises ValueError (vocabulary mismatch, a tree of the wrong size,
    synthetic acceptance with trees, ...) before anything compiles."""
    from specjax.checks import check_type

    check_type("tp_axis", tp_axis, str, "a mesh axis name (str)")
    return Step(target, proposer, mesh=mesh, tp_axis=tp_axis, tree_verification=tree_verification,
                logits_processors=logits_processors, logprobs_mode=logprobs_mode,
                fuse_projections=fuse_projections)


def configure(obj, proposer, vocab: int, *, mesh, tp_axis, tree_verification,
              logits_processors, logprobs_mode, fuse_projections) -> None:
    """Check the arguments shared by ``Step`` and ``VerifyStep`` and set on ``obj``:
    ``proposer`` (placed on ``mesh`` or with fused projections), ``feed``, ``k``,
    ``vocab_size``, ``tree``, ``synthetic_rates``, ``logits_processors``, ``logprobs_mode``,
    ``mesh`` / ``tp_axis``, ``fuse_projections``. ValueError naming the argument."""
    from specjax.checks import check_type

    check_logprobs_mode(logprobs_mode)
    check_type("fuse_projections", fuse_projections, bool, "True or False")
    if proposer is not None and not isinstance(proposer, Proposer):
        raise ValueError(f"proposer must come from specjax.make_proposer (a Proposer) or be "
                         f"None, got {type(proposer).__name__}")
    feed = None if proposer is None else proposer.feed
    if feed is not None and feed.vocab_size is not None and feed.vocab_size != vocab:
        raise ValueError(f"the proposer's vocabulary ({feed.vocab_size}) does not match "
                         f"the target's ({vocab})")
    if mesh is not None:
        from jax.sharding import Mesh

        if not isinstance(mesh, Mesh):
            raise ValueError(f"mesh must be a jax.sharding.Mesh or None, got "
                             f"{type(mesh).__name__}")
        if tp_axis not in mesh.axis_names:
            raise ValueError(f"tp_axis {tp_axis!r} is not an axis of the mesh (axes: "
                             f"{mesh.axis_names})")
        if proposer is not None:
            proposer = proposer.on_mesh(mesh, tp_axis)
    elif fuse_projections and getattr(proposer, "params", None) is not None:
        proposer = _with_fused_params(proposer)
    obj.mesh, obj.tp_axis, obj.fuse_projections = mesh, tp_axis, fuse_projections
    obj.proposer, obj.feed, obj.vocab_size = proposer, feed, vocab
    obj.k = 0 if feed is None else feed.num_speculative_tokens
    obj.tree = _resolve_tree(proposer, tree_verification)
    obj.synthetic_rates = _synthetic_rates(proposer, obj.tree)
    obj.logits_processors = _check_processors(logits_processors)
    obj.logprobs_mode = logprobs_mode


def make_spec(obj, target, *, accept: bool = False) -> _Spec:
    """The static ``_Spec`` of a configured ``Step`` / ``VerifyStep`` (``target`` None: no
    forward)."""
    feed = obj.feed
    in_step = feed is not None and feed.in_step
    return _Spec(
        target=target, impl=obj.proposer.impl if in_step else None, k=obj.k,
        vocab_size=obj.vocab_size, synthetic_rates=obj.synthetic_rates,
        drafts_in="none" if feed is None else feed.drafts_in,
        hidden=in_step and feed.hidden_states, aux=in_step and feed.aux_hidden_states,
        tree=obj.tree, processors=obj.logits_processors, logprobs_mode=obj.logprobs_mode,
        accept=accept, draft_sampling=in_step and getattr(
            obj.proposer.config, "draft_sample_method", "greedy") == "probabilistic")


def _with_fused_params(proposer):
    """``proposer``, or a copy with q/k/v and gate/up fused in its params (specjax's own
    layers only: a foreign draft model's params are its own)."""
    import copy

    from specjax.models import DecoderLM, fuse_projections
    from specjax.proposers.draft_model import DraftModelProposer

    if isinstance(proposer.impl, DraftModelProposer) and \
            not isinstance(proposer.impl.model, DecoderLM):
        return proposer
    fused = fuse_projections(proposer.params)
    if fused is proposer.params:
        return proposer
    out = copy.copy(proposer)
    out.params = fused
    return out


def _check_processors(procs) -> tuple:
    """``logits_processors`` as a tuple of callables (ValueError naming it otherwise)."""
    if isinstance(procs, list):
        procs = tuple(procs)
    if not isinstance(procs, tuple) or not all(callable(f) for f in procs):
        raise ValueError(f"logits_processors must be a tuple of functions (logits, params, "
                         f"context) -> logits, got {procs!r}")
    return procs


def _resolve_tree(proposer: Proposer | None, tree_verification) -> TokenTree | None:
    """The token tree to verify (``proposer.feed.token_tree``) when it branches
    (``tree_verification=None``) or when forced (True); None for chain verification."""
    if tree_verification not in (None, True, False):
        raise ValueError(f"tree_verification must be None, True or False, got {tree_verification!r}")
    tree = None if proposer is None else proposer.feed.token_tree
    use = (tree is not None and not tree.is_chain) if tree_verification is None else tree_verification
    if not use:
        return None
    if tree is None:
        raise ValueError("tree_verification=True needs a proposer with a token tree "
                         "(speculative_token_tree)")
    if proposer.feed.drafts_in == "history":
        raise ValueError(f"tree verification needs a device model proposer (EAGLE / EAGLE-3), "
                         f"got method={proposer.method!r}")
    if tree.num_nodes != proposer.num_speculative_tokens:
        raise ValueError(f"the token tree has {tree.num_nodes} nodes but the proposer drafts "
                         f"num_speculative_tokens={proposer.num_speculative_tokens}; they must match")
    return tree


def _synthetic_rates(proposer: Proposer | None, tree) -> tuple[float, ...] | None:
    cfg = None if proposer is None else proposer.config
    if cfg is None or cfg.rejection_sample_method != "synthetic":
        return None
    if tree is not None:
        raise ValueError("rejection_sample_method='synthetic' is not supported with tree "
                         "verification (a branching speculative_token_tree)")
    return tuple(unconditional_to_conditional_rates(cfg.synthetic_rates))

"""Reference decoding loop: batched speculative decoding with any proposer.

``generate(target, proposer, prompts, sampling_params)`` runs the loop a serving engine
runs (vLLM v1's scheduler + GPU model runner, reduced to what speculative decoding needs):

1. **Schedule (host).** Admit waiting requests while there is a free row and enough KV
   blocks; every running request is scheduled each step: its uncomputed tokens (the whole
   prompt at prefill, else the last sampled token) followed by its drafts. Blocks of the
   paged KV cache are allocated as the request grows (block 0 is a never-allocated null
   block that padding entries of the block table point at) and freed when it finishes.
2. **Step (device, one ``jax.jit``).** Target forward over the ragged batch (paged KV
   cache written through the slot mapping), logits at every draft and bonus position,
   ``specjax.sampler.rejection_sample``; in padded-batch mode also
   ``prepare_next_token_ids_padded`` / ``prepare_inputs_padded`` and the proposer's
   ``propose`` on the target's hidden states, all in the same compiled step with the KV
   caches and the proposer state donated. Shapes are padded to buckets (requests, query
   length, context blocks), so the step compiles once per bucket.
3. **Commit (host).** Accepted tokens and the bonus / recovered token are appended;
   requests stop on a stop token, ``max_tokens`` or ``max_model_len``. Token-history
   proposers (n-gram, suffix) draft now, from the updated histories. In the non-padded
   mode the host runs vLLM's ``prepare_inputs`` and a second jitted call drafts.

Plain (non-speculative) decoding is the same loop with ``proposer=None``: one token per
request per step, sampled by the same sampler. Greedy speculative decoding emits exactly
the tokens of plain greedy decoding (``tests/test_engine.py`` proves it for every method).

**Tree verification** (specjax's own; vLLM v0.20 verifies every draft as a chain). When
the proposer's ``token_tree`` branches (EAGLE / EAGLE-3 with a
``speculative_token_tree``; ``Engine(tree_verification=True)`` forces it for a chain), a
step in which every request has one uncomputed token verifies trees: each request's
query block is ``[root, node 0, ..., node n-1]`` (root = the last committed token at
position ``p``; node ``j`` at position ``p + depth(j)``, its KV at logical position
``p + 1 + j``) under the tree's ancestor mask (``CommonAttentionMetadata.tree_mask``);
``specjax.sampler.tree_rejection_sample`` walks the tree from the root (greedy rows on the
target's argmax, random rows by multi-draft rejection sampling over each node's drafted
children, lossless; per-request keys as in a chain step); the accepted nodes' KV is
moved to ``p + 1 .. p + m`` (``compact_tree_kv``); and
the proposer drafts the next tree from the chain-shaped batch chain drafting would have
given it (``tree_chain_inputs``), all inside the jitted step. The tree mask is static
for the whole batch and prompts need causal attention, so a step that prefills a prompt
is a chain step in which no request verifies drafts (decoding requests verify just their
root, gaining one token, and are redrafted). Near the end of a request it verifies a
breadth-first prefix of its tree (every ancestor of a node precedes it): the levels it
can still use (``max_tokens`` / ``max_model_len``), at most as many nodes as KV slots
remain before ``max_model_len``; possibly none (root only). Greedy and random
(``temperature > 0``, top-k / top-p, seeded) requests mix as in chain steps;
``rejection_sample_method='synthetic'`` is refused with a tree. (A seeded random request
is reproducible, but in tree mode its tokens may depend on the rest of the batch: whether
a step verifies a tree does, and a tree step draws from other key streams than a chain
step without drafts; its distribution does not.) Metrics: a request-step counts its
deepest verified level as its draft tokens (the most it can accept) and the accepted
path's levels as accepted positions (``SpecDecodingStats.num_spec_tokens`` = the tree's
depth); a chain tree gives exactly chain verification's numbers.

Not supported (yet): chunked prefill, preemption (admission reserves each request's
worst-case block count instead), synthetic acceptance with tree verification, logprobs,
penalties and other logits processors (see ``specjax.sampler``).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import math
import re
import time
from typing import Any, Callable, Hashable, Iterable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax.attention import CommonAttentionMetadata
from specjax.constants import next_power_of_2
from specjax.metadata import SpecDecodeMetadata
from specjax.metrics import SpecDecodingStats
from specjax.proposers import (DraftOutput, Proposer, ProposerInputs, TokenHistory,
                               prepare_inputs_padded, prepare_next_token_ids_padded)
from specjax.sampler import (PLACEHOLDER_TOKEN_ID, SamplingMetadata, rejection_sample,
                             tree_rejection_sample, unconditional_to_conditional_rates)
from specjax.tree import TokenTree

__all__ = ["SamplingParams", "RequestOutput", "GenerateResult", "TargetModel", "Engine",
           "generate", "attn_metadata_np", "spec_metadata_np"]

_NULL_BLOCK = 0
_I32 = np.int32
_req_counter = itertools.count()


# ---------------------------------------------------------------------------------------
# public types


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling parameters (vLLM's names).

    Attributes:
      max_tokens: most tokens to generate (>= 1).
      temperature: 0 is greedy; > 0 samples.
      top_k: 0 disables; top_p: 1 disables.
      seed: per-request seed; None draws one from ``generate``'s ``seed``. A seeded request
        gives the same tokens whatever else is in the batch.
      stop_token_ids: generation stops after emitting any of these (the token is kept).
      ignore_eos: do not stop on ``generate``'s ``eos_token_id``.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        def is_int(v):
            return isinstance(v, (int, np.integer)) and not isinstance(v, bool)

        if not is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {t!r}")
        if not is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 disables), got {self.top_k!r}")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {p!r}")
        if self.seed is not None and not is_int(self.seed):
            raise ValueError(f"seed must be None or an int, got {self.seed!r}")
        stops = tuple(self.stop_token_ids)
        if not all(is_int(s) and s >= 0 for s in stops):
            raise ValueError(f"stop_token_ids must be non-negative ints, got {self.stop_token_ids!r}")
        object.__setattr__(self, "stop_token_ids", tuple(int(s) for s in stops))


class RequestOutput(NamedTuple):
    """One request's result: ``token_ids`` generated (prompt excluded), ``finish_reason``
    ``"stop"`` (stop / EOS token, kept in ``token_ids``) or ``"length"`` (``max_tokens`` or
    ``max_model_len``), and its draft counts."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: str
    num_draft_tokens: int
    num_accepted_tokens: int


@dataclasses.dataclass
class GenerateResult:
    """Outputs in prompt order plus the run's speculative-decoding metrics.

    ``spec_stats`` sums every step's ``SpecDecodingStats`` (vLLM's counters);
    ``elapsed_s`` is the wall time of the loop (compilation included unless warmed up).
    """

    outputs: list[RequestOutput]
    spec_stats: SpecDecodingStats
    num_steps: int
    elapsed_s: float

    @property
    def token_ids(self) -> list[list[int]]:
        return [o.token_ids for o in self.outputs]

    @property
    def num_generated_tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.outputs)

    @property
    def mean_acceptance_length(self) -> float:
        """``1 + accepted / drafts`` (vLLM's; the bonus token counts); nan without drafts."""
        s = self.spec_stats
        return 1 + s.num_accepted_tokens / s.num_drafts if s.num_drafts else math.nan

    @property
    def acceptance_rate_per_position(self) -> list[float]:
        s = self.spec_stats
        return [a / s.num_drafts if s.num_drafts else math.nan for a in s.num_accepted_tokens_per_pos]


class TargetModel(NamedTuple):
    """The target: a ``specjax.models.DecoderLM`` runner and its params dict."""

    model: Any
    params: dict


# ---------------------------------------------------------------------------------------
# the jitted step


class _Spec(NamedTuple):
    """Static part of a step (hashable; the jit cache key besides the shapes)."""

    target: Any                 # DecoderLM
    impl: Any                   # device proposer (static) or None
    k: int                      # drafts per request (0: plain decoding)
    vocab_size: int
    all_greedy: bool
    synthetic_rates: tuple[float, ...] | None
    mode: str                   # "none" | "padded" | "split"
    needs_hidden: bool
    needs_aux: bool
    kernel_backend: str
    tree: Any = None            # TokenTree of a tree-verification step, else None
    block_size: int = 0         # KV block size (tree steps move KV and build slot mappings)


class _Batch(NamedTuple):
    """Device inputs of one step, padded to ``B`` rows, ``T = B * Q`` tokens."""

    input_ids: Any              # [T] int32
    positions: Any              # [T] int32
    attn: CommonAttentionMetadata
    sdm: SpecDecodeMetadata
    temperature: Any            # [B] float32
    top_k: Any                  # [B] int32
    top_p: Any                  # [B] float32
    seeds: Any                  # [B] uint32
    counters: Any               # [B] int32, tokens generated so far (folded into the key)
    backup_next: Any            # [B] int32, last committed token
    discard: Any                # [B] bool


def _sampling(spec: _Spec, b: _Batch) -> SamplingMetadata:
    """The step's sampling metadata: per-request keys from the seed and the number of
    tokens generated so far (``fold_in(key(seed), counter)``)."""
    keys = jax.vmap(lambda s, c: jax.random.key_data(jax.random.fold_in(jax.random.key(s), c)))(
        b.seeds, b.counters)
    return SamplingMetadata(b.temperature, b.top_k, b.top_p, keys, all_greedy=spec.all_greedy)


def _step(spec: _Spec, tparams, dparams, target_kv, draft_state, b: _Batch):
    if spec.tree is not None:
        return _tree_step(spec, tparams, dparams, target_kv, draft_state, b)
    cad = b.attn
    hidden, aux, target_kv = spec.target.forward(tparams, b.input_ids, b.positions, target_kv, cad)
    logits = spec.target.compute_logits(tparams, hidden[b.sdm.logits_indices])
    sampling = _sampling(spec, b)
    rates = None if spec.synthetic_rates is None else jnp.asarray(spec.synthetic_rates, jnp.float32)
    sampled = rejection_sample(b.sdm, None, logits, sampling, rates)
    drafts, extra = None, None
    h = hidden if spec.needs_hidden else None
    a = aux if spec.needs_aux else None
    if spec.mode == "padded":
        next_ids, valid = prepare_next_token_ids_padded(
            spec.impl, sampled, b.discard, b.backup_next, vocab_size=spec.vocab_size,
            num_reqs=cad.num_reqs, kernel_backend=spec.kernel_backend)
        tis, nrej = prepare_inputs_padded(spec.impl, b.sdm, valid, cad,
                                          kernel_backend=spec.kernel_backend)
        inputs = ProposerInputs(b.input_ids, b.positions, h, a, next_ids, tis, nrej, cad)
        drafts, draft_state = spec.impl.propose(dparams, draft_state, inputs)
    elif spec.mode == "split":
        extra = (h, a)
    if drafts is not None:
        # one array, so the host fetches the step's results in a single device->host copy:
        # [sampled (k+1) | drafts (k) | draft count (1)]
        sampled = jnp.concatenate([sampled, drafts.token_ids.astype(jnp.int32),
                                   drafts.num_drafts.astype(jnp.int32)[:, None]], axis=1)
    return sampled, target_kv, draft_state, extra


# ---------------------------------------------------------------------------------------
# tree verification step (EAGLE / EAGLE-3 token trees)


def _tree_step(spec: _Spec, tparams, dparams, target_kv, draft_state, b: _Batch):
    """One tree-verification step (every request's query block is ``[root, node 0, ...,
    node n_r - 1]``, ``n_r`` a breadth-first prefix of the tree; ``b.attn.tree_mask`` is the
    tree's ancestor mask with the root), fused like the padded chain step:

    1. target forward with tree attention; logits at every slot; ``tree_rejection_sample``
       (per-request keys derived from the seed and the tokens generated, as ``_step``);
    2. ``compact_tree_kv``: the accepted nodes' target KV moves to the contiguous positions
       after the root;
    3. ``tree_chain_inputs``: the proposer gets the batch chain drafting would have given it
       (root, accepted nodes, then rejected padding) and drafts the next tree.

    Returns what ``_step`` returns: ``[B, k+1]`` sampled tokens (the ``[B, depth+1]``
    verifier output padded with -1) followed by the drafts and their count.
    """
    tree = spec.tree
    n_nodes = tree.num_nodes
    cad = b.attn
    hidden, aux, target_kv = spec.target.forward(tparams, b.input_ids, b.positions, target_kv, cad)
    bp = cad.query_start_loc.shape[0] - 1
    t_pad = b.input_ids.shape[0]
    qsl = cad.query_start_loc
    qlen = qsl[1:] - qsl[:-1]
    real = jnp.arange(bp, dtype=jnp.int32) < cad.num_reqs
    # slot 0 = root, slot 1 + j = node j (rows past a request's block are masked out by
    # num_drafts below)
    idx = jnp.clip(qsl[:-1, None] + jnp.arange(n_nodes + 1, dtype=jnp.int32)[None, :], 0, t_pad - 1)
    logits = spec.target.compute_logits(tparams, hidden[idx.reshape(-1)]).reshape(bp, n_nodes + 1, -1)
    num_drafts = jnp.where(real, qlen - 1, 0)
    sampling = _sampling(spec, b)
    out, acc_nodes, n_acc = tree_rejection_sample(logits, b.input_ids[idx[:, 1:]], num_drafts,
                                                  sampling, tree=tree, num_reqs=cad.num_reqs)
    root_pos = jnp.where(real, cad.seq_lens - qlen, 0)          # logical position p of the root
    target_kv = compact_tree_kv(target_kv, cad.block_table, root_pos, acc_nodes, n_acc, real,
                                block_size=spec.block_size)
    sampled = jnp.concatenate(
        [out, jnp.full((bp, n_nodes - tree.depth), PLACEHOLDER_TOKEN_ID, jnp.int32)], axis=1)
    next_ids, _ = prepare_next_token_ids_padded(
        spec.impl, sampled, b.discard, b.backup_next, vocab_size=spec.vocab_size,
        num_reqs=cad.num_reqs, kernel_backend=spec.kernel_backend)
    padded = spec.mode == "padded"
    ids, pos, src, md, tis, nrej = tree_chain_inputs(
        b.input_ids, cad, acc_nodes, n_acc, tree=tree, block_size=spec.block_size, padded=padded)
    h = hidden[src] if spec.needs_hidden else None
    a = aux[src] if spec.needs_aux else None
    inputs = ProposerInputs(ids, pos, h, a, next_ids, tis, nrej, md)
    drafts, draft_state = spec.impl.propose(dparams, draft_state, inputs)
    res = jnp.concatenate([sampled, drafts.token_ids.astype(jnp.int32),
                           drafts.num_drafts.astype(jnp.int32)[:, None]], axis=1)
    return res, target_kv, draft_state, None


def _slots(block_table, rows, pos, block_size: int):
    """Flat KV slot of logical position ``pos`` of request ``rows`` (same shapes)."""
    c = block_table.shape[1]
    blk = block_table[rows, jnp.clip(pos // block_size, 0, c - 1)]
    return blk * block_size + pos % block_size


def compact_tree_kv(kv_caches, block_table, root_pos, accepted_nodes, num_accepted, real, *,
                    block_size: int):
    """Move the accepted nodes' KV to where the accepted tokens now sit (traceable).

    The verification pass wrote node ``j``'s K and V at logical position ``p + 1 + j``
    (``p`` = ``root_pos``, the root's); after accepting nodes ``a_1..a_m`` (one per level)
    the sequence continues ``p + 1 .. p + m``, so ``p + 1 + a_i`` is copied to ``p + i``
    for every leaf array of ``kv_caches`` (``[num_blocks, block_size, ...]``: every layer's
    K and V), through ``block_table``. All sources are gathered before anything is written
    (``p + 1 + a_i >= p + i``: a later source may be an earlier destination); entries with
    ``a_i + 1 == i`` (already in place), past ``num_accepted`` or on rows that are not
    ``real`` write nothing.
    """
    b, depth = accepted_nodes.shape
    i = jnp.arange(1, depth + 1, dtype=jnp.int32)[None, :]
    move = real[:, None] & (i <= num_accepted[:, None]) & (accepted_nodes + 1 != i)
    rows = jnp.broadcast_to(jnp.arange(b, dtype=jnp.int32)[:, None], (b, depth))
    src = _slots(block_table, rows, root_pos[:, None] + 1 + jnp.maximum(accepted_nodes, 0), block_size)
    dst = _slots(block_table, rows, root_pos[:, None] + i, block_size)
    src = jnp.where(move, src, 0).reshape(-1)
    dst = jnp.where(move, dst, -1).reshape(-1)

    from specjax.models.attention import scatter_slots

    def copy(cache):
        flat = cache.reshape((cache.shape[0] * cache.shape[1],) + cache.shape[2:])
        return scatter_slots(cache, flat[src], dst)

    return jax.tree.map(copy, kv_caches)


def tree_chain_inputs(input_ids, cad: CommonAttentionMetadata, accepted_nodes, num_accepted, *,
                      tree: TokenTree, block_size: int, padded: bool = True):
    """The proposer's chain-shaped batch after a tree verification (traceable).

    Request ``r`` of the verified batch (block ``[root, node 0 .. node n_r-1]`` at
    ``query_start_loc[r]``, root at logical position ``p = seq_len - query_len``) becomes
    the block ``[root, a_1, .., a_m, rejected...]``: the root and its accepted nodes
    (gathered), then, in padded mode, ``D_r - m`` rejected slots (``D_r`` = depth of the
    request's deepest node, 0 without drafts) as the chain engine leaves rejected drafts in
    the batch: they hold nodes of the request's block, are counted in
    ``num_rejected_tokens`` and are overwritten later. Non-padded mode keeps the root and
    the accepted nodes only (vLLM's ``prepare_inputs``).

    Positions and KV slots are contiguous, ``p .. p + len - 1``: the accepted node ``a_i``
    sits at level ``i`` (one per level on the path), so its position in the verification
    pass, ``p + depth(a_i)``, is ``p + i`` already, and its target KV was moved to ``p + i``
    (``compact_tree_kv``).

    Returns ``(token_ids [T], positions [T], src [T], attn_metadata, token_indices_to_sample
    [B], num_rejected_tokens [B])``: ``src`` indexes the verified batch (to gather hidden
    states); the last two are None in non-padded mode.
    """
    depth = tree.depth
    t_pad = input_ids.shape[0]
    qsl = cad.query_start_loc
    bp = qsl.shape[0] - 1
    qlen = qsl[1:] - qsl[:-1]
    real = jnp.arange(bp, dtype=jnp.int32) < cad.num_reqs
    n_nodes = jnp.where(real, qlen - 1, 0)
    d_r = jnp.asarray((0,) + tree.depths, jnp.int32)[n_nodes]   # a prefix's last node is deepest
    m = jnp.where(real, num_accepted, 0)
    length = jnp.where(real, 1 + (d_r if padded else m), 0)
    qsl_c = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(length).astype(jnp.int32)])
    p = jnp.where(real, cad.seq_lens - qlen, 0)
    t = jnp.arange(t_pad, dtype=jnp.int32)
    r_t = jnp.minimum(jnp.sum(qsl_c[None, 1:] <= t[:, None], axis=1, dtype=jnp.int32), bp - 1)
    i_t = t - qsl_c[r_t]
    valid = t < qsl_c[-1]
    node = accepted_nodes[r_t, jnp.clip(i_t - 1, 0, depth - 1)]
    off = jnp.where(i_t == 0, 0, jnp.where(i_t <= m[r_t], node + 1, i_t))
    src = jnp.clip(jnp.where(valid, qsl[r_t] + off, 0), 0, t_pad - 1)
    pos = jnp.where(valid, p[r_t] + i_t, 0)
    slots = jnp.where(valid, _slots(cad.block_table, r_t, pos, block_size), -1)
    seq = jnp.where(real, p + length, 0)
    md = cad.replace(query_start_loc=qsl_c, seq_lens=seq, slot_mapping=slots.astype(jnp.int32),
                     num_actual_tokens=qsl_c[-1], max_seq_len=jnp.max(seq).astype(jnp.int32),
                     causal=True, tree_mask=None)
    ids = jnp.where(valid, input_ids[src], 0)
    if not padded:
        return ids, pos, src, md, None, None
    tis = jnp.where(real, qsl_c[:-1] + m, 0)
    nrej = jnp.where(real, d_r - m, 0)
    return ids, pos, src, md, tis, nrej


_step_jit = jax.jit(_step, static_argnums=0, donate_argnums=(3, 4))


def _split_propose(impl, dparams, draft_state, input_ids, positions, hidden, aux, token_indices,
                   next_token_ids, attn):
    """Non-padded mode, after the host's ``prepare_inputs``: keep the accepted tokens."""
    take = lambda x: None if x is None else x[token_indices]  # noqa: E731
    inputs = ProposerInputs(take(input_ids), take(positions), take(hidden), take(aux),
                            next_token_ids, None, None, attn)
    return impl.propose(dparams, draft_state, inputs)


_split_propose_jit = jax.jit(_split_propose, static_argnums=0, donate_argnums=2)


def step_cache_size() -> int:
    """Number of compiled variants of the decoding step (for recompilation checks)."""
    return _step_jit._cache_size()


# ---------------------------------------------------------------------------------------
# requests and blocks


@dataclasses.dataclass
class _Request:
    index: int
    req_id: Hashable
    prompt: list[int]
    params: SamplingParams
    seed: int
    stop_ids: frozenset
    output: list[int] = dataclasses.field(default_factory=list)
    num_computed: int = 0
    drafts: list[int] = dataclasses.field(default_factory=list)
    blocks: list[int] = dataclasses.field(default_factory=list)
    reserve: int = 0            # worst-case block count over the request's life
    row: int = -1               # row of the token-history buffer
    finish_reason: str | None = None
    num_drafted: int = 0
    num_accepted: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    def token(self, i: int) -> int:
        p = len(self.prompt)
        return self.prompt[i] if i < p else self.output[i - p]


def _pick(buckets: Sequence[int] | None, n: int, cap: int | None = None) -> int:
    """Smallest bucket >= n (powers of two when ``buckets`` is None), at most ``cap``."""
    if buckets is None:
        b = next_power_of_2(n)
    else:
        fits = [x for x in buckets if x >= n]
        if not fits:
            raise ValueError(f"no bucket in {tuple(buckets)} holds {n}")
        b = min(fits)
    return b if cap is None else min(max(b, n), cap)


# ---------------------------------------------------------------------------------------
# the engine


class Engine:
    """A target, a proposer (or None), a paged KV cache, and the decoding loop.

    Args:
      target: ``TargetModel(model, params)`` or a ``(model, params)`` tuple; ``model`` is a
        ``specjax.models.DecoderLM``. When the proposer needs aux hidden states, the runner
        is rebuilt with the proposer's ``aux_layer_ids``.
      proposer: from ``specjax.make_proposer``, or None for plain decoding.
      max_model_len: context cap (prompt + output).
      block_size: tokens per KV block.
      max_num_seqs: most requests running at once (the rest wait).
      num_blocks: size of the KV block pool (default: enough for ``max_num_seqs`` requests
        at ``max_model_len``, plus the null block).
      kernel_backend: index-kernel backend for the padded-mode input preparation.
      batch_buckets / query_buckets / context_buckets: padded sizes the jitted step is
        compiled for: rows, tokens per request (``T = rows * query``), block-table width in
        blocks. None: powers of two (context capped at ``max_model_len``). Fewer buckets,
        fewer compilations.
      kv_dtype: dtype of the KV caches (default float32).
      min_tokens_per_step: pad every step to at least this many tokens (``B_pad *
        query_len >= min_tokens_per_step``, the query bucket rising as needed; default 2).
        On the H200 an 8B-shaped plain step at B=1 takes 12.7 ms with one token and 6.9 ms
        padded to two (``benchmarks/RESULTS.md``): XLA's code for one-row matrix products
        is far slower than for two rows. (A one-row KV-cache write also used to become a
        dynamic-update-slice that copied the donated caches every step; the cache write,
        ``models.attention.scatter_slots``, now keeps it in place whatever the padding.)
        The padding token writes nothing (slot -1) and is not sampled.
      tree_verification: None (default): verify trees when the proposer's token tree
        branches (see the module docstring), chains otherwise; True: the tree path even
        for a chain tree (tests, benchmarks; needs a device model proposer); False: chain
        verification.
      mesh: a ``jax.sharding.Mesh`` for tensor parallelism (None: one device). The target's
        params and KV caches, and a device proposer's params and state, are placed with
        ``specjax.sharding``'s Megatron rules over its ``tp_axis`` axis (attention by kv
        head, MLP by intermediate size, vocabulary-split heads; other axes replicate); XLA's
        partitioner follows those placements through the jitted step. A proposer with
        ``mesh`` / ``vocab_axis`` fields (EAGLE, EAGLE-3, DFlash, draft model) gets them, so
        its ``config.use_local_argmax_reduction`` reduces over the vocabulary shards.
        Indivisible head / intermediate / vocabulary sizes raise ValueError naming the
        parameter, before anything is placed.
      tp_axis: the mesh axis to shard over (default ``"tp"``).
    """

    def __init__(self, target, proposer: Proposer | None = None, *, max_model_len: int,
                 block_size: int = 16, max_num_seqs: int = 8, num_blocks: int | None = None,
                 kernel_backend: str = "auto", batch_buckets: Sequence[int] | None = None,
                 query_buckets: Sequence[int] | None = None,
                 context_buckets: Sequence[int] | None = None, kv_dtype=jnp.float32,
                 min_tokens_per_step: int = 2, tree_verification: bool | None = None,
                 mesh: Any = None, tp_axis: str = "tp") -> None:
        from specjax.models import DecoderLM

        if isinstance(target, tuple) and not isinstance(target, TargetModel):
            if len(target) != 2:
                raise ValueError("target must be TargetModel(model, params) or a (model, params) pair")
            target = TargetModel(*target)
        if not isinstance(target, TargetModel) or not isinstance(target.model, DecoderLM):
            raise ValueError("target must be TargetModel(model, params) with a specjax.models.DecoderLM "
                             f"model, got {type(getattr(target, 'model', target)).__name__}")
        if proposer is not None and not isinstance(proposer, Proposer):
            raise ValueError(f"proposer must come from specjax.make_proposer (a Proposer) or be None, "
                             f"got {type(proposer).__name__}")
        for name, v, lo in (("max_model_len", max_model_len, 2), ("block_size", block_size, 1),
                            ("max_num_seqs", max_num_seqs, 1),
                            ("min_tokens_per_step", min_tokens_per_step, 1)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo:
                raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")
        model = target.model
        vocab = model.config.vocab_size
        self.proposer = proposer
        self.k = 0 if proposer is None else proposer.num_speculative_tokens
        if proposer is not None:
            if proposer.vocab_size is not None and proposer.vocab_size != vocab:
                raise ValueError(f"the proposer's vocabulary ({proposer.vocab_size}) does not match "
                                 f"the target's ({vocab})")
            if proposer.needs_aux_hidden_states and tuple(model.aux_layer_ids) != proposer.aux_layer_ids:
                model = dataclasses.replace(model, aux_layer_ids=proposer.aux_layer_ids)
            for name, want in (("block_size", block_size), ("max_model_len", max_model_len)):
                got = getattr(proposer, name, None)
                if got is not None and got != want:
                    raise ValueError(f"the proposer was built with {name}={got}, the engine uses {want}")
        self.mesh, self.tp_axis = mesh, tp_axis
        if mesh is not None:
            target, proposer = _tensor_parallel(TargetModel(model, target.params), proposer,
                                                mesh, tp_axis)
            self.proposer = proposer
        self.target = TargetModel(model, target.params)
        self.vocab_size = vocab
        self.max_model_len = int(max_model_len)
        self.block_size = int(block_size)
        self.max_num_seqs = int(max_num_seqs)
        self.min_tokens_per_step = int(min_tokens_per_step)
        self.kernel_backend = kernel_backend
        self.batch_buckets = None if batch_buckets is None else tuple(sorted(batch_buckets))
        self.query_buckets = None if query_buckets is None else tuple(sorted(query_buckets))
        self.context_buckets = None if context_buckets is None else tuple(sorted(context_buckets))
        # Lookahead: KV slots the proposer writes past the verified tokens (the draft chain,
        # extra slots of draft-model / parallel drafting), allocated ahead like vLLM's
        # num_lookahead_tokens.
        self.lookahead = 0 if proposer is None else self.k + proposer.max_new_slots + 1
        self.max_blocks_per_req = -(-self.max_model_len // self.block_size)
        if num_blocks is None:
            num_blocks = 1 + self.max_num_seqs * self.max_blocks_per_req
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, (int, np.integer)) or num_blocks < 2:
            raise ValueError(f"num_blocks must be an int >= 2 (block 0 is the null block), "
                             f"got {num_blocks!r}")
        self.num_blocks = int(num_blocks)
        self.kv_dtype = kv_dtype
        self.mode = ("none" if proposer is None or proposer.needs_token_history
                     else "padded" if proposer.padded_drafter_batch else "split")
        cfg = None if proposer is None else proposer.config
        self.tree = self._resolve_tree(proposer, tree_verification)
        #: length of the per-position acceptance counts: k, or the tree's depth
        self.num_spec_positions = self.k if self.tree is None else self.tree.depth
        if self.tree is not None:
            self._tree_mask = self.tree.ancestor_mask(with_root=True)      # static, (1+N)^2
            # position offset of each slot of a tree block: root 0, node j depth(j)
            self._node_depths = np.array((0,) + self.tree.depths, np.int64)
        self.synthetic_rates = None
        if cfg is not None and cfg.rejection_sample_method == "synthetic":
            if cfg.synthetic_acceptance_rates is None:
                raise ValueError("rejection_sample_method='synthetic' needs synthetic_acceptance_rates "
                                 "in the reference loop (synthetic_acceptance_length is not supported)")
            self.synthetic_rates = tuple(unconditional_to_conditional_rates(cfg.synthetic_acceptance_rates))
            if self.tree is not None:
                raise ValueError("rejection_sample_method='synthetic' is not supported with tree "
                                 "verification (a branching speculative_token_tree)")
        self._reset_cache()

    @staticmethod
    def _resolve_tree(proposer, tree_verification) -> TokenTree | None:
        """The token tree to verify, or None for chain verification: the proposer's
        ``token_tree`` (itself, its ``impl``, else its config's ``speculative_token_tree``),
        used when it branches (``tree_verification=None``) or when forced (True)."""
        if tree_verification not in (None, True, False):
            raise ValueError(f"tree_verification must be None, True or False, got {tree_verification!r}")
        tree = None
        if proposer is not None:
            tree = getattr(proposer, "token_tree", None)
            if tree is None:
                tree = getattr(proposer.impl, "token_tree", None)
            if tree is None:
                tree = getattr(getattr(proposer, "config", None), "token_tree", None)
        if tree is not None and not isinstance(tree, TokenTree):
            tree = TokenTree.from_choices(tree)
        use = (tree is not None and not tree.is_chain) if tree_verification is None else tree_verification
        if not use:
            return None
        if tree is None:
            raise ValueError("tree_verification=True needs a proposer with a token tree "
                             "(speculative_token_tree)")
        if proposer.needs_token_history or proposer.impl is None:
            raise ValueError(f"tree verification needs a device model proposer (EAGLE / EAGLE-3), "
                             f"got method={proposer.method!r}")
        if tree.num_nodes != proposer.num_speculative_tokens:
            raise ValueError(f"the token tree has {tree.num_nodes} nodes but the proposer drafts "
                             f"num_speculative_tokens={proposer.num_speculative_tokens}; they must match")
        return tree

    # -- state ---------------------------------------------------------------------

    def _reset_cache(self) -> None:
        m = self.target.model
        self.target_kv = m.init_kv_caches(self.num_blocks, self.block_size, self.kv_dtype)
        self.draft_state = (None if self.proposer is None
                            else self.proposer.init_state(self.num_blocks, self.kv_dtype))
        if self.mesh is not None:
            from specjax.sharding import state_shardings

            self.target_kv, self.draft_state = (
                jax.device_put(x, state_shardings(x, self.mesh, axis=self.tp_axis))
                for x in (self.target_kv, self.draft_state))
        self.free_blocks = list(range(self.num_blocks - 1, _NULL_BLOCK, -1))   # pop() -> 1, 2, ...
        self.tok_buf = np.zeros((self.max_num_seqs, self.max_model_len), _I32)
        self.free_rows = list(range(self.max_num_seqs - 1, -1, -1))

    # -- validation ----------------------------------------------------------------

    def _check_inputs(self, prompts, sampling_params) -> tuple[list[list[int]], list[SamplingParams]]:
        if isinstance(prompts, np.ndarray) and prompts.ndim == 2:
            prompts = list(prompts)
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or len(prompts) == 0:
            raise ValueError("prompts must be a non-empty list of token-id lists")
        out = []
        for i, p in enumerate(prompts):
            arr = np.asarray(p)
            if arr.ndim != 1 or arr.size == 0 or not (np.issubdtype(arr.dtype, np.integer)):
                raise ValueError(f"prompts[{i}] must be a non-empty list of int token ids")
            if arr.min() < 0 or arr.max() >= self.vocab_size:
                bad = int(arr[(arr < 0) | (arr >= self.vocab_size)][0])
                raise ValueError(f"prompts[{i}] holds token id {bad}, outside the target's vocabulary "
                                 f"[0, {self.vocab_size})")
            if arr.size >= self.max_model_len:
                raise ValueError(f"prompts[{i}] has {arr.size} tokens; max_model_len={self.max_model_len} "
                                 "leaves no room to generate")
            out.append([int(t) for t in arr])
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sps = [sampling_params] * len(out)
        else:
            sps = list(sampling_params)
            if len(sps) != len(out):
                raise ValueError(f"sampling_params has {len(sps)} entries for {len(out)} prompts")
            if not all(isinstance(s, SamplingParams) for s in sps):
                raise ValueError("sampling_params must be a SamplingParams or a list of them")
        for i, (p, s) in enumerate(zip(out, sps)):
            if self._worst_blocks(len(p), s.max_tokens) > self.num_blocks - 1:
                raise ValueError(f"prompts[{i}] may need {self._worst_blocks(len(p), s.max_tokens)} KV "
                                 f"blocks, more than the pool's {self.num_blocks - 1}")
        return out, sps

    def _worst_blocks(self, prompt_len: int, max_tokens: int) -> int:
        n = min(self.max_model_len, prompt_len + max_tokens + self.lookahead)
        return -(-n // self.block_size)

    # -- public --------------------------------------------------------------------

    def generate(self, prompts: Sequence[Sequence[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 eos_token_id: int | None = None, seed: int = 0,
                 stat_loggers: Iterable[Callable[[SpecDecodingStats], None]] = (),
                 progress: Callable[[int, int, int], None] | None = None) -> GenerateResult:
        """Generate for every prompt; see :func:`generate`."""
        prompts, sps = self._check_inputs(prompts, sampling_params)
        if eos_token_id is not None and not (0 <= int(eos_token_id) < self.vocab_size):
            raise ValueError(f"eos_token_id={eos_token_id} is outside the vocabulary [0, {self.vocab_size})")
        stat_loggers = list(stat_loggers)
        rng = np.random.default_rng(seed)
        waiting = collections.deque()
        reqs = []
        for i, (p, sp) in enumerate(zip(prompts, sps)):
            stops = set(sp.stop_token_ids)
            if eos_token_id is not None and not sp.ignore_eos:
                stops.add(int(eos_token_id))
            r = _Request(index=i, req_id=f"req-{next(_req_counter)}", prompt=p, params=sp,
                         seed=int(sp.seed if sp.seed is not None else rng.integers(0, 2**31 - 1)) % 2**32,
                         stop_ids=frozenset(stops))
            r.reserve = self._worst_blocks(len(p), sp.max_tokens)
            reqs.append(r)
            waiting.append(r)
        running: list[_Request] = []
        total = SpecDecodingStats.new(self.num_spec_positions)
        steps, done = 0, 0
        t0 = time.perf_counter()
        try:
            while waiting or running:
                self._admit(waiting, running)
                stats, finished = self._step(running)
                steps += 1
                if stats is not None:
                    for f in stat_loggers:
                        f(stats)
                    _accumulate(total, stats)
                for r in finished:
                    running.remove(r)
                    self._release(r)
                done += len(finished)
                if progress is not None:
                    progress(done, len(reqs), sum(len(r.output) for r in reqs))
        finally:
            if self.proposer is not None:
                self.proposer.finish_requests([r.req_id for r in reqs])
            for r in running:
                self._release(r)
        elapsed = time.perf_counter() - t0
        outs = [RequestOutput(r.prompt, r.output, r.finish_reason, r.num_drafted, r.num_accepted)
                for r in reqs]
        return GenerateResult(outs, total, steps, elapsed)

    def warmup(self, batch_sizes: Sequence[int], query_lens: Sequence[int],
               context_blocks: Sequence[int] | None = None, *, all_greedy: Sequence[bool] = (True,)
               ) -> int:
        """Compile the step for every combination of the given buckets ahead of time (a
        dummy step with no real request, which writes nothing). Returns the number of
        variants compiled. ``context_blocks`` None: the widest (``max_model_len``)."""
        if context_blocks is None:
            context_blocks = [self.max_blocks_per_req]
        before = step_cache_size()
        phases = (False,) if self.tree is None else (False, True)
        for b, q, c, g, tv in itertools.product(batch_sizes, query_lens, context_blocks, all_greedy,
                                                phases):
            if int(b) * int(q) < self.min_tokens_per_step:      # as _buckets pads it
                q = _pick(self.query_buckets, -(-self.min_tokens_per_step // int(b)))
            batch = self._dummy_batch(int(b), int(q), int(c), tree_verify=tv)
            out = self._run(batch, all_greedy=bool(g), tree_verify=tv)
            jax.block_until_ready(out)
        return step_cache_size() - before

    def time_decode_step(self, num_reqs: int, context_len: int, *, iters: int = 20, seed: int = 0
                         ) -> dict[str, float]:
        """Cost of one steady-state decode step (benchmarks).

        ``num_reqs`` requests, each with ``context_len`` tokens in the KV cache and ``k``
        random drafts to verify (none for plain decoding), run through the jitted step
        (target forward + verification + device drafting) ``iters`` times, each synced
        on the sampled tokens as the loop does. Token-history proposers also draft after
        each step, from histories that grow by one token a call as the loop's do (lengths
        ``context_len - iters + 1 .. context_len``, after an untimed first call at
        ``context_len - iters`` that hands the proposer the whole contexts), so stateful
        ones (``ngram_gpu``, suffix) are timed in their steady state. Returns seconds:
        ``step_s`` (median), ``host_propose_s`` (median of the drafting calls, 0 for device
        proposers) and ``compile_s`` (first call).
        """
        reqs = self._bench_requests(num_reqs, context_len, seed)
        try:
            tv = self.tree is not None
            batch, _, b_pad = self._build_batch(reqs, tree_verify=tv)
            t0 = time.perf_counter()
            np.asarray(self._run(batch, all_greedy=True, tree_verify=tv)[0])   # compiles
            compile_s = time.perf_counter() - t0
            drafting = self.proposer is not None and self.proposer.needs_token_history
            if drafting:
                ids = [r.req_id for r in reqs]
                rows = self.tok_buf[[r.row for r in reqs]]
                first = max(1, context_len - iters)

                def history(i: int) -> TokenHistory:
                    n = min(first + i, context_len)
                    return TokenHistory(ids, rows, np.full(num_reqs, n, _I32),
                                        np.full(num_reqs, first - 1, _I32),
                                        [[int(rows[j, n - 1])] for j in range(num_reqs)],
                                        rows_pad=b_pad)

                self.proposer.propose_from_history(history(0))
            step, host = [], []
            for i in range(1, iters + 1):
                t0 = time.perf_counter()
                out, _ = self._run(batch, all_greedy=True, tree_verify=tv)
                np.asarray(out)          # sampled tokens (and drafts): what the loop fetches
                step.append(time.perf_counter() - t0)
                if drafting:
                    hist = history(i)
                    t0 = time.perf_counter()
                    self.proposer.propose_from_history(hist)
                    host.append(time.perf_counter() - t0)
        finally:
            if self.proposer is not None:
                self.proposer.finish_requests([r.req_id for r in reqs])
            for r in reqs:
                self._release(r)
        return {"step_s": float(np.median(step)), "host_propose_s": float(np.median(host)) if host else 0.0,
                "compile_s": compile_s}

    def lower_decode_step(self, num_reqs: int, context_len: int, *, seed: int = 0):
        """The ``jax.stages.Lowered`` of the step ``time_decode_step`` times (same buckets),
        for inspecting what XLA makes of it: ``.as_text()`` (donation shows as
        ``tf.aliasing_output``), ``.compile().as_text()`` (see ``kv_cache_copies``)."""
        reqs = self._bench_requests(num_reqs, context_len, seed)
        try:
            tv = self.tree is not None
            batch, _, _ = self._build_batch(reqs, tree_verify=tv)
            spec = self._spec(True, tree_verify=tv)
            return _step_jit.lower(spec, self.target.params,
                                   None if spec.impl is None else self.proposer.params,
                                   self.target_kv, self.draft_state, batch)
        finally:
            for r in reqs:
                self._release(r)

    def kv_cache_copies(self, compiled_hlo: str) -> int:
        """How many instructions of a compiled step's HLO text copy a whole KV-cache-shaped
        buffer (target or draft; ``copy`` ops and copy fusions). 0 when the donated caches
        are updated in place."""
        shapes = set()
        for x in jax.tree.leaves((self.target_kv, self.draft_state)):
            if getattr(x, "ndim", 0) == 4:        # [num_blocks, block_size, heads, head_dim]
                for dims in (x.shape, (x.shape[0] * x.shape[1],) + x.shape[2:]):
                    shapes.add(f"{jnp.dtype(x.dtype).name}[{','.join(map(str, dims))}]"
                               .replace("float32", "f32").replace("bfloat16", "bf16")
                               .replace("float16", "f16"))
        n = 0
        for line in compiled_hlo.splitlines():
            m = re.match(r"\s*(?:ROOT\s+)?%(\S+)\s*=\s*([a-z0-9]+\[[0-9,]*\])\S*\s+([a-z-]+)\(", line)
            if m and m.group(2) in shapes and (m.group(3) == "copy" or
                                               (m.group(3) == "fusion" and "copy" in m.group(1))):
                n += 1
        return n

    def _bench_requests(self, num_reqs: int, context_len: int, seed: int) -> list[_Request]:
        """Requests in the steady decode state: ``context_len`` tokens (all but the last in
        the KV cache) and ``k`` random drafts; each holds a token-history row."""
        if not 1 <= num_reqs <= self.max_num_seqs:
            raise ValueError(f"num_reqs must be in [1, max_num_seqs={self.max_num_seqs}], got {num_reqs}")
        if not 2 <= context_len <= self.max_model_len - self.k - 1:
            raise ValueError(f"context_len must be in [2, max_model_len - k - 1 = "
                             f"{self.max_model_len - self.k - 1}], got {context_len}")
        rng = np.random.default_rng(seed)
        reqs = []
        for i in range(num_reqs):
            toks = rng.integers(0, self.vocab_size, context_len).tolist()
            r = _Request(index=i, req_id=f"bench-{next(_req_counter)}", prompt=toks[:-1],
                         params=SamplingParams(max_tokens=self.max_model_len), seed=i,
                         stop_ids=frozenset(), output=toks[-1:], num_computed=context_len - 1,
                         drafts=rng.integers(0, self.vocab_size, self.k).tolist())
            r.row = self.free_rows.pop()
            self.tok_buf[r.row, :context_len] = toks
            reqs.append(r)
        return reqs

    # -- scheduling ----------------------------------------------------------------

    def _admit(self, waiting, running) -> None:
        while waiting and len(running) < self.max_num_seqs:
            r = waiting[0]
            owed = sum(x.reserve - len(x.blocks) for x in running)
            if len(self.free_blocks) - owed < r.reserve:
                if not running:   # cannot happen: _check_inputs bounds every request
                    raise RuntimeError("KV block pool too small for a single request")
                break
            waiting.popleft()
            r.row = self.free_rows.pop()
            self.tok_buf[r.row, : len(r.prompt)] = r.prompt
            running.append(r)

    def _release(self, r: _Request) -> None:
        self.free_blocks.extend(reversed(r.blocks))
        r.blocks = []
        if r.row >= 0:
            self.free_rows.append(r.row)
            r.row = -1

    def _ensure_blocks(self, r: _Request, upto: int) -> None:
        need = -(-min(upto, self.max_model_len) // self.block_size)
        while len(r.blocks) < need:
            r.blocks.append(self.free_blocks.pop())

    def _buckets(self, n: int, max_q: int, max_blocks: int) -> tuple[int, int, int]:
        b = _pick(self.batch_buckets, n)
        q = _pick(self.query_buckets, max(max_q, self.k + 1, -(-self.min_tokens_per_step // b)))
        c = _pick(self.context_buckets, max_blocks, cap=self.max_blocks_per_req)
        return b, q, c

    def _build_batch(self, running: list[_Request], tree_verify: bool = False
                     ) -> tuple[_Batch, list[int], int]:
        """The step's padded inputs: each request's uncomputed tokens, then its drafts. A
        tree-verification step (``tree_verify``: every request has one uncomputed token, the
        root) places node ``j`` at position ``p + depth(j)`` (KV slot ``p + 1 + j``) and
        attends with the tree's ancestor mask."""
        n = len(running)
        sched, qlens, seqs = [], [], []
        for r in running:
            toks = [r.token(i) for i in range(r.num_computed, r.num_tokens)] + r.drafts
            sched.append(toks)
            qlens.append(len(toks))
            seqs.append(r.num_computed + len(toks))
            self._ensure_blocks(r, seqs[-1] + self.lookahead)
        B, Q, C = self._buckets(n, max(qlens), max(len(r.blocks) for r in running))
        table = np.full((B, C), _NULL_BLOCK, _I32)
        for i, r in enumerate(running):
            m = min(len(r.blocks), C)
            table[i, :m] = r.blocks[:m]
        q = np.array(qlens, np.int64)
        s = np.array(seqs, np.int64)
        attn = attn_metadata_np(q, s, table, block_size=self.block_size, num_tokens_pad=B * Q,
                                max_query_len=Q)
        ids = np.zeros(B * Q, _I32)
        ids[: int(q.sum())] = [t for toks in sched for t in toks]
        pos = np.zeros(B * Q, _I32)
        offs = _ragged_arange(q)
        if tree_verify:
            offs = self._node_depths[offs]       # slot 0 the root, slot 1 + j node j
            attn = attn.replace(tree_mask=self._tree_mask)
        pos[: int(q.sum())] = np.repeat(s - q, q) + offs
        sdm = spec_metadata_np([r.drafts for r in running], q, num_reqs_pad=B, max_spec_len=self.k)
        temp = np.zeros(B, np.float32)
        topk = np.zeros(B, _I32)
        topp = np.ones(B, np.float32)
        seeds = np.zeros(B, np.uint32)
        ctr = np.zeros(B, _I32)
        backup = np.zeros(B, _I32)
        for i, r in enumerate(running):
            sp = r.params
            temp[i], topk[i], topp[i] = sp.temperature, sp.top_k, sp.top_p
            seeds[i] = r.seed
            ctr[i] = len(r.output)
            backup[i] = r.token(r.num_tokens - 1)
        batch = _Batch(ids, pos, attn, sdm, temp, topk, topp, seeds, ctr, backup, np.zeros(B, np.bool_))
        return batch, qlens, B

    def _dummy_batch(self, B: int, Q: int, C: int, tree_verify: bool = False) -> _Batch:
        z = np.zeros(0, np.int64)
        attn = attn_metadata_np(z, z, np.zeros((B, C), _I32), block_size=self.block_size,
                                num_tokens_pad=B * Q, max_query_len=Q)
        if tree_verify:
            attn = attn.replace(tree_mask=self._tree_mask)
        sdm = spec_metadata_np([], z, num_reqs_pad=B, max_spec_len=self.k)
        zb = np.zeros(B, _I32)
        return _Batch(np.zeros(B * Q, _I32), np.zeros(B * Q, _I32), attn, sdm,
                      np.zeros(B, np.float32), zb, np.ones(B, np.float32), np.zeros(B, np.uint32),
                      zb, zb, np.zeros(B, np.bool_))

    def _spec(self, all_greedy: bool, tree_verify: bool = False) -> _Spec:
        p = self.proposer
        fused = self.mode in ("padded", "split")
        return _Spec(
            target=self.target.model, impl=p.impl if fused else None, k=self.k,
            vocab_size=self.vocab_size, all_greedy=all_greedy, synthetic_rates=self.synthetic_rates,
            mode=self.mode, needs_hidden=fused and p.needs_hidden_states,
            needs_aux=fused and p.needs_aux_hidden_states, kernel_backend=self.kernel_backend,
            tree=self.tree if tree_verify else None,
            block_size=self.block_size if tree_verify else 0)

    def _tree_prefix(self, room: int, fit: int) -> int:
        """Nodes of the tree a request verifies: the levels ``<= room`` (accepted drafts
        that can still be used), at most ``fit`` nodes (KV slots left before
        ``max_model_len``): a breadth-first prefix, which holds every ancestor of its
        nodes."""
        lv = min(max(room, 0), self.tree.depth)
        n = self.tree.cu_level_sizes[lv - 1] if lv else 0
        return max(0, min(n, fit))

    def _run(self, batch: _Batch, *, all_greedy: bool, tree_verify: bool = False):
        """Run the jitted step: ``(out, extra)``, ``out`` the ``[B, k+1]`` sampled tokens,
        followed in padded mode by the ``k`` drafts and the draft count (``_unpack``)."""
        spec = self._spec(all_greedy, tree_verify)
        dparams = None if spec.impl is None else self.proposer.params
        out, self.target_kv, self.draft_state, extra = _step_jit(
            spec, self.target.params, dparams, self.target_kv, self.draft_state, batch)
        return out, extra

    def _unpack(self, out: np.ndarray):
        """``(sampled [B, k+1], (drafts [B, k], counts [B]) or None)`` of a step's output."""
        s = self.k + 1
        if out.shape[1] == s:
            return out, None
        return out[:, :s], (out[:, s:-1], out[:, -1])

    # -- one step ------------------------------------------------------------------

    def _step(self, running: list[_Request]) -> tuple[SpecDecodingStats | None, list[_Request]]:
        # Tree mode: the tree mask is static for the whole batch and a prompt needs causal
        # attention, so a step with a prompt to prefill is a chain step in which nobody
        # verifies drafts (decoding requests verify just their root and get redrafted);
        # every other step is a tree-verification step.
        tree_verify = self.tree is not None and all(
            r.num_tokens - r.num_computed == 1 for r in running)
        if self.tree is not None and not tree_verify:
            for r in running:
                r.drafts = []
        batch, qlens, b_pad = self._build_batch(running, tree_verify=tree_verify)
        all_greedy = all(r.params.temperature == 0 for r in running)
        out, extra = self._run(batch, all_greedy=all_greedy, tree_verify=tree_verify)
        sampled, drafts_np = self._unpack(np.asarray(out))
        if self.mode == "split" and not tree_verify:
            drafts = self._split_propose(batch, running, sampled, extra)
            drafts_np = (np.asarray(drafts.token_ids), np.asarray(drafts.num_drafts))

        stats = SpecDecodingStats.new(self.num_spec_positions) if self.proposer is not None else None
        finished, gained = [], []
        for i, r in enumerate(running):
            row = sampled[i]
            new = [int(t) for t in row if t != PLACEHOLDER_TOKEN_ID]
            nd = len(r.drafts)
            n_acc = len(new) - 1
            if nd:
                # trees: a request-step counts its deepest verified level as its drafts
                # (the most it can accept); position p = level p + 1
                nd_stat = nd if self.tree is None else self.tree.depths[nd - 1]
                stats.observe_draft(nd_stat, n_acc)
                r.num_drafted += nd_stat
                r.num_accepted += n_acc
            # the root and the accepted tokens are in the KV cache (a tree's moved there)
            r.num_computed += qlens[i] - (nd - n_acc)
            kept = []
            for tok in new:
                kept.append(tok)
                r.output.append(tok)
                if tok in r.stop_ids:
                    r.finish_reason = "stop"
                elif len(r.output) >= r.params.max_tokens or r.num_tokens >= self.max_model_len:
                    r.finish_reason = "length"
                if r.finish_reason:
                    break
            if r.row >= 0:
                start = r.num_tokens - len(kept)
                self.tok_buf[r.row, start : r.num_tokens] = kept
            r.drafts = []
            if r.finish_reason:
                finished.append(r)
            elif drafts_np is not None:
                tok, cnt = drafts_np
                r.drafts = tok[i, : int(cnt[i])].tolist()
            gained.append(kept)

        alive = [i for i, r in enumerate(running) if not r.finish_reason]
        if self.proposer is not None and self.proposer.needs_token_history and alive:
            rows = [running[i].row for i in alive]
            hist = TokenHistory(
                req_ids=[running[i].req_id for i in alive],
                token_ids=self.tok_buf[rows],
                num_tokens=np.array([running[i].num_tokens for i in alive], _I32),
                num_prompt_tokens=np.array([len(running[i].prompt) for i in alive], _I32),
                sampled_token_ids=[gained[i] for i in alive], rows_pad=b_pad)
            out = self.proposer.propose_from_history(hist)
            tok, cnt = np.asarray(out.token_ids), np.asarray(out.num_drafts)
            for j, i in enumerate(alive):
                running[i].drafts = tok[j, : int(cnt[j])].tolist()
        for i in alive:
            r = running[i]
            # Never verify past max_model_len or beyond what max_tokens can still use; a
            # token outside the vocabulary (a buggy proposer) ends the draft, as the target
            # would embed it as garbage.
            room = min(self.max_model_len - r.num_tokens, r.params.max_tokens - len(r.output)) - 1
            if self.tree is None:
                d = r.drafts[: max(0, min(room, self.k))]
            else:   # a breadth-first prefix; a bad token cuts the prefix there too
                d = r.drafts[: self._tree_prefix(room, self.max_model_len - r.num_tokens)]
            bad = [j for j, t in enumerate(d) if not 0 <= t < self.vocab_size]
            r.drafts = d[: bad[0]] if bad else d
        return stats, finished

    def _split_propose(self, batch: _Batch, running, sampled: np.ndarray, extra) -> DraftOutput:
        """Non-padded mode: vLLM's host ``prepare_inputs`` drops the rejected tokens, then
        the proposer drafts from the kept ones (second jitted call)."""
        from specjax.proposers.eagle import prepare_inputs

        n = len(running)
        lists = [[int(t) for t in sampled[i] if t != PLACEHOLDER_TOKEN_ID] for i in range(n)]
        md, idx = prepare_inputs(batch.attn, lists, [len(r.drafts) for r in running])
        nxt = np.zeros(batch.backup_next.shape[0], _I32)
        nxt[:n] = [lst[-1] for lst in lists]
        hidden, aux = extra
        drafts, self.draft_state = _split_propose_jit(
            self.proposer.impl, self.proposer.params, self.draft_state, batch.input_ids,
            batch.positions, hidden, aux, idx, nxt, md)
        return drafts


# ---------------------------------------------------------------------------------------
# host-side metadata (NumPy leaves: the jitted step uploads them in one go)


def _tensor_parallel(target: TargetModel, proposer: Proposer | None, mesh: Any, axis: str
                     ) -> tuple[TargetModel, Proposer | None]:
    """``Engine(mesh=...)``: the target and a device proposer's params on ``mesh`` (the
    proposer copied, with ``mesh`` / ``vocab_axis`` set on its ``impl`` when it has them).
    Every sharding is resolved (and checked) before anything is placed."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from specjax import sharding as sh

    if not isinstance(mesh, Mesh):
        raise ValueError(f"mesh must be a jax.sharding.Mesh or None, got {type(mesh).__name__}")
    if axis not in mesh.axis_names:
        raise ValueError(f"tp_axis {axis!r} is not an axis of the mesh (axes: {mesh.axis_names})")
    tshard = sh.param_shardings(target.params, mesh, target.model.config, axis=axis)
    impl, dparams = None, None
    if proposer is not None and proposer.impl is not None:
        impl, dparams = proposer.impl, proposer.params
        fields = {f.name for f in dataclasses.fields(impl)} if dataclasses.is_dataclass(impl) else set()
        if dparams is not None and {"mesh", "vocab_axis", "config", "model"} <= fields:
            # EAGLE / EAGLE-3 / DFlash / draft model: the proposers' own TP entry point
            impl, dparams, _ = sh.tensor_parallel(
                impl, dparams, None, mesh, axis=axis,
                local_argmax=impl.config.use_local_argmax_reduction)
        elif dparams is not None:
            dcfg = getattr(getattr(impl, "model", None), "config", None)
            dparams = jax.device_put(dparams, (
                jax.tree.map(lambda _: NamedSharding(mesh, PartitionSpec()), dparams)
                if dcfg is None else sh.param_shardings(dparams, mesh, dcfg, axis=axis)))
    target = TargetModel(target.model, jax.device_put(target.params, tshard))
    if impl is not None:
        import copy

        proposer = copy.copy(proposer)
        proposer.impl, proposer.params = impl, dparams
    return target, proposer


def _ragged_arange(lens: np.ndarray) -> np.ndarray:
    """``concat(arange(l) for l in lens)``."""
    lens = np.asarray(lens, np.int64)
    total = int(lens.sum())
    return np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(lens) - lens, lens)


def attn_metadata_np(query_lens, seq_lens, block_table, *, block_size: int, num_tokens_pad: int,
                     max_query_len: int) -> CommonAttentionMetadata:
    """``CommonAttentionMetadata.from_query_lens`` with NumPy leaves, vectorized.

    ``query_lens``, ``seq_lens``: ``[n]``; ``block_table``: ``[B_pad, C]`` (rows past n
    ignored and zeroed). Token slots: ``table[r, pos // block_size] * block_size + pos %
    block_size`` for each request's last ``query_len`` positions, -1 on padding.
    """
    q = np.asarray(query_lens, np.int64)
    s = np.asarray(seq_lens, np.int64)
    n = q.shape[0]
    table = np.array(block_table, _I32)
    b_pad = table.shape[0]
    table[n:] = _NULL_BLOCK
    t = int(q.sum())
    qsl = np.full(b_pad + 1, t, _I32)
    qsl[0] = 0
    qsl[1 : n + 1] = np.cumsum(q)
    seq = np.zeros(b_pad, _I32)
    seq[:n] = s
    slots = np.full(num_tokens_pad, -1, _I32)
    if t:
        req = np.repeat(np.arange(n), q)
        pos = np.repeat(s - q, q) + _ragged_arange(q)
        slots[:t] = table[req, pos // block_size].astype(np.int64) * block_size + pos % block_size
    i32 = lambda v: np.asarray(v, _I32)  # noqa: E731
    return CommonAttentionMetadata(
        query_start_loc=qsl, seq_lens=seq, block_table=table, slot_mapping=slots, num_reqs=i32(n),
        num_actual_tokens=i32(t), max_seq_len=i32(int(s.max(initial=0))),
        max_query_len=int(max_query_len), causal=True)


def spec_metadata_np(drafts: Sequence[Sequence[int]], query_lens, *, num_reqs_pad: int,
                     max_spec_len: int) -> SpecDecodeMetadata:
    """``SpecDecodeMetadata.from_draft_lists(drafts, cumsum(query_lens), max_spec_len=K,
    num_reqs_pad=B, num_drafts_pad=B*K)`` with NumPy leaves, vectorized: each request's
    drafts are the last ``len(drafts)`` of its ``query_len`` scheduled tokens."""
    nd = np.array([len(d) for d in drafts], np.int64)
    n, b, k = nd.shape[0], num_reqs_pad, max_spec_len
    cu_sched = np.cumsum(np.asarray(query_lens, np.int64))
    cu_draft = np.cumsum(nd)
    cu_sampled = np.cumsum(nd + 1)
    total, sampled = int(nd.sum()), int((nd + 1).sum())

    def pad(a, size, fill, repeat_last=False):
        out = np.full(size, fill, _I32)
        out[: len(a)] = a
        if repeat_last and len(a) and size > len(a):
            out[len(a):] = a[-1]
        return out

    flat = np.array([t for d in drafts for t in d], np.int64)
    target_idx = np.repeat(cu_sampled - nd - 1, nd) + _ragged_arange(nd)
    logits_idx = np.repeat(cu_sched - nd - 1, nd + 1) + _ragged_arange(nd + 1)
    assert total <= b * k and sampled <= b * (k + 1)
    return SpecDecodeMetadata(
        draft_token_ids=pad(flat, b * k, -1), num_draft_tokens=pad(nd, b, 0),
        cu_num_draft_tokens=pad(cu_draft, b, 0, True), cu_num_sampled_tokens=pad(cu_sampled, b, 0, True),
        target_logits_indices=pad(target_idx, b * k, 0), bonus_logits_indices=pad(cu_sampled - 1, b, 0),
        logits_indices=pad(logits_idx, b * (k + 1), 0), num_reqs=np.asarray(n, _I32),
        max_spec_len=int(k))


def _accumulate(total: SpecDecodingStats, s: SpecDecodingStats) -> None:
    total.num_drafts += s.num_drafts
    total.num_draft_tokens += s.num_draft_tokens
    total.num_accepted_tokens += s.num_accepted_tokens
    for p, a in enumerate(s.num_accepted_tokens_per_pos):
        total.num_accepted_tokens_per_pos[p] += a


def generate(target, proposer: Proposer | None, prompts: Sequence[Sequence[int]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
             max_model_len: int | None = None, block_size: int | None = None,
             max_num_seqs: int | None = None, num_blocks: int | None = None,
             eos_token_id: int | None = None, seed: int = 0, kernel_backend: str = "auto",
             batch_buckets: Sequence[int] | None = None, query_buckets: Sequence[int] | None = None,
             context_buckets: Sequence[int] | None = None, min_tokens_per_step: int = 2,
             stat_loggers: Iterable[Callable[[SpecDecodingStats], None]] = (),
             progress: Callable[[int, int, int], None] | None = None, mesh: Any = None,
             tp_axis: str = "tp") -> GenerateResult:
    """Batched generation with speculative decoding (``proposer``) or plain decoding (None).

    Args:
      target: ``TargetModel(model, params)`` or ``(model, params)``; ``model`` a
        ``specjax.models.DecoderLM``.
      proposer: ``specjax.make_proposer(...)`` or None.
      prompts: token-id lists (non-empty, ids in the target's vocabulary).
      sampling_params: one ``SamplingParams`` for all or one per prompt.
      max_model_len, block_size: default to the proposer's (else 2048 and 16).
      max_num_seqs: most running requests (default: all prompts at once, at most 256).
      eos_token_id: a stop token for every request without ``ignore_eos``.
      seed: draws the seeds of requests whose ``SamplingParams.seed`` is None.
      stat_loggers: called with each step's ``SpecDecodingStats`` (e.g.
        ``SpecDecodingLogging().observe``, ``SpecDecodingProm(...).observe``).
      progress: called after each step with ``(finished, total, generated_tokens)``.
      Other arguments: see :class:`Engine`.

    Returns:
      ``GenerateResult`` (outputs in prompt order, summed metrics, steps, wall time).

    Raises:
      ValueError: empty prompt list, token ids outside the vocabulary, ``max_tokens < 1``,
        a proposer whose vocabulary differs from the target's, ... before generation.
    """
    if max_model_len is None:
        max_model_len = getattr(proposer, "max_model_len", None) or 2048
    if block_size is None:
        block_size = getattr(proposer, "block_size", None) or 16
    if max_num_seqs is None:   # all at once, up to 256
        max_num_seqs = min(256, max(1, len(prompts))) if hasattr(prompts, "__len__") else 1
    engine = Engine(target, proposer, max_model_len=max_model_len, block_size=block_size,
                    max_num_seqs=max_num_seqs, num_blocks=num_blocks, kernel_backend=kernel_backend,
                    batch_buckets=batch_buckets, query_buckets=query_buckets,
                    context_buckets=context_buckets, min_tokens_per_step=min_tokens_per_step,
                    mesh=mesh, tp_axis=tp_axis)
    return engine.generate(prompts, sampling_params, eos_token_id=eos_token_id, seed=seed,
                           stat_loggers=stat_loggers, progress=progress)

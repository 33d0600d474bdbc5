"""Proposers, one module per method, and the uniform interface a decoding loop drives.

``make_proposer(config, ...)`` builds any method of a ``SpeculativeConfig`` and returns a
:class:`Proposer`: the method's own proposer object (``impl``), its ``params`` (device
model proposers) and its :class:`Feed` (``proposer.feed``): where it drafts (inside the
jitted step, in a second call after vLLM's host ``prepare_inputs``, or from the token
history), which target activations it needs, how many KV slots it writes ahead, its token
tree and vocabulary. A decoding loop reads the Feed only, never the method name
(``specjax.step.make_step`` does).

Model-free proposers (``ngram``, ``ngram_gpu``, ``suffix``) each keep their own vLLM-shaped
API in their module; :class:`NgramProposerAdapter`, :class:`NgramGPUProposerAdapter` and
:class:`SuffixProposerAdapter` map a :class:`TokenHistory` onto it and return a
``DraftOutput``.

Imports of the method modules are lazy: importing ``specjax.proposers`` pulls in neither
numba nor the models.
"""

from __future__ import annotations

import importlib
from typing import Any, Hashable, NamedTuple, Sequence

import numpy as np

from specjax.config import SpeculativeConfig
from specjax.constants import next_power_of_2
from specjax.proposers.base import DRAFT_PADDING_ID, DraftOutput, Feed, ProposerInputs

__all__ = [
    "DRAFT_PADDING_ID", "DraftOutput", "Feed", "ProposerInputs", "TokenHistory", "Proposer",
    "ModelProposer", "NgramProposerAdapter", "NgramGPUProposerAdapter",
    "SuffixProposerAdapter", "make_proposer", "available_methods",
    "prepare_next_token_ids_padded", "prepare_inputs_padded",
]

#: Module of each model-based method under ``specjax.proposers``, its proposer class, and
#: whether that class takes ``mesh`` / ``vocab_axis`` (``specjax.sharding.tensor_parallel``:
#: vocabulary-parallel argmax) or only has its params placed on a mesh.
_MODEL_METHODS = {
    "eagle": ("eagle", "EagleProposer", True),
    "eagle3": ("eagle", "EagleProposer", True),
    "dflash": ("dflash", "DFlashProposer", True),
    "medusa": ("medusa", "MedusaProposer", False),
    "draft_model": ("draft_model", "DraftModelProposer", True),
    "extract_hidden_states": ("extract_hidden_states", "ExtractHiddenStatesProposer", False),
}


class TokenHistory(NamedTuple):
    """What a token-history proposer sees after a verification step (host arrays).

    Attributes:
      req_ids: ``B`` distinct hashable request ids (stable over a request's life).
      token_ids: ``[B, W] int32``; row ``b`` holds request ``b``'s context (prompt and every
        output token, this step's included) in its first ``num_tokens[b]`` columns.
      num_tokens: ``[B] int32`` context lengths.
      num_prompt_tokens: ``[B] int32``.
      sampled_token_ids: ``B`` lists, the tokens each request gained this step (accepted
        drafts plus the bonus / recovered token); empty -> no draft for that request.
      rows_pad: the loop's padded batch size for this step (>= B) or None; device
        proposers pad to it so they compile once per batch bucket, like the step.
    """

    req_ids: Sequence[Hashable]
    token_ids: np.ndarray
    num_tokens: np.ndarray
    num_prompt_tokens: np.ndarray
    sampled_token_ids: Sequence[Sequence[int]]
    rows_pad: int | None = None


def _deprecated(name: str, instead: str, read):
    """A property that warns and reads ``proposer.feed`` (a declaration the Feed replaced)."""
    def get(self):
        import warnings

        warnings.warn(f"Proposer.{name} is deprecated: use proposer.feed.{instead}",
                      DeprecationWarning, stacklevel=2)
        return read(self.feed)
    return property(get)


class Proposer:
    """A proposer as the decoding loop sees it: ``feed`` (a :class:`Feed`, the only thing a
    loop reads), and either ``init_state`` / ``impl.propose(params, state, ProposerInputs)``
    inside the jitted step (device model proposers) or ``propose_from_history`` after it
    (token-history proposers)."""

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

    # The declarations the Feed replaced (kept for old callers).
    needs_token_history = _deprecated("needs_token_history", "drafts_in == 'history'",
                                      lambda f: f.drafts_in == "history")
    needs_hidden_states = _deprecated("needs_hidden_states", "hidden_states",
                                      lambda f: f.hidden_states)
    needs_aux_hidden_states = _deprecated("needs_aux_hidden_states", "aux_layer_ids",
                                          lambda f: f.aux_hidden_states)
    padded_drafter_batch = _deprecated("padded_drafter_batch", "drafts_in != 'split'",
                                       lambda f: f.drafts_in != "split")
    runs_on = _deprecated("runs_on", "drafts_in", lambda f: "host" if f.drafts_in == "history"
                          else "device")

    def _lookahead(self) -> int:
        return self.num_speculative_tokens + self.max_new_slots + 1

    def init_state(self, num_blocks: int, dtype=None) -> Any:
        """Device state pytree (draft KV cache and buffers) for a pool of ``num_blocks``
        KV blocks laid out by the target's block table; None when there is none."""
        return None

    def warmup(self, buckets: Any, state: Any = None, *, num_blocks: int | None = None,
               dtype=None, hidden_dtype=None) -> tuple:
        """Compile the device ``propose`` for every shape bucket ahead of time (see
        ``ModelProposer.warmup``). Token-history proposers compile nothing here and
        return ``()``."""
        return ()

    def propose_from_history(self, history: TokenHistory) -> DraftOutput:
        raise NotImplementedError(f"method={self.method!r} does not draft from token history")

    def finish_requests(self, req_ids: Sequence[Hashable]) -> None:
        """The loop calls this when requests leave for good (per-request host state)."""

    def on_mesh(self, mesh: Any, axis: str = "tp") -> "Proposer":
        """This proposer for tensor parallelism over ``mesh[axis]`` (params and the
        vocabulary-parallel argmax placed; see ``ModelProposer.on_mesh``). Token-history
        proposers have nothing to place and return themselves."""
        return self

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(method={self.method!r}, k={self.num_speculative_tokens}, "
                f"drafts_in={self.feed.drafts_in!r})")


# ---------------------------------------------------------------------------------------
# device model proposers


class ModelProposer(Proposer):
    """A model-based device proposer (EAGLE / EAGLE-3 / DFlash / Medusa / draft model /
    extract-hidden-states): ``impl`` is the method's frozen, hashable proposer whose
    ``propose(params, state, ProposerInputs)`` the loop calls inside its jitted step. Every
    such ``impl`` declares ``needs_hidden_states`` / ``needs_aux_hidden_states`` and has
    the padded-batch helpers (``prepare_next_token_ids_padded``,
    ``prepare_inputs_padded``)."""

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
            lookahead=self._lookahead(), token_tree=tree, vocab_size=vocab_size,
            block_size=getattr(impl, "block_size", None),
            max_model_len=getattr(impl, "max_model_len", None))

    @property
    def feed(self) -> Feed:
        return self._feed

    def init_state(self, num_blocks: int, dtype=None) -> Any:
        import jax.numpy as jnp

        return self.impl.init_state(num_blocks, jnp.float32 if dtype is None else dtype)

    def warmup(self, buckets: Any, state: Any = None, *, num_blocks: int | None = None,
               dtype=None, hidden_dtype=None) -> tuple:
        """Compile ``impl.propose(self.params, state, inputs)`` for every bucket ahead of
        time, so calls whose real counts vary inside them never compile.

        ``buckets``: ``ProposeBucket``s (``specjax.proposers.common``) or tuples
        ``(num_reqs_pad, num_tokens_pad[, max_blocks_per_req[, max_query_len]])``;
        ``state``: the state ``propose`` will get (only its shapes are used), else one is
        derived abstractly from ``num_blocks`` / ``dtype`` (float32) as ``init_state``
        builds it. Returns the resolved buckets; bad ones raise ValueError before anything
        compiles. This compiles the standalone ``impl.propose``; ``specjax.step.Step``
        fuses propose into its own step and ``Engine.warmup`` compiles that.
        """
        import jax.numpy as jnp

        return self.impl.warmup(buckets, self.params, state, num_blocks=num_blocks,
                                dtype=jnp.float32 if dtype is None else dtype,
                                hidden_dtype=hidden_dtype)

    def on_mesh(self, mesh: Any, axis: str = "tp") -> "ModelProposer":
        """A copy for tensor parallelism over ``mesh[axis]``: EAGLE / EAGLE-3 / DFlash /
        draft model through ``specjax.sharding.tensor_parallel`` (params sharded, ``impl``
        given ``mesh`` / ``vocab_axis`` so ``config.use_local_argmax_reduction`` reduces over
        the vocabulary shards); Medusa and extract-hidden-states get their params placed
        by the same rules (replicated without a model config)."""
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
    """``(next_token_ids [B], valid_sampled_tokens_count [B])`` int32: the proposer's own
    ``prepare_next_token_ids_padded`` when it has one (extract-hidden-states differs from
    EAGLE), else the ``eagle_prepare_next_token_padded`` kernel. Traceable."""
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


def _history_feed(config: SpeculativeConfig, max_model_len: int) -> Feed:
    return Feed(drafts_in="history", num_speculative_tokens=config.num_speculative_tokens,
                lookahead=config.num_speculative_tokens + config.max_num_new_slots_for_drafting() + 1,
                max_model_len=max_model_len)


class _HistoryProposer(Proposer):
    """A proposer that drafts from the token history (``feed.drafts_in == "history"``)."""

    _feed: Feed

    @property
    def feed(self) -> Feed:
        return self._feed


def _valid_mask(history: TokenHistory) -> np.ndarray:
    return np.fromiter((len(s) > 0 for s in history.sampled_token_ids), dtype=np.bool_,
                       count=len(history.sampled_token_ids))


class NgramProposerAdapter(_HistoryProposer):
    """``method="ngram"``: vLLM's CPU n-gram proposer (numba) on the token history."""

    def __init__(self, config: SpeculativeConfig, *, max_model_len: int) -> None:
        from specjax.proposers.ngram_cpu import NgramProposer

        self.config = config
        self._feed = _history_feed(config, max_model_len)
        self.impl = NgramProposer(num_speculative_tokens=config.num_speculative_tokens,
                                  max_model_len=max_model_len,
                                  prompt_lookup_min=config.prompt_lookup_min,
                                  prompt_lookup_max=config.prompt_lookup_max)

    def propose_from_history(self, history: TokenHistory) -> DraftOutput:
        return self.impl.propose_arrays(history.num_tokens, history.token_ids, _valid_mask(history))


class NgramGPUProposerAdapter(_HistoryProposer):
    """``method="ngram_gpu"``: the jit-compiled n-gram search on the accelerator, over a
    token buffer that stays on the device (``NgramGPUState``).

    Each request owns a buffer row for its life. Per call only this step's new tokens
    (``sampled_token_ids``: accepted drafts + bonus) go up, packed with the row indices and
    counts into one ``[rows_pad, 2 + S]`` int32 array, and the drafts come back as one
    ``[rows_pad, k + 1]`` array: one transfer each way. A request seen for the first time
    (or whose length is not its last length plus its new tokens: the history was not
    appended to as the interface says) has its context uploaded into its row first.
    Requests absent from a call have left (as for suffix decoding) and their rows are
    reused. The batch is padded to ``history.rows_pad`` (else a power of two) and the
    buffer grows by powers of two, so each batch bucket compiles once.
    """

    def __init__(self, config: SpeculativeConfig, *, max_model_len: int) -> None:
        from specjax.proposers.ngram_gpu import NgramGPUProposer

        self.config = config
        self._feed = _history_feed(config, max_model_len)
        self.impl = NgramGPUProposer(num_speculative_tokens=config.num_speculative_tokens,
                                     max_model_len=max_model_len,
                                     prompt_lookup_min=config.prompt_lookup_min,
                                     prompt_lookup_max=config.prompt_lookup_max)
        self.state = None                 # NgramGPUState, [capacity, max_model_len]
        self._slots: dict = {}            # req_id -> [row, length held on the device]
        self._free_rows: list[int] = []
        self.num_context_uploads = 0      # contexts uploaded whole (joins and re-syncs)

    def _ensure_rows(self, needed: int) -> None:
        cap = 0 if self.state is None else int(self.state.num_tokens.shape[0])
        if needed <= cap:
            return
        new_cap = next_power_of_2(needed)
        self.state = (self.impl.init_state(new_cap) if self.state is None
                      else self.impl.grow_state(self.state, new_cap))
        self._free_rows.extend(range(new_cap - 1, cap - 1, -1))   # pop() -> lowest first

    def _release(self, req_id) -> None:
        slot = self._slots.pop(req_id, None)
        if slot is not None:
            self._free_rows.append(slot[0])

    def propose_from_history(self, history: TokenHistory) -> DraftOutput:
        import jax.numpy as jnp

        ids = list(history.req_ids)
        b = len(ids)
        sampled = history.sampled_token_ids
        if len(sampled) != b or len(history.num_tokens) != b:
            raise ValueError(f"history has {b} req_ids, {len(sampled)} sampled lists and "
                             f"{len(history.num_tokens)} lengths; they must agree")
        if len(set(ids)) != b:
            raise ValueError("req_ids must be distinct")
        k, width = self.impl.k, self.max_model_len
        present = set(ids)
        for rid in [r for r in self._slots if r not in present]:
            self._release(rid)
        pad = history.rows_pad if (history.rows_pad or 0) >= b else next_power_of_2(max(b, 1))
        self._ensure_rows(pad)
        counts = np.fromiter((len(s) for s in sampled), np.int64, count=b)
        lengths = np.asarray(history.num_tokens, np.int64)
        if b and ((counts > lengths).any() or (lengths > history.token_ids.shape[1]).any()):
            raise ValueError("need len(sampled_token_ids[b]) <= num_tokens[b] <= token_ids.shape[1]")
        rows = np.empty(b, np.int64)
        uploads = []
        for j, rid in enumerate(ids):
            n, c = int(lengths[j]), int(counts[j])
            slot = self._slots.get(rid)
            if slot is None:
                slot = self._slots[rid] = [self._free_rows.pop(), -1]
            rows[j] = slot[0]
            if n > width:              # past max_model_len: no draft; forget the row
                slot[1] = -1
                counts[j] = 0
                continue
            if slot[1] != n - c:
                uploads.append(j)
            slot[1] = n
        if uploads:
            self._upload(history, uploads, rows, lengths - counts)
        s = max(k + 1, int(counts.max(initial=1)))
        s = s if s == k + 1 else next_power_of_2(s)
        packed = np.full((pad, 2 + s), -1, np.int32)
        packed[:b, 0] = rows
        packed[:, 1] = 0
        packed[:b, 1] = counts
        for j in range(b):
            if counts[j]:
                packed[j, 2 : 2 + counts[j]] = sampled[j]
        out, self.state = self.impl.propose_packed(self.state, jnp.asarray(packed))
        out = np.asarray(out)
        return DraftOutput(out[:b, :k], out[:b, k])

    def _upload(self, history: TokenHistory, which: list[int], rows: np.ndarray,
                base: np.ndarray) -> None:
        """Write whole contexts (minus this step's new tokens) into their rows."""
        import jax.numpy as jnp

        r = next_power_of_2(len(which))
        w = min(next_power_of_2(max(int(base[which].max(initial=1)), 1)), self.max_model_len)
        tok = np.zeros((r, w), np.int32)
        row_ids = np.full(r, -1, np.int32)
        num = np.zeros(r, np.int32)
        for i, j in enumerate(which):
            n = int(base[j])
            tok[i, :n] = history.token_ids[j, :n]
            row_ids[i], num[i] = rows[j], n
        self.state = self.impl.add_requests(self.state, jnp.asarray(row_ids), jnp.asarray(tok),
                                            jnp.asarray(num))
        self.num_context_uploads += len(which)

    def finish_requests(self, req_ids: Sequence[Hashable]) -> None:
        for rid in req_ids:
            self._release(rid)


class SuffixProposerAdapter(_HistoryProposer):
    """``method="suffix"``: suffix decoding over Arctic Inference (host C++). The request
    lifecycle (start, append, stop) follows the ids in the history; ``finish_requests``
    stops requests so their responses join the global cache."""

    def __init__(self, config: SpeculativeConfig, *, max_model_len: int) -> None:
        from specjax.proposers.suffix import SuffixDecodingProposer

        self.config = config
        self._feed = _history_feed(config, max_model_len)
        self.impl = SuffixDecodingProposer(
            max_model_len=max_model_len,
            num_speculative_tokens=config.num_speculative_tokens,
            suffix_decoding_max_tree_depth=config.suffix_decoding_max_tree_depth,
            suffix_decoding_max_cached_requests=config.suffix_decoding_max_cached_requests,
            suffix_decoding_max_spec_factor=config.suffix_decoding_max_spec_factor,
            suffix_decoding_min_token_prob=config.suffix_decoding_min_token_prob)

    def propose_from_history(self, history: TokenHistory) -> DraftOutput:
        return self.impl.propose_arrays(history.req_ids, history.sampled_token_ids,
                                        history.num_tokens, history.token_ids,
                                        history.num_prompt_tokens)

    def finish_requests(self, req_ids: Sequence[Hashable]) -> None:
        cache = self.impl.suffix_cache
        for r in req_ids:
            if r in cache.active_requests:
                cache.stop_request(r)


# ---------------------------------------------------------------------------------------
# factory


def available_methods() -> tuple[str, ...]:
    """Methods ``make_proposer`` can build in this install (the proposer module exists
    and its optional dependency imports: arctic-inference for ``suffix``)."""
    out = []
    for m in ("ngram", "ngram_gpu", "suffix", "eagle", "eagle3", "draft_model", "dflash",
              "medusa", "extract_hidden_states"):
        try:
            if m == "suffix":
                importlib.import_module("arctic_inference.suffix_decoding")
            elif m in _MODEL_METHODS:
                mod, cls, _ = _MODEL_METHODS[m]
                getattr(importlib.import_module(f"specjax.proposers.{mod}"), cls)
        except (ImportError, AttributeError):
            continue
        out.append(m)
    return tuple(out)


def _load_impl_class(method: str):
    mod, cls, _ = _MODEL_METHODS[method]
    try:
        module = importlib.import_module(f"specjax.proposers.{mod}")
    except ModuleNotFoundError as err:
        if err.name != f"specjax.proposers.{mod}":
            raise
        raise NotImplementedError(
            f"method={method!r} is not implemented in this specjax yet: its proposer module "
            f"specjax.proposers.{mod} does not exist") from None
    try:
        return getattr(module, cls)
    except AttributeError:
        raise NotImplementedError(
            f"method={method!r} is not implemented in this specjax yet: "
            f"specjax.proposers.{mod} has no {cls}") from None


def make_proposer(config: SpeculativeConfig, *, target: Any = None, target_params: dict | None = None,
                  draft: Any = None, draft_params: dict | None = None, block_size: int = 16,
                  max_model_len: int | None = None, aux_layer_ids: Sequence[int] | None = None,
                  kernel_backend: str = "auto", **options: Any) -> Proposer:
    """Build the proposer of ``config.method``.

    Args:
      config: the ``SpeculativeConfig`` (method, k, n-gram / suffix / tree options).
      target: the target runner (``specjax.models.DecoderLM``); used to check the draft's
        vocabulary and for the EAGLE-3 default aux layers.
      target_params: the target's params; heads without their own embedding / lm_head
        get the target's (``share_target_weights``, as vLLM shares them).
      draft: the draft runner (``EagleHead``, ``Eagle3Head``, ``DFlashHead``,
        ``MedusaHeads``, a ``DecoderLM`` for ``draft_model``) or its ``ModelConfig``;
        model-free methods take none.
      draft_params: the draft's params dict.
      block_size: KV-cache block size the loop uses (draft caches share the target's
        block table).
      max_model_len: context cap (default ``config.max_model_len``; required).
      aux_layer_ids: target layers whose inputs the method reads (EAGLE-3, DFlash,
        extract-hidden-states); default from the draft's config.
      kernel_backend: backend of the index kernels (``"auto"``, ``"xla"``, ``"pallas"``,
        ``"triton"``).
      options: further fields of the method's proposer class, passed through (e.g.
        ``parallel_drafting_token_id=`` for ``eagle``, ``eagle3`` and ``draft_model``;
        ``target_tensor_parallel_size=`` for ``draft_model``; ``mesh=`` / ``vocab_axis=``
        for ``eagle``, ``eagle3``, ``dflash`` and ``draft_model``, the vocab-sharded mesh
        ``config.use_local_argmax_reduction`` reduces over); a field the class lacks is a
        ValueError. With ``config.parallel_drafting`` and no
        ``parallel_drafting_token_id=``, the draft config's ``mask_token_id`` is used when
        set (``specjax.load_pretrained`` fills it from the checkpoint config's
        ``pard_token`` / ``ptd_token_id``, as vLLM reads the draft HF config).

    Raises:
      ValueError: bad arguments (missing draft, vocabulary mismatch, ...), before anything
        is built. NotImplementedError: the method's proposer module does not exist yet.
    """
    if not isinstance(config, SpeculativeConfig):
        raise ValueError(f"config must be a SpeculativeConfig, got {type(config).__name__}")
    if max_model_len is None:
        max_model_len = config.max_model_len
    if isinstance(max_model_len, bool) or not isinstance(max_model_len, int) or max_model_len < 2:
        raise ValueError(f"max_model_len must be an int >= 2 (argument or config.max_model_len), "
                         f"got {max_model_len!r}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    method = config.method
    if options and method in ("ngram", "ngram_gpu", "suffix"):
        raise ValueError(f"method={method!r} takes no extra options, got {sorted(options)} (its "
                         "settings live in the SpeculativeConfig)")
    if method == "ngram":
        return NgramProposerAdapter(config, max_model_len=max_model_len)
    if method == "ngram_gpu":
        return NgramGPUProposerAdapter(config, max_model_len=max_model_len)
    if method == "suffix":
        return SuffixProposerAdapter(config, max_model_len=max_model_len)
    if method not in _MODEL_METHODS:
        raise ValueError(f"method={method!r} has no proposer; known: {sorted(_MODEL_METHODS)}")
    cls = _load_impl_class(method)
    return _make_model_proposer(cls, config, target=target, target_params=target_params,
                                draft=draft, draft_params=draft_params, block_size=block_size,
                                max_model_len=max_model_len, aux_layer_ids=aux_layer_ids,
                                kernel_backend=kernel_backend, options=options)


def _make_model_proposer(cls, config, *, target, target_params, draft, draft_params, block_size,
                         max_model_len, aux_layer_ids, kernel_backend, options) -> ModelProposer:
    import dataclasses

    from specjax.models import ModelConfig, registry, share_target_weights
    from specjax.models.config import eagle3_default_aux_layer_ids

    method = config.method
    target_cfg = getattr(target, "config", None)
    if method == "extract_hidden_states":
        from specjax.models import ExtractHiddenStates

        if draft is None:
            if aux_layer_ids is None or target_cfg is None:
                raise ValueError("method='extract_hidden_states' needs aux_layer_ids= (the target "
                                 "layers whose inputs it stores) and target= (for the hidden size), "
                                 "or draft= an ExtractHiddenStates model")
            draft = ExtractHiddenStates(num_hidden_states=len(tuple(aux_layer_ids)),
                                        hidden_size=target_cfg.hidden_size)
        elif aux_layer_ids is None:
            raise ValueError("method='extract_hidden_states' needs aux_layer_ids= (the target layers "
                             "whose inputs it stores)")
        model, dcfg, params = draft, None, ({} if draft_params is None else draft_params)
    else:
        if draft is None:
            raise ValueError(f"method={method!r} needs draft= (the draft runner or its ModelConfig)")
        if draft_params is None:
            raise ValueError(f"method={method!r} needs draft_params= (the draft's params dict)")
        model = registry.make_model(draft.kind, draft) if isinstance(draft, ModelConfig) else draft
        dcfg = getattr(model, "config", None)
        params = draft_params
        if target_params is not None and method in ("eagle", "eagle3", "dflash"):
            params = share_target_weights(params, target_params, kind=method)
    vocab = getattr(dcfg, "vocab_size", None)
    if target_cfg is not None and vocab is not None and vocab != target_cfg.vocab_size:
        raise ValueError(f"method={method!r}: the draft's vocabulary ({vocab}) does not match the "
                         f"target's ({target_cfg.vocab_size})")
    if aux_layer_ids is None:
        aux_layer_ids = getattr(dcfg, "aux_layer_ids", None)
        if aux_layer_ids is None and method == "eagle3" and target_cfg is not None:
            aux_layer_ids = eagle3_default_aux_layer_ids(target_cfg.num_hidden_layers)
    # Each proposer takes the subset of these its dataclass declares.
    offered = dict(block_size=block_size, max_model_len=max_model_len, kernel_backend=kernel_backend,
                   target_vocab_size=(target_cfg.vocab_size if target_cfg is not None else vocab))
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(options) - names - {"config", "model"})
    if unknown:
        raise ValueError(f"method={method!r}: {cls.__name__} has no option(s) {unknown}; "
                         f"its fields: {sorted(names - {'config', 'model'})}")
    if config.parallel_drafting and "parallel_drafting_token_id" in names:
        mask = getattr(dcfg, "mask_token_id", -1)   # pard_token / ptd_token_id of the checkpoint
        offered["parallel_drafting_token_id"] = mask if isinstance(mask, int) and mask >= 0 else None
    kwargs = {k: v for k, v in offered.items() if k in names and v is not None}
    kwargs.update(options)
    impl = cls(config, model, **kwargs)
    return ModelProposer(config, impl, params, vocab_size=vocab, aux_layer_ids=aux_layer_ids or (),
                         mesh_fields=_MODEL_METHODS[method][2])

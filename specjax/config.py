"""``SpeculativeConfig``: vLLM's field names and defaults, validated at construction.

Every check raises before any model is built, naming the field, the value and what is
allowed (``specjax.checks``). Frozen and hashable: static configuration under ``jax.jit``.
"""

from __future__ import annotations

import ast
import dataclasses
import math
import warnings
from typing import Any, Literal, Mapping

import numpy as np

from specjax.checks import (ArgumentTypeError, check_bool, check_choice, check_int,
                            check_number, check_opt_int, is_int, show)

from specjax.method_registry import (HEAD_METHODS, METHODS, MODEL_FREE_METHODS,  # noqa: F401
                                     UNSUPPORTED_METHODS, custom_method, unknown_method_message)

#: Methods built on vLLM's SpecDecodeBaseProposer, the only ones that can draft in parallel.
PARALLEL_DRAFTING_METHODS = ("eagle", "eagle3", "draft_model", "dflash", "dspark")
TREE_METHODS = ("eagle", "eagle3")
#: Model methods drafting chains from a distribution (adaptive verification, sampled
#: drafts, ``history_first``'s second stage).
MODEL_CHAIN_METHODS = ("eagle", "eagle3", "mtp", "draft_model", "dflash", "dspark", "medusa")
REJECTION_SAMPLE_METHODS = ("strict", "probabilistic", "synthetic")

#: specjax's limits (vLLM has none; a larger value would build a k^2 tree string or a
#: k-sized host buffer before any check could say why it fails).
MAX_SPECULATIVE_TOKENS = 128
MAX_TREE_NODES = 1024
MAX_TREE_CHARS = 1 << 20
MAX_PROMPT_LOOKUP = 1 << 16

RejectionSampleMethod = Literal["strict", "probabilistic", "synthetic"]


def _chain_tree(k: int) -> tuple[tuple[int, ...], ...]:
    return tuple((0,) * i for i in range(1, k + 1))


def parse_token_tree(tree: str | list | tuple) -> tuple[tuple[int, ...], ...]:
    """Parse and check a ``speculative_token_tree``; return it sorted by ``(len, tuple)``.
    ValueError unless level l is exactly the children ``0..c_l-1`` of every node of level
    l-1 (top-k per level, as vLLM's ``propose_tree`` drafts)."""
    if isinstance(tree, str):
        try:
            choices = ast.literal_eval(tree)
        except (ValueError, SyntaxError) as e:
            raise ValueError(
                f"speculative_token_tree={tree!r} does not parse as a Python list of tuples ({e})"
            ) from None
    else:
        choices = tree
    if not isinstance(choices, (list, tuple)) or not choices:
        raise ValueError("speculative_token_tree must be a non-empty list of tuples of ints")
    nodes = []
    for c in choices:
        if (not isinstance(c, (list, tuple)) or not c
                or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in c)):
            raise ValueError(
                f"speculative_token_tree: node {c!r} is not a non-empty tuple of non-negative ints"
            )
        nodes.append(tuple(c))
    if len(set(nodes)) != len(nodes):
        raise ValueError("speculative_token_tree has duplicate nodes")
    nodes.sort(key=lambda t: (len(t), t))
    levels: dict[int, list[tuple[int, ...]]] = {}
    for n in nodes:
        levels.setdefault(len(n), []).append(n)
    depth = len(nodes[-1])
    prev: list[tuple[int, ...]] = [()]
    for lvl in range(1, depth + 1):
        cur = levels.get(lvl, [])
        if not cur or len(cur) % len(prev):
            raise ValueError(
                f"speculative_token_tree is not breadth-first consistent: level {lvl} has "
                f"{len(cur)} nodes, not a multiple of the {len(prev)} nodes above it"
            )
        c = len(cur) // len(prev)
        want = sorted((p + (i,) for p in prev for i in range(c)), key=lambda t: (len(t), t))
        if cur != want:
            raise ValueError(
                f"speculative_token_tree is not breadth-first consistent at level {lvl}: every "
                f"node above must have children 0..{c - 1}; expected {want}, got {cur}"
            )
        prev = cur
    return tuple(nodes)


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding configuration (vLLM ``SpeculativeConfig`` field names and
    defaults). ``method`` None: ``"ngram"`` when ``model`` is ``"ngram"``, else
    ``"draft_model"``. ``num_speculative_tokens`` is required except for suffix decoding.
    ``speculative_token_tree`` (None: the chain of k nodes for model-based methods) is
    stored sorted, as ``str`` like vLLM's. ``method`` may name a method registered with
    ``specjax.register_speculative_method``; ``speculator_options`` (vLLM 0.34) are read by
    its config class and stored as its value. ``num_speculative_tokens_per_batch_size``:
    vLLM's ``[lo, hi, K]`` schedule (``specjax.adaptive_k``), stored as sorted tuples.
    ``suffix_backend`` (specjax's): ``"device"`` (vLLM 0.34), ``"arctic"`` (vLLM 0.20) or
    None, resolved for suffix decoding (``_resolve_suffix_backend``). ``dspark_draft_topk``
    (vLLM 0.34, DSpark only): the Markov bias is evaluated on the base logits' top-k only.
    """

    method: str | None = None
    num_speculative_tokens: int | None = None
    model: str | None = None
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    speculative_token_tree: str | None = None
    parallel_drafting: bool = False
    disable_padded_drafter_batch: bool = False
    use_local_argmax_reduction: bool = False
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    rejection_sample_method: str = "strict"
    synthetic_acceptance_rates: tuple[float, ...] | None = None
    synthetic_acceptance_length: float | None = None
    enforce_eager: bool | None = None
    draft_tensor_parallel_size: int | None = None
    max_model_len: int | None = None
    speculator_options: Any = None
    num_speculative_tokens_per_batch_size: tuple[tuple[int, int, int], ...] | None = None
    enable_adaptive_verification: bool = False
    history_first: str | None = None
    draft_sample_method: str = "greedy"
    suffix_decoding_corpus_tokens: int = 1 << 20
    suffix_backend: str | None = None
    dspark_draft_topk: int | None = None

    def __post_init__(self) -> None:
        set_ = lambda f, v: object.__setattr__(self, f, v)  # noqa: E731
        method = self.method
        if method is not None and not isinstance(method, str):
            raise ArgumentTypeError(f"method must be None or a str, got {show(method)}")
        if self.model is not None and not isinstance(self.model, str):
            raise ArgumentTypeError(f"model must be None or a path / name str, got {show(self.model)}")
        if method is None:
            method = "ngram" if self.model in ("ngram", "[ngram]") else "draft_model"
        if method.endswith("_mtp"):
            warnings.warn(f"method={method!r} is deprecated; it means 'mtp'", DeprecationWarning,
                          stacklevel=3)
            method = "mtp"
        if method in UNSUPPORTED_METHODS:
            raise ValueError(
                f"method={method!r} is accepted by vLLM but not implemented by specjax; "
                f"supported methods: {METHODS}"
            )
        custom = custom_method(method)
        if method not in METHODS and custom is None:
            raise ValueError(f"method={show(method)}: {unknown_method_message(method)}")
        set_("method", method)
        _check_speculator_options(self, method, custom)
        if method == "draft_model" and not self.model:
            raise ValueError("model must name the draft model when method='draft_model'")
        if method in ("ngram", "ngram_gpu", "suffix", "extract_hidden_states") and self.model is None:
            set_("model", method)

        for f in ("parallel_drafting", "disable_padded_drafter_batch", "use_local_argmax_reduction",
                  "enable_adaptive_verification"):
            check_bool(f, getattr(self, f))

        # --- suffix decoding fields (checked for every method, as vLLM does)
        check_int("suffix_decoding_max_tree_depth", self.suffix_decoding_max_tree_depth, 1)
        check_int("suffix_decoding_max_cached_requests", self.suffix_decoding_max_cached_requests, 0,
                  why="0 disables the global tree")
        check_number("suffix_decoding_max_spec_factor", self.suffix_decoding_max_spec_factor, 0.0)
        check_number("suffix_decoding_min_token_prob", self.suffix_decoding_min_token_prob, 0.0, 1.0)
        check_int("suffix_decoding_corpus_tokens", self.suffix_decoding_corpus_tokens, 0,
                  (1 << 31) - 1, why="0: per-request matching only")
        if self.suffix_decoding_corpus_tokens == 0:      # vLLM 0.34: both mean no corpus
            set_("suffix_decoding_max_cached_requests", 0)
        set_("suffix_backend", _resolve_suffix_backend(self, method))

        # --- k
        k = self.num_speculative_tokens
        if k is None and method == "suffix" and self.suffix_backend == "device":
            k = min(8, self.suffix_decoding_max_tree_depth)      # vLLM 0.34, with its warning
            warnings.warn(f"num_speculative_tokens defaults to {k} for suffix decoding (vLLM "
                          "0.34: min(8, suffix_decoding_max_tree_depth)); every slot is verified, "
                          "so a deep default costs throughput at high concurrency", UserWarning,
                          stacklevel=3)
        if k is None and method == "suffix":
            if _is_int(self.suffix_decoding_max_tree_depth) and \
                    self.suffix_decoding_max_tree_depth > MAX_SPECULATIVE_TOKENS:
                raise ValueError(
                    f"num_speculative_tokens defaults to suffix_decoding_max_tree_depth="
                    f"{self.suffix_decoding_max_tree_depth} for suffix decoding, above specjax's "
                    f"limit {MAX_SPECULATIVE_TOKENS}: set num_speculative_tokens")
            k = self.suffix_decoding_max_tree_depth
        if k is None and method == "mtp":
            raise ValueError("num_speculative_tokens is required for method='mtp' (an int >= 1): "
                             "vLLM defaults it to the checkpoint's num_nextn_predict_layers, which "
                             "SpeculativeConfig.from_vllm reads from the model directory")
        if k is None:
            raise ValueError(f"num_speculative_tokens is required for method={method!r} (an int >= 1)")
        k = check_int("num_speculative_tokens", k, 1, MAX_SPECULATIVE_TOKENS,
                      why="specjax's limit on the draft length")
        set_("num_speculative_tokens", k)
        if method == "extract_hidden_states" and k != 1:
            raise ValueError("num_speculative_tokens must be 1 for method='extract_hidden_states', "
                             f"got {k}")

        _check_history_first(self, method)
        # --- n-gram lookup window (each given value is checked before one copies the other)
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if method in ("ngram", "ngram_gpu") or _history_ngram(self.history_first):
            lo = check_opt_int("prompt_lookup_min", lo, 1, MAX_PROMPT_LOOKUP)
            hi = check_opt_int("prompt_lookup_max", hi, 1, MAX_PROMPT_LOOKUP)
            if lo is None and hi is None:
                lo = hi = 5
            elif lo is None:
                lo = hi
            elif hi is None:
                hi = lo
            if lo > hi:
                raise ValueError(f"prompt_lookup_min={lo} must be <= prompt_lookup_max={hi}")
        else:
            for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
                if v not in (None, 0):
                    raise ValueError(f"{name}={show(v)} is only for methods 'ngram' / 'ngram_gpu', "
                                     f"not method={method!r} (or for history_first='ngram' / "
                                     f"'ngram_gpu', not {self.history_first!r})")
            lo = hi = 0
        set_("prompt_lookup_min", lo)
        set_("prompt_lookup_max", hi)

        # --- parallel drafting and trees
        if method in ("dflash", "dspark"):
            set_("parallel_drafting", True)
        if self.parallel_drafting and method not in PARALLEL_DRAFTING_METHODS:
            raise ValueError(f"parallel_drafting=True needs a method in {PARALLEL_DRAFTING_METHODS}, "
                             f"got method={method!r}")
        if self.parallel_drafting and self.disable_padded_drafter_batch:
            raise ValueError("parallel_drafting needs the padded drafter batch: set "
                             "disable_padded_drafter_batch=False")
        if method == "draft_model" and self.disable_padded_drafter_batch:
            raise ValueError("method='draft_model' needs the padded drafter batch: set "
                             "disable_padded_drafter_batch=False")
        tree = self.speculative_token_tree
        if tree is not None and not isinstance(tree, (str, list, tuple)):
            raise ArgumentTypeError(f"speculative_token_tree must be None, a str or a list of "
                                    f"tuples, got {show(tree)}")
        if isinstance(tree, str) and len(tree) > MAX_TREE_CHARS:
            raise ValueError(f"speculative_token_tree is {len(tree)} characters long, more than "
                             f"specjax's limit {MAX_TREE_CHARS} (at most {MAX_TREE_NODES} nodes)")
        if method in MODEL_FREE_METHODS or custom is not None:
            if tree is not None:
                raise ValueError(f"speculative_token_tree is only for methods {TREE_METHODS}, "
                                 f"not method={method!r}")
        else:
            nodes = _chain_tree(int(k)) if tree is None else parse_token_tree(tree)
            if len(nodes) > MAX_TREE_NODES or len(nodes[-1]) > MAX_SPECULATIVE_TOKENS:
                raise ValueError(f"speculative_token_tree has {len(nodes)} nodes and depth "
                                 f"{len(nodes[-1])}; specjax's limits: {MAX_TREE_NODES} nodes, "
                                 f"depth {MAX_SPECULATIVE_TOKENS}")
            is_chain = nodes == _chain_tree(len(nodes))
            if not is_chain and method not in TREE_METHODS:
                raise ValueError(f"a branching speculative_token_tree needs a method in "
                                 f"{TREE_METHODS}, got method={method!r}")
            if not is_chain and self.parallel_drafting:
                raise ValueError("a branching speculative_token_tree cannot be combined with "
                                 "parallel_drafting=True")
            set_("speculative_token_tree", str(list(nodes)))

        # --- rejection sampler (vLLM's _verify_args / _resolve_synthetic_acceptance_rates)
        rsm = self.rejection_sample_method
        if rsm not in REJECTION_SAMPLE_METHODS:
            raise ValueError(f"rejection_sample_method={show(rsm)}; allowed values: "
                             f"{REJECTION_SAMPLE_METHODS}")
        rates, length = self.synthetic_acceptance_rates, self.synthetic_acceptance_length
        if rsm == "synthetic":
            rates = resolve_synthetic_acceptance_rates(k, rates, length)
            if self.synthetic_acceptance_rates is not None:
                set_("synthetic_acceptance_rates", rates)
            else:
                set_("synthetic_acceptance_length", float(length))   # type: ignore[arg-type]
        elif rates is not None or length is not None:
            raise ValueError("synthetic_acceptance_rates / synthetic_acceptance_length are only "
                             "for rejection_sample_method='synthetic'")

        # --- vLLM fields specjax accepts only at vLLM's default
        if self.enforce_eager not in (None, False):
            raise ValueError(f"enforce_eager={show(self.enforce_eager)} is not supported: specjax "
                             "always runs jitted (use jax.disable_jit() around generate to debug); "
                             "allowed values: None, False")
        dtp = check_opt_int("draft_tensor_parallel_size", self.draft_tensor_parallel_size, 1, 4096)
        if dtp is not None and method != "draft_model":
            raise ValueError(f"draft_tensor_parallel_size={dtp} is only read by "
                             f"method='draft_model'; method={method!r} runs on the target's "
                             "mesh (vLLM's default, None)")
        check_opt_int("max_model_len", self.max_model_len, 1)
        sched = self.num_speculative_tokens_per_batch_size
        if sched is not None:
            from specjax.adaptive_k import validate_k_schedule

            set_("num_speculative_tokens_per_batch_size", tuple(validate_k_schedule(sched)))
            if self.speculative_token_tree is not None and not is_chain:
                raise ValueError("num_speculative_tokens_per_batch_size cannot be combined with "
                                 "a branching speculative_token_tree (its k is a node count)")
        if self.dspark_draft_topk is not None:      # vLLM 0.34's message for other methods
            if method != "dspark":
                raise ValueError(f"dspark_draft_topk is not supported with speculative method "
                                 f"{method!r}")
            check_int("dspark_draft_topk", self.dspark_draft_topk, 1)
        if self.enable_adaptive_verification:
            _check_adaptive_verification(self, method)
        if self.draft_sample_method != "greedy":
            _check_draft_sample_method(self, method)

    # --- vLLM helpers --------------------------------------------------------------

    @property
    def synthetic_rates(self) -> tuple[float, ...] | None:
        """The synthetic unconditional acceptance rates (given or resolved from the length),
        None unless ``rejection_sample_method='synthetic'``."""
        if self.rejection_sample_method != "synthetic":
            return None
        return resolve_synthetic_acceptance_rates(self.num_speculative_tokens,
                                                  self.synthetic_acceptance_rates,
                                                  self.synthetic_acceptance_length)

    @classmethod
    def from_vllm(cls, d: Mapping[str, Any], **overrides: Any) -> "SpeculativeConfig":
        """A vLLM ``speculative_config`` dict -> ``SpeculativeConfig``
        (:func:`specjax.vllm_config.from_vllm`, after vLLM 0.34's keys: :func:`_vllm_034`)."""
        from specjax.vllm_config import from_vllm

        if isinstance(d, Mapping):
            d, overrides = _vllm_034({**d, **overrides}), {}
        return cls(**from_vllm(d, tuple(f.name for f in dataclasses.fields(cls)), **overrides))

    @property
    def custom_method(self) -> str | None:
        """The method's name when it is user-registered (vLLM 0.34's field), else None."""
        return self.method if custom_method(self.method) is not None else None

    # --- vLLM helpers --------------------------------------------------------------

    @property
    def token_tree(self) -> tuple[tuple[int, ...], ...] | None:
        """The parsed tree (sorted breadth-first), or None for model-free methods."""
        t = self.speculative_token_tree
        return None if t is None else parse_token_tree(t)

    def use_eagle(self) -> bool:
        return self.method in ("eagle", "eagle3", "mtp", "dflash")

    def use_dflash(self) -> bool:
        return self.method == "dflash"

    def uses_draft_model(self) -> bool:
        return self.method == "draft_model"

    def uses_extract_hidden_states(self) -> bool:
        return self.method == "extract_hidden_states"

    def use_ngram_gpu(self) -> bool:
        return self.method == "ngram_gpu"

    @property
    def max_num_new_slots_for_drafting(self) -> "SlotCount":
        """Extra KV slots a request may need while drafting (vLLM's property): ``k-1`` with
        parallel drafting, plus 1 for a draft model; an int that may also be called."""
        n = self.num_speculative_tokens - 1 if self.parallel_drafting else 0
        return SlotCount(n + (1 if self.uses_draft_model() else 0))

    def __repr__(self) -> str:
        return (f"SpeculativeConfig(method={self.method!r}, model={self.model!r}, "
                f"num_spec_tokens={self.num_speculative_tokens})")


def _check_speculator_options(self: SpeculativeConfig, method: str, custom: Any) -> None:
    """vLLM 0.34's ``speculator_options``: only for a method whose config class reads them
    (a registered one), stored as that class's (hashable) value."""
    opts = self.speculator_options
    config_class = None if custom is None else custom.resolved_config_class()
    if opts is None or (isinstance(opts, Mapping) and not opts and config_class is None):
        object.__setattr__(self, "speculator_options", None)
        if config_class is None:
            return
        opts = {}
    if config_class is None:
        raise ValueError(f"speculator_options is not supported with speculative method "
                         f"{method!r} (only a registered method with a config_class reads them)")
    if not isinstance(opts, Mapping):
        if not isinstance(config_class, type) or isinstance(opts, config_class):
            return           # already built (dataclasses.replace, a copy)
        raise ArgumentTypeError(f"speculator_options must be a dict for method {method!r}, "
                                f"got {show(opts)}")
    try:
        value = config_class(**dict(opts))
        hash(value)
    except TypeError as e:
        raise ValueError(f"speculator_options={show(dict(opts))} for method {method!r}: {e} "
                         "(the registered config_class must accept them and return a hashable "
                         "value, e.g. a frozen dataclass)") from None
    object.__setattr__(self, "speculator_options", value)


#: Keys vLLM 0.34 removed -> what replaces them (refused by name).
VLLM_034_REMOVED = {
    "custom_class": "specjax.register_speculative_method(name, proposer, config_class) and "
                    "method=name (vLLM 0.34's register_speculative_method)",
    "use_heterogeneous_vocab": "nothing: vLLM 0.34 removed the V1 TLI path; specjax drafts in "
                               "the target's vocabulary (an EAGLE-3 head maps its own through d2t)",
}
#: vLLM 0.34's checkpoint detection order: of the methods a draft's config names, the first wins.
DETECTION_ORDER = ("eagle", "eagle3", "dflash", "dspark", "mtp")


def _vllm_034(d: Mapping[str, Any]) -> dict:
    """vLLM 0.34's keys in a ``speculative_config`` dict: removed ones refused naming their
    replacement; ``draft_decode_context_parallel_size`` (1 only), ``custom_method``,
    ``parallel_drafting=None`` read; the method of several a draft's config names picked by
    :data:`DETECTION_ORDER`. docs/vllm_config.md, "vLLM 0.34"."""
    d = dict(d)
    for key, instead in VLLM_034_REMOVED.items():
        if key in d:
            raise ValueError(f"speculative_config key {key!r} was removed in vLLM 0.34 and is not "
                             f"read by specjax; use {instead}")
    if "parallel_drafting" in d and d["parallel_drafting"] is None:
        del d["parallel_drafting"]           # 0.34's default: deprecated, None
    dcp = check_opt_int("draft_decode_context_parallel_size",
                        d.pop("draft_decode_context_parallel_size", None), 1)
    if dcp not in (None, 1):
        raise ValueError(f"draft_decode_context_parallel_size={dcp} is not supported: specjax has "
                         "no decode context parallelism (the target's size is 1, and vLLM allows "
                         "only 1 or the target's); allowed values: None, 1")
    name = d.pop("custom_method", None)
    if name is not None:
        if custom_method(name) is None:
            raise ValueError(f"custom_method={show(name)}: {unknown_method_message(name)}")
        d["method"] = name                   # vLLM keeps the base method in "method"
    model = d.get("model")
    if d.get("method") is None and isinstance(model, str) and model not in ("ngram", "[ngram]"):
        picked = _ordered_method(model)
        if picked is not None:
            d["method"] = picked
    return d


def _ordered_method(model: str) -> str | None:
    """The first of :data:`DETECTION_ORDER` when the draft's config names several methods and
    its tensors name none other (a contradiction stays ``detect_method``'s refusal)."""
    from pathlib import Path

    from specjax.vllm_config import _from_config, _from_tensors

    if not Path(model).is_dir():
        return None
    from specjax.hf import read_checkpoint_config

    found = _from_config(read_checkpoint_config(model))
    if len(found) < 2:
        return None
    by_tensors = _from_tensors(model)
    if by_tensors is not None and by_tensors not in found and \
            not ("mtp" in found and by_tensors == "draft_model"):
        return None
    return next((m for m in DETECTION_ORDER if m in found), None)


class SlotCount(int):
    """An int that returns itself when called (``config.max_num_new_slots_for_drafting``
    works as vLLM's property and as a call)."""

    def __call__(self) -> int:
        return int(self)


def _is_int(v) -> bool:
    return is_int(v)


def acceptance_length_to_rates(length: float, k: int) -> tuple[float, ...]:
    """vLLM's ``_acceptance_length_to_rates``: ``floor(length-1)`` ones, the fraction, then
    zeros, truncated to ``k``."""
    n_full = int(math.floor(length - 1))
    frac = (length - 1) - n_full
    rates = [1.0] * n_full + ([frac] if n_full < k else [])
    rates = (rates + [0.0] * k)[:k]
    return tuple(float(r) for r in rates)


def resolve_synthetic_acceptance_rates(k: int, rates: Any, length: Any) -> tuple[float, ...]:
    """vLLM's ``_resolve_synthetic_acceptance_rates``: exactly one of ``rates`` (k values
    in [0, 1], non-increasing) and ``length`` (in [1, k+1]); returns the rates."""
    if (rates is None) == (length is None):
        raise ValueError("rejection_sample_method='synthetic' needs exactly one of "
                         "synthetic_acceptance_rates and synthetic_acceptance_length")
    if length is not None:
        length = check_number("synthetic_acceptance_length", length, 1.0, k + 1.0)
        return acceptance_length_to_rates(length, k)
    if isinstance(rates, (str, bytes)) or not isinstance(rates, (list, tuple, np.ndarray)):
        raise ArgumentTypeError(f"synthetic_acceptance_rates must be a list of "
                                f"num_speculative_tokens={k} numbers in [0, 1], got {show(rates)}")
    rates = tuple(check_number(f"synthetic_acceptance_rates[{i}]", r, 0.0, 1.0)
                  for i, r in enumerate(rates))
    if len(rates) != k:
        raise ValueError(f"synthetic_acceptance_rates must hold num_speculative_tokens={k} values "
                         f"in [0, 1], got {len(rates)}: {show(rates)}")
    for i in range(1, k):
        if rates[i] > rates[i - 1]:
            raise ValueError(f"synthetic_acceptance_rates must be non-increasing (unconditional "
                             f"rates, as vLLM), got {show(rates)}: [{i}]={rates[i]} > "
                             f"[{i - 1}]={rates[i - 1]}")
    return rates


def _check_adaptive_verification(cfg: SpeculativeConfig, method: str) -> None:
    """``enable_adaptive_verification=True`` needs a model method's chain, no local argmax."""
    name = "enable_adaptive_verification=True"
    if method == "suffix" and cfg.suffix_backend == "device":
        return              # vLLM 0.34: the suffix speculator's acceptance statistics
    if method not in MODEL_CHAIN_METHODS:
        raise ValueError(f"{name} needs a method whose drafts have a distribution, one of "
                         f"{MODEL_CHAIN_METHODS}, or method='suffix' on the device backend; got "
                         f"method={method!r}")
    tree = cfg.speculative_token_tree
    if tree is not None and parse_token_tree(tree) != _chain_tree(cfg.num_speculative_tokens):
        raise ValueError(f"{name} cannot be combined with a branching speculative_token_tree")
    if cfg.use_local_argmax_reduction:
        raise ValueError(f"{name} cannot be combined with use_local_argmax_reduction=True (its "
                         "confidence needs the whole draft distribution; vLLM refuses it too)")


#: ``history_first``'s first stages.
HISTORY_FIRST_STAGES = (None, "ngram", "ngram_gpu", "suffix")


def _history_ngram(v: Any) -> bool:
    return isinstance(v, str) and v in ("ngram", "ngram_gpu")


#: ``suffix_backend``: vLLM 0.34's device speculator or vLLM 0.20's Arctic Inference trees.
SUFFIX_BACKENDS = (None, "device", "arctic")
#: Suffix keys only Arctic Inference reads (no effect in vLLM 0.34) -> their defaults.
SUFFIX_ARCTIC_ONLY = {"suffix_decoding_max_spec_factor": 1.0,
                      "suffix_decoding_min_token_prob": 0.1}


def _resolve_suffix_backend(cfg: SpeculativeConfig, method: str) -> str | None:
    """``suffix_backend`` for a config using suffix decoding (as given otherwise): None ->
    ``"device"``, or ``"arctic"`` (warning, naming the keys) when an Arctic-only key is set
    off its default; a key the chosen backend does not read warns, naming it."""
    backend = check_choice("suffix_backend", cfg.suffix_backend, SUFFIX_BACKENDS)
    if method != "suffix" and cfg.history_first != "suffix":
        return backend
    arctic_only = [f"{f}={show(getattr(cfg, f))}" for f, default in SUFFIX_ARCTIC_ONLY.items()
                   if getattr(cfg, f) != default]
    if cfg.suffix_decoding_max_cached_requests not in (0, 10000):   # 0 is read by both
        arctic_only.append(f"suffix_decoding_max_cached_requests="
                           f"{cfg.suffix_decoding_max_cached_requests}")
    if backend is None and arctic_only:
        warnings.warn(f"suffix_backend=None resolves to 'arctic' (Arctic Inference suffix trees) "
                      f"because {', '.join(arctic_only)} is set, which the device suffix "
                      "speculator (vLLM 0.34's) does not read; set suffix_backend to choose",
                      UserWarning, stacklevel=4)
        return "arctic"
    backend = backend or "device"
    if backend == "device" and arctic_only:
        warnings.warn(f"suffix_backend='device' does not read {', '.join(arctic_only)} (as in "
                      "vLLM 0.34: it drafts num_speculative_tokens tokens and keeps "
                      "suffix_decoding_corpus_tokens tokens); these keys have no effect",
                      UserWarning, stacklevel=4)
    corpus = cfg.suffix_decoding_corpus_tokens
    if backend == "arctic" and corpus not in (0, 1 << 20):
        warnings.warn(f"suffix_decoding_corpus_tokens={corpus} has no effect with "
                      "suffix_backend='arctic' (its cache holds "
                      "suffix_decoding_max_cached_requests responses; only 0 is read)",
                      UserWarning, stacklevel=4)
    return backend


def _check_history_first(cfg: SpeculativeConfig, method: str) -> None:
    """``history_first`` (specjax's): a history proposer drafts first, a model chain elsewhere."""
    v = cfg.history_first
    if v is None:
        return
    if not isinstance(v, str):
        raise ArgumentTypeError(f"history_first={show(v)}; allowed values: "
                                f"{HISTORY_FIRST_STAGES}")
    if v not in HISTORY_FIRST_STAGES:
        raise ValueError(f"history_first={show(v)}; allowed values: {HISTORY_FIRST_STAGES}")
    name = f"history_first={v!r}"
    if method not in MODEL_CHAIN_METHODS:
        raise ValueError(f"{name} needs a model method drafting a chain, one of "
                         f"{MODEL_CHAIN_METHODS}; got method={method!r}")
    tree = cfg.speculative_token_tree
    nodes = parse_token_tree(tree) if isinstance(tree, (str, list, tuple)) else None
    if nodes and nodes != _chain_tree(len(nodes)) and sum(len(c) == 1 for c in nodes) < 2:
        raise ValueError(f"{name} with a branching speculative_token_tree needs >= 2 children "
                         "of the root (the first stage's chain takes the last one's first-child "
                         f"path); got {list(nodes)}")
    if cfg.enable_adaptive_verification:
        raise ValueError(f"{name} cannot be combined with enable_adaptive_verification=True (the "
                         "first stage's drafts have no confidence features)")
    if cfg.disable_padded_drafter_batch:
        raise ValueError(f"{name} cannot be combined with disable_padded_drafter_batch=True (the "
                         "model drafter must run on every row inside the step)")
    sampled = cfg.draft_sample_method
    if sampled != "greedy":
        raise ValueError(f"{name} cannot be combined with draft_sample_method={sampled!r} (the "
                         "first stage's drafts have no distribution to verify against)")


def _check_draft_sample_method(cfg: SpeculativeConfig, method: str) -> None:
    """``draft_sample_method="probabilistic"`` needs a model method's chain whose drafts the
    standard rejection sampler verifies with their probabilities."""
    from specjax.sampling.draft_sample import DRAFT_SAMPLE_METHODS

    v = cfg.draft_sample_method
    if not isinstance(v, str) or v not in DRAFT_SAMPLE_METHODS:
        raise ValueError(f"draft_sample_method={show(v)}; allowed values: {DRAFT_SAMPLE_METHODS}")
    name = f"draft_sample_method={v!r}"
    tree = cfg.speculative_token_tree
    why = (f"method={method!r} has no draft distribution (greedy only)"
           if method not in MODEL_CHAIN_METHODS else
           "a branching speculative_token_tree: sampled siblings need a multi-draft "
           "verification specjax does not implement" if tree is not None and
           parse_token_tree(tree) != _chain_tree(cfg.num_speculative_tokens) else
           "use_local_argmax_reduction=True (vLLM refuses it too)"
           if cfg.use_local_argmax_reduction else
           "rejection_sample_method='synthetic' (it ignores the drafts' probabilities)"
           if cfg.rejection_sample_method == "synthetic" else
           "disable_padded_drafter_batch=True (the split drafter is greedy only)"
           if cfg.disable_padded_drafter_batch else None)
    if why is not None:
        raise ValueError(f"{name} cannot be used with {why}")

"""``SpeculativeConfig``: vLLM's field names and defaults, validated at construction.

Every check raises ``ValueError`` naming the field and the allowed values, before any
model or buffer is built. The object is frozen and hashable, so proposers can keep it as
static configuration under ``jax.jit``.
"""

from __future__ import annotations

import ast
import dataclasses
import warnings
from typing import Literal

MODEL_FREE_METHODS = ("ngram", "ngram_gpu", "suffix")
HEAD_METHODS = ("eagle", "eagle3", "dflash", "medusa", "extract_hidden_states")
METHODS = MODEL_FREE_METHODS + HEAD_METHODS + ("draft_model",)
#: Methods vLLM accepts that specjax does not implement.
UNSUPPORTED_METHODS = ("mlp_speculator", "mtp")
#: Methods built on vLLM's SpecDecodeBaseProposer, the only ones that can draft in parallel.
PARALLEL_DRAFTING_METHODS = ("eagle", "eagle3", "draft_model", "dflash")
TREE_METHODS = ("eagle", "eagle3")
REJECTION_SAMPLE_METHODS = ("strict", "probabilistic", "synthetic")

RejectionSampleMethod = Literal["strict", "probabilistic", "synthetic"]


def _chain_tree(k: int) -> tuple[tuple[int, ...], ...]:
    return tuple((0,) * i for i in range(1, k + 1))


def parse_token_tree(tree: str | list | tuple) -> tuple[tuple[int, ...], ...]:
    """Parse and check a ``speculative_token_tree``; return it sorted by ``(len, tuple)``.

    The proposer expands every node of a level into the same number of children (top-k
    per level, as vLLM's ``propose_tree`` does), so the tree must be breadth-first
    consistent: no duplicates, every node's parent present, and level l made of exactly
    the children ``0..c_l-1`` of every node of level l-1.
    """
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
    """Speculative decoding configuration (vLLM ``SpeculativeConfig`` field names).

    ``method`` None means ``"ngram"`` when ``model`` is ``"ngram"``/``"[ngram]"``, else
    ``"draft_model"``. ``num_speculative_tokens`` defaults to
    ``suffix_decoding_max_tree_depth`` for suffix decoding and is required otherwise.
    ``prompt_lookup_min/max`` default to 5 for the n-gram methods (one copies the other
    when only one is given) and are 0 for the others. ``speculative_token_tree`` becomes
    the chain of k nodes for model-based methods when None; it is stored normalized
    (sorted ``(len, tuple)``) as ``str`` like vLLM, and parsed in ``token_tree``.
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

    def __post_init__(self) -> None:
        set_ = lambda f, v: object.__setattr__(self, f, v)  # noqa: E731
        method = self.method
        if method is None:
            method = "ngram" if self.model in ("ngram", "[ngram]") else "draft_model"
        if isinstance(method, str) and method.endswith("_mtp"):
            warnings.warn(f"method={method!r} is deprecated; it means 'mtp'", DeprecationWarning,
                          stacklevel=3)
            method = "mtp"
        if method in UNSUPPORTED_METHODS:
            raise ValueError(
                f"method={method!r} is accepted by vLLM but not implemented by specjax; "
                f"supported methods: {METHODS}"
            )
        if method not in METHODS:
            raise ValueError(f"method={method!r} is unknown; allowed values: {METHODS}")
        set_("method", method)
        if method == "draft_model" and not self.model:
            raise ValueError("model must name the draft model when method='draft_model'")
        if method in ("ngram", "ngram_gpu", "suffix", "extract_hidden_states") and self.model is None:
            set_("model", method)

        for f in ("parallel_drafting", "disable_padded_drafter_batch", "use_local_argmax_reduction"):
            if not isinstance(getattr(self, f), bool):
                raise ValueError(f"{f} must be a bool, got {getattr(self, f)!r}")

        # --- suffix decoding fields (checked for every method, as vLLM does)
        if not _is_int(self.suffix_decoding_max_tree_depth) or self.suffix_decoding_max_tree_depth < 1:
            raise ValueError("suffix_decoding_max_tree_depth must be an int >= 1, got "
                             f"{self.suffix_decoding_max_tree_depth!r}")
        if (not _is_int(self.suffix_decoding_max_cached_requests)
                or self.suffix_decoding_max_cached_requests < 0):
            raise ValueError("suffix_decoding_max_cached_requests must be an int >= 0 (0 disables "
                             f"the global tree), got {self.suffix_decoding_max_cached_requests!r}")
        if not _is_num(self.suffix_decoding_max_spec_factor) or self.suffix_decoding_max_spec_factor < 0:
            raise ValueError("suffix_decoding_max_spec_factor must be a number >= 0, got "
                             f"{self.suffix_decoding_max_spec_factor!r}")
        if (not _is_num(self.suffix_decoding_min_token_prob)
                or not 0.0 <= self.suffix_decoding_min_token_prob <= 1.0):
            raise ValueError("suffix_decoding_min_token_prob must be in [0, 1], got "
                             f"{self.suffix_decoding_min_token_prob!r}")

        # --- k
        k = self.num_speculative_tokens
        if k is None and method == "suffix":
            k = self.suffix_decoding_max_tree_depth
        if k is None:
            raise ValueError(f"num_speculative_tokens is required for method={method!r} (an int >= 1)")
        if not _is_int(k) or k < 1:
            raise ValueError(f"num_speculative_tokens must be an int >= 1, got {k!r}")
        set_("num_speculative_tokens", int(k))
        if method == "extract_hidden_states" and k != 1:
            raise ValueError("num_speculative_tokens must be 1 for method='extract_hidden_states', "
                             f"got {k}")

        # --- n-gram lookup window
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if method in ("ngram", "ngram_gpu"):
            if lo is None and hi is None:
                lo = hi = 5
            elif lo is None:
                lo = hi
            elif hi is None:
                hi = lo
            for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
                if not _is_int(v) or v < 1:
                    raise ValueError(f"{name} must be an int >= 1, got {v!r}")
            if lo > hi:
                raise ValueError(f"prompt_lookup_min={lo} must be <= prompt_lookup_max={hi}")
        else:
            lo = hi = 0
        set_("prompt_lookup_min", lo)
        set_("prompt_lookup_max", hi)

        # --- parallel drafting and trees
        if method == "dflash":
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
        if method in MODEL_FREE_METHODS:
            if tree is not None:
                raise ValueError(f"speculative_token_tree is only for methods {TREE_METHODS}, "
                                 f"not method={method!r}")
        else:
            nodes = _chain_tree(int(k)) if tree is None else parse_token_tree(tree)
            is_chain = nodes == _chain_tree(len(nodes))
            if not is_chain and method not in TREE_METHODS:
                raise ValueError(f"a branching speculative_token_tree needs a method in "
                                 f"{TREE_METHODS}, got method={method!r}")
            if not is_chain and self.parallel_drafting:
                raise ValueError("a branching speculative_token_tree cannot be combined with "
                                 "parallel_drafting=True")
            set_("speculative_token_tree", str(list(nodes)))

        # --- rejection sampler
        rsm = self.rejection_sample_method
        if rsm not in REJECTION_SAMPLE_METHODS:
            raise ValueError(f"rejection_sample_method={rsm!r}; allowed values: "
                             f"{REJECTION_SAMPLE_METHODS}")
        rates, length = self.synthetic_acceptance_rates, self.synthetic_acceptance_length
        if rsm == "synthetic":
            if (rates is None) == (length is None):
                raise ValueError("rejection_sample_method='synthetic' needs exactly one of "
                                 "synthetic_acceptance_rates and synthetic_acceptance_length")
            if rates is not None:
                rates = tuple(float(r) for r in rates)
                if len(rates) != k or not all(0.0 <= r <= 1.0 for r in rates):
                    raise ValueError(f"synthetic_acceptance_rates must hold num_speculative_tokens={k} "
                                     f"values in [0, 1], got {rates}")
                set_("synthetic_acceptance_rates", rates)
            elif not _is_num(length) or not 1.0 <= length <= k + 1:
                raise ValueError(f"synthetic_acceptance_length must be in [1, {k + 1}], got {length!r}")
        elif rates is not None or length is not None:
            raise ValueError("synthetic_acceptance_rates / synthetic_acceptance_length are only "
                             "for rejection_sample_method='synthetic'")

        dtp = self.draft_tensor_parallel_size
        if dtp is not None and (not _is_int(dtp) or dtp < 1):
            raise ValueError(f"draft_tensor_parallel_size must be None or an int >= 1, got {dtp!r}")
        mml = self.max_model_len
        if mml is not None and (not _is_int(mml) or not 1 <= mml < 2**31):
            raise ValueError(f"max_model_len must be None or an int in [1, 2**31), got {mml!r}")

    # --- vLLM helpers --------------------------------------------------------------

    @property
    def token_tree(self) -> tuple[tuple[int, ...], ...] | None:
        """The parsed tree (sorted breadth-first), or None for model-free methods."""
        t = self.speculative_token_tree
        return None if t is None else parse_token_tree(t)

    def use_eagle(self) -> bool:
        return self.method in ("eagle", "eagle3", "dflash")

    def use_dflash(self) -> bool:
        return self.method == "dflash"

    def uses_draft_model(self) -> bool:
        return self.method == "draft_model"

    def uses_extract_hidden_states(self) -> bool:
        return self.method == "extract_hidden_states"

    def use_ngram_gpu(self) -> bool:
        return self.method == "ngram_gpu"

    def max_num_new_slots_for_drafting(self) -> int:
        """Extra KV slots a request may need while drafting: ``k-1`` if parallel drafting,
        plus 1 for a draft model (vLLM)."""
        n = self.num_speculative_tokens - 1 if self.parallel_drafting else 0
        return n + (1 if self.uses_draft_model() else 0)

    def __repr__(self) -> str:
        return (f"SpeculativeConfig(method={self.method!r}, model={self.model!r}, "
                f"num_spec_tokens={self.num_speculative_tokens})")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)

"""Suffix decoding (``method="suffix"``): drafts from suffix trees over the request's own
prompt and response and over a cache of earlier responses, via Arctic Inference (host C++).

Follows vLLM's ``SuffixDecodingProposer`` request lifecycle (start, append, speculate,
stop; docs/integration.md, "How the device proposers draft"). A request with no sampled
tokens, or with no room left below ``max_model_len``, gets no draft.
"""

from __future__ import annotations

from typing import Hashable, Sequence

import numpy as np

from specjax.checks import check_int
from specjax.config import SpeculativeConfig
from specjax.proposers.types import DraftOutput
from specjax.proposers.interface import HistoryProposer, TokenHistory, history_feed

_INSTALL_HINT = 'suffix decoding needs Arctic Inference: pip install "specjax[suffix]"'


def _load_cache_class():
    try:
        from arctic_inference.suffix_decoding import SuffixDecodingCache
    except ImportError as err:
        raise ImportError(f"{_INSTALL_HINT} (import failed: {err})") from err
    return SuffixDecodingCache


def _check_float(name: str, value, lo: float, hi: float | None) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ValueError(f"{name} must be a number {_interval(lo, hi)}, got {value!r}")
    value = float(value)
    if not (value >= lo and (hi is None or value <= hi)):  # also rejects NaN
        raise ValueError(f"{name} must be a number {_interval(lo, hi)}, got {value}")
    return value


def _interval(lo: float, hi: float | None) -> str:
    return f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"


class SuffixDecodingProposer:
    """vLLM's suffix-decoding proposer over ``arctic_inference``'s ``SuffixDecodingCache``.

    ``num_speculative_tokens`` defaults to ``suffix_decoding_max_tree_depth``; the
    ``suffix_decoding_*`` options are vLLM's (tree depth, cached responses, max spec factor,
    min token probability). Raises ImportError naming ``pip install "specjax[suffix]"``
    without Arctic Inference.
    """

    def __init__(
        self,
        *,
        max_model_len: int,
        num_speculative_tokens: int | None = None,
        suffix_decoding_max_tree_depth: int = 24,
        suffix_decoding_max_cached_requests: int = 10000,
        suffix_decoding_max_spec_factor: float = 1.0,
        suffix_decoding_min_token_prob: float = 0.1,
    ) -> None:
        self.max_model_len = check_int("max_model_len", max_model_len, 1)
        self.max_tree_depth = check_int(
            "suffix_decoding_max_tree_depth", suffix_decoding_max_tree_depth, 1
        )
        if num_speculative_tokens is None:
            num_speculative_tokens = self.max_tree_depth
        self.k = check_int("num_speculative_tokens", num_speculative_tokens, 1)
        self.max_cached_requests = check_int(
            "suffix_decoding_max_cached_requests", suffix_decoding_max_cached_requests, 0
        )
        self.max_spec_factor = _check_float("suffix_decoding_max_spec_factor", suffix_decoding_max_spec_factor, 0.0, None)
        self.min_token_prob = _check_float("suffix_decoding_min_token_prob", suffix_decoding_min_token_prob, 0.0, 1.0)
        cache_cls = _load_cache_class()
        self.suffix_cache = cache_cls(
            max_tree_depth=self.max_tree_depth, max_cached_requests=self.max_cached_requests
        )

    @property
    def num_speculative_tokens(self) -> int:
        return self.k

    def propose(
        self,
        req_ids: Sequence[Hashable],
        sampled_token_ids: Sequence[Sequence[int]],
        num_tokens_no_spec: np.ndarray,
        token_ids_cpu: np.ndarray,
        num_prompt_tokens: np.ndarray,
    ) -> list[list[int]]:
        """One step of the request lifecycle: ``B`` lists of drafts, each at most ``k``.

        ``req_ids``: ``B`` hashable ids (active requests absent from them are stopped);
        ``sampled_token_ids``: ``B`` sequences; ``num_tokens_no_spec [B]``: context lengths,
        sampled tokens included; ``token_ids_cpu [B', T]``: the contexts;
        ``num_prompt_tokens [B]``.
        """
        batch = len(req_ids)
        if len(sampled_token_ids) != batch:
            raise ValueError(
                f"sampled_token_ids has {len(sampled_token_ids)} entries but req_ids has {batch}; they must agree"
            )
        num_tokens = _int_array("num_tokens_no_spec", num_tokens_no_spec, 1)
        prompt_lens = _int_array("num_prompt_tokens", num_prompt_tokens, 1)
        token_ids = _int_array("token_ids_cpu", token_ids_cpu, 2)
        if num_tokens.shape[0] != batch or prompt_lens.shape[0] != batch:
            raise ValueError(
                f"num_tokens_no_spec ({num_tokens.shape[0]}) and num_prompt_tokens "
                f"({prompt_lens.shape[0]}) must have one entry per request ({batch})"
            )
        if token_ids.shape[0] < batch:
            raise ValueError(f"token_ids_cpu has {token_ids.shape[0]} rows, fewer than the {batch} requests")
        if batch and (
            num_tokens.min() < 0
            or num_tokens.max() > token_ids.shape[1]
            or prompt_lens.min() < 0
            or (prompt_lens > num_tokens).any()
        ):
            raise ValueError(
                "need 0 <= num_prompt_tokens <= num_tokens_no_spec <= token_ids_cpu.shape[1] "
                f"({token_ids.shape[1]}) for every request"
            )
        if len(set(req_ids)) != batch:
            raise ValueError("req_ids must be distinct")

        # Validate every request before touching the cache, so a bad call changes nothing.
        sampled_lists = [_token_list(sampled, i) for i, sampled in enumerate(sampled_token_ids)]

        cache = self.suffix_cache
        drafts: list[list[int]] = []
        for i, sampled in enumerate(sampled_lists):
            if not sampled:  # partial prefill
                drafts.append([])
                continue
            num = int(num_tokens[i])
            if num >= self.max_model_len:
                drafts.append([])
                continue
            req_id = req_ids[i]
            if req_id not in cache.active_requests:
                if req_id in cache.cached_requests:
                    # A finished request left its response under this id; it is stale now.
                    cache.evict_cached_response(req_id)
                cache.start_request(req_id, token_ids[i, : int(prompt_lens[i])])
            cache.add_active_response(req_id, sampled)
            max_spec_tokens = min(self.k, self.max_model_len - num - 1)
            if max_spec_tokens <= 0:
                drafts.append([])
                continue
            pattern = token_ids[i, max(0, num - self.max_tree_depth) : num]
            draft = cache.speculate(
                req_id,
                pattern,
                max_spec_tokens=max_spec_tokens,
                max_spec_factor=self.max_spec_factor,
                min_token_prob=self.min_token_prob,
            )
            drafts.append(list(draft.token_ids))

        present = set(req_ids)
        for req_id in [r for r in cache.active_requests if r not in present]:
            cache.stop_request(req_id)
        return drafts

    def propose_arrays(self, *args, **kwargs) -> DraftOutput:
        """``propose`` padded to ``DraftOutput`` numpy arrays (``[B, k]`` int32, -1 padded;
        ``[B]`` int32 counts). Same arguments as ``propose``."""
        return DraftOutput.from_lists(self.propose(*args, **kwargs), self.k)


def _int_array(name: str, value, ndim: int) -> np.ndarray:
    try:
        array = np.asarray(value)
    except ValueError as err:
        raise ValueError(f"{name} must be a rectangular integer array: {err}") from None
    if array.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimension(s), got shape {array.shape}")
    if array.dtype == object or not np.issubdtype(array.dtype, np.integer):
        raise TypeError(f"{name} must hold integers, got dtype {array.dtype}")
    # Arctic Inference's zero-copy path wants C-contiguous int32 rows.
    return np.ascontiguousarray(array, dtype=np.int32)


def _token_list(tokens, index: int) -> list[int]:
    if hasattr(tokens, "__len__") and len(tokens) == 0:
        return []
    array = np.asarray(tokens)
    if array.ndim != 1 or array.dtype == object or not np.issubdtype(array.dtype, np.integer):
        raise TypeError(f"sampled_token_ids[{index}] must be a flat sequence of integer token ids")
    return array.astype(np.int64).tolist()


# ---------------------------------------------------------------------------------------
# the adapter a decoding loop drives (``make_proposer``)


class SuffixProposerAdapter(HistoryProposer):
    """``method="suffix"`` on the token history; ``finish_requests`` stops requests so their
    responses join the global cache."""

    def __init__(self, config: SpeculativeConfig, *, max_model_len: int) -> None:
        self.config = config
        self._feed = history_feed(config, max_model_len)
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

    def finish_requests(self, req_ids: Sequence[Hashable], documents=None) -> None:
        cache = self.impl.suffix_cache
        for r in req_ids:
            if r in cache.active_requests:
                cache.stop_request(r)

"""``history_first``: a history proposer drafts where it matches, the model chain elsewhere
(with a branching EAGLE token tree: the history chain takes one branch, the model the rest)."""

from __future__ import annotations

import dataclasses
from typing import Hashable, Sequence

import numpy as np

from specjax.config import SpeculativeConfig
from specjax.proposers.interface import ModelProposer, Proposer, TokenHistory


@dataclasses.dataclass
class HistoryFirstCounts:
    """Rows (request-steps) and draft tokens each stage supplied, shared by every copy."""

    first_stage_rows: int = 0
    model_rows: int = 0
    first_stage_tokens: int = 0
    model_tokens: int = 0
    short_steps: int = 0      # device-loop iterations whose model chain drafted one token


class HistoryFirstProposer(ModelProposer):
    """The model proposer (same Feed, state and fused step) plus ``first_stage``, whose
    drafts replace the model's on the host for the rows where it drafts."""

    first_stage: Proposer
    counts: HistoryFirstCounts

    def __init__(self, model: ModelProposer, first_stage: Proposer) -> None:
        self.__dict__.update(vars(model))
        self.first_stage = first_stage
        self.counts = HistoryFirstCounts()
        self.branch = first_stage_branch(self.feed.token_tree)

    @property
    def loop_drafter(self):
        """The first stage's device drafter where the device loop merges the chains (a
        chain; ``ngram_gpu`` / the device suffix), else None."""
        return None if self.branch is not None else getattr(self.first_stage, "device_drafter",
                                                            None)

    @property
    def device_drafter_state(self):
        """The first stage's device state (the suffix corpus), or None."""
        return getattr(self.first_stage, "device_drafter_state", None)

    def count_merges(self, first_rows: int, model_rows: int, first_tokens: int,
                     model_tokens: int, short_steps: int) -> None:
        """Adds the device loop's merges (``LoopOutput.stage_counts``) to :attr:`counts`."""
        c = self.counts
        c.first_stage_rows += first_rows
        c.model_rows += model_rows
        c.first_stage_tokens += first_tokens
        c.model_tokens += model_tokens
        c.short_steps += short_steps

    @property
    def first_stage_rows(self) -> int:
        return self.counts.first_stage_rows

    @property
    def model_rows(self) -> int:
        return self.counts.model_rows

    def redraft(self, history: TokenHistory, drafts: Sequence[list[int]]) -> list[list[int]]:
        """``drafts`` (the model's, one per history row) with the first stage's where it
        drafts: the whole chain, or in a tree the nodes of :attr:`branch` where its first
        token differs from the model's first (the model keeps the others)."""
        out = self.first_stage.propose_from_history(history)
        tok, cnt = np.asarray(out.token_ids), np.asarray(out.num_drafts)
        c, res, branch = self.counts, [], self.branch
        for j, d in enumerate(drafts):
            n = int(cnt[j])
            if branch is not None and (len(d) <= branch[-1] or tok[j, 0] == d[0]):
                n = 0          # a cut tree, or the model's chain starts alike: the model's
            if n == 0:
                c.model_rows += 1
                c.model_tokens += len(d)
                res.append(list(d))
                continue
            first = tok[j, : n if branch is None else min(n, len(branch))].tolist()
            c.first_stage_rows += 1
            c.first_stage_tokens += len(first)
            if branch is not None:
                tree = list(d)
                for node, t in zip(branch, first):
                    tree[node] = t
                first = tree
            res.append(first)
        return res

    def finish_requests(self, req_ids: Sequence[Hashable], documents=None) -> None:
        super().finish_requests(req_ids, documents)
        self.first_stage.finish_requests(req_ids, documents)

    def __repr__(self) -> str:
        return f"{super().__repr__()[:-1]}, history_first={self.config.history_first!r})"


def first_stage_branch(tree) -> tuple[int, ...] | None:
    """The nodes of a branching tree's path ``(c, 0, 0, ...)`` from the root's last child c,
    where the first stage's chain goes; None for a chain or no tree."""
    if tree is None or tree.is_chain:
        return None
    last = max(c[0] for c in tree.choices)
    index = {c: i for i, c in enumerate(tree.choices)}
    return tuple(index[(last,) + (0,) * d] for d in range(tree.depth))


def _chain_len(config: SpeculativeConfig) -> int:
    """The first stage's k: ``num_speculative_tokens``, or a token tree's depth."""
    from specjax.config import parse_token_tree

    tree = config.speculative_token_tree
    return config.num_speculative_tokens if tree is None else len(parse_token_tree(tree)[-1])


def first_stage_config(config: SpeculativeConfig) -> SpeculativeConfig:
    """The config of ``config.history_first``'s proposer: same k and drafter limit, the
    suffix keys and the already resolved ``suffix_backend``."""
    import warnings

    stage = config.history_first
    ngram = stage in ("ngram", "ngram_gpu")
    with warnings.catch_warnings():       # the outer config has warned about its suffix keys
        warnings.simplefilter("ignore", UserWarning)
        return SpeculativeConfig(
            method=stage, num_speculative_tokens=_chain_len(config),
            prompt_lookup_min=config.prompt_lookup_min if ngram else None,
            prompt_lookup_max=config.prompt_lookup_max if ngram else None,
            suffix_decoding_max_tree_depth=config.suffix_decoding_max_tree_depth,
            suffix_decoding_max_cached_requests=config.suffix_decoding_max_cached_requests,
            suffix_decoding_max_spec_factor=config.suffix_decoding_max_spec_factor,
            suffix_decoding_min_token_prob=config.suffix_decoding_min_token_prob,
            suffix_decoding_corpus_tokens=config.suffix_decoding_corpus_tokens,
            suffix_backend=config.suffix_backend, max_model_len=config.max_model_len)

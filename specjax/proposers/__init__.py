"""Proposers, one module per method, and the uniform interface a decoding loop drives.

``make_proposer(config, ...)`` builds any method and returns a :class:`Proposer`: the
method's own object (``impl``), its ``params`` and its :class:`Feed`, which is all a loop
reads. Model-free methods keep their vLLM-shaped API; their adapters map a
:class:`TokenHistory` onto it. Method modules are imported lazily (no numba, no models).
"""

from __future__ import annotations

import importlib

from specjax.proposers.types import DRAFT_PADDING_ID, DraftOutput, Feed, ProposerInputs
from specjax.proposers.factory import _MODEL_METHODS, available_methods, make_proposer  # noqa: F401
from specjax.proposers.interface import (
    ModelProposer,
    Proposer,
    TokenHistory,
    prepare_inputs_padded,
    prepare_next_token_ids_padded,
)

__all__ = [
    "DRAFT_PADDING_ID", "DraftOutput", "Feed", "ProposerInputs", "TokenHistory", "Proposer",
    "ModelProposer", "NgramProposerAdapter", "NgramGPUProposerAdapter",
    "SuffixProposerAdapter", "make_proposer", "available_methods",
    "prepare_next_token_ids_padded", "prepare_inputs_padded",
]

#: The token-history adapters live with their methods (numba / arctic-inference load lazily).
_ADAPTERS = {"NgramProposerAdapter": "ngram_cpu", "NgramGPUProposerAdapter": "ngram_gpu",
             "SuffixProposerAdapter": "suffix"}


def __getattr__(name):
    if name in _ADAPTERS:
        return getattr(importlib.import_module(f"specjax.proposers.{_ADAPTERS[name]}"), name)
    raise AttributeError(f"module 'specjax.proposers' has no attribute {name!r}")

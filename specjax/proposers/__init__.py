"""Proposers, one module per method, and the uniform interface a decoding loop drives.

``make_proposer(config, ...)`` builds any method and returns a :class:`Proposer`: the
method's own object (``impl``), its ``params`` and its :class:`Feed`, which is all a loop
reads. Model-free methods keep their vLLM-shaped API; their adapters map a
:class:`TokenHistory` onto it. Method modules are imported lazily (no numba, no models).
"""

from __future__ import annotations

import importlib
from typing import Any, Mapping

from specjax.config import SpeculativeConfig
from specjax.method_registry import custom_method
from specjax.proposers.types import DRAFT_PADDING_ID, DraftOutput, Feed, ProposerInputs
from specjax.proposers import factory
from specjax.proposers.factory import _MODEL_METHODS, available_methods  # noqa: F401
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

def make_proposer(config: SpeculativeConfig | Mapping[str, Any], **kwargs: Any) -> Proposer:
    """``factory.make_proposer`` (its arguments and checks), and for a method registered
    with ``specjax.register_speculative_method`` its proposer (``custom.py``)."""
    if isinstance(config, Mapping):
        config = SpeculativeConfig.from_vllm(config)
    entry = custom_method(getattr(config, "method", None))
    if entry is None:
        return factory.make_proposer(config, **kwargs)
    from specjax.proposers.custom import make_custom_proposer

    return make_custom_proposer(entry, config, **kwargs)


make_proposer.__wrapped__ = factory.make_proposer     # type: ignore[attr-defined]


#: The token-history adapters live with their methods (numba / arctic-inference load lazily).
_ADAPTERS = {"NgramProposerAdapter": "ngram_cpu", "NgramGPUProposerAdapter": "ngram_gpu",
             "SuffixProposerAdapter": "suffix"}


def __getattr__(name):
    if name in _ADAPTERS:
        return getattr(importlib.import_module(f"specjax.proposers.{_ADAPTERS[name]}"), name)
    raise AttributeError(f"module 'specjax.proposers' has no attribute {name!r}")

"""Proposers, one module per method, and the uniform interface a decoding loop drives.

``make_proposer(config, ...)`` builds any method of a ``SpeculativeConfig`` and returns a
:class:`Proposer`: the method's own proposer object (``impl``), its ``params`` (device
model proposers) and its :class:`Feed` (``proposer.feed``): where it drafts (inside the
jitted step, in a second call after vLLM's host ``prepare_inputs``, or from the token
history), which target activations it needs, how many KV slots it writes ahead, its token
tree and vocabulary. A decoding loop reads the Feed only, never the method name
(``specjax.runtime.step.make_step`` does).

Model-free proposers (``ngram``, ``ngram_gpu``, ``suffix``) each keep their own vLLM-shaped
API in their module; :class:`NgramProposerAdapter`, :class:`NgramGPUProposerAdapter` and
:class:`SuffixProposerAdapter` map a :class:`TokenHistory` onto it and return a
``DraftOutput``.

Imports of the method modules are lazy: importing ``specjax.proposers`` pulls in neither
numba nor the models.
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

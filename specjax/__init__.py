"""specjax: speculative decoding for JAX (a port of vLLM v1's spec_decode module).

The public API loads lazily (``import specjax`` pulls in neither the models nor numba);
``dir(specjax)`` lists it. The library logs through :mod:`logging` (logger ``"specjax"``,
silent unless the application configures logging); only the CLI prints.
"""

import logging as _logging

from specjax.constants import PADDING_SLOT_ID, next_power_of_2
from specjax.converters import _specjax_getattr as _converters_getattr  # lazy load_pretrained

__version__ = "0.1.0.dev0"

_logging.getLogger(__name__).addHandler(_logging.NullHandler())

__all__ = ["PADDING_SLOT_ID", "next_power_of_2", "__version__", "generate", "make_proposer",
           "SamplingParams", "SpeculativeConfig", "TargetModel", "TokenTree", "Engine",
           "make_step", "Step", "StepBatch", "StepOutput", "build_batch", "Feed",
           "load_pretrained", "load_generation_config", "load_tokenizer", "score"]

# Lazy: ``import specjax`` stays light (no models, no numba) until these are used.
_LAZY = {
    "generate": "specjax.engine",
    "SamplingParams": "specjax.engine",
    "TargetModel": "specjax.engine",
    "Engine": "specjax.engine",
    "make_proposer": "specjax.proposers",
    "SpeculativeConfig": "specjax.config",
    "TokenTree": "specjax.token_tree",
    # the public step (docs/integration.md)
    "make_step": "specjax.step",
    "Step": "specjax.step",
    "StepBatch": "specjax.step",
    "StepOutput": "specjax.step",
    "build_batch": "specjax.batch",
    "Feed": "specjax.proposers",
    # real checkpoints (specjax.hf; tokenizers need the hf extra)
    "load_generation_config": "specjax.hf",
    "load_tokenizer": "specjax.hf",
    "score": "specjax.hf",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    return _converters_getattr(name)


def __dir__():
    return sorted(set(globals()) | set(__all__))

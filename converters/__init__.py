"""Checkpoint converters: every upstream format -> the canonical form of
``models/CANONICAL.md`` -> Flax params saved with orbax. No torch needed.

Attributes load lazily (PEP 562), so ``import specjax`` stays light.
"""

import importlib

_EXPORTS = {
    "CheckpointError": "errors",
    "DestinationError": "errors",
    "DestinationExistsError": "errors",
    "FormatDetectionError": "errors",
    "Interrupted": "errors",
    "TensorMismatchError": "errors",
    "UnsafePickleError": "errors",
    "FORMATS": "formats",
    "detect_format": "formats",
    "normalize": "formats",
    "convert": "pipeline",
    "load_pretrained": "pipeline",
    "prepare": "pipeline",
    "read_checkpoint": "readers",
    "read_safetensors_header": "readers",
    "read_torch_file": "torch_pickle",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"specjax.converters.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'specjax.converters' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + __all__)


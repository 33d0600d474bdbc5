"""specjax: speculative decoding for JAX (a port of vLLM v1's spec_decode module).

``__all__`` is what a user starts from: checkpoints, proposers, decoding and the serving
step. Everything loads lazily; the library logs through logger ``"specjax"`` and only the
CLI prints.
"""

import logging as _logging

__version__ = "0.1.0.dev0"

_logging.getLogger(__name__).addHandler(_logging.NullHandler())

#: public name -> (module, attribute), imported on first use
_LAZY = {
    # checkpoints
    "load_pretrained": ("specjax.converters", "load_pretrained"),
    "load_demo_model": ("specjax.demo_models", "load"),
    "Pretrained": ("specjax.models", "Pretrained"),
    "ByteTokenizer": ("specjax.tokenizer", "ByteTokenizer"),
    "load_tokenizer": ("specjax.hf", "load_tokenizer"),
    "load_generation_config": ("specjax.hf", "load_generation_config"),
    # proposers
    "SpeculativeConfig": ("specjax.config", "SpeculativeConfig"),
    "TokenTree": ("specjax.token_tree", "TokenTree"),
    "make_proposer": ("specjax.proposers", "make_proposer"),
    "register_speculative_method": ("specjax.method_registry", "register_speculative_method"),
    "Feed": ("specjax.proposers", "Feed"),
    # decoding
    "generate": ("specjax.engine", "generate"),
    "Engine": ("specjax.engine", "Engine"),
    "LoopOptions": ("specjax.engine", "LoopOptions"),
    "SamplingParams": ("specjax.engine", "SamplingParams"),
    "TargetModel": ("specjax.engine", "TargetModel"),
    "Target": ("specjax.target", "Target"),
    # the serving step (docs/integration.md)
    "make_step": ("specjax.runtime.step", "make_step"),
    "Step": ("specjax.runtime.step", "Step"),
    "StepBatch": ("specjax.runtime.step", "StepBatch"),
    "StepOutput": ("specjax.runtime.step", "StepOutput"),
    "build_batch": ("specjax.runtime.batch", "build_batch"),
    "make_verify_step": ("specjax.runtime.verify", "make_verify_step"),
    "VerifyStep": ("specjax.runtime.verify", "VerifyStep"),
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name):
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'specjax' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))

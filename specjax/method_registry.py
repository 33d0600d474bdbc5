"""Speculative method names: specjax's built-in ones and the user's, registered with
:func:`register_speculative_method` (vLLM 0.34's plugin registry, which replaced
``custom_class``). ``SpeculativeConfig`` accepts a registered name and checks its
``speculator_options`` with the method's config class; ``make_proposer`` builds it with its
proposer. A leaf module: it imports no proposer (docs/vllm_config.md, "User-defined methods").
"""

from __future__ import annotations

import dataclasses
import importlib
import re
from typing import Any, Callable

from specjax.checks import ArgumentError, ArgumentTypeError, show

MODEL_FREE_METHODS = ("ngram", "ngram_gpu", "suffix")
HEAD_METHODS = ("eagle", "eagle3", "dflash", "dspark", "medusa", "mtp", "extract_hidden_states")
METHODS = MODEL_FREE_METHODS + HEAD_METHODS + ("draft_model",)
#: Methods vLLM accepts that specjax does not implement.
UNSUPPORTED_METHODS = ("mlp_speculator",)

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*\Z")


@dataclasses.dataclass(frozen=True)
class CustomMethod:
    """A registered method. ``proposer``: a ``Proposer`` subclass or a function returning a
    ``Proposer``, called ``proposer(config, **offered)`` with the ``make_proposer`` arguments
    its signature names; ``config_class``: None or a callable called
    ``config_class(**speculator_options)`` that checks them and returns a hashable value.
    Either may be a ``"module:attr"`` / ``"module.attr"`` name, imported on first use."""

    name: str
    proposer: Any
    config_class: Any = None

    def resolved_proposer(self) -> Callable[..., Any]:
        return _resolve(self.proposer, f"the proposer of method {self.name!r}")

    def resolved_config_class(self) -> Callable[..., Any] | None:
        if self.config_class is None:
            return None
        return _resolve(self.config_class, f"the config class of method {self.name!r}")


_REGISTRY: dict[str, CustomMethod] = {}


def _resolve(obj: Any, what: str) -> Callable[..., Any]:
    if not isinstance(obj, str):
        return obj
    module, sep, attr = obj.partition(":")
    if not sep:
        module, _, attr = obj.rpartition(".")
    try:
        out = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError, ValueError) as e:
        raise ImportError(f"{what}, {obj!r}, cannot be imported: {e}") from None
    if not callable(out):
        raise ArgumentTypeError(f"{what}, {obj!r}, is not callable: {show(out)}")
    return out


def register_speculative_method(name: str, proposer: Any, config_class: Any = None) -> None:
    """Register ``name`` as a speculative method built by ``proposer`` (see
    :class:`CustomMethod`), so that ``SpeculativeConfig(method=name, ...)``,
    ``make_proposer`` and ``generate`` use it. ValueError for a built-in name (vLLM's or
    specjax's), a ``*_mtp`` alias or a name already registered."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise ArgumentTypeError(f"name must be a method name str (letters, digits, '_', '.', "
                                f"'-'; not starting with a digit), got {show(name)}")
    if name in METHODS or name in UNSUPPORTED_METHODS or name.endswith("_mtp") \
            or name == "custom_class":
        raise ArgumentError(f"method {name!r} is built in: register the method under another "
                            f"name (built-in methods: {list(METHODS + UNSUPPORTED_METHODS)}, "
                            "and every '*_mtp' alias)")
    if name in _REGISTRY:
        raise ArgumentError(f"method {name!r} is already registered (registered methods: "
                            f"{registered_methods()}); unregister_speculative_method({name!r}) "
                            "first to replace it")
    for what, obj, optional in (("proposer", proposer, False),
                                ("config_class", config_class, True)):
        if optional and obj is None:
            continue
        if not (isinstance(obj, str) or callable(obj)):
            raise ArgumentTypeError(f"{what} must be a class, a function or its 'module:attr' "
                                    f"name, got {show(obj)}")
    _REGISTRY[name] = CustomMethod(name, proposer, config_class)


def unregister_speculative_method(name: str) -> None:
    """Remove a registered method (ValueError if ``name`` is not one)."""
    if name not in _REGISTRY:
        raise ArgumentError(f"method {show(name)} is not registered; registered methods: "
                            f"{registered_methods()}")
    del _REGISTRY[name]


def registered_methods() -> list[str]:
    """The user-registered method names, sorted."""
    return sorted(_REGISTRY)


def custom_method(name: Any) -> CustomMethod | None:
    """The registration of ``name``, or None (built-in or unknown)."""
    return _REGISTRY.get(name) if isinstance(name, str) else None


def unknown_method_message(method: Any) -> str:
    """vLLM 0.34's refusal of an unknown method, listing built-in and registered names."""
    return (f"Unknown speculative method {show(method)}. Built-in methods: {list(METHODS)}; "
            f"registered custom methods: {registered_methods()} "
            "(specjax.register_speculative_method adds one)")

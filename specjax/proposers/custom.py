"""Methods registered with ``specjax.register_speculative_method``: ``make_proposer`` calls
the method's proposer with the arguments its signature names and checks that the result
keeps the ``Proposer`` / ``Feed`` contract (docs/integration.md, docs/vllm_config.md)."""

from __future__ import annotations

import inspect
from typing import Any, Sequence

from specjax.checks import ArgumentTypeError, check_int_sequence
from specjax.config import SpeculativeConfig
from specjax.method_registry import CustomMethod
from specjax.proposers.factory import _from_pretrained, check_sizes
from specjax.proposers.interface import Proposer
from specjax.proposers.types import Feed

#: ``make_proposer`` arguments a registered proposer may take; the models are refused when
#: given to one that does not, the settings simply not passed.
_MODELS = ("target", "target_params", "draft", "draft_params", "aux_layer_ids")


def make_custom_proposer(entry: CustomMethod, config: SpeculativeConfig, *, target: Any = None,
                         target_params: Any = None, draft: Any = None, draft_params: Any = None,
                         block_size: int = 16, max_model_len: int | None = None,
                         aux_layer_ids: Sequence[int] | None = None, kernel_backend: str = "auto",
                         **options: Any) -> Proposer:
    """``make_proposer`` for the registered method ``entry``: the arguments checked as for a
    built-in method, then ``proposer(config, **the ones it names, **options)``."""
    max_model_len, block_size = check_sizes(config, max_model_len, block_size, kernel_backend)
    if aux_layer_ids is not None:
        aux_layer_ids = check_int_sequence("aux_layer_ids", aux_layer_ids, 0, 1 << 16, min_len=1)
    target, target_params = _from_pretrained("target", target, target_params)
    draft, draft_params = _from_pretrained("draft", draft, draft_params)
    build = entry.resolved_proposer()
    try:
        sig = inspect.signature(build)
    except (TypeError, ValueError):
        sig = None
    params = {} if sig is None else sig.parameters
    any_kw = sig is None or any(p.kind is p.VAR_KEYWORD for p in params.values())
    names = {n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    offered = dict(target=target, target_params=target_params, draft=draft,
                   draft_params=draft_params, aux_layer_ids=aux_layer_ids,
                   max_model_len=max_model_len, block_size=block_size,
                   kernel_backend=kernel_backend)
    where = f"method={config.method!r} (registered, built by {getattr(build, '__name__', build)})"
    refused = [k for k in _MODELS if offered[k] is not None and not (any_kw or k in names)]
    unknown = sorted(k for k in options if not (any_kw or k in names))
    if refused or unknown:
        raise ValueError(f"{where} takes no {', '.join(f'{k}=' for k in refused + unknown)}; "
                         f"it takes: {sorted(names - {'config'})}")
    kwargs = {k: v for k, v in offered.items() if any_kw or k in names}
    kwargs.update(options)
    prop = build(config, **kwargs)
    if not isinstance(prop, Proposer):
        raise ArgumentTypeError(f"{where} returned {type(prop).__name__}, not a "
                                "specjax.proposers.Proposer")
    feed = prop.feed
    if not isinstance(feed, Feed):
        raise ArgumentTypeError(f"{where}: its feed is {type(feed).__name__}, not a "
                                "specjax.proposers.Feed")
    if getattr(prop, "config", None) != config:
        raise ValueError(f"{where}: the proposer's config must be the SpeculativeConfig it was "
                         "built from (set self.config = config)")
    if feed.num_speculative_tokens != config.num_speculative_tokens:
        raise ValueError(f"{where}: feed.num_speculative_tokens={feed.num_speculative_tokens} "
                         f"differs from config.num_speculative_tokens="
                         f"{config.num_speculative_tokens}")
    return prop

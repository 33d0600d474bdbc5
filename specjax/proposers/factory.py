"""``make_proposer``: the method -> builder table (model methods: module and class, loaded
lazily so ``import specjax.proposers`` pulls in neither numba nor the models; token-history
methods: their adapters) and ``available_methods``."""

from __future__ import annotations

import importlib
from typing import Any, Sequence

from specjax.config import SpeculativeConfig
from specjax.proposers.interface import ModelProposer, Proposer

#: Module of each model-based method under ``specjax.proposers``, its proposer class, and
#: whether that class takes ``mesh`` / ``vocab_axis`` (``specjax.sharding.tensor_parallel``:
#: vocabulary-parallel argmax) or only has its params placed on a mesh.
_MODEL_METHODS = {
    "eagle": ("eagle", "EagleProposer", True),
    "eagle3": ("eagle", "EagleProposer", True),
    "dflash": ("dflash", "DFlashProposer", True),
    "medusa": ("medusa", "MedusaProposer", False),
    "draft_model": ("draft_model", "DraftModelProposer", True),
    "extract_hidden_states": ("extract_hidden_states", "ExtractHiddenStatesProposer", False),
}



def _ngram(config: SpeculativeConfig, *, max_model_len: int) -> Proposer:
    from specjax.proposers.ngram_cpu import NgramProposerAdapter

    return NgramProposerAdapter(config, max_model_len=max_model_len)


def _ngram_gpu(config: SpeculativeConfig, *, max_model_len: int) -> Proposer:
    from specjax.proposers.ngram_gpu import NgramGPUProposerAdapter

    return NgramGPUProposerAdapter(config, max_model_len=max_model_len)


def _suffix(config: SpeculativeConfig, *, max_model_len: int) -> Proposer:
    from specjax.proposers.suffix import SuffixProposerAdapter

    return SuffixProposerAdapter(config, max_model_len=max_model_len)


#: The token-history methods and their builders (each imports its module when called).
_HISTORY_METHODS = {"ngram": _ngram, "ngram_gpu": _ngram_gpu, "suffix": _suffix}


def available_methods() -> tuple[str, ...]:
    """Methods ``make_proposer`` can build in this install (the proposer module exists
    and its optional dependency imports: arctic-inference for ``suffix``)."""
    out = []
    for m in ("ngram", "ngram_gpu", "suffix", "eagle", "eagle3", "draft_model", "dflash",
              "medusa", "extract_hidden_states"):
        try:
            if m == "suffix":
                importlib.import_module("arctic_inference.suffix_decoding")
            elif m in _MODEL_METHODS:
                mod, cls, _ = _MODEL_METHODS[m]
                getattr(importlib.import_module(f"specjax.proposers.{mod}"), cls)
        except (ImportError, AttributeError):
            continue
        out.append(m)
    return tuple(out)


def _load_impl_class(method: str):
    mod, cls, _ = _MODEL_METHODS[method]
    try:
        module = importlib.import_module(f"specjax.proposers.{mod}")
    except ModuleNotFoundError as err:
        if err.name != f"specjax.proposers.{mod}":
            raise
        raise NotImplementedError(
            f"method={method!r} is not implemented in this specjax yet: its proposer module "
            f"specjax.proposers.{mod} does not exist") from None
    try:
        return getattr(module, cls)
    except AttributeError:
        raise NotImplementedError(
            f"method={method!r} is not implemented in this specjax yet: "
            f"specjax.proposers.{mod} has no {cls}") from None


def make_proposer(config: SpeculativeConfig, *, target: Any = None, target_params: dict | None = None,
                  draft: Any = None, draft_params: dict | None = None, block_size: int = 16,
                  max_model_len: int | None = None, aux_layer_ids: Sequence[int] | None = None,
                  kernel_backend: str = "auto", **options: Any) -> Proposer:
    """Build the proposer of ``config.method``.

    Args:
      config: the ``SpeculativeConfig`` (method, k, n-gram / suffix / tree options).
      target: the target runner (``specjax.models.DecoderLM``); used to check the draft's
        vocabulary and for the EAGLE-3 default aux layers.
      target_params: the target's params; heads without their own embedding / lm_head
        get the target's (``share_target_weights``, as vLLM shares them).
      draft: the draft runner (``EagleHead``, ``Eagle3Head``, ``DFlashHead``,
        ``MedusaHeads``, a ``DecoderLM`` for ``draft_model``) or its ``ModelConfig``;
        model-free methods take none.
      draft_params: the draft's params dict.
      block_size: KV-cache block size the loop uses (draft caches share the target's
        block table).
      max_model_len: context cap (default ``config.max_model_len``; required).
      aux_layer_ids: target layers whose inputs the method reads (EAGLE-3, DFlash,
        extract-hidden-states); default from the draft's config.
      kernel_backend: backend of the index kernels (``"auto"``, ``"xla"``, ``"pallas"``,
        ``"triton"``).
      options: further fields of the method's proposer class, passed through (e.g.
        ``parallel_drafting_token_id=`` for ``eagle``, ``eagle3`` and ``draft_model``;
        ``target_tensor_parallel_size=`` for ``draft_model``; ``mesh=`` / ``vocab_axis=``
        for ``eagle``, ``eagle3``, ``dflash`` and ``draft_model``, the vocab-sharded mesh
        ``config.use_local_argmax_reduction`` reduces over); a field the class lacks is a
        ValueError. With ``config.parallel_drafting`` and no
        ``parallel_drafting_token_id=``, the draft config's ``mask_token_id`` is used when
        set (``specjax.load_pretrained`` fills it from the checkpoint config's
        ``pard_token`` / ``ptd_token_id``, as vLLM reads the draft HF config).

    Raises:
      ValueError: bad arguments (missing draft, vocabulary mismatch, ...), before anything
        is built. NotImplementedError: the method's proposer module does not exist yet.
    """
    if not isinstance(config, SpeculativeConfig):
        raise ValueError(f"config must be a SpeculativeConfig, got {type(config).__name__}")
    if max_model_len is None:
        max_model_len = config.max_model_len
    if isinstance(max_model_len, bool) or not isinstance(max_model_len, int) or max_model_len < 2:
        raise ValueError(f"max_model_len must be an int >= 2 (argument or config.max_model_len), "
                         f"got {max_model_len!r}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    method = config.method
    if options and method in ("ngram", "ngram_gpu", "suffix"):
        raise ValueError(f"method={method!r} takes no extra options, got {sorted(options)} (its "
                         "settings live in the SpeculativeConfig)")
    if method in _HISTORY_METHODS:
        return _HISTORY_METHODS[method](config, max_model_len=max_model_len)
    if method not in _MODEL_METHODS:
        raise ValueError(f"method={method!r} has no proposer; known: {sorted(_MODEL_METHODS)}")
    cls = _load_impl_class(method)
    return _make_model_proposer(cls, config, target=target, target_params=target_params,
                                draft=draft, draft_params=draft_params, block_size=block_size,
                                max_model_len=max_model_len, aux_layer_ids=aux_layer_ids,
                                kernel_backend=kernel_backend, options=options)


def _make_model_proposer(cls, config, *, target, target_params, draft, draft_params, block_size,
                         max_model_len, aux_layer_ids, kernel_backend, options) -> ModelProposer:
    import dataclasses

    from specjax.models import ModelConfig, registry, share_target_weights
    from specjax.models.config import eagle3_default_aux_layer_ids

    method = config.method
    target_cfg = getattr(target, "config", None)
    if method == "extract_hidden_states":
        from specjax.models import ExtractHiddenStates

        if draft is None:
            if aux_layer_ids is None or target_cfg is None:
                raise ValueError("method='extract_hidden_states' needs aux_layer_ids= (the target "
                                 "layers whose inputs it stores) and target= (for the hidden size), "
                                 "or draft= an ExtractHiddenStates model")
            draft = ExtractHiddenStates(num_hidden_states=len(tuple(aux_layer_ids)),
                                        hidden_size=target_cfg.hidden_size)
        elif aux_layer_ids is None:
            raise ValueError("method='extract_hidden_states' needs aux_layer_ids= (the target layers "
                             "whose inputs it stores)")
        model, dcfg, params = draft, None, ({} if draft_params is None else draft_params)
    else:
        if draft is None:
            raise ValueError(f"method={method!r} needs draft= (the draft runner or its ModelConfig)")
        if draft_params is None:
            raise ValueError(f"method={method!r} needs draft_params= (the draft's params dict)")
        model = registry.make_model(draft.kind, draft) if isinstance(draft, ModelConfig) else draft
        dcfg = getattr(model, "config", None)
        params = draft_params
        if target_params is not None and method in ("eagle", "eagle3", "dflash"):
            params = share_target_weights(params, target_params, kind=method)
    vocab = getattr(dcfg, "vocab_size", None)
    if target_cfg is not None and vocab is not None and vocab != target_cfg.vocab_size:
        raise ValueError(f"method={method!r}: the draft's vocabulary ({vocab}) does not match the "
                         f"target's ({target_cfg.vocab_size})")
    if aux_layer_ids is None:
        aux_layer_ids = getattr(dcfg, "aux_layer_ids", None)
        if aux_layer_ids is None and method == "eagle3" and target_cfg is not None:
            aux_layer_ids = eagle3_default_aux_layer_ids(target_cfg.num_hidden_layers)
    # Each proposer takes the subset of these its dataclass declares.
    offered = dict(block_size=block_size, max_model_len=max_model_len, kernel_backend=kernel_backend,
                   target_vocab_size=(target_cfg.vocab_size if target_cfg is not None else vocab))
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(options) - names - {"config", "model"})
    if unknown:
        raise ValueError(f"method={method!r}: {cls.__name__} has no option(s) {unknown}; "
                         f"its fields: {sorted(names - {'config', 'model'})}")
    if config.parallel_drafting and "parallel_drafting_token_id" in names:
        mask = getattr(dcfg, "mask_token_id", -1)   # pard_token / ptd_token_id of the checkpoint
        offered["parallel_drafting_token_id"] = mask if isinstance(mask, int) and mask >= 0 else None
    kwargs = {k: v for k, v in offered.items() if k in names and v is not None}
    kwargs.update(options)
    impl = cls(config, model, **kwargs)
    return ModelProposer(config, impl, params, vocab_size=vocab, aux_layer_ids=aux_layer_ids or (),
                         mesh_fields=_MODEL_METHODS[method][2])

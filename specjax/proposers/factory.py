"""``make_proposer`` (from a ``SpeculativeConfig`` or a vLLM ``speculative_config`` dict)
and ``available_methods``; each builder of :data:`BUILDERS` imports its proposer module
when called, so ``import specjax.proposers`` pulls in neither numba nor the models."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Mapping, Sequence

from specjax.checks import (ArgumentTypeError, check_choice, check_int, check_int_sequence,
                            show)
from specjax.config import SpeculativeConfig
from specjax.proposers.interface import ModelProposer, Proposer

logger = logging.getLogger(__name__)

KERNEL_BACKENDS = ("auto", "xla", "pallas", "triton")


def _ngram(config: SpeculativeConfig, *, max_model_len: int) -> Proposer:
    from specjax.proposers.ngram_cpu import NgramProposerAdapter

    return NgramProposerAdapter(config, max_model_len=max_model_len)


def _ngram_gpu(config: SpeculativeConfig, *, max_model_len: int) -> Proposer:
    from specjax.proposers.ngram_gpu import NgramGPUProposerAdapter

    return NgramGPUProposerAdapter(config, max_model_len=max_model_len)


def _suffix(config: SpeculativeConfig, *, max_model_len: int) -> Proposer:
    if config.suffix_backend == "arctic":
        from specjax.proposers.suffix import SuffixProposerAdapter

        return SuffixProposerAdapter(config, max_model_len=max_model_len)
    from specjax.proposers.suffix_gpu import SuffixGPUProposerAdapter

    return SuffixGPUProposerAdapter(config, max_model_len=max_model_len)


#: The token-history methods and their builders (each imports its module when called).
_HISTORY_METHODS = {"ngram": _ngram, "ngram_gpu": _ngram_gpu, "suffix": _suffix}


def _eagle_cls():
    from specjax.proposers.eagle import EagleProposer

    return EagleProposer


def _dflash_cls():
    from specjax.proposers.dflash import DFlashProposer

    return DFlashProposer


def _dspark_cls():
    from specjax.proposers.dspark import DSparkProposer

    return DSparkProposer


def _medusa_cls():
    from specjax.proposers.medusa import MedusaProposer

    return MedusaProposer


def _draft_model_cls():
    from specjax.proposers.draft_model import DraftModelProposer

    return DraftModelProposer


def _extract_cls():
    from specjax.proposers.extract_hidden_states import ExtractHiddenStatesProposer

    return ExtractHiddenStatesProposer


@dataclasses.dataclass(frozen=True)
class ModelBuilder:
    """A model-based method: its proposer class (imported when called) and whether it takes
    ``mesh`` / ``vocab_axis``."""

    proposer_class: Callable[[], type]
    mesh_fields: bool


#: The model-based methods.
_MODEL_METHODS: dict[str, ModelBuilder] = {
    "eagle": ModelBuilder(_eagle_cls, True),
    "eagle3": ModelBuilder(_eagle_cls, True),
    "dflash": ModelBuilder(_dflash_cls, True),
    "dspark": ModelBuilder(_dspark_cls, True),
    "medusa": ModelBuilder(_medusa_cls, False),
    "mtp": ModelBuilder(_eagle_cls, True),
    "draft_model": ModelBuilder(_draft_model_cls, True),
    "extract_hidden_states": ModelBuilder(_extract_cls, False),
}

#: Every method -> its builder: a token-history builder ``(config, max_model_len=)`` or a
#: :class:`ModelBuilder`.
BUILDERS: dict[str, Any] = {**_HISTORY_METHODS, **_MODEL_METHODS}


def available_methods() -> tuple[str, ...]:
    """Methods ``make_proposer`` can build in this install (the proposer module imports,
    ``suffix`` on the device whether or not arctic-inference imports), then those registered with
    ``specjax.register_speculative_method``."""
    from specjax.method_registry import registered_methods

    out = []
    for m, b in BUILDERS.items():
        try:
            if isinstance(b, ModelBuilder):
                b.proposer_class()
        except ImportError:
            continue
        out.append(m)
    return tuple(out) + tuple(registered_methods())



def check_sizes(config: SpeculativeConfig, max_model_len: Any, block_size: Any,
                kernel_backend: Any) -> tuple[int, int]:
    """``(max_model_len, block_size)`` of ``make_proposer`` checked (None: the config's
    ``max_model_len``), and ``kernel_backend``; ValueError / TypeError naming the argument."""
    if max_model_len is None:
        max_model_len = config.max_model_len
    if max_model_len is None:
        raise ValueError("max_model_len is required (the argument or config.max_model_len), "
                         "an int >= 2")
    max_model_len = check_int("max_model_len", max_model_len, 2)
    if config.max_model_len is not None and config.max_model_len > max_model_len:
        # vLLM's _maybe_override_draft_max_model_len: the drafter's limit cannot pass the target's
        raise ValueError(f"config.max_model_len={config.max_model_len} (the drafter's context "
                         f"limit) cannot be larger than max_model_len={max_model_len} (the "
                         f"target's); allowed: 1 .. {max_model_len}")
    block_size = check_int("block_size", block_size, 1, 1 << 16)
    check_choice("kernel_backend", kernel_backend, KERNEL_BACKENDS)
    return max_model_len, block_size


def make_proposer(config: SpeculativeConfig | Mapping[str, Any], *, target: Any = None,
                  target_params: dict | None = None, draft: Any = None,
                  draft_params: dict | None = None, block_size: int = 16,
                  max_model_len: int | None = None, aux_layer_ids: Sequence[int] | None = None,
                  kernel_backend: str = "auto", **options: Any) -> Proposer:
    """Build the proposer of ``config.method``.

    Args:
      config: a ``SpeculativeConfig``, or a vLLM ``speculative_config`` dict whose ``model``
        directory is loaded when ``draft=`` is not given (both together: ``ValueError``).
      target, target_params: the target (a ``specjax.Target``, e.g. a ``DecoderLM`` runner,
        or a ``Pretrained``) and its params; ``target.shared_weights(target_params)`` go into
        heads without their own embedding / lm_head.
      draft, draft_params: the draft runner, ``ModelConfig`` or ``Pretrained``, and its
        params; none for model-free methods. ``method="draft_model"``: any ``specjax.Target``
        (its own KV layout; recurrent ones refused).
      block_size: the loop's KV-cache block size.
      max_model_len: the loop's context cap (default ``config.max_model_len``); a smaller
        ``config.max_model_len`` is the drafter's limit, a larger one is refused.
      aux_layer_ids: target layers the method reads (default: the draft config's).
      kernel_backend: ``"auto"``, ``"xla"``, ``"pallas"`` or ``"triton"``.
      options: further fields of the method's proposer class (``parallel_drafting_token_id``
        (default: the draft config's ``mask_token_id``), ``mesh``, ``vocab_axis``,
        ``attention`` (draft_model: the draft ``DecoderLM``'s attention kernel), ...); an
        unknown field is a ``ValueError``.

    Raises:
      ValueError: bad arguments, before anything is built. NotImplementedError: a method
        without a proposer module.
    """
    if isinstance(config, Mapping):
        config = SpeculativeConfig.from_vllm(config)
    if not isinstance(config, SpeculativeConfig):
        raise ArgumentTypeError(f"config must be a SpeculativeConfig or a vLLM speculative_config "
                                f"dict, got {show(config)} of type {type(config).__name__}")
    max_model_len, block_size = check_sizes(config, max_model_len, block_size, kernel_backend)
    if aux_layer_ids is not None:
        aux_layer_ids = check_int_sequence("aux_layer_ids", aux_layer_ids, 0, 1 << 16, min_len=1)
    method = config.method
    if options and method in _HISTORY_METHODS:
        raise ValueError(f"method={method!r} takes no extra options, got {sorted(options)} (its "
                         "settings live in the SpeculativeConfig)")
    target, target_params = _from_pretrained("target", target, target_params)
    draft, draft_params = _from_pretrained("draft", draft, draft_params)
    from specjax.models import DecoderLM

    for name, model, v in (("target_params", target, target_params),
                           ("draft_params", draft, draft_params)):
        own = model is None or isinstance(model, (DecoderLM, str))   # a foreign Target: any pytree
        if v is not None and own and not isinstance(v, Mapping):
            raise ArgumentTypeError(f"{name} must be a params dict, got {type(v).__name__}")
    builder = _MODEL_METHODS.get(method) or _HISTORY_METHODS.get(method)
    if builder is None:
        raise ValueError(f"method={method!r} has no proposer; known: {sorted(BUILDERS)}")
    if not isinstance(builder, ModelBuilder):
        return builder(config, max_model_len=max_model_len)
    _proposer_class(builder, method)      # NotImplementedError first when its module is absent
    if method != "extract_hidden_states":
        draft, draft_params = _draft_from_model(config, draft, draft_params)
    prop = _make_model_proposer(builder, config, target=target, target_params=target_params,
                                draft=draft, draft_params=draft_params, block_size=block_size,
                                max_model_len=max_model_len, aux_layer_ids=aux_layer_ids,
                                kernel_backend=kernel_backend, options=options)
    if config.history_first is None:
        return prop
    from specjax.proposers.history_first import HistoryFirstProposer, first_stage_config

    first = make_proposer(first_stage_config(config), max_model_len=max_model_len)
    return HistoryFirstProposer(prop, first)


def _from_pretrained(name: str, model: Any, params: Any) -> tuple[Any, Any]:
    """``(runner or config, params)`` of a ``target=`` / ``draft=`` that may be a
    ``Pretrained``; a Pretrained with ``*_params=`` too is refused."""
    from specjax.models import Pretrained
    from specjax.models.config import DECODER_KINDS

    if not isinstance(model, Pretrained):
        return model, params
    if params is not None:
        raise ValueError(f"{name}= is a Pretrained checkpoint (it carries its params) and "
                         f"{name}_params= is given too: pass one of them")
    if name == "target":
        if model.kind not in DECODER_KINDS:
            raise ValueError(f"target= is a {model.kind!r} checkpoint, not a decoder LM (one of "
                             f"{sorted(DECODER_KINDS)})")
        return model.model, model.params
    return model.config, model.params


def _proposer_class(builder: ModelBuilder, method: str) -> type:
    try:
        return builder.proposer_class()
    except ModuleNotFoundError as err:
        if not (err.name or "").startswith("specjax.proposers"):
            raise
        raise NotImplementedError(f"method={method!r} is not implemented in this specjax: its "
                                  f"proposer module {err.name} does not exist") from None


def _draft_from_model(config: SpeculativeConfig, draft: Any, draft_params: Any) -> tuple[Any, Any]:
    """``(draft, draft_params)``: the caller's, or loaded from ``config.model`` when that
    names a directory and the caller gave no ``draft=``."""
    model_dir = config.model is not None and Path(config.model).is_dir()
    if draft is not None:
        if model_dir:
            raise ValueError(f"both draft= and config.model={show(config.model)} (a checkpoint "
                             "directory) are given: pass one of them")
        return draft, draft_params
    if config.model is None or not model_dir:
        if config.model is not None and ("/" in config.model or Path(config.model).suffix):
            raise FileNotFoundError(f"config.model={show(config.model)}: no such checkpoint "
                                    "directory (hub names are not downloaded: pass a local path)")
        if config.method == "mtp":
            raise ValueError("method='mtp' needs draft= (the MTPHead or its ModelConfig) or "
                             "config.model naming the MiMo checkpoint directory (vLLM uses the "
                             "target's own directory when model is None: set model to it)")
        raise ValueError(f"method={config.method!r} needs draft= (the draft runner or its "
                         "ModelConfig) or config.model naming a checkpoint directory")
    if draft_params is not None:
        raise ValueError("draft_params= without draft=: config.model's own params are loaded")
    from specjax.hf import load_draft

    return load_draft(config.model, config.method)


def _make_model_proposer(builder: ModelBuilder, config, *, target, target_params, draft,
                         draft_params, block_size, max_model_len, aux_layer_ids, kernel_backend,
                         options) -> ModelProposer:
    from specjax.models import ModelConfig, registry, share_target_weights
    from specjax.models.config import eagle3_default_aux_layer_ids
    from specjax.target import check_target

    method = config.method
    cls = _proposer_class(builder, method)
    target_cfg = None
    if target is not None:
        check_target(target)
        # what the checks below read of the target, from the protocol (not its config)
        target_cfg = SimpleNamespace(vocab_size=int(target.vocab_size),
                                     hidden_size=int(target.hidden_size),
                                     num_hidden_layers=int(target.num_layers))
        if target_params is not None:
            target_params = target.shared_weights(target_params)
            _check_shared_entries(target_cfg, target_params)
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
        if isinstance(dcfg, ModelConfig):
            registry.check_params(dcfg.kind, dcfg, draft_params, name="draft_params",
                                  shared_ok=target_params is not None)
            _check_head_fits_target(method, dcfg, target_cfg)
            if method == "mtp":
                _check_mtp_k(config.num_speculative_tokens, dcfg.n_predict)
        params = draft_params
        if target_params is not None and method in ("eagle", "eagle3", "dflash", "dspark", "mtp"):
            params = share_target_weights(params, target_params, kind=method)
    vocab = getattr(dcfg, "vocab_size", None)
    if vocab is None and method == "draft_model" and hasattr(model, "vocab_size"):
        vocab = int(model.vocab_size)       # a draft that is a specjax.Target without config
    if target_cfg is not None and vocab is not None and vocab != target_cfg.vocab_size:
        raise ValueError(f"method={method!r}: the draft's vocabulary ({vocab}) does not match the "
                         f"target's ({target_cfg.vocab_size})")
    source = "aux_layer_ids"
    if aux_layer_ids is None:
        aux_layer_ids = getattr(dcfg, "aux_layer_ids", None)
        source = "the draft config's aux_layer_ids"
        if aux_layer_ids is None and method == "eagle3" and target_cfg is not None:
            aux_layer_ids = eagle3_default_aux_layer_ids(target_cfg.num_hidden_layers)
            source = "the EAGLE-3 default aux_layer_ids (2, L // 2, L - 3)"
    if aux_layer_ids is not None and method in ("eagle3", "dflash", "dspark", "extract_hidden_states"):
        _check_aux_layer_ids(method, tuple(int(i) for i in aux_layer_ids), source, dcfg, target_cfg)
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
                         mesh_fields=builder.mesh_fields)


def _check_aux_layer_ids(method: str, ids: tuple[int, ...], source: str, dcfg, target_cfg) -> None:
    """Aux layer ids must be strictly increasing target layers in ``[0, num_hidden_layers)``,
    as many as the head's ``fc`` reads."""
    if target_cfg is not None:
        n = target_cfg.num_hidden_layers
        if not ids or any(not 0 <= i < n for i in ids) or list(ids) != sorted(set(ids)):
            raise ValueError(f"method={method!r}: {source} = {show(list(ids))} must be strictly "
                             f"increasing target layer ids in [0, {n - 1}] (the target has "
                             f"num_hidden_layers={n}; id k reads the input of layer k)")
    want = getattr(dcfg, "num_aux", None) if method in ("eagle3", "dflash", "dspark") else None
    if isinstance(want, int) and len(ids) != want:
        raise ValueError(f"method={method!r}: {source} has {len(ids)} ids; the head's fc reads "
                         f"{want} aux states: give {want} ids")


#: The ``ModelConfig.kind`` values each model-based method accepts as its draft.
_DRAFT_KINDS = {"eagle": ("eagle",), "eagle3": ("eagle3",), "dflash": ("dflash",),
                "dspark": ("dspark",), "medusa": ("medusa",), "mtp": ("mtp",),
                "draft_model": ("llama", "qwen2", "qwen3", "mistral", "ministral", "gemma3",
                                "qwen3_moe", "gpt_oss")}


def _check_mtp_k(k: int, n_predict: int) -> None:
    """vLLM's MTP rule on k: above the checkpoint's ``n_predict`` it must be a multiple of it."""
    n = max(int(n_predict), 1)
    if k > n and k % n:
        raise ValueError(f"num_speculative_tokens:{k} must be divisible by n_predict={n} (the MTP "
                         "checkpoint's num_nextn_predict_layers), vLLM's rule for method='mtp'")
    if k > 1:
        logger.warning("Enabling num_speculative_tokens > 1 will run multiple times of forward on "
                       "same MTP layer, which may result in lower acceptance rate")


def _check_shared_entries(target_cfg, target_params) -> None:
    """The target entries a head may share (``embed_tokens`` ``[V, H]``, ``lm_head``
    ``[H, V]``) have the target config's shapes (the rest is checked by the engine)."""
    v, h = target_cfg.vocab_size, target_cfg.hidden_size
    emb = target_params.get("embed_tokens", {})
    head = target_params.get("lm_head") or {}
    for what, arr, want in (("embed_tokens.embedding", emb.get("embedding"), (v, h)),
                            ("lm_head.kernel", head.get("kernel"), (h, v))):
        if arr is not None and tuple(getattr(arr, "shape", ())) != want:
            raise ValueError(f"target_params do not match the target's config: {what} has shape "
                             f"{tuple(getattr(arr, 'shape', ()))}, expected {want}")


def _check_head_fits_target(method: str, dcfg, target_cfg) -> None:
    """The draft's kind fits the method and its input width matches the target's hidden size."""
    kinds = _DRAFT_KINDS.get(method)
    if kinds is not None and dcfg.kind not in kinds:
        raise ValueError(f"method={method!r} needs a draft of kind {' / '.join(kinds)}, got a "
                         f"{dcfg.kind!r} model (is config.method right?)")
    if target_cfg is None:
        return
    th = target_cfg.hidden_size
    if method in ("eagle", "medusa", "mtp") and dcfg.hidden_size != th:
        raise ValueError(f"method={method!r}: the draft's hidden_size ({dcfg.hidden_size}) "
                         f"differs from the target's hidden_size ({th}); the head reads the "
                         "target's hidden states")
    if method in ("eagle3", "dflash", "dspark"):
        got = dcfg.target_hidden_size or dcfg.hidden_size
        if got != th:
            raise ValueError(f"method={method!r}: the head's target_hidden_size ({got}) differs "
                             f"from the target's hidden_size ({th})")
    # aux layer ids are checked against the target's layers where the target runs them
    # (DecoderLM, through make_step / generate)

"""Real checkpoints end to end, torch-free: a checkpoint directory's config, its model, its
tokenizer (``transformers.AutoTokenizer``, the ``hf`` extra), its ``generation_config.json``
stop ids, and scoring. Local directories only, nothing downloaded or executed
(``trust_remote_code`` stays False); a ``specjax-convert`` output's carried files are
checked against the sizes and sha256 its ``specjax.json`` records before they are read.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Sequence

from specjax.checks import ArgumentError, ArgumentTypeError, check_int_sequence, show

logger = logging.getLogger(__name__)

__all__ = ["checkpoint_dir", "read_checkpoint_config", "load_model", "load_draft",
           "load_generation_config", "load_tokenizer", "tokenizer_dir", "encode_prompt",
           "encode_bad_words", "score", "DRAFT_KIND_METHODS", "DRAFT_METHOD_FORMATS",
           "TOKENIZER_FILES"]

#: A directory holds a tokenizer when it has one of these (``tokenizer.json``: a fast
#: tokenizer; ``tokenizer.model``: SentencePiece; ``vocab.json``: BPE, with merges.txt;
#: ``tokenizer_config.json``: whatever else it names, left to transformers to load).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")

#: ``ModelConfig.kind`` -> the method a draft of that kind is used by.
DRAFT_KIND_METHODS = {"eagle": "eagle", "eagle3": "eagle3", "dflash": "dflash", "dspark": "dspark",
                      "medusa": "medusa", "llama": "draft_model", "qwen2": "draft_model",
                      "qwen3": "draft_model", "mistral": "draft_model",
                      "ministral": "draft_model", "gemma3": "draft_model", "mtp": "mtp",
                      "qwen3_moe": "draft_model", "gpt_oss": "draft_model"}
#: method -> the converters' format an *original* (not converted) draft directory is read
#: in, instead of auto-detection: vLLM's ``method="mtp"`` drafts from the MiMo target's own
#: directory, which auto-detects as the target (format ``mimo``).
DRAFT_METHOD_FORMATS = {"mtp": "mimo-mtp"}


def checkpoint_dir(path: Any, what: str = "checkpoint") -> Path:
    """``path`` as an existing directory holding ``config.json`` or ``specjax.json``;
    FileNotFoundError naming the path and the missing file otherwise."""
    if not isinstance(path, (str, Path)):
        raise ArgumentTypeError(f"{what} path must be a str or Path, got {show(path)}")
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"{what} directory {str(p)!r} does not exist (only local "
                                "directories are read; nothing is downloaded)")
    if not p.is_dir():
        raise NotADirectoryError(f"{what} path {str(p)!r} is a file, not a checkpoint directory")
    if not (p / "config.json").is_file() and not (p / "specjax.json").is_file():
        raise FileNotFoundError(f"{what} directory {str(p)!r} has no config.json (nor a "
                                "specjax.json of a converted checkpoint): config.json is missing")
    return p


def read_checkpoint_config(path: Any) -> dict:
    """The checkpoint's config: ``config.json``, or for a ``specjax-convert`` output its
    ``specjax.json`` (which names the ``kind``)."""
    p = checkpoint_dir(path)
    f = p / "config.json" if (p / "config.json").is_file() else p / "specjax.json"
    try:
        d = json.loads(f.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{f}: not valid JSON ({e})") from None
    if not isinstance(d, dict):
        raise ValueError(f"{f}: expected a JSON object, got {type(d).__name__}")
    if f.name == "specjax.json":
        d = {"specjax_kind": d.get("kind"), **d}
    return d


def load_model(path: Any, dtype: Any = None, *, format: str | None = None):
    """``(runner, kind, config, params)`` of the checkpoint at ``path`` (converted or
    original); ``format``: a ``specjax.converters.FORMATS`` key for an original one (None:
    auto-detected)."""
    from specjax.converters import load_pretrained
    from specjax.models import registry

    p = checkpoint_dir(path)
    kind, config, params = load_pretrained(p, dtype, format=format)
    return registry.make_model(kind, config), kind, config, params


def load_draft(path: Any, method: str, dtype: Any = None):
    """``(draft runner, draft params)`` of ``config.model``, checked to be a draft of
    ``method``'s kind (read in ``DRAFT_METHOD_FORMATS[method]`` when there is one)."""
    from specjax.converters.errors import CheckpointError

    fmt = DRAFT_METHOD_FORMATS.get(method)
    try:
        runner, kind, _, params = load_model(path, dtype, format=fmt)
    except CheckpointError as e:
        if fmt is None or (Path(path).expanduser() / "specjax.json").is_file():
            raise
        raise CheckpointError(f"config.model={show(str(path))} (read in format {fmt!r} for "
                              f"method={method!r}): {e}") from None
    want = DRAFT_KIND_METHODS.get(kind)
    if want != method:
        raise ValueError(f"config.model={show(str(path))} is a {kind!r} checkpoint (a draft for "
                         f"method={want!r}), not one for method={method!r}")
    logger.info("loaded the %s draft from %s", kind, path)
    return runner, params


def load_generation_config(path: Any) -> dict:
    """``generation_config.json`` of a checkpoint directory as ``{"eos_token_ids": [...],
    "bos_token_id", "pad_token_id", "temperature", "top_k", "top_p"}`` (absent keys
    omitted), else the same keys of its config; ``{}`` when there are none."""
    p = Path(path).expanduser()
    if not p.is_dir():
        raise FileNotFoundError(f"checkpoint directory {str(p)!r} does not exist")
    meta = _converted_metadata(p, ["generation_config.json"])
    src = p / "generation_config.json"
    if not src.is_file():
        src = p / "config.json"
        if not src.is_file():
            hf = meta.get("hf_config") if meta else None
            return _generation_fields(hf, p / "specjax.json") if isinstance(hf, dict) else {}
    try:
        d = json.loads(src.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{src}: not valid JSON ({e})") from None
    if not isinstance(d, dict):
        raise ValueError(f"{src}: expected a JSON object")
    return _generation_fields(d, src)


def _generation_fields(d: dict, src: Path) -> dict:
    out: dict[str, Any] = {}
    eos = d.get("eos_token_id")
    if eos is not None:
        ids = [eos] if not isinstance(eos, (list, tuple)) else list(eos)
        out["eos_token_ids"] = list(check_int_sequence(f"{src.name} eos_token_id", ids, 0))
    for key in ("bos_token_id", "pad_token_id", "top_k"):
        if isinstance(d.get(key), int) and not isinstance(d.get(key), bool):
            out[key] = d[key]
    for key in ("temperature", "top_p"):
        if isinstance(d.get(key), (int, float)) and not isinstance(d.get(key), bool):
            out[key] = float(d[key])
    return out


def _converted_metadata(p: Path, names=None) -> dict | None:
    """``specjax.json`` of a converted directory with its carried files among ``names``
    checked (``CorruptOutputError``); None for an original checkpoint."""
    if not (p / "specjax.json").is_file():
        return None
    from specjax.converters import store

    meta = store.read_metadata(p)
    store.verify_carried(p, meta, names)
    return meta


def tokenizer_dir(path: Any, what: str = "tokenizer", hint: str = "") -> Path:
    """``path`` as an existing directory holding one of :data:`TOKENIZER_FILES`; else
    ``FileNotFoundError`` / ``NotADirectoryError`` naming ``what``, the files and ``hint``."""
    if not isinstance(path, (str, Path)):
        raise ArgumentTypeError(f"{what} path must be a str or Path, got {show(path)}")
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"{what} {str(p)!r}: directory does not exist (only local "
                                "directories are read; nothing is downloaded)")
    if not p.is_dir():
        raise NotADirectoryError(f"{what} {str(p)!r}: a file, not a directory")
    if not any((p / f).is_file() for f in TOKENIZER_FILES):
        raise FileNotFoundError(f"{what} {str(p)!r}: no tokenizer in this directory (looked "
                                f"for {', '.join(TOKENIZER_FILES)}){hint}")
    return p


def _import_auto_tokenizer():
    """``transformers.AutoTokenizer``, imported without its "PyTorch was not found" notice
    (tokenizers need no PyTorch)."""
    lg = logging.getLogger("transformers")
    if not any(isinstance(f, _NoTorchNotice) for f in lg.filters):
        lg.addFilter(_NoTorchNotice())
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ImportError("tokenization needs transformers: pip install \"specjax[hf]\"") from None
    return AutoTokenizer


class _NoTorchNotice(logging.Filter):
    NOTICES = ("PyTorch was not found", "None of PyTorch, TensorFlow")

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.NOTICES)


def load_tokenizer(path: Any, what: str = "tokenizer"):
    """``transformers.AutoTokenizer`` of a local directory holding a tokenizer (the ``hf``
    extra; ``trust_remote_code=False``, no network). Raises ``FileNotFoundError`` without
    a tokenizer, ``CorruptOutputError`` for a changed carried file, ``ValueError`` when
    transformers cannot load it; each names ``what``."""
    p = tokenizer_dir(path, what)
    _converted_metadata(p)
    auto = _import_auto_tokenizer()
    try:
        return auto.from_pretrained(str(p), local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
        msg = " ".join(str(e).split())
        raise ValueError(f"{what} {str(p)!r}: transformers cannot load its tokenizer "
                         f"({type(e).__name__}: {msg[:300]})") from None


def encode_prompt(tokenizer, prompt: str, *, chat: bool | None = None) -> list[int]:
    """Token ids of ``prompt``: through the tokenizer's chat template (a user turn, the
    generation prompt added) when it has one and ``chat`` is not False, else plain
    encoding with the tokenizer's special tokens."""
    if not isinstance(prompt, str):
        raise ArgumentTypeError(f"prompt must be a str, got {show(prompt)}")
    use_chat = bool(getattr(tokenizer, "chat_template", None)) if chat is None else chat
    if use_chat:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                            add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return [int(i) for i in ids]
    return [int(i) for i in tokenizer(prompt)["input_ids"]]


def encode_bad_words(tokenizer, words: Sequence[str]) -> list[list[int]]:
    """Token-id sequences of vLLM's string ``bad_words`` (``SamplingParams.
    update_from_tokenizer``): each word as written and, when that differs in its first
    token only, with a leading space; a word of no tokens is refused."""
    if isinstance(words, (str, bytes)) or not isinstance(words, (list, tuple)):
        raise ArgumentTypeError(f"bad_words must be a list of str, got {show(words)}")
    out: list[list[int]] = []
    for i, w in enumerate(words):
        if not isinstance(w, str):
            raise ArgumentTypeError(f"bad_words[{i}] must be a str, got {show(w)}")
        first: list[int] | None = None
        for prefix in ("", " "):
            ids = [int(t) for t in tokenizer.encode(prefix + w.lstrip(), add_special_tokens=False)]
            if first is None:
                if not ids:
                    raise ArgumentError(f"bad_words[{i}]={show(w)} encodes to no token "
                                        f"(allowed: a word the tokenizer encodes)")
                first = ids
                out.append(ids)
            elif ids and ids[0] != first[0] and len(ids) == len(first):
                out.append(ids)
    return out


def score(model, params, token_ids: Sequence[int]):
    """Logits ``[len(token_ids), V]`` (float32, NumPy) of a ``DecoderLM`` over one sequence:
    row ``i`` scores the token after ``token_ids[: i + 1]`` (one jitted prefill)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from specjax.constants import next_power_of_2
    from specjax.attention_metadata import CommonAttentionMetadata
    from specjax.models import DecoderLM

    if not isinstance(model, DecoderLM):
        raise ArgumentTypeError(f"model must be a specjax.models.DecoderLM, got "
                                f"{type(model).__name__}")
    ids = check_int_sequence("token_ids", token_ids, 0, model.config.vocab_size - 1, min_len=1,
                             max_len=1 << 20)
    n = len(ids)
    pad = max(16, next_power_of_2(n))
    md = CommonAttentionMetadata.from_query_lens([n], [n], [[0]], block_size=pad,
                                                 num_tokens_pad=pad, max_query_len=pad)
    buf = np.zeros(pad, np.int32)
    buf[:n] = ids
    fwd = _forward(model)
    hidden = fwd(params, jnp.asarray(buf), jnp.arange(pad, dtype=jnp.int32),
                 model.init_kv_caches(1, pad), md)
    logits = model.compute_logits(params, hidden[:n])
    return np.asarray(jax.device_get(logits), np.float32)


_FORWARDS: dict = {}


def _forward(model):
    import jax

    if model not in _FORWARDS:
        _FORWARDS[model] = jax.jit(lambda p, i, pos, kv, md: model.forward(p, i, pos, kv, md)[0])
    return _FORWARDS[model]

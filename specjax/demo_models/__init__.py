"""The trained demo models shipped with specjax (package data).

A byte-level Llama target trained on CPython's standard-library sources and one draft of
every kind trained against it (``eagle``, ``eagle3``, ``medusa``, ``draft_model``,
``dflash``, ``dspark``), each in its real upstream checkpoint layout, fp16; :func:`load` reads one
through ``specjax.load_pretrained``. Reproduce them with ``python -m
specjax.training.recipe --out DIR`` (docs/training.md).
"""

from __future__ import annotations

from pathlib import Path

#: Every shipped model, target first.
NAMES = ("target", "eagle", "eagle3", "medusa", "draft_model", "dflash", "dspark")

ROOT = Path(__file__).resolve().parent


def path(name: str) -> Path:
    """The directory of the shipped model ``name`` (one of :data:`NAMES`)."""
    if name not in NAMES:
        raise ValueError(f"name must be one of {NAMES}, got {name!r}")
    return ROOT / name


def available() -> tuple[str, ...]:
    """The names whose checkpoint is present in this install."""
    return tuple(n for n in NAMES if (ROOT / n / "config.json").is_file())


def load(name: str, dtype="fp32"):
    """``Pretrained(kind, config, params)`` of the shipped model ``name`` via
    ``load_pretrained``, params cast to ``dtype`` (default fp32, for the lossless checks;
    the files are fp16). Public as ``specjax.load_demo_model``."""
    from specjax.converters import load_pretrained

    p = path(name)
    if not (p / "config.json").is_file():
        raise FileNotFoundError(f"demo model {name!r} is not shipped in this install ({p})")
    return load_pretrained(p, dtype)


__all__ = ["NAMES", "ROOT", "path", "available", "load"]

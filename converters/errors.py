"""Errors raised by the converters. All are ``ValueError`` subclasses except
:class:`DestinationExistsError` (a ``FileExistsError``) and :class:`Interrupted` (a
``SystemExit``: SIGTERM turned into an exception so that cleanup runs)."""

from __future__ import annotations

#: At most this many names are listed in an error message ("... and N more" after them).
LIST_LIMIT = 8
#: Values quoted in an error message are cut to this many characters.
VALUE_LIMIT = 80


def listing(items, limit: int = LIST_LIMIT) -> str:
    """``a, b, c ... and N more``: at most ``limit`` items of ``items``, comma-separated."""
    items = [str(i) for i in items]
    head = ", ".join(items[:limit])
    return head + (f" ... and {len(items) - limit} more" if len(items) > limit else "")


def clip(text: str, limit: int = VALUE_LIMIT) -> str:
    """``text`` cut to ``limit`` characters in the middle (``...`` marks the cut)."""
    text = str(text)
    if len(text) <= limit:
        return text
    head = (limit - 3) // 2
    return text[:head] + "..." + text[len(text) - (limit - 3 - head):]


def short(value, limit: int = VALUE_LIMIT) -> str:
    """``repr(value)`` cut to ``limit`` characters."""
    return clip(repr(value), limit)


class CheckpointError(ValueError):
    """A checkpoint cannot be read or converted (bad file, bad config, unsupported field)."""


class UnsafePickleError(CheckpointError):
    """A PyTorch pickle names a global outside the allow-list; it was not run."""

    def __init__(self, global_name: str, path: str):
        self.global_name = global_name
        self.path = path
        super().__init__(
            f"{path}: refusing to load a pickle that references {global_name!r}: only "
            "tensor-rebuild functions, storage types and plain containers are allowed "
            "(nothing was executed)"
        )


class FormatDetectionError(CheckpointError):
    """No known format matches the checkpoint (or the named format is unknown)."""


class TensorMismatchError(CheckpointError):
    """The tensors do not match what the model expects: ``unknown``, ``missing`` and
    ``mis_shaped`` (``key -> (found, expected)``) keys, every one named."""

    def __init__(
        self,
        kind: str,
        unknown: list[str] = (),
        missing: list[str] = (),
        mis_shaped: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] | None = None,
        source: str = "",
        mis_typed: dict[str, tuple[str, str]] | None = None,
    ):
        self.kind = kind
        self.unknown = sorted(unknown)
        self.missing = sorted(missing)
        self.mis_shaped = dict(sorted((mis_shaped or {}).items()))
        self.mis_typed = dict(sorted((mis_typed or {}).items()))
        parts = []
        if self.unknown:
            parts.append("unknown tensors (not part of a %s model): %s"
                         % (kind, listing(self.unknown)))
        if self.missing:
            parts.append("missing tensors: %s" % listing(self.missing))
        if self.mis_shaped:
            parts.append("mis-shaped tensors: %s" % listing(
                f"{k} has shape {list(got)}, expected {list(want)}"
                for k, (got, want) in self.mis_shaped.items()))
        if self.mis_typed:
            parts.append("tensors of the wrong dtype: %s" % listing(
                f"{k} is {got}, expected {want}" for k, (got, want) in self.mis_typed.items()))
        where = f"{source}: " if source else ""
        super().__init__(f"{where}checkpoint does not match the {kind} model: "
                         + "; ".join(parts))

    @property
    def keys(self) -> list[str]:
        """Every offending key."""
        return self.unknown + self.missing + list(self.mis_shaped) + list(self.mis_typed)


class NonFiniteError(CheckpointError):
    """A float tensor holds NaN or Inf (or overflows the output dtype); pass
    ``allow_nonfinite=True`` / ``--allow-nonfinite`` to convert it anyway."""


class CorruptOutputError(CheckpointError):
    """A converted directory is damaged: ``specjax.json`` invalid, a data file missing,
    truncated or changed (checksum), or a stored shape / dtype not the recorded one."""


class DestinationExistsError(FileExistsError):
    """The conversion output directory already exists (pass ``force=True`` / ``--force``)."""


class DestinationError(ValueError):
    """The output directory breaks the destination rules (:mod:`.destination`). Raised
    before anything is read."""


class Interrupted(SystemExit):
    """A conversion or export was stopped by SIGTERM (``code`` 143), raised once the write
    in progress has finished or been removed."""

    def __init__(self, signum: int):
        self.signum = int(signum)
        super().__init__(128 + self.signum)

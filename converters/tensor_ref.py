"""``TensorRef``: a tensor's shape and dtype, read from a file header or pickle, with its
data loaded only on demand, so every check runs before any weight bytes are read.
Immutable, so a pickle's BUILD opcode cannot rewrite one."""

from __future__ import annotations

from typing import Callable

import numpy as np

from specjax.converters.errors import CheckpointError


class TensorRef:
    """A lazily loaded tensor. ``source`` names where it comes from (``file:key``)."""

    __slots__ = ("shape", "dtype", "loader", "source")
    shape: tuple[int, ...]
    dtype: np.dtype
    loader: Callable[[], np.ndarray]
    source: str

    def __init__(self, shape, dtype, loader: Callable[[], np.ndarray], source: str = ""):
        for name, value in (("shape", tuple(int(d) for d in shape)), ("dtype", np.dtype(dtype)),
                            ("loader", loader), ("source", str(source))):
            object.__setattr__(self, name, value)

    def __setattr__(self, name, value):
        raise AttributeError(f"TensorRef is immutable (cannot set {name!r})")

    def __delattr__(self, name):
        raise AttributeError(f"TensorRef is immutable (cannot delete {name!r})")

    def __setstate__(self, state):  # the BUILD opcode of a pickle
        raise CheckpointError(f"{self.source}: the pickle tries to modify a rebuilt tensor "
                              "(BUILD on a tensor); refused")

    def __reduce__(self):
        raise TypeError("a TensorRef cannot be pickled")

    def __repr__(self):
        return f"TensorRef(shape={self.shape}, dtype={self.dtype}, source={self.source!r})"

    def __eq__(self, other):
        if not isinstance(other, TensorRef):
            return NotImplemented
        return (self.shape, self.dtype, self.source) == (other.shape, other.dtype, other.source)

    def __hash__(self):
        return hash((self.shape, str(self.dtype), self.source))

    @property
    def size(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def load(self) -> np.ndarray:
        arr = self.loader()
        if tuple(arr.shape) != tuple(self.shape) or arr.dtype != self.dtype:
            raise CheckpointError(
                f"{self.source}: loaded {arr.dtype}{list(arr.shape)}, "
                f"header said {self.dtype}{list(self.shape)}")
        return arr

    def map(self, fn: Callable[[np.ndarray], np.ndarray], shape=None, dtype=None,
            source: str | None = None) -> "TensorRef":
        """A derived tensor (``fn`` applied at load time) with the given shape/dtype."""
        parent = self
        return TensorRef(
            shape=tuple(self.shape if shape is None else shape),
            dtype=np.dtype(self.dtype if dtype is None else dtype),
            loader=lambda: fn(parent.load()),
            source=self.source if source is None else source,
        )

    def astype(self, dtype) -> "TensorRef":
        dtype = np.dtype(dtype)
        if dtype == self.dtype:
            return self
        return self.map(lambda a: a.astype(dtype), dtype=dtype)

    @staticmethod
    def from_array(arr: np.ndarray, source: str = "<array>") -> "TensorRef":
        arr = np.asarray(arr)
        return TensorRef(tuple(arr.shape), arr.dtype, lambda: arr, source)

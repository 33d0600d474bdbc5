"""``TensorRef``: a tensor's shape and dtype, read from a file header or pickle, with its
data loaded only on demand, so every check runs before any weight bytes are read."""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np


@dataclasses.dataclass(frozen=True)
class TensorRef:
    """A lazily loaded tensor. ``source`` names where it comes from (``file:key``)."""

    shape: tuple[int, ...]
    dtype: np.dtype
    loader: Callable[[], np.ndarray] = dataclasses.field(repr=False, compare=False)
    source: str = ""

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    def load(self) -> np.ndarray:
        arr = self.loader()
        if tuple(arr.shape) != tuple(self.shape) or arr.dtype != self.dtype:
            raise AssertionError(  # a reader bug, not a checkpoint problem
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

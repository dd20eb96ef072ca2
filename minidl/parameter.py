"""Parameters: named arrays with a gradient, living in the device pool once bound to a device."""

from __future__ import annotations

from typing import Any

import numpy as np


class Parameter:
    """A trainable array (``trainable=True``) or a buffer such as BatchNorm's running statistics.

    ``data`` and ``grad`` are arrays of the same shape (``grad`` is ``None`` for buffers and
    before the first backward). Once a trainer binds the network to a device, both are views
    into that device's pool; optimizers update ``data`` in place.
    """

    __slots__ = ("name", "data", "grad", "trainable")

    def __init__(self, name: str, data: Any, trainable: bool = True) -> None:
        self.name = name
        self.data = data
        self.grad: Any = None
        self.trainable = trainable

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape)

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.data.dtype)

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    def __repr__(self) -> str:
        kind = "Parameter" if self.trainable else "Buffer"
        return f"{kind}({self.name}, shape={self.shape}, dtype={self.dtype})"

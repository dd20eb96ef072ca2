"""Parameters: named arrays with a gradient, living in the device pool once bound to a device."""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np

from ..memory.runtime.transfer import to_host


class Parameter:
    """A trainable array (``trainable=True``) or a buffer such as BatchNorm's running statistics.

    ``data`` and ``grad`` are arrays of the same shape (``grad`` is ``None`` for buffers and
    before the first backward). Once a trainer binds the network to a device, both are views
    into that device's pool (``bound_to`` is the trainer's engine); optimizers update ``data``
    in place. A second trainer binding the same network takes the parameters over (with
    their values); the first then refuses to run rather than train someone else's memory.
    """

    __slots__ = ("name", "data", "grad", "trainable", "_bound")

    def __init__(self, name: str, data: Any, trainable: bool = True) -> None:
        self.name = name
        self.data = data
        self.grad: Any = None
        self.trainable = trainable
        self._bound: Any = None  # weak reference to the binding engine

    @property
    def bound_to(self) -> Any:
        """The engine whose pool holds ``data`` and ``grad`` (None: host arrays)."""
        return self._bound() if self._bound is not None else None

    @bound_to.setter
    def bound_to(self, engine: Any) -> None:
        self._bound = None if engine is None else weakref.ref(engine)

    def __getstate__(self) -> dict:
        """Pickled and copied as host arrays, bound to nothing."""
        return {"name": self.name, "data": to_host(self.data), "trainable": self.trainable,
                "grad": None if self.grad is None else to_host(self.grad)}

    def __setstate__(self, state: dict) -> None:
        for k, v in state.items():
            setattr(self, k, v)
        self._bound = None

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

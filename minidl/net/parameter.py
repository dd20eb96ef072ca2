"""Parameters: named arrays with a gradient, living in the device pool once bound to a device."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from ..memory.runtime.transfer import to_host
from .deferred_init import DeferredInitialiser, PendingValue


class Parameter:
    """A trainable array (``trainable=True``) or a buffer such as BatchNorm's running statistics.

    ``data`` and ``grad`` are arrays of the same shape (``grad`` is ``None`` for buffers and
    before the first backward). Once a trainer binds the network to a device, both are views
    into that device's pool (``bound_to`` is the trainer's engine); optimizers update ``data``
    in place. A second trainer binding the same network takes the parameters over (with
    their values); the first then refuses to run rather than train someone else's memory.
    A parameter built under :func:`~minidl.net.deferred_init.deferred_parameters` holds a
    :class:`~minidl.net.deferred_init.PendingValue` until ``data`` is first read.
    """

    __slots__ = ("name", "_data", "grad", "trainable", "_bound")

    def __init__(self, name: str, data: Any, trainable: bool = True) -> None:
        self.name = name
        self._data: Any = None
        self.data = data
        self.grad: Any = None
        self.trainable = trainable
        self._bound: Any = None  # weak reference to the binding engine

    @property
    def data(self) -> Any:
        """The values (a pending value is drawn first, with its network's others)."""
        value = self._data
        if type(value) is PendingValue:
            value.initialiser.materialise()
            value = self._data
        return value

    @data.setter
    def data(self, value: Any) -> None:
        self._data = value

    @property
    def pending_value(self) -> PendingValue | None:
        """The value still to be drawn (None once ``data`` holds an array)."""
        value = self._data
        return value if type(value) is PendingValue else None

    @property
    def materialised(self) -> bool:
        """Whether ``data`` holds values (False while deferred)."""
        return self.pending_value is None

    def _array_or_pending(self) -> Any:
        """``data`` without drawing it (a subclass's computed ``data`` when it keeps none)."""
        value = self._data
        return self.data if value is None else value

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
        return tuple(self._array_or_pending().shape)

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self._array_or_pending().dtype)

    @property
    def nbytes(self) -> int:
        return int(self._array_or_pending().nbytes)

    def __repr__(self) -> str:
        kind = "Parameter" if self.trainable else "Buffer"
        return f"{kind}({self.name}, shape={self.shape}, dtype={self.dtype})"


def new_parameter(name: str, shape: tuple[int, ...], dtype: Any, draw: Callable[[], np.ndarray],
                  trainable: bool = True, initialiser: DeferredInitialiser | None = None
                  ) -> Parameter:
    """A parameter whose value ``draw`` makes: now when no ``initialiser`` is given, else on
    the first read of any of the parameters ``initialiser`` deferred (all drawn in order)."""
    if initialiser is None:
        return Parameter(name, draw(), trainable=trainable)
    parameter = Parameter(name, None, trainable=trainable)
    parameter.data = initialiser.defer(parameter, shape, dtype, draw)
    return parameter

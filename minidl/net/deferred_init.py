"""Deferred parameter initialisation: a network built for planning knows every parameter's
shape and dtype but draws no value and holds no memory (accelerate's ``init_empty_weights``,
PyTorch's meta device), so ``minidl plan`` of a 1.5 B-parameter GPT takes seconds.

Inside :func:`deferred_parameters`, the builders (``Network``, the zoo's parameter stores)
give each parameter a :class:`PendingValue` instead of an array. The first read of any
parameter's ``data`` draws every pending value of its generator, in creation order, so the
values equal an eager build's bit for bit; a network that is only planned never draws.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import numpy as np

from .param_memory import check_parameter_memory

_DEFERRING: ContextVar[bool] = ContextVar("minidl_deferred_parameters", default=False)


@contextmanager
def deferred_parameters() -> Iterator[None]:
    """Networks built inside this block defer their parameters' values until first read."""
    token = _DEFERRING.set(True)
    try:
        yield
    finally:
        _DEFERRING.reset(token)


def deferring() -> bool:
    """Whether parameters built now are deferred (inside :func:`deferred_parameters`)."""
    return _DEFERRING.get()


class PendingValue:
    """A parameter value not drawn yet: its ``shape`` and ``dtype``, the function that draws it
    and the :class:`DeferredInitialiser` that draws it together with its siblings."""

    __slots__ = ("shape", "dtype", "draw", "initialiser")

    def __init__(self, shape: tuple[int, ...], dtype: Any, draw: Callable[[], np.ndarray],
                 initialiser: DeferredInitialiser) -> None:
        self.shape = tuple(int(d) for d in shape)
        self.dtype = np.dtype(dtype)
        self.draw = draw
        self.initialiser = initialiser

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __repr__(self) -> str:
        return f"PendingValue(shape={self.shape}, dtype={self.dtype})"


class DeferredInitialiser:
    """The deferred parameters of one network's generator, in creation order (``name``: the
    network's, for the host-memory check when they are drawn)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.pending: list[tuple[Any, PendingValue]] = []
        self._lock = threading.Lock()  # (a second reader waits for the values)

    def defer(self, parameter: Any, shape: tuple[int, ...], dtype: Any,
              draw: Callable[[], np.ndarray]) -> PendingValue:
        """``parameter``'s value of ``shape`` and ``dtype`` that ``draw`` makes when first read."""
        value = PendingValue(shape, dtype, draw, self)
        self.pending.append((parameter, value))
        return value

    def materialise(self) -> None:
        """Draw every pending value in creation order (the generator's order of an eager build);
        a value replaced meanwhile is still drawn, and dropped, so the others are unchanged."""
        with self._lock:
            if not self.pending:
                return
            check_parameter_memory(self.name, [v for _, v in self.pending], np.float32)
            pending, self.pending = self.pending, []
            for parameter, value in pending:
                array = value.draw()
                if array.shape != value.shape or array.dtype != value.dtype:
                    raise AssertionError(f"{parameter.name}: drawn {array.shape} {array.dtype},"
                                         f" declared {value.shape} {value.dtype}")
                if parameter.pending_value is value:
                    parameter.data = array

"""Numbers a device is still computing: a training step on a GPU returns its loss before the
GPU has finished, and the host waits only when the number is read.

A :class:`Deferred` behaves as the float it stands for (``float()``, formatting, arithmetic,
comparisons): each of those reads it, waiting for the device if need be, and raises what the
value's check raises (a non-finite loss, for instance). :meth:`Deferred.ready` says, without
waiting, whether reading it now would wait. On the CPU nothing is deferred: steps return
plain floats.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

__all__ = ["Deferred", "is_ready", "resolve", "resolve_all"]


class Deferred:
    """A float delivered later: ``read()`` computes it once (waiting for the device), ``ready()``
    asks without waiting."""

    __slots__ = ("_read", "_ready", "_value")

    def __init__(self, read: Callable[[], float], ready: Callable[[], bool]) -> None:
        self._read: Callable[[], float] | None = read
        self._ready = ready
        self._value: float | None = None

    def ready(self) -> bool:
        """True when reading the value will not wait for the device."""
        return self._read is None or bool(self._ready())

    def read(self) -> float:
        """The value (waits for the device the first time, unless :meth:`ready`)."""
        if self._read is not None:
            read, self._read = self._read, None
            try:
                self._value = float(read())
            except BaseException:
                self._read = read  # reading again raises again
                raise
        assert self._value is not None
        return self._value

    def __float__(self) -> float:
        return self.read()

    def __format__(self, spec: str) -> str:
        return format(self.read(), spec)

    def __repr__(self) -> str:
        return repr(self._value) if self._read is None else "Deferred(pending)"

    def __str__(self) -> str:
        return str(self.read())

    def __bool__(self) -> bool:
        return bool(self.read())

    def __round__(self, ndigits: int | None = None) -> Any:
        return round(self.read(), ndigits)

    def __hash__(self) -> int:
        return hash(self.read())

    def __eq__(self, other: object) -> bool:
        return self.read() == _value(other)

    def __ne__(self, other: object) -> bool:
        return self.read() != _value(other)

    def __lt__(self, other: Any) -> bool:
        return self.read() < _value(other)

    def __le__(self, other: Any) -> bool:
        return self.read() <= _value(other)

    def __gt__(self, other: Any) -> bool:
        return self.read() > _value(other)

    def __ge__(self, other: Any) -> bool:
        return self.read() >= _value(other)

    def __neg__(self) -> float:
        return -self.read()

    def __abs__(self) -> float:
        return abs(self.read())

    def __add__(self, other: Any) -> float:
        return self.read() + _value(other)

    def __radd__(self, other: Any) -> float:
        return _value(other) + self.read()

    def __sub__(self, other: Any) -> float:
        return self.read() - _value(other)

    def __rsub__(self, other: Any) -> float:
        return _value(other) - self.read()

    def __mul__(self, other: Any) -> float:
        return self.read() * _value(other)

    def __rmul__(self, other: Any) -> float:
        return _value(other) * self.read()

    def __truediv__(self, other: Any) -> float:
        return self.read() / _value(other)

    def __rtruediv__(self, other: Any) -> float:
        return _value(other) / self.read()


def _value(x: Any) -> Any:
    return x.read() if isinstance(x, Deferred) else x


def resolve(x: Any) -> Any:
    """``x`` read if it is :class:`Deferred`, else ``x`` itself."""
    return _value(x)


def resolve_all(values: list[Any]) -> list[Any]:
    """Every value read, the newest first: one wait for the last step's figures covers the
    earlier ones (the device finished them before it)."""
    return list(reversed([resolve(v) for v in reversed(values)]))


def is_ready(x: Any) -> bool:
    """False only for a :class:`Deferred` whose value the device has not delivered."""
    return not isinstance(x, Deferred) or x.ready()


def isfinite(x: Any) -> bool:
    """``math.isfinite`` of ``x`` (reading it)."""
    return math.isfinite(_value(x))

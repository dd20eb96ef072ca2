"""The bytes a network's parameters will take, counted from their declared shapes before any is
allocated, and refused in one line when the host does not have them (rather than NumPy's
``Unable to allocate 1.31 TiB`` from deep inside an initialiser)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import numpy as np

from ..memory.devices.device import available_host_memory
from ..memory.ir.units import format_size


class ParameterMemoryError(MemoryError):
    """A network's parameters need more host memory than is available (``needed_bytes``,
    ``available_bytes``)."""

    def __init__(self, message: str, needed_bytes: int, available_bytes: int) -> None:
        super().__init__(message)
        self.needed_bytes = needed_bytes
        self.available_bytes = available_bytes


def parameter_bytes(specs: Iterable[Any], dtype: Any) -> tuple[int, int]:
    """(values, bytes) of these :class:`~minidl.layers.base.ParamSpec`\\ s in ``dtype`` (a
    spec's own dtype where it has one)."""
    values = nbytes = 0
    for spec in specs:
        n = math.prod(int(d) for d in spec.shape)
        values += n
        nbytes += n * np.dtype(spec.dtype if spec.dtype is not None else dtype).itemsize
    return values, nbytes


def check_parameter_memory(name: str, specs: Iterable[Any], dtype: Any,
                           available: int | None = None) -> None:
    """Raise :class:`ParameterMemoryError` when the parameters of network ``name`` (its
    ``specs``) need more bytes than the host has available now (``available``: measured
    unless given). The largest is initialised in float64 first (NumPy's generators), so that
    copy counts too."""
    specs = list(specs)
    values, nbytes = parameter_bytes(specs, dtype)
    largest = max((math.prod(int(d) for d in s.shape) for s in specs), default=0)
    needed = nbytes + 8 * largest
    have = available_host_memory() if available is None else available
    if needed > have:
        raise ParameterMemoryError(
            f"the parameters of {name} need {format_size(nbytes)} ({values:,} values of "
            f"{np.dtype(dtype).name}, {format_size(needed)} while initialised); this machine "
            f"has {format_size(have)} of memory available", needed, have)

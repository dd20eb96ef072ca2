"""Explicit host <-> device transfers: the one way data crosses between NumPy and a device.

Device arrays (CuPy's, the strict test device's) refuse implicit conversion, so every crossing
goes through :func:`to_host` or :func:`copy_into`; on the CPU device both are plain copies.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..devices.traits import device_traits

__all__ = ["HostValue", "copy_into", "fetch_async", "is_host", "to_host"]


def is_host(a: Any) -> bool:
    """True for NumPy arrays and scalars (host memory)."""
    return isinstance(a, (np.ndarray, np.generic, int, float, bool))


def to_host(a: Any) -> np.ndarray:
    """A NumPy copy of ``a`` (a device-to-host copy for device arrays)."""
    if isinstance(a, np.ndarray):
        return np.array(a, copy=True)
    if is_host(a):
        return np.asarray(a)
    get = getattr(a, "get", None)
    if get is None:
        raise TypeError(f"cannot copy a {type(a).__name__} to the host (no data: a meta array?)")
    return get()


def copy_into(dst: Any, src: Any) -> None:
    """``dst[...] = src`` across host and device, casting ``src`` to ``dst``'s dtype.

    ``src`` is broadcast to ``dst``'s shape when both are on the same side; a host source for
    a device destination is converted on the host first and sent with one copy.
    """
    dst_host, src_host = isinstance(dst, np.ndarray), is_host(src)
    if dst_host and src_host:
        np.copyto(dst, src, casting="unsafe")
    elif dst_host:
        np.copyto(dst, src.get(), casting="unsafe")
    elif src_host:
        # (np.ascontiguousarray would make a 0-d array 1-d)
        host = np.array(np.broadcast_to(np.asarray(src, dtype=dst.dtype), dst.shape), order="C")
        if not dst.flags.c_contiguous:
            raise ValueError("copy_into: a host source needs a C-contiguous device destination")
        dst.set(host)
    else:
        dst[...] = src if src.dtype == dst.dtype else src.astype(dst.dtype)


class HostValue:
    """A copy already on the host (what :func:`fetch_async` gives on host devices)."""

    __slots__ = ("_value",)

    def __init__(self, value: np.ndarray) -> None:
        self._value = value

    def ready(self) -> bool:
        return True

    def result(self) -> np.ndarray:
        return self._value


def fetch_async(device: Any, a: Any) -> Any:
    """A host copy of ``a`` that the host need not wait for yet: ``ready()`` (would reading it
    wait?) and ``result()`` (the NumPy copy). On a device that runs asynchronously (its
    ``fetch_async``) the copy is queued behind the work producing ``a``; elsewhere it is made
    now (:class:`HostValue`)."""
    fetch = device_traits(device).fetch_async
    if fetch is None or is_host(a):
        return HostValue(to_host(a))
    return fetch(a)

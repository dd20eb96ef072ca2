"""The array module of an array: NumPy for host arrays, CuPy (or a CuPy-like test namespace)
for device arrays. Device code creates its temporaries with ``namespace(x).empty(...)`` etc.,
never with ``np.empty`` (a host array, which CuPy refuses to mix with its own)."""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["is_host", "namespace"]


def is_host(a: Any) -> bool:
    """True for NumPy arrays (host memory)."""
    return isinstance(a, np.ndarray)


def namespace(a: Any) -> Any:
    """``numpy`` for NumPy arrays and scalars; the array's own module for device arrays."""
    if isinstance(a, (np.ndarray, np.generic)) or a is None:
        return np
    get_ns = getattr(a, "__array_namespace__", None)
    if get_ns is not None:
        return get_ns()
    if type(a).__module__.split(".")[0] == "cupy":
        import cupy

        return cupy
    return np

"""The array module of an array: NumPy for host arrays, CuPy (or a CuPy-like test namespace)
for device arrays. Device code creates its temporaries with ``namespace(x).empty(...)`` etc.,
never with ``np.empty`` (a host array, which CuPy refuses to mix with its own)."""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["HALF_DTYPES", "half_device", "half_inf_bits", "is_half_dtype", "is_host", "namespace",
           "round_into"]

#: The 2-byte float dtypes mixed precision keeps tensors in (bfloat16 as ``ml_dtypes``'s).
HALF_DTYPES = frozenset({"float16", "bfloat16"})


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


def is_half_dtype(dtype: Any) -> bool:
    """Whether ``dtype`` is float16 or bfloat16 (``ml_dtypes``', whose kind is ``V``)."""
    return np.dtype(dtype).name in HALF_DTYPES


def half_device(*arrays: Any) -> bool:
    """Device arrays of one half dtype (float16 / bfloat16)."""
    from ._cuda import is_device_array

    return (all(is_device_array(a) for a in arrays) and is_half_dtype(arrays[0].dtype)
            and all(a.dtype == arrays[0].dtype for a in arrays))


def half_inf_bits(dtype: Any) -> int:
    """+inf's bit pattern in a half dtype: 0x7C00 for float16, 0x7F80 for bfloat16 (a NaN's
    magnitude bits lie above it)."""
    return 0x7C00 if np.dtype(dtype) == np.float16 else 0x7F80


def round_into(dst: Any, src: Any) -> None:
    """``dst[...] = src`` converted to ``dst``'s dtype (rounded when narrower); float16's
    overflow to inf is no error (loss scaling watches for it)."""
    with np.errstate(over="ignore", invalid="ignore"):
        np.copyto(dst, src, casting="unsafe")

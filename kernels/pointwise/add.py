"""Elementwise sum and copy of large arrays, split over the threads.

NumPy's ``np.add`` and ``np.copyto`` run on one thread; over a residual block's feature maps
(a few MB, from main memory) two threads measured 1.4-1.8x faster here (2 M float32: add
1.63 -> 0.90 ms, copy 1.28 -> 0.91 ms). Each element is one add, so the result is the same
bits whatever the split. Non-contiguous or non-NumPy arrays go to NumPy.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ..parallel import ensure_blas_policy, run_pages

#: Elements below which a call runs on the calling thread alone.
SERIAL_ELEMS = 1 << 16


@njit(nogil=True, cache=True, error_model="numpy")
def _add(a, b, out, i0, i1):
    a_, b_, out_ = a[i0:i1], b[i0:i1], out[i0:i1]  # indices from 0: vectorised
    for i in range(i1 - i0):
        out_[i] = a_[i] + b_[i]


@njit(nogil=True, cache=True, error_model="numpy")
def _copy(src, out, i0, i1):
    src_, out_ = src[i0:i1], out[i0:i1]
    for i in range(i1 - i0):
        out_[i] = src_[i]


@njit(nogil=True, cache=True, parallel=True, error_model="numpy")
def _add_par(a, b, out, bounds):
    for t in prange(bounds.size - 1):
        _add(a, b, out, bounds[t], bounds[t + 1])


@njit(nogil=True, cache=True, parallel=True, error_model="numpy")
def _copy_par(src, out, bounds):
    for t in prange(bounds.size - 1):
        _copy(src, out, bounds[t], bounds[t + 1])


def _fast(*arrays) -> bool:
    """Contiguous NumPy arrays of one float32 / float64 dtype (others go to NumPy)."""
    return all(type(a) is np.ndarray and a.flags.c_contiguous for a in arrays) and \
        len({a.dtype for a in arrays}) == 1 and arrays[0].dtype in _FLOATS


_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))


def add(a, b, out) -> None:
    """``out = a + b`` (same shape and dtype); ``out`` may be ``a`` or ``b``."""
    if not _fast(a, b, out):
        np.add(a, b, out=out)
        return
    ensure_blas_policy()
    run_pages(_add, _add_par, (a.reshape(-1), b.reshape(-1), out.reshape(-1)), out.size,
              SERIAL_ELEMS)


def copy(src, out) -> None:
    """``out[...] = src`` (same shape and dtype)."""
    if not _fast(src, out):
        np.copyto(out, src)
        return
    ensure_blas_policy()
    run_pages(_copy, _copy_par, (src.reshape(-1), out.reshape(-1)), out.size, SERIAL_ELEMS)

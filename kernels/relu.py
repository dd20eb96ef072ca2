"""ReLU forward / backward: NumPy references and multi-threaded Numba CPU kernels.

One pass over memory, no temporaries (NumPy's ``dy * (y > 0)`` builds a boolean array first),
split over :func:`~minidl.kernels.parallel.num_threads` threads. Safe in place (``out`` may be
``x``, or ``dy``). Non-contiguous arrays fall back to the references.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from .parallel import chunks, ensure_blas_policy, num_threads


def relu_forward_ref(x: np.ndarray, out: np.ndarray) -> None:
    """``out = max(x, 0)`` (NaN propagates, as ``np.maximum``)."""
    np.maximum(x, 0, out=out)


def relu_backward_ref(dy: np.ndarray, y: np.ndarray, out: np.ndarray) -> None:
    """``out = dy * (y > 0)`` where ``y`` is the forward output (or input)."""
    np.copyto(out, np.where(y > 0, dy, 0).astype(out.dtype, copy=False))


@njit(nogil=True, cache=True, parallel=True)
def _relu_fwd(x, out, bounds):
    for t in prange(bounds.size - 1):
        z = x.dtype.type(0)
        for i in range(bounds[t], bounds[t + 1]):
            v = x[i]
            out[i] = v if (v > z or v != v) else z


@njit(nogil=True, cache=True, parallel=True)
def _relu_bwd(dy, y, out, bounds):
    for t in prange(bounds.size - 1):
        z = dy.dtype.type(0)
        for i in range(bounds[t], bounds[t + 1]):
            out[i] = dy[i] if y[i] > z else z


def _bounds(n: int) -> np.ndarray:
    # Chunks of whole 4 KiB pages per thread, so threads never share a cache line.
    parts = min(num_threads(), max(1, n // 1024))
    return np.array([0] + [b for _, b in chunks(max(n, 1), parts)], np.int64)


def _fast(*arrays: np.ndarray) -> bool:
    return all(type(a) is np.ndarray and a.flags.c_contiguous for a in arrays)


def relu_forward(x: np.ndarray, out: np.ndarray) -> None:
    """``out = max(x, 0)``; ``out`` may be ``x``."""
    if not _fast(x, out) or x.dtype != out.dtype:
        return relu_forward_ref(x, out)
    ensure_blas_policy()
    _relu_fwd(x.reshape(-1), out.reshape(-1), _bounds(x.size))


def relu_backward(dy: np.ndarray, y: np.ndarray, out: np.ndarray) -> None:
    """``out = dy * (y > 0)``; ``out`` may be ``dy``."""
    if not _fast(dy, y, out) or dy.dtype != out.dtype:
        return relu_backward_ref(dy, y, out)
    ensure_blas_policy()
    _relu_bwd(dy.reshape(-1), y.reshape(-1), out.reshape(-1), _bounds(dy.size))

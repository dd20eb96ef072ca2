"""ReLU forward / backward: NumPy references, multi-threaded Numba CPU kernels and, for device
arrays, one ufunc (forward) or one Numba CUDA kernel (backward).

Half device arrays (float16, or ``ml_dtypes.bfloat16``: one dtype, C-contiguous) run Numba
CUDA kernels on their ``uint16`` bits (Numba CUDA has no bfloat16), both directions, with no
float32 temporary: bit-identical to casting each operand to float32, running the float32 kernel
and rounding back (forward: ``x`` where ``x > 0`` or NaN, else +0.0, so -0.0 gives +0.0;
backward: ``dy`` where ``y > 0``, else +0.0, a NaN ``y`` giving +0.0). NaN bits are copied as
they are (the float32 round trip keeps float16 payloads and bfloat16's quiet NaN).

One pass over memory, no temporaries (NumPy's ``dy * (y > 0)`` builds a boolean array first),
split over :func:`~minidl.kernels.parallel.num_threads` threads. Safe in place (``out`` may be
``x``, or ``dy``). Non-contiguous arrays fall back to the references.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any

import numpy as np
from numba import njit, prange

from .. import _cuda
from ..array_api import half_device, half_inf_bits
from ..parallel import ensure_blas_policy, run_pages

cuda: Any = None  # numba.cuda, set by _cuda.bind on first CUDA use


def relu_forward_ref(x: np.ndarray, out: np.ndarray) -> None:
    """``out = max(x, 0)`` (NaN propagates, as ``np.maximum``)."""
    np.maximum(x, 0, out=out)


def relu_backward_ref(dy: np.ndarray, y: np.ndarray, out: np.ndarray) -> None:
    """``out = dy * (y > 0)`` where ``y`` is the forward output (or input)."""
    np.copyto(out, np.where(y > 0, dy, 0).astype(out.dtype, copy=False))


@njit(nogil=True, cache=True, error_model="numpy")
def _relu_fwd(x, out, i0, i1):
    z = x.dtype.type(0)
    xs, outs = x[i0:i1], out[i0:i1]  # indices from 0: no negative-index wrap, so it vectorises
    for i in range(i1 - i0):
        v = xs[i]
        outs[i] = z if v <= z else v  # NaN: not <= 0, kept


@njit(nogil=True, cache=True, error_model="numpy")
def _relu_bwd(dy, y, out, i0, i1):
    z = dy.dtype.type(0)
    dys, ys, outs = dy[i0:i1], y[i0:i1], out[i0:i1]  # from 0: a branch-free vector select
    for i in range(i1 - i0):
        outs[i] = dys[i] if ys[i] > z else z


@njit(nogil=True, cache=True, parallel=True, error_model="numpy")
def _relu_fwd_par(x, out, bounds):
    for t in prange(bounds.size - 1):
        _relu_fwd(x, out, bounds[t], bounds[t + 1])


@njit(nogil=True, cache=True, parallel=True, error_model="numpy")
def _relu_bwd_par(dy, y, out, bounds):
    for t in prange(bounds.size - 1):
        _relu_bwd(dy, y, out, bounds[t], bounds[t + 1])


#: Elements below which a call runs on the calling thread alone.
SERIAL_ELEMS = 1 << 16


def _fast(*arrays: np.ndarray) -> bool:
    """Contiguous NumPy float32 / float64 arrays (others, e.g. float16, go to NumPy)."""
    return all(type(a) is np.ndarray and a.flags.c_contiguous and a.dtype in _FLOATS
               for a in arrays)


_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))


def relu_forward(x: np.ndarray, out: np.ndarray) -> None:
    """``out = max(x, 0)``; ``out`` may be ``x``."""
    if _half_device(x, out):
        flat = _cuda.flat(out).view(np.uint16)
        _cuda.launch(_kernels().k_relu_fwd_half_bits, flat.size,
                     _cuda.flat(x, "x").view(np.uint16), flat, _inf_bits(out.dtype))
        return
    if not _fast(x, out) or x.dtype != out.dtype:
        return relu_forward_ref(x, out)
    ensure_blas_policy()
    run_pages(_relu_fwd, _relu_fwd_par, (x.reshape(-1), out.reshape(-1)), x.size,
              SERIAL_ELEMS)


def _k_relu_bwd(dy, y, out):
    """``out = dy where y > 0 else 0`` (one pass, no mask array)."""
    for i in range(cuda.grid(1), out.size, cuda.gridsize(1)):
        out[i] = dy[i] if y[i] > 0 else 0.0  # (+0.0, as the reference's np.where)


def _k_relu_fwd_half_bits(x, out, inf_bits):
    """Forward on a half array's ``uint16`` bits: kept when positive (sign bit clear, not +0)
    or NaN (magnitude above +inf's pattern ``inf_bits``), else +0.0."""
    for i in range(cuda.grid(1), out.size, cuda.gridsize(1)):
        b = x[i]
        out[i] = b if (b != 0 and b < 0x8000) or (b & 0x7FFF) > inf_bits else 0


def _k_relu_bwd_half_bits(dy, y, out, inf_bits):
    """Backward on half arrays' ``uint16`` bits: ``dy`` where ``0 < y <= +inf`` (``y > 0``),
    else +0.0."""
    for i in range(cuda.grid(1), out.size, cuda.gridsize(1)):
        v = y[i]
        out[i] = dy[i] if v > 0 and v <= inf_bits else 0


@functools.cache
def _kernels() -> SimpleNamespace:
    return _cuda.bind(globals(), ["_k_relu_bwd", "_k_relu_fwd_half_bits",
                                  "_k_relu_bwd_half_bits"])


def _half_device(*arrays: Any) -> bool:
    """Device arrays of one half dtype (float16 / bfloat16), all C-contiguous."""
    return half_device(*arrays) and all(a.flags.c_contiguous for a in arrays)


def _inf_bits(dtype: np.dtype) -> np.uint16:
    """+inf's bit pattern in ``dtype`` (:func:`~..array_api.half_inf_bits`)."""
    return np.uint16(half_inf_bits(dtype))


def relu_backward(dy: np.ndarray, y: np.ndarray, out: np.ndarray) -> None:
    """``out = dy * (y > 0)``; ``out`` may be ``dy``."""
    if _half_device(dy, y, out):
        flat = _cuda.flat(out).view(np.uint16)
        _cuda.launch(_kernels().k_relu_bwd_half_bits, flat.size,
                     _cuda.flat(dy, "dy").view(np.uint16), _cuda.flat(y, "y").view(np.uint16),
                     flat, _inf_bits(out.dtype))
        return
    if _cuda.is_device_array(out) and all(a.flags.c_contiguous for a in (dy, y, out)) \
            and dy.dtype == y.dtype == out.dtype:
        flat = _cuda.flat(out)
        _cuda.launch(_kernels().k_relu_bwd, flat.size, _cuda.flat(dy), _cuda.flat(y), flat)
        return
    if not _fast(dy, y, out) or dy.dtype != out.dtype:
        return relu_backward_ref(dy, y, out)
    ensure_blas_policy()
    run_pages(_relu_bwd, _relu_bwd_par, (dy.reshape(-1), y.reshape(-1), out.reshape(-1)),
              dy.size, SERIAL_ELEMS)

"""GELU forward / backward, exact (erf) and tanh-approximated, as PyTorch's ``nn.GELU``.

    exact: y = x * Phi(x) = 0.5 * x * (1 + erf(x / sqrt(2)))
           dy/dx = Phi(x) + x * exp(-x**2 / 2) / sqrt(2 * pi)
    tanh:  u = sqrt(2 / pi) * (x + 0.044715 * x**3), y = 0.5 * x * (1 + tanh(u))
           dy/dx = 0.5 * (1 + tanh(u)) + 0.5 * x * (1 - tanh(u)**2) * du/dx

The Numba loops (C-contiguous NumPy arrays, split over threads, element by element so results
never depend on the thread count) compute each element in float64 and round once. The
exact forward on float32 arrays evaluates erf as x * P(x^2) / Q(x^2) on |x| <= 4 (a rational
fit of this module's own, in float64: relative error < 5e-9, below float32's rounding; |erf|
rounds to 1 beyond 4) and the exact backward also exp by a polynomial (:func:`_exp_neg_fast`):
with Numba's NumPy error model the loops vectorise, 3-6x faster than libm's erf and exp
(measured on this machine). Absolute errors stay below
1e-8 (the cancellation in 1 + erf(x) for x << 0 makes the relative error of those tiny values
larger). Float64 arrays and the tanh form keep libm's erf, exp and tanh. Device arrays
(C-contiguous, float32 / float64) run one Numba CUDA kernel each way, the generic loops' float64
element math (no temporaries: the references would make several of the tensor's size). Other
arrays take the references (the arrays' own library; erf from SciPy, or CuPy's
``cupyx.scipy.special`` for device arrays). ``out`` may be the first operand (in place).
"""

from __future__ import annotations

import functools
import math
from types import SimpleNamespace
from typing import Any

import numpy as np
from numba import njit, prange

from .. import _cuda
from ..array_api import namespace
from ..parallel import ensure_blas_policy, run_pages

cuda: Any = None  # numba.cuda, set by _cuda.bind on first CUDA use

APPROXIMATIONS = ("none", "tanh")
_SQRT_HALF = math.sqrt(0.5)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_K = 0.044715
#: Elements below which a call runs on the calling thread alone.
SERIAL_ELEMS = 1 << 16


# ---------------------------------------------------------------- vectorisable erf and exp
#: erf(x) ~ x * P(x^2) / Q(x^2) for |x| <= 4 (coefficients by increasing power).
_ERF_P = (1.128379169442179, 0.18514524532412843, 0.054306008348905824,
          0.003846897585690791, 0.00037942360543287597, 4.680629314281204e-06,
          -1.3173701268742732e-08)
_ERF_Q = (1.0, 0.49741411719356726, 0.11393161824875941, 0.015455907457203755,
          0.001306783725652222, 6.307351505776583e-05)
_P0, _P1, _P2, _P3, _P4, _P5, _P6 = _ERF_P
_Q0, _Q1, _Q2, _Q3, _Q4, _Q5 = _ERF_Q
@njit(nogil=True, cache=True, inline="always", error_model="numpy")
def _erf_fast(v):
    c = min(max(v, -4.0), 4.0)
    t = c * c
    p = _P0 + t * (_P1 + t * (_P2 + t * (_P3 + t * (_P4 + t * (_P5 + t * _P6)))))
    q = _Q0 + t * (_Q1 + t * (_Q2 + t * (_Q3 + t * (_Q4 + t * _Q5))))
    s = 1.0 if v > 0.0 else -1.0  # erf is +-1 to within 1.6e-8 beyond +-4
    return c * p / q if c == v else s  # selects, no branch: the loops vectorise


#: 1 / k! for k = 2..8: Taylor terms of exp on [-18 / 64, 0].
_E2, _E3, _E4, _E5, _E6, _E7, _E8 = (1.0 / math.factorial(k) for k in range(2, 9))


@njit(nogil=True, cache=True, inline="always", error_model="numpy")
def _exp_neg_fast(t):
    """exp(t) for t <= 0 (exp(-18) ~ 1.5e-8 below): exp(u)^64 with u = t / 64 in [-0.28, 0]
    by its Taylor polynomial of degree 8 (relative error < 3e-11, < 2e-9 after the six
    squarings). Vectorisable, unlike libm's exp."""
    u = max(t, -18.0) * (1.0 / 64.0)
    e = 1.0 + u * (1.0 + u * (_E2 + u * (_E3 + u * (_E4 + u * (_E5 + u * (_E6 + u * (
        _E7 + u * _E8)))))))
    e = e * e
    e = e * e
    e = e * e
    e = e * e
    e = e * e
    return e * e


@njit(nogil=True, cache=True, inline="always", error_model="numpy")
def _gelu_fast(v):
    return 0.5 * v * (1.0 + _erf_fast(v * _SQRT_HALF))


@njit(nogil=True, cache=True, inline="always", error_model="numpy")
def _dgelu_fast(v):
    return 0.5 * (1.0 + _erf_fast(v * _SQRT_HALF)) + v * _exp_neg_fast(-0.5 * v * v) * \
        _INV_SQRT_2PI


# The loops run over slices from index 0 (a range(i0, i1) index may be negative, which keeps
# an in-place loop from vectorising), and in place through loops of their own: where ``out``
# is an operand, LLVM's runtime overlap check sends the two-array loop down its scalar path
# (2.8x slower, measured).
@njit(nogil=True, cache=True, error_model="numpy")
def _fwd_fast(x, out, i0, i1):
    xs, outs = x[i0:i1], out[i0:i1]
    for i in range(xs.size):
        outs[i] = _gelu_fast(float(xs[i]))


@njit(nogil=True, cache=True, error_model="numpy")
def _fwd_fast_inplace(x, i0, i1):
    xs = x[i0:i1]
    for i in range(xs.size):
        xs[i] = _gelu_fast(float(xs[i]))


@njit(nogil=True, cache=True, error_model="numpy")
def _bwd_fast(dy, x, out, i0, i1):
    dys, xs, outs = dy[i0:i1], x[i0:i1], out[i0:i1]
    for i in range(xs.size):
        outs[i] = dys[i] * _dgelu_fast(float(xs[i]))


@njit(nogil=True, cache=True, error_model="numpy")
def _bwd_fast_inplace(dy, x, i0, i1):
    dys, xs = dy[i0:i1], x[i0:i1]
    for i in range(xs.size):
        dys[i] = dys[i] * _dgelu_fast(float(xs[i]))


@njit(nogil=True, cache=True, parallel=True, error_model="numpy")
def _fwd_fast_par(x, out, bounds):
    for t in prange(bounds.size - 1):
        _fwd_fast(x, out, bounds[t], bounds[t + 1])


@njit(nogil=True, cache=True, parallel=True, error_model="numpy")
def _fwd_fast_inplace_par(x, bounds):
    for t in prange(bounds.size - 1):
        _fwd_fast_inplace(x, bounds[t], bounds[t + 1])


@njit(nogil=True, cache=True, parallel=True, error_model="numpy")
def _bwd_fast_par(dy, x, out, bounds):
    for t in prange(bounds.size - 1):
        _bwd_fast(dy, x, out, bounds[t], bounds[t + 1])


@njit(nogil=True, cache=True, parallel=True, error_model="numpy")
def _bwd_fast_inplace_par(dy, x, bounds):
    for t in prange(bounds.size - 1):
        _bwd_fast_inplace(dy, x, bounds[t], bounds[t + 1])


# ---------------------------------------------------------------- Numba CPU
@njit(nogil=True, cache=True, error_model="numpy")
def _fwd(x, out, tanh_form, i0, i1):
    for i in range(i0, i1):
        v = float(x[i])
        if tanh_form:
            y = 0.5 * v * (1.0 + math.tanh(_SQRT_2_OVER_PI * (v + _K * v * v * v)))
        else:
            y = 0.5 * v * (1.0 + math.erf(v * _SQRT_HALF))
        out[i] = y


@njit(nogil=True, cache=True, error_model="numpy")
def _bwd(dy, x, out, tanh_form, i0, i1):
    for i in range(i0, i1):
        v = float(x[i])
        if tanh_form:
            t = math.tanh(_SQRT_2_OVER_PI * (v + _K * v * v * v))
            d = 0.5 * (1.0 + t) + 0.5 * v * (1.0 - t * t) * _SQRT_2_OVER_PI * (
                1.0 + 3.0 * _K * v * v)
        else:
            d = 0.5 * (1.0 + math.erf(v * _SQRT_HALF)) + v * math.exp(-0.5 * v * v) * \
                _INV_SQRT_2PI
        out[i] = dy[i] * d


@njit(nogil=True, cache=True, parallel=True, error_model="numpy")
def _fwd_par(x, out, tanh_form, bounds):
    for t in prange(bounds.size - 1):
        _fwd(x, out, tanh_form, bounds[t], bounds[t + 1])


@njit(nogil=True, cache=True, parallel=True, error_model="numpy")
def _bwd_par(dy, x, out, tanh_form, bounds):
    for t in prange(bounds.size - 1):
        _bwd(dy, x, out, tanh_form, bounds[t], bounds[t + 1])


# ---------------------------------------------------------------- CUDA kernels
def _k_gelu_fwd(x, out, tanh_form):
    for i in range(cuda.grid(1), out.size, cuda.gridsize(1)):
        v = float(x[i])
        if tanh_form:
            y = 0.5 * v * (1.0 + math.tanh(_SQRT_2_OVER_PI * (v + _K * v * v * v)))
        else:
            y = 0.5 * v * (1.0 + math.erf(v * _SQRT_HALF))
        out[i] = y


def _k_gelu_bwd(dy, x, out, tanh_form):
    for i in range(cuda.grid(1), out.size, cuda.gridsize(1)):
        v = float(x[i])
        if tanh_form:
            t = math.tanh(_SQRT_2_OVER_PI * (v + _K * v * v * v))
            d = 0.5 * (1.0 + t) + 0.5 * v * (1.0 - t * t) * _SQRT_2_OVER_PI * (
                1.0 + 3.0 * _K * v * v)
        else:
            d = 0.5 * (1.0 + math.erf(v * _SQRT_HALF)) + v * math.exp(-0.5 * v * v) * \
                _INV_SQRT_2PI
        out[i] = dy[i] * d


@functools.cache
def _kernels() -> SimpleNamespace:
    return _cuda.bind(globals(), ["_k_gelu_fwd", "_k_gelu_bwd"])


def _on_device(*arrays) -> bool:
    return _cuda.is_device_array(arrays[-1]) and all(
        a.flags.c_contiguous and a.dtype == arrays[0].dtype and a.dtype in (np.float32, np.float64)
        for a in arrays)


# ---------------------------------------------------------------- references
def _erf(x):
    if namespace(x) is np:
        from scipy.special import erf
    else:  # a device array: its library's erf
        from cupyx.scipy.special import erf
    return erf(x)


def gelu_forward_ref(x, out, approximate: str = "none") -> None:
    """Reference of :func:`gelu_forward`."""
    if approximate == "tanh":
        u = np.tanh(_SQRT_2_OVER_PI * (x + _K * x * x * x))
    else:
        u = _erf(x * _SQRT_HALF)
    np.multiply(0.5 * x, 1.0 + u, out=out)


def gelu_backward_ref(dy, x, out, approximate: str = "none") -> None:
    """Reference of :func:`gelu_backward`."""
    if approximate == "tanh":
        t = np.tanh(_SQRT_2_OVER_PI * (x + _K * x * x * x))
        d = 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * _SQRT_2_OVER_PI * (1.0 + 3 * _K * x * x)
    else:
        d = 0.5 * (1.0 + _erf(x * _SQRT_HALF)) + x * np.exp(-0.5 * x * x) * _INV_SQRT_2PI
    np.multiply(dy, d, out=out)


# ---------------------------------------------------------------- dispatchers
def _check(approximate: str) -> bool:
    if approximate not in APPROXIMATIONS:
        raise ValueError(f"GELU approximate must be one of {APPROXIMATIONS}, got {approximate!r}")
    return approximate == "tanh"


def _fast(*arrays) -> bool:
    return all(type(a) is np.ndarray and a.flags.c_contiguous for a in arrays)


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether ``b`` is ``a``'s memory (an in-place call)."""
    return a.ctypes.data == b.ctypes.data


def _run(serial, par, arrays: tuple, n: int) -> None:
    ensure_blas_policy()
    run_pages(serial, par, arrays, n, SERIAL_ELEMS)


def gelu_forward(x, out, approximate: str = "none") -> None:
    """``out = gelu(x)``; ``out`` may be ``x``."""
    tanh_form = _check(approximate)
    if _on_device(x, out):
        flat = _cuda.flat(out)
        _cuda.launch(_kernels().k_gelu_fwd, flat.size, _cuda.flat(x), flat, tanh_form)
        return
    if not _fast(x, out):
        return gelu_forward_ref(x, out, approximate)
    if x.dtype == np.float32 and not tanh_form:
        if _same(x, out):
            _run(_fwd_fast_inplace, _fwd_fast_inplace_par, (x.reshape(-1),), x.size)
        else:
            _run(_fwd_fast, _fwd_fast_par, (x.reshape(-1), out.reshape(-1)), x.size)
    else:
        _run(_fwd, _fwd_par, (x.reshape(-1), out.reshape(-1), tanh_form), x.size)


def gelu_backward(dy, x, out, approximate: str = "none") -> None:
    """``out = dy * gelu'(x)``; ``out`` may be ``dy``."""
    tanh_form = _check(approximate)
    if _on_device(dy, x, out):
        flat = _cuda.flat(out)
        _cuda.launch(_kernels().k_gelu_bwd, flat.size, _cuda.flat(dy), _cuda.flat(x), flat,
                     tanh_form)
        return
    if not _fast(dy, x, out):
        return gelu_backward_ref(dy, x, out, approximate)
    if x.dtype == np.float32 and not tanh_form:
        if _same(dy, out):
            _run(_bwd_fast_inplace, _bwd_fast_inplace_par, (dy.reshape(-1), x.reshape(-1)),
                 dy.size)
        else:
            _run(_bwd_fast, _bwd_fast_par, (dy.reshape(-1), x.reshape(-1), out.reshape(-1)),
                 dy.size)
    else:
        _run(_bwd, _bwd_par, (dy.reshape(-1), x.reshape(-1), out.reshape(-1), tanh_form),
             dy.size)

"""Batch-normalisation kernels on (N, C, S) views: a NumPy reference, a Numba CPU version and
a device version.

Per-channel sums accumulate in float64 (two passes for the variance). Apply kernels are safe
when the output is the same array as their first operand (in place). C-contiguous NumPy arrays
go to the Numba loops (no temporaries). Given a ``scratch`` array of x's shape and dtype, other
arrays (CuPy's) go to the device version: in-place ufuncs with ``out=`` and float64 reductions
with ``out=``, so it creates no array of its own (the reference makes float64 copies of x);
``x - mean`` is rounded to x's dtype there before it is squared or multiplied (a relative
difference of the order of float32 rounding from the CPU's float64 loops). Anything else goes
to the NumPy reference.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from .parallel import ensure_blas_policy, num_threads


def _use_numba(*arrays) -> bool:
    ensure_blas_policy()
    return all(type(a) is np.ndarray and a.flags.c_contiguous for a in arrays)


# ---------------------------------------------------------------- Numba CPU loops
# Each channel's sums run over its rows with 4 accumulators (element j into lane j % 4, the
# lanes added in a fixed order at the end): 4 additions in flight instead of one chain. Channels
# (statistics) or rows (apply) are shared out over the threads when the tensor is large;
# either way every sum has the same order, so the bits depend neither on the thread count nor
# on the serial / parallel choice.
@njit(nogil=True, cache=True, inline="always", error_model="numpy")
def _channel_sum(x, ch, mu, square):
    """sum over (i, j) of x[i, ch, j] - mu (squared if ``square``), in float64."""
    a0 = a1 = a2 = a3 = 0.0
    s = x.shape[2]
    s4 = s - s % 4
    for i in range(x.shape[0]):
        r = x[i, ch]
        for j in range(0, s4, 4):
            d0, d1, d2, d3 = r[j] - mu, r[j + 1] - mu, r[j + 2] - mu, r[j + 3] - mu
            if square:
                d0, d1, d2, d3 = d0 * d0, d1 * d1, d2 * d2, d3 * d3
            a0 += d0
            a1 += d1
            a2 += d2
            a3 += d3
        for j in range(s4, s):
            d = r[j] - mu
            a0 += d * d if square else d
    return (a0 + a1) + (a2 + a3)


@njit(nogil=True, cache=True, inline="always", error_model="numpy")
def _stats_channel(x, ch, mean, var):
    count = x.shape[0] * x.shape[2]
    mu = _channel_sum(x, ch, 0.0, False) / count
    mean[ch] = mu
    var[ch] = _channel_sum(x, ch, mu, True) / count


@njit(nogil=True, cache=True, error_model="numpy")
def _stats_nb(x, mean, var):
    for ch in range(x.shape[1]):
        _stats_channel(x, ch, mean, var)


@njit(nogil=True, cache=True, parallel=True, error_model="numpy")
def _stats_par(x, mean, var):
    for ch in prange(x.shape[1]):
        _stats_channel(x, ch, mean, var)


@njit(nogil=True, cache=True, inline="always", error_model="numpy")
def _apply_row(x, mean, scale, shift, y, k):
    i, ch = k // x.shape[1], k % x.shape[1]
    m, a, b = mean[ch], scale[ch], shift[ch]
    xr, yr = x[i, ch], y[i, ch]
    for j in range(xr.size):
        yr[j] = (xr[j] - m) * a + b


@njit(nogil=True, cache=True, error_model="numpy")
def _apply_nb(x, mean, scale, shift, y):
    for k in range(x.shape[0] * x.shape[1]):
        _apply_row(x, mean, scale, shift, y, k)


@njit(nogil=True, cache=True, parallel=True, error_model="numpy")
def _apply_par(x, mean, scale, shift, y):
    for k in prange(x.shape[0] * x.shape[1]):
        _apply_row(x, mean, scale, shift, y, k)


@njit(nogil=True, cache=True, inline="always", error_model="numpy")
def _reduce_channel(dy, x, mean, sum_dy, sum_dy_xmu, ch):
    m = mean[ch]
    a0 = a1 = a2 = a3 = 0.0
    b0 = b1 = b2 = b3 = 0.0
    s = x.shape[2]
    s4 = s - s % 4
    for i in range(x.shape[0]):
        g, r = dy[i, ch], x[i, ch]
        for j in range(0, s4, 4):
            a0 += g[j]
            a1 += g[j + 1]
            a2 += g[j + 2]
            a3 += g[j + 3]
            b0 += g[j] * (r[j] - m)
            b1 += g[j + 1] * (r[j + 1] - m)
            b2 += g[j + 2] * (r[j + 2] - m)
            b3 += g[j + 3] * (r[j + 3] - m)
        for j in range(s4, s):
            a0 += g[j]
            b0 += g[j] * (r[j] - m)
    sum_dy[ch] = (a0 + a1) + (a2 + a3)
    sum_dy_xmu[ch] = (b0 + b1) + (b2 + b3)


@njit(nogil=True, cache=True, error_model="numpy")
def _reduce_nb(dy, x, mean, sum_dy, sum_dy_xmu):
    for ch in range(x.shape[1]):
        _reduce_channel(dy, x, mean, sum_dy, sum_dy_xmu, ch)


@njit(nogil=True, cache=True, parallel=True, error_model="numpy")
def _reduce_par(dy, x, mean, sum_dy, sum_dy_xmu):
    for ch in prange(x.shape[1]):
        _reduce_channel(dy, x, mean, sum_dy, sum_dy_xmu, ch)


@njit(nogil=True, cache=True, inline="always", error_model="numpy")
def _backward_apply_row(dy, x, mean, k, shift, coef, dx, q):
    i, ch = q // x.shape[1], q % x.shape[1]
    m, kk, sh, co = mean[ch], k[ch], shift[ch], coef[ch]
    g, r, o = dy[i, ch], x[i, ch], dx[i, ch]
    for j in range(r.size):
        o[j] = kk * (g[j] - sh - (r[j] - m) * co)


@njit(nogil=True, cache=True, error_model="numpy")
def _backward_apply_nb(dy, x, mean, k, shift, coef, dx):
    for q in range(x.shape[0] * x.shape[1]):
        _backward_apply_row(dy, x, mean, k, shift, coef, dx, q)


@njit(nogil=True, cache=True, parallel=True, error_model="numpy")
def _backward_apply_par(dy, x, mean, k, shift, coef, dx):
    for q in prange(x.shape[0] * x.shape[1]):
        _backward_apply_row(dy, x, mean, k, shift, coef, dx, q)


#: Elements below which a call runs on the calling thread alone (a parallel launch costs
#: more than small tensors' work, and stalls when another process holds a core).
SERIAL_ELEMS = 1 << 16


def _parallel(x) -> bool:
    return x.size >= SERIAL_ELEMS and x.shape[0] * x.shape[1] > 1 and num_threads() > 1


# ---------------------------------------------------------------- NumPy references
def stats_ref(x, mean, var) -> None:
    x64 = x.astype(np.float64)
    mu = x64.mean(axis=(0, 2))
    mean[...] = mu
    var[...] = ((x64 - mu[:, None]) ** 2).mean(axis=(0, 2))


def apply_ref(x, mean, scale, shift, out) -> None:
    np.copyto(out, (x - mean[:, None]) * scale[:, None] + shift[:, None])


def reduce_ref(dy, x, mean, sum_dy, sum_dy_xmu) -> None:
    g = dy.astype(np.float64)
    sum_dy[...] = g.sum(axis=(0, 2))
    sum_dy_xmu[...] = (g * (x - mean[:, None])).sum(axis=(0, 2))


def backward_apply_ref(dy, x, mean, k, shift, coef, out) -> None:
    c = (slice(None), None)
    np.copyto(out, k[c] * (dy - shift[c] - (x - mean[c]) * coef[c]))


# ---------------------------------------------------------------- device versions (no temporaries)
def stats_device(x, mean, var, scratch) -> None:
    """:func:`stats` with ``scratch`` (x's shape and dtype) holding ``(x - mean)**2``."""
    count = x.shape[0] * x.shape[2]
    x.sum(axis=(0, 2), dtype=np.float64, out=mean)
    mean /= count
    np.subtract(x, mean[:, None], out=scratch)
    np.multiply(scratch, scratch, out=scratch)
    scratch.sum(axis=(0, 2), dtype=np.float64, out=var)
    var /= count


def apply_device(x, mean, scale, shift, out) -> None:
    """:func:`apply` by three in-place passes over ``out``."""
    np.subtract(x, mean[:, None], out=out)
    np.multiply(out, scale[:, None], out=out)
    np.add(out, shift[:, None], out=out)


def reduce_device(dy, x, mean, sum_dy, sum_dy_xmu, scratch) -> None:
    """:func:`reduce` with ``scratch`` holding ``dy * (x - mean)``."""
    dy.sum(axis=(0, 2), dtype=np.float64, out=sum_dy)
    np.subtract(x, mean[:, None], out=scratch)
    np.multiply(scratch, dy, out=scratch)
    scratch.sum(axis=(0, 2), dtype=np.float64, out=sum_dy_xmu)


def backward_apply_device(dy, x, mean, k, shift, coef, out, scratch) -> None:
    """:func:`backward_apply` with ``scratch`` holding ``(x - mean) * coef``; ``out`` may be
    ``dy`` (each pass reads an element before writing it)."""
    np.subtract(x, mean[:, None], out=scratch)
    np.multiply(scratch, coef[:, None], out=scratch)
    np.subtract(dy, scratch, out=out)
    np.subtract(out, shift[:, None], out=out)
    np.multiply(out, k[:, None], out=out)


# ---------------------------------------------------------------- dispatchers
def stats(x, mean, var, scratch=None) -> None:
    """Per-channel mean and biased variance of x (N, C, S) into float64 arrays (C,);
    ``scratch`` (x's shape and dtype) enables the device version for non-NumPy arrays."""
    if _use_numba(x, mean, var):
        (_stats_par if _parallel(x) else _stats_nb)(x, mean, var)
    elif scratch is not None:
        stats_device(x, mean, var, scratch)
    else:
        stats_ref(x, mean, var)


def apply(x, mean, scale, shift, out) -> None:
    """out = (x - mean) * scale + shift, per channel (all (C,) arrays in x's dtype)."""
    if _use_numba(x, mean, scale, shift, out):
        (_apply_par if _parallel(x) else _apply_nb)(x, mean, scale, shift, out)
    elif type(x) is not np.ndarray:
        apply_device(x, mean, scale, shift, out)
    else:
        apply_ref(x, mean, scale, shift, out)


def reduce(dy, x, mean, sum_dy, sum_dy_xmu, scratch=None) -> None:
    """Per-channel sum(dy) and sum(dy * (x - mean)) into float64 arrays (C,)."""
    if _use_numba(dy, x, mean, sum_dy, sum_dy_xmu):
        (_reduce_par if _parallel(x) else _reduce_nb)(dy, x, mean, sum_dy, sum_dy_xmu)
    elif scratch is not None:
        reduce_device(dy, x, mean, sum_dy, sum_dy_xmu, scratch)
    else:
        reduce_ref(dy, x, mean, sum_dy, sum_dy_xmu)


def backward_apply(dy, x, mean, k, shift, coef, out, scratch=None) -> None:
    """out = k * (dy - shift - (x - mean) * coef), per channel; ``out`` may be ``dy``."""
    if _use_numba(dy, x, mean, k, shift, coef, out):
        (_backward_apply_par if _parallel(x) else _backward_apply_nb)(dy, x, mean, k, shift,
                                                                      coef, out)
    elif scratch is not None:
        backward_apply_device(dy, x, mean, k, shift, coef, out, scratch)
    else:
        backward_apply_ref(dy, x, mean, k, shift, coef, out)

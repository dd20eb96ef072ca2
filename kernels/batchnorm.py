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
from numba import njit


def _use_numba(*arrays) -> bool:
    return all(type(a) is np.ndarray and a.flags.c_contiguous for a in arrays)


# ---------------------------------------------------------------- Numba CPU loops
@njit(cache=True, error_model="numpy")
def _stats_nb(x, mean, var):
    n, c, s = x.shape
    count = n * s
    for ch in range(c):
        acc = 0.0
        for i in range(n):
            for j in range(s):
                acc += x[i, ch, j]
        mu = acc / count
        acc2 = 0.0
        for i in range(n):
            for j in range(s):
                d = x[i, ch, j] - mu
                acc2 += d * d
        mean[ch] = mu
        var[ch] = acc2 / count


@njit(cache=True, error_model="numpy")
def _apply_nb(x, mean, scale, shift, y):
    n, c, s = x.shape
    for i in range(n):
        for ch in range(c):
            m, a, b = mean[ch], scale[ch], shift[ch]
            for j in range(s):
                y[i, ch, j] = (x[i, ch, j] - m) * a + b


@njit(cache=True, error_model="numpy")
def _reduce_nb(dy, x, mean, sum_dy, sum_dy_xmu):
    n, c, s = x.shape
    for ch in range(c):
        m = mean[ch]
        a = 0.0
        b = 0.0
        for i in range(n):
            for j in range(s):
                g = dy[i, ch, j]
                a += g
                b += g * (x[i, ch, j] - m)
        sum_dy[ch] = a
        sum_dy_xmu[ch] = b


@njit(cache=True, error_model="numpy")
def _backward_apply_nb(dy, x, mean, k, shift, coef, dx):
    n, c, s = x.shape
    for i in range(n):
        for ch in range(c):
            m, kk, sh, co = mean[ch], k[ch], shift[ch], coef[ch]
            for j in range(s):
                dx[i, ch, j] = kk * (dy[i, ch, j] - sh - (x[i, ch, j] - m) * co)


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
        _stats_nb(x, mean, var)
    elif scratch is not None:
        stats_device(x, mean, var, scratch)
    else:
        stats_ref(x, mean, var)


def apply(x, mean, scale, shift, out) -> None:
    """out = (x - mean) * scale + shift, per channel (all (C,) arrays in x's dtype)."""
    if _use_numba(x, mean, scale, shift, out):
        _apply_nb(x, mean, scale, shift, out)
    elif type(x) is not np.ndarray:
        apply_device(x, mean, scale, shift, out)
    else:
        apply_ref(x, mean, scale, shift, out)


def reduce(dy, x, mean, sum_dy, sum_dy_xmu, scratch=None) -> None:
    """Per-channel sum(dy) and sum(dy * (x - mean)) into float64 arrays (C,)."""
    if _use_numba(dy, x, mean, sum_dy, sum_dy_xmu):
        _reduce_nb(dy, x, mean, sum_dy, sum_dy_xmu)
    elif scratch is not None:
        reduce_device(dy, x, mean, sum_dy, sum_dy_xmu, scratch)
    else:
        reduce_ref(dy, x, mean, sum_dy, sum_dy_xmu)


def backward_apply(dy, x, mean, k, shift, coef, out, scratch=None) -> None:
    """out = k * (dy - shift - (x - mean) * coef), per channel; ``out`` may be ``dy``."""
    if _use_numba(dy, x, mean, k, shift, coef, out):
        _backward_apply_nb(dy, x, mean, k, shift, coef, out)
    elif scratch is not None:
        backward_apply_device(dy, x, mean, k, shift, coef, out, scratch)
    else:
        backward_apply_ref(dy, x, mean, k, shift, coef, out)

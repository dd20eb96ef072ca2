"""Layer normalisation over the last axis: NumPy references and multi-threaded Numba kernels.

Arrays are seen as (rows, D). Forward writes ``y = (x - mean) * rstd * weight + bias`` and
the per-row ``mean`` and ``rstd = 1 / sqrt(var + eps)`` (biased variance; both accumulated in
float64 per row, stored in the stash dtype). Backward rebuilds ``xhat`` from ``x`` and the
stash and writes

    dx = rstd * (g - mean(g) - xhat * mean(g * xhat)),  g = dy * weight,
    dweight = sum_rows(dy * xhat),  dbias = sum_rows(dy).

Rows are independent, so the row loops split over threads freely; the parameter gradients are
summed over fixed parts of :data:`ROWS_PER_PART` rows (partials in the workspace, added in part
order), so results never depend on the thread count. ``dx`` may be ``dy`` (in place): a row of
``dy`` is read before the same row of ``dx`` is written. Non-NumPy arrays (a device's) take the
references, built from the arrays' own library.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from .array_api import namespace
from .parallel import ensure_blas_policy, num_threads, split

#: Rows per part of the parameter-gradient sums (fixed: the sums never depend on threads).
ROWS_PER_PART = 256
#: Elements below which a call runs on the calling thread alone.
SERIAL_ELEMS = 1 << 15


def parts(rows: int) -> int:
    """Number of partial sums of the parameter gradients for ``rows`` rows."""
    return max(1, -(-rows // ROWS_PER_PART))


def backward_workspace_shape(rows: int, dim: int) -> tuple[int, ...]:
    """Shape (in the float dtype) of the workspace :func:`layernorm_backward` needs."""
    return (parts(rows), 2, dim)


# ---------------------------------------------------------------- Numba CPU
@njit(nogil=True, cache=True, error_model="numpy")
def _fwd_rows(x, w, b, y, mean, rstd, eps, r0, r1):
    d = x.shape[1]
    for r in range(r0, r1):
        s = 0.0
        for j in range(d):
            s += x[r, j]
        m = s / d
        v = 0.0
        for j in range(d):
            t = x[r, j] - m
            v += t * t
        inv = 1.0 / math.sqrt(v / d + eps)
        mean[r] = m
        rstd[r] = inv
        mr, ir = mean[r], rstd[r]  # the stored (stash-dtype) values, as backward sees them
        for j in range(d):
            y[r, j] = (x[r, j] - mr) * ir * w[j] + b[j]


@njit(nogil=True, cache=True, parallel=True, error_model="numpy")
def _fwd_par(x, w, b, y, mean, rstd, eps, bounds):
    for t in prange(bounds.size - 1):
        _fwd_rows(x, w, b, y, mean, rstd, eps, bounds[t], bounds[t + 1])


@njit(nogil=True, cache=True, error_model="numpy")
def _bwd_part(dy, x, w, mean, rstd, dx, part, r0, r1, has_dx):
    """Rows r0..r1: dx (if ``has_dx``) and this part's sums of dy * xhat and dy."""
    d = x.shape[1]
    z = part.dtype.type(0)
    for j in range(d):
        part[0, j] = z
        part[1, j] = z
    for r in range(r0, r1):
        m, inv = mean[r], rstd[r]
        a = 0.0
        c = 0.0
        for j in range(d):
            xh = (x[r, j] - m) * inv
            g = dy[r, j]
            part[0, j] += g * xh
            part[1, j] += g
            gw = g * w[j]
            a += gw
            c += gw * xh
        if has_dx:
            a /= d
            c /= d
            ac = dx.dtype.type(a)
            cc = dx.dtype.type(c)
            for j in range(d):
                xh = (x[r, j] - m) * inv
                dx[r, j] = inv * (dy[r, j] * w[j] - ac - xh * cc)


@njit(nogil=True, cache=True, parallel=True, error_model="numpy")
def _bwd_par(dy, x, w, mean, rstd, dx, partials, has_dx, rows_per_part):
    n = x.shape[0]
    for p in prange(partials.shape[0]):
        r0 = p * rows_per_part
        _bwd_part(dy, x, w, mean, rstd, dx, partials[p], r0, min(n, r0 + rows_per_part),
                  has_dx)


@njit(nogil=True, cache=True, error_model="numpy")
def _bwd_serial(dy, x, w, mean, rstd, dx, partials, has_dx, rows_per_part):
    n = x.shape[0]
    for p in range(partials.shape[0]):
        r0 = p * rows_per_part
        _bwd_part(dy, x, w, mean, rstd, dx, partials[p], r0, min(n, r0 + rows_per_part),
                  has_dx)


@njit(nogil=True, cache=True, error_model="numpy")
def _sum_parts(partials, dw, db, accumulate):
    for j in range(partials.shape[2]):
        sw = partials[0, 0, j]
        sb = partials[0, 1, j]
        for p in range(1, partials.shape[0]):
            sw += partials[p, 0, j]
            sb += partials[p, 1, j]
        if accumulate:
            dw[j] += sw
            db[j] += sb
        else:
            dw[j] = sw
            db[j] = sb


# ---------------------------------------------------------------- references
def layernorm_forward_ref(x, weight, bias, y, mean, rstd, eps: float) -> None:
    """Reference of :func:`layernorm_forward` (the arrays' own library, float64 statistics)."""
    x64 = x.astype(np.float64)
    m = x64.mean(axis=1)
    v = ((x64 - m[:, None]) ** 2).mean(axis=1)
    mean[...] = m
    rstd[...] = 1.0 / namespace(x).sqrt(v + eps)
    np.multiply(x - mean[:, None], rstd[:, None], out=y)
    y *= weight
    y += bias


def layernorm_backward_ref(dy, x, weight, mean, rstd, dx, dweight, dbias,
                           accumulate: bool = False) -> None:
    """Reference of :func:`layernorm_backward` (no workspace; temporaries of x's size)."""
    xhat = (x - mean[:, None]) * rstd[:, None]
    gw = (dy * xhat).sum(axis=0)
    gb = dy.sum(axis=0)
    if dx is not None:
        g = dy * weight
        a = g.mean(axis=1, keepdims=True)
        c = (g * xhat).mean(axis=1, keepdims=True)
        np.subtract(g, a, out=dx)
        dx -= xhat * c
        dx *= rstd[:, None]
    if dweight is not None:
        if accumulate:
            dweight += gw
            dbias += gb
        else:
            dweight[...] = gw
            dbias[...] = gb


# ---------------------------------------------------------------- dispatchers
def _fast(*arrays) -> bool:
    return all(a is None or (type(a) is np.ndarray and a.flags.c_contiguous) for a in arrays)


def layernorm_forward(x, weight, bias, y, mean, rstd, eps: float) -> None:
    """``x``, ``y`` (rows, D); ``weight``, ``bias`` (D,); ``mean``, ``rstd`` (rows,) written."""
    if not _fast(x, weight, bias, y, mean, rstd):
        return layernorm_forward_ref(x, weight, bias, y, mean, rstd, eps)
    ensure_blas_policy()
    rows = x.shape[0]
    bounds = split(rows, num_threads(), x.size, SERIAL_ELEMS)
    if bounds is None:
        _fwd_rows(x, weight, bias, y, mean, rstd, eps, 0, rows)
    else:
        _fwd_par(x, weight, bias, y, mean, rstd, eps, bounds)


def layernorm_backward(dy, x, weight, mean, rstd, dx, dweight, dbias, workspace,
                       accumulate: bool = False) -> None:
    """``dx`` (or ``None``) overwritten, ``dweight`` / ``dbias`` overwritten (added into with
    ``accumulate``); ``workspace``: float partials of :func:`backward_workspace_shape` (only
    the Numba path uses it). ``dx`` may be ``dy``."""
    if not _fast(dy, x, weight, mean, rstd, dx, dweight, dbias):
        return layernorm_backward_ref(dy, x, weight, mean, rstd, dx, dweight, dbias, accumulate)
    ensure_blas_policy()
    has_dx = dx is not None
    out = dx if has_dx else dy  # not written when has_dx is false
    partials = workspace
    serial = split(partials.shape[0], num_threads(), x.size, SERIAL_ELEMS) is None
    (_bwd_serial if serial else _bwd_par)(dy, x, weight, mean, rstd, out, partials, has_dx,
                                          ROWS_PER_PART)
    _sum_parts(partials, dweight, dbias, accumulate)

"""Layer normalisation over the last axis: NumPy references, multi-threaded Numba kernels and
Numba CUDA kernels for device arrays.

Arrays are seen as (rows, D). Forward writes ``y = (x - mean) * rstd * weight + bias`` and
the per-row ``mean`` and ``rstd = 1 / sqrt(var + eps)`` (biased variance; both accumulated in
float64 per row, stored in the stash dtype). Backward rebuilds ``xhat`` from ``x`` and the
stash and writes

    dx = rstd * (g - mean(g) - xhat * mean(g * xhat)),  g = dy * weight,
    dweight = sum_rows(dy * xhat),  dbias = sum_rows(dy).

Rows are independent, so the row loops split over threads freely; the parameter gradients are
summed over fixed parts of :data:`ROWS_PER_PART` rows (partials in the workspace, added in part
order), so results never depend on the thread count. ``dx`` may be ``dy`` (in place): a row of
``dy`` is read before the same row of ``dx`` is written.

Device arrays (C-contiguous, float32 / float64) take Numba CUDA kernels with the same
arithmetic and no temporary: forward is one launch (a block per row: float64 sums of the row
and of its squared deviations in a fixed tree order, then the affine output); backward is
three (two without ``dx``): the parts' parameter-gradient partials into the workspace (one
thread per part and column, rows in order, in the float dtype as the host loop sums them),
their sum in part order (the host's arithmetic in the host's order: its bits, but where the
GPU fuses a multiply and an add), then ``dx`` (a block per row). No atomics: deterministic,
and independent of the launch shape. Other arrays take the references, built from the arrays'
own library.
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
from ..parallel import ensure_blas_policy, num_threads, split

#: Rows per part of the parameter-gradient sums (fixed: the sums never depend on threads).
ROWS_PER_PART = 256
#: Elements below which a call runs on the calling thread alone.
SERIAL_ELEMS = 1 << 15
#: Most threads of a row block, and most blocks of a launch (device kernels).
BLOCK = _cuda.BLOCK
MAX_BLOCKS = _cuda.MAX_BLOCKS

cuda: Any = None  # numba.cuda, set by _cuda.bind on first CUDA use


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


# ---------------------------------------------------------------- CUDA kernels
_block_sum_py = _cuda.block_sum_py  # the block reduction, bound as a device function

_d_block_sum: Any = None  # the CUDA device version of _block_sum_py (bind's device=)


def _k_ln_fwd(x, w, b, y, mean, rstd, eps):
    """A block per row: float64 mean and biased variance (two passes), the stash, then ``y``
    from the stored (stash-dtype) statistics as the host loop."""
    part = cuda.shared.array(BLOCK, np.float64)
    rows, d = x.shape
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    for r in range(cuda.blockIdx.x, rows, cuda.gridDim.x):
        acc = 0.0
        for j in range(tid, d, nt):
            acc += x[r, j]
        part[tid] = acc
        m = _d_block_sum(part) / d
        acc = 0.0
        for j in range(tid, d, nt):
            t = x[r, j] - m
            acc += t * t
        part[tid] = acc
        var = _d_block_sum(part) / d
        if tid == 0:
            mean[r] = m
            rstd[r] = 1.0 / math.sqrt(var + eps)
        cuda.syncthreads()
        mr = mean[r]
        ir = rstd[r]
        for j in range(tid, d, nt):
            y[r, j] = (x[r, j] - mr) * ir * w[j] + b[j]


def _k_ln_bwd_partials(dy, x, mean, rstd, partials, rows_per_part):
    """``partials[p] = (sum dy * xhat, sum dy)`` over the rows of part p, per column: one
    thread per (part, column), rows in order, summed in the float dtype (the host's loop)."""
    rows = x.shape[0]
    d = partials.shape[2]
    acc = cuda.local.array(2, partials.dtype)
    for e in range(cuda.grid(1), partials.shape[0] * d, cuda.gridsize(1)):
        p = e // d
        j = e - p * d
        r0 = p * rows_per_part
        r1 = r0 + rows_per_part if r0 + rows_per_part < rows else rows
        acc[0] = 0
        acc[1] = 0
        for r in range(r0, r1):
            xh = (x[r, j] - mean[r]) * rstd[r]
            g = dy[r, j]
            acc[0] += g * xh
            acc[1] += g
        partials[p, 0, j] = acc[0]
        partials[p, 1, j] = acc[1]


def _k_ln_bwd_sum(partials, dw, db, accumulate):
    """``dw`` / ``db`` (written, or added into) from the partials summed in part order."""
    acc = cuda.local.array(2, partials.dtype)
    for j in range(cuda.grid(1), partials.shape[2], cuda.gridsize(1)):
        acc[0] = partials[0, 0, j]
        acc[1] = partials[0, 1, j]
        for p in range(1, partials.shape[0]):
            acc[0] += partials[p, 0, j]
            acc[1] += partials[p, 1, j]
        if accumulate:
            dw[j] += acc[0]
            db[j] += acc[1]
        else:
            dw[j] = acc[0]
            db[j] = acc[1]


def _k_ln_bwd_dx(dy, x, w, mean, rstd, dx):
    """A block per row: float64 sums of ``g = dy * w`` and ``g * xhat`` (tree order), then
    ``dx`` in the float dtype as the host loop (``dx`` may be ``dy``: each thread reads the
    elements it writes, and the row's sums are complete before any is written)."""
    part_a = cuda.shared.array(BLOCK, np.float64)
    part_c = cuda.shared.array(BLOCK, np.float64)
    means = cuda.shared.array(2, dx.dtype)
    rows, d = x.shape
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    for r in range(cuda.blockIdx.x, rows, cuda.gridDim.x):
        m = mean[r]
        inv = rstd[r]
        a = 0.0
        c = 0.0
        for j in range(tid, d, nt):
            xh = (x[r, j] - m) * inv
            gw = dy[r, j] * w[j]
            a += gw
            c += gw * xh
        part_a[tid] = a
        part_c[tid] = c
        a = _d_block_sum(part_a)
        c = _d_block_sum(part_c)
        if tid == 0:
            means[0] = a / d  # rounded to the float dtype, as the host's
            means[1] = c / d
        cuda.syncthreads()
        ac = means[0]
        cc = means[1]
        for j in range(tid, d, nt):
            xh = (x[r, j] - m) * inv
            dx[r, j] = inv * (dy[r, j] * w[j] - ac - xh * cc)
        cuda.syncthreads()  # (means is written again for the next row)


@functools.cache
def _kernels() -> SimpleNamespace:
    return _cuda.bind(globals(), ["_k_ln_fwd", "_k_ln_bwd_partials", "_k_ln_bwd_sum",
                                  "_k_ln_bwd_dx"], device={"_d_block_sum": "_block_sum_py"})


def _on_device(*arrays) -> bool:
    present = [a for a in arrays if a is not None]
    return _cuda.is_device_array(present[0]) and all(
        _cuda.is_device_array(a) and a.flags.c_contiguous and a.dtype == present[0].dtype
        for a in present) and present[0].dtype in (np.float32, np.float64)


def layernorm_forward_device(x, weight, bias, y, mean, rstd, eps: float) -> None:
    """:func:`layernorm_forward` on C-contiguous device arrays: one launch."""
    _cuda.launch_blocks(_kernels().k_ln_fwd, *x.shape, x, weight, bias, y, mean, rstd,
                        float(eps))


def layernorm_backward_device(dy, x, weight, mean, rstd, dx, dweight, dbias, workspace,
                              accumulate: bool = False) -> None:
    """:func:`layernorm_backward` on C-contiguous device arrays: the parameter gradients
    through the workspace partials (two launches), then ``dx`` (one)."""
    rows, d = x.shape
    k = _kernels()
    if dweight is not None:
        if rows == 0:
            if not accumulate:
                dweight.fill(0)
                dbias.fill(0)
        else:
            partials = workspace[:parts(rows)]
            _cuda.launch(k.k_ln_bwd_partials, partials.shape[0] * d, dy, x, mean, rstd,
                         partials, ROWS_PER_PART)
            _cuda.launch(k.k_ln_bwd_sum, d, partials, dweight, dbias, bool(accumulate))
    if dx is not None:
        _cuda.launch_blocks(k.k_ln_bwd_dx, rows, d, dy, x, weight, mean, rstd, dx)


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
    if _on_device(x, weight, bias, y, mean, rstd):
        return layernorm_forward_device(x, weight, bias, y, mean, rstd, eps)
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
    the Numba and CUDA paths use it). ``dx`` may be ``dy``."""
    if _on_device(dy, x, weight, mean, rstd, dx, dweight, dbias, workspace):
        return layernorm_backward_device(dy, x, weight, mean, rstd, dx, dweight, dbias,
                                         workspace, accumulate)
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

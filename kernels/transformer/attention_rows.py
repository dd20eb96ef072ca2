"""The row kernels of attention (:mod:`.attention`): softmax (whole rows, or one key tile of
a running softmax), probabilities rebuilt from the row log-sum-exp, dropout masks hashed from
(seed, flat index), the score gradient, and per-head row dot products.

Tiles are (N, R, C) with N = B*H; a tile's rows are rows r0.. and its columns c0.. of the
(T, T) score matrix; per-row vectors are (N, T). Each kernel has a serial row-range body and a
threaded driver over row bounds: rows are independent and each is done by one thread, so no
result depends on the thread count. NumPy arrays take the Numba kernels, device arrays of a
float dtype the Numba CUDA kernels of :mod:`.transformer_device` (one launch each, no
temporary), others the references (the arrays' own library).
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from ..array_api import namespace
from ..parallel import num_threads, split
from ..pointwise.dropout import _mix, _mix_ref, keep_threshold, seed_keys
from ..recurrent.rnn import _exp_parts
from . import transformer_device as td

#: Elements below which a kernel runs on the calling thread alone.
SERIAL_ELEMS = 1 << 15


@njit(nogil=True, cache=True, error_model="numpy")
def _valid(causal, r, c0, cols):
    """Number of leading columns of a tile row not masked (causal: keys up to the query)."""
    return min(cols, r - c0 + 1) if causal else cols


@njit(nogil=True, cache=True, inline="always", error_model="numpy")
def _exp_nonpositive(y, vectorised):
    """exp(y) for y <= 0 (or NaN): libm's, or with ``vectorised`` the branch-free exp of
    :mod:`.rnn` (relative error < 3e-10: exact after rounding to float32 but in rare ties),
    which LLVM vectorises where libm's call is one value at a time."""
    if vectorised:
        y = -700.0 if y < -700.0 else y  # exp(-700) is 0 in float32; NaN passes through
        sc, p = _exp_parts(y)
        return sc + sc * p
    return math.exp(y)


@njit(nogil=True, cache=True, error_model="numpy")
def _softmax_rows(s, scale, causal, i0, i1):
    rows, cols = s.shape[1], s.shape[2]
    z = s.dtype.type(0)
    vectorised = s.itemsize == 4  # float32 scores: the vectorised exp; float64: libm's
    for k in range(i0, i1):
        n, r = k // rows, k % rows
        v = _valid(causal, r, 0, cols)
        mx = -np.inf
        for c in range(v):
            mx = max(mx, s[n, r, c] * scale)
        tot = 0.0
        for c in range(v):
            e = _exp_nonpositive(s[n, r, c] * scale - mx, vectorised)
            s[n, r, c] = e
            tot += s[n, r, c]
        inv = 1.0 / tot
        for c in range(v):
            s[n, r, c] = s[n, r, c] * inv
        for c in range(v, cols):
            s[n, r, c] = z


@njit(nogil=True, cache=True, error_model="numpy")
def _online_rows(s, m, l, alpha, scale, causal, r0, c0, first, i0, i1):
    """One key tile of the running softmax: s -> exp(s*scale - new max), the tile rows'
    running max ``m`` and sum ``l`` (N, R) updated, alpha = exp(old max - new max) (the
    factor of the output accumulated so far)."""
    rows, cols = s.shape[1], s.shape[2]
    z = s.dtype.type(0)
    for k in range(i0, i1):
        n, r = k // rows, k % rows
        v = _valid(causal, r0 + r, c0, cols)
        old = -np.inf if first else float(m[n, r])
        mx = old
        for c in range(v):
            mx = max(mx, s[n, r, c] * scale)
        tot = 0.0
        for c in range(v):
            s[n, r, c] = math.exp(s[n, r, c] * scale - mx)
            tot += s[n, r, c]
        for c in range(v, cols):
            s[n, r, c] = z
        alpha[n, r] = 0.0 if first else math.exp(old - mx)
        m[n, r] = mx
        l[n, r] = tot if first else l[n, r] * alpha[n, r] + tot


@njit(nogil=True, cache=True, error_model="numpy")
def _probs_rows(s, lse, scale, causal, r0, c0, i0, i1):
    """s -> exp(s*scale - lse) (the softmax rebuilt from the row log-sum-exp), masked."""
    rows, cols = s.shape[1], s.shape[2]
    z = s.dtype.type(0)
    for k in range(i0, i1):
        n, r = k // rows, k % rows
        v = max(0, _valid(causal, r0 + r, c0, cols))
        g = float(lse[n, r0 + r])
        for c in range(v):
            s[n, r, c] = math.exp(s[n, r, c] * scale - g)
        for c in range(v, cols):
            s[n, r, c] = z


@njit(nogil=True, cache=True, error_model="numpy")
def _dropout_rows(p, out, seq, r0, c0, k0, k1, thresh, dscale, i0, i1):
    rows, cols = p.shape[1], p.shape[2]
    z = p.dtype.type(0)
    for k in range(i0, i1):
        n, r = k // rows, k % rows
        base = (n * seq + r0 + r) * seq + c0
        for c in range(cols):
            h = _mix(_mix(np.uint64(base + c) ^ k0) ^ k1)
            out[n, r, c] = p[n, r, c] * dscale if h >= thresh else z


@njit(nogil=True, cache=True, error_model="numpy")
def _dscores_rows(dp, p, pd, delta, scale, r0, i0, i1):
    """dp -> (pd * dp - p * delta) * scale (pd: the dropped probabilities, or p itself)."""
    rows, cols = dp.shape[1], dp.shape[2]
    sc = dp.dtype.type(scale)
    for k in range(i0, i1):
        n, r = k // rows, k % rows
        d = delta[n, r0 + r]
        for c in range(cols):
            dp[n, r, c] = (pd[n, r, c] * dp[n, r, c] - p[n, r, c] * d) * sc


@njit(nogil=True, cache=True, error_model="numpy")
def _rowdot_rows(a, b, out, heads, i0, i1):
    """out[n, t] = dot of head n % heads of rows t of a and b (B, T, D) (n = batch*H + h)."""
    seq, dim = a.shape[1], a.shape[2]
    hd = dim // heads
    for k in range(i0, i1):
        bt, t = k // seq, k % seq
        for h in range(heads):
            acc = 0.0
            for j in range(h * hd, (h + 1) * hd):
                acc += a[bt, t, j] * b[bt, t, j]
            out[bt * heads + h, t] = acc


@njit(nogil=True, cache=True, parallel=True, error_model="numpy")
def _softmax_par(s, scale, causal, bounds):
    for t in prange(bounds.size - 1):
        _softmax_rows(s, scale, causal, bounds[t], bounds[t + 1])


@njit(nogil=True, cache=True, parallel=True, error_model="numpy")
def _online_par(s, m, l, alpha, scale, causal, r0, c0, first, bounds):
    for t in prange(bounds.size - 1):
        _online_rows(s, m, l, alpha, scale, causal, r0, c0, first, bounds[t], bounds[t + 1])


@njit(nogil=True, cache=True, parallel=True, error_model="numpy")
def _probs_par(s, lse, scale, causal, r0, c0, bounds):
    for t in prange(bounds.size - 1):
        _probs_rows(s, lse, scale, causal, r0, c0, bounds[t], bounds[t + 1])


@njit(nogil=True, cache=True, parallel=True, error_model="numpy")
def _dropout_par(p, out, seq, r0, c0, k0, k1, thresh, dscale, bounds):
    for t in prange(bounds.size - 1):
        _dropout_rows(p, out, seq, r0, c0, k0, k1, thresh, dscale, bounds[t], bounds[t + 1])


@njit(nogil=True, cache=True, parallel=True, error_model="numpy")
def _dscores_par(dp, p, pd, delta, scale, r0, bounds):
    for t in prange(bounds.size - 1):
        _dscores_rows(dp, p, pd, delta, scale, r0, bounds[t], bounds[t + 1])


@njit(nogil=True, cache=True, parallel=True, error_model="numpy")
def _rowdot_par(a, b, out, heads, bounds):
    for t in prange(bounds.size - 1):
        _rowdot_rows(a, b, out, heads, bounds[t], bounds[t + 1])


def _launch(serial, par, args: tuple, rows: int, elems: int) -> None:
    bounds = split(rows, num_threads(), elems, SERIAL_ELEMS)
    if bounds is None:
        serial(*args, 0, rows)
    else:
        par(*args, bounds)


# ---------------------------------------------------------------- references
def _col_mask(xp, rows: int, cols: int, r0: int, c0: int):
    """True where a tile entry is masked by causality (key after query)."""
    return (xp.arange(c0, c0 + cols)[None, :] > xp.arange(r0, r0 + rows)[:, None])[None]


def _softmax_ref(s, scale, causal):
    xp = namespace(s)
    s *= s.dtype.type(scale)
    if causal:
        s[xp.broadcast_to(_col_mask(xp, s.shape[1], s.shape[2], 0, 0), s.shape)] = -np.inf
    s -= s.max(axis=2, keepdims=True)
    np.exp(s, out=s)
    s /= s.sum(axis=2, keepdims=True)


def _online_ref(s, m, l, alpha, scale, causal, r0, c0, first):
    xp = namespace(s)
    rows = s.shape[1]
    s *= s.dtype.type(scale)
    if causal:
        s[xp.broadcast_to(_col_mask(xp, rows, s.shape[2], r0, c0), s.shape)] = -np.inf
    new = s.max(axis=2) if first else xp.maximum(m, s.max(axis=2))
    s -= new[:, :, None]
    np.exp(s, out=s)
    if first:
        alpha[...] = 0
        l[...] = s.sum(axis=2)
    else:
        np.exp(m - new, out=alpha)
        l *= alpha
        l += s.sum(axis=2)
    m[...] = new


def _probs_ref(s, lse, scale, causal, r0, c0):
    xp = namespace(s)
    rows = s.shape[1]
    s *= s.dtype.type(scale)
    s -= lse[:, r0:r0 + rows, None]
    np.exp(s, out=s)
    if causal:
        s[xp.broadcast_to(_col_mask(xp, rows, s.shape[2], r0, c0), s.shape)] = 0


def _dropout_ref(p, out, seq, r0, c0, k0, k1, thresh, dscale):
    xp = namespace(p)
    n, rows, cols = p.shape
    idx = ((xp.arange(n, dtype=np.uint64)[:, None, None] * seq
            + xp.arange(r0, r0 + rows, dtype=np.uint64)[None, :, None]) * seq
           + xp.arange(c0, c0 + cols, dtype=np.uint64)[None, None, :])
    h = (idx & np.uint64(0xFFFFFFFF)).astype(np.uint32)
    t = xp.empty_like(h)
    np.bitwise_xor(h, np.uint32(k0), out=h)
    _mix_ref(h, t)
    np.bitwise_xor(h, np.uint32(k1), out=h)
    _mix_ref(h, t)
    np.multiply(p, (h >= np.uint32(thresh)).astype(p.dtype), out=out)
    out *= p.dtype.type(dscale)


def _dscores_ref(dp, p, pd, delta, scale, r0):
    rows = dp.shape[1]
    dp *= pd
    dp -= p * delta[:, r0:r0 + rows, None]
    dp *= dp.dtype.type(scale)


def _rowdot_ref(a, b, out, heads):
    bsz, seq, dim = a.shape
    prod = (a * b).reshape(bsz, seq, heads, dim // heads).sum(axis=3)
    out[...] = prod.transpose(0, 2, 1).reshape(bsz * heads, seq)


# ---------------------------------------------------------------- dispatch of the row kernels
def _host(*arrays) -> bool:
    return all(type(a) is np.ndarray for a in arrays)


def softmax_rows(s, scale: float, causal: bool) -> None:
    """In place over a (N, T, T) score array: ``softmax(s * scale)`` per row (causal: keys
    after the query get probability 0)."""
    if _host(s):
        _launch(_softmax_rows, _softmax_par, (s, scale, causal), s.shape[0] * s.shape[1], s.size)
    elif td.device_ok(s):
        td.softmax_rows(s, scale, causal)
    else:
        _softmax_ref(s, scale, causal)


def online_rows(s, m, l, alpha, scale: float, causal: bool, r0: int, c0: int,
                first: bool) -> None:
    """One key tile (rows r0.., columns c0..) of the running softmax; ``m``, ``l``, ``alpha``
    (N, R): the tile rows' running max and sum, and the factor of what was accumulated."""
    if _host(s, m, l, alpha):
        _launch(_online_rows, _online_par, (s, m, l, alpha, scale, causal, r0, c0, first),
                s.shape[0] * s.shape[1], s.size)
    elif td.device_ok(s, m, l, alpha):
        td.online_rows(s, m, l, alpha, scale, causal, r0, c0, first)
    else:
        _online_ref(s, m, l, alpha, scale, causal, r0, c0, first)


def probs_rows(s, lse, scale: float, causal: bool, r0: int, c0: int) -> None:
    """In place: a tile's probabilities ``exp(s * scale - lse)`` (masked)."""
    if _host(s, lse):
        _launch(_probs_rows, _probs_par, (s, lse, scale, causal, r0, c0),
                s.shape[0] * s.shape[1], s.size)
    elif td.device_ok(s, lse):
        td.probs_rows(s, lse, scale, causal, r0, c0)
    else:
        _probs_ref(s, lse, scale, causal, r0, c0)


def dropout_rows(p, out, p_drop: float, seed: int, seq: int, r0: int, c0: int) -> None:
    """``out = p * keep / (1 - p_drop)`` on a tile, ``keep`` hashed from (seed, flat index in
    the (N, seq, seq) matrix); ``out`` may be ``p``."""
    k0, k1 = seed_keys(seed)
    thresh, dscale = keep_threshold(p_drop), 1.0 / (1.0 - p_drop)
    if _host(p, out):
        _launch(_dropout_rows, _dropout_par, (p, out, seq, r0, c0, np.uint64(k0),
                np.uint64(k1), np.uint64(thresh), p.dtype.type(dscale)),
                p.shape[0] * p.shape[1], p.size)
    elif td.device_ok(p, out):
        td.dropout_rows(p, out, seq, r0, c0, k0, k1, thresh, dscale)
    else:
        _dropout_ref(p, out, seq, r0, c0, k0, k1, thresh, dscale)


def dscores_rows(dp, p, pd, delta, scale: float, r0: int, c0: int = 0,
                 causal: bool = False) -> None:
    """In place: ``dp = (pd * dp - p * delta) * scale`` (``pd`` may be ``p``). ``c0`` and
    ``causal`` matter to device arrays only: there the masked entries (key after query) are
    written as 0 without reading ``dp`` (the device ``keep`` form leaves them uncomputed);
    elsewhere they are computed from ``dp`` (``p`` and ``pd`` are 0 there)."""
    if _host(dp, p, pd, delta):
        _launch(_dscores_rows, _dscores_par, (dp, p, pd, delta, scale, r0),
                dp.shape[0] * dp.shape[1], dp.size)
    elif td.device_ok(dp, p, pd, delta):
        td.dscores_rows(dp, p, pd, delta, scale, r0, c0, causal)
    else:
        _dscores_ref(dp, p, pd, delta, scale, r0)


def rowdot(a, b, out, heads: int) -> None:
    """``out`` (B*H, T) = per head and row, the dot product of ``a`` and ``b`` (B, T, D)."""
    if _host(a, b, out) and a.flags.c_contiguous and b.flags.c_contiguous:
        _launch(_rowdot_rows, _rowdot_par, (a, b, out, heads), a.shape[0] * a.shape[1], a.size)
    elif td.device_ok(a, b, out):
        td.rowdot(a, b, out, heads)
    else:
        _rowdot_ref(a, b, out, heads)

"""LSTM and GRU cell kernels: fused element-wise gate math, a NumPy reference and a Numba CPU
version of each (the recurrent GEMMs stay in the layers, through NumPy's own BLAS).

Gate orders and formulas are PyTorch's. LSTM: gates ``[i, f, g, o]``, ``c = f*c_prev + i*g``,
``h = o*tanh(c)``. GRU: gates ``[r, z, n]``, ``n = tanh(gx_n + r*(W_hn h_prev + b_hn))``,
``h = (1-z)*n + z*h_prev``.

Accuracy: float32 kernels evaluate sigmoid and tanh in float64 with an exp of their own
(Cody-Waite reduction, degree-8 Taylor polynomial with FMA contraction, exponent built from
bits), branch-free so that LLVM vectorises the loops (~0.7 ns per value on AVX-512; Numba's
``math.exp`` / ``math.tanh`` are scalar libm calls here). Results are within float32 rounding
of the exact values (max relative error < 6e-8, i.e. one rounding; NumPy's own float32
``np.tanh`` is at 1.1e-7). float64 kernels use libm (``math.tanh`` / ``math.exp``), exact to
float64 rounding, for gradient checks.

All Numba loops are ``nogil``; NumPy arrays of any layout go to them. Device arrays (CuPy's,
C-contiguous, float32 / float64) go to the Numba CUDA kernels of :mod:`.rnn_device`, one
launch per cell call (the gate-major recurrent product as the CPU takes it; the bias gradient
by one column-sum reduction); anything else (other device layouts through NumPy's dispatch
protocols) to the NumPy references.
"""

from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic, overload

from . import rnn_device as dev

_JIT = {"cache": True, "nogil": True, "error_model": "numpy"}


# ---------------------------------------------------------------- accurate vectorisable math
@intrinsic
def _f64_from_bits(typingctx, i):
    if isinstance(i, types.Integer) and i.bitwidth == 64:
        def codegen(context, builder, sig, args):
            return builder.bitcast(args[0], ir.DoubleType())
        return types.float64(i), codegen
    return None


@intrinsic
def _f64_bits(typingctx, x):
    if x == types.float64:
        def codegen(context, builder, sig, args):
            return builder.bitcast(args[0], ir.IntType(64))
        return types.int64(x), codegen
    return None


_LOG2E = 1.4426950408889634
_LN2_HI = 6.93147180369123816490e-01  # ln 2 split in two (fdlibm): hi has 32 free low bits
_LN2_LO = 1.90821492927058770002e-10
_SHIFT = 6755399441055744.0  # 1.5 * 2**52: adding it rounds to an integer, kept in the low bits


_FM = {"contract"}  # FMA contraction only: exact rounding of each fused op, no reassociation


@njit(fastmath=_FM)
def _exp_parts(y):
    """(s, p) with exp(y) = s * (1 + p), s = 2**k, |y - k ln 2| <= ln(2)/2; |y| < 700.

    ``p`` = expm1 of the reduced argument (degree-8 Taylor, relative error < 3e-10), so
    ``expm1(y) = s*p + (s - 1)`` keeps full relative accuracy near 0.
    """
    kf = y * _LOG2E + _SHIFT
    ki = _f64_bits(kf)
    kf = kf - _SHIFT
    r = (y - kf * _LN2_HI) - kf * _LN2_LO
    p = r * (1.0 + r * (1 / 2 + r * (1 / 6 + r * (1 / 24 + r * (
        1 / 120 + r * (1 / 720 + r * (1 / 5040 + r * (1 / 40320))))))))
    s = _f64_from_bits((ki + 1023) << 52)
    return s, p


@njit(fastmath=_FM)
def _tanh32(x):
    v = np.float64(x)
    a = abs(v)
    a = 10.0 if a > 10.0 else a  # tanh(10) rounds to 1 in float32; NaN passes through
    s, p = _exp_parts(-2.0 * a)
    em1 = s * p + (s - 1.0)  # expm1(-2a) in [-1, 0]
    t = -em1 / (2.0 + em1)
    return np.float32(math.copysign(t, v))


@njit(fastmath=_FM)
def _sigmoid32(x):
    v = np.float64(x)
    a = abs(v)
    a = 120.0 if a > 120.0 else a  # sigmoid(-120) is 0 in float32; NaN passes through
    s, p = _exp_parts(-a)
    e = s + s * p  # exp(-|v|) in (0, 1]
    r = 1.0 / (1.0 + e)
    return np.float32(r if v >= 0.0 else e * r)


def act_tanh(x):
    """tanh of a scalar inside Numba kernels (float32: vectorisable and accurate)."""
    return math.tanh(x)


def act_sigmoid(x):
    """Logistic sigmoid of a scalar inside Numba kernels (float32: vectorisable, accurate)."""
    return 1.0 / (1.0 + math.exp(-x))


@overload(act_tanh)
def _act_tanh_ol(x):
    if x == types.float32:
        return lambda x: _tanh32(x)
    if isinstance(x, types.Float):
        return lambda x: math.tanh(x)
    return None


@overload(act_sigmoid)
def _act_sigmoid_ol(x):
    if x == types.float32:
        return lambda x: _sigmoid32(x)
    if isinstance(x, types.Float):
        return lambda x: 1.0 / (1.0 + math.exp(-x))
    return None


@njit(**_JIT)
def tanh_nb(x, out):
    """out = tanh(x) on 1-D arrays with the kernels' activation (for tests and benchmarks)."""
    for i in range(x.size):
        out[i] = act_tanh(x[i])


@njit(**_JIT)
def sigmoid_nb(x, out):
    """out = sigmoid(x) on 1-D arrays with the kernels' activation."""
    for i in range(x.size):
        out[i] = act_sigmoid(x[i])


# ---------------------------------------------------------------- Numba CPU loops
_TILE = 8  # batch rows gathered at once from a gate-major product

# Row by row, in short passes that each write one stream at one offset: a loop writing one
# array at several offsets (gate blocks) defeats LLVM's dependence analysis and would not
# vectorise. Loops run over range(hid) with the offset in the index (range(lo, hi) does not
# vectorise either). Each pass works on one row, which stays in L1.
@njit(**_JIT)
def _lstm_fwd_nb(hw_t, gx, bias, c_prev, gates, h, c):
    n_rows, hid = h.shape
    g4 = 4 * hid
    # hw_t is gate-major (4H, N): gather _TILE of its columns at a time into a row-major
    # tile (one read of _TILE consecutive floats per gate row, instead of one cache line per
    # value: 70 -> 60 us per step for N = 32, H = 256)
    tile = np.empty((_TILE, g4), dtype=gates.dtype)
    for n0 in range(0, n_rows, _TILE):
        nb = min(_TILE, n_rows - n0)
        for j in range(g4):
            hr = hw_t[j]
            for q in range(nb):
                tile[q, j] = hr[n0 + q]
        for q in range(nb):
            n = n0 + q
            gr, gxr, cr, hr, cpr, tr = gates[n], gx[n], c[n], h[n], c_prev[n], tile[q]
            for j in range(g4):  # pre-activations
                gr[j] = tr[j] + gxr[j] + bias[j]
            for j in range(2 * hid):  # i, f
                gr[j] = act_sigmoid(gr[j])
            for j in range(hid):  # g
                gr[2 * hid + j] = act_tanh(gr[2 * hid + j])
            for j in range(hid):  # o
                gr[3 * hid + j] = act_sigmoid(gr[3 * hid + j])
            for j in range(hid):
                cr[j] = gr[hid + j] * cpr[j] + gr[j] * gr[2 * hid + j]
            for j in range(hid):
                hr[j] = gr[3 * hid + j] * act_tanh(cr[j])


@njit(**_JIT)
def _lstm_bwd_nb(dh, dc, gates, c, c_prev, one, dgates, dc_prev, write_dc_prev, dbias):
    n_rows, hid = c.shape
    dct = np.empty(hid, dtype=c.dtype)  # total gradient of c, one row
    for j in range(4 * hid):
        dbias[j] = 0
    for n in range(n_rows):
        gr, dgr, dhr = gates[n], dgates[n], dh[n]
        cr, dcr, cpr = c[n], dc[n], c_prev[n]
        for j in range(hid):
            o_ = gr[3 * hid + j]
            tc = act_tanh(cr[j])
            dct[j] = dcr[j] + dhr[j] * o_ * (one - tc * tc)
            dgr[3 * hid + j] = dhr[j] * tc * (o_ * (one - o_))
        for j in range(hid):
            i_ = gr[j]
            dgr[j] = dct[j] * gr[2 * hid + j] * (i_ * (one - i_))
        for j in range(hid):
            f_ = gr[hid + j]
            dgr[hid + j] = dct[j] * cpr[j] * (f_ * (one - f_))
        for j in range(hid):
            g_ = gr[2 * hid + j]
            dgr[2 * hid + j] = dct[j] * gr[j] * (one - g_ * g_)
        if write_dc_prev:
            dcpr = dc_prev[n]
            for j in range(hid):
                dcpr[j] = dct[j] * gr[hid + j]
        for j in range(4 * hid):
            dbias[j] += dgr[j]


@njit(**_JIT)
def _gru_fwd_nb(gx, hw_t, bias, h_prev, stash, h):
    n_rows, hid = h.shape
    for n in range(n_rows):
        gxr, st, hr, hpr = gx[n], stash[n], h[n], h_prev[n]
        for j in range(2 * hid):  # strided reads of hw_t
            st[j] = hw_t[j, n] + bias[j]
        for j in range(hid):  # W_hn h_prev + b_hn
            st[3 * hid + j] = hw_t[2 * hid + j, n] + bias[2 * hid + j]
        for j in range(2 * hid):  # r, z
            st[j] = act_sigmoid(gxr[j] + st[j])
        for j in range(hid):  # n, kept in h for now
            hr[j] = act_tanh(gxr[2 * hid + j] + st[j] * st[3 * hid + j])
        for j in range(hid):
            st[2 * hid + j] = hr[j]
        for j in range(hid):
            hr[j] = hr[j] + st[hid + j] * (hpr[j] - hr[j])


@njit(**_JIT)
def _gru_bwd_nb(dh, stash, h_prev, one, dgx, dgh, dbias):
    n_rows, hid = dh.shape
    for j in range(3 * hid):
        dbias[j] = 0
    for n in range(n_rows):
        dhr, st, hpr, dgxr, dghr = dh[n], stash[n], h_prev[n], dgx[n], dgh[n]
        for j in range(hid):  # dn (pre-activation)
            z = st[hid + j]
            nn = st[2 * hid + j]
            dgxr[2 * hid + j] = dhr[j] * (one - z) * (one - nn * nn)
        for j in range(hid):  # dz
            z = st[hid + j]
            dgxr[hid + j] = dhr[j] * (hpr[j] - st[2 * hid + j]) * (z * (one - z))
        for j in range(hid):  # dr = dn * ghn * r(1-r)
            r = st[j]
            z = st[hid + j]
            nn = st[2 * hid + j]
            dn = dhr[j] * (one - z) * (one - nn * nn)
            dgxr[j] = dn * st[3 * hid + j] * (r * (one - r))
        for j in range(2 * hid):
            dghr[j] = dgxr[j]
        for j in range(hid):
            dghr[2 * hid + j] = dgxr[2 * hid + j] * st[j]
        for j in range(3 * hid):
            dbias[j] += dghr[j]


@njit(**_JIT)
def _add_mul_nb(acc, a, stash, col):
    """acc += a * stash[:, col:col + H] (GRU's direct path dh * z into dh_prev)."""
    n_rows, hid = acc.shape
    for n in range(n_rows):
        ar, xr, sr = acc[n], a[n], stash[n]
        for j in range(hid):
            ar[j] += xr[j] * sr[col + j]


# ---------------------------------------------------------------- NumPy references
def _sigmoid_ref(x):
    with np.errstate(over="ignore"):
        return 1 / (1 + np.exp(-x))


def lstm_forward_ref(hw_t, gx, bias, c_prev, gates, h, c) -> None:
    hid = h.shape[1]
    pre = hw_t.T + gx + bias
    i_, f_, o_ = (_sigmoid_ref(pre[:, k * hid:(k + 1) * hid]) for k in (0, 1, 3))
    g_ = np.tanh(pre[:, 2 * hid:3 * hid])
    cc = f_ * c_prev + i_ * g_
    gates[...] = np.concatenate([i_, f_, g_, o_], axis=1)
    c[...] = cc
    h[...] = o_ * np.tanh(cc)


def lstm_backward_ref(dh, dc, gates, c, c_prev, dgates, dc_prev, dbias) -> None:
    hid = c.shape[1]
    i_, f_, g_, o_ = (gates[:, k * hid:(k + 1) * hid] for k in range(4))
    tc = np.tanh(c)
    dct = dc + dh * o_ * (1 - tc * tc)
    d = np.concatenate([dct * g_ * (i_ * (1 - i_)), dct * c_prev * (f_ * (1 - f_)),
                        dct * i_ * (1 - g_ * g_), dh * tc * (o_ * (1 - o_))], axis=1)
    dgates[...] = d
    dbias[...] = d.sum(axis=0)
    if dc_prev is not None:
        dc_prev[...] = dct * f_


def gru_forward_ref(gx, hw_t, bias, h_prev, stash, h) -> None:
    hid = h.shape[1]
    pre = hw_t.T + bias
    r = _sigmoid_ref(gx[:, :hid] + pre[:, :hid])
    z = _sigmoid_ref(gx[:, hid:2 * hid] + pre[:, hid:2 * hid])
    ghn = pre[:, 2 * hid:]
    nn = np.tanh(gx[:, 2 * hid:] + r * ghn)
    stash[...] = np.concatenate([r, z, nn, ghn], axis=1)
    h[...] = nn + z * (h_prev - nn)


def gru_backward_ref(dh, stash, h_prev, dgx, dgh, dbias) -> None:
    hid = dh.shape[1]
    r, z, nn, ghn = (stash[:, k * hid:(k + 1) * hid] for k in range(4))
    dn = dh * (1 - z) * (1 - nn * nn)
    dz = dh * (h_prev - nn) * (z * (1 - z))
    dr = dn * ghn * (r * (1 - r))
    dgx[...] = np.concatenate([dr, dz, dn], axis=1)
    dgh[...] = np.concatenate([dr, dz, dn * r], axis=1)
    dbias[...] = dgh.sum(axis=0)


# ---------------------------------------------------------------- dispatchers
def _numba_ok(*arrays) -> bool:
    return all(type(a) is np.ndarray for a in arrays)


def lstm_cell_forward(hw_t, gx, bias, c_prev, gates, h, c) -> None:
    """LSTM gate math of one step.

    ``hw_t`` (4H, N) is the recurrent product ``W_hh @ h_prev.T``, gate-major (OpenBLAS
    computes it ~1.6x faster than ``h_prev @ W_hh.T`` for N = 32), ``gx`` (N, 4H) the input
    projection (with ``b_ih``), ``bias`` (4H,) is ``b_hh``. Writes the activated gates
    ``[i, f, g, o]`` to ``gates`` (N, 4H), ``c`` = f*c_prev + i*g and ``h`` = o*tanh(c).
    """
    if _numba_ok(hw_t, gx, bias, c_prev, gates, h, c):
        _lstm_fwd_nb(hw_t, gx, bias, c_prev, gates, h, c)
    elif dev.device_ok(hw_t, gx, bias, c_prev, gates, h, c):
        dev.lstm_forward_device(hw_t, gx, bias, None, c_prev, gates, h, c, gate_major=True)
    else:
        lstm_forward_ref(hw_t, gx, bias, c_prev, gates, h, c)


def lstm_cell_backward(dh, dc, gates, c, c_prev, dgates, dc_prev, dbias) -> None:
    """Gradients of one LSTM step through the gate math.

    From ``dh``, ``dc`` (N, H), the activated ``gates`` (N, 4H), ``c`` (this step's cell
    state, tanh(c) is recomputed) and ``c_prev``: writes ``dgates`` (N, 4H), the gradient of
    the pre-activations (= of ``gx`` and of ``h_prev @ W_hh.T``), ``dbias`` (4H,) = its
    column sums, and ``dc_prev`` (N, H) unless it is None.
    """
    if _numba_ok(dh, dc, gates, c, c_prev, dgates, dbias) and (
            dc_prev is None or type(dc_prev) is np.ndarray):
        write = dc_prev is not None
        _lstm_bwd_nb(dh, dc, gates, c, c_prev, gates.dtype.type(1), dgates,
                     dc_prev if write else dc, write, dbias)
    elif dev.device_ok(dh, dc, gates, c, c_prev, dgates, dc_prev, dbias):
        dev.lstm_backward_device(dh, None, dc, gates, c, c_prev, dgates, dc_prev)
        np.sum(dgates, axis=0, out=dbias)
    else:
        lstm_backward_ref(dh, dc, gates, c, c_prev, dgates, dc_prev, dbias)


def gru_cell_forward(gx, hw_t, bias, h_prev, stash, h) -> None:
    """GRU gate math of one step.

    ``gx`` (N, 3H) is the input projection (with ``b_ih``), ``hw_t`` (3H, N) the recurrent
    product ``W_hh @ h_prev.T`` (gate-major, no bias), ``bias`` (3H,) = ``b_hh``. Writes ``h``
    (N, H) and ``stash`` (N, 4H) = ``[r, z, n, W_hn h_prev + b_hn]``, all backward needs
    besides ``h_prev``.
    """
    if _numba_ok(gx, hw_t, bias, h_prev, stash, h):
        _gru_fwd_nb(gx, hw_t, bias, h_prev, stash, h)
    elif dev.device_ok(gx, hw_t, bias, h_prev, stash, h):
        dev.gru_forward_device(gx, None, hw_t, bias, h_prev, stash, h, gate_major=True)
    else:
        gru_forward_ref(gx, hw_t, bias, h_prev, stash, h)


def gru_cell_backward(dh, stash, h_prev, dgx, dgh, dbias) -> None:
    """Gradients of one GRU step through the gate math.

    Writes ``dgx`` (N, 3H) (gradient of the input projection), ``dgh`` (N, 3H) (gradient of
    ``h_prev @ W_hh.T + b_hh``) and ``dbias`` (3H,) = column sums of ``dgh``. The gradient of
    ``h_prev`` is ``dgh @ W_hh`` plus ``dh * z`` (see :func:`gru_add_direct`).
    """
    if _numba_ok(dh, stash, h_prev, dgx, dgh, dbias):
        _gru_bwd_nb(dh, stash, h_prev, dh.dtype.type(1), dgx, dgh, dbias)
    elif dev.device_ok(dh, stash, h_prev, dgx, dgh, dbias):
        dev.gru_backward_device(dh, None, None, stash, h_prev, dgx, dgh, None)
        np.sum(dgh, axis=0, out=dbias)
    else:
        gru_backward_ref(dh, stash, h_prev, dgx, dgh, dbias)


def gru_add_direct(dh_prev, dh, stash) -> None:
    """dh_prev += dh * z, the direct path of the GRU's h = (1-z)*n + z*h_prev."""
    hid = dh.shape[1]
    if _numba_ok(dh_prev, dh, stash):
        _add_mul_nb(dh_prev, dh, stash, hid)
    elif dev.device_ok(dh_prev, dh, stash):
        dev.gru_add_direct_device(dh_prev, dh, stash)
    else:
        dh_prev += dh * stash[:, hid:2 * hid]

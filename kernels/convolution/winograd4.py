"""Winograd F(4x4, 3x3) convolution (3x3, stride 1, dilation 1, one group): Numba CPU kernels.

The larger sibling of :mod:`minidl.kernels.convolution.winograd` (F(2x2, 3x3)), with the
interpolation
points 0, +-1, +-2 and infinity: per 4x4 output tile the 6x6 input tile ``d`` becomes
``V = B^T d B`` and the filter ``U = G g G^T``; the 36 positions ``xi`` of the 6x6
transforms turn the convolution into 36 independent matrix products over channels,
``M[xi] = U[xi] @ V[xi]``, and ``y = A^T M A``: 4x fewer multiplications than im2col + GEMM
(F(2x2, 3x3): 2.25x), and 2.25 transformed values per output instead of 4, so the
transforms move less memory too. The price is rounding: the transforms' coefficients reach 8
(A) and 1/24 (G), so float32 results differ from the exact convolution by a few 1e-6 of the
output's scale (F(2x2, 3x3): about 1e-7; measured and bounded in the tests).

Backward is the transposed identities, as in F(2x2, 3x3): ``DY = A dy A^T`` (the 4x4
output-gradient tile lifted to 6x6), ``dW = G^T (sum over tiles of DY (x) V) G`` and the
input-tile gradient ``B (U^T DY) B^T`` added back over the overlapping 6x6 tiles. Images are
transformed a block at a time; every thread works on its own blocks and workspace row.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ..blas import mm
from ..parallel import ThreadedKernel
from .winograd import (
    L2_BUDGET,
    _pad,
    add_bias_sums,
    finish_transformed,
    kron_taps,
    plane_stride,
    unpad,
)

#: Positions of the transformed 6x6 tiles (the number of products).
PLANES = 36


def tiles(ho: int, wo: int) -> tuple[int, int]:
    """Tile rows and columns covering an ``ho x wo`` output plane (4x4 tiles)."""
    return (ho + 3) // 4, (wo + 3) // 4


def transformed_image_bytes(cin: int, cout: int, ho: int, wo: int, itemsize: int) -> int:
    """Bytes of one image's transformed input and output tiles (and input gradient)."""
    th, tw = tiles(ho, wo)
    return PLANES * (2 * cin + cout) * th * tw * itemsize


def images_per_block(cin: int, cout: int, ho: int, wo: int, itemsize: int) -> int:
    """Images transformed together: as many as fit :data:`L2_BUDGET` (at least one)."""
    return max(1, L2_BUDGET // transformed_image_bytes(cin, cout, ho, wo, itemsize))


@njit(nogil=True, cache=True, inline="always", error_model="numpy")
def _planes(s, off, rows, p):
    """``(36, plane stride)`` view of ``s[off:]`` (see :func:`.winograd.plane_stride`)."""
    ps = (rows * p + 1023) // 1024 * 1024 + 16
    return s[off: off + 36 * ps].reshape((36, ps))


def slab_elems(x_shape: tuple[int, ...], cout: int, padding: tuple[int, int], nb: int,
               backward: bool) -> list[int]:
    """Element counts of one thread's buffers (see the kernels' argument lists)."""
    _, cin, h, w = x_shape
    ho, wo = h + 2 * padding[0] - 2, w + 2 * padding[1] - 2
    th, tw = tiles(ho, wo)
    p = nb * th * tw
    xp = cin * (4 * th + 2) * (4 * tw + 2)
    u = PLANES * cout * cin
    vin, vout = PLANES * plane_stride(cin, p), PLANES * plane_stride(cout, p)
    if not backward:
        return [u, xp, vin, vout]  # U, padded image, V, M
    return [u, xp, vin, vout, vin]  # U, padded image, V, DY, dD (V's size)


# ----------------------------------------------------------------------------- transforms
# 1-D transforms; the 2-D ones apply them to the columns of a tile, then to its rows. ``k``:
# the constants in the data's type (:func:`_k`; a Python int or float would promote float32
# arithmetic to float64).
@njit(nogil=True, cache=True, inline="always", error_model="numpy")
def _k(a):
    """``(2, 4, 5, 8)`` in the dtype of array ``a``."""
    t = a.dtype.type
    return t(2.0), t(4.0), t(5.0), t(8.0)


@njit(nogil=True, cache=True, inline="always", error_model="numpy")
def _bt(d0, d1, d2, d3, d4, d5, k):
    """B^T d (6 values)."""
    k2, k4, k5 = k[0], k[1], k[2]
    return (k4 * d0 - k5 * d2 + d4, d3 + d4 - k4 * (d1 + d2), k4 * (d1 - d2) + d4 - d3,
            k2 * (d3 - d1) + d4 - d2, k2 * (d1 - d3) + d4 - d2, k4 * d1 - k5 * d3 + d5)


@njit(nogil=True, cache=True, inline="always", error_model="numpy")
def _b(m0, m1, m2, m3, m4, m5, k):
    """B m (6 values)."""
    k2, k4, k5 = k[0], k[1], k[2]
    return (k4 * m0, k4 * (m2 - m1) + k2 * (m4 - m3) + k4 * m5,
            -k5 * m0 - k4 * (m1 + m2) - m3 - m4, m1 - m2 + k2 * (m3 - m4) - k5 * m5,
            m0 + m1 + m2 + m3 + m4, m5)


@njit(nogil=True, cache=True, inline="always", error_model="numpy")
def _at(m0, m1, m2, m3, m4, m5, k):
    """A^T m (4 values)."""
    k2, k4, k8 = k[0], k[1], k[3]
    s12, d12, s34, d34 = m1 + m2, m1 - m2, m3 + m4, m3 - m4
    return m0 + s12 + s34, d12 + k2 * d34, s12 + k4 * s34, d12 + k8 * d34 + m5


@njit(nogil=True, cache=True, inline="always", error_model="numpy")
def _a(e0, e1, e2, e3, k):
    """A e (6 values)."""
    k2, k4, k8 = k[0], k[1], k[3]
    s02, s13 = e0 + e2, e1 + e3
    q02, q13 = e0 + k4 * e2, k2 * e1 + k8 * e3
    return e0, s02 + s13, s02 - s13, q02 + q13, q02 - q13, e3


@njit(nogil=True, cache=True, error_model="numpy")
def _gg(a):
    """``kron(G, G)`` (36 x 9) in the dtype of ``a`` (see :func:`.winograd.kron_taps`)."""
    g = np.zeros((6, 3))
    g[0, 0] = 0.25
    g[1, :] = -1.0 / 6.0
    g[2, 0], g[2, 1], g[2, 2] = -1.0 / 6.0, 1.0 / 6.0, -1.0 / 6.0
    g[3, 0], g[3, 1], g[3, 2] = 1.0 / 24.0, 1.0 / 12.0, 1.0 / 6.0
    g[4, 0], g[4, 1], g[4, 2] = 1.0 / 24.0, -1.0 / 12.0, 1.0 / 6.0
    g[5, 2] = 1.0
    return kron_taps(g, a)


@njit(nogil=True, cache=True, error_model="numpy")
def _filter_transform(w, u, work):
    """``u[xi, co * Cin + c] = (G w[co, c] G^T)[xi]`` for 3x3 filters (``w`` contiguous),
    as one product ``kron(G, G) @ w_flat^T`` (36 x 9 by 9 x Cout*Cin): the 36 planes are
    written row by row, where the separable form's scattered stores were 4x slower."""
    nw = w.shape[0] * w.shape[1]
    mm(_gg(w), w.reshape((nw, 9)), u, False, True, 1.0, 0.0, 36, nw, 9, work)


@njit(nogil=True, cache=True, inline="always", error_model="numpy")
def _xcol(xp, c, r, q, k):
    """Column ``q`` of the 6x6 tile at row ``r`` of channel ``c`` of ``xp``, B^T-transformed."""
    return _bt(xp[c, r, q], xp[c, r + 1, q], xp[c, r + 2, q], xp[c, r + 3, q],
               xp[c, r + 4, q], xp[c, r + 5, q], k)


@njit(nogil=True, cache=True, error_model="numpy")
def _input_transform(xp, v, ntot, p0, th, tw):
    """Plane ``xi`` of ``v``, row ``c``, column ``p0 + tile``: ``(B^T d B)[xi]`` for every 6x6
    tile ``d`` of ``xp`` (tiles 4 apart; ``ntot`` columns per row)."""
    k = _k(xp)
    for c in range(xp.shape[0]):
        for a in range(th):
            r = 4 * a
            for b in range(tw):
                p = c * ntot + p0 + a * tw + b
                q = 4 * b
                k0, k1, k2 = _xcol(xp, c, r, q, k), _xcol(xp, c, r, q + 1, k), \
                    _xcol(xp, c, r, q + 2, k)
                k3, k4, k5 = _xcol(xp, c, r, q + 3, k), _xcol(xp, c, r, q + 4, k), \
                    _xcol(xp, c, r, q + 5, k)
                for i in range(6):
                    t = _bt(k0[i], k1[i], k2[i], k3[i], k4[i], k5[i], k)
                    for j in range(6):
                        v[6 * i + j, p] = t[j]


@njit(nogil=True, cache=True, inline="always", error_model="numpy")
def _mcol(m, j, p, k):
    """Column ``j`` of the 6x6 tile ``p`` of ``m``, A^T-transformed (4 values)."""
    return _at(m[j, p], m[6 + j, p], m[12 + j, p], m[18 + j, p], m[24 + j, p], m[30 + j, p],
               k)


@njit(nogil=True, cache=True, error_model="numpy")
def _output_transform(m, y, n0, n1, th, tw, b, has_bias):
    """``y[n, co, 4a:4a+4, 4b:4b+4] = A^T m A (+ bias)`` for images ``n0:n1`` (clipped to the
    output size; ``m`` as from :func:`_planes`, row ``co``)."""
    cout, ho, wo = y.shape[1], y.shape[2], y.shape[3]
    ntile = (n1 - n0) * th * tw
    k = _k(y)
    for co in range(cout):
        bias = b[co] if has_bias else y.dtype.type(0)
        r0 = co * ntile
        for n in range(n0, n1):
            for a in range(th):
                for bb in range(tw):
                    p = r0 + ((n - n0) * th + a) * tw + bb
                    k0, k1, k2 = _mcol(m, 0, p, k), _mcol(m, 1, p, k), _mcol(m, 2, p, k)
                    k3, k4, k5 = _mcol(m, 3, p, k), _mcol(m, 4, p, k), _mcol(m, 5, p, k)
                    for i in range(4):
                        r = 4 * a + i
                        if r < ho:
                            t = _at(k0[i], k1[i], k2[i], k3[i], k4[i], k5[i], k)
                            for j in range(4):
                                q = 4 * bb + j
                                if q < wo:
                                    y[n, co, r, q] = t[j] + bias


@njit(nogil=True, cache=True, inline="always", error_model="numpy")
def _dy(dy, n, co, r, q, ho, wo):
    return dy[n, co, r, q] if r < ho and q < wo else dy.dtype.type(0)


@njit(nogil=True, cache=True, inline="always", error_model="numpy")
def _ecol(dy, n, co, r, q, ho, wo, k):
    """Column ``q`` of the 4x4 tile of ``dy`` at row ``r`` (zero past the edge), A-lifted."""
    return _a(_dy(dy, n, co, r, q, ho, wo), _dy(dy, n, co, r + 1, q, ho, wo),
              _dy(dy, n, co, r + 2, q, ho, wo), _dy(dy, n, co, r + 3, q, ho, wo), k)


@njit(nogil=True, cache=True, error_model="numpy")
def _grad_output_transform(dy, g, n0, n1, th, tw):
    """Plane ``xi`` of ``g``, row ``co``: ``(A e A^T)[xi]`` for every 4x4 tile ``e`` of
    ``dy[n0:n1]`` (zero past the output edge)."""
    cout, ho, wo = dy.shape[1], dy.shape[2], dy.shape[3]
    ntile = (n1 - n0) * th * tw
    k = _k(g)
    for co in range(cout):
        r0 = co * ntile
        for n in range(n0, n1):
            for a in range(th):
                r = 4 * a
                for bb in range(tw):
                    p = r0 + ((n - n0) * th + a) * tw + bb
                    q = 4 * bb
                    k0, k1 = _ecol(dy, n, co, r, q, ho, wo, k), \
                        _ecol(dy, n, co, r, q + 1, ho, wo, k)
                    k2, k3 = _ecol(dy, n, co, r, q + 2, ho, wo, k), \
                        _ecol(dy, n, co, r, q + 3, ho, wo, k)
                    for i in range(6):
                        t = _a(k0[i], k1[i], k2[i], k3[i], k)
                        for j in range(6):
                            g[6 * i + j, p] = t[j]


@njit(nogil=True, cache=True, inline="always", error_model="numpy")
def _dcol(dd, j, p, k):
    """Column ``j`` of the 6x6 tile ``p`` of ``dd``, B-transformed (6 values)."""
    return _b(dd[j, p], dd[6 + j, p], dd[12 + j, p], dd[18 + j, p], dd[24 + j, p],
              dd[30 + j, p], k)


@njit(nogil=True, cache=True, error_model="numpy")
def _input_grad_transform(dd, ntot, dxp, p0, th, tw):
    """Overwrite the padded input gradient ``dxp`` with the sum of ``B dd B^T`` over the
    (overlapping) 6x6 tiles of one image (columns ``p0:p0 + th*tw`` of the rows of ``dd``,
    which have ``ntot`` columns)."""
    k = _k(dxp)
    for c in range(dxp.shape[0]):
        for r in range(dxp.shape[1]):
            for q in range(dxp.shape[2]):
                dxp[c, r, q] = 0
        for a in range(th):
            for bb in range(tw):
                p = c * ntot + p0 + a * tw + bb
                k0, k1, k2 = _dcol(dd, 0, p, k), _dcol(dd, 1, p, k), _dcol(dd, 2, p, k)
                k3, k4, k5 = _dcol(dd, 3, p, k), _dcol(dd, 4, p, k), _dcol(dd, 5, p, k)
                for i in range(6):
                    t = _b(k0[i], k1[i], k2[i], k3[i], k4[i], k5[i], k)
                    for j in range(6):
                        dxp[c, 4 * a + i, 4 * bb + j] += t[j]


# ----------------------------------------------------------------------------- chunks
@njit(nogil=True, cache=True, error_model="numpy")
def fwd_chunk(x, w, b, has_bias, y, slabs, offs, bounds, nb, ph, pw, t, threads):
    """Thread ``t``'s images ``bounds[t]:bounds[t + 1]`` of the forward on its workspace row
    ``slabs[t]`` (see :class:`~minidl.kernels.parallel.ThreadedKernel`)."""
    s, n0, n1 = slabs[t], bounds[t], bounds[t + 1]
    cin, cout = x.shape[1], w.shape[0]
    th, tw = (y.shape[2] + 3) // 4, (y.shape[3] + 3) // 4
    hb, wb = 4 * th + 2, 4 * tw + 2
    u = s[offs[0]: offs[0] + 36 * cout * cin].reshape((36, cout, cin))
    xp = s[offs[1]: offs[1] + cin * hb * wb].reshape((cin, hb, wb))
    work = np.empty(8, np.int32)
    _filter_transform(w, u.reshape((36, cout * cin)), work)
    for s0 in range(n0, n1, nb):
        s1 = min(s0 + nb, n1)
        p = (s1 - s0) * th * tw
        v = _planes(s, offs[2], cin, p)
        m = _planes(s, offs[3], cout, p)
        for n in range(s0, s1):
            _pad(x, n, xp, ph, pw)
            _input_transform(xp, v, p, (n - s0) * th * tw, th, tw)
        for xi in range(36):
            mm(u[xi], v[xi, : cin * p].reshape((cin, p)), m[xi, : cout * p].reshape((cout, p)),
               False, False, 1.0, 0.0, cout, p, cin, work)
        _output_transform(m, y, s0, s1, th, tw, b, has_bias)


@njit(nogil=True, cache=True, error_model="numpy")
def bwd_chunk(x, w, dy, dx, need_dx, s, offs, dwpart, db, n0, n1, nb, ph, pw):
    """Images ``n0:n1``: ``dx`` rows; their transformed ``dW`` and ``db`` summed into
    ``dwpart`` (``36 * Cout * Cin``, overwritten by the first block's products) and
    ``db`` (zeroed first)."""
    cin, cout = x.shape[1], w.shape[0]
    th, tw = (dy.shape[2] + 3) // 4, (dy.shape[3] + 3) // 4
    hb, wb = 4 * th + 2, 4 * tw + 2
    u = s[offs[0]: offs[0] + 36 * cout * cin].reshape((36, cout, cin))
    xp = s[offs[1]: offs[1] + cin * hb * wb].reshape((cin, hb, wb))
    dwx = dwpart[: 36 * cout * cin].reshape((36, cout, cin))
    work = np.empty(8, np.int32)
    _filter_transform(w, u.reshape((36, cout * cin)), work)
    for i in range(cout):
        db[i] = 0
    for s0 in range(n0, n1, nb):
        s1 = min(s0 + nb, n1)
        p = (s1 - s0) * th * tw
        v = _planes(s, offs[2], cin, p)
        g = _planes(s, offs[3], cout, p)
        dd = _planes(s, offs[4], cin, p)
        _grad_output_transform(dy, g, s0, s1, th, tw)
        for n in range(s0, s1):
            _pad(x, n, xp, ph, pw)
            _input_transform(xp, v, p, (n - s0) * th * tw, th, tw)
            add_bias_sums(dy, n, db)
        for xi in range(36):
            vx = v[xi, : cin * p].reshape((cin, p))
            gx = g[xi, : cout * p].reshape((cout, p))
            mm(gx, vx, dwx[xi], False, True, 1.0, 0.0 if s0 == n0 else 1.0, cout, cin, p,
               work)  # dWx (+)= G V^T: the first block overwrites (no zeroing pass)
            if need_dx:
                mm(u[xi], gx, dd[xi, : cin * p].reshape((cin, p)), True, False, 1.0, 0.0, cin,
                   p, cout, work)
        if need_dx:
            for n in range(s0, s1):
                _input_grad_transform(dd, p, xp, (n - s0) * th * tw, th, tw)
                unpad(xp, dx, n, ph, pw)


@njit(nogil=True, cache=True, error_model="numpy")
def backward_parts(x, w, dy, dx, need_dx, slabs, offs, dwparts, dbparts, bounds, nb, ph, pw,
                   first, step):
    """Gradient parts ``first, first + step, ...`` (images ``bounds[p]:bounds[p + 1]``) on
    the workspace row ``slabs[first]`` (thread ``first`` of ``step``)."""
    s = slabs[first]
    for p in range(first, bounds.size - 1, step):
        bwd_chunk(x, w, dy, dx, need_dx, s, offs, dwparts[p], dbparts[p], bounds[p],
                  bounds[p + 1], nb, ph, pw)


#: Forward and backward on Numba's pool, one workspace row per thread.
FORWARD = ThreadedKernel(fwd_chunk)
BACKWARD = ThreadedKernel(backward_parts)


def finish_grads(dwparts: np.ndarray, dbparts: np.ndarray, dw: np.ndarray, db: np.ndarray,
                 add: bool) -> None:
    """``dW = G^T dWx G`` from the parts' transformed sums (in part order) into ``dw`` and
    the bias sums into ``db`` (added to what they hold if ``add``; ``dw`` contiguous)."""
    finish_transformed(_gg(dw), dwparts, dbparts, dw, db, add)

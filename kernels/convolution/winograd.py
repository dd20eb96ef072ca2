"""Winograd F(2x2, 3x3) convolution (3x3, stride 1, dilation 1, one group): Numba CPU kernels.

Per 2x2 output tile the 4x4 input tile ``d`` becomes ``V = B^T d B`` and the filter
``U = G g G^T``; the 16 positions ``xi`` of the 4x4 transforms turn the convolution into 16
independent matrix products over channels, ``M[xi] = U[xi] @ V[xi]`` (``Cout x Cin`` by
``Cin x tiles``), and ``y = A^T M A``: 2.25x fewer multiplications than im2col + GEMM.

Backward uses the transposed identities of the same transforms: with ``DY = A dy A^T`` (the
2x2 output-gradient tile lifted to 4x4), ``dW = G^T (sum over tiles of DY (x) V) G`` (16
products ``DY[xi] @ V[xi].T``) and the input-tile gradient ``B (U^T DY) B^T``, added back
over the overlapping 4x4 tiles. Images are processed a few at a time so that ``V``, ``M`` and
``DY`` stay in L2; every thread works on its own batch chunk and workspace row.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ..blas import mm
from ..parallel import ThreadedKernel

#: L2 budget for the transformed tiles of one sub-chunk of images (bytes).
L2_BUDGET = 1 << 20


def tiles(ho: int, wo: int) -> tuple[int, int]:
    """Tile rows and columns covering an ``ho x wo`` output plane."""
    return (ho + 1) // 2, (wo + 1) // 2


#: Positions of the transformed 4x4 tiles (the number of products).
PLANES = 16


def transformed_image_bytes(cin: int, cout: int, ho: int, wo: int, itemsize: int) -> int:
    """Bytes of one image's transformed input and output tiles (and input gradient)."""
    th, tw = tiles(ho, wo)
    return PLANES * (2 * cin + cout) * th * tw * itemsize


def images_per_block(cin: int, cout: int, ho: int, wo: int, itemsize: int) -> int:
    """Images transformed together: as many as fit :data:`L2_BUDGET` (at least one)."""
    return max(1, L2_BUDGET // transformed_image_bytes(cin, cout, ho, wo, itemsize))


def plane_stride(rows: int, p: int) -> int:
    """Elements between the 16 planes of a transformed ``(16, rows, p)`` buffer: rounded up to
    4 KiB (float32) and shifted by one cache line, so that the 16 streams the transforms
    read and write never map to the same L1 sets (with power-of-two planes, e.g. 64 channels
    x 256 tiles, they all did: 3.5x slower)."""
    return -(-rows * p // 1024) * 1024 + 16


@njit(nogil=True, cache=True, inline="always", error_model="numpy")
def _planes(s, off, rows, p):
    """``(16, plane stride)`` view of ``s[off:]``: plane ``xi`` holds a ``rows x p`` matrix
    in its first ``rows * p`` elements (row ``r`` at ``r * p``)."""
    ps = (rows * p + 1023) // 1024 * 1024 + 16
    return s[off: off + 16 * ps].reshape((16, ps))


def slab_elems(x_shape: tuple[int, ...], cout: int, padding: tuple[int, int], nb: int,
               backward: bool) -> list[int]:
    """Element counts of one thread's buffers (see the kernels' argument lists)."""
    _, cin, h, w = x_shape
    ho, wo = h + 2 * padding[0] - 2, w + 2 * padding[1] - 2
    th, tw = tiles(ho, wo)
    p = nb * th * tw
    xp = cin * (2 * th + 2) * (2 * tw + 2)
    u = 16 * cout * cin
    vin, vout = 16 * plane_stride(cin, p), 16 * plane_stride(cout, p)
    if not backward:
        return [u, xp, vin, vout, 4 * p]  # U, padded image, V, M, out tiles
    # U, padded image, V, DY, dD (V's size), gathered dy tiles, input-gradient tiles of one
    # image (transformed, half-transformed); the dW and db partials are the caller's
    return [u, xp, vin, vout, vin, 4 * p, 16 * th * tw, 16 * th * tw]


# ----------------------------------------------------------------------------- transforms
# 1-D transforms on 4 (or 3, 2) scalars; the 2-D ones apply them to columns, then rows.
@njit(nogil=True, cache=True, inline="always", error_model="numpy")
def _bt(d0, d1, d2, d3):
    """B^T d."""
    return d0 - d2, d1 + d2, d2 - d1, d1 - d3


@njit(nogil=True, cache=True, inline="always", error_model="numpy")
def _b(m0, m1, m2, m3):
    """B m."""
    return m0, m1 - m2 + m3, m1 + m2 - m0, -m3


@njit(nogil=True, cache=True, inline="always", error_model="numpy")
def _at(m0, m1, m2, m3):
    """A^T m (2 values)."""
    return m0 + m1 + m2, m1 - m2 - m3


@njit(nogil=True, cache=True, inline="always", error_model="numpy")
def _a(e0, e1):
    """A e (4 values)."""
    return e0, e0 + e1, e0 - e1, -e1


@njit(nogil=True, cache=True, error_model="numpy")
def _filter_transform(w, u, work):
    """``u[xi, co * Cin + c] = (G w[co, c] G^T)[xi]`` for 3x3 filters (``w`` contiguous), as
    one product ``kron(G, G) @ w_flat^T`` (16 x 9 by 9 x Cout*Cin), written plane by plane
    (the per-filter form's scattered stores: 8.9 ms at 512 x 512 channels, this: ~3 ms)."""
    nw = w.shape[0] * w.shape[1]
    mm(_gg(w), w.reshape((nw, 9)), u, False, True, 1.0, 0.0, 16, nw, 9, work)


@njit(nogil=True, cache=True, inline="always", error_model="numpy")
def _pad(x, n, xp, ph, pw):
    """Image ``n`` of ``x`` into the padded ``xp`` (C, Hb, Wb), zero elsewhere."""
    c, h, w = x.shape[1], x.shape[2], x.shape[3]
    hb, wb = xp.shape[1], xp.shape[2]
    for ci in range(c):
        for r in range(hb):
            for q in range(wb):
                xp[ci, r, q] = 0
        for r in range(h):
            for q in range(w):
                xp[ci, r + ph, q + pw] = x[n, ci, r, q]


@njit(nogil=True, cache=True, error_model="numpy")
def _input_transform(xp, v, ntot, p0, th, tw):
    """Plane ``xi`` of ``v``, row ``c``, column ``p0 + tile``: ``(B^T d B)[xi]`` for every 4x4
    tile ``d`` of ``xp`` (``ntot`` columns per row)."""
    for c in range(xp.shape[0]):
        for a in range(th):
            r = 2 * a
            for b in range(tw):
                p = c * ntot + p0 + a * tw + b
                q = 2 * b
                k0 = _bt(xp[c, r, q], xp[c, r + 1, q], xp[c, r + 2, q], xp[c, r + 3, q])
                k1 = _bt(xp[c, r, q + 1], xp[c, r + 1, q + 1], xp[c, r + 2, q + 1],
                         xp[c, r + 3, q + 1])
                k2 = _bt(xp[c, r, q + 2], xp[c, r + 1, q + 2], xp[c, r + 2, q + 2],
                         xp[c, r + 3, q + 2])
                k3 = _bt(xp[c, r, q + 3], xp[c, r + 1, q + 3], xp[c, r + 2, q + 3],
                         xp[c, r + 3, q + 3])
                for i in range(4):
                    t = _bt(k0[i], k1[i], k2[i], k3[i])
                    for j in range(4):
                        v[4 * i + j, p] = t[j]


@njit(nogil=True, cache=True, error_model="numpy")
def _output_transform(m, o, y, n0, n1, th, tw, b, has_bias):
    """``y[n, co, 2a:2a+2, 2b:2b+2] = A^T m A (+ bias)`` for images ``n0:n1`` (clipped to the
    output size; ``m`` as from :func:`_planes`, row ``co``). The transform runs over all tiles
    of a channel at once (vectorised), into ``o`` (4, tiles), then scatters."""
    cout, ho, wo = y.shape[1], y.shape[2], y.shape[3]
    ntile = (n1 - n0) * th * tw
    for co in range(cout):
        r0 = co * ntile
        m0, m1, m2, m3 = m[0, r0:], m[1, r0:], m[2, r0:], m[3, r0:]
        m4, m5, m6, m7 = m[4, r0:], m[5, r0:], m[6, r0:], m[7, r0:]
        m8, m9, m10, m11 = m[8, r0:], m[9, r0:], m[10, r0:], m[11, r0:]
        m12, m13, m14, m15 = m[12, r0:], m[13, r0:], m[14, r0:], m[15, r0:]
        for p in range(ntile):
            k0 = _at(m0[p], m4[p], m8[p], m12[p])
            k1 = _at(m1[p], m5[p], m9[p], m13[p])
            k2 = _at(m2[p], m6[p], m10[p], m14[p])
            k3 = _at(m3[p], m7[p], m11[p], m15[p])
            t0 = _at(k0[0], k1[0], k2[0], k3[0])
            t1 = _at(k0[1], k1[1], k2[1], k3[1])
            o[0, p] = t0[0]
            o[1, p] = t0[1]
            o[2, p] = t1[0]
            o[3, p] = t1[1]
        bias = b[co] if has_bias else y.dtype.type(0)
        for n in range(n0, n1):
            for a in range(th):
                pb = ((n - n0) * th + a) * tw
                for i in range(2):
                    r = 2 * a + i
                    if r < ho:
                        for q in range(wo):
                            y[n, co, r, q] = o[2 * i + (q & 1), pb + (q >> 1)] + bias


@njit(nogil=True, cache=True, error_model="numpy")
def _grad_output_transform(dy, e, g, n0, n1, th, tw):
    """Plane ``xi`` of ``g``, row ``co``: ``(A e A^T)[xi]`` for every 2x2 tile ``e`` of
    ``dy[n0:n1]`` (zero past the output edge): gather the tiles of a channel into ``e``
    (4, tiles), then transform them all at once (vectorised)."""
    cout, ho, wo = dy.shape[1], dy.shape[2], dy.shape[3]
    ntile = (n1 - n0) * th * tw
    for co in range(cout):
        if ho % 2 or wo % 2:
            for k in range(4):
                for p in range(ntile):
                    e[k, p] = 0
        for n in range(n0, n1):
            for a in range(th):
                pb = ((n - n0) * th + a) * tw
                for i in range(2):
                    r = 2 * a + i
                    if r < ho:
                        for q in range(wo):
                            e[2 * i + (q & 1), pb + (q >> 1)] = dy[n, co, r, q]
        # One row of the 4x4 result per loop: few store streams keep LLVM's overlap checks
        # below its limit, so the loop vectorises (3x faster than all 16 at once).
        e0, e1, e2, e3 = e[0], e[1], e[2], e[3]
        for i in range(4):
            r0 = co * ntile
            ga, gb, gc, gd = g[4 * i, r0:], g[4 * i + 1, r0:], g[4 * i + 2, r0:], g[4 * i + 3, r0:]
            for p in range(ntile):
                a = _a(e0[p], e2[p])[i]
                c = _a(e1[p], e3[p])[i]
                ga[p] = a
                gb[p] = a + c
                gc[p] = a - c
                gd[p] = -c


@njit(nogil=True, cache=True, error_model="numpy")
def _input_grad_transform(dd, ntot, kb, t16, dxp, p0, th, tw):
    """Overwrite the padded input gradient ``dxp`` with the sum of ``B dd B^T`` over the
    (overlapping) tiles of one image (columns ``p0:p0 + th*tw`` of the rows of ``dd``, which
    have ``ntot`` columns).

    Per channel, ``B`` is applied to the columns of all tiles at once (into ``kb``), then to
    the rows (into ``t16``), each loop touching 4 + 4 arrays: few enough for LLVM to check
    their overlap at run time and vectorise (3x faster than one 16-stream loop); the
    overlap-add of the 4x4 tiles is a scalar pass.
    """
    nt = th * tw
    for c in range(dxp.shape[0]):
        c0 = c * ntot + p0
        for j in range(4):
            a, b, cc, d = dd[j, c0:], dd[4 + j, c0:], dd[8 + j, c0:], dd[12 + j, c0:]
            k0, k1, k2, k3 = kb[4 * j], kb[4 * j + 1], kb[4 * j + 2], kb[4 * j + 3]
            for p in range(nt):
                t = _b(a[p], b[p], cc[p], d[p])
                k0[p], k1[p], k2[p], k3[p] = t[0], t[1], t[2], t[3]
        for i in range(4):
            a, b, cc, d = kb[i], kb[4 + i], kb[8 + i], kb[12 + i]
            t0, t1, t2, t3 = t16[4 * i], t16[4 * i + 1], t16[4 * i + 2], t16[4 * i + 3]
            for p in range(nt):
                t = _b(a[p], b[p], cc[p], d[p])
                t0[p], t1[p], t2[p], t3[p] = t[0], t[1], t[2], t[3]
        for r in range(dxp.shape[1]):
            for q in range(dxp.shape[2]):
                dxp[c, r, q] = 0
        for a in range(th):
            for i in range(4):
                t0, t1, t2, t3 = t16[4 * i], t16[4 * i + 1], t16[4 * i + 2], t16[4 * i + 3]
                for bb in range(tw):
                    p = a * tw + bb
                    dxp[c, 2 * a + i, 2 * bb] += t0[p]
                    dxp[c, 2 * a + i, 2 * bb + 1] += t1[p]
                    dxp[c, 2 * a + i, 2 * bb + 2] += t2[p]
                    dxp[c, 2 * a + i, 2 * bb + 3] += t3[p]


# ----------------------------------------------------------------------------- chunks
@njit(nogil=True, cache=True, error_model="numpy")
def fwd_chunk(x, w, b, has_bias, y, slabs, offs, bounds, nb, ph, pw, t, threads):
    """Thread ``t``'s images ``bounds[t]:bounds[t + 1]`` of the forward on its workspace row
    ``slabs[t]`` (see :class:`~minidl.kernels.parallel.ThreadedKernel`)."""
    s, n0, n1 = slabs[t], bounds[t], bounds[t + 1]
    cin, cout = x.shape[1], w.shape[0]
    th, tw = (y.shape[2] + 1) // 2, (y.shape[3] + 1) // 2
    hb, wb = 2 * th + 2, 2 * tw + 2
    u = s[offs[0]: offs[0] + 16 * cout * cin].reshape((16, cout, cin))
    xp = s[offs[1]: offs[1] + cin * hb * wb].reshape((cin, hb, wb))
    work = np.empty(8, np.int32)
    _filter_transform(w, u.reshape((16, cout * cin)), work)
    for s0 in range(n0, n1, nb):
        s1 = min(s0 + nb, n1)
        p = (s1 - s0) * th * tw
        v = _planes(s, offs[2], cin, p)
        m = _planes(s, offs[3], cout, p)
        for n in range(s0, s1):
            _pad(x, n, xp, ph, pw)
            _input_transform(xp, v, p, (n - s0) * th * tw, th, tw)
        for xi in range(16):
            mm(u[xi], v[xi, : cin * p].reshape((cin, p)), m[xi, : cout * p].reshape((cout, p)),
               False, False, 1.0, 0.0, cout, p, cin, work)
        o = s[offs[4]: offs[4] + 4 * p].reshape((4, p))
        _output_transform(m, o, y, s0, s1, th, tw, b, has_bias)


@njit(nogil=True, cache=True, error_model="numpy")
def bwd_chunk(x, w, dy, dx, need_dx, s, offs, dwpart, db, n0, n1, nb, ph, pw):
    """Images ``n0:n1``: ``dx`` rows; their transformed ``dW`` and ``db`` summed into
    ``dwpart`` (``16 * Cout * Cin``, overwritten by the first block's products) and
    ``db`` (zeroed first)."""
    cin, cout = x.shape[1], w.shape[0]
    th, tw = (dy.shape[2] + 1) // 2, (dy.shape[3] + 1) // 2
    hb, wb = 2 * th + 2, 2 * tw + 2
    u = s[offs[0]: offs[0] + 16 * cout * cin].reshape((16, cout, cin))
    xp = s[offs[1]: offs[1] + cin * hb * wb].reshape((cin, hb, wb))
    dwx = dwpart[: 16 * cout * cin].reshape((16, cout, cin))
    work = np.empty(8, np.int32)
    _filter_transform(w, u.reshape((16, cout * cin)), work)
    for i in range(cout):
        db[i] = 0
    for s0 in range(n0, n1, nb):
        s1 = min(s0 + nb, n1)
        p = (s1 - s0) * th * tw
        v = _planes(s, offs[2], cin, p)
        g = _planes(s, offs[3], cout, p)
        dd = _planes(s, offs[4], cin, p)
        e = s[offs[5]: offs[5] + 4 * p].reshape((4, p))
        t16 = s[offs[6]: offs[6] + 16 * th * tw].reshape((16, th * tw))
        kb = s[offs[7]: offs[7] + 16 * th * tw].reshape((16, th * tw))
        _grad_output_transform(dy, e, g, s0, s1, th, tw)
        for n in range(s0, s1):
            _pad(x, n, xp, ph, pw)
            _input_transform(xp, v, p, (n - s0) * th * tw, th, tw)
            add_bias_sums(dy, n, db)
        for xi in range(16):
            vx = v[xi, : cin * p].reshape((cin, p))
            gx = g[xi, : cout * p].reshape((cout, p))
            mm(gx, vx, dwx[xi], False, True, 1.0, 0.0 if s0 == n0 else 1.0, cout, cin, p,
               work)  # dWx (+)= G V^T: the first block overwrites (no zeroing pass)
            if need_dx:
                mm(u[xi], gx, dd[xi, : cin * p].reshape((cin, p)), True, False, 1.0, 0.0, cin,
                   p, cout, work)
        if need_dx:
            for n in range(s0, s1):
                _input_grad_transform(dd, p, kb, t16, xp, (n - s0) * th * tw, th, tw)
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


@njit(nogil=True, cache=True, error_model="numpy")
def kron_taps(g, a):
    """``kron(g, g)`` of a transform's ``G`` (``t x 3``, float64) in the dtype of ``a``: row
    ``t*i + j``, column ``3r + q`` is the weight of filter tap ``(r, q)`` in position
    ``(i, j)`` of ``G w G^T`` (products taken in float64, then rounded)."""
    t = g.shape[0]
    out = np.empty((t * t, 9), a.dtype)
    for i in range(t):
        for j in range(t):
            for r in range(3):
                for q in range(3):
                    out[t * i + j, 3 * r + q] = g[i, r] * g[j, q]
    return out


@njit(nogil=True, cache=True, error_model="numpy")
def _gg(a):
    """``kron(G, G)`` (16 x 9) in the dtype of ``a`` (entries 0, 1/4, 1/2 and 1: exact)."""
    g = np.zeros((4, 3))
    g[0, 0] = 1.0
    g[1, :] = 0.5
    g[2, 0], g[2, 1], g[2, 2] = 0.5, -0.5, 0.5
    g[3, 2] = 1.0
    return kron_taps(g, a)


@njit(nogil=True, cache=True, inline="always", error_model="numpy")
def add_bias_sums(dy, n, db):
    """``db[co] += sum of dy[n, co]`` for every output channel."""
    for co in range(dy.shape[1]):
        acc = dy.dtype.type(0)
        for r in range(dy.shape[2]):
            for q in range(dy.shape[3]):
                acc += dy[n, co, r, q]
        db[co] += acc


@njit(nogil=True, cache=True, inline="always", error_model="numpy")
def unpad(xp, dx, n, ph, pw):
    """Image ``n`` of ``dx`` from the padded ``xp`` (C, Hb, Wb)."""
    for c in range(dx.shape[1]):
        for r in range(dx.shape[2]):
            for q in range(dx.shape[3]):
                dx[n, c, r, q] = xp[c, r + ph, q + pw]


#: Filter pairs per task of :func:`finish_transformed`: fixed (the sums' order never depends
#: on the thread count), and small enough that a task's 9 accumulator rows stay in L1.
FINISH_PAIRS = 1024


@njit(nogil=True, cache=True, parallel=True, error_model="numpy")
def finish_transformed(gg, dwparts, dbparts, dw, db, add):
    """The weight gradient from the parts' transformed sums: ``dw[co, c].flat[k] =
    sum over parts t, planes xi of gg[xi, k] * dwparts[t, xi * Cout*Cin + co*Cin + c]`` (the
    parts in order, ``gg``: the transform's ``kron(G, G)``, zero entries skipped), and the
    parts' bias sums into ``db``; both added to what they hold if ``add``. The filter pairs
    are shared over the threads in fixed tasks of :data:`FINISH_PAIRS`, each accumulating
    whole rows of the transformed sums (one product per plane read once, vectorised: a
    512 x 512 layer's F(4x4) finish took 30 ms as one BLAS product of 9 columns)."""
    planes = gg.shape[0]
    nw = dw.shape[0] * dw.shape[1]
    out = dw.reshape((nw, 9))
    for t in range(dbparts.shape[0]):
        for co in range(db.shape[0]):
            db[co] = db[co] + dbparts[t, co] if add or t > 0 else dbparts[t, co]
    for task in prange(-(-nw // FINISH_PAIRS)):
        c0 = task * FINISH_PAIRS
        width = min(nw, c0 + FINISH_PAIRS) - c0
        acc = np.zeros((9, FINISH_PAIRS), dw.dtype)
        for t in range(dbparts.shape[0]):
            for xi in range(planes):
                row = dwparts[t, xi * nw + c0: xi * nw + c0 + width]
                for k in range(9):
                    g = gg[xi, k]
                    if g != 0:
                        a = acc[k]
                        for c in range(width):
                            a[c] += g * row[c]
        for c in range(width):
            for k in range(9):
                out[c0 + c, k] = out[c0 + c, k] + acc[k, c] if add else acc[k, c]


def finish_grads(dwparts: np.ndarray, dbparts: np.ndarray, dw: np.ndarray, db: np.ndarray,
                 add: bool) -> None:
    """``dW = G^T dWx G`` from the parts' transformed sums (in part order) into ``dw`` and
    the bias sums into ``db`` (added to what they hold if ``add``; ``dw`` contiguous)."""
    finish_transformed(_gg(dw), dwparts, dbparts, dw, db, add)

"""Numba CPU kernels of the im2col + GEMM convolution: im2col / col2im and the per-thread
forward and backward loops (one workspace row per thread, run on Numba's pool by
:class:`~minidl.kernels.parallel.ThreadedKernel`)."""

from __future__ import annotations

import numpy as np
from numba import njit, uintp

from ..blas import mm
from ..parallel import ThreadedKernel
from ..small_gemm import is_thin, thin_mm


# ----------------------------------------------------------------------------- numba: im2col
@njit(nogil=True, cache=True, inline="always", error_model="numpy")
def _valid(o_len, s, off, length):
    """Range [lo, hi) of o in [0, o_len) with 0 <= o*s + off < length."""
    lo = 0
    if off < 0:
        lo = (-off + s - 1) // s
    hi = 0
    if length - off > 0:
        hi = (length - off + s - 1) // s
    hi = min(hi, o_len)
    lo = min(lo, hi)
    return lo, hi


@njit(nogil=True, cache=True, error_model="numpy")
def _im2col_plane(xf, xbase, col, ld, coff, cg, h, w, kh, kw, i, j, offh, offw, nq, oh0, oh_lo,
                  oh_hi, ow_lo, ow_hi):
    """The ``cg`` rows of kernel offset ``(i, j)`` of :func:`im2col` for a same-size output
    (stride 1, ``wo == w``): per channel one shifted contiguous copy, then zero the border."""
    for c in range(cg):
        r0 = uintp(((c * kh + i) * kw + j) * ld + coff)
        start = uintp((oh_lo - oh0) * w + ow_lo)
        stop = uintp((oh_hi - 1 - oh0) * w + ow_hi)
        xb = uintp(xbase + (c * h + oh0 + offh) * w + offw)
        for q in range(start, stop):
            col[r0 + q] = xf[xb + q]
        for q in range(start):
            col[r0 + q] = 0
        for q in range(stop, nq):
            col[r0 + q] = 0
        for oh in range(oh_lo - oh0, oh_hi - 1 - oh0):
            for q in range(uintp(oh * w + ow_hi), uintp(oh * w + w + ow_lo)):
                col[r0 + q] = 0


@njit(nogil=True, cache=True, error_model="numpy")
def _im2col_rows(xf, xbase, col, ld, coff, cg, h, w, kh, kw, i, j, sh, sw, offh, offw, wo, nq,
                 oh0, oh_lo, oh_hi, ow_lo, ow_hi):
    """The ``cg`` rows of kernel offset ``(i, j)`` of :func:`im2col`, output row by output row
    (any stride), zeros outside the valid ranges."""
    for c in range(cg):
        r0 = uintp(((c * kh + i) * kw + j) * ld + coff)
        for q in range(uintp((oh_lo - oh0) * wo)):
            col[r0 + q] = 0
        for oh in range(oh_lo, oh_hi):
            xb = uintp(xbase + (c * h + oh * sh + offh) * w + offw)
            cb = uintp(r0 + (oh - oh0) * wo)
            for q in range(uintp(ow_lo)):
                col[cb + q] = 0
            if sw == 1:
                for q in range(uintp(ow_lo), uintp(ow_hi)):
                    col[cb + q] = xf[xb + q]
            else:
                for q in range(uintp(ow_lo), uintp(ow_hi)):
                    col[cb + q] = xf[xb + q * uintp(sw)]
            for q in range(uintp(ow_hi), uintp(wo)):
                col[cb + q] = 0
        for q in range(uintp((oh_hi - oh0) * wo), nq):
            col[r0 + q] = 0


@njit(nogil=True, cache=True, error_model="numpy")
def im2col(xf, xbase, col, ld, coff, cg, h, w, kh, kw, sh, sw, ph, pw, dh, dw, ho, wo, oh0, oh1):
    """im2col of output rows ``oh0:oh1`` of ``cg`` channels of a flat image starting at
    ``xf[xbase]``: row ``r`` of the ``(cg*kh*kw, (oh1-oh0)*wo)`` result goes to
    ``col[r*ld + coff:]`` (``ld`` larger than a row lets images share one matrix).

    Hot loops index with unsigned integers: Numba then skips its negative-index wraparound,
    which otherwise blocks vectorisation (measured 4-6x slower). Each kernel offset's rows
    are written by :func:`_im2col_plane` or :func:`_im2col_rows`, inlined here (once per
    offset, not per row: inlined array arguments cost a reference count each time).
    """
    nq = uintp((oh1 - oh0) * wo)
    plane = sh == 1 and sw == 1 and wo == w
    for i in range(kh):
        offh = i * dh - ph
        oh_lo, oh_hi = _valid(ho, sh, offh, h)
        oh_lo, oh_hi = max(oh_lo, oh0), min(oh_hi, oh1)
        for j in range(kw):
            offw = j * dw - pw
            ow_lo, ow_hi = _valid(wo, sw, offw, w)
            if oh_hi <= oh_lo or ow_hi <= ow_lo:
                for c in range(cg):
                    r0 = uintp(((c * kh + i) * kw + j) * ld + coff)
                    for q in range(nq):
                        col[r0 + q] = 0
            elif plane:
                _im2col_plane(xf, xbase, col, ld, coff, cg, h, w, kh, kw, i, j, offh, offw, nq,
                              oh0, oh_lo, oh_hi, ow_lo, ow_hi)
            else:
                _im2col_rows(xf, xbase, col, ld, coff, cg, h, w, kh, kw, i, j, sh, sw, offh,
                             offw, wo, nq, oh0, oh_lo, oh_hi, ow_lo, ow_hi)


@njit(nogil=True, cache=True, error_model="numpy")
def col2im(col, ld, coff, dxf, xbase, cg, h, w, kh, kw, sh, sw, ph, pw, dh, dw, ho, wo, oh0,
           oh1):
    """Add the columns of output rows ``oh0:oh1`` (laid out as in :func:`im2col`) back into
    ``cg`` channels of the flat image gradient ``dxf`` from ``xbase``."""
    for i in range(kh):
        offh = i * dh - ph
        oh_lo, oh_hi = _valid(ho, sh, offh, h)
        oh_lo, oh_hi = max(oh_lo, oh0), min(oh_hi, oh1)
        for j in range(kw):
            offw = j * dw - pw
            ow_lo, ow_hi = _valid(wo, sw, offw, w)
            for c in range(cg):
                r0 = ((c * kh + i) * kw + j) * ld + coff
                for oh in range(oh_lo, oh_hi):
                    xb = uintp(xbase + (c * h + oh * sh + offh) * w + offw)
                    cb = uintp(r0 + (oh - oh0) * wo)
                    if sw == 1:
                        for q in range(uintp(ow_lo), uintp(ow_hi)):
                            dxf[xb + q] += col[cb + q]
                    else:
                        for q in range(uintp(ow_lo), uintp(ow_hi)):
                            dxf[xb + q * uintp(sw)] += col[cb + q]


@njit(nogil=True, cache=True, error_model="numpy")
def im2col_wide(xf, xbase, col, ld, coff, cg, h, w, kh, kw, dh, dw, ho, wo, adjoint):
    """im2col of a whole image, unpadded and stride 1, at the input's row pitch ``w``
    (:func:`~minidl.kernels.convolution.conv_geometry.column_pitch`): row ``r`` holds output ``(oh,
    ow)``
    at column ``oh * w + ow``, ``(ho-1) * w + wo`` columns, one contiguous run of the input
    (the ``w - wo`` columns after each output row hold input values no output uses). With
    ``adjoint``, col2im instead: the columns are added back into ``xf`` (the unused ones must
    hold zeros: they land on other input positions)."""
    nq = uintp((ho - 1) * w + wo)
    for i in range(kh):
        for j in range(kw):
            for c in range(cg):
                r0 = uintp(((c * kh + i) * kw + j) * ld + coff)
                xb = uintp(xbase + (c * h + i * dh) * w + j * dw)
                if adjoint:
                    for q in range(nq):
                        xf[xb + q] += col[r0 + q]
                else:
                    for q in range(nq):
                        col[r0 + q] = xf[xb + q]


# ----------------------------------------------------------------------------- numba
@njit(nogil=True, cache=True, inline="always", error_model="numpy")
def _product(a, b, c, ta, beta, m, n, k, work):
    """``c = op(a) @ b (+ c)``: thin products (few filters, few terms) by
    :func:`~minidl.kernels.small_gemm.thin_mm`, the others by BLAS."""
    if is_thin(m, n, k):
        thin_mm(a, b, c, ta, 1.0, beta, m, n, k)
    else:
        mm(a, b, c, ta, False, 1.0, beta, m, n, k, work)


@njit(nogil=True, cache=True, fastmath={"reassoc"}, error_model="numpy")
def _add_row_sums(a, out):
    """``out[r] += a[r].sum()`` (vectorised: the sum may be reordered)."""
    for r in range(a.shape[0]):
        s = a.dtype.type(0)
        for p in range(a.shape[1]):
            s += a[r, p]
        out[r] += s


@njit(nogil=True, cache=True, error_model="numpy")
def _image_columns(xf, xbase, col, ln, coff, cg, h, wd, geom, pitch, adjoint):
    """One image's im2col matrix at column ``coff`` of the ``ln``-column matrix ``col`` (the
    wide layout where ``pitch``, columns per output row, is wider than the output); with
    ``adjoint`` its col2im: the columns added into the image gradient ``xf``."""
    kh, kw, sh, sw, ph, pw, dh, dw, ho, wo = geom
    if pitch != wo:
        im2col_wide(xf, xbase, col, ln, coff, cg, h, wd, kh, kw, dh, dw, ho, wo, adjoint)
    elif adjoint:
        col2im(col, ln, coff, xf, xbase, cg, h, wd, kh, kw, sh, sw, ph, pw, dh, dw, ho, wo,
               0, ho)
    else:
        im2col(xf, xbase, col, ln, coff, cg, h, wd, kh, kw, sh, sw, ph, pw, dh, dw, ho, wo,
               0, ho)


@njit(nogil=True, cache=True, inline="always", error_model="numpy")
def _fwd_bands(x, w3, y, colbuf, s0, g, xb, band, geom, work):
    """Group ``g`` of image ``s0`` in bands of ``band`` output rows, each product written in
    place (BLAS with the plane's row stride)."""
    _, c, h, wd = x.shape
    groups, og, k = w3.shape
    cout, ho, wo = y.shape[1], y.shape[2], y.shape[3]
    cg = c // groups
    yn = y[s0].reshape((cout, ho * wo))
    for b0 in range(0, ho, band):
        b1 = min(b0 + band, ho)
        ln = (b1 - b0) * wo
        im2col(x[s0].reshape(-1), xb, colbuf, ln, 0, cg, h, wd, *geom, b0, b1)
        _product(w3[g], colbuf[: k * ln].reshape((k, ln)),
                 yn[g * og:(g + 1) * og, b0 * wo: b1 * wo], False, 0.0, og, ln,
                 k, work)


@njit(nogil=True, cache=True, inline="always", error_model="numpy")
def _scatter_image(yb, base, yn, g, og, ho, wo, pitch):
    """The ``og`` rows of one image's outputs at column ``base`` of the block product ``yb``
    (``pitch`` columns per output row) out to group ``g``'s rows of ``yn`` (``Cout x HWo``)."""
    hwo = ho * wo
    for o in range(og):
        if pitch == wo:
            for p in range(hwo):
                yn[g * og + o, p] = yb[o, base + p]
        else:
            for oh in range(ho):
                for ow in range(wo):
                    yn[g * og + o, oh * wo + ow] = yb[o, base + oh * pitch + ow]


@njit(nogil=True, cache=True, inline="always", error_model="numpy")
def _add_bias(y, b, s0, s1):
    """``y[n, co] += b[co]`` for the images ``s0:s1``."""
    cout, hwo = y.shape[1], y.shape[2] * y.shape[3]
    for n in range(s0, s1):
        yn = y[n].reshape((cout, hwo))
        for co in range(cout):
            bv = b[co]
            for p in range(hwo):
                yn[co, p] += bv


@njit(nogil=True, cache=True, error_model="numpy")
def _fwd_gemm(x, w3, b, has_bias, y, slabs, offs, bounds, nb, band, pitch, kh, kw, sh, sw, ph,
              pw, dh, dw, t, threads):
    """Thread ``t``'s images ``bounds[t]:bounds[t + 1]`` on its workspace row ``slabs[t]``:
    ``nb`` images per matrix product (``pitch`` columns per output row, see
    :func:`~minidl.kernels.convolution.conv_geometry.column_pitch`), or one image in bands of
    ``band``
    output rows written in place (BLAS with the plane's row stride)."""
    s, n0, n1 = slabs[t], bounds[t], bounds[t + 1]
    colbuf, ybuf = s[offs[0]:offs[1]], s[offs[1]:]
    _, c, h, wd = x.shape
    groups, og, k = w3.shape
    cout, ho, wo = y.shape[1], y.shape[2], y.shape[3]
    cg = c // groups
    hwo = ho * wo
    hwp = (ho - 1) * pitch + wo  # columns of one image
    work = np.empty(8, np.int32)
    geom = (kh, kw, sh, sw, ph, pw, dh, dw, ho, wo)
    for s0 in range(n0, n1, nb):
        s1 = min(s0 + nb, n1)
        for g in range(groups):
            xb = g * cg * h * wd
            if s1 - s0 == 1 and pitch == wo:
                _fwd_bands(x, w3, y, colbuf, s0, g, xb, band, geom, work)
            else:  # several images side by side: product into ybuf, then out to NCHW
                ln = (s1 - s0) * hwp
                for n in range(s0, s1):
                    _image_columns(x[n].reshape(-1), xb, colbuf, ln, (n - s0) * hwp, cg, h,
                                   wd, geom, pitch, False)
                yb = ybuf[: og * ln].reshape((og, ln))
                _product(w3[g], colbuf[: k * ln].reshape((k, ln)), yb, False, 0.0, og, ln, k,
                         work)
                for n in range(s0, s1):
                    _scatter_image(yb, (n - s0) * hwp, y[n].reshape((cout, hwo)), g, og, ho,
                                   wo, pitch)
        if has_bias:
            _add_bias(y, b, s0, s1)


@njit(nogil=True, cache=True, inline="always", error_model="numpy")
def _bwd_bands(x, w3, dy, dx, need_dx, colbuf, dcolbuf, dwg, s0, g, xb, band, geom, work):
    """Group ``g`` of image ``s0`` in bands of ``band`` output rows: ``dW`` added into
    ``dwg``, and (``need_dx``) the bands' ``dx`` added by col2im."""
    _, c, h, wd = x.shape
    groups, og, k = w3.shape
    cout, ho, wo = dy.shape[1], dy.shape[2], dy.shape[3]
    cg = c // groups
    wg = w3[g]
    dyn = dy[s0].reshape((cout, ho * wo))
    for b0 in range(0, ho, band):
        b1 = min(b0 + band, ho)
        ln = (b1 - b0) * wo
        im2col(x[s0].reshape(-1), xb, colbuf, ln, 0, cg, h, wd, *geom, b0, b1)
        dyv = dyn[g * og:(g + 1) * og, b0 * wo: b1 * wo]
        mm(dyv, colbuf[: k * ln].reshape((k, ln)), dwg, False, True, 1.0, 1.0,
           og, k, ln, work)
        if need_dx:
            _product(wg, dyv, dcolbuf[: k * ln].reshape((k, ln)), True, 0.0, k,
                     ln, og, work)
            col2im(dcolbuf, ln, 0, dx[s0].reshape(-1), xb, cg, h, wd, *geom, b0, b1)


@njit(nogil=True, cache=True, inline="always", error_model="numpy")
def _gather_image(yb, base, dyn, g, og, ho, wo, pitch):
    """Group ``g``'s rows of one image's output gradient ``dyn`` (``Cout x HWo``) into the
    block matrix ``yb`` at column ``base`` (``pitch`` columns per output row; the unused
    columns of the wide layout zeroed)."""
    hwo = ho * wo
    for o in range(og):
        if pitch == wo:
            for p in range(hwo):
                yb[o, base + p] = dyn[g * og + o, p]
        else:
            for oh in range(ho):
                for ow in range(wo):
                    yb[o, base + oh * pitch + ow] = dyn[g * og + o, oh * wo + ow]
                if oh < ho - 1:  # the unused columns: zeros in every product
                    for ow in range(wo, pitch):
                        yb[o, base + oh * pitch + ow] = 0


@njit(nogil=True, cache=True, inline="always", error_model="numpy")
def _zero_grads(dwacc, zero_dw, dbbuf, cout, k):
    """Zero ``dbbuf[:cout]``, and ``dwacc[:cout * k]`` if ``zero_dw``."""
    if zero_dw:
        for i in range(cout * k):
            dwacc[i] = 0
    for i in range(cout):
        dbbuf[i] = 0


@njit(nogil=True, cache=True, inline="always", error_model="numpy")
def _zero_images(dx, s0, s1):
    """Zero the images ``s0:s1`` of ``dx``."""
    for n in range(s0, s1):
        dxn = dx[n].reshape(-1)
        for i in range(dxn.size):
            dxn[i] = 0


@njit(nogil=True, cache=True, error_model="numpy")
def _bwd_gemm(x, w3, dy, dx, need_dx, s, offs, dwacc, zero_dw, dbbuf, n0, n1, nb, band, pitch,
              kh, kw, sh, sw, ph, pw, dh, dw):
    """Images ``n0:n1`` (blocked as in :func:`_fwd_gemm`): ``dW`` summed into ``dwacc``
    (``Cout x K``, BLAS with beta 1; zeroed first if ``zero_dw``), ``db`` into ``dbbuf``
    (zeroed first), ``dx`` rows."""
    colbuf, dcolbuf, dybuf = s[offs[0]:offs[1]], s[offs[1]:offs[2]], s[offs[2]:]
    _, c, h, wd = x.shape
    groups, og, k = w3.shape
    cout, ho, wo = dy.shape[1], dy.shape[2], dy.shape[3]
    cg = c // groups
    hwo = ho * wo
    hwp = (ho - 1) * pitch + wo
    work = np.empty(8, np.int32)
    geom = (kh, kw, sh, sw, ph, pw, dh, dw, ho, wo)
    _zero_grads(dwacc, zero_dw, dbbuf, cout, k)
    dw2 = dwacc[: cout * k].reshape((cout, k))
    for s0 in range(n0, n1, nb):
        s1 = min(s0 + nb, n1)
        if need_dx:
            _zero_images(dx, s0, s1)
        for g in range(groups):
            xb = g * cg * h * wd
            wg = w3[g]
            dwg = dw2[g * og:(g + 1) * og]
            if s1 - s0 == 1 and pitch == wo:
                _bwd_bands(x, w3, dy, dx, need_dx, colbuf, dcolbuf, dwg, s0, g, xb, band, geom,
                           work)
            else:  # several images side by side: gather their output gradients
                ln = (s1 - s0) * hwp
                yb = dybuf[: og * ln].reshape((og, ln))
                for n in range(s0, s1):
                    _image_columns(x[n].reshape(-1), xb, colbuf, ln, (n - s0) * hwp, cg, h,
                                   wd, geom, pitch, False)
                    _gather_image(yb, (n - s0) * hwp, dy[n].reshape((cout, hwo)), g, og, ho,
                                  wo, pitch)
                mm(yb, colbuf[: k * ln].reshape((k, ln)), dwg, False, True, 1.0, 1.0, og, k,
                   ln, work)
                if need_dx:
                    _product(wg, yb, dcolbuf[: k * ln].reshape((k, ln)), True, 0.0, k, ln, og,
                             work)
                    for n in range(s0, s1):
                        _image_columns(dx[n].reshape(-1), xb, dcolbuf, ln, (n - s0) * hwp,
                                       cg, h, wd, geom, pitch, True)
        for n in range(s0, s1):
            _add_row_sums(dy[n].reshape((cout, hwo)), dbbuf)


# ----------------------------------------------------------------------------- parts
@njit(nogil=True, cache=True, error_model="numpy")
def _bwd_gemm_parts(x, w3, dy, dx, need_dx, slabs, offs, dwout, add_dw, dwparts, dbparts, bounds,
                    nb, band, pitch, kh, kw, sh, sw, ph, pw, dh, dw, first, step):
    """Gradient parts ``first, first + step, ...`` on the workspace row ``slabs[first]`` (a
    thread ``first`` of ``step``, see :class:`~minidl.kernels.parallel.ThreadedKernel`); the
    first part's ``dW`` goes into ``dwout`` (added to what it holds if ``add_dw``)."""
    s = slabs[first]
    for p in range(first, bounds.size - 1, step):
        acc = dwout if p == 0 else dwparts[p - 1]
        _bwd_gemm(x, w3, dy, dx, need_dx, s, offs, acc, p > 0 or not add_dw, dbparts[p],
                  bounds[p], bounds[p + 1], nb, band, pitch, kh, kw, sh, sw, ph, pw, dh, dw)


#: Forward and backward on Numba's pool, one workspace row per thread.
FWD_GEMM = ThreadedKernel(_fwd_gemm)
BWD_GEMM = ThreadedKernel(_bwd_gemm_parts)

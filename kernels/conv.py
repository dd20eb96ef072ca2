"""2-D convolution (NCHW, PyTorch weight layout): NumPy reference and Numba CPU kernels.

Two CPU algorithms, both per image so that every buffer stays in cache:

* ``gemm``: im2col of one image (and group) into a ``(Cin/g*kh*kw, Ho*Wo)`` buffer, then one
  matrix product with the weight written straight into the NCHW output; backward recomputes
  the im2col, ``dW += dY_n @ col.T`` and ``dcol = W.T @ dY_n`` scattered back by col2im.
* ``direct``: stride 1 and a small reduction (e.g. a first layer with one input channel): the
  image is padded once into a buffer and every tap is one contiguous multiply-add over a
  "wide" output grid of ``Ho x (W + 2*pw)``, whose extra columns are dropped on copy-out.

The batch is split over :func:`~minidl.kernels.parallel.num_threads` threads, each running a
serial GIL-free kernel on its own slab of the workspace. Weight gradients are summed per
chunk and reduced once at the end.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit, uintp

from .parallel import chunks, num_threads, run_chunks

Pair = tuple[int, int]

#: Largest ``Cin/groups * kh * kw`` for which stride-1 convolutions use the direct kernel.
DIRECT_MAX_K = 16
_ALIGN = 64


# ----------------------------------------------------------------------------- geometry
def conv_output_hw(hw: Pair, kernel: Pair, stride: Pair, padding: Pair, dilation: Pair) -> Pair:
    """Output height and width (PyTorch's formula, floor mode)."""
    return tuple(  # type: ignore[return-value]
        (hw[a] + 2 * padding[a] - dilation[a] * (kernel[a] - 1) - 1) // stride[a] + 1
        for a in range(2)
    )


def choose_algo(cin_g: int, kernel: Pair, stride: Pair) -> str:
    """``"direct"`` for stride-1 convolutions with a small reduction, else ``"gemm"``."""
    if stride == (1, 1) and cin_g * kernel[0] * kernel[1] <= DIRECT_MAX_K:
        return "direct"
    return "gemm"


def _slab_elems(
    x_shape: tuple[int, ...], cout: int, kernel: Pair, stride: Pair, padding: Pair,
    dilation: Pair, groups: int, backward: bool, algo: str,
) -> list[int]:
    """Element counts of one thread's buffers, in the order the kernels take them."""
    _, c, h, w = x_shape
    kh, kw = kernel
    ho, wo = conv_output_hw((h, w), kernel, stride, padding, dilation)
    cg, og = c // groups, cout // groups
    k = cg * kh * kw
    if algo == "direct":
        hp, wp = h + 2 * padding[0], w + 2 * padding[1]
        xp = cg * hp * wp + (kw - 1) * dilation[1] + 1
        if not backward:
            return [xp, ho * wp]
        return [xp, ho * wp, xp, cout * k, cout]  # xp, dy wide, dxp, dW part, db part
    if not backward:
        return [k * ho * wo]
    return [k * ho * wo, k * ho * wo, og * k, cout * k, cout]  # col, dcol, tmp, dW, db


def _slab_bytes(elems: list[int], itemsize: int) -> int:
    return sum(-(-e * itemsize // _ALIGN) * _ALIGN for e in elems)


def conv2d_workspace_bytes(
    x_shape: tuple[int, ...], cout: int, kernel: Pair, stride: Pair, padding: Pair,
    dilation: Pair, groups: int, dtype: Any, backward: bool, threads: int | None = None,
) -> int:
    """Workspace bytes of :func:`conv2d_forward` / :func:`conv2d_backward` (all threads)."""
    algo = choose_algo(x_shape[1] // groups, kernel, stride)
    elems = _slab_elems(x_shape, cout, kernel, stride, padding, dilation, groups, backward, algo)
    t = min(threads or num_threads(), max(1, x_shape[0]))
    return t * _slab_bytes(elems, np.dtype(dtype).itemsize)


def _slabs(workspace: np.ndarray | None, elems: list[int], dtype: np.dtype, n: int,
           threads: int | None) -> list[list[np.ndarray]]:
    """Cut the workspace into per-thread lists of 1-D buffers (as many threads as fit)."""
    per = _slab_bytes(elems, dtype.itemsize)
    t = min(threads or num_threads(), max(1, n))
    if workspace is None:
        workspace = np.empty(t * per + _ALIGN, np.uint8)
    base = (-workspace.ctypes.data) % _ALIGN if workspace.nbytes >= t * per + _ALIGN else 0
    t = max(1, min(t, (workspace.nbytes - base) // per))
    if (workspace.nbytes - base) < per:
        raise ValueError(f"conv2d workspace of {workspace.nbytes} bytes, needs at least {per}")
    out = []
    for i in range(t):
        off = base + i * per
        bufs = []
        for e in elems:
            nb = -(-e * dtype.itemsize // _ALIGN) * _ALIGN
            bufs.append(workspace[off: off + e * dtype.itemsize].view(dtype))
            off += nb
        out.append(bufs)
    return out


# ----------------------------------------------------------------------------- reference
def _tap_slices(i: int, j: int, ho: int, wo: int, stride: Pair, dilation: Pair):
    return (
        slice(i * dilation[0], i * dilation[0] + stride[0] * (ho - 1) + 1, stride[0]),
        slice(j * dilation[1], j * dilation[1] + stride[1] * (wo - 1) + 1, stride[1]),
    )


def conv2d_forward_ref(x: np.ndarray, w: np.ndarray, b: np.ndarray | None, stride: Pair = (1, 1),
                       padding: Pair = (0, 0), dilation: Pair = (1, 1), groups: int = 1
                       ) -> np.ndarray:
    """NumPy reference: ``y = conv2d(x, w) + b`` (PyTorch semantics)."""
    n, c, h, wd = x.shape
    cout, cg, kh, kw = w.shape
    ho, wo = conv_output_hw((h, wd), (kh, kw), stride, padding, dilation)
    xp = np.pad(x, ((0, 0), (0, 0), (padding[0],) * 2, (padding[1],) * 2))
    y = np.zeros((n, groups, cout // groups, ho, wo), dtype=x.dtype)
    for i in range(kh):
        for j in range(kw):
            sh, sw = _tap_slices(i, j, ho, wo, stride, dilation)
            xs = xp[:, :, sh, sw].reshape(n, groups, cg, ho, wo)
            wg = w[:, :, i, j].reshape(groups, cout // groups, cg)
            y += np.einsum("ngchw,goc->ngohw", xs, wg)
    y = y.reshape(n, cout, ho, wo)
    if b is not None:
        y += b.reshape(1, -1, 1, 1)
    return y


def conv2d_backward_ref(x: np.ndarray, w: np.ndarray, dy: np.ndarray, stride: Pair = (1, 1),
                        padding: Pair = (0, 0), dilation: Pair = (1, 1), groups: int = 1
                        ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """NumPy reference: ``(dx, dw, db)`` of :func:`conv2d_forward_ref`."""
    n, c, h, wd = x.shape
    cout, cg, kh, kw = w.shape
    og = cout // groups
    ho, wo = dy.shape[2:]
    xp = np.pad(x, ((0, 0), (0, 0), (padding[0],) * 2, (padding[1],) * 2))
    dxp = np.zeros_like(xp)
    dw = np.zeros_like(w)
    dyg = dy.reshape(n, groups, og, ho, wo)
    for i in range(kh):
        for j in range(kw):
            sh, sw = _tap_slices(i, j, ho, wo, stride, dilation)
            xs = xp[:, :, sh, sw].reshape(n, groups, cg, ho, wo)
            wg = w[:, :, i, j].reshape(groups, og, cg)
            dw[:, :, i, j] = np.einsum("ngohw,ngchw->goc", dyg, xs).reshape(cout, cg)
            dxp[:, :, sh, sw] += np.einsum("ngohw,goc->ngchw", dyg, wg).reshape(n, c, ho, wo)
    dx = dxp[:, :, padding[0]: padding[0] + h, padding[1]: padding[1] + wd]
    return np.ascontiguousarray(dx), dw, dy.sum(axis=(0, 2, 3))


def im2col_ref(x: np.ndarray, kernel: Pair, stride: Pair, padding: Pair, dilation: Pair
               ) -> np.ndarray:
    """NumPy reference im2col of one image ``(C, H, W)`` -> ``(C*kh*kw, Ho*Wo)``."""
    c, h, w = x.shape
    ho, wo = conv_output_hw((h, w), kernel, stride, padding, dilation)
    xp = np.pad(x, ((0, 0), (padding[0],) * 2, (padding[1],) * 2))
    col = np.empty((c, kernel[0], kernel[1], ho, wo), x.dtype)
    for i in range(kernel[0]):
        for j in range(kernel[1]):
            sh, sw = _tap_slices(i, j, ho, wo, stride, dilation)
            col[:, i, j] = xp[:, sh, sw]
    return col.reshape(c * kernel[0] * kernel[1], ho * wo)


# ----------------------------------------------------------------------------- numba: im2col
@njit(nogil=True, cache=True, inline="always")
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


@njit(nogil=True, cache=True)
def im2col(xf, xbase, col, cg, h, w, kh, kw, sh, sw, ph, pw, dh, dw, ho, wo):
    """im2col of ``cg`` channels of a flat image starting at ``xf[xbase]`` into flat ``col``.

    Hot loops index with unsigned integers: Numba then skips its negative-index wraparound,
    which otherwise blocks vectorisation (measured 4-6x slower).
    """
    hwo = uintp(ho * wo)
    plane = sh == 1 and sw == 1 and wo == w
    for i in range(kh):
        offh = i * dh - ph
        oh_lo, oh_hi = _valid(ho, sh, offh, h)
        for j in range(kw):
            offw = j * dw - pw
            ow_lo, ow_hi = _valid(wo, sw, offw, w)
            for c in range(cg):
                r0 = uintp(((c * kh + i) * kw + j) * ho * wo)
                if oh_hi <= oh_lo or ow_hi <= ow_lo:
                    for q in range(hwo):
                        col[r0 + q] = 0
                elif plane:
                    # Same-size output: one shifted contiguous copy, then zero the border.
                    start = uintp(oh_lo * w + ow_lo)
                    stop = uintp((oh_hi - 1) * w + ow_hi)
                    xb = uintp(xbase + (c * h + offh) * w + offw)
                    for q in range(start, stop):
                        col[r0 + q] = xf[xb + q]
                    for q in range(start):
                        col[r0 + q] = 0
                    for q in range(stop, hwo):
                        col[r0 + q] = 0
                    for oh in range(oh_lo, oh_hi - 1):
                        for q in range(uintp(oh * w + ow_hi), uintp(oh * w + w + ow_lo)):
                            col[r0 + q] = 0
                else:
                    for q in range(uintp(oh_lo * wo)):
                        col[r0 + q] = 0
                    for oh in range(oh_lo, oh_hi):
                        xb = uintp(xbase + (c * h + oh * sh + offh) * w + offw)
                        cb = uintp(r0 + oh * wo)
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
                    for q in range(uintp(oh_hi * wo), hwo):
                        col[r0 + q] = 0


@njit(nogil=True, cache=True)
def col2im(col, dxf, xbase, cg, h, w, kh, kw, sh, sw, ph, pw, dh, dw, ho, wo):
    """Scatter-add flat ``col`` into ``cg`` channels of flat ``dxf`` from ``xbase`` (zeroed
    first)."""
    for q in range(uintp(xbase), uintp(xbase + cg * h * w)):
        dxf[q] = 0
    for i in range(kh):
        offh = i * dh - ph
        oh_lo, oh_hi = _valid(ho, sh, offh, h)
        for j in range(kw):
            offw = j * dw - pw
            ow_lo, ow_hi = _valid(wo, sw, offw, w)
            for c in range(cg):
                r0 = ((c * kh + i) * kw + j) * ho * wo
                for oh in range(oh_lo, oh_hi):
                    xb = uintp(xbase + (c * h + oh * sh + offh) * w + offw)
                    cb = uintp(r0 + oh * wo)
                    if sw == 1:
                        for q in range(uintp(ow_lo), uintp(ow_hi)):
                            dxf[xb + q] += col[cb + q]
                    else:
                        for q in range(uintp(ow_lo), uintp(ow_hi)):
                            dxf[xb + q * uintp(sw)] += col[cb + q]


# ----------------------------------------------------------------------------- numba: gemm
@njit(nogil=True, cache=True, fastmath={"reassoc"})
def _add_row_sums(a, out):
    """``out[r] += a[r].sum()`` (vectorised: the sum may be reordered)."""
    for r in range(a.shape[0]):
        s = a.dtype.type(0)
        for p in range(a.shape[1]):
            s += a[r, p]
        out[r] += s


@njit(nogil=True, cache=True)
def _fwd_gemm(x, w3, b, has_bias, y, colbuf, n0, n1, kh, kw, sh, sw, ph, pw, dh, dw):
    _, c, h, wd = x.shape
    groups, og, k = w3.shape
    cout, ho, wo = y.shape[1], y.shape[2], y.shape[3]
    cg = c // groups
    hwo = ho * wo
    col = colbuf[: k * hwo].reshape((k, hwo))
    for n in range(n0, n1):
        xf = x[n].reshape(-1)
        yn = y[n].reshape((groups, og, hwo))
        for g in range(groups):
            im2col(xf, g * cg * h * wd, colbuf, cg, h, wd, kh, kw, sh, sw, ph, pw, dh, dw, ho, wo)
            np.dot(w3[g], col, yn[g])
        if has_bias:
            y2 = y[n].reshape((cout, hwo))
            for co in range(cout):
                bv = b[co]
                for p in range(hwo):
                    y2[co, p] += bv


@njit(nogil=True, cache=True)
def _bwd_gemm(x, w3, dy, dx, need_dx, colbuf, dcolbuf, tmpbuf, dwbuf, dbbuf, n0, n1,
              kh, kw, sh, sw, ph, pw, dh, dw):
    _, c, h, wd = x.shape
    groups, og, k = w3.shape
    cout, ho, wo = dy.shape[1], dy.shape[2], dy.shape[3]
    cg = c // groups
    hwo = ho * wo
    col = colbuf[: k * hwo].reshape((k, hwo))
    dcol = dcolbuf[: k * hwo].reshape((k, hwo))
    tmp = tmpbuf[: og * k].reshape((og, k))
    dw3 = dwbuf[: cout * k].reshape((groups, og, k))
    dw3[:] = 0
    dbbuf[:cout] = 0
    for n in range(n0, n1):
        xf = x[n].reshape(-1)
        dyn = dy[n].reshape((groups, og, hwo))
        for g in range(groups):
            im2col(xf, g * cg * h * wd, colbuf, cg, h, wd, kh, kw, sh, sw, ph, pw, dh, dw, ho, wo)
            np.dot(dyn[g], col.T, tmp)
            dw3[g] += tmp
            if need_dx:
                np.dot(w3[g].T, dyn[g], dcol)
                col2im(dcolbuf, dx[n].reshape(-1), g * cg * h * wd, cg, h, wd,
                       kh, kw, sh, sw, ph, pw, dh, dw, ho, wo)
        _add_row_sums(dy[n].reshape((cout, hwo)), dbbuf)


# ----------------------------------------------------------------------------- numba: direct
@njit(nogil=True, cache=True, inline="always")
def _pad_image(xf, xbase, xp, cg, h, w, ph, pw, hp, wp):
    xp[:] = 0
    for c in range(cg):
        for r in range(h):
            src = uintp(xbase + (c * h + r) * w)
            dst = uintp((c * hp + r + ph) * wp + pw)
            for q in range(uintp(w)):
                xp[dst + q] = xf[src + q]


@njit(nogil=True, cache=True, fastmath={"contract"})
def _fwd_direct(x, w, b, has_bias, y, xp, acc, n0, n1, groups, ph, pw, dh, dw):
    _, c, h, wd = x.shape
    cout, cg, kh, kw = w.shape
    ho, wo = y.shape[2], y.shape[3]
    og = cout // groups
    hp, wp = h + 2 * ph, wd + 2 * pw
    m = uintp(ho * wp)
    for n in range(n0, n1):
        xf = x[n].reshape(-1)
        for g in range(groups):
            _pad_image(xf, g * cg * h * wd, xp, cg, h, wd, ph, pw, hp, wp)
            for oc in range(og):
                co = g * og + oc
                bv = b[co] if has_bias else 0.0
                for p in range(m):
                    acc[p] = bv
                for ci in range(cg):
                    for i in range(kh):
                        for j in range(kw):
                            wv = w[co, ci, i, j]
                            off = uintp((ci * hp + i * dh) * wp + j * dw)
                            for p in range(m):
                                acc[p] += wv * xp[off + p]
                yf = y[n, co].reshape(-1)
                for oh in range(ho):
                    src = uintp(oh * wp)
                    dst = uintp(oh * wo)
                    for q in range(uintp(wo)):
                        yf[dst + q] = acc[src + q]


@njit(nogil=True, cache=True, fastmath={"contract", "reassoc"})
def _bwd_direct(x, w, dy, dx, need_dx, xp, dyw, dxp, dwbuf, dbbuf, n0, n1, groups,
                ph, pw, dh, dw):
    _, c, h, wd = x.shape
    cout, cg, kh, kw = w.shape
    ho, wo = dy.shape[2], dy.shape[3]
    og = cout // groups
    hp, wp = h + 2 * ph, wd + 2 * pw
    m = uintp(ho * wp)
    k = cg * kh * kw
    dw2 = dwbuf[: cout * k].reshape((cout, k))
    dw2[:] = 0
    dbbuf[:cout] = 0
    for n in range(n0, n1):
        xf = x[n].reshape(-1)
        for g in range(groups):
            _pad_image(xf, g * cg * h * wd, xp, cg, h, wd, ph, pw, hp, wp)
            if need_dx:
                dxp[:] = 0
            for oc in range(og):
                co = g * og + oc
                dyf = dy[n, co].reshape(-1)
                s = 0.0
                for oh in range(ho):
                    src = uintp(oh * wo)
                    dst = uintp(oh * wp)
                    for q in range(uintp(wo)):
                        v = dyf[src + q]
                        dyw[dst + q] = v
                        s += v
                    for q in range(uintp(wo), uintp(wp)):
                        dyw[dst + q] = 0
                dbbuf[co] += s
                for ci in range(cg):
                    for i in range(kh):
                        for j in range(kw):
                            off = uintp((ci * hp + i * dh) * wp + j * dw)
                            a = 0.0
                            for p in range(m):
                                a += dyw[p] * xp[off + p]
                            dw2[co, (ci * kh + i) * kw + j] += a
                            if need_dx:
                                wv = w[co, ci, i, j]
                                for p in range(m):
                                    dxp[off + p] += wv * dyw[p]
            if need_dx:
                for ci in range(cg):
                    dxf = dx[n, g * cg + ci].reshape(-1)
                    for r in range(h):
                        src = uintp((ci * hp + r + ph) * wp + pw)
                        dst = uintp(r * wd)
                        for q in range(uintp(wd)):
                            dxf[dst + q] = dxp[src + q]


# ----------------------------------------------------------------------------- drivers
def _c(a: np.ndarray) -> np.ndarray:
    return a if a.flags.c_contiguous else np.ascontiguousarray(a)


def conv2d_forward(
    x: np.ndarray, w: np.ndarray, b: np.ndarray | None, y: np.ndarray, stride: Pair = (1, 1),
    padding: Pair = (0, 0), dilation: Pair = (1, 1), groups: int = 1,
    workspace: np.ndarray | None = None, threads: int | None = None, algo: str | None = None,
) -> None:
    """Write ``conv2d(x, w) + b`` into ``y`` (NCHW). ``workspace``: ``uint8`` of at least
    :func:`conv2d_workspace_bytes` (``backward=False``); ``None`` allocates one."""
    n = x.shape[0]
    cout, cg, kh, kw = w.shape
    algo = algo or choose_algo(cg, (kh, kw), stride)
    elems = _slab_elems(x.shape, cout, (kh, kw), stride, padding, dilation, groups, False, algo)
    slabs = _slabs(workspace, elems, x.dtype, n, threads)
    x, w = _c(x), _c(w)
    out = y if y.flags.c_contiguous else np.empty(y.shape, y.dtype)
    has_bias = b is not None
    bb = _c(b) if has_bias else np.zeros(0, x.dtype)
    parts = chunks(n, len(slabs))
    if algo == "direct":
        args = [(x, w, bb, has_bias, out, s[0], s[1], n0, n1, groups, padding[0], padding[1],
                 dilation[0], dilation[1]) for s, (n0, n1) in zip(slabs, parts)]
        run_chunks(_fwd_direct, args)
    else:
        w3 = w.reshape(groups, cout // groups, cg * kh * kw)
        args = [(x, w3, bb, has_bias, out, s[0], n0, n1, kh, kw, stride[0], stride[1],
                 padding[0], padding[1], dilation[0], dilation[1])
                for s, (n0, n1) in zip(slabs, parts)]
        run_chunks(_fwd_gemm, args)
    if out is not y:
        y[...] = out


def conv2d_backward(
    x: np.ndarray, w: np.ndarray, dy: np.ndarray, dx: np.ndarray | None, dw: np.ndarray,
    db: np.ndarray | None, stride: Pair = (1, 1), padding: Pair = (0, 0),
    dilation: Pair = (1, 1), groups: int = 1, workspace: np.ndarray | None = None,
    threads: int | None = None, algo: str | None = None,
) -> None:
    """Overwrite ``dw``, ``db`` (if given) and ``dx`` (if given) with the gradients of
    :func:`conv2d_forward`. ``workspace``: :func:`conv2d_workspace_bytes`, ``backward=True``."""
    n = x.shape[0]
    cout, cg, kh, kw = w.shape
    algo = algo or choose_algo(cg, (kh, kw), stride)
    elems = _slab_elems(x.shape, cout, (kh, kw), stride, padding, dilation, groups, True, algo)
    slabs = _slabs(workspace, elems, x.dtype, n, threads)
    x, w, dy = _c(x), _c(w), _c(dy)
    need_dx = dx is not None
    dxo = (dx if dx.flags.c_contiguous else np.empty(dx.shape, dx.dtype)) if need_dx else \
        np.zeros((0, 0, 0, 0), x.dtype)
    parts = chunks(n, len(slabs))
    if algo == "direct":
        args = [(x, w, dy, dxo, need_dx, s[0], s[1], s[2], s[3], s[4], n0, n1, groups,
                 padding[0], padding[1], dilation[0], dilation[1])
                for s, (n0, n1) in zip(slabs, parts)]
        run_chunks(_bwd_direct, args)
        dws, dbs = [s[3] for s in slabs], [s[4] for s in slabs]
    else:
        w3 = w.reshape(groups, cout // groups, cg * kh * kw)
        args = [(x, w3, dy, dxo, need_dx, s[0], s[1], s[2], s[3], s[4], n0, n1, kh, kw,
                 stride[0], stride[1], padding[0], padding[1], dilation[0], dilation[1])
                for s, (n0, n1) in zip(slabs, parts)]
        run_chunks(_bwd_gemm, args)
        dws, dbs = [s[3] for s in slabs], [s[4] for s in slabs]
    np.copyto(dw, dws[0].reshape(w.shape))
    for part in dws[1:]:
        np.add(dw, part.reshape(w.shape), out=dw)
    if db is not None:
        np.copyto(db, dbs[0])
        for part in dbs[1:]:
            db += part
    if need_dx and dxo is not dx:
        dx[...] = dxo

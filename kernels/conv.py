"""2-D convolution (NCHW, PyTorch weight layout): NumPy reference and Numba CPU kernels.

Two CPU algorithms (:func:`choose_algo`), both working image by image so that buffers stay
in cache:

* ``gemm`` (any geometry): im2col of one image (and group) into a ``(Cin/g*kh*kw, Ho*Wo)``
  buffer, then one matrix product with the weight written straight into the NCHW output
  (Numba's ``np.dot``, i.e. BLAS). Backward recomputes the im2col (only the input is
  retained), accumulates ``dW += dY_n @ col.T`` and, when the input gradient is wanted,
  scatters ``dcol = W.T @ dY_n`` back with col2im.
* ``winograd`` (3x3, stride 1, one group, enough channels): F(2x2, 3x3), see
  :mod:`minidl.kernels.winograd`; 2.25x fewer multiplications.

The batch is split over :func:`~minidl.kernels.parallel.num_threads` threads (one ``prange``
iteration each, each thread on its own row of the workspace); weight-gradient partials are
summed once at the end. Small calls run on the calling thread. A direct (no im2col) kernel
for one-input-channel layers was measured slower than im2col + GEMM (conv1 of smallcnn:
0.73 / 1.6 ms against 0.47 / 0.51 ms forward / backward) and was dropped.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit, prange, uintp

from . import _cuda, winograd
from .parallel import ensure_blas_policy, num_threads, split

Pair = tuple[int, int]

_ALIGN = 64


# ----------------------------------------------------------------------------- geometry
def conv_output_hw(hw: Pair, kernel: Pair, stride: Pair, padding: Pair, dilation: Pair) -> Pair:
    """Output height and width (PyTorch's formula, floor mode)."""
    return tuple(  # type: ignore[return-value]
        (hw[a] + 2 * padding[a] - dilation[a] * (kernel[a] - 1) - 1) // stride[a] + 1
        for a in range(2)
    )


#: Winograd F(2x2, 3x3) needs at least this many input channels (below, its small matrix
#: products lose to im2col: 16 -> 16 channels at 32x32 took 19 ms against 7.6 ms forward) ...
WINOGRAD_MIN_CIN = 32
#: ... and from this many to this many 2x2 tiles per image plane. Measured (batch 32, forward
#: + backward, Winograd / im2col time): 0.5-0.8 at 14x14 and 28x28 planes (49 and 196 tiles),
#: 1.0-1.6 at 4x4 and 8x8, 1.4 at 40x40 (the transformed tiles of one image overflow L2).
WINOGRAD_MIN_TILES = 36
WINOGRAD_MAX_TILES = 256


def choose_algo(x_shape: tuple[int, ...], kernel: Pair, stride: Pair, dilation: Pair,
                groups: int, padding: Pair = (1, 1)) -> str:
    """``"winograd"`` for 3x3 / stride 1 / dilation 1 / one group with at least
    :data:`WINOGRAD_MIN_CIN` input channels and :data:`WINOGRAD_MIN_TILES` to
    :data:`WINOGRAD_MAX_TILES` tiles per plane, else ``"gemm"`` (im2col). Measured on
    smallcnn's conv2 (32 -> 64 at 14x14): 2.0 / 4.2 ms against 3.0 / 5.9 ms forward /
    backward."""
    if (kernel == (3, 3) and stride == (1, 1) and dilation == (1, 1) and groups == 1
            and x_shape[1] >= WINOGRAD_MIN_CIN):
        th, tw = winograd.tiles(x_shape[2] + 2 * padding[0] - 2, x_shape[3] + 2 * padding[1] - 2)
        if WINOGRAD_MIN_TILES <= th * tw <= WINOGRAD_MAX_TILES:
            return "winograd"
    return "gemm"


def _winograd_nb(x_shape, cout, padding, itemsize) -> int:
    ho, wo = x_shape[2] + 2 * padding[0] - 2, x_shape[3] + 2 * padding[1] - 2
    return min(max(1, x_shape[0]), winograd.images_per_block(x_shape[1], cout, ho, wo, itemsize))


def _slab_elems(
    x_shape: tuple[int, ...], cout: int, kernel: Pair, stride: Pair, padding: Pair,
    dilation: Pair, groups: int, backward: bool, algo: str, itemsize: int,
) -> list[int]:
    """Element counts of one thread's buffers, in the order the kernels take them."""
    if algo == "winograd":
        nb = _winograd_nb(x_shape, cout, padding, itemsize)
        return winograd.slab_elems(x_shape, cout, padding, nb, backward)
    _, c, h, w = x_shape
    ho, wo = conv_output_hw((h, w), kernel, stride, padding, dilation)
    k = c // groups * kernel[0] * kernel[1]
    nb = _gemm_nb(x_shape, k, ho * wo, itemsize)
    ln = nb * ho * wo
    side = cout // groups * ln if nb > 1 else 0  # products of several images side by side
    if not backward:
        return [k * ln, side]  # col, y block
    return [k * ln, k * ln, side, cout // groups * k, cout * k, cout]  # col dcol dy tmp dW db


#: im2col + GEMM multiplies several images at once when one image's output plane has fewer
#: columns than this (small late-stage planes: a 4x4 plane alone makes a 16-column product
#: that streams the whole weight matrix for little work) ...
GEMM_MIN_COLS = 256
#: ... as long as their im2col matrix stays below this many bytes.
GEMM_MAX_COL_BYTES = 4 << 20


def _gemm_nb(x_shape: tuple[int, ...], k: int, hwo: int, itemsize: int) -> int:
    """Images per matrix product of the im2col path."""
    nb = -(-GEMM_MIN_COLS // max(hwo, 1))
    nb = min(nb, max(1, GEMM_MAX_COL_BYTES // max(1, k * hwo * itemsize)))
    return max(1, min(nb, x_shape[0]))


#: Thread cap of the conv kernels: every thread has its own workspace row (~0.5-1 MB), so
#: the declared workspace grows with the thread count.
MAX_THREADS = 16


def _default_threads() -> int:
    return min(num_threads(), MAX_THREADS)


def _slab_bytes(elems: list[int], itemsize: int) -> int:
    return sum(-(-e * itemsize // _ALIGN) * _ALIGN for e in elems)


def conv2d_workspace_bytes(
    x_shape: tuple[int, ...], cout: int, kernel: Pair, stride: Pair, padding: Pair,
    dilation: Pair, groups: int, dtype: Any, backward: bool, threads: int | None = None,
    algo: str | None = None,
) -> int:
    """Workspace bytes of :func:`conv2d_forward` / :func:`conv2d_backward` (all threads)."""
    algo = algo or choose_algo(x_shape, kernel, stride, dilation, groups, padding)
    elems = _slab_elems(x_shape, cout, kernel, stride, padding, dilation, groups, backward,
                        algo, np.dtype(dtype).itemsize)
    t = min(threads or _default_threads(), max(1, x_shape[0]))
    return t * _slab_bytes(elems, np.dtype(dtype).itemsize)


def _slabs(workspace: np.ndarray | None, elems: list[int], dtype: np.dtype, n: int,
           threads: int | None) -> tuple[np.ndarray, np.ndarray]:
    """View the workspace as ``(threads, per_thread)`` elements (as many threads as fit) and
    return it with the start offsets of each buffer in a row."""
    per = _slab_bytes(elems, dtype.itemsize)
    t = min(threads or _default_threads(), max(1, n))
    if workspace is None:
        workspace = np.empty(t * per, np.uint8)
    t = min(t, workspace.nbytes // per)
    if t < 1:
        raise ValueError(f"conv2d workspace of {workspace.nbytes} bytes, needs at least {per}")
    offs = np.cumsum([0] + [-(-e * dtype.itemsize // _ALIGN) * _ALIGN // dtype.itemsize
                            for e in elems[:-1]]).astype(np.int64)
    return workspace[: t * per].view(dtype).reshape(t, per // dtype.itemsize), offs


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
def im2col(xf, xbase, col, ld, coff, cg, h, w, kh, kw, sh, sw, ph, pw, dh, dw, ho, wo):
    """im2col of ``cg`` channels of a flat image starting at ``xf[xbase]`` into flat ``col``:
    row ``r`` of the ``(cg*kh*kw, ho*wo)`` result at ``col[r*ld + coff:]`` (``ld`` >= ho*wo
    lets several images share one matrix, side by side).

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
                r0 = uintp(((c * kh + i) * kw + j) * ld + coff)
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
def col2im(col, ld, coff, dxf, xbase, cg, h, w, kh, kw, sh, sw, ph, pw, dh, dw, ho, wo):
    """Scatter-add flat ``col`` (laid out as in :func:`im2col`) into ``cg`` channels of flat
    ``dxf`` from ``xbase`` (zeroed first)."""
    for q in range(uintp(xbase), uintp(xbase + cg * h * w)):
        dxf[q] = 0
    for i in range(kh):
        offh = i * dh - ph
        oh_lo, oh_hi = _valid(ho, sh, offh, h)
        for j in range(kw):
            offw = j * dw - pw
            ow_lo, ow_hi = _valid(wo, sw, offw, w)
            for c in range(cg):
                r0 = ((c * kh + i) * kw + j) * ld + coff
                for oh in range(oh_lo, oh_hi):
                    xb = uintp(xbase + (c * h + oh * sh + offh) * w + offw)
                    cb = uintp(r0 + oh * wo)
                    if sw == 1:
                        for q in range(uintp(ow_lo), uintp(ow_hi)):
                            dxf[xb + q] += col[cb + q]
                    else:
                        for q in range(uintp(ow_lo), uintp(ow_hi)):
                            dxf[xb + q * uintp(sw)] += col[cb + q]


# ----------------------------------------------------------------------------- numba
@njit(nogil=True, cache=True, fastmath={"reassoc"})
def _add_row_sums(a, out):
    """``out[r] += a[r].sum()`` (vectorised: the sum may be reordered)."""
    for r in range(a.shape[0]):
        s = a.dtype.type(0)
        for p in range(a.shape[1]):
            s += a[r, p]
        out[r] += s


@njit(nogil=True, cache=True)
def _fwd_gemm(x, w3, b, has_bias, y, s, offs, n0, n1, nb, kh, kw, sh, sw, ph, pw, dh, dw):
    """Images ``n0:n1``, ``nb`` per matrix product; ``s`` is this thread's workspace row."""
    colbuf, ybuf = s[offs[0]:offs[1]], s[offs[1]:]
    _, c, h, wd = x.shape
    groups, og, k = w3.shape
    cout, ho, wo = y.shape[1], y.shape[2], y.shape[3]
    cg = c // groups
    hwo = ho * wo
    for s0 in range(n0, n1, nb):
        s1 = min(s0 + nb, n1)
        ln = (s1 - s0) * hwo
        col = colbuf[: k * ln].reshape((k, ln))
        for g in range(groups):
            for n in range(s0, s1):
                im2col(x[n].reshape(-1), g * cg * h * wd, colbuf, ln, (n - s0) * hwo, cg, h, wd,
                       kh, kw, sh, sw, ph, pw, dh, dw, ho, wo)
            if s1 - s0 == 1:
                np.dot(w3[g], col, y[s0].reshape((groups, og, hwo))[g])
            else:  # several images side by side: product into ybuf, then out to NCHW
                yb = ybuf[: og * ln].reshape((og, ln))
                np.dot(w3[g], col, yb)
                for n in range(s0, s1):
                    yn = y[n].reshape((cout, hwo))
                    for o in range(og):
                        for p in range(hwo):
                            yn[g * og + o, p] = yb[o, (n - s0) * hwo + p]
        if has_bias:
            for n in range(s0, s1):
                yn = y[n].reshape((cout, hwo))
                for co in range(cout):
                    bv = b[co]
                    for p in range(hwo):
                        yn[co, p] += bv


@njit(nogil=True, cache=True)
def _bwd_gemm(x, w3, dy, dx, need_dx, s, offs, n0, n1, nb, kh, kw, sh, sw, ph, pw, dh, dw):
    """Images ``n0:n1`` (``nb`` per product): partial ``dW``, ``db`` into this thread's row
    ``s``, and ``dx`` rows."""
    colbuf, dcolbuf, dybuf = s[offs[0]:offs[1]], s[offs[1]:offs[2]], s[offs[2]:offs[3]]
    tmpbuf, dwbuf, dbbuf = s[offs[3]:offs[4]], s[offs[4]:offs[5]], s[offs[5]:]
    _, c, h, wd = x.shape
    groups, og, k = w3.shape
    cout, ho, wo = dy.shape[1], dy.shape[2], dy.shape[3]
    cg = c // groups
    hwo = ho * wo
    tmp = tmpbuf[: og * k].reshape((og, k))
    for i in range(cout * k):
        dwbuf[i] = 0
    for i in range(cout):
        dbbuf[i] = 0
    for s0 in range(n0, n1, nb):
        s1 = min(s0 + nb, n1)
        ln = (s1 - s0) * hwo
        col = colbuf[: k * ln].reshape((k, ln))
        dcol = dcolbuf[: k * ln].reshape((k, ln))
        for g in range(groups):
            for n in range(s0, s1):
                im2col(x[n].reshape(-1), g * cg * h * wd, colbuf, ln, (n - s0) * hwo, cg, h, wd,
                       kh, kw, sh, sw, ph, pw, dh, dw, ho, wo)
            if s1 - s0 == 1:
                dyb = dy[s0].reshape((groups, og, hwo))[g]
            else:  # gather the images' output gradients side by side
                dyb = dybuf[: og * ln].reshape((og, ln))
                for n in range(s0, s1):
                    dyn = dy[n].reshape((cout, hwo))
                    for o in range(og):
                        for p in range(hwo):
                            dyb[o, (n - s0) * hwo + p] = dyn[g * og + o, p]
            np.dot(dyb, col.T, tmp)
            base = g * og * k
            for i in range(og * k):
                dwbuf[base + i] += tmpbuf[i]
            if need_dx:
                np.dot(w3[g].T, dyb, dcol)
                for n in range(s0, s1):
                    col2im(dcolbuf, ln, (n - s0) * hwo, dx[n].reshape(-1), g * cg * h * wd, cg,
                           h, wd, kh, kw, sh, sw, ph, pw, dh, dw, ho, wo)
        for n in range(s0, s1):
            _add_row_sums(dy[n].reshape((cout, hwo)), dbbuf)


# ----------------------------------------------------------------------------- parallel
# One prange iteration per thread, each a serial kernel on its batch chunk and workspace row.
@njit(nogil=True, cache=True, parallel=True)
def _fwd_gemm_par(x, w3, b, has_bias, y, slabs, offs, bounds, nb, kh, kw, sh, sw, ph, pw, dh,
                  dw):
    for t in prange(bounds.size - 1):
        _fwd_gemm(x, w3, b, has_bias, y, slabs[t], offs, bounds[t], bounds[t + 1], nb,
                  kh, kw, sh, sw, ph, pw, dh, dw)


@njit(nogil=True, cache=True, parallel=True)
def _bwd_gemm_par(x, w3, dy, dx, need_dx, slabs, offs, bounds, nb, kh, kw, sh, sw, ph, pw, dh,
                  dw):
    for t in prange(bounds.size - 1):
        _bwd_gemm(x, w3, dy, dx, need_dx, slabs[t], offs, bounds[t], bounds[t + 1], nb,
                  kh, kw, sh, sw, ph, pw, dh, dw)


# ----------------------------------------------------------------------------- drivers
def _c(a: np.ndarray) -> np.ndarray:
    return a if a.flags.c_contiguous else np.ascontiguousarray(a)


#: Multiply-adds below which a call runs on the calling thread alone (~20-50 us of work).
SERIAL_MACS = 1 << 20


def _split(n: int, slabs: int, macs: int, threads: int | None) -> np.ndarray | None:
    return split(n, slabs, macs, SERIAL_MACS, force=threads is not None)


def _check(x, w, groups, stride, padding, dilation, **arrays) -> None:
    """Validate shapes before the kernels index blindly."""
    if _cuda.is_device_array(x):
        raise NotImplementedError("conv2d has CPU kernels only (no CUDA kernel for device "
                                  "arrays)")
    n, c, h, wd = x.shape
    cout, cg, kh, kw = w.shape
    if c != cg * groups or cout % groups:
        raise ValueError(f"conv2d: input {x.shape} / weight {w.shape} / groups {groups} mismatch")
    ho, wo = conv_output_hw((h, wd), (kh, kw), stride, padding, dilation)
    want = {"y": (n, cout, ho, wo), "dy": (n, cout, ho, wo), "dx": x.shape, "dw": w.shape,
            "b": (cout,), "db": (cout,)}
    for name, a in arrays.items():
        if a is not None and tuple(a.shape) != tuple(want[name]):
            raise ValueError(f"conv2d: {name} has shape {a.shape}, expected {want[name]}")


def conv2d_forward(
    x: np.ndarray, w: np.ndarray, b: np.ndarray | None, y: np.ndarray, stride: Pair = (1, 1),
    padding: Pair = (0, 0), dilation: Pair = (1, 1), groups: int = 1,
    workspace: np.ndarray | None = None, threads: int | None = None, algo: str | None = None,
) -> None:
    """Write ``conv2d(x, w) + b`` into ``y`` (NCHW). ``workspace``: ``uint8`` of at least
    :func:`conv2d_workspace_bytes` (``backward=False``); ``None`` allocates one. ``algo``
    (``"gemm"`` / ``"winograd"``) overrides :func:`choose_algo`."""
    ensure_blas_policy()
    _check(x, w, groups, stride, padding, dilation, y=y, b=b)
    n = x.shape[0]
    cout, cg, kh, kw = w.shape
    algo = algo or choose_algo(x.shape, (kh, kw), stride, dilation, groups, padding)
    elems = _slab_elems(x.shape, cout, (kh, kw), stride, padding, dilation, groups, False, algo,
                        x.dtype.itemsize)
    slabs, offs = _slabs(workspace, elems, x.dtype, n, threads)
    x, w = _c(x), _c(w)
    out = y if y.flags.c_contiguous else np.empty(y.shape, y.dtype)
    has_bias = b is not None
    bb = _c(b) if has_bias else np.zeros(0, x.dtype)
    bounds = _split(n, slabs.shape[0], out.size * cg * kh * kw, threads)
    if algo == "winograd":
        nb = _winograd_nb(x.shape, cout, padding, x.dtype.itemsize)
        if bounds is None:
            winograd.fwd_chunk(x, w, bb, has_bias, out, slabs[0], offs, 0, n, nb, *padding)
        else:
            winograd.forward_par(x, w, bb, has_bias, out, slabs, offs, bounds, nb, *padding)
    else:
        w3 = w.reshape(groups, cout // groups, cg * kh * kw)
        nb = _gemm_nb(x.shape, cg * kh * kw, out.shape[2] * out.shape[3], x.dtype.itemsize)
        geom = (nb, kh, kw, *stride, *padding, *dilation)
        if bounds is None:
            _fwd_gemm(x, w3, bb, has_bias, out, slabs[0], offs, 0, n, *geom)
        else:
            _fwd_gemm_par(x, w3, bb, has_bias, out, slabs, offs, bounds, *geom)
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
    ensure_blas_policy()
    _check(x, w, groups, stride, padding, dilation, dy=dy, dx=dx, dw=dw, db=db)
    n = x.shape[0]
    cout, cg, kh, kw = w.shape
    algo = algo or choose_algo(x.shape, (kh, kw), stride, dilation, groups, padding)
    elems = _slab_elems(x.shape, cout, (kh, kw), stride, padding, dilation, groups, True, algo,
                        x.dtype.itemsize)
    slabs, offs = _slabs(workspace, elems, x.dtype, n, threads)
    x, w, dy = _c(x), _c(w), _c(dy)
    need_dx = dx is not None
    dxo = (dx if dx.flags.c_contiguous else np.empty(dx.shape, dx.dtype)) if need_dx else \
        np.zeros((0, 0, 0, 0), x.dtype)
    bounds = _split(n, slabs.shape[0], dy.size * cg * kh * kw, threads)
    used = 1 if bounds is None else bounds.size - 1
    dwo = dw if dw.flags.c_contiguous else np.empty(dw.shape, dw.dtype)
    if algo == "winograd":
        nb = _winograd_nb(x.shape, cout, padding, x.dtype.itemsize)
        dbo = db if db is not None else np.zeros(cout, x.dtype)
        if bounds is None:
            winograd.bwd_chunk(x, w, dy, dxo, need_dx, slabs[0], offs, 0, n, nb, *padding)
        else:
            winograd.backward_par(x, w, dy, dxo, need_dx, slabs, offs, bounds, nb, *padding)
        winograd.finish_grads(slabs, offs, used, dwo, dbo)
    else:
        w3 = w.reshape(groups, cout // groups, cg * kh * kw)
        nb = _gemm_nb(x.shape, cg * kh * kw, dy.shape[2] * dy.shape[3], x.dtype.itemsize)
        geom = (nb, kh, kw, *stride, *padding, *dilation)
        if bounds is None:
            _bwd_gemm(x, w3, dy, dxo, need_dx, slabs[0], offs, 0, n, *geom)
        else:
            _bwd_gemm_par(x, w3, dy, dxo, need_dx, slabs, offs, bounds, *geom)
        k = cg * kh * kw
        np.sum(slabs[:used, offs[4]: offs[4] + cout * k], axis=0, out=dwo.reshape(cout * k))
        if db is not None:
            np.sum(slabs[:used, offs[5]: offs[5] + cout], axis=0, out=db)
    if dwo is not dw:
        dw[...] = dwo
    if need_dx and dxo is not dx:
        dx[...] = dxo

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

The batch is cut into blocks of images multiplied together (block boundaries at multiples of
the block size, whatever the thread count) and the blocks are shared out over
:func:`~minidl.kernels.parallel.num_threads` threads (one ``prange`` iteration each, each thread
on its own row of the workspace). Weight and bias gradients are summed over :data:`GRAD_PARTS`
fixed runs of blocks, each into its own partial, then added in order. Every matrix product and
every sum therefore has the same shape and order for any thread count: results are
bit-identical across thread counts (on one machine: BLAS kernels differ between CPU models).
Small calls run on the calling thread. A direct (no im2col) kernel
for one-input-channel layers was measured slower than im2col + GEMM (conv1 of smallcnn:
0.73 / 1.6 ms against 0.47 / 0.51 ms forward / backward) and was dropped.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit, prange, uintp

from . import _cuda, winograd
from .blas import mm
from .parallel import chunks, ensure_blas_policy, num_threads, split

Pair = tuple[int, int]

_ALIGN = 64


# ----------------------------------------------------------------------------- geometry
def conv_output_hw(hw: Pair, kernel: Pair, stride: Pair, padding: Pair, dilation: Pair) -> Pair:
    """Output height and width (PyTorch's formula, floor mode)."""
    return tuple(  # type: ignore[return-value]
        (hw[a] + 2 * padding[a] - dilation[a] * (kernel[a] - 1) - 1) // stride[a] + 1
        for a in range(2)
    )


# When Winograd F(2x2, 3x3) pays, measured (batch 32, forward + backward time, Winograd /
# im2col): 0.5-0.8 from 8x8 to 56x56 planes with 16 to 128 channels; 1.1-1.2 on 4x4 and 6x6
# planes; 1.5 with 8 input channels.
#: Smallest number of input channels for Winograd ...
WINOGRAD_MIN_CIN = 16
#: ... and of 2x2 tiles per output plane (8x8 planes) ...
WINOGRAD_MIN_TILES = 16
#: ... largest ``Cin * Cout``: each thread keeps the transformed filters (16 * Cin * Cout
#: values) and, in backward, its transformed weight-gradient partial (at 512 x 512 channels,
#: 34 MB per thread; im2col's banded path needs a few MB) ...
WINOGRAD_MAX_WEIGHTS = 128 * 128
#: ... and largest transformed image (bytes; one image is the smallest unit of work, so
#: this bounds the workspace per thread: 64 channels at 56x56 would need 9.6 MB).
WINOGRAD_MAX_IMAGE_BYTES = 8 << 20


def choose_algo(x_shape: tuple[int, ...], kernel: Pair, stride: Pair, dilation: Pair,
                groups: int, padding: Pair = (1, 1), cout: int = 64, itemsize: int = 4) -> str:
    """``"winograd"`` for 3x3 / stride 1 / dilation 1 / one group within the bounds above,
    else ``"gemm"`` (im2col). Measured on smallcnn's conv2 (32 -> 64 at 14x14): 2.0 / 4.1 ms
    against 3.0 / 5.6 ms forward / backward."""
    cin = x_shape[1]
    if not (kernel == (3, 3) and stride == (1, 1) and dilation == (1, 1) and groups == 1
            and cin >= WINOGRAD_MIN_CIN and cin * cout <= WINOGRAD_MAX_WEIGHTS):
        return "gemm"
    th, tw = winograd.tiles(x_shape[2] + 2 * padding[0] - 2, x_shape[3] + 2 * padding[1] - 2)
    image = 16 * (2 * cin + cout) * th * tw * itemsize
    if th * tw >= WINOGRAD_MIN_TILES and image <= WINOGRAD_MAX_IMAGE_BYTES:
        return "winograd"
    return "gemm"


def _winograd_nb(x_shape, cout, padding, itemsize) -> int:
    ho, wo = x_shape[2] + 2 * padding[0] - 2, x_shape[3] + 2 * padding[1] - 2
    return min(max(1, x_shape[0]), winograd.images_per_block(x_shape[1], cout, ho, wo, itemsize))


#: The im2col path multiplies several images at once when one image's output plane has
#: fewer columns than this (small late-stage planes: a 4x4 plane alone makes a 16-column
#: product that streams the whole weight matrix for little work) ...
GEMM_MIN_COLS = 256
#: ... and cuts large planes into bands of output rows: its im2col matrix (per thread, and
#: its gradient in backward) stays below this many bytes whatever the image size.
GEMM_MAX_COL_BYTES = 4 << 20


def _gemm_blocking(x_shape: tuple[int, ...], k: int, ho: int, wo: int, itemsize: int
                   ) -> tuple[int, int]:
    """``(images per product, output rows per band)`` of the im2col path."""
    row = max(1, k * wo * itemsize)
    band = max(1, min(ho, GEMM_MAX_COL_BYTES // row))
    if band < ho:
        return 1, band
    nb = -(-GEMM_MIN_COLS // max(ho * wo, 1))
    nb = min(nb, max(1, GEMM_MAX_COL_BYTES // (row * ho)))
    return max(1, min(nb, x_shape[0])), ho


def _slab_elems(
    x_shape: tuple[int, ...], cout: int, kernel: Pair, stride: Pair, padding: Pair,
    dilation: Pair, groups: int, backward: bool, algo: str, itemsize: int,
) -> tuple[list[int], list[tuple[int, int]], int]:
    """Element counts of one thread's buffers (in the order the kernels take them); the
    gradient partials as ``(count, elements)`` pairs; and the images per block."""
    if algo == "winograd":
        nb = _winograd_nb(x_shape, cout, padding, itemsize)
        row = winograd.slab_elems(x_shape, cout, padding, nb, backward)
        if not backward:
            return row, [], nb
        p = grad_parts(x_shape[0], nb)
        return row, [(p, cout), (p, 16 * cout * x_shape[1])], nb  # db, transformed dW
    _, c, h, w = x_shape
    ho, wo = conv_output_hw((h, w), kernel, stride, padding, dilation)
    k = c // groups * kernel[0] * kernel[1]
    nb, band = _gemm_blocking(x_shape, k, ho, wo, itemsize)
    ln = nb * band * wo
    side = cout // groups * ln if nb > 1 else 0  # products of several images side by side
    if not backward:
        return [k * ln, side], [], nb  # col, y block
    p = grad_parts(x_shape[0], nb)
    # col, dcol, dy block; db per part, dW per part but the first (it goes straight to dw)
    return [k * ln, k * ln, side], [(p, cout), (p - 1, cout * k)], nb


#: Weight and bias gradients are sums over the batch taken in at most this many fixed parts
#: (contiguous runs of image blocks), each accumulated into its own partial and then added in
#: part order: the parts depend on the shapes only, so the sums never depend on the number of
#: threads (threads take whole parts). Each part past the first costs one weight-sized partial
#: in the workspace; two match these 2-core machines (the same workspace as one partial per
#: extra thread had). With more cores, more parts would let more threads share the backward.
GRAD_PARTS = 2


def grad_parts(n: int, nb: int) -> int:
    """Parts the gradient sums of an ``n``-image batch in blocks of ``nb`` are cut into."""
    return max(1, min(GRAD_PARTS, -(-n // nb)))


def block_bounds(n: int, nb: int, parts: int) -> np.ndarray:
    """Image bounds (``int64``, ``parts' + 1`` entries) of up to ``parts`` contiguous runs of
    the ``nb``-image blocks of ``range(n)`` (blocks start at multiples of ``nb``)."""
    blocks = chunks(max(1, -(-n // nb)), parts)
    return np.array([0] + [min(n, stop * nb) for _, stop in blocks], np.int64)


#: Thread cap of the conv kernels: every thread has its own workspace row, so the declared
#: workspace grows with the thread count.
MAX_THREADS = 16


def _default_threads() -> int:
    return min(num_threads(), MAX_THREADS)


def _aligned(elems: int, itemsize: int) -> int:
    return -(-elems * itemsize // _ALIGN) * _ALIGN


def _threads(layout: tuple[list[int], list[tuple[int, int]], int], n: int, backward: bool,
             threads: int | None) -> int:
    """Workspace rows wanted: one per thread, no more than there are blocks (forward) or
    gradient parts (backward) to share out."""
    _, parts, nb = layout
    units = parts[0][0] if backward else -(-max(1, n) // nb)
    return max(1, min(threads or _default_threads(), units))


def _parts_elems(parts: list[tuple[int, int]], itemsize: int) -> int:
    return sum(count * _aligned(e, itemsize) // itemsize for count, e in parts)


def conv2d_workspace_bytes(
    x_shape: tuple[int, ...], cout: int, kernel: Pair, stride: Pair, padding: Pair,
    dilation: Pair, groups: int, dtype: Any, backward: bool, threads: int | None = None,
    algo: str | None = None,
) -> int:
    """Workspace bytes of :func:`conv2d_forward` / :func:`conv2d_backward` (all threads)."""
    itemsize = np.dtype(dtype).itemsize
    algo = algo or choose_algo(x_shape, kernel, stride, dilation, groups, padding, cout,
                               itemsize)
    layout = _slab_elems(x_shape, cout, kernel, stride, padding, dilation, groups, backward,
                         algo, itemsize)
    t = _threads(layout, x_shape[0], backward, threads)
    per = sum(_aligned(e, itemsize) for e in layout[0])
    return t * per + _parts_elems(layout[1], itemsize) * itemsize


def _slabs(workspace: np.ndarray | None, layout: tuple[list[int], list[tuple[int, int]], int],
           dtype: np.dtype, n: int, backward: bool, threads: int | None
           ) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    """Cut the workspace into ``(threads, per_thread)`` rows (as many threads as fit), the
    start offsets of each buffer in a row, and the ``(count, elements)`` partial buffers."""
    elems, parts, _ = layout
    it = dtype.itemsize
    per = sum(_aligned(e, it) for e in elems)
    fixed = _parts_elems(parts, it) * it
    t = _threads(layout, n, backward, threads)
    if workspace is None:
        workspace = np.empty(t * per + fixed, np.uint8)
    t = min(t, (workspace.nbytes - fixed) // per) if per else t
    if t < 1 or workspace.nbytes < fixed:
        raise ValueError(f"conv2d workspace of {workspace.nbytes} bytes, needs at least "
                         f"{per + fixed}")
    offs = np.cumsum([0] + [_aligned(e, it) // it for e in elems[:-1]]).astype(np.int64)
    rows = workspace[: t * per].view(dtype).reshape(t, per // it)
    views, start = [], t * per
    for count, e in parts:
        stride = _aligned(e, it)
        views.append(workspace[start: start + count * stride].view(dtype)
                     .reshape(count, stride // it))  # rows padded to the alignment
        start += count * stride
    return rows, offs, views


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
def im2col(xf, xbase, col, ld, coff, cg, h, w, kh, kw, sh, sw, ph, pw, dh, dw, ho, wo, oh0, oh1):
    """im2col of output rows ``oh0:oh1`` of ``cg`` channels of a flat image starting at
    ``xf[xbase]``: row ``r`` of the ``(cg*kh*kw, (oh1-oh0)*wo)`` result goes to
    ``col[r*ld + coff:]`` (``ld`` larger than a row lets images share one matrix).

    Hot loops index with unsigned integers: Numba then skips its negative-index wraparound,
    which otherwise blocks vectorisation (measured 4-6x slower).
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
            for c in range(cg):
                r0 = uintp(((c * kh + i) * kw + j) * ld + coff)
                if oh_hi <= oh_lo or ow_hi <= ow_lo:
                    for q in range(nq):
                        col[r0 + q] = 0
                elif plane:
                    # Same-size output: one shifted contiguous copy, then zero the border.
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
                else:
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


@njit(nogil=True, cache=True)
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
def _fwd_gemm(x, w3, b, has_bias, y, s, offs, n0, n1, nb, band, kh, kw, sh, sw, ph, pw, dh,
              dw):
    """Images ``n0:n1``: ``nb`` images per matrix product, or one image in bands of
    ``band`` output rows written in place (BLAS with the plane's row stride)."""
    colbuf, ybuf = s[offs[0]:offs[1]], s[offs[1]:]
    _, c, h, wd = x.shape
    groups, og, k = w3.shape
    cout, ho, wo = y.shape[1], y.shape[2], y.shape[3]
    cg = c // groups
    hwo = ho * wo
    work = np.empty(8, np.int32)
    geom = (kh, kw, sh, sw, ph, pw, dh, dw, ho, wo)
    for s0 in range(n0, n1, nb):
        s1 = min(s0 + nb, n1)
        for g in range(groups):
            xb = g * cg * h * wd
            if s1 - s0 == 1:
                yn = y[s0].reshape((cout, hwo))
                for b0 in range(0, ho, band):
                    b1 = min(b0 + band, ho)
                    ln = (b1 - b0) * wo
                    im2col(x[s0].reshape(-1), xb, colbuf, ln, 0, cg, h, wd, *geom, b0, b1)
                    mm(w3[g], colbuf[: k * ln].reshape((k, ln)),
                       yn[g * og:(g + 1) * og, b0 * wo: b1 * wo], False, False, 1.0, 0.0,
                       og, ln, k, work)
            else:  # several images side by side: product into ybuf, then out to NCHW
                ln = (s1 - s0) * hwo
                for n in range(s0, s1):
                    im2col(x[n].reshape(-1), xb, colbuf, ln, (n - s0) * hwo, cg, h, wd, *geom,
                           0, ho)
                yb = ybuf[: og * ln].reshape((og, ln))
                mm(w3[g], colbuf[: k * ln].reshape((k, ln)), yb, False, False, 1.0, 0.0,
                   og, ln, k, work)
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
def _bwd_gemm(x, w3, dy, dx, need_dx, s, offs, dwacc, zero_dw, dbbuf, n0, n1, nb, band, kh, kw,
              sh, sw, ph, pw, dh, dw):
    """Images ``n0:n1`` (blocked as in :func:`_fwd_gemm`): ``dW`` summed into ``dwacc``
    (``Cout x K``, BLAS with beta 1; zeroed first if ``zero_dw``), ``db`` into ``dbbuf``
    (zeroed first), ``dx`` rows."""
    colbuf, dcolbuf, dybuf = s[offs[0]:offs[1]], s[offs[1]:offs[2]], s[offs[2]:]
    _, c, h, wd = x.shape
    groups, og, k = w3.shape
    cout, ho, wo = dy.shape[1], dy.shape[2], dy.shape[3]
    cg = c // groups
    hwo = ho * wo
    work = np.empty(8, np.int32)
    geom = (kh, kw, sh, sw, ph, pw, dh, dw, ho, wo)
    if zero_dw:
        for i in range(cout * k):
            dwacc[i] = 0
    for i in range(cout):
        dbbuf[i] = 0
    dw2 = dwacc[: cout * k].reshape((cout, k))
    for s0 in range(n0, n1, nb):
        s1 = min(s0 + nb, n1)
        if need_dx:
            for n in range(s0, s1):
                dxn = dx[n].reshape(-1)
                for i in range(dxn.size):
                    dxn[i] = 0
        for g in range(groups):
            xb = g * cg * h * wd
            wg = w3[g]
            dwg = dw2[g * og:(g + 1) * og]
            if s1 - s0 == 1:
                dyn = dy[s0].reshape((cout, hwo))
                for b0 in range(0, ho, band):
                    b1 = min(b0 + band, ho)
                    ln = (b1 - b0) * wo
                    im2col(x[s0].reshape(-1), xb, colbuf, ln, 0, cg, h, wd, *geom, b0, b1)
                    dyv = dyn[g * og:(g + 1) * og, b0 * wo: b1 * wo]
                    mm(dyv, colbuf[: k * ln].reshape((k, ln)), dwg, False, True, 1.0, 1.0,
                       og, k, ln, work)
                    if need_dx:
                        mm(wg, dyv, dcolbuf[: k * ln].reshape((k, ln)), True, False, 1.0, 0.0,
                           k, ln, og, work)
                        col2im(dcolbuf, ln, 0, dx[s0].reshape(-1), xb, cg, h, wd, *geom, b0, b1)
            else:  # several images side by side: gather their output gradients
                ln = (s1 - s0) * hwo
                yb = dybuf[: og * ln].reshape((og, ln))
                for n in range(s0, s1):
                    im2col(x[n].reshape(-1), xb, colbuf, ln, (n - s0) * hwo, cg, h, wd, *geom,
                           0, ho)
                    dyn = dy[n].reshape((cout, hwo))
                    for o in range(og):
                        for p in range(hwo):
                            yb[o, (n - s0) * hwo + p] = dyn[g * og + o, p]
                mm(yb, colbuf[: k * ln].reshape((k, ln)), dwg, False, True, 1.0, 1.0, og, k,
                   ln, work)
                if need_dx:
                    mm(wg, yb, dcolbuf[: k * ln].reshape((k, ln)), True, False, 1.0, 0.0, k,
                       ln, og, work)
                    for n in range(s0, s1):
                        col2im(dcolbuf, ln, (n - s0) * hwo, dx[n].reshape(-1), xb, cg, h, wd,
                               *geom, 0, ho)
        for n in range(s0, s1):
            _add_row_sums(dy[n].reshape((cout, hwo)), dbbuf)


# ----------------------------------------------------------------------------- parallel
# One prange iteration per thread, each a serial kernel on its workspace row: forward on its
# run of blocks, backward on the gradient parts ``t, t + threads, ...``.
@njit(nogil=True, cache=True, parallel=True)
def _fwd_gemm_par(x, w3, b, has_bias, y, slabs, offs, bounds, nb, band, kh, kw, sh, sw, ph, pw,
                  dh, dw):
    for t in prange(bounds.size - 1):
        _fwd_gemm(x, w3, b, has_bias, y, slabs[t], offs, bounds[t], bounds[t + 1], nb, band,
                  kh, kw, sh, sw, ph, pw, dh, dw)


@njit(nogil=True, cache=True)
def _bwd_gemm_parts(x, w3, dy, dx, need_dx, s, offs, dwout, add_dw, dwparts, dbparts, bounds,
                    first, step, nb, band, kh, kw, sh, sw, ph, pw, dh, dw):
    """Gradient parts ``first, first + step, ...`` on one workspace row ``s``; the first
    part's ``dW`` goes into ``dwout`` (added to what it holds if ``add_dw``)."""
    for p in range(first, bounds.size - 1, step):
        acc = dwout if p == 0 else dwparts[p - 1]
        _bwd_gemm(x, w3, dy, dx, need_dx, s, offs, acc, p > 0 or not add_dw, dbparts[p],
                  bounds[p], bounds[p + 1], nb, band, kh, kw, sh, sw, ph, pw, dh, dw)


@njit(nogil=True, cache=True, parallel=True)
def _bwd_gemm_par(x, w3, dy, dx, need_dx, slabs, offs, dwout, add_dw, dwparts, dbparts, bounds,
                  nb, band, kh, kw, sh, sw, ph, pw, dh, dw):
    threads = slabs.shape[0]
    for t in prange(threads):
        _bwd_gemm_parts(x, w3, dy, dx, need_dx, slabs[t], offs, dwout, add_dw, dwparts,
                        dbparts, bounds, t, threads, nb, band, kh, kw, sh, sw, ph, pw, dh, dw)


# ----------------------------------------------------------------------------- drivers
def _c(a: np.ndarray) -> np.ndarray:
    return a if a.flags.c_contiguous else np.ascontiguousarray(a)


#: Multiply-adds below which a call runs on the calling thread alone (~20-50 us of work).
SERIAL_MACS = 1 << 20


def _parallel(n: int, rows: int, macs: int, threads: int | None) -> bool:
    """Whether a call runs on its ``rows`` threads (else serially on the calling thread)."""
    return split(n, rows, macs, SERIAL_MACS, force=threads is not None) is not None


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
    algo = algo or choose_algo(x.shape, (kh, kw), stride, dilation, groups, padding, cout,
                               x.dtype.itemsize)
    layout = _slab_elems(x.shape, cout, (kh, kw), stride, padding, dilation, groups, False,
                         algo, x.dtype.itemsize)
    slabs, offs, _ = _slabs(workspace, layout, x.dtype, n, False, threads)
    x, w = _c(x), _c(w)
    out = y if y.flags.c_contiguous else np.empty(y.shape, y.dtype)
    has_bias = b is not None
    bb = _c(b) if has_bias else np.zeros(0, x.dtype)
    nb = layout[2]
    parallel = _parallel(n, slabs.shape[0], out.size * cg * kh * kw, threads)
    bounds = block_bounds(n, nb, slabs.shape[0])
    if algo == "winograd":
        if not parallel:
            winograd.fwd_chunk(x, w, bb, has_bias, out, slabs[0], offs, 0, n, nb, *padding)
        else:
            winograd.forward_par(x, w, bb, has_bias, out, slabs, offs, bounds, nb, *padding)
    else:
        w3 = w.reshape(groups, cout // groups, cg * kh * kw)
        band = _gemm_blocking(x.shape, cg * kh * kw, *out.shape[2:], x.dtype.itemsize)[1]
        geom = (nb, band, kh, kw, *stride, *padding, *dilation)
        if not parallel:
            _fwd_gemm(x, w3, bb, has_bias, out, slabs[0], offs, 0, n, *geom)
        else:
            _fwd_gemm_par(x, w3, bb, has_bias, out, slabs, offs, bounds, *geom)
    if out is not y:
        y[...] = out


def conv2d_backward(
    x: np.ndarray, w: np.ndarray, dy: np.ndarray, dx: np.ndarray | None, dw: np.ndarray,
    db: np.ndarray | None, stride: Pair = (1, 1), padding: Pair = (0, 0),
    dilation: Pair = (1, 1), groups: int = 1, workspace: np.ndarray | None = None,
    threads: int | None = None, algo: str | None = None, accumulate: bool = False,
) -> None:
    """Overwrite ``dw``, ``db`` (if given) and ``dx`` (if given) with the gradients of
    :func:`conv2d_forward`; with ``accumulate``, add into ``dw`` and ``db`` instead (``dx`` is
    still overwritten). ``workspace``: :func:`conv2d_workspace_bytes`, ``backward=True``."""
    ensure_blas_policy()
    _check(x, w, groups, stride, padding, dilation, dy=dy, dx=dx, dw=dw, db=db)
    n = x.shape[0]
    cout, cg, kh, kw = w.shape
    algo = algo or choose_algo(x.shape, (kh, kw), stride, dilation, groups, padding, cout,
                               x.dtype.itemsize)
    layout = _slab_elems(x.shape, cout, (kh, kw), stride, padding, dilation, groups, True,
                         algo, x.dtype.itemsize)
    slabs, offs, (dbparts, dwparts) = _slabs(workspace, layout, x.dtype, n, True, threads)
    x, w, dy = _c(x), _c(w), _c(dy)
    need_dx = dx is not None
    dxo = (dx if dx.flags.c_contiguous else np.empty(dx.shape, dx.dtype)) if need_dx else \
        np.zeros((0, 0, 0, 0), x.dtype)
    nb = layout[2]
    bounds = block_bounds(n, nb, dbparts.shape[0])  # the gradient parts
    parallel = _parallel(n, slabs.shape[0], dy.size * cg * kh * kw, threads)
    dwo = dw if dw.flags.c_contiguous else np.empty(dw.shape, dw.dtype)
    dbo = db if db is not None else np.zeros(cout, x.dtype)
    add = bool(accumulate)
    if add and dwo is not dw:
        dwo[...] = dw
    if algo == "winograd":
        if not parallel:
            winograd.backward_parts(x, w, dy, dxo, need_dx, slabs[0], offs, dwparts, dbparts,
                                    bounds, 0, 1, nb, *padding)
        else:
            winograd.backward_par(x, w, dy, dxo, need_dx, slabs, offs, dwparts, dbparts,
                                  bounds, nb, *padding)
        winograd.finish_grads(dwparts, dbparts, dwo, dbo, add)
    else:
        w3 = w.reshape(groups, cout // groups, cg * kh * kw)
        band = _gemm_blocking(x.shape, cg * kh * kw, *dy.shape[2:], x.dtype.itemsize)[1]
        geom = (nb, band, kh, kw, *stride, *padding, *dilation)
        dwf = dwo.reshape(-1)
        if not parallel:
            _bwd_gemm_parts(x, w3, dy, dxo, need_dx, slabs[0], offs, dwf, add, dwparts,
                            dbparts, bounds, 0, 1, *geom)
        else:
            _bwd_gemm_par(x, w3, dy, dxo, need_dx, slabs, offs, dwf, add, dwparts, dbparts,
                          bounds, *geom)
        for part in dwparts:  # the first part went straight into dw; the others, in order
            dwf += part[: dwf.size]
        if not add:
            dbo[...] = dbparts[0, :cout]
        for part in dbparts[1 - add:]:
            dbo += part[:cout]
    if dwo is not dw:
        dw[...] = dwo
    if need_dx and dxo is not dx:
        dx[...] = dxo

"""2-D convolution on device arrays (CuPy): im2col of a tile into the declared workspace by
one Numba CUDA kernel, cuBLAS GEMMs through ``np.matmul(..., out=)``, col2im by one gather
kernel. NumPy arrays (the tests' reference) take the same code with strided slice copies and
additions in place of the two kernels.

Apart from the two kernels, every operation is one CuPy implements and one NumPy's API hands to
the array's own type (ufuncs with ``out=``, ndarray methods, basic slicing and slice
assignment), and no array is created outside the outputs and the workspace:

* A *tile* is ``m`` consecutive images (whole output planes), or a band of output rows of one
  image when one image's column matrix would exceed :data:`DEVICE_MAX_COL_BYTES`
  (:func:`device_tiling`; shapes only). Images are put side by side until a tile has
  :data:`DEVICE_MIN_COLS` columns, so small planes still make one large GEMM.
* im2col: the tile's column matrix, ``(C, kh, kw, images, rows, Wo)`` in memory, i.e. ``(G, K,
  cols)`` with ``K = C/G*kh*kw``. Device arrays: one launch of ``_k_im2col`` per tile writes
  every element (the input value, or 0 where the tap falls in the padding). NumPy arrays:
  ``kh*kw`` strided slice copies of the in-bounds boxes, after one zero-fill of the column
  matrix when a tap reaches into the padding. The two are bit-identical (a copy).
* GEMM, per group: ``np.matmul(a, b, out=c)`` on 2-D operands that are C- or F-contiguous
  with a C-contiguous ``c`` (:func:`gemm` checks it), which CuPy hands to cuBLAS as they are
  (a transpose is a flag). Batched matmuls are avoided: CuPy copies non-contiguous batched
  operands and allocates pointer arrays for broadcast ones.
* A tile of one whole image writes the GEMM straight into ``y`` (and reads ``dy`` in place);
  a tile of several images or of a band goes through a ``(Cout, cols)`` block buffer, copied
  to / from the NCHW tensor by one strided slice assignment.
* Backward, per tile: im2col; ``dW_g (+)= dY_g @ col_g.T`` (the first tile straight into
  ``dw`` unless accumulating, later ones through a one-group partial); then, if ``dx`` is
  wanted, ``dcol_g = W_g.T @ dY_g`` over the column matrix (no longer needed) and col2im into
  ``dx``, zeroed per image at its first tile (``r0 == 0``; later bands of the image add to
  it). Device arrays: one launch of ``_k_col2im`` per tile, a gather (each thread owns ``dx``
  elements of the rows the tile reaches, no atomics) that adds the taps in the slice order
  (``i`` outer, ``j`` inner) onto the element's value, or onto 0 for the first tile of an
  image (which then covers every row: the zero-fill is folded in). NumPy arrays: a zero-fill
  and ``kh*kw`` strided slice additions. Same additions in the same order: bit-identical.
  ``db`` is one reduction of ``dy`` over (N, H, W), written into ``db`` (or a partial when
  accumulating): the axes are not the trailing ones, so CuPy runs its own reduction kernel,
  not CUB's segmented reduction (which allocates its output and scratch whatever ``out`` is).

The kernels take float32 / float64 arrays of one dtype with a C-contiguous ``x`` / ``dx``;
other device arrays go the slice way. In-place additions pass the same array object as input
and ``out`` (:func:`add_into`): CuPy copies an input that overlaps an output unless it *is* the
output. Sums run in another order than in the CPU kernels: results agree with them to
rounding, not bit for bit.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np

from .. import _cuda
from ..device_gemm import gemm
from .conv_geometry import Pair, conv_output_hw

cuda: Any = None  # numba.cuda, set by _cuda.bind on first CUDA use

#: A tile's column matrix stays below this many bytes (a band of rows of one image if need be).
DEVICE_MAX_COL_BYTES = 16 << 20
#: Column-matrix caps a workspace cap (``max_workspace``) may choose from, largest first; 0 is
#: one output row of one image per tile.
DEVICE_LEAN_COL_BYTES = (DEVICE_MAX_COL_BYTES, 4 << 20, 1 << 20, 256 << 10, 64 << 10, 0)
#: Images are put side by side in a tile until it has this many GEMM columns.
DEVICE_MIN_COLS = 4096
#: Alignment of the buffers carved out of the workspace (cuBLAS and vector loads).
DEVICE_ALIGN = 256


# ----------------------------------------------------------------------------- geometry
def tap_range(offset: int, stride: int, size: int, out_size: int) -> tuple[int, int]:
    """Output positions ``[lo, hi)`` whose input index ``o * stride + offset`` lies in
    ``[0, size)`` (``offset = tap * dilation - padding``); ``lo == hi`` when none does."""
    lo = max(0, -(offset // stride))
    hi = min(out_size, (size - 1 - offset) // stride + 1)
    return lo, max(lo, hi)


def device_tiling(x_shape: tuple[int, ...], kernel: Pair, stride: Pair, padding: Pair,
                  dilation: Pair, itemsize: int, max_col_bytes: int = DEVICE_MAX_COL_BYTES
                  ) -> tuple[int, int]:
    """``(images per tile, output rows per tile)``: several whole images, or bands of one,
    the column matrix below ``max_col_bytes`` (one output row at the least)."""
    n, c, h, w = x_shape
    ho, wo = conv_output_hw((h, w), kernel, stride, padding, dilation)
    row = max(1, c * kernel[0] * kernel[1] * wo * itemsize)  # column bytes of one output row
    if row * ho > max_col_bytes:
        return 1, max(1, min(ho, max_col_bytes // row))
    m = -(-DEVICE_MIN_COLS // max(1, ho * wo))
    m = min(m, max_col_bytes // (row * ho), max(1, n))
    return max(1, m), ho


def _aligned(nbytes: int) -> int:
    return -(-nbytes // DEVICE_ALIGN) * DEVICE_ALIGN


@dataclass(frozen=True)
class DeviceLayout:
    """Tiling and workspace layout of one convolution (byte offsets into the workspace)."""

    ho: int
    wo: int
    images: int  # per tile
    rows: int  # output rows per tile
    blocked: bool  # tiles go through the block buffer (several images, or bands)
    col: tuple[int, int]  # (byte offset, elements): the column matrix (and dcol)
    block: tuple[int, int]  # the (Cout, cols) block buffer (0 elements when not blocked)
    dw_part: tuple[int, int]  # one group's weight-gradient partial (backward)
    db_part: tuple[int, int]  # the bias-gradient partial (backward)
    nbytes: int


def device_layout(x_shape: tuple[int, ...], cout: int, kernel: Pair, stride: Pair,
                  padding: Pair, dilation: Pair, groups: int, itemsize: int, backward: bool,
                  max_workspace: int | None = None) -> DeviceLayout:
    """The tiling and the buffers of :func:`conv2d_forward_device` / ``_backward_device``;
    with ``max_workspace`` (bytes), the largest tiles of :data:`DEVICE_LEAN_COL_BYTES` whose
    workspace fits it (the smallest if none does)."""
    if max_workspace is not None:
        lay = None
        for col in DEVICE_LEAN_COL_BYTES:
            lay = _device_layout(x_shape, cout, kernel, stride, padding, dilation, groups,
                                 itemsize, backward, col)
            if lay.nbytes <= max_workspace:
                break
        assert lay is not None
        return lay
    return _device_layout(x_shape, cout, kernel, stride, padding, dilation, groups, itemsize,
                          backward, DEVICE_MAX_COL_BYTES)


def _device_layout(x_shape: tuple[int, ...], cout: int, kernel: Pair, stride: Pair,
                   padding: Pair, dilation: Pair, groups: int, itemsize: int, backward: bool,
                   max_col_bytes: int) -> DeviceLayout:
    n, c, h, w = x_shape
    ho, wo = conv_output_hw((h, w), kernel, stride, padding, dilation)
    m, rows = device_tiling(x_shape, kernel, stride, padding, dilation, itemsize, max_col_bytes)
    blocked = m > 1 or rows < ho
    cols = m * rows * wo
    k = c // groups * kernel[0] * kernel[1]
    sizes = [c * kernel[0] * kernel[1] * cols, cout * cols if blocked else 0]
    if backward:
        sizes += [cout // groups * k, cout]
    else:
        sizes += [0, 0]
    spans, off = [], 0
    for e in sizes:
        spans.append((off, e))
        off += _aligned(e * itemsize)
    return DeviceLayout(ho, wo, m, rows, blocked, *spans, nbytes=off)


def conv2d_device_workspace_bytes(
    x_shape: tuple[int, ...], cout: int, kernel: Pair, stride: Pair, padding: Pair,
    dilation: Pair, groups: int, dtype: Any, backward: bool, max_workspace: int | None = None,
) -> int:
    """Workspace bytes of :func:`conv2d_forward_device` / :func:`conv2d_backward_device`:
    ``align(C*kh*kw*cols) + align(Cout*cols)`` (the block buffer, only when tiles hold several
    images or a band) ``[+ align(Cout/G*K) + align(Cout)]`` (backward partials), in items of
    ``dtype``, each buffer rounded up to :data:`DEVICE_ALIGN` bytes; ``cols`` = images per
    tile x rows per tile x Wo (:func:`device_tiling`); ``max_workspace``: smaller tiles to
    fit it (:func:`device_layout`)."""
    return device_layout(tuple(x_shape), cout, kernel, stride, padding, dilation, groups,
                         np.dtype(dtype).itemsize, backward, max_workspace).nbytes


def check_conv_shapes(x: Any, w: Any, groups: int, stride: Pair, padding: Pair,
                      dilation: Pair, **arrays: Any) -> None:
    """Validate the shapes of a conv2d call (``y``, ``dy``, ``dx``, ``dw``, ``b``, ``db``)."""
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


# ----------------------------------------------------------------------------- array ops
def _contiguous(a: Any, what: str) -> None:
    if not a.flags.c_contiguous:
        raise ValueError(f"conv2d on the device: {what} must be C-contiguous")


def add_into(dst: Any, src: Any) -> None:
    """``dst += src`` with ``dst`` itself as the ufunc's output (no defensive copy in CuPy)."""
    np.add(dst, src, out=dst)


def _typed(ws: Any, span: tuple[int, int], count: int, dtype: np.dtype) -> Any:
    """The first ``count`` items of a workspace buffer, flat."""
    off = span[0]
    return ws[off: off + count * dtype.itemsize].view(dtype)


def _workspace(workspace: Any, lay: DeviceLayout, like: Any) -> Any:
    if workspace is None:
        if not isinstance(like, np.ndarray):
            raise ValueError("conv2d on the device needs its declared workspace "
                             "(conv2d_device_workspace_bytes)")
        workspace = np.empty(lay.nbytes, np.uint8)
    return _cuda.byte_view(workspace, lay.nbytes, "conv2d workspace")


def _tiles(n: int, lay: DeviceLayout) -> Iterator[tuple[int, int, int, int]]:
    """``(n0, n1, r0, r1)``: images and output rows of each tile, in order."""
    if lay.rows < lay.ho:
        for i in range(n):
            for r0 in range(0, lay.ho, lay.rows):
                yield i, i + 1, r0, min(lay.ho, r0 + lay.rows)
    else:
        for n0 in range(0, n, lay.images):
            yield n0, min(n, n0 + lay.images), 0, lay.ho


@dataclass(frozen=True)
class _Taps:
    """In-bounds output box of every kernel tap (rows per ``i``, columns per ``j``) and the
    geometry the kernels take."""

    rows: list[tuple[int, int, int]]  # (lo, hi, first input row) per i
    cols: list[tuple[int, int, int]]  # (lo, hi, first input col) per j
    stride: Pair
    padding: Pair
    dilation: Pair
    ho: int
    wo: int


def _taps(x_shape: tuple[int, ...], kernel: Pair, stride: Pair, padding: Pair,
          dilation: Pair, ho: int, wo: int) -> _Taps:
    def axis(a: int, size: int, out: int) -> list[tuple[int, int, int]]:
        res = []
        for t in range(kernel[a]):
            off = t * dilation[a] - padding[a]
            lo, hi = tap_range(off, stride[a], size, out)
            res.append((lo, hi, lo * stride[a] + off))
        return res

    return _Taps(axis(0, x_shape[2], ho), axis(1, x_shape[3], wo), tuple(stride),
                 tuple(padding), tuple(dilation), ho, wo)


def _box(taps: _Taps, i: int, j: int, r0: int, r1: int) -> tuple[slice, slice, slice, slice
                                                                 ] | None:
    """``(out rows, out cols, in rows, in cols)`` slices of tap ``(i, j)`` within output rows
    ``[r0, r1)`` (rows relative to ``r0``), or ``None`` if the tap is all padding there."""
    lo, hi, ih = taps.rows[i]
    clo, chi, iw = taps.cols[j]
    a, b = max(lo, r0), min(hi, r1)
    if a >= b or clo >= chi:
        return None
    sh, sw = taps.stride
    ih += (a - lo) * sh
    return (slice(a - r0, b - r0), slice(clo, chi),
            slice(ih, ih + (b - a - 1) * sh + 1, sh), slice(iw, iw + (chi - clo - 1) * sw + 1, sw))


def _full(taps: _Taps, r0: int, r1: int, wo: int) -> bool:
    """Every tap covers the whole tile (no zero padding reached)."""
    return all(lo <= r0 and hi >= r1 for lo, hi, _ in taps.rows) and all(
        lo == 0 and hi == wo for lo, hi, _ in taps.cols)


# ----------------------------------------------------------------------------- CUDA kernels
def _k_im2col(x, col, n0, m, r0, rows, c, h, w, kh, kw, wo, sh, sw, ph, pw, dh, dw, zero):
    """Every element of the tile's column matrix ``col`` (flat ``(C, kh, kw, m, rows, Wo)``):
    ``x[n0 + img, ch, (r0 + orow) * sh + i * dh - ph, ow * sw + j * dw - pw]`` (flat NCHW
    ``x``), ``zero`` where that lies in the padding."""
    for e in range(cuda.grid(1), c * kh * kw * m * rows * wo, cuda.gridsize(1)):
        t = e // wo
        ow = e - t * wo
        u = t // rows
        orow = t - u * rows
        t = u // m
        img = u - t * m
        u = t // kw
        j = t - u * kw
        ch = u // kh
        i = u - ch * kh
        ih = (r0 + orow) * sh + i * dh - ph
        iw = ow * sw + j * dw - pw
        if ih >= 0 and ih < h and iw >= 0 and iw < w:
            col[e] = x[(((n0 + img) * c + ch) * h + ih) * w + iw]
        else:
            col[e] = zero


def _k_col2im(dcol, dx, n0, m, r0, r1, row0, nrows, from_zero, c, h, w, kh, kw, wo, sh, sw,
              ph, pw, dh, dw, zero):
    """Gather: each element of rows ``[row0, row0 + nrows)`` of images ``n0:n0 + m`` of ``dx``
    (flat NCHW) adds, tap by tap (``i`` outer, ``j`` inner), the ``dcol`` element (flat
    ``(C, kh, kw, m, r1 - r0, Wo)``) of the output that tap reads it for, if that output lies
    in rows ``[r0, r1)``, onto its value (onto ``zero`` when ``from_zero``)."""
    rows = r1 - r0
    for e in range(cuda.grid(1), m * c * nrows * w, cuda.gridsize(1)):
        t = e // w
        iw = e - t * w
        u = t // nrows
        ih = row0 + t - u * nrows
        img = u // c
        ch = u - img * c
        at = (((n0 + img) * c + ch) * h + ih) * w + iw
        acc = zero if from_zero else dx[at]
        for i in range(kh):
            oh_s = ih + ph - i * dh  # output row times the stride, if tap i reaches ih
            if oh_s >= 0 and oh_s % sh == 0 and oh_s // sh >= r0 and oh_s // sh < r1:
                row_base = ((ch * kh + i) * kw * m + img) * rows + oh_s // sh - r0
                for j in range(kw):
                    ow_s = iw + pw - j * dw
                    if ow_s >= 0 and ow_s % sw == 0 and ow_s // sw < wo:
                        acc += dcol[(row_base + j * m * rows) * wo + ow_s // sw]
        dx[at] = acc


@functools.cache
def _kernels() -> SimpleNamespace:
    return _cuda.bind(globals(), ["_k_im2col", "_k_col2im"])


def _kernel_path(a: Any, other: Any) -> bool:
    """Device arrays the kernels take: float32 / float64 of one dtype, ``a`` C-contiguous
    (``other`` is a flat view of the workspace)."""
    return (_cuda.choose("auto", a, other) == "cuda" and a.dtype == other.dtype
            and a.dtype in (np.float32, np.float64) and bool(a.flags.c_contiguous))


def _geometry(x_shape: tuple[int, ...], taps: _Taps) -> tuple[int, ...]:
    c, h, w = x_shape[1:]
    return (c, h, w, len(taps.rows), len(taps.cols), taps.wo, *taps.stride, *taps.padding,
            *taps.dilation)


# ----------------------------------------------------------------------------- im2col / col2im
def _im2col(x: Any, col: Any, taps: _Taps, n0: int, n1: int, r0: int, r1: int) -> None:
    """Fill the flat column matrix ``col`` ``(C, kh, kw, images, rows, Wo)`` from images
    ``n0:n1``, output rows ``r0:r1`` of ``x``: one kernel launch on device arrays, strided
    slice copies otherwise."""
    c, kh, kw, wo = x.shape[1], len(taps.rows), len(taps.cols), taps.wo
    if _kernel_path(x, col):
        _cuda.launch(_kernels().k_im2col, col.size, _cuda.flat(x, "x"), col, n0, n1 - n0, r0,
                     r1 - r0, *_geometry(x.shape, taps), np.zeros((), col.dtype)[()])
        return
    col6 = col.reshape(c, kh, kw, n1 - n0, r1 - r0, wo)
    if not _full(taps, r0, r1, wo):
        col6.fill(0)
    for i in range(kh):
        for j in range(kw):
            box = _box(taps, i, j, r0, r1)
            if box is not None:
                orow, ocol, irow, icol = box
                col6[:, i, j, :, orow, ocol] = x[n0:n1, :, irow, icol].transpose(1, 0, 2, 3)


def _col2im(dcol: Any, dx: Any, taps: _Taps, n0: int, n1: int, r0: int, r1: int) -> None:
    """Add the flat ``dcol`` ``(C, kh, kw, images, rows, Wo)`` of output rows ``r0:r1`` into
    images ``n0:n1`` of ``dx``, zeroed first when ``r0 == 0`` (an image's first tile): one
    gather kernel launch on device arrays, a fill and strided slice additions otherwise."""
    c, h = dx.shape[1:3]
    kh, kw, wo = len(taps.rows), len(taps.cols), taps.wo
    if _kernel_path(dx, dcol):
        if r0 == 0:  # every row of the images: the zero-fill
            row0, row1 = 0, h
        else:  # the input rows output rows r0:r1 reach
            sh, dh, ph = taps.stride[0], taps.dilation[0], taps.padding[0]
            row0 = max(0, r0 * sh - ph)
            row1 = min(h, (r1 - 1) * sh + (kh - 1) * dh - ph + 1)
        nrows = max(0, row1 - row0)
        _cuda.launch(_kernels().k_col2im, (n1 - n0) * c * nrows * dx.shape[3], dcol,
                     _cuda.flat(dx, "dx"), n0, n1 - n0, r0, r1, row0, nrows, int(r0 == 0),
                     *_geometry(dx.shape, taps), np.zeros((), dx.dtype)[()])
        return
    if r0 == 0:
        dx[n0:n1].fill(0)
    dcol6 = dcol.reshape(c, kh, kw, n1 - n0, r1 - r0, wo)
    for i in range(kh):
        for j in range(kw):
            box = _box(taps, i, j, r0, r1)
            if box is not None:
                orow, ocol, irow, icol = box
                add_into(dx[n0:n1, :, irow, icol],
                         dcol6[:, i, j, :, orow, ocol].transpose(1, 0, 2, 3))


# ----------------------------------------------------------------------------- public API
def conv2d_forward_device(
    x: Any, w: Any, b: Any | None, y: Any, stride: Pair = (1, 1), padding: Pair = (0, 0),
    dilation: Pair = (1, 1), groups: int = 1, workspace: Any | None = None,
    max_workspace: int | None = None,
) -> None:
    """Write ``conv2d(x, w) + b`` into ``y`` (NCHW) by array operations (module docstring).
    ``workspace``: at least :func:`conv2d_device_workspace_bytes` (``backward=False``, the same
    ``max_workspace``) bytes; ``None`` allocates one for NumPy arrays only. ``w`` and ``y``
    must be C-contiguous."""
    check_conv_shapes(x, w, groups, stride, padding, dilation, y=y, b=b)
    _contiguous(w, "the weight")
    _contiguous(y, "y")
    n, c = x.shape[:2]
    cout, cg, kh, kw = w.shape
    og, k = cout // groups, cg * kh * kw
    dt = y.dtype
    lay = device_layout(x.shape, cout, (kh, kw), stride, padding, dilation, groups,
                        dt.itemsize, False, max_workspace)
    ws = _workspace(workspace, lay, x)
    taps = _taps(x.shape, (kh, kw), stride, padding, dilation, lay.ho, lay.wo)
    w3 = w.reshape(groups, og, k)
    for n0, n1, r0, r1 in _tiles(n, lay):
        shape = (n1 - n0, r1 - r0, lay.wo)
        cols = shape[0] * shape[1] * shape[2]
        col = _typed(ws, lay.col, c * kh * kw * cols, dt)
        _im2col(x, col, taps, n0, n1, r0, r1)
        col3 = col.reshape(groups, k, cols)
        out = (_typed(ws, lay.block, cout * cols, dt) if lay.blocked else y[n0]
               ).reshape(groups, og, cols)
        for g in range(groups):
            gemm(w3[g], col3[g], out[g])
        if lay.blocked:
            y[n0:n1, :, r0:r1, :] = out.reshape(cout, *shape).transpose(1, 0, 2, 3)
    if b is not None:
        add_into(y, b.reshape(1, cout, 1, 1))


def conv2d_backward_device(
    x: Any, w: Any, dy: Any, dx: Any | None, dw: Any, db: Any | None,
    stride: Pair = (1, 1), padding: Pair = (0, 0), dilation: Pair = (1, 1), groups: int = 1,
    workspace: Any | None = None, accumulate: bool = False, accumulate_bias: bool | None = None,
    max_workspace: int | None = None,
) -> None:
    """Gradients of :func:`conv2d_forward_device`: overwrite ``dw``, ``db`` (if given) and
    ``dx`` (if given); with ``accumulate`` add into ``dw`` (and ``db``, unless
    ``accumulate_bias`` says otherwise) instead; ``dx`` is always overwritten. ``workspace``:
    :func:`conv2d_device_workspace_bytes` with ``backward=True`` (and the same
    ``max_workspace``). ``w``, ``dy`` and ``dw`` must be C-contiguous."""
    check_conv_shapes(x, w, groups, stride, padding, dilation, dy=dy, dx=dx, dw=dw, db=db)
    for a, what in ((w, "the weight"), (dy, "dy"), (dw, "dw")):
        _contiguous(a, what)
    n, c = x.shape[:2]
    cout, cg, kh, kw = w.shape
    og, k = cout // groups, cg * kh * kw
    dt = dy.dtype
    lay = device_layout(x.shape, cout, (kh, kw), stride, padding, dilation, groups,
                        dt.itemsize, True, max_workspace)
    ws = _workspace(workspace, lay, x)
    if db is not None:
        if accumulate if accumulate_bias is None else accumulate_bias:
            part = _typed(ws, lay.db_part, cout, dt)
            dy.sum(axis=(0, 2, 3), out=part)
            add_into(db, part)
        else:
            dy.sum(axis=(0, 2, 3), out=db)
    taps = _taps(x.shape, (kh, kw), stride, padding, dilation, lay.ho, lay.wo)
    w3, dw3 = w.reshape(groups, og, k), dw.reshape(groups, og, k)
    dw_part = _typed(ws, lay.dw_part, og * k, dt).reshape(og, k)
    first = not accumulate
    for n0, n1, r0, r1 in _tiles(n, lay):
        shape = (n1 - n0, r1 - r0, lay.wo)
        cols = shape[0] * shape[1] * shape[2]
        col = _typed(ws, lay.col, c * kh * kw * cols, dt)
        _im2col(x, col, taps, n0, n1, r0, r1)
        col3 = col.reshape(groups, k, cols)
        if lay.blocked:
            blk = _typed(ws, lay.block, cout * cols, dt)
            blk.reshape(cout, *shape)[...] = dy[n0:n1, :, r0:r1, :].transpose(1, 0, 2, 3)
            dy3 = blk.reshape(groups, og, cols)
        else:
            dy3 = dy[n0].reshape(groups, og, cols)
        for g in range(groups):
            dwg = dw3[g]
            if first:
                gemm(dy3[g], col3[g].T, dwg)
            else:
                gemm(dy3[g], col3[g].T, dw_part)
                add_into(dwg, dw_part)
        first = False
        if dx is None:
            continue
        for g in range(groups):  # the column matrix becomes its gradient
            gemm(w3[g].T, dy3[g], col3[g])
        _col2im(col, dx, taps, n0, n1, r0, r1)


__all__ = [
    "DEVICE_ALIGN", "DEVICE_LEAN_COL_BYTES", "DEVICE_MAX_COL_BYTES", "DEVICE_MIN_COLS",
    "DeviceLayout", "add_into", "check_conv_shapes", "conv2d_backward_device",
    "conv2d_device_workspace_bytes", "conv2d_forward_device", "device_layout", "device_tiling",
    "gemm", "tap_range",
]

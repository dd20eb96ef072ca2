"""2-D convolution on device arrays whose input and weight are half (float16 / bfloat16):
mixed precision's convolution reading its half operands directly and writing its output and
input gradient in their own dtype (half, or float32), inside a workspace sized for it
(:func:`conv2d_device_half_workspace_bytes`, what the plan declares for a half convolution on
the cuda kind): no float32 copy of any operand, no temporary.

Tiles are :mod:`.conv_device`'s (several whole images, or bands of rows of one image). A
tile's column matrix is im2col'ed in the half dtype (``_k_im2col`` on the ``uint16`` bits of
both arrays: a copy, exact for float16 and bfloat16 alike, the padding's 0 bits are +0.0) and
every product is :func:`~minidl.kernels.blas.gemm` on half operands with float32 compute
(cuBLAS GemmEx, :func:`~minidl.kernels.device_gemm.gemm_ex`; on emulated arrays the host's
float32 BLAS on float32 copies of the half values).

* Forward: ``y = W @ col`` into a float32 block, the bias added there in float32, then the
  block rounded once into the tile of ``y`` (a float32 ``y`` without bands or several images
  takes the product directly, the bias added at the end).
* Backward: ``dW (+)= dY @ col.T`` straight into the float32 ``dw`` (``beta = 1``
  accumulates), ``db`` a float32 sum of ``dy``; ``dcol = W.T @ dY`` in float32 over the column
  span (sized for 4-byte items: the half columns are no longer needed), scattered by the
  float32 col2im into ``dx`` itself when it is float32, else into a float32 buffer of the
  tile's images, rounded once into the half ``dx`` after their last band.

The same products on the same half-rounded values as the float32 path on float32 copies, each
output rounded once: only the GEMMs' summation order may differ from the CPU's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import _cuda
from ..array_api import HALF_DTYPES, is_half_dtype, round_into
from ..blas import gemm
from .conv_device import (
    DEVICE_LEAN_COL_BYTES,
    DEVICE_MAX_COL_BYTES,
    _aligned,
    _col2im,
    _contiguous,
    _geometry,
    _kernels,
    _taps,
    _tiles,
    _typed,
    _workspace,
    add_into,
    check_conv_shapes,
    device_tiling,
)
from .conv_geometry import Pair, conv_output_hw

F32 = np.dtype(np.float32)
HALF_ITEM = 2


def half_operands(x: Any, w: Any) -> bool:
    """Whether a device convolution takes :mod:`this module's <.conv_device_half>` path: a
    C-contiguous half ``x`` and ``w`` of one dtype."""
    return (x.dtype == w.dtype and is_half_dtype(x.dtype) and bool(x.flags.c_contiguous)
            and bool(w.flags.c_contiguous))


@dataclass(frozen=True)
class Tiling:
    """Tiles of one pass over a convolution (what ``conv_device._tiles`` reads)."""

    ho: int
    images: int  # per tile
    rows: int  # output rows per tile

    @property
    def banded(self) -> bool:
        """Whether a tile holds several images or a band of rows (not one image's all)."""
        return self.images > 1 or self.rows < self.ho

    def cols(self, wo: int) -> int:
        """GEMM columns of a full tile."""
        return self.images * self.rows * wo


@dataclass(frozen=True)
class HalfLayout:
    """Tiling and workspace layout of one half-operand convolution (spans: byte offset and
    bytes). The forward and the weight gradient go over ``tiles``; the input gradient over
    ``dx_tiles``, of half their columns, so that its float32 column gradient fits the span
    of the half columns."""

    wo: int
    tiles: Tiling
    dx_tiles: Tiling
    col: tuple[int, int]  # the half columns (backward: then the float32 dcol over them)
    block: tuple[int, int]  # forward: float32 (Cout, cols); backward: the half dy block
    db_part: tuple[int, int]  # float32 bias-gradient partial (backward)
    dx: tuple[int, int]  # float32 input gradient of a dx tile's images (backward, half dx)
    nbytes: int


def half_layout(x_shape: tuple[int, ...], cout: int, kernel: Pair, stride: Pair,
                padding: Pair, dilation: Pair, groups: int, backward: bool, half_out: bool,
                max_workspace: int | None = None) -> HalfLayout:
    """The tiling and buffers of :func:`conv2d_forward_device_half` /
    ``_backward_device_half``; ``half_out``: a half ``y`` (forward) or ``dx`` (backward);
    with ``max_workspace``, the largest tiles of :data:`~.conv_device.DEVICE_LEAN_COL_BYTES`
    whose workspace fits it (the smallest if none does)."""
    caps = DEVICE_LEAN_COL_BYTES if max_workspace is not None else (DEVICE_MAX_COL_BYTES,)
    lay = None
    for cap in caps:
        lay = _half_layout(x_shape, cout, kernel, stride, padding, dilation, groups, backward,
                           half_out, cap)
        if max_workspace is None or lay.nbytes <= max_workspace:
            break
    assert lay is not None
    return lay


def _halved(t: Tiling) -> Tiling:
    """Tiles of half the columns: half the images, else half the rows (one row at least)."""
    if t.images > 1:
        return Tiling(t.ho, -(-t.images // 2), t.rows)
    return Tiling(t.ho, 1, max(1, -(-t.rows // 2)))


def _half_layout(x_shape: tuple[int, ...], cout: int, kernel: Pair, stride: Pair,
                 padding: Pair, dilation: Pair, groups: int, backward: bool, half_out: bool,
                 max_col_bytes: int) -> HalfLayout:
    n, c, h, w = x_shape
    ho, wo = conv_output_hw((h, w), kernel, stride, padding, dilation)
    tiles = Tiling(ho, *device_tiling(x_shape, kernel, stride, padding, dilation, HALF_ITEM,
                                      max_col_bytes))
    dx_tiles = _halved(tiles)
    taps = c * kernel[0] * kernel[1]
    if backward:
        sizes = [max(taps * tiles.cols(wo) * HALF_ITEM, taps * dx_tiles.cols(wo) * F32.itemsize),
                 cout * tiles.cols(wo) * HALF_ITEM if tiles.banded or dx_tiles.banded else 0,
                 cout * F32.itemsize,
                 dx_tiles.images * c * h * w * F32.itemsize if half_out else 0]
    else:
        sizes = [taps * tiles.cols(wo) * HALF_ITEM,
                 cout * tiles.cols(wo) * F32.itemsize if tiles.banded or half_out else 0, 0, 0]
    spans, off = [], 0
    for nbytes in sizes:
        spans.append((off, nbytes))
        off += _aligned(nbytes)
    return HalfLayout(wo, tiles, dx_tiles, *spans, nbytes=off)


def conv2d_device_half_workspace_bytes(
    x_shape: tuple[int, ...], cout: int, kernel: Pair, stride: Pair, padding: Pair,
    dilation: Pair, groups: int, backward: bool, max_workspace: int | None = None,
    half_out: bool = True,
) -> int:
    """Workspace bytes of a half-operand convolution (:func:`half_layout`): forward
    ``align(C*kh*kw*cols*2) + align(Cout*cols*4)`` (the float32 product block: for a half
    ``y``, or tiles of several images or bands); backward ``align(C*kh*kw*cols*4)
    [+ align(Cout*cols*2)] + align(Cout*4) [+ align(images*C*H*W*4)]`` (the half ``dy`` block
    of banded tiles, the float32 input gradient of a tile's images for a half ``dx``)."""
    return half_layout(tuple(x_shape), cout, kernel, stride, padding, dilation, groups,
                       backward, half_out, max_workspace).nbytes


def _bytes(ws: Any, span: tuple[int, int], dtype: np.dtype) -> Any:
    """A workspace span as a flat array of ``dtype``."""
    return _typed(ws, span, span[1] // dtype.itemsize, dtype)


def _im2col_half(x: Any, col: Any, taps: Any, n0: int, n1: int, r0: int, r1: int) -> None:
    """The tile's half column matrix ``col`` (flat) from images ``n0:n1``, output rows
    ``r0:r1`` of the half ``x``: one ``_k_im2col`` launch on their ``uint16`` bits."""
    bits = _cuda.flat(x, "x").view(np.uint16)
    _cuda.launch(_kernels().k_im2col, col.size, bits, col.view(np.uint16), n0, n1 - n0, r0,
                 r1 - r0, *_geometry(x.shape, taps), np.uint16(0))


def _dy_tile(dy: Any, ws: Any, lay: HalfLayout, t: Tiling, n0: int, n1: int, r0: int,
             r1: int, groups: int) -> Any:
    """``dy``'s tile as ``(groups, Cout / groups, cols)``: copied into the half block when
    the tiles are banded, else a view of image ``n0``."""
    cout = dy.shape[1]
    if not t.banded:
        return dy[n0].reshape(groups, cout // groups, -1)
    shape = (n1 - n0, r1 - r0, lay.wo)
    blk = _typed(ws, lay.block, cout * shape[0] * shape[1] * shape[2], dy.dtype)
    blk.reshape(cout, *shape)[...] = dy[n0:n1, :, r0:r1, :].transpose(1, 0, 2, 3)
    return blk.reshape(groups, cout // groups, -1)


def conv2d_forward_device_half(
    x: Any, w: Any, b: Any | None, y: Any, stride: Pair = (1, 1), padding: Pair = (0, 0),
    dilation: Pair = (1, 1), groups: int = 1, workspace: Any | None = None,
    max_workspace: int | None = None,
) -> None:
    """``y = conv2d(x, w) + b`` with a half ``x`` and ``w`` (see :func:`half_operands`), a half
    or float32 ``y`` and a float32 or half ``b``; ``workspace``: at least
    :func:`conv2d_device_half_workspace_bytes` (``backward=False``)."""
    check_conv_shapes(x, w, groups, stride, padding, dilation, y=y, b=b)
    _contiguous(y, "y")
    n, c = x.shape[:2]
    cout, cg, kh, kw = w.shape
    og, k = cout // groups, cg * kh * kw
    half_y = is_half_dtype(y.dtype)
    lay = half_layout(x.shape, cout, (kh, kw), stride, padding, dilation, groups, False,
                      half_y, max_workspace)
    ws = _workspace(workspace, lay, x)
    t = lay.tiles
    taps = _taps(x.shape, (kh, kw), stride, padding, dilation, t.ho, lay.wo)
    w3 = w.reshape(groups, og, k)
    direct = not (t.banded or half_y)  # the product straight into a float32 y
    for n0, n1, r0, r1 in _tiles(n, t):
        shape = (n1 - n0, r1 - r0, lay.wo)
        cols = shape[0] * shape[1] * shape[2]
        col = _typed(ws, lay.col, c * kh * kw * cols, x.dtype)
        _im2col_half(x, col, taps, n0, n1, r0, r1)
        col3 = col.reshape(groups, k, cols)
        out = (y[n0] if direct else _typed(ws, lay.block, cout * cols, F32)
               ).reshape(groups, og, cols)
        for g in range(groups):
            gemm(w3[g], col3[g], out[g])
        if direct:
            continue
        if b is not None:
            add_into(out.reshape(cout, cols), b.reshape(cout, 1))
        round_into(y[n0:n1, :, r0:r1, :], out.reshape(cout, *shape).transpose(1, 0, 2, 3))
    if direct and b is not None:
        add_into(y, b.reshape(1, cout, 1, 1))


def conv2d_backward_device_half(
    x: Any, w: Any, dy: Any, dx: Any | None, dw: Any, db: Any | None,
    stride: Pair = (1, 1), padding: Pair = (0, 0), dilation: Pair = (1, 1), groups: int = 1,
    workspace: Any | None = None, accumulate: bool = False, accumulate_bias: bool | None = None,
    max_workspace: int | None = None,
) -> None:
    """Gradients of :func:`conv2d_forward_device_half`: a half ``x``, ``w`` and ``dy``, float32
    ``dw`` and ``db``, a half or float32 ``dx`` (overwritten; ``dw`` / ``db`` added into as in
    :func:`~.conv_device.conv2d_backward_device`); ``workspace``: at least
    :func:`conv2d_device_half_workspace_bytes` (``backward=True``). The weight gradient goes
    over the layout's tiles, the input gradient over its ``dx_tiles``."""
    check_conv_shapes(x, w, groups, stride, padding, dilation, dy=dy, dx=dx, dw=dw, db=db)
    for a, what in ((dy, "dy"), (dw, "dw")):
        _contiguous(a, what)
    n, c, h, wd = x.shape
    cout, cg, kh, kw = w.shape
    og, k = cout // groups, cg * kh * kw
    half_dx = dx is not None and is_half_dtype(dx.dtype)
    lay = half_layout(x.shape, cout, (kh, kw), stride, padding, dilation, groups, True,
                      half_dx, max_workspace)
    ws = _workspace(workspace, lay, x)
    if db is not None:
        if accumulate if accumulate_bias is None else accumulate_bias:
            part = _typed(ws, lay.db_part, cout, F32)
            dy.sum(axis=(0, 2, 3), dtype=F32, out=part)
            add_into(db, part)
        else:
            dy.sum(axis=(0, 2, 3), dtype=F32, out=db)
    taps = _taps(x.shape, (kh, kw), stride, padding, dilation, lay.tiles.ho, lay.wo)
    w3, dw3 = w.reshape(groups, og, k), dw.reshape(groups, og, k)
    beta = 1.0 if accumulate else 0.0
    for n0, n1, r0, r1 in _tiles(n, lay.tiles):  # dW (+)= dY @ col.T
        cols = (n1 - n0) * (r1 - r0) * lay.wo
        col = _typed(ws, lay.col, c * kh * kw * cols, x.dtype)
        _im2col_half(x, col, taps, n0, n1, r0, r1)
        col3 = col.reshape(groups, k, cols)
        dy3 = _dy_tile(dy, ws, lay, lay.tiles, n0, n1, r0, r1, groups)
        for g in range(groups):
            gemm(dy3[g], col3[g], dw3[g], trans_b=True, beta=beta)
        beta = 1.0
    if dx is None:
        return
    for n0, n1, r0, r1 in _tiles(n, lay.dx_tiles):  # dcol = W.T @ dY, col2im'ed into dx
        cols = (n1 - n0) * (r1 - r0) * lay.wo
        dy3 = _dy_tile(dy, ws, lay, lay.dx_tiles, n0, n1, r0, r1, groups)
        dcol = _typed(ws, lay.col, c * kh * kw * cols, F32)
        dcol3 = dcol.reshape(groups, k, cols)
        for g in range(groups):
            gemm(w3[g], dy3[g], dcol3[g], trans_a=True)
        if not half_dx:
            _col2im(dcol, dx, taps, n0, n1, r0, r1)
            continue
        buf = _typed(ws, lay.dx, (n1 - n0) * c * h * wd, F32).reshape(n1 - n0, c, h, wd)
        _col2im(dcol, buf, taps, 0, n1 - n0, r0, r1)
        if r1 == lay.tiles.ho:  # the images' last band: their gradient is whole
            round_into(dx[n0:n1], buf)


__all__ = ["HALF_DTYPES", "HalfLayout", "Tiling", "conv2d_backward_device_half",
           "conv2d_device_half_workspace_bytes", "conv2d_forward_device_half", "half_layout",
           "half_operands", "is_half_dtype"]

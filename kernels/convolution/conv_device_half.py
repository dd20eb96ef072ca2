"""2-D convolution on device arrays whose input and weight are half (float16 / bfloat16), the
output and gradients float32: mixed precision's convolution reading its half operands
directly (no float32 copy of them).

The tiling and the workspace are :mod:`.conv_device`'s for the float32 outputs
(:func:`~.conv_device.device_layout` with 4-byte items, what the mixed-precision step sizes
its workspace for): the column matrix of a tile is im2col'ed in the half dtype into the first
half of its float32 span (``_k_im2col`` on the ``uint16`` bits of both arrays: a copy, exact
for float16 and bfloat16 alike, the padding's 0 bits are +0.0), and every product is
:func:`~minidl.kernels.blas.gemm` on half operands into float32 (cuBLAS GemmEx with float32
compute, :func:`~minidl.kernels.device_gemm.gemm_ex`; on emulated arrays the host's float32
BLAS on float32 copies of the half values). Forward: ``y = W @ col`` (+ the bias, added in
float32). Backward: ``dW (+)= dY @ col.T`` straight into the float32 ``dw`` (``beta = 1``
accumulates), ``db`` a float32 sum of ``dy``, and ``dcol = W.T @ dY`` in float32 over the
column span (the half columns are no longer needed), scattered by the float32 col2im into the
float32 ``dx``. The same products on the same half-rounded values as the float32 path on
float32 copies: only the summation order of the GEMMs may differ.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import _cuda
from ..blas import gemm
from .conv_device import (
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
    device_layout,
)
from .conv_geometry import Pair

#: The half dtypes whose bits the im2col copies.
HALF_DTYPES = frozenset({"float16", "bfloat16"})
F32 = np.dtype(np.float32)


def half_operands(x: Any, w: Any, out: Any) -> bool:
    """Whether a device convolution takes :mod:`this module's <.conv_device_half>` path: a
    C-contiguous half ``x`` and ``w`` of one dtype and a float32 output (``y`` or ``dy``'s
    gradient ``dw``)."""
    return (x.dtype == w.dtype and x.dtype.name in HALF_DTYPES and out.dtype == F32
            and bool(x.flags.c_contiguous) and bool(w.flags.c_contiguous))


def _im2col_half(x: Any, col: Any, taps: Any, n0: int, n1: int, r0: int, r1: int) -> None:
    """The tile's half column matrix ``col`` (flat) from images ``n0:n1``, output rows
    ``r0:r1`` of the half ``x``: one ``_k_im2col`` launch on their ``uint16`` bits."""
    bits = _cuda.flat(x, "x").view(np.uint16)
    _cuda.launch(_kernels().k_im2col, col.size, bits, col.view(np.uint16), n0, n1 - n0, r0,
                 r1 - r0, *_geometry(x.shape, taps), np.uint16(0))


def conv2d_forward_device_half(
    x: Any, w: Any, b: Any | None, y: Any, stride: Pair = (1, 1), padding: Pair = (0, 0),
    dilation: Pair = (1, 1), groups: int = 1, workspace: Any | None = None,
    max_workspace: int | None = None,
) -> None:
    """``y = conv2d(x, w) + b`` with a half ``x`` and ``w`` (see :func:`half_operands`), a
    float32 ``y`` and a float32 or half ``b``; ``workspace``: at least
    :func:`~.conv_device.conv2d_device_workspace_bytes` for float32 (``backward=False``)."""
    check_conv_shapes(x, w, groups, stride, padding, dilation, y=y, b=b)
    _contiguous(y, "y")
    n, c = x.shape[:2]
    cout, cg, kh, kw = w.shape
    og, k = cout // groups, cg * kh * kw
    lay = device_layout(x.shape, cout, (kh, kw), stride, padding, dilation, groups,
                        F32.itemsize, False, max_workspace)
    ws = _workspace(workspace, lay, x)
    taps = _taps(x.shape, (kh, kw), stride, padding, dilation, lay.ho, lay.wo)
    w3 = w.reshape(groups, og, k)
    for n0, n1, r0, r1 in _tiles(n, lay):
        shape = (n1 - n0, r1 - r0, lay.wo)
        cols = shape[0] * shape[1] * shape[2]
        col = _typed(ws, lay.col, c * kh * kw * cols, x.dtype)
        _im2col_half(x, col, taps, n0, n1, r0, r1)
        col3 = col.reshape(groups, k, cols)
        out = (_typed(ws, lay.block, cout * cols, F32) if lay.blocked else y[n0]
               ).reshape(groups, og, cols)
        for g in range(groups):
            gemm(w3[g], col3[g], out[g])
        if lay.blocked:
            y[n0:n1, :, r0:r1, :] = out.reshape(cout, *shape).transpose(1, 0, 2, 3)
    if b is not None:
        add_into(y, b.reshape(1, cout, 1, 1))


def conv2d_backward_device_half(
    x: Any, w: Any, dy: Any, dx: Any | None, dw: Any, db: Any | None,
    stride: Pair = (1, 1), padding: Pair = (0, 0), dilation: Pair = (1, 1), groups: int = 1,
    workspace: Any | None = None, accumulate: bool = False, accumulate_bias: bool | None = None,
    max_workspace: int | None = None,
) -> None:
    """Gradients of :func:`conv2d_forward_device_half`: a half ``x``, ``w`` and ``dy``,
    float32 ``dw``, ``db`` and ``dx`` (overwritten, or ``dw`` / ``db`` added into as in
    :func:`~.conv_device.conv2d_backward_device`); ``workspace``: the float32 backward
    workspace of :func:`~.conv_device.conv2d_device_workspace_bytes`."""
    check_conv_shapes(x, w, groups, stride, padding, dilation, dy=dy, dx=dx, dw=dw, db=db)
    for a, what in ((dy, "dy"), (dw, "dw")):
        _contiguous(a, what)
    n, c = x.shape[:2]
    cout, cg, kh, kw = w.shape
    og, k = cout // groups, cg * kh * kw
    lay = device_layout(x.shape, cout, (kh, kw), stride, padding, dilation, groups,
                        F32.itemsize, True, max_workspace)
    ws = _workspace(workspace, lay, x)
    if db is not None:
        if accumulate if accumulate_bias is None else accumulate_bias:
            part = _typed(ws, lay.db_part, cout, F32)
            dy.sum(axis=(0, 2, 3), dtype=F32, out=part)
            add_into(db, part)
        else:
            dy.sum(axis=(0, 2, 3), dtype=F32, out=db)
    taps = _taps(x.shape, (kh, kw), stride, padding, dilation, lay.ho, lay.wo)
    w3, dw3 = w.reshape(groups, og, k), dw.reshape(groups, og, k)
    beta = 1.0 if accumulate else 0.0
    for n0, n1, r0, r1 in _tiles(n, lay):
        shape = (n1 - n0, r1 - r0, lay.wo)
        cols = shape[0] * shape[1] * shape[2]
        col = _typed(ws, lay.col, c * kh * kw * cols, x.dtype)
        _im2col_half(x, col, taps, n0, n1, r0, r1)
        col3 = col.reshape(groups, k, cols)
        if lay.blocked:  # (the block span is sized for float32: half fits)
            blk = _typed(ws, lay.block, cout * cols, dy.dtype)
            blk.reshape(cout, *shape)[...] = dy[n0:n1, :, r0:r1, :].transpose(1, 0, 2, 3)
            dy3 = blk.reshape(groups, og, cols)
        else:
            dy3 = dy[n0].reshape(groups, og, cols)
        for g in range(groups):
            gemm(dy3[g], col3[g], dw3[g], trans_b=True, beta=beta)
        beta = 1.0
        if dx is None:
            continue
        dcol = _typed(ws, lay.col, c * kh * kw * cols, F32)  # (over the half columns)
        dcol3 = dcol.reshape(groups, k, cols)
        for g in range(groups):
            gemm(w3[g], dy3[g], dcol3[g], trans_a=True)
        _col2im(dcol, dx, taps, n0, n1, r0, r1)


__all__ = ["HALF_DTYPES", "conv2d_backward_device_half", "conv2d_forward_device_half",
           "half_operands"]

"""Average pooling and global average pooling on device arrays (CuPy) by array operations.

Forward zeroes ``y``, adds each of the ``kh*kw`` window taps as one strided slice addition of
the input over the outputs whose tap is in bounds (padding adds nothing), then scales by
``1 / (kh*kw)`` (``count_include_pad=True``). Backward is the transpose: ``dx`` zeroed, each
tap adds the in-bounds outputs' gradient into its strided input slice, then the scale. Only
ufuncs with ``out=`` (the output itself as first input: no copy in CuPy), ``fill`` and basic
slicing, so the same code runs on NumPy arrays; sums run tap by tap in the output's dtype, so
results match the CPU kernels to rounding. No workspace.

Global average pooling is one GEMM, ``(N*C, H*W) @ (H*W, 1)`` against a column of
``1 / (H*W)`` in the workspace (:func:`global_avgpool2d_workspace_bytes`): a sum over the
trailing axes (``x.sum(axis=(2, 3), out=y)``) would run CuPy's CUB segmented reduction, which
allocates its own output and scratch whatever ``out`` is. Its backward, one broadcast
multiplication, is the layer's (the same on NumPy and device arrays).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import _cuda
from .conv_device import DEVICE_ALIGN, add_into, gemm, tap_range

Pair = tuple[int, int]


def _boxes(in_hw: Pair, out_hw: Pair, kernel: Pair, stride: Pair, padding: Pair):
    """``(out rows, out cols, in rows, in cols)`` slices of each tap with in-bounds outputs."""
    axes = []
    for a in range(2):
        taps = []
        for t in range(kernel[a]):
            lo, hi = tap_range(t - padding[a], stride[a], in_hw[a], out_hw[a])
            if lo < hi:
                first = lo * stride[a] + t - padding[a]
                taps.append((slice(lo, hi), slice(first, first + (hi - lo - 1) * stride[a] + 1,
                                                  stride[a])))
        axes.append(taps)
    for orow, irow in axes[0]:
        for ocol, icol in axes[1]:
            yield orow, ocol, irow, icol


def avgpool2d_forward_device(x: Any, y: Any, kernel: Pair, stride: Pair,
                             padding: Pair = (0, 0)) -> None:
    """Write the average pooling of ``x`` (padding counted) into ``y`` by array operations."""
    y.fill(0)
    for orow, ocol, irow, icol in _boxes(x.shape[2:], y.shape[2:], kernel, stride, padding):
        add_into(y[:, :, orow, ocol], x[:, :, irow, icol])
    np.multiply(y, 1.0 / (kernel[0] * kernel[1]), out=y)


def avgpool2d_backward_device(dy: Any, dx: Any, kernel: Pair, stride: Pair,
                              padding: Pair = (0, 0)) -> None:
    """Overwrite ``dx`` with the gradient of average pooling by array operations."""
    dx.fill(0)
    for orow, ocol, irow, icol in _boxes(dx.shape[2:], dy.shape[2:], kernel, stride, padding):
        add_into(dx[:, :, irow, icol], dy[:, :, orow, ocol])
    np.multiply(dx, 1.0 / (kernel[0] * kernel[1]), out=dx)


def global_avgpool2d_workspace_bytes(x_shape: tuple[int, ...], dtype: Any) -> int:
    """Workspace of :func:`global_avgpool2d_forward_device`: ``H*W`` items, aligned."""
    nbytes = x_shape[2] * x_shape[3] * np.dtype(dtype).itemsize
    return -(-nbytes // DEVICE_ALIGN) * DEVICE_ALIGN


def global_avgpool2d_forward_device(x: Any, y: Any, workspace: Any) -> None:
    """``y`` (N, C) = the mean of each (H, W) plane of ``x`` (C-contiguous, like ``y``), as
    one GEMM against the workspace filled with ``1 / (H*W)``."""
    n, c, h, w = x.shape
    if not (x.flags.c_contiguous and y.flags.c_contiguous):
        raise ValueError("global average pooling on the device needs C-contiguous x and y")
    nbytes = global_avgpool2d_workspace_bytes(x.shape, y.dtype)
    col = _cuda.byte_view(workspace, nbytes, "global average pooling workspace")[
        : h * w * y.dtype.itemsize].view(y.dtype).reshape(h * w, 1)
    col.fill(1.0 / (h * w))
    gemm(x.reshape(n * c, h * w), col, y.reshape(n * c, 1))


__all__ = ["avgpool2d_backward_device", "avgpool2d_forward_device",
           "global_avgpool2d_forward_device",
           "global_avgpool2d_workspace_bytes"]

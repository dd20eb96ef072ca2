"""Average pooling and global average pooling on device arrays (CuPy).

Average pooling (``count_include_pad=True``) on device arrays is one Numba CUDA gather kernel
launch per direction: forward, each output element sums its window's in-bounds taps
(``i`` outer, ``j`` inner) onto 0, then multiplies by ``1 / (kh*kw)`` (in the output's dtype);
backward, each ``dx`` element sums the gradients of the outputs whose window holds it in the
same tap order onto 0, then the same scale. NumPy arrays (the tests' reference) take array
operations that do the same arithmetic: the output zeroed, one strided slice addition per tap
over the outputs whose tap is in bounds (padding adds nothing), then the scale, so the kernels
are bit-identical to them. The kernels take float32 / float64 arrays of one dtype, both
C-contiguous; other device arrays take the array operations (ufuncs with ``out=``, the output
itself as first input: no copy in CuPy; ``fill``; basic slicing). Sums run tap by tap in the
output's dtype, so results match the CPU kernels to rounding. No workspace.

Global average pooling is one GEMM, ``(N*C, H*W) @ (H*W, 1)`` against a column of
``1 / (H*W)`` in the workspace (:func:`global_avgpool2d_workspace_bytes`): a sum over the
trailing axes (``x.sum(axis=(2, 3), out=y)``) would run CuPy's CUB segmented reduction, which
allocates its own output and scratch whatever ``out`` is. Its backward, one broadcast
multiplication, is the layer's (the same on NumPy and device arrays).
"""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any

import numpy as np

from .. import _cuda
from ..convolution.conv_device import DEVICE_ALIGN, add_into, gemm, tap_range

cuda: Any = None  # numba.cuda, set by _cuda.bind on first CUDA use

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


# ----------------------------------------------------------------------------- CUDA kernels
def _k_avgpool_fwd(x, y, npl, h, w, ho, wo, kh, kw, sh, sw, ph, pw, zero, scale):
    """Gather: each output element sums its in-bounds taps (``i`` outer, ``j`` inner) onto
    ``zero``, then scales (flat NCHW ``x`` and ``y``)."""
    for e in range(cuda.grid(1), npl * ho * wo, cuda.gridsize(1)):
        t = e // wo
        ow = e - t * wo
        plane = t // ho
        oh = t - plane * ho
        acc = zero
        for i in range(kh):
            ih = oh * sh + i - ph
            if ih >= 0 and ih < h:
                for j in range(kw):
                    iw = ow * sw + j - pw
                    if iw >= 0 and iw < w:
                        acc += x[(plane * h + ih) * w + iw]
        y[e] = acc * scale


def _k_avgpool_bwd(dy, dx, npl, h, w, ho, wo, kh, kw, sh, sw, ph, pw, zero, scale):
    """Gather: each ``dx`` element sums, tap by tap (``i`` outer, ``j`` inner), the gradient of
    the output whose window holds it there onto ``zero``, then scales."""
    for e in range(cuda.grid(1), npl * h * w, cuda.gridsize(1)):
        t = e // w
        iw = e - t * w
        plane = t // h
        ih = t - plane * h
        acc = zero
        for i in range(kh):
            oh_s = ih + ph - i  # output row times the stride, if tap i reaches ih
            if oh_s >= 0 and oh_s % sh == 0 and oh_s // sh < ho:
                for j in range(kw):
                    ow_s = iw + pw - j
                    if ow_s >= 0 and ow_s % sw == 0 and ow_s // sw < wo:
                        acc += dy[(plane * ho + oh_s // sh) * wo + ow_s // sw]
        dx[e] = acc * scale


@functools.cache
def _kernels() -> SimpleNamespace:
    return _cuda.bind(globals(), ["_k_avgpool_fwd", "_k_avgpool_bwd"])


def _kernel_path(a: Any, b: Any) -> bool:
    """Device arrays the kernels take: float32 / float64 of one dtype, both C-contiguous."""
    return (_cuda.choose("auto", a, b) == "cuda" and a.dtype == b.dtype
            and a.dtype in (np.float32, np.float64)
            and bool(a.flags.c_contiguous) and bool(b.flags.c_contiguous))


def _launch(kernel: Any, src: Any, dst: Any, big: Any, small: Any, kernel_hw: Pair,
            stride: Pair, padding: Pair) -> None:
    """Launch an average-pooling kernel over ``dst``; ``big`` / ``small``: the input-side and
    output-side arrays (for the geometry)."""
    n, c, h, w = big.shape
    scale = dst.dtype.type(1.0 / (kernel_hw[0] * kernel_hw[1]))  # as NumPy / CuPy cast it
    _cuda.launch(kernel, dst.size, _cuda.flat(src, "src"), _cuda.flat(dst, "dst"), n * c, h, w,
                 small.shape[2], small.shape[3], *kernel_hw, *stride, *padding,
                 dst.dtype.type(0), scale)


# ----------------------------------------------------------------------------- public API
def avgpool2d_forward_device(x: Any, y: Any, kernel: Pair, stride: Pair,
                             padding: Pair = (0, 0)) -> None:
    """Write the average pooling of ``x`` (padding counted) into ``y``: one gather kernel on
    device arrays, array operations otherwise (module docstring)."""
    if _kernel_path(x, y):
        _launch(_kernels().k_avgpool_fwd, x, y, x, y, kernel, stride, padding)
        return
    y.fill(0)
    for orow, ocol, irow, icol in _boxes(x.shape[2:], y.shape[2:], kernel, stride, padding):
        add_into(y[:, :, orow, ocol], x[:, :, irow, icol])
    np.multiply(y, 1.0 / (kernel[0] * kernel[1]), out=y)


def avgpool2d_backward_device(dy: Any, dx: Any, kernel: Pair, stride: Pair,
                              padding: Pair = (0, 0)) -> None:
    """Overwrite ``dx`` with the gradient of average pooling: one gather kernel on device
    arrays, array operations otherwise (module docstring)."""
    if _kernel_path(dy, dx):
        _launch(_kernels().k_avgpool_bwd, dy, dx, dx, dy, kernel, stride, padding)
        return
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

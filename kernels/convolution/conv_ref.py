"""NumPy references of the 2-D convolution (PyTorch semantics), for tests."""

from __future__ import annotations

import numpy as np

from .conv_geometry import Pair, conv_output_hw


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

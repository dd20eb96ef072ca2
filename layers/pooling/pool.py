"""MaxPool2d and AvgPool2d over NCHW activations (PyTorch semantics, floor mode)."""

from __future__ import annotations

import numpy as np

from ...kernels.pooling.pool import (
    argmax_dtype,
    avgpool2d_backward,
    avgpool2d_forward,
    maxpool2d_backward,
    maxpool2d_forward,
    pool_output_hw,
)
from ...kernels.pooling.poolidx import maxpool_backward_packed
from ...kernels.vocabulary import StashEncoding
from ..base import Layer, Shape
from ..convolution.conv2d import _pair


class _Pool2d(Layer):
    kind = "pool"

    def __init__(
        self,
        kernel_size: int | tuple[int, int],
        stride: int | tuple[int, int] | None = None,
        padding: int | tuple[int, int] = 0,
    ) -> None:
        super().__init__()
        self.kernel_size = _pair(kernel_size, "kernel_size", 1)
        self.stride = self.kernel_size if stride is None else _pair(stride, "stride", 1)
        self.padding = _pair(padding, "padding", 0)
        if any(2 * p > k for p, k in zip(self.padding, self.kernel_size)):
            raise ValueError(
                f"padding {self.padding} must be at most half of kernel_size {self.kernel_size}"
            )

    def describe(self) -> str:
        s = f"{type(self).__name__}(kernel_size={self.kernel_size}, stride={self.stride}"
        if self.padding != (0, 0):
            s += f", padding={self.padding}"
        return s + ")"

    def output_shapes(self, in_shapes: list[Shape]) -> list[Shape]:
        s = tuple(in_shapes[0])
        if len(s) != 4:
            raise self.shape_error("(N, C, H, W)", s)
        ho, wo = pool_output_hw(s[2:], self.kernel_size, self.stride, self.padding)
        if ho < 1 or wo < 1:
            raise self.shape_error(
                f"(N, C, H, W) with H, W large enough for a positive output (got output "
                f"{ho}x{wo})", s)
        return [(s[0], s[1], ho, wo)]

    def flops(self, in_shapes: list[Shape]) -> int:
        n, c, ho, wo = self.output_shapes(in_shapes)[0]
        return n * c * ho * wo * self.kernel_size[0] * self.kernel_size[1]


class MaxPool2d(_Pool2d):
    """Max over each window, like ``torch.nn.MaxPool2d`` (padding counts as ``-inf``).

    Backward keeps neither input nor output: forward stashes the window index of each
    maximum (``argmax``, one byte per output element for windows up to 256 elements).
    """

    backward_from = (StashEncoding.PACKED_ARGMAX,)

    def stash_specs(self, in_shapes: list[Shape], dtype: np.dtype) -> dict[str, tuple]:
        return {"argmax": (self.output_shapes(in_shapes)[0], argmax_dtype(self.kernel_size))}

    def memory_attrs(self, in_shapes: list[Shape]) -> dict:
        kh, kw = self.kernel_size
        return {"window": kh * kw, "kernel": tuple(self.kernel_size),
                "stride": tuple(self.stride), "padding": tuple(self.padding)}

    def backward_from_encoded(self, encoding, encoded, grad_output, grad_input) -> None:
        """From the argmax stash packed to the window's bits (Gist's binarize)."""
        if encoding != StashEncoding.PACKED_ARGMAX:
            super().backward_from_encoded(encoding, encoded, grad_output, grad_input)
        maxpool_backward_packed(grad_output, encoded, tuple(grad_input.shape), self.kernel_size,
                                self.stride, self.padding, out=grad_input)

    def forward(self, ctx, inputs, outputs, params, stash, workspace) -> None:
        maxpool2d_forward(inputs[0], outputs[0], stash["argmax"], self.kernel_size,
                          self.stride, self.padding)

    def backward(self, ctx, grad_outputs, grad_inputs, inputs, outputs, params, grad_params,
                 stash, workspace) -> None:
        if grad_inputs[0] is not None:
            maxpool2d_backward(grad_outputs[0], stash["argmax"], grad_inputs[0],
                               self.kernel_size, self.stride, self.padding)


class AvgPool2d(_Pool2d):
    """Mean over each window, like ``torch.nn.AvgPool2d`` with ``count_include_pad=True``.

    Backward needs only the output gradient (no retained tensors).
    """

    def forward(self, ctx, inputs, outputs, params, stash, workspace) -> None:
        avgpool2d_forward(inputs[0], outputs[0], self.kernel_size, self.stride, self.padding)

    def backward(self, ctx, grad_outputs, grad_inputs, inputs, outputs, params, grad_params,
                 stash, workspace) -> None:
        if grad_inputs[0] is not None:
            avgpool2d_backward(grad_outputs[0], grad_inputs[0], self.kernel_size, self.stride,
                               self.padding)


__all__ = ["MaxPool2d", "AvgPool2d"]

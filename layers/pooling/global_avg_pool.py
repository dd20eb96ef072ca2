"""GlobalAvgPool2d: (N, C, H, W) -> (N, C), the mean over each feature map.

Equivalent to PyTorch's ``AdaptiveAvgPool2d(1)`` followed by ``flatten(1)``: the output is
(N, C), ready for a Linear layer. On device arrays forward is one GEMM against a column of
``1 / (H*W)`` in its workspace, declared for the ``"cuda"`` device kind only
(:mod:`minidl.kernels.pooling.pool_device`); on NumPy arrays a sum, with no workspace.
"""

from __future__ import annotations

import numpy as np

from ...kernels._cuda import is_device_array
from ...kernels.pooling.pool_device import (
    global_avgpool2d_forward_device,
    global_avgpool2d_workspace_bytes,
)
from ...kernels.vocabulary import DeviceKind
from ..base import Layer, device_kind


class GlobalAvgPool2d(Layer):
    kind = "pool"
    option_names = ("device_kind",)

    def output_shapes(self, in_shapes):
        (s,) = in_shapes
        if len(s) != 4 or s[2] < 1 or s[3] < 1:
            raise self.shape_error("(N, C, H, W) with H, W >= 1", tuple(s))
        return [(s[0], s[1])]

    def flops(self, in_shapes):
        n, c, h, w = in_shapes[0]
        return n * c * h * w

    def stash_specs(self, in_shapes, dtype, options=None):
        return {}

    def forward_workspace_bytes(self, in_shapes, dtype, options=None) -> int:
        self.output_shapes(in_shapes)
        if device_kind(options) == DeviceKind.CUDA:
            return global_avgpool2d_workspace_bytes(tuple(in_shapes[0]), dtype)
        return 0

    def backward_workspace_bytes(self, in_shapes, dtype, options=None) -> int:
        return 0

    def forward(self, ctx, inputs, outputs, params, stash, workspace) -> None:
        x, y = inputs[0], outputs[0]
        if is_device_array(x):
            global_avgpool2d_forward_device(x, y, workspace)
            return
        np.sum(x, axis=(2, 3), out=y)
        y *= 1.0 / (x.shape[2] * x.shape[3])

    def backward(self, ctx, grad_outputs, grad_inputs, inputs, outputs, params, grad_params,
                 stash, workspace) -> None:
        dx = grad_inputs[0]
        if dx is not None:
            np.multiply(grad_outputs[0][:, :, None, None], 1.0 / (dx.shape[2] * dx.shape[3]),
                        out=dx)

"""GlobalAvgPool2d: (N, C, H, W) -> (N, C), the mean over each feature map.

Equivalent to PyTorch's ``AdaptiveAvgPool2d(1)`` followed by ``flatten(1)``: the output is
(N, C), ready for a Linear layer.
"""

from __future__ import annotations

import numpy as np

from .base import Layer


class GlobalAvgPool2d(Layer):
    kind = "pool"

    def output_shapes(self, in_shapes):
        (s,) = in_shapes
        if len(s) != 4 or s[2] < 1 or s[3] < 1:
            raise self.shape_error("(N, C, H, W) with H, W >= 1", tuple(s))
        return [(s[0], s[1])]

    def flops(self, in_shapes):
        n, c, h, w = in_shapes[0]
        return n * c * h * w

    def forward(self, ctx, inputs, outputs, params, stash, workspace) -> None:
        x, y = inputs[0], outputs[0]
        np.sum(x, axis=(2, 3), out=y)
        y *= 1.0 / (x.shape[2] * x.shape[3])

    def backward(self, ctx, grad_outputs, grad_inputs, inputs, outputs, params, grad_params,
                 stash, workspace) -> None:
        dx = grad_inputs[0]
        if dx is not None:
            np.multiply(grad_outputs[0][:, :, None, None], 1.0 / (dx.shape[2] * dx.shape[3]),
                        out=dx)

"""ReLU: y = max(x, 0). Backward needs only the sign of its output."""

from __future__ import annotations

import numpy as np

from .base import Layer


class ReLU(Layer):
    kind = "relu"
    retain_outputs = (0,)
    inplace_forward = True
    inplace_backward = True

    def forward(self, ctx, inputs, outputs, params, stash, workspace) -> None:
        np.maximum(inputs[0], 0, out=outputs[0])

    def backward(self, ctx, grad_outputs, grad_inputs, inputs, outputs, params, grad_params,
                 stash, workspace) -> None:
        if grad_inputs[0] is not None:
            # dy * (y > 0); safe when grad_inputs[0] is grad_outputs[0].
            np.multiply(grad_outputs[0], outputs[0] > 0, out=grad_inputs[0])

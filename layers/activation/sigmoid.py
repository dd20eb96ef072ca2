"""Sigmoid: y = 1 / (1 + exp(-x)); backward from the output, dy * y * (1 - y)."""

from __future__ import annotations

import numpy as np

from ...kernels.pointwise.elementwise import sigmoid_backward
from ..base import Layer


class Sigmoid(Layer):
    kind = "act"
    retain_outputs = (0,)
    inplace_forward = True
    inplace_backward = True

    def forward(self, ctx, inputs, outputs, params, stash, workspace) -> None:
        y = outputs[0]
        # In place in y, no temporaries; exp overflow gives inf and 1 / inf = 0, as intended.
        with np.errstate(over="ignore", under="ignore"):
            np.negative(inputs[0], out=y)
            np.exp(y, out=y)
        y += 1
        np.reciprocal(y, out=y)

    def backward(self, ctx, grad_outputs, grad_inputs, inputs, outputs, params, grad_params,
                 stash, workspace) -> None:
        if grad_inputs[0] is not None:
            sigmoid_backward(grad_outputs[0], outputs[0], grad_inputs[0])

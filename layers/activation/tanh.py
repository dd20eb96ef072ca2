"""Tanh: y = tanh(x); backward from the output, dy * (1 - y**2)."""

from __future__ import annotations

import numpy as np

from ...kernels.pointwise.elementwise import tanh_backward
from ..base import Layer


class Tanh(Layer):
    kind = "act"
    retain_outputs = (0,)
    inplace_forward = True
    inplace_backward = True

    def forward(self, ctx, inputs, outputs, params, stash, workspace) -> None:
        np.tanh(inputs[0], out=outputs[0])

    def backward(self, ctx, grad_outputs, grad_inputs, inputs, outputs, params, grad_params,
                 stash, workspace) -> None:
        if grad_inputs[0] is not None:
            tanh_backward(grad_outputs[0], outputs[0], grad_inputs[0])

"""LeakyReLU: y = x if x > 0 else negative_slope * x."""

from __future__ import annotations

from ...kernels.pointwise.elementwise import leaky_relu_backward, leaky_relu_forward
from ..base import Layer


class LeakyReLU(Layer):
    """For ``negative_slope >= 0`` the sign of the output equals the sign of the input, so
    backward reads the output and the layer runs in place. For a negative slope it retains
    the input instead (instance-level flags: no in-place forward). Tagged ``act``, not
    ``relu``: the output is dense, so ReLU-specific sparse encodings do not pay off."""

    kind = "act"
    retain_outputs = (0,)
    inplace_forward = True
    inplace_backward = True

    def __init__(self, negative_slope: float = 0.01) -> None:
        super().__init__()
        self.negative_slope = float(negative_slope)
        if self.negative_slope < 0:
            self.retain_inputs = (0,)
            self.retain_outputs = ()
            self.inplace_forward = False

    def forward(self, ctx, inputs, outputs, params, stash, workspace) -> None:
        leaky_relu_forward(inputs[0], self.negative_slope, outputs[0])

    def backward(self, ctx, grad_outputs, grad_inputs, inputs, outputs, params, grad_params,
                 stash, workspace) -> None:
        if grad_inputs[0] is None:
            return
        ref = inputs[0] if self.negative_slope < 0 else outputs[0]
        leaky_relu_backward(grad_outputs[0], ref, self.negative_slope, grad_inputs[0])

    def describe(self) -> str:
        return f"LeakyReLU({self.negative_slope:g})"

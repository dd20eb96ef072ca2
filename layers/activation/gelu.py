"""GELU: x * Phi(x), exact (erf) or tanh-approximated, as ``torch.nn.GELU``."""

from __future__ import annotations

from ...kernels.transformer.gelu import APPROXIMATIONS, gelu_backward, gelu_forward
from ..base import Layer


class GELU(Layer):
    """``approximate="none"`` (erf, the default) or ``"tanh"``, PyTorch's forms. Backward
    retains the input (the derivative needs x) and may write the input gradient over the
    output gradient."""

    kind = "act"
    retain_inputs = (0,)
    inplace_backward = True

    def __init__(self, approximate: str = "none") -> None:
        super().__init__()
        if approximate not in APPROXIMATIONS:
            raise ValueError(f"GELU approximate must be one of {', '.join(APPROXIMATIONS)}, "
                             f"got {approximate!r}")
        self.approximate = approximate

    def flops(self, in_shapes):
        return 8 * int(super().flops(in_shapes))

    def forward(self, ctx, inputs, outputs, params, stash, workspace) -> None:
        gelu_forward(inputs[0], outputs[0], self.approximate)

    def backward(self, ctx, grad_outputs, grad_inputs, inputs, outputs, params, grad_params,
                 stash, workspace) -> None:
        if grad_inputs[0] is not None:
            gelu_backward(grad_outputs[0], inputs[0], grad_inputs[0], self.approximate)

    def describe(self) -> str:
        return "GELU()" if self.approximate == "none" else f"GELU(approximate={self.approximate!r})"

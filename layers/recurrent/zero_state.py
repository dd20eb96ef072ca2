"""ZeroState: a zero-filled (N, *shape) tensor sized by its input's batch — an RNN's default
initial hidden or cell state."""

from __future__ import annotations

import numpy as np

from ..base import Layer, Shape


class ZeroState(Layer):
    """Output zeros of shape ``(N, *shape)`` where N is the input's batch size. No gradient
    flows to the input (it only gives the batch size)."""

    kind = "state"
    nondiff_inputs = (0,)

    def __init__(self, *shape: int) -> None:
        super().__init__()
        if not shape or any(int(s) <= 0 for s in shape):
            raise ValueError(f"ZeroState needs positive sizes, got {shape}")
        self.shape = tuple(int(s) for s in shape)

    def describe(self) -> str:
        return f"ZeroState{self.shape}"

    def output_shapes(self, in_shapes: list[Shape]) -> list[Shape]:
        return [(in_shapes[0][0], *self.shape)]

    def output_dtypes(self, in_dtypes):
        dt = np.dtype(in_dtypes[0])
        return [dt if dt.kind == "f" else np.dtype(np.float32)]

    def flops(self, in_shapes: list[Shape]) -> int:
        return 0

    def forward(self, ctx, inputs, outputs, params, stash, workspace) -> None:
        outputs[0].fill(0)

    def backward(self, ctx, grad_outputs, grad_inputs, inputs, outputs, params, grad_params,
                 stash, workspace) -> None:
        """Nothing to do: no parameters, and the input receives no gradient."""

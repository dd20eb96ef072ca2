"""TimeStack: T per-step tensors (N, *F) stacked along a new time axis into (N, T, *F)."""

from __future__ import annotations

from ..base import Layer, Shape


class TimeStack(Layer):
    """Stack ``T`` inputs of identical shape ``(N, *F)`` into one ``(N, T, *F)`` output (how an
    unrolled RNN's per-step outputs become a sequence). Backward slices the gradient back."""

    kind = "stack"
    num_inputs = None

    def describe(self) -> str:
        return "TimeStack()"

    def output_shapes(self, in_shapes: list[Shape]) -> list[Shape]:
        first = tuple(in_shapes[0])
        for s in in_shapes[1:]:
            if tuple(s) != first:
                raise self.shape_error(f"{len(in_shapes)} tensors of shape {first}", tuple(s))
        return [(first[0], len(in_shapes), *first[1:])]

    def flops(self, in_shapes: list[Shape]) -> int:
        return 0

    def forward(self, ctx, inputs, outputs, params, stash, workspace) -> None:
        y = outputs[0]
        for t, x in enumerate(inputs):
            y[:, t] = x

    def backward(self, ctx, grad_outputs, grad_inputs, inputs, outputs, params, grad_params,
                 stash, workspace) -> None:
        dy = grad_outputs[0]
        for t, g in enumerate(grad_inputs):
            if g is not None:
                g[...] = dy[:, t]

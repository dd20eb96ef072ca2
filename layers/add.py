"""Add: elementwise sum of two or more inputs of identical shape (residual connections)."""

from __future__ import annotations

import numpy as np

from ..kernels.pointwise import add as addk
from ..kernels.vocabulary import RecomputeCost
from .base import Layer


class Add(Layer):
    """y = x0 + x1 + ...; no broadcasting. Output 0 may alias input 0 (in-place forward) and
    grad-input 0 may alias the grad output (in-place backward). Retains nothing."""

    kind = "add"
    recompute_cost = RecomputeCost.EXPENSIVE  # a join: kept as a checkpoint
    num_inputs = None
    inplace_forward = True
    inplace_backward = True

    def output_shapes(self, in_shapes):
        if len(in_shapes) < 2:
            raise TypeError(f"{self.name or 'Add'} takes at least 2 inputs, got {len(in_shapes)}")
        first = tuple(in_shapes[0])
        for s in in_shapes[1:]:
            if tuple(s) != first:
                raise self.shape_error(
                    f"inputs of identical shape, {first} for all",
                    tuple(tuple(t) for t in in_shapes),
                )
        return [first]

    def output_dtypes(self, in_dtypes):
        dts = {np.dtype(d) for d in in_dtypes}
        if len(dts) != 1:
            raise TypeError(f"{self.name or 'Add'} inputs differ in dtype: {sorted(map(str, dts))}")
        return [np.dtype(in_dtypes[0])]

    def flops(self, in_shapes):
        return (len(in_shapes) - 1) * int(np.prod(in_shapes[0]))

    def forward(self, ctx, inputs, outputs, params, stash, workspace) -> None:
        y = outputs[0]
        addk.add(inputs[0], inputs[1], y)
        for x in inputs[2:]:
            addk.add(y, x, y)

    def backward(self, ctx, grad_outputs, grad_inputs, inputs, outputs, params, grad_params,
                 stash, workspace) -> None:
        dy = grad_outputs[0]
        for dx in grad_inputs:
            if dx is not None and dx is not dy:
                addk.copy(dy, dx)

"""Concat: joins two or more inputs along one axis (never the batch axis 0)."""

from __future__ import annotations

import numpy as np

from ..kernels.vocabulary import RecomputeCost
from .base import Layer


class Concat(Layer):
    """``axis`` counts on the full batch-first shape (1 = channels for NCHW); negative values
    count from the end. Concatenating along the batch axis is refused, so the batch dimension
    always means the same thing through the network. Retains no tensors; stashes the
    input sizes along the axis (8 bytes per input)."""

    kind = "concat"
    recompute_cost = RecomputeCost.EXPENSIVE  # a join: kept as a checkpoint
    num_inputs = None

    def __init__(self, axis: int = 1) -> None:
        super().__init__()
        if axis == 0:
            raise ValueError("Concat along the batch axis 0 is not supported")
        self.axis = int(axis)

    def _axis(self, rank: int) -> int:
        return self.axis + rank if self.axis < 0 else self.axis

    def output_shapes(self, in_shapes):
        if len(in_shapes) < 2:
            raise TypeError(
                f"{self.name or 'Concat'} takes at least 2 inputs, got {len(in_shapes)}"
            )
        shapes = tuple(tuple(s) for s in in_shapes)
        rank = len(shapes[0])
        ax = self._axis(rank)
        ok = 1 <= ax < rank and all(
            len(s) == rank and s[:ax] + s[ax + 1:] == shapes[0][:ax] + shapes[0][ax + 1:]
            for s in shapes
        )
        if not ok:
            raise self.shape_error(
                f"inputs of equal rank >= 2 whose shapes agree except on axis {self.axis}", shapes
            )
        out = list(shapes[0])
        out[ax] = sum(s[ax] for s in shapes)
        return [tuple(out)]

    def output_dtypes(self, in_dtypes):
        dts = {np.dtype(d) for d in in_dtypes}
        if len(dts) != 1:
            raise TypeError(
                f"{self.name or 'Concat'} inputs differ in dtype: {sorted(map(str, dts))}"
            )
        return [np.dtype(in_dtypes[0])]

    def flops(self, in_shapes):
        return 0

    def stash_specs(self, in_shapes, dtype):
        # Backward must know where each input's slice starts even when some gradient is not
        # needed; the inputs are not retained, so forward records their sizes on the axis.
        return {"sizes": ((len(in_shapes),), np.int64)}

    def forward(self, ctx, inputs, outputs, params, stash, workspace) -> None:
        ax = self._axis(outputs[0].ndim)
        np.concatenate(inputs, axis=ax, out=outputs[0])
        sizes = stash["sizes"]
        for i, x in enumerate(inputs):  # element by element: no host list into device memory
            sizes[i] = x.shape[ax]

    def backward(self, ctx, grad_outputs, grad_inputs, inputs, outputs, params, grad_params,
                 stash, workspace) -> None:
        dy = grad_outputs[0]
        ax = self._axis(dy.ndim)
        idx = [slice(None)] * dy.ndim
        lo = 0
        for dx, size in zip(grad_inputs, stash["sizes"].tolist(), strict=True):
            if dx is not None:
                idx[ax] = slice(lo, lo + size)
                np.copyto(dx, dy[tuple(idx)])
            lo += size

    def describe(self) -> str:
        return f"Concat(axis={self.axis})"

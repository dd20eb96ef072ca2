"""Flatten: (N, d1, ..., dk) -> (N, d1 * ... * dk), as ``torch.nn.Flatten``."""

from __future__ import annotations

import math

import numpy as np

from .base import Layer


def _copy(src: np.ndarray, dst: np.ndarray) -> None:
    """dst[...] = src reshaped; nothing to do when dst already is src's memory (in place)."""
    if dst.size == src.size and np.may_share_memory(dst, src):
        return  # contiguous arrays of one size that overlap: the same memory
    np.copyto(dst, src.reshape(dst.shape))


class Flatten(Layer):
    """Flattens dims ``start_dim..end_dim`` (PyTorch's arguments; the batch dim 0 is always
    kept, so ``start_dim`` must resolve to >= 1). Forward and backward copy; declared in place:
    the engine may give output 0 the input's memory (as a reshaped view), then both are no-ops.
    """

    kind = "flatten"
    inplace_forward = True
    inplace_backward = True

    def __init__(self, start_dim: int = 1, end_dim: int = -1) -> None:
        super().__init__()
        if start_dim == 0:
            raise ValueError("Flatten must keep the batch dimension: start_dim must not be 0")
        self.start_dim = int(start_dim)
        self.end_dim = int(end_dim)

    def output_shapes(self, in_shapes):
        (s,) = in_shapes
        s = tuple(s)
        r = len(s)
        start = self.start_dim + r if self.start_dim < 0 else self.start_dim
        end = self.end_dim + r if self.end_dim < 0 else self.end_dim
        if r < 1 or not (1 <= start <= end < r):
            raise self.shape_error(
                f"a tensor with dims {self.start_dim}..{self.end_dim} after the batch dim", s
            )
        return [(*s[:start], math.prod(s[start:end + 1]), *s[end + 1:])]

    def flops(self, in_shapes):
        return 0

    def forward(self, ctx, inputs, outputs, params, stash, workspace) -> None:
        _copy(inputs[0], outputs[0])

    def backward(self, ctx, grad_outputs, grad_inputs, inputs, outputs, params, grad_params,
                 stash, workspace) -> None:
        if grad_inputs[0] is not None:
            _copy(grad_outputs[0], grad_inputs[0])

    def describe(self) -> str:
        if (self.start_dim, self.end_dim) == (1, -1):
            return "Flatten()"
        return f"Flatten({self.start_dim}, {self.end_dim})"

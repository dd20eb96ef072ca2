"""Dropout: inverted dropout with a reproducible mask derived only from ``ctx.seed``."""

from __future__ import annotations

import math

import numpy as np

from ..kernels._cuda import is_device_array
from ..kernels.pointwise.dropout import dropout_backward_device, dropout_forward, workspace_bytes
from .base import Layer


class Dropout(Layer):
    """Training: y = x * mask / (1 - p), mask ~ Bernoulli(1 - p) from a counter-based hash
    of ``(ctx.seed, element index)`` (:mod:`minidl.kernels.pointwise.dropout`), so a recomputed
    forward
    with the same seed replays the same mask, and the CPU and a GPU draw the same one (the
    mask depends on the seed and the size only, not on the dtype or the device).
    Eval: identity. ``p`` in [0, 1]; p = 1 zeroes everything (as PyTorch).

    The mask is stashed as uint8 of the input's shape (always declared; written in eval too).
    The forward workspace (``min(size, 65536)`` * 8 bytes, provided by the engine) holds the
    hashes chunk by chunk for arrays that take neither the CPU kernel nor the device one (a
    float device array runs one kernel each way). Runs in place; retains no tensors.
    """

    kind = "dropout"
    inplace_forward = True
    inplace_backward = True

    def __init__(self, p: float = 0.5) -> None:
        super().__init__()
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"dropout probability must be in [0, 1], got {p}")
        self.p = float(p)

    def stash_specs(self, in_shapes, dtype):
        return {"mask": (tuple(in_shapes[0]), np.uint8)}

    def forward_workspace_bytes(self, in_shapes, dtype):
        return workspace_bytes(math.prod(in_shapes[0]))

    def forward(self, ctx, inputs, outputs, params, stash, workspace) -> None:
        x, y, mask = inputs[0], outputs[0], stash["mask"]
        p = self.p
        if not ctx.training or p == 0.0:
            mask.fill(1)
            if not np.may_share_memory(x, y):
                np.copyto(y, x)
            return
        if p == 1.0:
            mask.fill(0)
            y.fill(0)
            return
        if not (y.flags.c_contiguous and mask.flags.c_contiguous):
            raise ValueError("Dropout writes C-contiguous output and mask arrays only")
        dropout_forward(x, p, ctx.seed, y, mask, workspace)

    def backward(self, ctx, grad_outputs, grad_inputs, inputs, outputs, params, grad_params,
                 stash, workspace) -> None:
        dy, dx = grad_outputs[0], grad_inputs[0]
        if dx is None:
            return
        p = self.p
        if not ctx.training or p == 0.0:
            if dx is not dy:
                np.copyto(dx, dy)
        elif p == 1.0:
            dx.fill(0)
        elif is_device_array(dx) and dx.dtype in (np.float32, np.float64) and \
                dx.flags.c_contiguous and dy.flags.c_contiguous:
            dropout_backward_device(dy, stash["mask"], dx, p)  # one kernel
        else:
            np.multiply(dy, stash["mask"], out=dx)
            dx *= dx.dtype.type(1.0 / (1.0 - p))

    def describe(self) -> str:
        return f"Dropout(p={self.p:g})"

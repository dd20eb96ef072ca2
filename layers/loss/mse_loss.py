"""MSELoss: mean((pred - target) ** 2) over all elements; a scalar (shape ()) output."""

from __future__ import annotations

import math

import numpy as np

from ..base import Layer

#: Elements per chunk of the forward pass (bounds its workspace).
_CHUNK = 1 << 16


class MSELoss(Layer):
    """Inputs (pred, target) of one shape; the target gets no gradient. Forward works in
    chunks through a workspace of ``min(size, 65536)`` elements that the engine provides."""

    kind = "loss"
    num_inputs = 2
    retain_inputs = (0, 1)
    nondiff_inputs = (1,)

    def output_shapes(self, in_shapes):
        p, t = (tuple(s) for s in in_shapes)
        if p != t:
            raise self.shape_error(f"target of the prediction's shape {p}", t)
        return [()]

    def flops(self, in_shapes):
        return 3 * math.prod(in_shapes[0])

    def forward_workspace_bytes(self, in_shapes, dtype):
        return min(math.prod(in_shapes[0]), _CHUNK) * np.dtype(dtype).itemsize

    def forward(self, ctx, inputs, outputs, params, stash, workspace) -> None:
        p, t = inputs[0].reshape(-1), inputs[1].reshape(-1)
        n = p.size
        chunk = min(n, _CHUNK)
        total = 0.0
        if n:
            buf = workspace[: chunk * p.dtype.itemsize].view(p.dtype)
            for lo in range(0, n, chunk):
                b = buf[: min(chunk, n - lo)]
                np.subtract(p[lo:lo + chunk], t[lo:lo + chunk], out=b)
                # a float64 sum, on the data's device (no host synchronisation per chunk)
                total = total + np.dot(b, b).astype(np.float64)
        outputs[0][...] = total / n if n else np.nan

    def backward(self, ctx, grad_outputs, grad_inputs, inputs, outputs, params, grad_params,
                 stash, workspace) -> None:
        dx = grad_inputs[0]
        if dx is None:
            return
        np.subtract(inputs[0], inputs[1], out=dx)
        dx *= grad_outputs[0] * (2.0 / max(dx.size, 1))

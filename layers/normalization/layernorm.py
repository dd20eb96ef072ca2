"""LayerNorm over the last axis with PyTorch's parameters (``weight``, ``bias``)."""

from __future__ import annotations

import math

import numpy as np

from ...kernels.normalization.layernorm import (
    backward_workspace_shape,
    layernorm_backward,
    layernorm_forward,
)
from ...kernels.workspace import workspace_bytes, workspace_views
from ..base import Layer, ParamSpec


class LayerNorm(Layer):
    """``y = (x - mean) / sqrt(var + eps) * weight + bias`` over the last axis (of size
    ``dim``), like ``torch.nn.LayerNorm(dim, eps)``: ``weight`` (dim,) initialised to ones,
    ``bias`` (dim,) to zeros, the biased variance.

    Stash: ``mean`` and ``rstd`` (one per row, in the float dtype). Backward retains the input
    and rebuilds the normalised values from it; it may write the input gradient over the
    output gradient (in place). The backward workspace holds the parameter gradients' partial
    sums over fixed parts of rows (:mod:`minidl.kernels.normalization.layernorm`), so the sums do
    not depend
    on the thread count.
    """

    kind = "norm"
    retain_inputs = (0,)
    inplace_backward = True
    accumulates_grads = True

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        if dim < 1:
            raise ValueError(f"LayerNorm needs a positive dim, got {dim}")
        if not eps > 0:
            raise ValueError(f"LayerNorm eps must be positive, got {eps}")
        self.dim = int(dim)
        self.eps = float(eps)

    def output_shapes(self, in_shapes):
        (s,) = in_shapes
        if len(s) < 1 or s[-1] != self.dim:
            raise self.shape_error(f"(*, {self.dim})", tuple(s))
        return [tuple(s)]

    def param_specs(self):
        return {"weight": ParamSpec((self.dim,), "ones"), "bias": ParamSpec((self.dim,), "zeros")}

    def _rows(self, in_shapes) -> int:
        return math.prod(in_shapes[0][:-1])

    def stash_specs(self, in_shapes, dtype):
        rows = (self._rows(in_shapes),)
        return {"mean": (rows, np.dtype(dtype)), "rstd": (rows, np.dtype(dtype))}

    def backward_workspace_bytes(self, in_shapes, dtype):
        return workspace_bytes(dtype, backward_workspace_shape(self._rows(in_shapes), self.dim))

    def flops(self, in_shapes):
        return 8 * math.prod(in_shapes[0])

    def forward(self, ctx, inputs, outputs, params, stash, workspace) -> None:
        d = self.dim
        layernorm_forward(inputs[0].reshape(-1, d), params["weight"], params["bias"],
                          outputs[0].reshape(-1, d), stash["mean"], stash["rstd"], self.eps)

    def backward(self, ctx, grad_outputs, grad_inputs, inputs, outputs, params, grad_params,
                 stash, workspace) -> None:
        d = self.dim
        x = inputs[0].reshape(-1, d)
        dx = grad_inputs[0]
        (partials,) = workspace_views(workspace, x.dtype,
                                      backward_workspace_shape(x.shape[0], d))
        acc = "weight" in ctx.accumulate
        layernorm_backward(grad_outputs[0].reshape(-1, d), x, params["weight"], stash["mean"],
                           stash["rstd"], None if dx is None else dx.reshape(-1, d),
                           grad_params["weight"], grad_params["bias"], partials, accumulate=acc)

    def describe(self) -> str:
        extra = "" if self.eps == 1e-5 else f", eps={self.eps:g}"
        return f"LayerNorm({self.dim}{extra})"

"""Linear: y = x @ weight.T + bias, on (N, in) or (N, *, in) inputs (PyTorch layout)."""

from __future__ import annotations

import math

import numpy as np

from ..kernels.blas import gemm
from .base import Layer, ParamSpec


def _rows(a: np.ndarray, cols: int) -> np.ndarray | None:
    """``a`` as a 2-D (rows, cols) view of the same memory, or None if that needs a copy."""
    v = a.reshape(-1, cols)
    return v if np.may_share_memory(v, a) else None


class Linear(Layer):
    """Fully connected layer. ``weight`` is (out, in), ``bias`` (out,), both initialised
    U(-1/sqrt(in), 1/sqrt(in)) as in PyTorch. Backward retains only the input."""

    kind = "linear"
    recompute_cost = "expensive"
    retain_inputs = (0,)
    accumulates_grads = True

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__()
        if in_features < 1 or out_features < 1:
            raise ValueError(f"Linear needs positive sizes, got ({in_features}, {out_features})")
        self.in_features = int(in_features)
        self.out_features = int(out_features)
        self.bias = bool(bias)

    def output_shapes(self, in_shapes):
        (s,) = in_shapes
        if len(s) < 2 or s[-1] != self.in_features:
            raise self.shape_error(f"(N, *, {self.in_features})", tuple(s))
        return [(*s[:-1], self.out_features)]

    def param_specs(self):
        specs = {"weight": ParamSpec((self.out_features, self.in_features), "uniform",
                                     fan_in=self.in_features)}
        if self.bias:
            specs["bias"] = ParamSpec((self.out_features,), "uniform", fan_in=self.in_features)
        return specs

    def flops(self, in_shapes):
        rows = math.prod(in_shapes[0][:-1])
        return 2 * rows * self.in_features * self.out_features

    def forward(self, ctx, inputs, outputs, params, stash, workspace) -> None:
        x, y, w = inputs[0], outputs[0], params["weight"]
        x2, y2 = _rows(x, self.in_features), _rows(y, self.out_features)
        if x2 is None or y2 is None:  # non-contiguous views: batched matmul, still no copy
            np.matmul(x, w.T, out=y)
        else:
            np.matmul(x2, w.T, out=y2)
        if self.bias:
            y += params["bias"]

    def backward(self, ctx, grad_outputs, grad_inputs, inputs, outputs, params, grad_params,
                 stash, workspace) -> None:
        dy, x, w = grad_outputs[0], inputs[0], params["weight"]
        dy2 = _rows(dy, self.out_features)
        if dy2 is None:
            dy2 = dy.reshape(-1, self.out_features)
        dx = grad_inputs[0]
        if dx is not None:
            dx2 = _rows(dx, self.in_features)
            if dx2 is None:
                np.matmul(dy, w, out=dx)
            else:
                np.matmul(dy2, w, out=dx2)
        if "weight" in grad_params:
            x2 = _rows(x, self.in_features)
            if x2 is None:
                x2 = x.reshape(-1, self.in_features)
            if "weight" in ctx.accumulate:  # dW += dY^T X, straight into the gradient
                gemm(dy2, x2, grad_params["weight"], trans_a=True, beta=1.0)
            else:
                np.matmul(dy2.T, x2, out=grad_params["weight"])
        if self.bias and "bias" in grad_params:
            db = grad_params["bias"]
            if "bias" in ctx.accumulate:
                np.add(db, dy2.sum(axis=0, dtype=db.dtype), out=db)
            else:
                np.sum(dy2, axis=0, out=db)

    def describe(self) -> str:
        extra = "" if self.bias else ", bias=False"
        return f"Linear({self.in_features}, {self.out_features}{extra})"

"""Linear: y = x @ weight.T + bias, on (N, in) or (N, *, in) inputs (PyTorch layout)."""

from __future__ import annotations

import math

import numpy as np

from ..kernels.array_api import half_device
from ..kernels.blas import gemm
from ..kernels.vocabulary import RecomputeCost
from .base import Layer, ParamSpec


def _rows(a: np.ndarray, cols: int) -> np.ndarray | None:
    """``a`` as a 2-D (rows, cols) view of the same memory, or None if that needs a copy."""
    v = a.reshape(-1, cols)
    return v if np.may_share_memory(v, a) else None


def linear_forward(x2: np.ndarray, w: np.ndarray, b: np.ndarray | None, y2: np.ndarray) -> None:
    """``y2 = x2 @ w.T (+ b)`` on 2-D row views, the product in parallel bands. A half ``y2``
    on a device (mixed precision: half ``x2``, ``w`` and ``b``) takes the bias first and the
    product added to it in float32, rounded once (GemmEx's ``beta = 1``): the value of the
    float32 product plus the bias, rounded."""
    if b is not None and half_device(y2) and b.dtype == y2.dtype:
        y2[...] = b
        gemm(x2, w, y2, trans_b=True, beta=1.0)
        return
    gemm(x2, w, y2, trans_b=True, parallel=True)
    if b is not None:
        y2 += b


def linear_backward(dy2: np.ndarray, x2: np.ndarray, w: np.ndarray, dx2: np.ndarray | None,
                    grads: dict, ctx, prefix: str = "") -> None:
    """``dx2 = dy2 @ w`` (if wanted) and the gradients ``grads[prefix + "weight"]`` /
    ``grads[prefix + "bias"]`` (those present), added into when ``ctx.accumulate`` names
    them (micro-batches), else overwritten."""
    if dx2 is not None:
        gemm(dy2, w, dx2, parallel=True)
    gw, gb = grads.get(prefix + "weight"), grads.get(prefix + "bias")
    if gw is not None:  # dW (+)= dY^T X, straight into the gradient
        gemm(dy2, x2, gw, trans_a=True, beta=1.0 if prefix + "weight" in ctx.accumulate
             else 0.0, parallel=True)
    if gb is not None:
        if prefix + "bias" in ctx.accumulate:
            np.add(gb, dy2.sum(axis=0, dtype=gb.dtype), out=gb)
        else:  # (in float32 from half gradients)
            np.sum(dy2, axis=0, dtype=gb.dtype, out=gb)


class Linear(Layer):
    """Fully connected layer. ``weight`` is (out, in), ``bias`` (out,), both initialised
    U(-1/sqrt(in), 1/sqrt(in)) as in PyTorch. Backward retains only the input."""

    kind = "linear"
    recompute_cost = RecomputeCost.EXPENSIVE
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
            if self.bias:
                y += params["bias"]
        else:
            linear_forward(x2, w, params.get("bias") if self.bias else None, y2)

    def backward(self, ctx, grad_outputs, grad_inputs, inputs, outputs, params, grad_params,
                 stash, workspace) -> None:
        dy, x, w, dx = grad_outputs[0], inputs[0], params["weight"], grad_inputs[0]
        dy2 = _rows(dy, self.out_features)
        if dy2 is None:
            dy2 = dy.reshape(-1, self.out_features)
        x2 = _rows(x, self.in_features)
        if x2 is None:
            x2 = x.reshape(-1, self.in_features)
        dx2 = None if dx is None else _rows(dx, self.in_features)
        if dx is not None and dx2 is None:  # non-contiguous: batched matmul, still no copy
            np.matmul(dy, w, out=dx)
        linear_backward(dy2, x2, w, dx2, grad_params, ctx)

    def describe(self) -> str:
        extra = "" if self.bias else ", bias=False"
        return f"Linear({self.in_features}, {self.out_features}{extra})"

"""PositionalEmbedding: a learned table of positions added to a (N, T, D) input."""

from __future__ import annotations

import numpy as np

from ...kernels._cuda import is_device_array
from ...kernels.transformer.embedding import positional_grad_device
from ..base import Layer, ParamSpec


class PositionalEmbedding(Layer):
    """``y[n, t] = x[n, t] + weight[t]`` for t < T <= ``context``: GPT's learned positions
    (nanoGPT's ``wpe``: ``weight`` (context, dim), initialised N(0, 1) like
    ``torch.nn.Embedding``). Runs in place both ways and retains nothing: the gradient of
    ``weight[:T]`` is the sum of the output gradient over the batch, rows T and above get zero
    (on C-contiguous device arrays one kernel, with no temporary, accumulating or not).
    """

    kind = "embedding"
    inplace_forward = True
    inplace_backward = True
    accumulates_grads = True

    def __init__(self, context: int, dim: int) -> None:
        super().__init__()
        if context < 1 or dim < 1:
            raise ValueError(f"PositionalEmbedding needs positive sizes, got ({context}, {dim})")
        self.context = int(context)
        self.dim = int(dim)

    def output_shapes(self, in_shapes):
        (s,) = in_shapes
        if len(s) != 3 or s[2] != self.dim or not 1 <= s[1] <= self.context:
            raise self.shape_error(f"(N, T, {self.dim}) with 1 <= T <= {self.context}", tuple(s))
        return [tuple(s)]

    def param_specs(self):
        return {"weight": ParamSpec((self.context, self.dim), "normal")}

    def forward(self, ctx, inputs, outputs, params, stash, workspace) -> None:
        x, y = inputs[0], outputs[0]
        np.add(x, params["weight"][:x.shape[1]], out=y)

    def backward(self, ctx, grad_outputs, grad_inputs, inputs, outputs, params, grad_params,
                 stash, workspace) -> None:
        dy, dx = grad_outputs[0], grad_inputs[0]
        gw = grad_params.get("weight")
        if gw is not None:  # before dx: dx may be dy's memory, and must stay dy
            t = dy.shape[1]
            if is_device_array(gw) and gw.flags.c_contiguous and dy.flags.c_contiguous:
                positional_grad_device(dy, gw, "weight" in ctx.accumulate)
            elif "weight" in ctx.accumulate:
                gw[:t] += dy.sum(axis=0)
            else:
                np.sum(dy, axis=0, out=gw[:t])
                gw[t:] = 0
        if dx is not None and dx is not dy:
            np.copyto(dx, dy)

    def describe(self) -> str:
        return f"PositionalEmbedding({self.context}, {self.dim})"

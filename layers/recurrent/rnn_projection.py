"""RNNInputProjection: the input-to-gates product of one RNN layer for all T steps at once.

``gx_t = x_t @ weight.T + bias`` for t < T, as one GEMM over the N*T rows (PyTorch's
``weight_ih_l{k}`` / ``bias_ih_l{k}``), so that the per-step cells only do the recurrent
product. Inputs are either one batch-first sequence ``x`` (N, T, I) (the first RNN layer) or,
with ``step_inputs=True``, the T per-step tensors ``h_0 .. h_{T-1}`` (N, I) of the layer
below. Outputs are the T tensors ``gx_t`` (N, gate_size).
"""

from __future__ import annotations

import numpy as np

from ...kernels.workspace import Layout
from ..base import Layer, ParamSpec, Shape


def _rows(a: np.ndarray, cols: int) -> np.ndarray | None:
    """``a`` as a 2-D (rows, cols) view of the same memory, or None if that needs a copy."""
    v = a.reshape(-1, cols)
    return v if np.may_share_memory(v, a) else None


class RNNInputProjection(Layer):
    """Input projection of one LSTM/GRU layer over ``steps`` time steps.

    ``weight`` (gate_size, input_size) and ``bias`` (gate_size,) are initialised
    U(-1/sqrt(H), 1/sqrt(H)) with H = ``hidden_size`` (PyTorch's rule for every RNN
    parameter; pass the hidden size of the RNN: 4H = gate_size for an LSTM, 3H for a GRU;
    default gate_size). Backward retains every input. Workspace: forward (N*T, gate_size),
    plus (N*T, input_size) to gather step inputs; backward the same.
    """

    kind = "rnn"

    def __init__(self, input_size: int, gate_size: int, steps: int, bias: bool = True, *,
                 step_inputs: bool = False, hidden_size: int | None = None) -> None:
        super().__init__()
        if min(input_size, gate_size, steps) < 1:
            raise ValueError(
                f"RNNInputProjection needs positive sizes and steps, got input_size="
                f"{input_size}, gate_size={gate_size}, steps={steps}"
            )
        self.input_size = int(input_size)
        self.gate_size = int(gate_size)
        self.steps = int(steps)
        self.bias = bool(bias)
        self.step_inputs = bool(step_inputs)
        self.hidden_size = int(hidden_size) if hidden_size is not None else self.gate_size
        self.num_inputs = self.steps if self.step_inputs else 1
        self.num_outputs = self.steps
        self.retain_inputs = tuple(range(self.num_inputs))

    # ----------------------------------------------------------------- declarations
    def _batch(self, in_shapes: list[Shape]) -> int:
        """Batch size N, after checking the input shapes."""
        shapes = [tuple(s) for s in in_shapes]
        T, I = self.steps, self.input_size
        if not self.step_inputs:
            s = shapes[0] if len(shapes) == 1 else tuple(shapes)
            if len(shapes) != 1 or len(s) != 3 or s[1] != T or s[2] != I:
                raise self.shape_error(f"one sequence (N, {T}, {I})", s)
            return s[0]
        n = shapes[0][0] if shapes and shapes[0] else None
        if len(shapes) != T or any(s != (n, I) for s in shapes):
            raise self.shape_error(f"{T} step tensors (N, {I})", tuple(shapes))
        return n

    def output_shapes(self, in_shapes):
        n = self._batch(in_shapes)
        return [(n, self.gate_size)] * self.steps

    def param_specs(self):
        h = self.hidden_size
        specs = {"weight": ParamSpec((self.gate_size, self.input_size), "uniform", fan_in=h)}
        if self.bias:
            specs["bias"] = ParamSpec((self.gate_size,), "uniform", fan_in=h)
        return specs

    def _layout(self, n: int) -> Layout:
        """``gates``: all steps' projections (or their gradients) in one block; with step
        inputs, ``inputs``: the steps' inputs gathered into one block."""
        rows = n * self.steps
        if self.step_inputs:
            return Layout.of(gates=(rows, self.gate_size), inputs=(rows, self.input_size))
        return Layout.of(gates=(rows, self.gate_size))

    def forward_workspace_bytes(self, in_shapes, dtype):
        return self._layout(self._batch(in_shapes)).nbytes(dtype)

    def backward_workspace_bytes(self, in_shapes, dtype):
        return self._layout(self._batch(in_shapes)).nbytes(dtype)

    def flops(self, in_shapes):
        rows = self._batch(in_shapes) * self.steps
        return 2 * rows * self.input_size * self.gate_size + (rows * self.gate_size
                                                               if self.bias else 0)

    # ----------------------------------------------------------------- compute
    def forward(self, ctx, inputs, outputs, params, stash, workspace) -> None:
        w = params["weight"]
        b = params["bias"] if self.bias else None
        T, G, I = self.steps, self.gate_size, self.input_size
        n = outputs[0].shape[0]
        ws = self._layout(n).carve(workspace, outputs[0].dtype)
        y = ws.gates
        if self.step_inputs:  # rows in (t, n) order
            xg = ws.inputs
            for t in range(T):
                np.copyto(xg[t * n:(t + 1) * n], inputs[t])
            np.matmul(xg, w.T, out=y)
            blocks = [y[t * n:(t + 1) * n] for t in range(T)]
        else:  # rows in (n, t) order
            x = inputs[0]
            x2 = _rows(x, I)
            if x2 is None:
                np.matmul(x, w.T, out=y.reshape(n, T, G))
            else:
                np.matmul(x2, w.T, out=y)
            y3 = y.reshape(n, T, G)
            blocks = [y3[:, t] for t in range(T)]
        for t in range(T):
            if b is None:
                np.copyto(outputs[t], blocks[t])
            else:
                np.add(blocks[t], b, out=outputs[t])

    def backward(self, ctx, grad_outputs, grad_inputs, inputs, outputs, params, grad_params,
                 stash, workspace) -> None:
        w = params["weight"]
        T, G, I = self.steps, self.gate_size, self.input_size
        x0 = inputs[0]
        n = x0.shape[0]
        ws = self._layout(n).carve(workspace, x0.dtype)
        dy = ws.gates
        if self.step_inputs:
            dblocks = [dy[t * n:(t + 1) * n] for t in range(T)]
        else:
            dy3 = dy.reshape(n, T, G)
            dblocks = [dy3[:, t] for t in range(T)]
        for t in range(T):
            g = grad_outputs[t]
            if g is None:
                dblocks[t].fill(0)
            else:
                np.copyto(dblocks[t], g)

        if self.bias and "bias" in grad_params:
            np.sum(dy, axis=0, out=grad_params["bias"])
        if self.step_inputs:
            xg = ws.inputs
            if "weight" in grad_params:
                for t in range(T):
                    np.copyto(xg[t * n:(t + 1) * n], inputs[t])
                np.matmul(dy.T, xg, out=grad_params["weight"])
            if any(g is not None for g in grad_inputs):
                np.matmul(dy, w, out=xg)  # the gathered inputs are no longer needed
                for t, g in enumerate(grad_inputs):
                    if g is not None:
                        np.copyto(g, xg[t * n:(t + 1) * n])
            return

        if "weight" in grad_params:
            x2 = _rows(x0, I)
            if x2 is None:
                x2 = x0.reshape(-1, I)
            np.matmul(dy.T, x2, out=grad_params["weight"])
        dx = grad_inputs[0]
        if dx is not None:
            dx2 = _rows(dx, I)
            if dx2 is None:
                np.matmul(dy.reshape(n, T, G), w, out=dx)
            else:
                np.matmul(dy, w, out=dx2)

    def describe(self) -> str:
        extra = "" if self.bias else ", bias=False"
        mode = ", step_inputs=True" if self.step_inputs else ""
        return (f"RNNInputProjection({self.input_size}, {self.gate_size}, steps={self.steps}"
                f"{extra}{mode})")

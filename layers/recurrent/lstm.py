"""LSTMCell: one time step of an LSTM layer, PyTorch's formulas and gate order (i, f, g, o).

``gates = gx_t + h_prev @ weight_hh.T + bias_hh``; i, f, o = sigmoid, g = tanh;
``c_t = f*c_prev + i*g``; ``h_t = o*tanh(c_t)``. ``gx_t`` is the input projection with
``bias_ih`` (see :class:`RNNInputProjection`). The engine unrolls a sequence into one cell per
step sharing ``weight_hh`` / ``bias_hh``.
"""

from __future__ import annotations

import numpy as np

from ...kernels.recurrent.rnn import lstm_cell_backward, lstm_cell_forward
from ...kernels.workspace import Layout
from ..base import Layer, ParamSpec, Shape


class LSTMCell(Layer):
    """One LSTM step: inputs ``(gx_t (N, 4H), h_prev (N, H), c_prev (N, H))``, outputs
    ``(h_t, c_t)``; parameters ``weight_hh`` (4H, H) and ``bias_hh`` (4H,), initialised
    U(-1/sqrt(H), 1/sqrt(H)) as in PyTorch.

    Kept for backward: the stash ``gates`` (N, 4H), the activated ``[i, f, g, o]``; the
    inputs ``h_prev`` (for dW_hh) and ``c_prev`` (for df); the output ``c_t`` (tanh(c_t) is
    recomputed). c_t is the next step's retained ``c_prev`` anyway, so the cell states cost
    one (N, H) per step in all, and the stash 4H instead of 5H with tanh(c_t). Workspace:
    forward (4H, N) for ``W_hh @ h_prev.T``; backward (N, 4H) for the gate gradients when the
    gradient of gx is not wanted.
    """

    kind = "rnn"
    num_inputs = 3
    num_outputs = 2
    retain_inputs = (1, 2)
    retain_outputs = (1,)

    def __init__(self, hidden_size: int, bias: bool = True) -> None:
        super().__init__()
        if hidden_size < 1:
            raise ValueError(f"LSTMCell needs a positive hidden size, got {hidden_size}")
        self.hidden_size = int(hidden_size)
        self.bias = bool(bias)

    def _batch(self, in_shapes: list[Shape]) -> int:
        h = self.hidden_size
        shapes = tuple(tuple(s) for s in in_shapes)
        ok = len(shapes) == 3 and all(len(s) == 2 for s in shapes)
        n = shapes[0][0] if ok else None
        if not ok or shapes != ((n, 4 * h), (n, h), (n, h)):
            raise self.shape_error(f"(gx (N, {4 * h}), h_prev (N, {h}), c_prev (N, {h}))",
                                   shapes)
        return n

    def output_shapes(self, in_shapes):
        n = self._batch(in_shapes)
        return [(n, self.hidden_size), (n, self.hidden_size)]

    def param_specs(self):
        h = self.hidden_size
        specs = {"weight_hh": ParamSpec((4 * h, h), "uniform", fan_in=h)}
        if self.bias:
            specs["bias_hh"] = ParamSpec((4 * h,), "uniform", fan_in=h)
        return specs

    def stash_specs(self, in_shapes, dtype):
        return {"gates": ((self._batch(in_shapes), 4 * self.hidden_size), dtype)}

    def _fwd_layout(self, n: int) -> Layout:
        # the recurrent product, gate-major (4H, N); zeros for the missing bias
        g = 4 * self.hidden_size
        return Layout.of(hw_t=(g, n)) if self.bias else Layout.of(hw_t=(g, n), zero_bias=(g,))

    def forward_workspace_bytes(self, in_shapes, dtype):
        return self._fwd_layout(self._batch(in_shapes)).nbytes(dtype)

    def _bwd_layout(self, n: int) -> Layout:
        # dgates when grad of gx is not wanted; the bias gradient when there is no bias
        return Layout.of(dgates=(n, 4 * self.hidden_size), dbias=(4 * self.hidden_size,))

    def backward_workspace_bytes(self, in_shapes, dtype):
        return self._bwd_layout(self._batch(in_shapes)).nbytes(dtype)

    def flops(self, in_shapes):
        n, h = self._batch(in_shapes), self.hidden_size
        return 2 * n * 4 * h * h + 12 * n * 4 * h  # recurrent GEMM + gate math (approx.)

    def forward(self, ctx, inputs, outputs, params, stash, workspace) -> None:
        gx, h_prev, c_prev = inputs
        h, c = outputs
        gates = stash["gates"]
        ws = self._fwd_layout(gates.shape[0]).carve(workspace, gates.dtype)
        hw_t = ws.hw_t
        if self.bias:
            b = params["bias_hh"]
        else:
            b = ws.zero_bias
            b.fill(0)
        np.matmul(params["weight_hh"], h_prev.T, out=hw_t)
        lstm_cell_forward(hw_t, gx, b, c_prev, gates, h, c)

    def backward(self, ctx, grad_outputs, grad_inputs, inputs, outputs, params, grad_params,
                 stash, workspace) -> None:
        _, h_prev, c_prev = inputs
        c = outputs[1]
        gates = stash["gates"]
        dh, dc = (np.zeros_like(c) if g is None else g for g in grad_outputs)
        ws = self._bwd_layout(gates.shape[0]).carve(workspace, gates.dtype)
        scratch_dg, scratch_db = ws.dgates, ws.dbias
        dgates = grad_inputs[0] if grad_inputs[0] is not None else scratch_dg
        db = grad_params.get("bias_hh", scratch_db) if self.bias else scratch_db
        lstm_cell_backward(dh, dc, gates, c, c_prev, dgates, grad_inputs[2], db)
        if grad_inputs[1] is not None:
            np.matmul(dgates, params["weight_hh"], out=grad_inputs[1])
        if "weight_hh" in grad_params:
            np.matmul(dgates.T, h_prev, out=grad_params["weight_hh"])

    def describe(self) -> str:
        extra = "" if self.bias else ", bias=False"
        return f"LSTMCell({self.hidden_size}{extra})"

"""GRUCell: one time step of a GRU layer, PyTorch's formulas and gate order (r, z, n).

``r = sigmoid(gx_r + W_hr h + b_hr)``, ``z = sigmoid(gx_z + W_hz h + b_hz)``,
``n = tanh(gx_n + r * (W_hn h + b_hn))``, ``h_t = (1 - z) * n + z * h_prev``, where ``gx_t``
is the input projection with ``bias_ih`` (see :class:`RNNInputProjection`).
"""

from __future__ import annotations

import numpy as np

from ...kernels.recurrent.rnn import gru_add_direct, gru_cell_backward, gru_cell_forward
from ...kernels.workspace import Layout
from ..base import Layer, ParamSpec, Shape


class GRUCell(Layer):
    """One GRU step: inputs ``(gx_t (N, 3H), h_prev (N, H))``, output ``h_t`` (N, H);
    parameters ``weight_hh`` (3H, H) and ``bias_hh`` (3H,), initialised U(-1/sqrt(H),
    1/sqrt(H)) as in PyTorch.

    Kept for backward: the stash ``gates`` (N, 4H) = ``[r, z, n, W_hn h_prev + b_hn]`` and
    the input ``h_prev``. Workspace: forward (3H, N) for ``W_hh @ h_prev.T``; backward two
    (N, 3H) (gradient of that product, and of gx when not wanted).
    """

    kind = "rnn"
    num_inputs = 2
    retain_inputs = (1,)

    def __init__(self, hidden_size: int, bias: bool = True) -> None:
        super().__init__()
        if hidden_size < 1:
            raise ValueError(f"GRUCell needs a positive hidden size, got {hidden_size}")
        self.hidden_size = int(hidden_size)
        self.bias = bool(bias)

    def _batch(self, in_shapes: list[Shape]) -> int:
        h = self.hidden_size
        shapes = tuple(tuple(s) for s in in_shapes)
        ok = len(shapes) == 2 and all(len(s) == 2 for s in shapes)
        n = shapes[0][0] if ok else None
        if not ok or shapes != ((n, 3 * h), (n, h)):
            raise self.shape_error(f"(gx (N, {3 * h}), h_prev (N, {h}))", shapes)
        return n

    def output_shapes(self, in_shapes):
        return [(self._batch(in_shapes), self.hidden_size)]

    def param_specs(self):
        h = self.hidden_size
        specs = {"weight_hh": ParamSpec((3 * h, h), "uniform", fan_in=h)}
        if self.bias:
            specs["bias_hh"] = ParamSpec((3 * h,), "uniform", fan_in=h)
        return specs

    def stash_specs(self, in_shapes, dtype):
        return {"gates": ((self._batch(in_shapes), 4 * self.hidden_size), dtype)}

    def _fwd_layout(self, n: int) -> Layout:
        # the recurrent product, gate-major (3H, N); zeros for the missing bias
        g = 3 * self.hidden_size
        return Layout.of(hw_t=(g, n)) if self.bias else Layout.of(hw_t=(g, n), zero_bias=(g,))

    def _bwd_layout(self, n: int) -> Layout:
        # gradient of the recurrent product; of gx when not wanted; of the missing bias
        g = 3 * self.hidden_size
        return Layout.of(dgh=(n, g), dgx=(n, g), dbias=(g,))

    def forward_workspace_bytes(self, in_shapes, dtype):
        return self._fwd_layout(self._batch(in_shapes)).nbytes(dtype)

    def backward_workspace_bytes(self, in_shapes, dtype):
        return self._bwd_layout(self._batch(in_shapes)).nbytes(dtype)

    def flops(self, in_shapes):
        n, h = self._batch(in_shapes), self.hidden_size
        return 2 * n * 3 * h * h + 12 * n * 3 * h  # recurrent GEMM + gate math (approx.)

    def forward(self, ctx, inputs, outputs, params, stash, workspace) -> None:
        gx, h_prev = inputs
        st = stash["gates"]
        ws = self._fwd_layout(st.shape[0]).carve(workspace, st.dtype)
        hw_t = ws.hw_t
        if self.bias:
            b = params["bias_hh"]
        else:
            b = ws.zero_bias
            b.fill(0)
        np.matmul(params["weight_hh"], h_prev.T, out=hw_t)  # gate-major: faster in OpenBLAS
        gru_cell_forward(gx, hw_t, b, h_prev, st, outputs[0])

    def backward(self, ctx, grad_outputs, grad_inputs, inputs, outputs, params, grad_params,
                 stash, workspace) -> None:
        h_prev = inputs[1]
        st = stash["gates"]
        dh = grad_outputs[0] if grad_outputs[0] is not None else np.zeros_like(h_prev)
        ws = self._bwd_layout(st.shape[0]).carve(workspace, st.dtype)
        dgh, scratch_dgx, scratch_db = ws.dgh, ws.dgx, ws.dbias
        dgx = grad_inputs[0] if grad_inputs[0] is not None else scratch_dgx
        db = grad_params.get("bias_hh", scratch_db) if self.bias else scratch_db
        gru_cell_backward(dh, st, h_prev, dgx, dgh, db)
        dh_prev = grad_inputs[1]
        if dh_prev is not None:
            np.matmul(dgh, params["weight_hh"], out=dh_prev)
            gru_add_direct(dh_prev, dh, st)
        if "weight_hh" in grad_params:
            np.matmul(dgh.T, h_prev, out=grad_params["weight_hh"])

    def describe(self) -> str:
        extra = "" if self.bias else ", bias=False"
        return f"GRUCell({self.hidden_size}{extra})"

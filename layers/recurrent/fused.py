"""LSTM and GRU over whole sequences: one node per layer stack, an internal loop over time.

The fused form of a recurrent layer (cuDNN's, oneDNN's): input ``x`` (N, T, I) batch-first,
output ``y`` (N, T, H), ``num_layers`` stacked layers with PyTorch's parameter names, layouts
and gate orders (``weight_ih_l{k}`` (G, I_k), ``weight_hh_l{k}`` (G, H), ``bias_ih_l{k}``,
``bias_hh_l{k}``; G = 4H with gates i, f, g, o for LSTM, 3H with r, z, n for GRU).

Time is cut into *units* of ``unit_steps`` steps. Per unit and layer, the input projection is
one GEMM over the unit's N*len rows, each step one recurrent GEMM and one fused Numba gate
kernel; in backward the weight gradients are one GEMM per unit (K = N*len) and the input
gradient another. Internally everything is time-major, so a unit's rows are contiguous.

On device arrays (CuPy) a step is two launches each way: forward the recurrent GEMM ``h_prev @
W_hh.T`` (row-major, cuBLAS) and one Numba CUDA cell kernel
(:mod:`minidl.kernels.recurrent.rnn_device`)
that adds the input projection and both biases itself (no per-piece bias pass); backward one
cell kernel, which adds the carried ``dh`` itself, and the GEMM ``dG @ W_hh`` into the carry.
A GRU's direct path ``dh * z`` goes from each step's kernel, through that step's (no longer
needed) slot of the incoming gradient, into the kernel of the step before; it is added to the
carry once per unit and layer. The CPU path is unchanged.

Memory over time follows a *schedule* (plain data, e.g. from ``minidl.memory.passes.bptt``):

* ``schedule=None`` keeps every unit's internals (gates, cell and hidden states) from forward
  to backward (stash ``gates`` (L, T, N, 4H), ``h`` and ``c`` (L, T+1, N, H));
* otherwise forward keeps only the hidden (and cell) states at the boundaries listed in
  ``schedule.forward_stores``, in ``schedule.max_stored`` slots, and backward replays
  ``schedule.ops``: ``("advance", a, b)`` runs units a..b-1 from the state at boundary a and
  stores the state at b; ``("backprop", j, j+1)`` recomputes unit j keeping its internals and
  backpropagates through it (Gruslys et al. 2016, BPTT-HSM). Every unit is computed by the
  same calls on the same shapes either way, and the gradients are accumulated unit by unit in
  the same order, so all schedules give bit-identical results.

Threads: keeping everything, the work per (layer, unit) — projection, recurrence, input- and
weight-gradient GEMMs — runs as tasks on ``threads`` workers (default: the kernels' thread
count, at most 2), each with single-threaded BLAS, by list scheduling over their dependencies
(layer k about one unit behind layer k-1, weight gradients filling the gaps; dependencies fix
every accumulation order, so results do not depend on the interleaving or on ``threads``).
Scheduled runs go unit by unit on the calling thread. BLAS stays single-threaded everywhere:
a multi-threaded OpenBLAS cuts a product differently by thread count, and on some CPUs (AMD
EPYC, measured) that changes the bits, so results would depend on the thread count and the
scheduled path would no longer match the pipelined one.

With ``vocab_size`` the input is (N, T) tokens and the layer owns the embedding: layer 0's
projection is a row gather from the (V, G) table ``embedding @ weight_ih_l0.T`` (when V <= N*T)
and its gradients come from dG summed per token.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ...kernels._cuda import is_device_array
from ...kernels.device_gemm import gemm as device_gemm
from ...kernels.parallel import ensure_blas_policy
from ...kernels.recurrent.rnn import (
    gru_add_direct,
    gru_cell_backward,
    gru_cell_forward,
    lstm_cell_backward,
    lstm_cell_forward,
)
from ...kernels.recurrent.rnn_device import (
    gru_backward_device,
    gru_forward_device,
    lstm_backward_device,
    lstm_forward_device,
)
from ...kernels.vocabulary import RecomputeCost
from ...kernels.workspace import Layout
from ..base import Layer, ParamSpec, Shape
from ..transformer.embedding import check_integer_dtype
from .keep_all import _KeepAllPath
from .scheduled import _ScheduledPath
from .units import _Accumulator, _UnitOps


class _Recurrent(_KeepAllPath, _ScheduledPath, _UnitOps, Layer):
    """Shared machinery of :class:`LSTM` and :class:`GRU` (see the module docstring)."""

    kind = "recurrent"
    recompute_cost = RecomputeCost.SEQUENCE
    option_names = ("bptt",)
    accumulates_grads = True
    cell = ""
    gate_factor = 4  # G = gate_factor * H
    state_parts = 1  # arrays per layer in a hidden state: (h,) or (h, c)

    def __init__(self, input_size: int, hidden_size: int, num_layers: int = 1,
                 bias: bool = True, *, unit_steps: int = 16, schedule: Any = None,
                 initial_state: bool = False, threads: int | None = None,
                 vocab_size: int | None = None, dtype: Any = np.float32) -> None:
        super().__init__()
        if min(input_size, hidden_size, num_layers, unit_steps) < 1:
            raise ValueError(
                f"{type(self).__name__} needs positive sizes, got input_size={input_size}, "
                f"hidden_size={hidden_size}, num_layers={num_layers}, unit_steps={unit_steps}")
        self.input_size = int(input_size)
        self.hidden_size = int(hidden_size)
        self.num_layers = int(num_layers)
        self.bias = bool(bias)
        self.unit_steps = int(unit_steps)
        self.schedule = schedule
        self.initial_state = bool(initial_state)
        self.threads = threads
        self.vocab_size = None if vocab_size is None else int(vocab_size)
        if self.vocab_size is not None and self.vocab_size < 1:
            raise ValueError(f"{type(self).__name__} needs a positive vocabulary, got "
                             f"{vocab_size}")
        self.dtype = np.dtype(dtype)
        self.num_inputs = 1 + (self.state_parts if self.initial_state else 0)
        self.retain_inputs = tuple(range(self.num_inputs))
        self.nondiff_inputs = (0,) if self.vocab_size is not None else ()

    # ----------------------------------------------------------------- declarations
    @property
    def gates(self) -> int:
        return self.gate_factor * self.hidden_size

    def units(self, steps: int) -> list[tuple[int, int]]:
        """(start, stop) of each time unit of a ``steps``-long sequence."""
        c = self.unit_steps
        return [(t, min(t + c, steps)) for t in range(0, steps, c)]

    def schedule_of(self, options: dict | None) -> Any:
        """The BPTT schedule to run: the ``"bptt"`` option a memory pass set on the step
        (``None``: keep everything), else the constructor's ``schedule``."""
        if options and "bptt" in options:
            return options["bptt"]
        return self.schedule

    def _dims(self, in_shapes: list[Shape], sched: Any = None) -> tuple[int, int]:
        """(N, T) after checking every input shape (and ``sched`` against T)."""
        shapes = [tuple(s) for s in in_shapes]
        x = shapes[0] if shapes else ()
        if self.vocab_size is not None:
            if len(x) != 2 or x[1] < 1:
                raise self.shape_error("tokens (N, T >= 1)", x)
        elif len(x) != 3 or x[2] != self.input_size or x[1] < 1:
            raise self.shape_error(f"x (N, T >= 1, {self.input_size})", x)
        n, t = x[0], x[1]
        state = (self.num_layers, n, self.hidden_size)
        for s in shapes[1:]:
            if s != state:
                raise self.shape_error(f"initial states {state}", s)
        if sched is not None:
            self._check_schedule(sched, t)
        return n, t

    def output_shapes(self, in_shapes):
        n, t = self._dims(in_shapes, self.schedule)
        return [(n, t, self.hidden_size)]

    def output_dtypes(self, in_dtypes):
        if self.vocab_size is None:
            return [np.dtype(in_dtypes[0])]
        check_integer_dtype(self, in_dtypes[0], "tokens")
        return [self.dtype]

    def _table(self, n: int, t: int) -> bool:
        """Token input through a (V, G) table ``embedding @ weight_ih_l0.T`` (a gather per
        step instead of a GEMM) when the vocabulary is no larger than the tokens."""
        return self.vocab_size is not None and self.vocab_size <= n * t

    def param_specs(self):
        h, g = self.hidden_size, self.gates
        specs = {}
        if self.vocab_size is not None:  # PyTorch's Embedding: N(0, 1)
            specs["embedding"] = ParamSpec((self.vocab_size, self.input_size), "normal")
        for k in range(self.num_layers):
            i = self.input_size if k == 0 else h
            specs[f"weight_ih_l{k}"] = ParamSpec((g, i), "uniform", fan_in=h)
            specs[f"weight_hh_l{k}"] = ParamSpec((g, h), "uniform", fan_in=h)
            if self.bias:
                specs[f"bias_ih_l{k}"] = ParamSpec((g,), "uniform", fan_in=h)
                specs[f"bias_hh_l{k}"] = ParamSpec((g,), "uniform", fan_in=h)
        return specs

    def _stash_gates(self) -> int:
        return 4 * self.hidden_size  # LSTM: [i, f, g, o]; GRU: [r, z, n, W_hn h + b_hn]

    def stash_specs(self, in_shapes, dtype, options=None):
        sched = self.schedule_of(options)
        n, t = self._dims(in_shapes, sched)
        if sched is None:
            return {name: (shape, dtype)
                    for name, shape in self._internal_shapes(n, t).items()}
        return self._scheduled_stash_specs(sched, n, dtype)

    def _unit_len(self, t: int) -> int:
        return min(self.unit_steps, t)

    def _internal_shapes(self, n: int, steps: int) -> dict[str, Shape]:
        """Time-major internals of ``steps`` steps for every layer: ``gates`` (L, steps, N,
        4H), hidden (and cell) states ``h`` (and ``c``) (L, steps+1, N, H), index b = the
        state at boundary b."""
        L, H = self.num_layers, self.hidden_size
        shapes = {"gates": (L, steps, n, 4 * H), "h": (L, steps + 1, n, H)}
        if self.state_parts == 2:
            shapes["c"] = (L, steps + 1, n, H)
        return shapes

    def _table_shape(self, n: int, t: int) -> Shape:
        """The (V, G) token table, or an empty buffer when there is none."""
        return (self.vocab_size, self.gates) if self._table(n, t) else (0,)

    def _forward_layout(self, sched: Any, n: int, t: int) -> Layout:
        if sched is None:
            return self._keep_all_forward_layout(n, t)
        return self._scheduled_forward_layout(n, t)

    def _backward_layout(self, sched: Any, n: int, t: int) -> Layout:
        """Both layouts hold ``carry`` (the carried dh and dc) and ``token_dg``."""
        if sched is None:
            return self._keep_all_backward_layout(n, t)
        return self._scheduled_backward_layout(n, t)

    def forward_workspace_bytes(self, in_shapes, dtype, options=None):
        sched = self.schedule_of(options)
        return self._forward_layout(sched, *self._dims(in_shapes, sched)).nbytes(dtype)

    def backward_workspace_bytes(self, in_shapes, dtype, options=None):
        sched = self.schedule_of(options)
        return self._backward_layout(sched, *self._dims(in_shapes, sched)).nbytes(dtype)

    def flops(self, in_shapes):
        n, t = self._dims(in_shapes)
        h, g = self.hidden_size, self.gates
        per_step = sum(2 * n * (self.input_size if k == 0 else h) * g + 2 * n * h * g
                       + 12 * n * g for k in range(self.num_layers))
        return int(per_step * t)

    def memory_attrs(self, in_shapes: list[Shape]) -> dict:
        """The time units a BPTT schedule of this op must cover."""
        return {"time_units": len(self.units(self._dims(in_shapes)[1]))}

    def recompute_flops(self, in_shapes, options=None) -> int:
        """Forward FLOPs the schedule spends again in backward (0 when everything is kept)."""
        sched = self.schedule_of(options)
        if sched is None:
            return 0
        return self._scheduled_recompute_flops(sched, in_shapes)

    def describe(self) -> str:
        extra = "" if self.bias else ", bias=False"
        if self.vocab_size is not None:
            extra += f", vocab_size={self.vocab_size}"
        sched = "" if self.schedule is None else self._describe_schedule(self.schedule)
        return (f"{type(self).__name__}({self.input_size}, {self.hidden_size}, "
                f"num_layers={self.num_layers}{extra}, unit_steps={self.unit_steps}{sched})")

    # ----------------------------------------------------------------- cell hooks
    def _step_forward(self, k, i, s, params, gates, hs, cs, gx, hw, bias) -> None:
        raise NotImplementedError

    def _step_backward(self, k, i, params, gates, hs, cs, dh, dg, dgh, carry, direct,
                       scratch) -> None:
        raise NotImplementedError

    def _prepare_bias(self, params, k, gx, bias) -> None:
        """Set ``bias`` (G,) to what the gate kernel adds to each step's ``gx`` rows."""
        raise NotImplementedError

    def _step_backward_device(self, k, i, params, gates, hs, cs, din, s, dg, dgh,
                              carry) -> None:
        """Backward of step i (local index ``s`` of the unit's incoming gradient ``din``) on
        device arrays: the carried dh is added inside the cell kernel."""
        raise NotImplementedError

    def _backprop_step(self, k, i, params, gates, hs, cs, din, s, dg, dgh, carry, direct,
                       scratch) -> None:
        """Backward of layer k's step i, ``din[s]`` being the gradient into its output from
        above; leaves the gradient into h_{i-1} (and c_{i-1}) in ``carry[k]``."""
        if is_device_array(din):
            self._step_backward_device(k, i, params, gates, hs, cs, din, s, dg, dgh, carry)
            return
        dh = din[s]
        dh += carry[k, 0]
        self._step_backward(k, i, params, gates, hs, cs, dh, dg, dgh, carry, direct, scratch)

    def _device_biases(self, params, k) -> tuple:
        """(b_ih, b_hh) of layer k for the device cell kernels ((None, None) without bias)."""
        if not self.bias:
            return None, None
        return params[f"bias_ih_l{k}"], params[f"bias_hh_l{k}"]

    def _recurrent_product(self, k, i, params, hs, hw):
        """``h_i @ W_hh.T`` of layer k into the (G, N) scratch ``hw`` seen as (N, G), on
        device arrays (row-major: the cell kernel reads it coalesced)."""
        out = hw.reshape(hw.shape[1], hw.shape[0])
        device_gemm(hs[k, i], params[f"weight_hh_l{k}"].T, out)
        return out

    # ----------------------------------------------------------------- compute
    def forward(self, ctx, inputs, outputs, params, stash, workspace) -> None:
        ensure_blas_policy()
        x, y = inputs[0], outputs[0]
        n, t = y.shape[0], y.shape[1]
        self._check_tokens(x)
        self._round_to = ctx.storage_dtype
        sched = self.schedule_of(ctx.options)
        ws = self._forward_layout(sched, n, t).carve(workspace, y.dtype)
        if sched is None:
            self._forward_keep_all(inputs, y, params, stash, ws)
        else:
            self._forward_scheduled(sched, inputs, y, params, stash, ws)

    def backward(self, ctx, grad_outputs, grad_inputs, inputs, outputs, params, grad_params,
                 stash, workspace) -> None:
        ensure_blas_policy()
        x, dy = inputs[0], grad_outputs[0]
        n, t = x.shape[0], x.shape[1]
        self._round_to = ctx.storage_dtype  # (a scheduled backward recomputes units)
        sched = self.schedule_of(ctx.options)
        ws = self._backward_layout(sched, n, t).carve(workspace, dy.dtype)
        carry, token_dg = ws.carry, ws.token_dg
        carry.fill(0)
        token_dg.fill(0)
        if (self.vocab_size is not None and not token_dg.size and "embedding" in grad_params
                and "embedding" not in ctx.accumulate):
            grad_params["embedding"].fill(0)  # scatter-added unit by unit
        accumulate = _Accumulator(grad_params, ctx.accumulate)
        if sched is None:
            self._backward_keep_all(inputs, dy, grad_inputs, params, grad_params, stash, ws,
                                    accumulate)
        else:
            self._backward_scheduled(sched, inputs, dy, grad_inputs, params, grad_params, stash,
                                     ws, accumulate)
        self._finish_tokens(params, grad_params, token_dg, ctx.accumulate)
        if self.initial_state:
            for p in range(self.state_parts):
                if grad_inputs[1 + p] is not None:
                    np.copyto(grad_inputs[1 + p], carry[:, p])


class LSTM(_Recurrent):
    """A stack of ``num_layers`` LSTM layers over a whole sequence (PyTorch's ``nn.LSTM``
    with ``batch_first=True``): input ``x`` (N, T, input_size) [, ``h0``, ``c0`` (L, N, H)
    with ``initial_state=True``], output every step's top-layer hidden state (N, T, H)."""

    cell = "lstm"
    gate_factor = 4
    state_parts = 2

    def _step_forward(self, k, i, s, params, gates, hs, cs, gx, hw, bias) -> None:
        if is_device_array(hw):
            lstm_forward_device(self._recurrent_product(k, i, params, hs, hw), gx[s],
                                *self._device_biases(params, k), cs[k, i], gates[k, i],
                                hs[k, i + 1], cs[k, i + 1], gate_major=False)
            return
        np.matmul(params[f"weight_hh_l{k}"], hs[k, i].T, out=hw)
        lstm_cell_forward(hw, gx[s], bias, cs[k, i], gates[k, i], hs[k, i + 1], cs[k, i + 1])

    def _prepare_bias(self, params, k, gx, bias) -> None:
        if is_device_array(gx):  # the device kernel adds b_ih + b_hh itself
            return
        if self.bias:  # the kernel adds b_ih + b_hh to the projection in one go
            np.add(params[f"bias_ih_l{k}"], params[f"bias_hh_l{k}"], out=bias)
        else:
            bias.fill(0)

    def _step_backward(self, k, i, params, gates, hs, cs, dh, dg, dgh, carry, direct,
                       scratch) -> None:
        # carry[k, 1] (dc of step i+1) is read, then overwritten with dc_prev (row by row)
        lstm_cell_backward(dh, carry[k, 1], gates[k, i], cs[k, i + 1], cs[k, i], dg,
                           carry[k, 1], scratch)
        np.matmul(dg, params[f"weight_hh_l{k}"], out=carry[k, 0])

    def _step_backward_device(self, k, i, params, gates, hs, cs, din, s, dg, dgh,
                              carry) -> None:
        dh_carry, dc = carry[k, 0], carry[k, 1]  # dc of step i+1 read, dc_prev written
        lstm_backward_device(din[s], dh_carry, dc, gates[k, i], cs[k, i + 1], cs[k, i], dg, dc)
        device_gemm(dg, params[f"weight_hh_l{k}"], dh_carry)


class GRU(_Recurrent):
    """A stack of ``num_layers`` GRU layers over a whole sequence (PyTorch's ``nn.GRU`` with
    ``batch_first=True``): input ``x`` (N, T, input_size) [, ``h0`` (L, N, H) with
    ``initial_state=True``], output every step's top-layer hidden state (N, T, H)."""

    cell = "gru"
    gate_factor = 3
    state_parts = 1

    def _step_forward(self, k, i, s, params, gates, hs, cs, gx, hw, bias) -> None:
        if is_device_array(hw):
            b_ih, b_hh = self._device_biases(params, k)
            gru_forward_device(gx[s], b_ih, self._recurrent_product(k, i, params, hs, hw), b_hh,
                               hs[k, i], gates[k, i], hs[k, i + 1], gate_major=False)
            return
        np.matmul(params[f"weight_hh_l{k}"], hs[k, i].T, out=hw)
        gru_cell_forward(gx[s], hw, bias, hs[k, i], gates[k, i], hs[k, i + 1])

    def _prepare_bias(self, params, k, gx, bias) -> None:
        if is_device_array(gx):  # the device kernel adds b_ih and b_hh itself
            return
        if self.bias:  # b_in sits outside r * (W_hn h + b_hn): add b_ih to the projection
            gx += params[f"bias_ih_l{k}"]
            np.copyto(bias, params[f"bias_hh_l{k}"])
        else:
            bias.fill(0)

    def _step_backward(self, k, i, params, gates, hs, cs, dh, dg, dgh, carry, direct,
                       scratch) -> None:
        gru_cell_backward(dh, gates[k, i], hs[k, i], dg, dgh, scratch)
        np.matmul(dgh, params[f"weight_hh_l{k}"], out=carry[k, 0])
        gru_add_direct(carry[k, 0], dh, gates[k, i])

    def _step_backward_device(self, k, i, params, gates, hs, cs, din, s, dg, dgh,
                              carry) -> None:
        # din[s] is read, then overwritten with this step's direct path dh * z, which the
        # kernel of step s-1 adds; the unit's first step adds it to the carry instead
        dh_carry = carry[k, 0]
        direct_in = din[s + 1] if s + 1 < din.shape[0] else None
        gru_backward_device(din[s], dh_carry, direct_in, gates[k, i], hs[k, i], dg, dgh, din[s])
        device_gemm(dgh, params[f"weight_hh_l{k}"], dh_carry)
        if s == 0:
            np.add(dh_carry, din[0], out=dh_carry)

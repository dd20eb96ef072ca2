"""LSTM and GRU over whole sequences: one node per layer stack, an internal loop over time.

The fused form of a recurrent layer (cuDNN's, oneDNN's): input ``x`` (N, T, I) batch-first,
output ``y`` (N, T, H), ``num_layers`` stacked layers with PyTorch's parameter names, layouts
and gate orders (``weight_ih_l{k}`` (G, I_k), ``weight_hh_l{k}`` (G, H), ``bias_ih_l{k}``,
``bias_hh_l{k}``; G = 4H with gates i, f, g, o for LSTM, 3H with r, z, n for GRU).

Time is cut into *units* of ``unit_steps`` steps. Per unit and layer, the input projection is
one GEMM over the unit's N*len rows, each step one recurrent GEMM and one fused Numba gate
kernel; in backward the weight gradients are one GEMM per unit (K = N*len) and the input
gradient another. Internally everything is time-major, so a unit's rows are contiguous.

Memory over time follows a *schedule* (plain data, e.g. from ``minidl.memory.bptt``):

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

from ..kernels.blas import gemm
from ..kernels.embedding import embedding_accumulate
from ..kernels.parallel import ensure_blas_policy, num_threads, run_tasks
from ..kernels.rnn import (
    gru_add_direct,
    gru_cell_backward,
    gru_cell_forward,
    lstm_cell_backward,
    lstm_cell_forward,
    workspace_bytes,
    workspace_views,
)
from .base import Layer, ParamSpec, Shape
from .embedding import check_index_range, check_integer_dtype


def _flat(buf: np.ndarray, *shape: int) -> np.ndarray:
    """The first prod(shape) elements of the contiguous ``buf`` as a C-contiguous array."""
    return buf.reshape(-1)[:int(np.prod(shape))].reshape(shape)


class _Accumulator:
    """Writes the first value of each gradient, adds the later ones (in call order); adds
    every value into the gradients named in ``adds`` (``ctx.accumulate``: micro-batches)."""

    def __init__(self, grad_params: dict, adds: frozenset[str] = frozenset()) -> None:
        self.grad_params = grad_params
        self.first = set(grad_params) - set(adds)

    def __call__(self, name: str, value: np.ndarray) -> None:
        if name not in self.grad_params:
            return
        if name in self.first:
            np.copyto(self.grad_params[name], value)
            self.first.discard(name)
        else:
            self.grad_params[name] += value


class _Recurrent(Layer):
    """Shared machinery of :class:`LSTM` and :class:`GRU` (see the module docstring)."""

    kind = "recurrent"
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

    def _dims(self, in_shapes: list[Shape]) -> tuple[int, int]:
        """(N, T) after checking every input shape."""
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
        if self.schedule is not None and self.schedule.units != len(self.units(t)):
            raise ValueError(
                f"layer {self.name or type(self).__name__}: its BPTT schedule covers "
                f"{self.schedule.units} units but T={t} makes {len(self.units(t))} units of "
                f"{self.unit_steps} steps")
        return n, t

    def output_shapes(self, in_shapes):
        n, t = self._dims(in_shapes)
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

    def stash_specs(self, in_shapes, dtype):
        n, t = self._dims(in_shapes)
        L, H = self.num_layers, self.hidden_size
        if self.schedule is None:
            return {name: (shape, dtype) for name, shape in
                    zip(("gates", "h", "c"), self._internal_shapes(n, t))}
        slots = max(1, int(self.schedule.max_stored))
        return {"states": ((slots, L, self.state_parts, n, H), dtype)}

    def _unit_len(self, t: int) -> int:
        return min(self.unit_steps, t)

    def _internal_shapes(self, n: int, steps: int) -> list[Shape]:
        """Time-major internals of ``steps`` steps for every layer: gates (L, steps, N, 4H),
        hidden (and cell) states (L, steps+1, N, H), index b = the state at boundary b."""
        L, H = self.num_layers, self.hidden_size
        shapes = [(L, steps, n, 4 * H), (L, steps + 1, n, H)]
        if self.state_parts == 2:
            shapes.append((L, steps + 1, n, H))
        return shapes

    def _scratch_shapes(self, n: int, t: int) -> list[Shape]:
        """One thread's forward scratch: layer-0 input, projection, recurrent product, bias."""
        c, G = self._unit_len(t), self.gates
        return [(c, n, self.input_size), (c, n, G), (G, n), (G,)]

    def _fwd_ws(self, n: int, t: int) -> list[Shape]:
        """Keeping everything: two threads' scratch and the token table; scheduled: one
        scratch, the token table and one unit's internals."""
        G = self.gates
        table = (self.vocab_size, G) if self._table(n, t) else (0,)
        if self.schedule is None:  # see _forward_keep_all
            c, L = self._unit_len(t), self.num_layers
            worker = [(c, n, self.input_size), (G, n)]
            return [(L, 2, c, n, G), (L, G), *worker, *worker, table]
        return self._scratch_shapes(n, t) + [table] + self._internal_shapes(n, self._unit_len(t))

    def _bwd_ws(self, n: int, t: int) -> list[Shape]:
        c, L, H, G = self._unit_len(t), self.num_layers, self.hidden_size, self.gates
        wide = max(self.input_size, H)
        table = (self.vocab_size, G) if self._table(n, t) else (0,)
        if self.schedule is None:  # the pipelined backward (see _backward_keep_all)
            worker = [(n, H), (G,), (G, wide), (G,), (c * n * wide,), (c, n, self.input_size)]
            return [
                (L, 2, c, n, G), (L, 2, c, n, G) if self.gate_factor == 3 else (0,),  # dG rings
                (L, 2, c * n * wide),  # ring of gradients into each layer's outputs
                (L, self.state_parts, n, H),  # carried dh (and dc)
                *worker, *worker,  # per worker: GRU's dh*z, dbias, GEMM, sums, dx, input rows
                table,  # token-summed dG (table)
            ]
        return self._fwd_ws(n, t) + [
            (c, n, G), (c, n, G) if self.gate_factor == 3 else (0,),  # dG; GRU: dG_hh
            (c * n * wide,), (c * n * wide,),  # gradient into this layer's / below's h
            (L, self.state_parts, n, H), (n, H),  # carried dh (and dc); GRU's dh_prev part
            (G, wide), (G,), (G,),  # weight-gradient product, bias sums, kernel scratch
            table,  # token-summed dG (table)
        ]

    def forward_workspace_bytes(self, in_shapes, dtype):
        return workspace_bytes(dtype, *self._fwd_ws(*self._dims(in_shapes)))

    def backward_workspace_bytes(self, in_shapes, dtype):
        return workspace_bytes(dtype, *self._bwd_ws(*self._dims(in_shapes)))

    def flops(self, in_shapes):
        n, t = self._dims(in_shapes)
        h, g = self.hidden_size, self.gates
        per_step = sum(2 * n * (self.input_size if k == 0 else h) * g + 2 * n * h * g
                       + 12 * n * g for k in range(self.num_layers))
        return int(per_step * t)

    def recompute_flops(self, in_shapes) -> int:
        """Forward FLOPs the schedule spends again in backward (0 when everything is kept)."""
        if self.schedule is None:
            return 0
        n, t = self._dims(in_shapes)
        extra_units = int(self.schedule.unit_forwards) - len(self.units(t))
        return int(self.flops(in_shapes) * extra_units / len(self.units(t)))

    def describe(self) -> str:
        extra = "" if self.bias else ", bias=False"
        if self.vocab_size is not None:
            extra += f", vocab_size={self.vocab_size}"
        sched = "" if self.schedule is None else (
            f", bptt={self.schedule.policy}:{self.schedule.max_stored}")
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

    # ----------------------------------------------------------------- compute
    def _store_views(self, stash, internals):
        """(gates, hs, cs): the layers' time-major internals, from the stash (everything
        kept) or the unit scratch (scheduled); ``cs`` is None for a GRU."""
        gates, hs, *rest = internals if internals is not None else (
            [stash["gates"], stash["h"]] + ([stash["c"]] if self.state_parts == 2 else []))
        return gates, hs, (rest[0] if rest else None)

    def _parts(self, hs, cs):
        return [hs] if cs is None else [hs, cs]

    def _run_unit(self, params, x, u0, u1, gates, hs, cs, xs, gx, hw, bias, table) -> None:
        """Forward of steps u0..u1-1 for every layer into one unit's internals: index 0 of
        ``hs`` / ``cs`` holds the state at boundary u0 on entry; step u0+s writes gates[s]
        and states[s+1]."""
        for k in range(self.num_layers):
            self._project(k, params, x, u0, u1, 0, hs, xs, gx, bias, table)
            for s in range(u1 - u0):
                self._step_forward(k, s, s, params, gates, hs, cs, gx, hw, bias)

    def _project(self, k, params, x, u0, u1, lo, hs, xs, gx, bias, table) -> None:
        """Layer k's input projection of steps u0..u1-1 into ``gx`` (and its ``bias``)."""
        n, m = x.shape[0], u1 - u0
        g2 = gx[:m].reshape(m * n, -1)
        if k == 0 and table.size:  # gather the rows of embedding @ weight_ih_l0.T
            np.take(table, x[:, u0:u1].T, axis=0, out=gx[:m], mode="clip")
        else:
            if k == 0:
                self._layer_input(params, x, u0, u1, xs)
                xin = xs[:m].reshape(m * n, self.input_size)
            else:
                xin = hs[k - 1, lo + 1:lo + 1 + m].reshape(m * n, self.hidden_size)
            np.matmul(xin, params[f"weight_ih_l{k}"].T, out=g2)
        self._prepare_bias(params, k, g2, bias)

    def _layer_input(self, params, x, u0, u1, xs) -> None:
        """Steps u0..u1-1 of the first layer's input, time-major, into ``xs``."""
        if self.vocab_size is not None:
            np.take(params["embedding"], x[:, u0:u1].T, axis=0, out=xs[:u1 - u0], mode="clip")
        else:
            np.copyto(xs[:u1 - u0], x[:, u0:u1].transpose(1, 0, 2))

    def _check_tokens(self, x) -> None:
        if self.vocab_size is not None:
            check_index_range(self, x, self.vocab_size, "token")

    def _make_table(self, params, table) -> None:
        if table.size:
            np.matmul(params["embedding"], params["weight_ih_l0"].T, out=table)

    def _load_initial(self, inputs, hs, cs, index: int) -> None:
        for p, arr in enumerate(self._parts(hs, cs)):
            if self.initial_state:
                np.copyto(arr[:, index], inputs[1 + p])
            else:
                arr[:, index].fill(0)

    def forward(self, ctx, inputs, outputs, params, stash, workspace) -> None:
        ensure_blas_policy()
        x, y = inputs[0], outputs[0]
        n, t = y.shape[0], y.shape[1]
        self._check_tokens(x)
        views = workspace_views(workspace, y.dtype, *self._fwd_ws(n, t))
        if self.schedule is None:
            self._forward_keep_all(inputs, y, params, stash, views)
            return
        xs, gx, hw, bias, table = views[:5]
        gates, hs, cs = self._store_views(stash, views[5:])
        self._load_initial(inputs, hs, cs, 0)
        stores = set(self.schedule.forward_stores)
        slot_of = self._slots()
        self._make_table(params, table)
        for u, (u0, u1) in enumerate(self.units(t)):
            m = u1 - u0
            self._run_unit(params, x, u0, u1, gates, hs, cs, xs, gx, hw, bias, table)
            np.copyto(y[:, u0:u1], hs[-1, 1:1 + m].transpose(1, 0, 2))
            if u + 1 in stores:
                self._save_state(stash["states"], slot_of[("fwd", u + 1)], hs, cs, m)
            self._move(hs, cs, m, 0)  # the unit's end state starts the next unit

    # ----------------------------------------------------------------- keep-all, pipelined
    def _lanes(self) -> int:
        """Threads of the pipelined paths (1: everything on the calling thread)."""
        return max(1, min(2, self.threads if self.threads is not None else num_threads()))

    def _forward_keep_all(self, inputs, y, params, stash, views) -> None:
        """Everything kept: per layer and unit a projection task and a recurrence task, on two
        workers (single-threaded BLAS each) by list scheduling: layer k runs about one unit
        behind layer k-1 (a wavefront); projections fill the gaps."""
        x = inputs[0]
        t, L = y.shape[1], self.num_layers
        gx_ring, bias, table = views[0], views[1], views[-1]
        per_worker = (views[2:4], views[4:6])  # layer-0 input rows, recurrent product
        gates, hs, cs = self._store_views(stash, None)
        self._load_initial(inputs, hs, cs, 0)
        units = self.units(t)
        U = len(units)
        self._make_table(params, table)

        def proj(k: int, u: int):
            def run(wid: int) -> None:
                self._project(k, params, x, *units[u], units[u][0], hs, per_worker[wid][0],
                              gx_ring[k, u % 2], bias[k], table)
            return run

        def rec(k: int, u: int):
            def run(wid: int) -> None:
                u0, u1 = units[u]
                hw, gx = per_worker[wid][1], gx_ring[k, u % 2]
                for s in range(u1 - u0):
                    self._step_forward(k, u0 + s, s, params, gates, hs, cs, gx, hw, bias[k])
                if k == L - 1:
                    np.copyto(y[:, u0:u1], hs[-1, u0 + 1:u1 + 1].transpose(1, 0, 2))
            return run

        tasks = []
        for w in range(U + L - 1):
            for k in range(L):
                u = w - k
                if 0 <= u < U:  # the projection's ring slot is free once unit u-2 ran
                    tasks.append((("p", k, u), ([("r", k - 1, u)] if k > 0 else []) + (
                        [("r", k, u - 2)] if u > 1 else []), proj(k, u)))
                    tasks.append((("r", k, u), [("p", k, u)] + (
                        [("r", k, u - 1)] if u > 0 else []), rec(k, u)))
        run_tasks(tasks, self._lanes())

    def _backward_keep_all(self, inputs, dy, grad_inputs, params, grad_params, stash, views,
                           accumulate) -> None:
        """Everything kept: the calling thread runs the recurrences (layer k one unit behind
        layer k+1), a second thread the unit GEMMs (input gradients first: the layer below
        waits for them; then weight gradients, in unit order per weight)."""
        x = inputs[0]
        n, t = x.shape[0], x.shape[1]
        L, H, G = self.num_layers, self.hidden_size, self.gates
        dg_ring, dgh_ring, din_ring, carry = views[:4]
        per_worker = (views[4:10], views[10:16])  # direct, dbias, prod, colsum, dxbuf, xs
        token_dg = views[16]
        gru = self.gate_factor == 3
        gates, hs, cs = self._store_views(stash, None)
        units = self.units(t)
        U = len(units)

        def din_of(k: int, u: int) -> np.ndarray:
            m = units[u][1] - units[u][0]
            return _flat(din_ring[k, u % 2], m, n, H)

        def rec(k: int, u: int):
            def run(wid: int) -> None:
                direct, scratch_db = per_worker[wid][:2]
                u0, u1 = units[u]
                m = u1 - u0
                din = din_of(k, u)
                if k == L - 1:
                    np.copyto(din, dy[:, u0:u1].transpose(1, 0, 2))
                dg, dgh = dg_ring[k, u % 2, :m], (dgh_ring if gru else dg_ring)[k, u % 2, :m]
                for s in range(m - 1, -1, -1):
                    dh = din[s]
                    dh += carry[k, 0]
                    self._step_backward(k, u0 + s, params, gates, hs, cs, dh, dg[s], dgh[s],
                                        carry, direct, scratch_db)
            return run

        def dx(k: int, u: int):  # gradient into layer k-1's outputs of unit u
            def run(wid: int) -> None:
                u0, u1 = units[u]
                rows = (u1 - u0) * n
                np.matmul(dg_ring[k, u % 2, :u1 - u0].reshape(rows, G),
                          params[f"weight_ih_l{k}"], out=din_of(k - 1, u).reshape(rows, H))
            return run

        def dgs(k: int, u: int) -> tuple[np.ndarray, np.ndarray]:
            """Unit u's (dG, dG_hh) rows of layer k."""
            rows = (units[u][1] - units[u][0]) * n
            return (dg_ring[k, u % 2].reshape(-1, G)[:rows],
                    (dgh_ring if gru else dg_ring)[k, u % 2].reshape(-1, G)[:rows])

        def whh(k: int, u: int):
            def run(wid: int) -> None:
                u0, u1 = units[u]
                self._grad_w_hh(k, dgs(k, u)[1], hs[k, u0:u1], per_worker[wid][2], accumulate)
            return run

        def wgrad(k: int, u: int):  # W_ih, biases, layer 0's input gradient
            def run(wid: int) -> None:
                prod, colsum, dxbuf, xs = per_worker[wid][2:]
                u0, u1 = units[u]
                dg2, dgh2 = dgs(k, u)
                self._grad_w_ih_and_biases(k, params, x, u0, u1, u0, hs, dg2, dgh2, prod,
                                           colsum, xs, token_dg, accumulate)
                if k == 0:
                    self._input_gradient(params, x, grad_inputs, grad_params, u0, u1, dg2,
                                         dxbuf, token_dg)
            return run

        tasks, later = [], []
        for w in range(U + L - 1):
            for k in range(L - 1, -1, -1):
                u = U - 1 - (w - (L - 1 - k))
                if not 0 <= u < U:
                    continue
                deps = [("dx", k + 1, u)] if k < L - 1 else []
                if u + 1 < U:
                    deps.append(("rec", k, u + 1))  # the carried dh, dc
                if u + 2 < U:  # the dG and input-gradient ring slots are free again
                    deps += [("w", k, u + 2), ("whh", k, u + 2)] + (
                        [("dx", k, u + 2)] if k > 0 else [])
                tasks.append((("rec", k, u), deps, rec(k, u)))
                if k > 0:  # writes the ring slot layer k-1's unit u+2 read
                    tasks.append((("dx", k, u), [("rec", k, u)] + (
                        [("rec", k - 1, u + 2)] if u + 2 < U else []), dx(k, u)))
                # weight gradients add up in unit order; short tasks keep a worker free soon
                for name, fn in (("whh", whh), ("w", wgrad)):
                    later.append(((name, k, u), [("rec", k, u)] + (
                        [(name, k, u + 1)] if u + 1 < U else []), fn(k, u)))
        # the recurrences and the input gradients they wait for are the critical path: a free
        # worker takes them first, weight gradients fill the gaps
        run_tasks(tasks + later, self._lanes())

    def _grad_w_hh(self, k, dgh2, hprev, prod, accumulate) -> None:
        """Add one unit's ``dG_hh^T h_prev`` to layer k's ``weight_hh`` gradient."""
        dw = _flat(prod, self.gates, self.hidden_size)
        np.matmul(dgh2.T, hprev.reshape(dgh2.shape[0], self.hidden_size), out=dw)
        accumulate(f"weight_hh_l{k}", dw)

    def _grad_w_ih_and_biases(self, k, params, x, u0, u1, lo, hs, dg2, dgh2, prod, colsum, xs,
                              token_dg, accumulate) -> None:
        """Add steps u0..u1-1 (local index ``lo``) to layer k's ``weight_ih`` gradient (for
        tokens through the table: dG summed per token) and bias gradients."""
        m, rows = u1 - u0, dg2.shape[0]
        if k == 0 and token_dg.size:
            embedding_accumulate(x[:, u0:u1].T.reshape(-1), dg2, token_dg)
        else:
            if k == 0:
                self._layer_input(params, x, u0, u1, xs)
                xin = xs[:m].reshape(rows, self.input_size)
            else:
                xin = hs[k - 1, lo + 1:lo + 1 + m].reshape(rows, self.hidden_size)
            dw = _flat(prod, self.gates, xin.shape[1])
            np.matmul(dg2.T, xin, out=dw)
            accumulate(f"weight_ih_l{k}", dw)
        if self.bias:
            np.sum(dg2, axis=0, out=colsum)
            accumulate(f"bias_ih_l{k}", colsum)
            if self.gate_factor == 3:  # GRU: b_hh gets the recurrent gradient
                np.sum(dgh2, axis=0, out=colsum)
            accumulate(f"bias_hh_l{k}", colsum)

    def _input_gradient(self, params, x, grad_inputs, grad_params, u0, u1, dg2, dxbuf,
                        token_dg) -> None:
        """Layer 0's input gradient of steps u0..u1-1 from its dG rows: into ``grad x``, or
        (tokens without the table) scatter-added into the embedding's gradient."""
        n, I = x.shape[0], self.input_size
        m, rows = u1 - u0, (u1 - u0) * x.shape[0]
        if self.vocab_size is not None:
            if not token_dg.size and "embedding" in grad_params:
                d = _flat(dxbuf, rows, I)
                np.matmul(dg2, params["weight_ih_l0"], out=d)
                embedding_accumulate(x[:, u0:u1].T.reshape(-1), d, grad_params["embedding"])
        elif grad_inputs[0] is not None:
            d = _flat(dxbuf, rows, I)
            np.matmul(dg2, params["weight_ih_l0"], out=d)
            np.copyto(grad_inputs[0][:, u0:u1], d.reshape(m, n, I).transpose(1, 0, 2))

    def _finish_tokens(self, params, grad_params, token_dg, adds: frozenset[str]) -> None:
        """dW_ih0 = S^T E and d embedding = S W_ih0, S being dG summed per token (table);
        added into the gradients named in ``adds``."""
        if not token_dg.size:
            return
        for name, a, b, trans_a in (("weight_ih_l0", token_dg, params["embedding"], True),
                                    ("embedding", token_dg, params["weight_ih_l0"], False)):
            if name not in grad_params:
                continue
            if name in adds:
                gemm(a, b, grad_params[name], trans_a=trans_a, beta=1.0)
            else:
                np.matmul(a.T if trans_a else a, b, out=grad_params[name])

    def _move(self, hs, cs, src: int, dst: int) -> None:
        for arr in self._parts(hs, cs):
            np.copyto(arr[:, dst], arr[:, src])

    def _save_state(self, store, slot, hs, cs, index) -> None:
        for p, arr in enumerate(self._parts(hs, cs)):
            np.copyto(store[slot, :, p], arr[:, index])

    def _load_state(self, store, slot, hs, cs) -> None:
        for p, arr in enumerate(self._parts(hs, cs)):
            np.copyto(arr[:, 0], store[slot, :, p])

    def _slots(self) -> dict[tuple[str, int], int]:
        """Slot of every stored boundary: keys ("fwd", b) for forward stores and ("op", i)
        for the i-th backward op's store; a slot frees when its boundary is backpropagated."""
        free = list(range(max(1, int(self.schedule.max_stored))))[::-1]
        held: dict[int, int] = {}
        out: dict[tuple[str, int], int] = {}
        for b in self.schedule.forward_stores:
            held[b] = out[("fwd", b)] = free.pop()
        for i, (op, a, b) in enumerate(self.schedule.ops):
            if op == "advance":
                held[b] = out[("op", i)] = free.pop()
            elif a in held:
                free.append(held.pop(a))
        return out

    def backward(self, ctx, grad_outputs, grad_inputs, inputs, outputs, params, grad_params,
                 stash, workspace) -> None:
        ensure_blas_policy()
        x, dy = inputs[0], grad_outputs[0]
        n, t = x.shape[0], x.shape[1]
        views = workspace_views(workspace, dy.dtype, *self._bwd_ws(n, t))
        keep_all = self.schedule is None
        carry = views[3] if keep_all else views[len(self._fwd_ws(n, t)) + 4]
        token_dg = views[-1]  # both layouts end with it
        carry.fill(0)
        token_dg.fill(0)
        if (self.vocab_size is not None and not token_dg.size and "embedding" in grad_params
                and "embedding" not in ctx.accumulate):
            grad_params["embedding"].fill(0)  # scatter-added unit by unit
        accumulate = _Accumulator(grad_params, ctx.accumulate)
        if keep_all:
            self._backward_keep_all(inputs, dy, grad_inputs, params, grad_params, stash, views,
                                    accumulate)
        else:
            self._backward_scheduled(inputs, dy, grad_inputs, params, grad_params, stash, views,
                                     accumulate)
        self._finish_tokens(params, grad_params, token_dg, ctx.accumulate)
        if self.initial_state:
            for p in range(self.state_parts):
                if grad_inputs[1 + p] is not None:
                    np.copyto(grad_inputs[1 + p], carry[:, p])

    def _backward_scheduled(self, inputs, dy, grad_inputs, params, grad_params, stash, views,
                            accumulate) -> None:
        """Replay the schedule's ops unit by unit."""
        x = inputs[0]
        n, t = x.shape[0], x.shape[1]
        nf = len(self._fwd_ws(n, t))
        xs, gx, hw, bias, table = views[:5]
        gates, hs, cs = self._store_views(stash, views[5:nf])
        work = views[nf:]
        units = self.units(t)
        store = stash["states"]
        slot_of = self._slots()
        held = {b: slot_of[("fwd", b)] for b in self.schedule.forward_stores}
        self._make_table(params, table)
        for i, (op, a, b) in enumerate(self.schedule.ops):
            if a == 0:
                self._load_initial(inputs, hs, cs, 0)
            else:
                self._load_state(store, held[a], hs, cs)
            if op == "advance":
                for u in range(a, b):
                    if u > a:
                        self._move(hs, cs, units[u - 1][1] - units[u - 1][0], 0)
                    self._run_unit(params, x, *units[u], gates, hs, cs, xs, gx, hw, bias,
                                   table)
                held[b] = slot_of[("op", i)]
                self._save_state(store, held[b], hs, cs, units[b - 1][1] - units[b - 1][0])
            else:  # recompute unit a's internals from the state at boundary a, then back
                u0, u1 = units[a]
                self._run_unit(params, x, u0, u1, gates, hs, cs, xs, gx, hw, bias, table)
                self._backprop_unit(params, x, dy, grad_inputs, grad_params, u0, u1 - u0,
                                    gates, hs, cs, xs, work, accumulate)
                held.pop(a, None)

    def _backprop_unit(self, params, x, dy, grad_inputs, grad_params, u0, m, gates, hs, cs,
                       xs, work, accumulate) -> None:
        """Backward of steps u0..u0+m-1 (local indices 0..m-1) through every layer."""
        dg_buf, dgh_buf, din_buf, dlow_buf, carry, direct, prod, colsum, scratch, token_dg = work
        n, H, G = x.shape[0], self.hidden_size, self.gates
        rows = m * n
        din = _flat(din_buf, m, n, H)
        np.copyto(din, dy[:, u0:u0 + m].transpose(1, 0, 2))
        dg = dg_buf[:m]
        dgh = dgh_buf[:m] if self.gate_factor == 3 else dg
        dg2, dgh2 = dg.reshape(rows, G), dgh.reshape(rows, G)
        for k in range(self.num_layers - 1, -1, -1):
            for s in range(m - 1, -1, -1):
                dh = din[s]
                dh += carry[k, 0]
                self._step_backward(k, s, params, gates, hs, cs, dh, dg[s], dgh[s], carry,
                                    direct, scratch)
            self._grad_w_hh(k, dgh2, hs[k, :m], prod, accumulate)
            self._grad_w_ih_and_biases(k, params, x, u0, u0 + m, 0, hs, dg2, dgh2, prod, colsum,
                                       xs, token_dg, accumulate)
            if k > 0:
                low = _flat(dlow_buf, m, n, H)
                np.matmul(dg2, params[f"weight_ih_l{k}"], out=low.reshape(rows, H))
                din_buf, dlow_buf = dlow_buf, din_buf
                din = low
            else:
                self._input_gradient(params, x, grad_inputs, grad_params, u0, u0 + m, dg2,
                                     dlow_buf, token_dg)


class LSTM(_Recurrent):
    """A stack of ``num_layers`` LSTM layers over a whole sequence (PyTorch's ``nn.LSTM``
    with ``batch_first=True``): input ``x`` (N, T, input_size) [, ``h0``, ``c0`` (L, N, H)
    with ``initial_state=True``], output every step's top-layer hidden state (N, T, H)."""

    cell = "lstm"
    gate_factor = 4
    state_parts = 2

    def _step_forward(self, k, i, s, params, gates, hs, cs, gx, hw, bias) -> None:
        np.matmul(params[f"weight_hh_l{k}"], hs[k, i].T, out=hw)
        lstm_cell_forward(hw, gx[s], bias, cs[k, i], gates[k, i], hs[k, i + 1], cs[k, i + 1])

    def _prepare_bias(self, params, k, gx, bias) -> None:
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


class GRU(_Recurrent):
    """A stack of ``num_layers`` GRU layers over a whole sequence (PyTorch's ``nn.GRU`` with
    ``batch_first=True``): input ``x`` (N, T, input_size) [, ``h0`` (L, N, H) with
    ``initial_state=True``], output every step's top-layer hidden state (N, T, H)."""

    cell = "gru"
    gate_factor = 3
    state_parts = 1

    def _step_forward(self, k, i, s, params, gates, hs, cs, gx, hw, bias) -> None:
        np.matmul(params[f"weight_hh_l{k}"], hs[k, i].T, out=hw)
        gru_cell_forward(gx[s], hw, bias, hs[k, i], gates[k, i], hs[k, i + 1])

    def _prepare_bias(self, params, k, gx, bias) -> None:
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

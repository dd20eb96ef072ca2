"""The keep-everything path of the fused recurrent layers: every unit's internals stay in the
stash from forward to backward, and the work per (layer, unit) runs as tasks on two workers."""

from __future__ import annotations

import numpy as np

from ...kernels.parallel import critical_path_order, num_threads, run_tasks
from ...kernels.workspace import Layout
from .units import _flat


class _KeepAllPath:
    """Forward and backward with ``schedule=None`` (a mixin of
    :class:`~minidl.layers.recurrent.fused._Recurrent`)."""

    #: Order the tasks by their longest path to the end, each task's duration the least
    #: measured at the earlier calls of the same shapes (list scheduling's HLFET priority;
    #: the least, since a task the machine preempted once would otherwise reorder the next
    #: call; the first call keeps the wavefront order). The order never changes the bits.
    critical_path_first = True

    def _run_lane_tasks(self, phase: str, x, tasks: list) -> None:
        """``run_tasks`` on the layer's lanes, in critical-path order once durations of the
        same phase and shapes were measured (kept per layer: the last few shapes)."""
        memo = self.__dict__.setdefault("_lane_durations", {})
        key = (phase, *x.shape[:2])
        known = memo.pop(key, None)  # re-inserted last: the dict stays in use order
        if known is not None and self.critical_path_first:
            tasks = critical_path_order(tasks, known)
        measured: dict = {}
        run_tasks(tasks, self._lanes(x), measured)
        if known is not None:
            measured = {k: min(v, known.get(k, v)) for k, v in measured.items()}
        memo[key] = measured
        while len(memo) > 8:
            del memo[next(iter(memo))]

    def _lanes(self, x) -> int:
        """Threads of the pipelined paths (1: everything on the calling thread). Device arrays
        take 1: a device library queues each thread's work on that thread's current stream
        (CuPy's is per thread), so other threads would leave the step's stream, and the device
        runs the queued work in order anyway."""
        if type(x) is not np.ndarray:
            return 1
        return max(1, min(2, self.threads if self.threads is not None else num_threads()))

    def _keep_all_forward_layout(self, n: int, t: int) -> Layout:
        """Projection ring (two units per layer), per-layer bias, two workers' scratch
        (layer-0 input rows, recurrent product) and the token table."""
        c, L, G = self._unit_len(t), self.num_layers, self.gates
        worker = Layout.of(xs=(c, n, self.input_size), hw=(G, n))
        return Layout.of(gx_ring=(L, 2, c, n, G), bias=(L, G), worker=(worker, worker),
                         table=self._table_shape(n, t))

    def _keep_all_backward_layout(self, n: int, t: int) -> Layout:
        """dG rings (GRU: and dG_hh), the ring of gradients into each layer's outputs, the
        carried dh (and dc), two workers' scratch and the token-summed dG (table)."""
        c, L, H, G = self._unit_len(t), self.num_layers, self.hidden_size, self.gates
        wide = max(self.input_size, H)
        worker = Layout.of(
            direct=(n, H), dbias=(G,),  # GRU's dh*z part; the cell kernel's bias sums
            prod=(G, wide), colsum=(G,),  # weight-gradient product, bias-gradient sums
            dx=(c * n * wide,), xs=(c, n, self.input_size))  # input gradient, input rows
        return Layout.of(
            dg_ring=(L, 2, c, n, G), dgh_ring=(L, 2, c, n, G) if self.gate_factor == 3 else (0,),
            din_ring=(L, 2, c * n * wide), carry=(L, self.state_parts, n, H),
            worker=(worker, worker), token_dg=self._table_shape(n, t))

    def _forward_keep_all(self, inputs, y, params, stash, ws) -> None:
        """Everything kept: per layer, unit and projection piece (:meth:`_pieces`) a
        projection task and a recurrence task, on two workers (single-threaded BLAS each) by
        list scheduling: layer k runs about one piece behind layer k-1 (a wavefront);
        projections fill the gaps."""
        x = inputs[0]
        t, L = y.shape[1], self.num_layers
        gx_ring, bias, table, workers = ws.gx_ring, ws.bias, ws.table, ws.worker
        gates, hs, cs = self._internals(stash)
        self._load_initial(inputs, hs, cs, 0)
        units = self.units(t)
        U = len(units)
        self._make_table(params, table)

        pieces = [self._pieces(u0, u1, t) for u0, u1 in units]

        def proj(k: int, u: int, j: int):
            def run(wid: int) -> None:
                self._project(k, params, x, *units[u], units[u][0], hs, workers[wid].xs,
                              gx_ring[k, u % 2], bias[k], table, pieces[u][j:j + 1])
            return run

        def rec(k: int, u: int, j: int):
            def run(wid: int) -> None:
                u0 = units[u][0]
                a, b = pieces[u][j]
                hw, gx = workers[wid].hw, gx_ring[k, u % 2]
                for s in range(a, b):
                    self._step_forward(k, u0 + s, s, params, gates, hs, cs, gx, hw, bias[k])
                    self._round_step(k, u0 + s, gates, hs, cs)
                if k == L - 1:
                    np.copyto(y[:, u0 + a:u0 + b], hs[-1, u0 + a + 1:u0 + b + 1].transpose(1, 0, 2))
            return run

        def last(k: int, u: int) -> tuple:
            return ("r", k, u, len(pieces[u]) - 1)

        tasks = []
        for w in range(U + L - 1):
            for k in range(L):
                u = w - k
                if not 0 <= u < U:
                    continue
                for j in range(len(pieces[u])):
                    # the projection's ring slot is free once unit u-2 ran
                    tasks.append((("p", k, u, j), ([("r", k - 1, u, j)] if k > 0 else []) + (
                        [last(k, u - 2)] if u > 1 else []), proj(k, u, j)))
                    before = ("r", k, u, j - 1) if j > 0 else (last(k, u - 1) if u > 0 else None)
                    tasks.append((("r", k, u, j), [("p", k, u, j)] + (
                        [before] if before is not None else []), rec(k, u, j)))
        self._run_lane_tasks("forward", x, tasks)

    def _backward_keep_all(self, inputs, dy, grad_inputs, params, grad_params, stash, ws,
                           accumulate) -> None:
        """Everything kept: the calling thread runs the recurrences (layer k one unit behind
        layer k+1), a second thread the unit GEMMs (input gradients first: the layer below
        waits for them; then weight gradients, in unit order per weight)."""
        work = _KeepAllBackward(self, inputs, dy, grad_inputs, params, grad_params, stash, ws,
                                accumulate)
        # the recurrences and the input gradients they wait for are the critical path: a free
        # worker takes them first, weight gradients fill the gaps
        self._run_lane_tasks("backward", work.x, work.tasks())


def _done(k: int, u: int) -> tuple:
    """The task whose end finishes unit ``u`` of layer ``k`` backward (its first piece's
    recurrence: the pieces run last to first)."""
    return ("rec", k, u, 0)


class _KeepAllBackward:
    """One keep-everything backward as tasks: per layer ``k``, unit ``u`` and piece ``j`` the
    recurrence (``rec``) and the gradient into layer k-1's outputs (``dx``); per unit the
    weight gradients (``whh``; ``w``: W_ih, biases and layer 0's input gradient). The dG and
    input-gradient rings hold two units per layer."""

    def __init__(self, layer, inputs, dy, grad_inputs, params, grad_params, stash, ws,
                 accumulate) -> None:
        self.layer, self.dy, self.params, self.accumulate = layer, dy, params, accumulate
        self.grad_inputs, self.grad_params = grad_inputs, grad_params
        self.x = x = inputs[0]
        self.n, t = x.shape[0], x.shape[1]
        self.L, self.H, self.G = layer.num_layers, layer.hidden_size, layer.gates
        self.dg_ring, self.din_ring, self.carry = ws.dg_ring, ws.din_ring, ws.carry
        self.workers, self.token_dg = ws.worker, ws.token_dg
        # (GRU: dG_hh has its own ring; the other cells read dG for it)
        self.dgh_ring = ws.dgh_ring if layer.gate_factor == 3 else ws.dg_ring
        self.gates, self.hs, self.cs = layer._internals(stash)
        self.units = layer.units(t)
        self.pieces = [layer._pieces(u0, u1, t) for u0, u1 in self.units]

    def din_of(self, k: int, u: int) -> np.ndarray:
        """The gradients into layer k's outputs over unit u (its ring slot)."""
        m = self.units[u][1] - self.units[u][0]
        return _flat(self.din_ring[k, u % 2], m, self.n, self.H)

    def dgs(self, k: int, u: int) -> tuple[np.ndarray, np.ndarray]:
        """Unit u's (dG, dG_hh) rows of layer k."""
        rows = (self.units[u][1] - self.units[u][0]) * self.n
        return (self.dg_ring[k, u % 2].reshape(-1, self.G)[:rows],
                self.dgh_ring[k, u % 2].reshape(-1, self.G)[:rows])

    # ------------------------------------------------------------------ task bodies
    def rec(self, k: int, u: int, j: int):
        """The steps of piece j, last to first."""
        layer = self.layer

        def run(wid: int) -> None:
            direct, scratch_db = self.workers[wid].direct, self.workers[wid].dbias
            u0, u1 = self.units[u]
            m = u1 - u0
            a, b = self.pieces[u][j]
            din = self.din_of(k, u)
            if k == self.L - 1:
                np.copyto(din[a:b], self.dy[:, u0 + a:u0 + b].transpose(1, 0, 2))
            dg, dgh = self.dg_ring[k, u % 2, :m], self.dgh_ring[k, u % 2, :m]
            params, gates, hs, cs, carry = self.params, self.gates, self.hs, self.cs, self.carry
            for s in range(b - 1, a - 1, -1):
                layer._backprop_step(k, u0 + s, params, gates, hs, cs, din, s, dg[s], dgh[s],
                                     carry, direct, scratch_db)
        return run

    def dx(self, k: int, u: int, j: int):
        """The gradient into layer k-1's outputs of piece j."""
        def run(wid: int) -> None:
            m = self.units[u][1] - self.units[u][0]
            self.layer._grad_into_lower(k, self.params, self.dg_ring[k, u % 2, :m],
                                        self.din_of(k - 1, u), self.pieces[u][j:j + 1])
        return run

    def whh(self, k: int, u: int):
        def run(wid: int) -> None:
            u0, u1 = self.units[u]
            self.layer._grad_w_hh(k, self.dgs(k, u)[1], self.hs[k, u0:u1],
                                  self.workers[wid].prod, self.accumulate)
        return run

    def wgrad(self, k: int, u: int):
        """W_ih, biases, layer 0's input gradient."""
        def run(wid: int) -> None:
            wk = self.workers[wid]
            prod, colsum, dxbuf, xs = wk.prod, wk.colsum, wk.dx, wk.xs
            u0, u1 = self.units[u]
            dg2, dgh2 = self.dgs(k, u)
            self.layer._grad_w_ih_and_biases(k, self.params, self.x, u0, u1, u0, self.hs, dg2,
                                             dgh2, prod, colsum, xs, self.token_dg,
                                             self.accumulate)
            if k == 0:
                self.layer._input_gradient(self.params, self.x, self.grad_inputs,
                                           self.grad_params, u0, u1, dg2, dxbuf, self.token_dg)
        return run

    # ------------------------------------------------------------------ the task graph
    def rec_deps(self, k: int, u: int, j: int) -> list:
        """What the recurrence of piece j waits for: the gradient from the layer above, the
        carried dh (and dc) of the piece after it, and the ring slots it writes being free
        (unit u+2's weight and input gradients read them)."""
        U, last = len(self.units), len(self.pieces[u]) - 1
        deps = [("dx", k + 1, u, j)] if k < self.L - 1 else []
        if j < last:
            deps.append(("rec", k, u, j + 1))  # the carried dh, dc
        elif u + 1 < U:
            deps.append(_done(k, u + 1))
        if j == last and u + 2 < U:  # the dG and input-gradient slots are free
            deps += [("w", k, u + 2), ("whh", k, u + 2)] + (
                [("dx", k, u + 2, i) for i in range(len(self.pieces[u + 2]))]
                if k > 0 else [])
        return deps

    def unit_tasks(self, k: int, u: int) -> list:
        """Unit u of layer k's recurrences and gradients into the layer below, last piece
        first."""
        U = len(self.units)
        out = []
        for j in range(len(self.pieces[u]) - 1, -1, -1):
            out.append((("rec", k, u, j), self.rec_deps(k, u, j), self.rec(k, u, j)))
            if k > 0:  # writes the ring slot layer k-1's unit u+2 read
                out.append((("dx", k, u, j), [("rec", k, u, j)] + (
                    [_done(k - 1, u + 2)] if u + 2 < U else []), self.dx(k, u, j)))
        return out

    def tasks(self) -> list:
        """Every task, by wavefront (layer k one unit behind layer k+1): the recurrences and
        input gradients first, then the weight gradients (added up in unit order; short
        tasks keep a worker free soon)."""
        U, L = len(self.units), self.L
        tasks, later = [], []
        for w in range(U + L - 1):
            for k in range(L - 1, -1, -1):
                u = U - 1 - (w - (L - 1 - k))
                if not 0 <= u < U:
                    continue
                tasks += self.unit_tasks(k, u)
                for name, fn in (("whh", self.whh), ("w", self.wgrad)):
                    later.append(((name, k, u), [_done(k, u)] + (
                        [(name, k, u + 1)] if u + 1 < U else []), fn(k, u)))
        return tasks + later

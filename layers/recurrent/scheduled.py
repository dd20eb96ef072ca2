"""The scheduled path of the fused recurrent layers: forward keeps the hidden (and cell) states
at the schedule's boundaries only, backward replays the schedule's ops unit by unit. Everything
the layers know about BPTT schedules is here."""

from __future__ import annotations

import numpy as np

from ...kernels.workspace import Layout
from .units import _flat


class _ScheduledPath:
    """Forward and backward under a BPTT schedule (a mixin of
    :class:`~minidl.layers.recurrent.fused._Recurrent`)."""

    def _check_schedule(self, sched, t: int) -> None:
        if sched.units != len(self.units(t)):
            raise ValueError(
                f"layer {self.name or type(self).__name__}: its BPTT schedule covers "
                f"{sched.units} units but T={t} makes {len(self.units(t))} units of "
                f"{self.unit_steps} steps")

    def _scheduled_stash_specs(self, sched, n: int, dtype) -> dict:
        """The stored boundary states, ``max_stored`` slots of (L, state parts, N, H)."""
        slots = max(1, int(sched.max_stored))
        shape = (slots, self.num_layers, self.state_parts, n, self.hidden_size)
        return {"states": (shape, dtype)}

    def _scheduled_recompute_flops(self, sched, in_shapes) -> int:
        n, t = self._dims(in_shapes, sched)
        extra_units = int(sched.unit_forwards) - len(self.units(t))
        return int(self.flops(in_shapes) * extra_units / len(self.units(t)))

    def _describe_schedule(self, sched) -> str:
        return f", bptt={sched.policy}:{sched.max_stored}"

    def _scheduled_forward_layout(self, n: int, t: int) -> Layout:
        """One thread's scratch (layer-0 input rows, projection, recurrent product, bias),
        the token table and one unit's internals (``unit``: gates, h and c)."""
        c, G = self._unit_len(t), self.gates
        return Layout.of(xs=(c, n, self.input_size), gx=(c, n, G), hw=(G, n), bias=(G,),
                         table=self._table_shape(n, t),
                         unit=Layout.of(**self._internal_shapes(n, c)))

    def _scheduled_backward_layout(self, n: int, t: int) -> Layout:
        """The forward layout (backward recomputes units), then one unit's backward buffers
        and the token-summed dG (table)."""
        c, L, H, G = self._unit_len(t), self.num_layers, self.hidden_size, self.gates
        wide = max(self.input_size, H)
        return Layout.of(
            forward=self._scheduled_forward_layout(n, t),
            dg=(c, n, G), dgh=(c, n, G) if self.gate_factor == 3 else (0,),  # GRU: dG_hh
            din=(c * n * wide,), dlow=(c * n * wide,),  # into this layer's / below's h
            carry=(L, self.state_parts, n, H), direct=(n, H),  # dh (and dc); GRU's dh*z
            prod=(G, wide), colsum=(G,), dbias=(G,),  # weight-gradient product, bias sums,
            token_dg=self._table_shape(n, t))  # the cell kernel's bias sums; dG per token

    def _forward_scheduled(self, sched, inputs, y, params, stash, ws) -> None:
        """Unit by unit, storing the states at the schedule's forward boundaries."""
        x = inputs[0]
        t = y.shape[1]
        xs, gx, hw, bias, table = ws.xs, ws.gx, ws.hw, ws.bias, ws.table
        gates, hs, cs = self._internals(ws.unit)
        self._load_initial(inputs, hs, cs, 0)
        stores = set(sched.forward_stores)
        slot_of = self._slots(sched)
        self._make_table(params, table)
        for u, (u0, u1) in enumerate(self.units(t)):
            m = u1 - u0
            self._run_unit(params, x, u0, u1, gates, hs, cs, xs, gx, hw, bias, table)
            np.copyto(y[:, u0:u1], hs[-1, 1:1 + m].transpose(1, 0, 2))
            if u + 1 in stores:
                self._save_state(stash["states"], slot_of[("fwd", u + 1)], hs, cs, m)
            self._move(hs, cs, m, 0)  # the unit's end state starts the next unit

    def _move(self, hs, cs, src: int, dst: int) -> None:
        for arr in self._parts(hs, cs):
            np.copyto(arr[:, dst], arr[:, src])

    def _save_state(self, store, slot, hs, cs, index) -> None:
        for p, arr in enumerate(self._parts(hs, cs)):
            np.copyto(store[slot, :, p], arr[:, index])

    def _load_state(self, store, slot, hs, cs) -> None:
        for p, arr in enumerate(self._parts(hs, cs)):
            np.copyto(arr[:, 0], store[slot, :, p])

    def _slots(self, sched) -> dict[tuple[str, int], int]:
        """Slot of every stored boundary: keys ("fwd", b) for forward stores and ("op", i)
        for the i-th backward op's store; a slot frees when its boundary is backpropagated."""
        free = list(range(max(1, int(sched.max_stored))))[::-1]
        held: dict[int, int] = {}
        out: dict[tuple[str, int], int] = {}
        for b in sched.forward_stores:
            held[b] = out[("fwd", b)] = free.pop()
        for i, (op, a, b) in enumerate(sched.ops):
            if op == "advance":
                held[b] = out[("op", i)] = free.pop()
            elif a in held:
                free.append(held.pop(a))
        return out

    def _backward_scheduled(self, sched, inputs, dy, grad_inputs, params, grad_params, stash,
                            ws, accumulate) -> None:
        """Replay the schedule's ops unit by unit."""
        x = inputs[0]
        t = x.shape[1]
        fw = ws.forward
        xs, gx, hw, bias, table = fw.xs, fw.gx, fw.hw, fw.bias, fw.table
        gates, hs, cs = self._internals(fw.unit)
        units = self.units(t)
        store = stash["states"]
        slot_of = self._slots(sched)
        held = {b: slot_of[("fwd", b)] for b in sched.forward_stores}
        self._make_table(params, table)
        for i, (op, a, b) in enumerate(sched.ops):
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
                                    gates, hs, cs, xs, ws, accumulate)
                held.pop(a, None)

    def _backprop_unit(self, params, x, dy, grad_inputs, grad_params, u0, m, gates, hs, cs,
                       xs, ws, accumulate) -> None:
        """Backward of steps u0..u0+m-1 (local indices 0..m-1) through every layer, with the
        buffers of the scheduled backward layout ``ws``."""
        dg_buf, dgh_buf, din_buf, dlow_buf = ws.dg, ws.dgh, ws.din, ws.dlow
        carry, direct, prod, colsum, token_dg = ws.carry, ws.direct, ws.prod, ws.colsum, ws.token_dg
        n, H, G = x.shape[0], self.hidden_size, self.gates
        rows = m * n
        din = _flat(din_buf, m, n, H)
        np.copyto(din, dy[:, u0:u0 + m].transpose(1, 0, 2))
        dg = dg_buf[:m]
        dgh = dgh_buf[:m] if self.gate_factor == 3 else dg
        dg2, dgh2 = dg.reshape(rows, G), dgh.reshape(rows, G)
        for k in range(self.num_layers - 1, -1, -1):
            for s in range(m - 1, -1, -1):
                self._backprop_step(k, s, params, gates, hs, cs, din, s, dg[s], dgh[s], carry,
                                    direct, ws.dbias)
            self._grad_w_hh(k, dgh2, hs[k, :m], prod, accumulate)
            self._grad_w_ih_and_biases(k, params, x, u0, u0 + m, 0, hs, dg2, dgh2, prod, colsum,
                                       xs, token_dg, accumulate)
            if k > 0:
                low = _flat(dlow_buf, m, n, H)
                self._grad_into_lower(k, params, dg, low, self._pieces(u0, u0 + m, x.shape[1]))
                din_buf, dlow_buf = dlow_buf, din_buf
                din = low
            else:
                self._input_gradient(params, x, grad_inputs, grad_params, u0, u0 + m, dg2,
                                     dlow_buf, token_dg)


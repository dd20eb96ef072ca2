"""Memory-efficient backpropagation through time: checkpoint schedules for a recurrent layer
(Gruslys et al. 2016, BPTT-HSM, hidden-state memorisation), as plain data.

A sequence is cut into ``units`` time units 0..units-1; boundary b (0..units) is the hidden
state before unit b. Boundary 0 (the initial state) is always available and never counted as
stored. A schedule is executed as:

* forward phase: run units 0..units-1 once, storing the boundaries in ``forward_stores``;
* backward phase, ``ops`` in order:

  - ``("advance", a, b)``: from stored boundary a (or 0) run units a..b-1 without keeping
    internals and store boundary b; costs b - a unit forwards;
  - ``("backprop", j, j + 1)``: recompute unit j from stored boundary j (or 0) keeping its
    internals, backpropagate through it and free boundary j; costs 1 unit forward. Backprops
    run for j = units-1 down to 0, each once.

Cost model: ``unit_forwards`` = units (forward phase) + all advance lengths + one per backprop,
so storing every boundary costs 2 * units. ``max_stored`` is the peak number of stored
boundaries (boundary 0 excluded) over both phases.

The optimal schedule for a slot budget m (Gruslys' dynamic programme, adapted to this cost
model) uses two tables over (t units, m free slots), both starting from a stored left boundary:

* ``R(t, m)`` — *cold*, the forward pass over the segment must be paid:
  ``R(1, m) = 1``, ``R(t, 0) = inf`` for t >= 2,
  ``R(t, m) = min_y  y + R(t - y, m - 1) + R(y, m)``
  (advance y units and store, do the right part with one slot fewer, then the left part with
  the slot back, since the right part's backprops freed it);
* ``F(t, m)`` — *hot*, the segment is being run by the forward phase anyway, so the advance to
  the split point is free (it becomes a forward store):
  ``F(1, m) = 1``, ``F(t, 0) = inf`` for t >= 2, ``F(t, m) = min_y  F(t - y, m - 1) + R(y, m)``.

``optimal_cost(units, slots) = units + F(units, min(slots, units - 1))``. For m >= t - 1 the
closed forms ``R = 2t - 1`` and ``F = t`` hold (store every boundary), which bounds the work.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from math import isqrt
from typing import Any

import numpy as np

ADVANCE = "advance"
BACKPROP = "backprop"
POLICIES = ("dp", "sqrt", "all")
_INF = 10**15  # "infeasible"; three of them still fit in int64

Op = tuple[str, int, int]


@dataclass(frozen=True)
class BPTTSchedule:
    """A checkpoint schedule for BPTT over ``units`` time units (see the module docstring)."""

    units: int
    forward_stores: tuple[int, ...]
    ops: tuple[Op, ...]
    max_stored: int
    unit_forwards: int
    policy: str

    @property
    def overhead(self) -> float:
        """Unit forwards per unit (2.0 for store-everything)."""
        return self.unit_forwards / self.units

    def validate(self) -> None:
        """Replay the schedule; raise ValueError if it is invalid or its figures are wrong."""
        peak, forwards = simulate(self)
        if (peak, forwards) != (self.max_stored, self.unit_forwards):
            raise ValueError(
                f"schedule claims max_stored={self.max_stored}, unit_forwards="
                f"{self.unit_forwards}; replay gives max_stored={peak}, unit_forwards={forwards}"
            )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready plain data (lists of ints / [str, int, int])."""
        return {
            "units": self.units,
            "forward_stores": list(self.forward_stores),
            "ops": [list(op) for op in self.ops],
            "max_stored": self.max_stored,
            "unit_forwards": self.unit_forwards,
            "policy": self.policy,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BPTTSchedule:
        """Inverse of ``to_dict`` (lists become tuples); does not validate."""
        return cls(
            units=int(data["units"]),
            forward_stores=tuple(int(b) for b in data["forward_stores"]),
            ops=tuple((str(k), int(a), int(b)) for k, a, b in data["ops"]),
            max_stored=int(data["max_stored"]),
            unit_forwards=int(data["unit_forwards"]),
            policy=str(data["policy"]),
        )


def _is_int(x: object) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _check_units(units: int) -> None:
    if not _is_int(units) or units < 1:
        raise ValueError(f"units must be an int >= 1, got {units!r}")


def min_slots(units: int) -> int:
    """Fewest storable boundaries any schedule needs: 0 for one unit, else 1."""
    _check_units(units)
    return 0 if units == 1 else 1


def simulate(schedule: BPTTSchedule) -> tuple[int, int]:
    """Replay ``schedule`` and return ``(max_stored, unit_forwards)``.

    Raises ValueError on any violation: bad forward stores, advancing from an unstored state,
    storing a boundary twice or one whose unit is already backpropagated, backprops out of
    order, missing or from an unstored state, or states left stored at the end.
    """
    units = schedule.units
    _check_units(units)
    stored = _forward_phase(schedule)
    peak = len(stored)
    forwards = units
    nxt = units - 1  # next unit to backpropagate
    for i, op in enumerate(schedule.ops):
        kind, a, b = _op_parts(i, op)
        if kind == ADVANCE:
            _advance(i, op, stored, nxt)
            peak = max(peak, len(stored))
            forwards += b - a
        elif kind == BACKPROP:
            _backprop(i, op, stored, nxt)
            forwards += 1
            nxt -= 1
        else:
            raise ValueError(f"op {i} {op!r}: unknown kind {kind!r} (advance or backprop)")
    if nxt >= 0:
        raise ValueError(f"units {nxt}..0 never backpropagated")
    if stored:
        raise ValueError(f"boundaries {sorted(stored)} still stored at the end")
    return peak, forwards


def _forward_phase(schedule: BPTTSchedule) -> set[int]:
    """The boundaries the forward phase stores, checked (inside 1..units-1, ascending)."""
    units = schedule.units
    stored: set[int] = set()
    prev = 0
    for b in schedule.forward_stores:
        if not _is_int(b) or not 1 <= b <= units - 1:
            raise ValueError(f"forward store {b!r} outside boundaries 1..{units - 1}")
        if b <= prev:
            raise ValueError(f"forward_stores must be strictly ascending, got {b} after {prev}")
        stored.add(b)
        prev = b
    return stored


def _op_parts(i: int, op: object) -> Op:
    """Op ``i`` as ``(kind, a, b)`` with int boundaries, or ValueError."""
    if not isinstance(op, Sequence) or isinstance(op, str) or len(op) != 3:
        raise ValueError(f"op {i}: expected (kind, a, b), got {op!r}")
    kind, a, b = op
    if not (_is_int(a) and _is_int(b)):
        raise ValueError(f"op {i} {op!r}: boundaries must be ints")
    return kind, a, b


def _advance(i: int, op: Sequence, stored: set[int], nxt: int) -> None:
    """Check op ``i``, an advance from boundary a to b, and store b."""
    _, a, b = op
    if not 0 <= a < b:
        raise ValueError(f"op {i} {op!r}: advance needs 0 <= a < b")
    if b > nxt:
        raise ValueError(
            f"op {i} {op!r}: boundary {b} is past the next unit to backprop ({nxt}); "
            "it could never be freed"
        )
    if a != 0 and a not in stored:
        raise ValueError(f"op {i} {op!r}: advance from unstored boundary {a}")
    if b in stored:
        raise ValueError(f"op {i} {op!r}: boundary {b} is already stored")
    stored.add(b)


def _backprop(i: int, op: Sequence, stored: set[int], nxt: int) -> None:
    """Check op ``i``, the backprop of unit a (the next, ``nxt``), and free boundary a."""
    _, a, b = op
    if b != a + 1:
        raise ValueError(f"op {i} {op!r}: backprop must be (j, j + 1)")
    if a != nxt:
        raise ValueError(
            f"op {i} {op!r}: backprop of unit {a} out of order, expected unit {nxt}"
        )
    if a != 0:
        if a not in stored:
            raise ValueError(f"op {i} {op!r}: backprop from unstored boundary {a}")
        stored.remove(a)


def _build(units: int, stores: list[int], ops: list[Op], policy: str) -> BPTTSchedule:
    draft = BPTTSchedule(units, tuple(stores), tuple(ops), 0, 0, policy)
    peak, forwards = simulate(draft)
    return BPTTSchedule(units, tuple(stores), tuple(ops), peak, forwards, policy)


# --------------------------------------------------------------------------- the DP tables


@dataclass(frozen=True)
class _Tables:
    """R/F costs and argmin splits, indexed [m, t] for m in 0..slots, t in 0..units."""

    cold: np.ndarray
    hot: np.ndarray
    cold_split: np.ndarray
    hot_split: np.ndarray


def _tables(units: int, slots: int) -> _Tables:
    """Fill the BPTT-HSM tables for t <= units, m <= slots (slots <= units - 1)."""
    shape = (slots + 1, units + 1)
    cold = np.full(shape, _INF, dtype=np.int64)
    hot = np.full(shape, _INF, dtype=np.int64)
    cold_split = np.zeros(shape, dtype=np.int32)
    hot_split = np.zeros(shape, dtype=np.int32)
    cold[:, 1] = 1
    hot[:, 1] = 1
    ar = np.arange(units + 1, dtype=np.int64)
    for m in range(1, slots + 1):
        # m >= t - 1: store every boundary (lower bound t - 1 advances + t backprops attained).
        top = min(m + 1, units)
        cold[m, 2 : top + 1] = 2 * ar[2 : top + 1] - 1
        hot[m, 2 : top + 1] = ar[2 : top + 1]
        cold_split[m, 2 : top + 1] = 1
        hot_split[m, 2 : top + 1] = 1
        c_prev, h_prev, c_row, h_row = cold[m - 1], hot[m - 1], cold[m], hot[m]
        for t in range(top + 1, units + 1):
            left = c_row[1:t]  # R(y, m), y = 1..t-1
            c = ar[1:t] + c_prev[t - 1 : 0 : -1] + left
            h = h_prev[t - 1 : 0 : -1] + left
            i = int(np.argmin(c))
            j = int(np.argmin(h))
            c_row[t] = c[i]
            h_row[t] = h[j]
            cold_split[m, t] = i + 1
            hot_split[m, t] = j + 1
    return _Tables(cold, hot, cold_split, hot_split)


def _check_slots(units: int, slots: int, what: str = "slots") -> int:
    _check_units(units)
    if not _is_int(slots):
        raise ValueError(f"{what} must be an int, got {slots!r}")
    need = min_slots(units)
    if slots < need:
        raise ValueError(
            f"{what}={slots} is infeasible for {units} units: at least {need} stored "
            f"state{'s' if need != 1 else ''} needed"
        )
    return min(int(slots), units - 1)


def cost_curve(units: int, max_slots: int) -> tuple[int | None, ...]:
    """``optimal_cost(units, m)`` for m = 0..max_slots in one table fill (None: infeasible)."""
    _check_units(units)
    if not _is_int(max_slots) or max_slots < 0:
        raise ValueError(f"max_slots must be an int >= 0, got {max_slots!r}")
    cap = min(int(max_slots), units - 1)
    hot = _tables(units, cap).hot[:, units]
    out = [units + int(v) if v < _INF else None for v in hot]
    out += [out[-1]] * (int(max_slots) - cap)
    return tuple(out)


def optimal_cost(units: int, slots: int) -> int:
    """Fewest unit forwards (forward phase included) to backprop ``units`` units with at most
    ``slots`` stored boundaries; ValueError if ``slots`` is below ``min_slots(units)``."""
    m = _check_slots(units, slots)
    return units + int(_tables(units, m).hot[m, units])


def dp_schedule(units: int, slots: int) -> BPTTSchedule:
    """Optimal (BPTT-HSM) schedule for at most ``slots`` stored boundaries (policy "dp").

    Among equal-cost budgets the smallest is used, so ``max_stored`` is the fewest slots that
    reach ``optimal_cost(units, slots)``.
    """
    m = _check_slots(units, slots)
    tab = _tables(units, m)
    best = tab.hot[m, units]
    m = int(np.flatnonzero(tab.hot[:, units] == best)[0])
    stores: list[int] = []
    ops: list[Op] = []
    cold: list[tuple[int, int, int]] = []  # deferred left parts (start, units, slots)
    s, t = 0, units
    while t > 1:  # the hot chain: its advances are the forward phase's stores
        y = int(tab.hot_split[m, t])
        stores.append(s + y)
        cold.append((s, y, m))
        s, t, m = s + y, t - y, m - 1
    ops.append((BACKPROP, s, s + 1))
    stack = cold  # innermost left part first; pushing right after left runs right first
    while stack:
        s, t, m = stack.pop()
        if t == 1:
            ops.append((BACKPROP, s, s + 1))
            continue
        y = int(tab.cold_split[m, t])
        ops.append((ADVANCE, s, s + y))
        stack.append((s, y, m))
        stack.append((s + y, t - y, m - 1))
    return _build(units, stores, ops, "dp")


def sqrt_schedule(units: int) -> BPTTSchedule:
    """Chen et al.: store every k-th boundary in forward (k = ceil(sqrt(units))); per segment
    from the right, advance one unit at a time storing each boundary, then backprop them."""
    _check_units(units)
    k = isqrt(units - 1) + 1  # ceil(sqrt(units))
    stores = list(range(k, units, k))
    ops: list[Op] = []
    starts = [0, *stores]
    for a in reversed(starts):
        b = min(a + k, units)
        ops.extend((ADVANCE, x, x + 1) for x in range(a, b - 1))
        ops.extend((BACKPROP, j, j + 1) for j in range(b - 1, a - 1, -1))
    return _build(units, stores, ops, "sqrt")


def store_all_schedule(units: int) -> BPTTSchedule:
    """Store every boundary in forward; backward only backprops (policy "all", 2 * units)."""
    _check_units(units)
    ops = [(BACKPROP, j, j + 1) for j in range(units - 1, -1, -1)]
    return _build(units, list(range(1, units)), ops, "all")


def schedule_for_budget(units: int, max_states: int) -> BPTTSchedule:
    """Cheapest schedule storing at most ``max_states`` boundaries (the dp schedule with
    ``slots = min(max_states, units - 1)``); ValueError below ``min_slots(units)``."""
    return dp_schedule(units, _check_slots(units, max_states, "max_states"))

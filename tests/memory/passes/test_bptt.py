"""BPTT checkpoint schedules (Gruslys et al. 2016 BPTT-HSM): replay, optimality, figures."""

from __future__ import annotations

import heapq
import json
import math
from functools import cache

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minidl.memory.passes.bptt import (
    BPTTSchedule,
    cost_curve,
    dp_schedule,
    min_slots,
    optimal_cost,
    schedule_for_budget,
    simulate,
    sqrt_schedule,
    store_all_schedule,
)


def brute_force_cost(units: int, slots: int) -> int | None:
    """Cheapest valid schedule by exhaustive search: Dijkstra over (stored set, next backprop),
    sourced from every forward-store subset; every advance (a, b) the executor allows."""
    start = units  # the forward phase
    dist: dict[tuple[int, int], int] = {}
    heap: list[tuple[int, int, int]] = []
    for mask in range(1 << units):
        if mask & 1 or bin(mask).count("1") > slots:  # bit b = boundary b; boundary 0 free
            continue
        heap.append((start, mask, units - 1))
    heapq.heapify(heap)
    while heap:
        d, mask, nxt = heapq.heappop(heap)
        if (mask, nxt) in dist:
            continue
        dist[(mask, nxt)] = d
        if nxt < 0:
            if mask == 0:
                return d
            continue
        if nxt == 0 or mask >> nxt & 1:  # backprop unit nxt
            heapq.heappush(heap, (d + 1, mask & ~(1 << nxt), nxt - 1))
        if bin(mask).count("1") < slots:
            for a in range(nxt):
                if a and not mask >> a & 1:
                    continue
                for b in range(a + 1, nxt + 1):
                    if not mask >> b & 1:
                        heapq.heappush(heap, (d + b - a, mask | 1 << b, nxt))
    return None


def recursion_cost(units: int, slots: int) -> int:
    """Independent plain recursion (no closed forms, no NumPy) of the HSM programme."""

    @cache
    def cold(t: int, m: int) -> float:
        if t == 1:
            return 1
        if m == 0:
            return math.inf
        return min(y + cold(t - y, m - 1) + cold(y, m) for y in range(1, t))

    @cache
    def hot(t: int, m: int) -> float:
        if t == 1:
            return 1
        if m == 0:
            return math.inf
        return min(hot(t - y, m - 1) + cold(y, m) for y in range(1, t))

    return units + int(hot(units, slots))


@pytest.mark.parametrize("units", range(1, 8))
def test_dp_equals_exhaustive_search(units):
    for slots in range(units + 1):
        expect = brute_force_cost(units, slots)
        if expect is None:
            assert slots < min_slots(units)
            with pytest.raises(ValueError, match="at least 1"):
                optimal_cost(units, slots)
            continue
        assert optimal_cost(units, slots) == expect, (units, slots)
        sched = dp_schedule(units, slots)
        assert sched.unit_forwards == expect
        assert sched.max_stored <= slots


def test_dp_equals_plain_recursion():
    for units in range(1, 41):
        curve = cost_curve(units, units + 2)
        for slots in range(min_slots(units), units + 3):
            assert curve[slots] == recursion_cost(units, min(slots, units - 1)), (units, slots)


@settings(max_examples=60, deadline=None)
@given(units=st.integers(1, 90), slots=st.integers(0, 95))
def test_dp_schedule_replays_to_its_figures(units, slots):
    if slots < min_slots(units):
        with pytest.raises(ValueError):
            dp_schedule(units, slots)
        return
    sched = dp_schedule(units, slots)
    assert simulate(sched) == (sched.max_stored, sched.unit_forwards)
    sched.validate()
    assert sched.policy == "dp"
    assert sched.unit_forwards == optimal_cost(units, slots)
    assert sched.max_stored <= slots
    # max_stored is the fewest slots reaching this cost
    if sched.max_stored > min_slots(units):
        assert optimal_cost(units, sched.max_stored - 1) > sched.unit_forwards


@pytest.mark.parametrize("units", [1, 2, 3, 4, 5, 9, 10, 16, 17, 63, 64, 65, 125, 200])
def test_sqrt_and_store_all_replay(units):
    for sched in (sqrt_schedule(units), store_all_schedule(units)):
        assert simulate(sched) == (sched.max_stored, sched.unit_forwards)
    k = math.ceil(math.sqrt(units))
    sq = sqrt_schedule(units)
    assert sq.policy == "sqrt"
    assert sq.forward_stores == tuple(range(k, units, k))
    nseg = len(sq.forward_stores) + 1
    assert sq.unit_forwards == 3 * units - nseg  # forward + advances + backprops
    assert sq.max_stored <= 2 * k
    al = store_all_schedule(units)
    assert al.policy == "all"
    assert (al.unit_forwards, al.max_stored) == (2 * units, units - 1)
    assert optimal_cost(units, units - 1) == 2 * units
    assert optimal_cost(units, 10 * units) == 2 * units
    assert dp_schedule(units, units - 1) == BPTTSchedule(
        units, al.forward_stores, al.ops, al.max_stored, al.unit_forwards, "dp"
    )


@pytest.mark.parametrize("units", [2, 7, 33, 100])
def test_cost_monotone_in_slots(units):
    curve = cost_curve(units, units + 3)
    assert curve[0] is None
    # one slot: advance from boundary 0 to each of units-2..1 in turn
    assert curve[1] == 2 * units + (units - 1) * (units - 2) // 2
    feasible = curve[1:]
    assert all(a >= b for a, b in zip(feasible, feasible[1:]))
    assert feasible[-1] == 2 * units


@pytest.mark.parametrize("units", [4, 10, 30, 64, 125, 256])
def test_dp_never_worse_than_sqrt(units):
    sq = sqrt_schedule(units)
    dp = dp_schedule(units, sq.max_stored)
    assert dp.unit_forwards <= sq.unit_forwards
    assert dp.max_stored <= sq.max_stored


def test_schedule_for_budget():
    assert schedule_for_budget(1, 0).unit_forwards == 2
    assert schedule_for_budget(20, 1000) == dp_schedule(20, 19)
    assert schedule_for_budget(20, 5).max_stored <= 5
    with pytest.raises(ValueError, match=r"max_states=0 .* 20 units: at least 1"):
        schedule_for_budget(20, 0)
    with pytest.raises(ValueError, match="units"):
        schedule_for_budget(0, 3)


def test_dict_round_trip():
    sched = dp_schedule(37, 4)
    data = json.loads(json.dumps(sched.to_dict()))
    assert BPTTSchedule.from_dict(data) == sched
    assert all(type(op[0]) is str and type(op[1]) is int for op in sched.ops)


def _bad(units, stores, ops, peak=0, fwd=0):
    return BPTTSchedule(units, tuple(stores), tuple(ops), peak, fwd, "hand")


@pytest.mark.parametrize(
    ("sched", "message"),
    [
        (_bad(3, [], [("backprop", 2, 3)]), "unstored boundary 2"),
        (_bad(4, [3], [("backprop", 3, 4), ("advance", 1, 2)]), "advance from unstored"),
        (_bad(3, [1, 2], [("advance", 1, 2)]), "already stored"),
        (_bad(3, [2], [("backprop", 2, 3), ("advance", 0, 2)]), "past the next unit"),
        (_bad(3, [2], [("backprop", 2, 3), ("backprop", 0, 1)]), "out of order"),
        (_bad(3, [2], [("backprop", 2, 3)]), r"units 1\.\.0 never"),
        (_bad(3, [1, 2], [("backprop", 2, 3), ("backprop", 1, 3)]), r"\(j, j \+ 1\)"),
        (_bad(3, [1, 2], [("backprop", 2, 3), ("advance", 0, 0)]), "a < b"),
        (_bad(3, [2, 1], []), "ascending"),
        (_bad(3, [3], []), "outside"),
        (_bad(3, [0], []), "outside"),
        (_bad(3, [2], [("backprop", 2, 3), ("recompute", 0, 1)]), "unknown kind"),
        (
            _bad(4, [2], [("backprop", 3, 4)]),
            "unstored boundary 3",
        ),
        (
            _bad(
                4,
                [1, 3],
                [("backprop", 3, 4), ("advance", 1, 2), ("backprop", 2, 3), ("backprop", 0, 1)],
            ),
            "out of order",
        ),
        (
            _bad(3, [1, 2], [("backprop", 2, 3), ("advance", 0, 1)]),
            "already stored",
        ),
    ],
)
def test_simulate_rejects_invalid(sched, message):
    with pytest.raises(ValueError, match=message):
        simulate(sched)


def test_simulate_rejects_leftover_and_wrong_figures():
    missing = _bad(3, [1, 2], [("backprop", 2, 3), ("backprop", 1, 2)])
    with pytest.raises(ValueError, match="units 0..0 never backpropagated"):
        simulate(missing)
    stay = _bad(
        3, [1], [("advance", 1, 2), ("backprop", 2, 3), ("backprop", 1, 2), ("advance", 0, 1)]
    )
    with pytest.raises(ValueError, match="past the next unit"):
        simulate(stay)
    good = store_all_schedule(5)
    wrong = BPTTSchedule(5, good.forward_stores, good.ops, good.max_stored, 9, "all")
    with pytest.raises(ValueError, match="unit_forwards=9; replay gives"):
        wrong.validate()


def test_figures_length_1000():
    """Gruslys et al. report ~95% memory saved at length 1000 for a modest time cost. Here a
    budget of ceil(sqrt(1000)) = 32 states (3.2% of store-all's 999) costs 3.406 unit forwards
    per unit against store-all's 2.0, and beats Chen's sqrt schedule at its own memory."""
    units, slots = 1000, math.ceil(math.sqrt(1000))
    dp = dp_schedule(units, slots)
    assert dp.max_stored == slots
    assert dp.unit_forwards == 3406
    assert dp.unit_forwards < 1.75 * store_all_schedule(units).unit_forwards
    sq = sqrt_schedule(units)
    assert (sq.max_stored, sq.unit_forwards) == (61, 2968)
    assert optimal_cost(units, sq.max_stored) == 2938 < sq.unit_forwards
    assert optimal_cost(units, sq.max_stored // 2) < 1.2 * sq.unit_forwards

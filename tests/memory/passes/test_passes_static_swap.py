"""Unit tests of ``static`` (block intervals, offsets) and ``swap`` on hand-built programs."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hand_programs import chain, ids, render, residual

from minidl.memory.ir.config import MemoryConfig
from minidl.memory.ir.plan import STARTS, Alloc, Await, Offload, Prefetch, Release
from minidl.memory.passes.base_plan import base_plan, plan_peak
from minidl.memory.passes.static_plan import block_intervals, max_live_bytes, static_plan
from minidl.memory.passes.swap import SwapCandidate, swap_candidates, swap_plan

UNIT = 512
REUSE_INPLACE = MemoryConfig.parse("reuse,inplace")


def live_bytes_by_walk(plan) -> int:
    """Reference peak: walk the actions, adding a block's size when it starts and taking it off
    when it ends (alias views carry no bytes)."""
    p = plan.program
    live = best = 0
    for _, a in plan.actions():
        if a.tensor in plan.aliases:
            continue
        size = p.block_size(p.tensors[a.tensor].nbytes)
        if a.effect.starts_block:
            live += size
        elif a.effect.ends_block:
            live -= size
        best = max(best, live)
    return best


def _live_after(plan, step: int) -> int:
    """Bytes of blocks live after ``step``'s actions."""
    p = plan.program
    live = 0
    for i, a in plan.actions():
        if i > step:
            break
        if a.tensor in plan.aliases:
            continue
        size = p.block_size(p.tensors[a.tensor].nbytes)
        live += size if a.effect.starts_block else -size if a.effect.ends_block else 0
    return live


def test_block_intervals_are_action_positions():
    p = chain()
    plan = base_plan(p, REUSE_INPLACE)
    n = {t.id: t.name for t in p.tensors}
    iv = {(n[t], k): v for (t, k), v in block_intervals(plan).items()}
    # times count every action, views included: 0 alloc x, 1 alloc labels, 2 alloc conv,
    # 3 alloc conv.fwd_ws, 4 free conv.fwd_ws, 5 alloc relu (a view of conv: no interval), ...
    # 24 free conv (after relu's backward), 25 alloc conv.bwd_ws, 26 free conv.grad, 27 free x
    assert iv[("x", 0)] == (0, 27, 4 * UNIT)
    assert iv[("conv", 0)] == (2, 24, 4 * UNIT)
    assert iv[("conv.fwd_ws", 0)] == (3, 4, 2 * UNIT)
    assert ("relu", 0) not in iv and ("conv.grad", 0) not in iv  # views of other blocks
    assert len(iv) == 13
    assert max_live_bytes(block_intervals(plan)) == live_bytes_by_walk(plan) == 16 * UNIT


def test_max_live_bytes_of_hand_intervals():
    iv = {(1, 0): (0, 4, 100), (2, 0): (1, 2, 50), (3, 0): (2, 6, 30), (4, 0): (4, 5, 70)}
    # at t=1: 150; at t=2 the 50 ends before the 30 starts; at t=4: 30 + 70 (100 ended)
    assert max_live_bytes(iv) == 150


@pytest.mark.parametrize("make", [chain, residual])
@pytest.mark.parametrize("spec", ["none", "reuse", "reuse,inplace", "reuse,swap=all"])
def test_static_offsets_never_overlap_in_time_and_space(make, spec):
    p = make()
    plan = base_plan(p, MemoryConfig.parse(spec))
    if "swap" in spec:
        plan = swap_plan(plan, "all")
    base = 3 * UNIT
    st = static_plan(plan, base)
    st.validate()
    iv = block_intervals(plan)
    offsets: dict[tuple[int, int], int] = {}
    seen: dict[int, int] = {}
    for _, a in st.actions():
        if isinstance(a, STARTS):
            if a.tensor in plan.aliases:
                assert a.offset == -1  # a view: no block of its own
                continue
            k = seen.get(a.tensor, 0)
            seen[a.tensor] = k + 1
            assert a.offset >= base and (a.offset - base) % UNIT == 0
            offsets[(a.tensor, k)] = a.offset - base
    assert offsets.keys() == iv.keys()
    top = 0
    for key, (s, e, size) in iv.items():
        top = max(top, offsets[key] + size)
        for other, (s2, e2, size2) in iv.items():
            if key < other and s < e2 and s2 < e:  # live at the same time: disjoint bytes
                o, o2 = offsets[key], offsets[other]
                assert o + size <= o2 or o2 + size2 <= o, (key, other)
    assert st.static.arena == top >= max_live_bytes(iv)
    assert st.static.base == base
    # the input plan is untouched: still no offsets
    assert all(a.offset == -1 for _, a in plan.actions() if isinstance(a, STARTS))


def test_static_arena_of_the_chain():
    plan = base_plan(chain(), REUSE_INPLACE)
    st = static_plan(plan, 0)
    # the greedy cannot reach the 16-unit live peak here: 17 units
    assert (st.static.arena, max_live_bytes(block_intervals(plan))) == (17 * UNIT, 16 * UNIT)
    assert st.notes[-1].startswith("static: 13 blocks at planned offsets, arena 8,704 B")
    # static changes offsets only: the same actions in the same places
    assert render(st) == render(plan)
    assert [(i, type(a), a.tensor) for i, a in st.actions()] == \
        [(i, type(a), a.tensor) for i, a in plan.actions()]


def test_static_with_cache_places_nothing():
    plan = swap_plan(base_plan(chain(), REUSE_INPLACE), "all")
    cached = replace(plan, swapping=replace(plan.swapping, cache=True))
    out = static_plan(cached, 0)
    assert out.static.arena == -1
    assert out.steps == cached.steps
    assert out.notes[-1].startswith("static: not applied with cache")


# ---- swap


def test_swap_candidates_of_the_chain():
    p = chain()
    t = ids(p)
    plan = base_plan(p, REUSE_INPLACE)
    # x: last forward use conv (0), first backward use conv's backward (9); conv's block
    # (with relu, its in-place view): pool's forward (2) / relu's backward (8); pool: 3 / 6;
    # fc: 4 / 5. The argmax stash and the labels are not feature maps / too close.
    assert swap_candidates(p, plan.aliases, "all") == [
        SwapCandidate(t["x"], 0, 9, 4 * UNIT), SwapCandidate(t["conv"], 2, 8, 4 * UNIT),
        SwapCandidate(t["pool"], 3, 6, 2 * UNIT), SwapCandidate(t["labels"], 4, 5, UNIT),
        SwapCandidate(t["fc"], 4, 5, UNIT)]
    # swap=conv: only the convolution's input
    assert swap_candidates(p, plan.aliases, "conv") == [SwapCandidate(t["x"], 0, 9, 4 * UNIT)]


def test_swap_plan_positions_and_a_new_plan():
    p = chain()
    plan = base_plan(p, REUSE_INPLACE)
    before = render(plan)
    swapped = swap_plan(plan, "all")
    assert swapped is not plan and render(plan) == before and plan.swapping.blocks == ()
    t = ids(p)
    assert swapped.swapping.blocks == (t["x"], t["conv"], t["pool"])  # fc: only 1 step apart
    rows = render(swapped)
    extra = [(row[0], [a for a in row[1] if a not in old[1]], [a for a in row[2]
                                                               if a not in old[2]])
             for row, old in zip(rows, before)]
    # offload after the last forward use i, release after i + 1 (lag), prefetch before
    # max(i + 2, j - 2) (lookahead 2), await before the first backward use j
    assert [e for e in extra if e[1] or e[2]] == [
        ("conv (forward)", [], ["offload x"]),
        ("relu (forward)", [], ["release x"]),
        ("pool (forward)", [], ["offload conv"]),
        ("fc (forward)", [], ["release conv", "offload pool"]),
        ("loss (forward)", [], ["release pool"]),
        ("loss (backward)", ["prefetch pool"], []),
        ("fc (backward)", ["prefetch conv", "await pool"], []),
        ("pool (backward)", ["prefetch x"], []),
        ("relu (backward)", ["await conv"], []),
        ("conv (backward)", ["await x"], []),
    ]
    swapped.validate()
    assert swapped.notes[-1].startswith("swap: 3 feature maps offloaded (5,120 B per iteration)")
    # a swapped block has two occurrences: allocation to release, prefetch to free
    iv = block_intervals(swapped)
    assert {k for k in iv if k[1] == 1} == {(t["x"], 1), (t["conv"], 1), (t["pool"], 1)}
    # the peak is in backward (pool's), when the prefetches have brought x and conv back
    assert plan_peak(swapped) == live_bytes_by_walk(swapped) == plan_peak(plan) == 16 * UNIT
    # but forward ends lighter: at the loss, x, conv and pool are on host (10 units fewer)
    assert _live_after(swapped, 4) == _live_after(plan, 4) - 10 * UNIT


def test_swap_plan_lookahead_lag_and_only():
    p = chain()
    t = ids(p)
    plan = base_plan(p, REUSE_INPLACE)
    out = swap_plan(plan, "all", lookahead=5, lag=2, only={t["x"]})
    assert out.swapping.blocks == (t["x"],)
    where = {(i, type(a)) for i, a in out.actions() if a.tensor == t["x"]
             and isinstance(a, (Offload, Release, Prefetch, Await))}
    # offload after 0, release after 0 + 2, prefetch before max(3, 9 - 5) = 4, await before 9
    assert where == {(0, Offload), (2, Release), (4, Prefetch), (9, Await)}
    # with lag 2 the pool (3 -> 6) has no idle step left: 6 - 3 < 2 + 2
    assert swap_plan(plan, "all", lag=2).swapping.blocks == (t["x"], t["conv"])


def test_swap_auto_unmeasured_behaves_as_conv_and_measured_hides_transfers():
    p = chain()
    t = ids(p)
    plan = base_plan(p, REUSE_INPLACE)
    assert swap_plan(plan, "auto").swapping.blocks == (t["x"],)
    slow = [1.0] * len(p.steps)  # 1 s per step: every gap hides a 2 KiB copy
    assert swap_plan(plan, "auto", step_times=slow).swapping.blocks == \
        (t["x"], t["conv"], t["pool"])
    fast = [1e-9] * len(p.steps)  # nothing is hidden
    assert swap_plan(plan, "auto", step_times=fast).swapping.blocks == ()


def test_swap_alloc_keeps_offsets_through_static():
    p = chain()
    t = ids(p)
    st = static_plan(swap_plan(base_plan(p, REUSE_INPLACE), "all"), 0)
    pre = [a for _, a in st.actions() if isinstance(a, Prefetch)]
    assert {a.tensor for a in pre} == {t["x"], t["conv"], t["pool"]}
    assert all(a.offset >= 0 for a in pre)
    assert all(a.offset >= 0 for _, a in st.actions()
               if isinstance(a, Alloc) and a.tensor not in st.aliases)

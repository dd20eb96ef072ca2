"""``static``: every block's offset planned before the first iteration from its lifetime.

Offsets are assigned greedily by size (the largest block first, each at the lowest offset not
overlapping any already placed block whose lifetime intersects its own), as static planners
(Chen et al., vDNN++, TensorFlow's and tinygrad's memory planners) do; orderings by lifetime
length, by size × lifetime and by allocation time are tried too and the smallest arena kept.
The pool then places each block at its planned offset: no search at run time, no
fragmentation within an iteration, the reserved peak known ahead.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from .plan import ENDS, STARTS, Action, Plan


def block_intervals(plan: Plan) -> dict[tuple[int, int], tuple[int, int, int]]:
    """(tensor, occurrence) -> (start time, end time, block size in the program's allocation
    unit) over the plan's action sequence. A swapped tensor has two occurrences: allocation to
    release, prefetch to free."""
    program = plan.program
    start: dict[int, tuple[int, int]] = {}
    count: dict[int, int] = {}
    out: dict[tuple[int, int], tuple[int, int, int]] = {}
    for t, (_, a) in enumerate(plan.actions()):
        if a.tensor in plan.aliases:
            continue
        if isinstance(a, STARTS):
            k = count.get(a.tensor, 0)
            count[a.tensor] = k + 1
            start[a.tensor] = (k, t)
        elif isinstance(a, ENDS) and a.tensor in start:
            k, s = start.pop(a.tensor)
            out[(a.tensor, k)] = (s, t, program.block_size(program.tensors[a.tensor].nbytes))
    return out


def _greedy(intervals: dict[int, tuple[int, int, int]], order: list[int]) -> tuple[dict, int]:
    """Place blocks in ``order``, each at the lowest offset where it overlaps no block placed
    before it that is live at the same time (first fit over the offsets)."""
    n = len(order)
    starts = np.empty(n, np.int64)
    ends = np.empty(n, np.int64)
    los = np.empty(n, np.int64)
    his = np.empty(n, np.int64)
    offsets: dict[int, int] = {}
    top = 0
    for k, tid in enumerate(order):
        s, e, size = intervals[tid]
        live = np.flatnonzero((starts[:k] < e) & (s < ends[:k]))
        off = 0
        if live.size:
            lo, hi = los[live], his[live]
            by = np.argsort(lo, kind="stable")
            lo, hi = lo[by], hi[by]
            # the offset after each busy block in turn (0 before the first): the first that
            # leaves room below the next block is where this one goes, else above them all
            after = np.maximum.accumulate(hi)
            before = np.concatenate(([0], after[:-1]))
            room = np.flatnonzero(before + size <= lo)
            off = int(before[room[0]]) if room.size else int(after[-1])
        starts[k], ends[k], los[k], his[k] = s, e, off, off + size
        offsets[tid] = off
        top = max(top, off + size)
    return offsets, top


def max_live_bytes(intervals: dict[int, tuple[int, int, int]]) -> int:
    """The largest sum of bytes live at one time: the best any placement can reach."""
    events = sorted([(s, size) for s, _, size in intervals.values()]
                    + [(e, -size) for _, e, size in intervals.values()])
    live = best = 0
    for _, d in events:
        live += d
        best = max(best, live)
    return best


def static_plan(plan: Plan, base: int) -> Plan:
    """A copy of ``plan`` whose allocations carry offsets (``Alloc.offset``), starting at
    ``base`` (the bytes of persistent state allocated below the iteration's blocks)."""
    if plan.cache:
        return plan.with_notes("static: not applied with cache (what stays resident depends "
                               "on memory pressure at run time): the pool places blocks itself")
    iv = block_intervals(plan)
    orders = [
        sorted(iv, key=lambda t: (-iv[t][2], iv[t][0])),
        sorted(iv, key=lambda t: (-(iv[t][1] - iv[t][0]), -iv[t][2])),
        sorted(iv, key=lambda t: (-iv[t][2] * (iv[t][1] - iv[t][0]), iv[t][0])),
        sorted(iv, key=lambda t: (iv[t][0], -iv[t][2])),
    ]
    offsets, top = min((_greedy(iv, o) for o in orders), key=lambda r: r[1])

    seen: dict[int, int] = {}

    def place(actions: list[Action]) -> list[Action]:
        out = []
        for a in actions:
            if isinstance(a, STARTS) and a.tensor not in plan.aliases:
                k = seen.get(a.tensor, 0)
                seen[a.tensor] = k + 1
                a = replace(a, offset=base + offsets[(a.tensor, k)])
            out.append(a)
        return out

    begin = place(plan.begin)
    steps = [replace(sp, before=place(sp.before), after=place(sp.after)) for sp in plan.steps]
    best = max_live_bytes(iv)
    notes = (*plan.notes,
             f"static: {len(offsets)} blocks at planned offsets, arena {top:,} B for iteration "
             f"tensors; the largest sum live at once is {best:,} B ({top / max(best, 1):.4f}x)")
    return replace(plan, begin=begin, steps=steps, end=plan.end, notes=notes,
                   static_arena=top, static_base=base)


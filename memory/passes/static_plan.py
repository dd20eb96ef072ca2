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
from numba import njit

from ..ir.plan import Action, Plan, StaticLayout
from ..ir.walk import walk


def block_intervals(plan: Plan) -> dict[tuple[int, int], tuple[int, int, int]]:
    """(tensor, occurrence) -> (start time, end time, block size in the program's allocation
    unit) over the plan's action sequence (in :func:`.walk.walk`'s order; time counts
    actions). A swapped tensor has two occurrences: allocation to release, prefetch to
    free."""
    program = plan.program
    aliases = plan.aliases
    sizes = program.block_sizes
    start: dict[int, tuple[int, int]] = {}
    count: dict[int, int] = {}
    out: dict[tuple[int, int], tuple[int, int, int]] = {}
    t = 0
    for visit in walk(plan):
        for a in visit.actions:
            tid = a.tensor
            if tid not in aliases:
                effect = a.effect
                if effect.starts_block:
                    k = count.get(tid, 0)
                    count[tid] = k + 1
                    start[tid] = (k, t)
                elif effect.ends_block and tid in start:
                    k, s = start.pop(tid)
                    out[(tid, k)] = (s, t, sizes[tid])
            t += 1
    return out


@njit(nogil=True, cache=True)
def _first_fit(starts: np.ndarray, ends: np.ndarray, sizes: np.ndarray,
               order: np.ndarray) -> tuple[np.ndarray, int]:  # pragma: no cover - jitted
    """Offsets of blocks placed in ``order``, each at the lowest offset where it overlaps no
    block placed before it that is live at the same time; and the arena's top."""
    n = order.size
    offsets = np.zeros(sizes.size, np.int64)
    placed = np.empty(n, np.int64)
    lo = np.empty(n, np.int64)
    hi = np.empty(n, np.int64)
    top = 0
    for k in range(n):
        i = order[k]
        s, e, size = starts[i], ends[i], sizes[i]
        m = 0
        for q in range(k):
            j = placed[q]
            if starts[j] < e and s < ends[j]:
                lo[m] = offsets[j]
                hi[m] = offsets[j] + sizes[j]
                m += 1
        off = 0
        if m:
            by = np.argsort(lo[:m], kind="mergesort")
            # the offset after each busy block in turn (0 before the first): the first that
            # leaves room below the next block is where this one goes, else above them all
            before = 0
            for r in range(m):
                b = by[r]
                if before + size <= lo[b]:
                    break
                if hi[b] > before:
                    before = hi[b]
            off = before
        offsets[i] = off
        placed[k] = i
        if off + size > top:
            top = off + size
    return offsets, top


def _layout(iv: dict[tuple[int, int], tuple[int, int, int]]) -> tuple[dict, int, int]:
    """The best of the module's orderings: (offsets by block key, arena top, the largest sum
    live at once). Stops at an ordering that reaches that sum (no placement does better)."""
    keys = list(iv)
    if not keys:
        return {}, 0, 0
    arr = np.array([iv[k] for k in keys], np.int64).reshape(len(keys), 3)
    starts, ends, sizes = arr[:, 0].copy(), arr[:, 1].copy(), arr[:, 2].copy()
    best = max_live_bytes(iv)
    n = np.arange(len(keys))
    orders = [  # (np.lexsort sorts by its last key first; ties by key order, like sorted())
        np.lexsort((n, starts, -sizes)),
        np.lexsort((n, -sizes, -(ends - starts))),
        np.lexsort((n, starts, -sizes * (ends - starts))),
        np.lexsort((n, -sizes, starts)),
    ]
    result = None
    for order in orders:
        offsets, top = _first_fit(starts, ends, sizes, order.astype(np.int64))
        if result is None or top < result[1]:
            result = (offsets, int(top))
        if result[1] <= best:
            break
    assert result is not None
    return {k: int(o) for k, o in zip(keys, result[0])}, result[1], best


def static_arena(plan: Plan) -> int:
    """The arena :func:`static_plan` places ``plan``'s iteration blocks in (bytes), without
    writing the offsets into a new plan."""
    return _layout(block_intervals(plan))[1]


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
    if plan.swapping.cache:
        return plan.with_notes("static: not applied with cache (what stays resident depends "
                               "on memory pressure at run time): the pool places blocks itself")
    iv = block_intervals(plan)
    offsets, top, best = _layout(iv)

    seen: dict[int, int] = {}

    def place(actions: list[Action]) -> list[Action]:
        out = []
        for a in actions:
            if a.effect.starts_block and a.tensor not in plan.aliases:
                k = seen.get(a.tensor, 0)
                seen[a.tensor] = k + 1
                a = replace(a, offset=base + offsets[(a.tensor, k)])
            out.append(a)
        return out

    begin = place(plan.begin)
    steps = [replace(sp, before=place(sp.before), after=place(sp.after)) for sp in plan.steps]
    notes = (*plan.notes,
             f"static: {len(offsets)} blocks at planned offsets, arena {top:,} B for iteration "
             f"tensors; the largest sum live at once is {best:,} B ({top / max(best, 1):.4f}x)")
    return replace(plan, begin=begin, steps=steps, end=plan.end, notes=notes,
                   static=StaticLayout(top, base))


"""Swapping added to the auto planner's candidates (:mod:`.frontier`): the feature maps whose
copies the link hides under a schedule's compute, and swaps below the lowest candidates while
the peak falls."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..ir.liveness import root_of
from ..ir.plan import Plan
from ..passes.static_plan import block_intervals
from ..passes.swap import swap_candidates, swap_plan
from .candidate import Candidate, priced

__all__ = ["SWAP_MOVES", "hidden_swaps", "swap_down"]

#: Swap moves tried below the frontier's lowest schedules (each a plan priced exactly).
SWAP_MOVES = 60


def hidden_swaps(candidates: list[Candidate], costs: Sequence[float], bandwidth: float,
                 price: Callable[[Plan], tuple[float, float]]) -> list[Candidate]:
    """Each candidate with ``swap=auto`` added: the feature maps whose copies the link can
    hide under the schedule's own compute (recomputation's steps included), offloaded."""
    out = []
    for c in candidates:
        if c.plan.swapping.blocks:
            continue
        plan = swap_plan(c.plan, "auto", step_times=_plan_costs(c.plan, costs),
                         bandwidth=bandwidth,
                         cost_source="timed on the auto planner's step costs")
        if plan.swapping.blocks:
            out.append(priced(plan, price, f"{c.source}, swap=auto"))
    return out


def swap_down(candidates: list[Candidate], costs: Sequence[float], bandwidth: float,
              price: Callable[[Plan], tuple[float, float]], moves: int = SWAP_MOVES
              ) -> list[Candidate]:
    """Plans below the lowest candidates: from each of the three lowest that swap nothing,
    swap the largest feature map live at the peak (one with idle steps between its last
    forward use and its first backward use) while that lowers the peak; every plan on the way
    is a candidate. At most ``moves`` plans are priced in all (work, not time)."""
    out: list[Candidate] = []
    starts = sorted((c for c in candidates if not c.plan.swapping.blocks),
                    key=lambda c: (c.live_peak, c.time_s))[:3]
    left = moves
    for start in starts:
        base, cur, swapped = start.plan, start, frozenset()
        pool = {c.root: c for c in swap_candidates(base.program, base.aliases, "all")
                if c.first_backward - c.last_forward >= 3}
        while left > 0:
            live = _live_roots_at_peak(cur.plan)
            cands = [c for r, c in pool.items() if r in live and r not in swapped]
            if not cands:
                break
            pick = max(cands, key=lambda c: (c.nbytes, -c.root))
            trial = swapped | {pick.root}
            left -= 1
            plan = swap_plan(base, "all", only=set(trial), bandwidth=bandwidth,
                             step_times=_plan_costs(base, costs),
                             cost_source="timed on the auto planner's step costs")
            cand = priced(plan, price, f"{start.source} + {len(trial)} swapped")
            if cand.live_peak >= cur.live_peak:
                break
            out.append(cand)
            cur, swapped = cand, trial
    return out


def _plan_costs(plan: Plan, costs: Sequence[float]) -> list[float]:
    return [costs[s.cost.origin] if 0 <= s.cost.origin < len(costs) else 0.0
            for s in plan.program.steps]


def _live_roots_at_peak(plan: Plan) -> set[int]:
    """Block roots live where the plan's live bytes peak."""
    iv = block_intervals(plan)
    events = sorted([(s, size) for s, _, size in iv.values()]
                    + [(e, -size) for _, e, size in iv.values()])
    live = best = when = 0
    for t, d in events:
        live += d
        if live > best:
            best, when = live, t
    return {root_of(plan.aliases, tid) for (tid, _), (s, e, _) in iv.items() if s <= when < e}

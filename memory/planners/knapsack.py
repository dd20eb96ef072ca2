"""torch.compile's activation-memory policy: the forward steps ranked by recompute seconds per
byte of output kept, the top share keeping its outputs and every other one recomputed (once per
run of consecutive dropped steps). Single feature maps dropped where they are cheap, which
stage-level schedules cannot express."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..ir.names import Category, Phase, Role
from ..ir.plan import Plan
from ..ir.program import Program
from ..passes.base_plan import base_plan
from ..passes.block_choices import block_choices
from ..passes.recompute import dropping_program
from .candidate import BASE, Candidate, priced

__all__ = ["KNAPSACK_SHARES", "knapsack_candidates", "knapsack_order"]

#: Shares of the forward steps (by recompute time per byte) the knapsack candidates keep (the
#: shares of benchmarks/plans/planner_curve.py's torch.compile anchor).
KNAPSACK_SHARES = (0.8, 0.6, 0.45, 0.3, 0.2, 0.1, 0.05, 0.0)


def knapsack_order(program: Program, costs: Sequence[float], *,
                   later_first: bool = False) -> list[int]:
    """The forward steps that write feature maps (the loss's step aside), by the most seconds
    (``costs[step]``) per byte of those outputs first: the order in which the policy keeps
    them. Steps of equal ratio: the earlier one first, or the later one with
    ``later_first``."""
    loss = {st.index for st in program.steps if program.loss in st.access.writes}
    items = []
    for st in program.steps:
        if st.phase != Phase.FORWARD or st.index in loss:
            continue
        out = [t for t in st.access.writes if program.tensors[t].role == Role.VALUE
               and program.tensors[t].category == Category.FEATURE_MAP]
        if out:
            nbytes = sum(program.block_sizes[t] for t in out)
            items.append((costs[st.index] / max(nbytes, 1), st.index))
    if later_first:
        items.sort(reverse=True)
    else:
        items.sort(key=lambda item: (-item[0], item[1]))
    return [i for _, i in items]


def knapsack_candidates(program: Program, costs: Sequence[float],
                        price: Callable[[Plan], tuple[float, float]]) -> list[Candidate]:
    """The policy's plans as candidates: for each share in :data:`KNAPSACK_SHARES` the top
    share of :func:`knapsack_order` keeps its outputs and every other step is recomputed;
    none for inference programs or where the network forces memory choices on blocks."""
    if not program.training or block_choices(program):
        return []
    order = knapsack_order(program, costs)
    out_cands, seen = [], set()
    for share in KNAPSACK_SHARES:
        dropped = frozenset(order[int(share * len(order)):])
        if not dropped or dropped in seen:
            continue
        seen.add(dropped)
        plan = base_plan(dropping_program(program, set(dropped)), BASE)
        out_cands.append(priced(plan, price, f"knapsack {share:.0%} kept"))
    return out_cands

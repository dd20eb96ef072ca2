"""Exact prices of a keep / swap / recompute choice for :mod:`.optimal` (the peak of its built
plan, its walk on the clock) and the two searches that use nothing else: every choice of a small
program, and the polish that removes actions from a checked choice."""

from __future__ import annotations

from ..ir.config import OnlyAction
from ..ir.plan import AutoChoice, Plan
from ..ir.program import Program
from ..passes.base_plan import plan_peak
from ..passes.block_choices import block_choices
from ..passes.swap import DEFAULT_BANDWIDTH
from .auto import build, plan_extra
from .optimal_facts import droppable_steps, forward_producers


def evaluate(program: Program, choice: AutoChoice, costs: list[float],
             bandwidth: float = DEFAULT_BANDWIDTH) -> tuple[int, float, Plan]:
    """(total peak bytes, estimated extra seconds, plan) of a choice, exactly: the peak of the
    built plan plus the persistent state, and the extra time of its walk on the clock
    (:func:`.auto.plan_extra`: stalls on the link, recomputed steps)."""
    plan = build(program, choice, costs, bandwidth)
    return (program.persistent_bytes() + plan_peak(plan), plan_extra(plan, costs, bandwidth),
            plan)


def evaluate_placements(program: Program, choice: AutoChoice, costs: list[float],
                        bandwidth: float, budget: int) -> tuple[AutoChoice, int, float, Plan]:
    """``choice`` with the better release placement of its swapped blocks (when the copy ends,
    or one step after the offload — the placement the MILP's memory model assumes): the one
    that fits ``budget`` at less extra time, else the smaller peak. Returns (choice, peak,
    extra seconds, plan)."""
    out = None
    for early in (False, True) if choice.swapped else (False,):
        c = AutoChoice(set(choice.swapped), set(choice.dropped), early_release=early,
                       only=choice.only)
        peak, extra, plan = evaluate(program, c, costs, bandwidth)
        key = (peak > budget, extra if peak <= budget else peak)
        if out is None or key < out[0]:
            out = (key, c, peak, extra, plan)
    assert out is not None
    return out[1], out[2], out[3], out[4]


def enumerate_choices(program: Program, budget: int, costs: list[float], bandwidth: float,
                      swap_cost: dict[int, float], only: str | None, max_decisions: int,
                      ) -> tuple[AutoChoice | None, int] | None:
    """The best choice over every keep / swap / recompute assignment of a small program (the
    one of least estimated time that fits, else the least peak) and the number of decisions
    (2 ** that many plans built at most, twice); ``None`` when the program has more than
    ``max_decisions`` decisions or forces choices."""
    if block_choices(program):
        return None
    producer = forward_producers(program)
    drops = [] if only == "swap" else droppable_steps(program)
    swaps = sorted(swap_cost) if only != OnlyAction.RECOMPUTE else []
    n = len(drops) + len(swaps)
    if n > max_decisions:
        return None
    best = None
    for dmask in range(1 << len(drops)):
        dropped = {k for i, k in enumerate(drops) if dmask >> i & 1}
        for smask in range(1 << len(swaps)):
            swapped = {t for i, t in enumerate(swaps) if smask >> i & 1}
            if any(producer.get(t) in dropped for t in swapped):
                continue  # a recomputed map is not swapped
            choice, peak, extra, _ = evaluate_placements(
                program, AutoChoice(swapped, dropped, only=only), costs, bandwidth, budget)
            key = (peak > budget, extra if peak <= budget else peak, len(dropped) + len(swapped))
            if best is None or key < best[0]:
                choice.peak, choice.extra_time_s = peak, extra
                best = (key, choice)
    return (best[1] if best else None), n


def polish(program: Program, choice: AutoChoice, extra: float, budget: int,
           costs: list[float], swap_cost: dict[int, float], bandwidth: float,
           max_evaluations: int) -> tuple[AutoChoice, float, int, int]:
    """Remove actions while the exact plan still fits at no more estimated time (never those
    the network's blocks force), building ``max_evaluations`` plans at most."""
    blocks = block_choices(program)
    peak = -1
    moves = 0
    evaluations = 0
    improved = True
    while improved and evaluations < max_evaluations:
        improved = False
        acts = [("s", t) for t in choice.swapped - blocks.swapped] + \
            [("d", k) for k in choice.dropped - blocks.dropped]
        acts.sort(key=lambda a: -(swap_cost.get(a[1], 0.0) if a[0] == "s" else costs[a[1]]))
        for kind, x in acts:
            trial = AutoChoice(set(choice.swapped) - ({x} if kind == "s" else set()),
                               set(choice.dropped) - ({x} if kind == "d" else set()),
                               early_release=choice.early_release, only=choice.only)
            tpeak, textra, _ = evaluate(program, trial, costs, bandwidth)
            evaluations += 1
            if tpeak <= budget and textra <= extra:
                choice, extra, peak, improved = trial, textra, tpeak, True
                moves += 1
                break
            if evaluations >= max_evaluations:
                break
    return choice, extra, peak, moves

"""``auto`` with a budget: for every feature map kept for backward, choose keep / swap /
recompute so the iteration fits the budget at the least estimated time (Capuchin, moDNN, DTR).

The planner walks a greedy path from the plain ``reuse,inplace`` plan. At each point it looks
at the tensors live at the plan's peak and tries, for each, to swap it or to recompute the
layer that made it. A plan's extra time is that of its walk on the clock
(:func:`.cost_model.extra_time`): the steps at their costs, the swaps' copies queued on one
link per direction, compute waiting where a copy is late, the recomputed steps. Swapped blocks
are released once their offload has ended, as compute reaches it (vDNN), so a congested link
costs memory rather than time; when that path cannot reach the budget, the walk is run again
releasing each block one step after its offload (compute waits for the copy: time bought for
memory). It takes the action with the most peak reduction per second of extra time, and only
actions that lower the peak, so the peak falls strictly along the path. A budget stops the
walk at the first plan that fits; a smaller budget walks further, so the peak never rises as
the budget falls. Costs come from measured step times when there are any, else from FLOPs at
an assumed throughput. Offsets are then planned statically (no fragmentation: the budget is
the arena).
"""

from __future__ import annotations

import math
from dataclasses import replace

from ..cost.cost_model import extra_time
from ..ir.config import MemoryConfig, OnlyAction
from ..ir.liveness import root_of
from ..ir.names import Category, Phase, Role
from ..ir.plan import AutoChoice, Plan
from ..ir.program import Program
from ..passes.base_plan import base_plan, plan_peak
from ..passes.block_choices import block_choices
from ..passes.recompute import choose_checkpoints, dropping_program
from ..passes.static_plan import block_intervals, static_plan
from ..passes.swap import DEFAULT_BANDWIDTH, SwapCandidate, swap_candidates, swap_plan

#: FLOP/s assumed for compute before any step is measured (this class of CPU, float32 GEMM).
DEFAULT_FLOPS_PER_S = 2.0e10
#: The greedy search's work when ``max_evaluations`` is not given: this many program steps'
#: worth of plans built and priced, i.e. ``SEARCH_WORK // len(program.steps)`` plans (a plan's
#: build and pricing walks its program a few times, so its cost grows with the length).
#: ResNet-56 at batch 128 (398 steps) gets 1,256 plans: at 58,336,000 B on the v100 model its
#: walks use about 1,100 of them, 13 to 18 s on two CPU cores, and reach the plan (79.8 ms of extra
#: time) that the 20 s clock limit this replaces gave on a quiet machine (a loaded one got
#: less: 628 plans give 80.1 ms). No clock decides anything, so a plan is a function of the
#: program, the budget and the costs alone.
SEARCH_WORK = 500_000
_BASE = MemoryConfig.parse("reuse,inplace")


class BudgetTooSmall(MemoryError):
    """No plan fits the budget; the message gives the smallest peak reached and its parts."""


class BelowFloor(BudgetTooSmall):
    """The budget is under the peak floor of every plan (:mod:`.floor`): refused before any
    search. ``floor`` is the :class:`~.floor.PeakFloor`, ``budget`` the bytes asked for."""

    def __init__(self, floor, budget: int) -> None:
        super().__init__(floor.refusal(budget))
        self.floor = floor
        self.budget = budget


def step_costs(program: Program, step_times: list[float] | None,
               flops_per_s: float = DEFAULT_FLOPS_PER_S) -> list[float]:
    """Seconds per step of ``program``: measured when given (and of the right length), else
    from FLOPs at ``flops_per_s``."""
    if step_times is not None and len(step_times) == len(program.steps) and sum(step_times) > 0:
        return [float(t) for t in step_times]
    return [max(s.cost.flops, 1) / flops_per_s for s in program.steps]


def build(program: Program, choice: AutoChoice, costs: list[float] | None = None,
          bandwidth: float = DEFAULT_BANDWIDTH) -> Plan:
    """The plan for a choice: recompute rewrite, sharing and liveness, then swapping. With
    ``costs`` (seconds per step of ``program``) and unless ``choice.early_release``, swapped
    blocks are released when compute reaches the end of their offload on the link."""
    prog = dropping_program(program, choice.dropped)
    plan = base_plan(prog, _BASE)
    if choice.swapped:
        roots = {root_of(plan.aliases, t) for t in choice.swapped}
        timed = costs is not None and not choice.early_release
        plan = swap_plan(plan, "all", only=roots, bandwidth=bandwidth,
                         step_times=plan_costs(plan, costs) if timed else None,
                         cost_source="timed on the auto planner's step costs")
    return plan


def plan_costs(plan: Plan, costs: list[float]) -> list[float]:
    """Seconds per step of ``plan``'s program from ``costs`` of the program it was made from
    (a recomputation costs its forward step; steps a pass added, nothing)."""
    return [costs[s.cost.origin] if 0 <= s.cost.origin < len(costs) else 0.0
            for s in plan.program.steps]


def plan_extra(plan: Plan, costs: list[float], bandwidth: float) -> float:
    """Estimated seconds ``plan`` adds to an iteration (stalls on the link, recomputation)."""
    return extra_time(plan, plan_costs(plan, costs), bandwidth)





def _pressure(plan: Plan) -> tuple[int, int]:
    """(peak bytes, byte-steps): the peak, and the area under the live-bytes curve that breaks
    ties on a plateau (several steps at the peak)."""
    iv = block_intervals(plan)
    area = sum(size * (e - s) for s, e, size in iv.values())
    return plan_peak(plan), area


def _live_at_peak(plan: Plan) -> list[int]:
    """Original tensors (clones mapped back) whose blocks are live at the plan's peak."""
    iv = block_intervals(plan)
    events = sorted([(s, size, k) for k, (s, _, size) in iv.items()]
                    + [(e, -size, k) for k, (_, e, size) in iv.items()])
    live, best, best_t = 0, -1, 0
    for t, d, _ in events:
        live += d
        if live > best:
            best, best_t = live, t
    tensors = plan.program.tensors
    roots = {tid for (tid, _), (s, e, _) in iv.items() if s <= best_t < e}
    members = roots | {t for t in plan.aliases if root_of(plan.aliases, t) in roots}
    out = []
    for tid in sorted(members):
        t = tensors[tid]
        out.append(t.of if t.of >= 0 and t.role == Role.VALUE else tid)
    return out


class SearchWork:
    """Plans built and priced so far (``spent``) against the search's ``limit``: the only bound
    of the greedy walks (a walk stops at the first move that starts at or past its share)."""

    def __init__(self, limit: int):
        self.limit, self.spent = int(limit), 0

    def share(self, fraction: float) -> int:
        """The count at which a walk started now with ``fraction`` of the limit stops."""
        return min(self.limit, self.spent + math.ceil(fraction * self.limit))

    def build(self, program: Program, choice: AutoChoice, costs: list[float],
              bandwidth: float) -> Plan:
        """:func:`build`, counted."""
        self.spent += 1
        return build(program, choice, costs, bandwidth)


def default_evaluations(program: Program) -> int:
    """The plans the greedy search builds and prices at most when not told:
    :data:`SEARCH_WORK` program steps' worth, and never fewer than 64."""
    return max(64, SEARCH_WORK // max(1, len(program.steps)))


def forced_choice(program: Program, early_release: bool = False,
                  only: str | None = None) -> AutoChoice:
    """The choice the network's blocks force (:mod:`.block_choices`): where every planner's
    search starts, and what it never undoes."""
    blocks = block_choices(program)
    return AutoChoice(set(blocks.swapped), set(blocks.dropped), early_release=early_release,
                      only=only)


def auto_choose(program: Program, budget: int | None, step_times: list[float] | None = None,
                bandwidth: float = DEFAULT_BANDWIDTH,
                flops_per_s: float = DEFAULT_FLOPS_PER_S, max_moves: int = 400,
                max_candidates: int = 8, only: str | None = None,
                max_evaluations: int | None = None) -> AutoChoice:
    """Walk the greedy path until the total peak (persistent + iteration) fits ``budget``
    (``None``: walk to the end, the smallest peak this planner reaches). ``only``:
    ``"recompute"`` or ``"swap"`` restricts the actions.

    Swapped blocks are released when their copy has ended. When that path does not reach the
    budget (or, without one, to find a lower peak), a path starting from Chen et al.'s sqrt(n)
    checkpoints (segments of layers recomputed) is walked, then one releasing swapped blocks one
    step after the offload (from nothing, and from those checkpoints when they reached lower
    and it has not fitted); when the path taken
    costs time, a recompute-only path is walked too (a greedy swap can cost more than the
    recomputations it avoided), and the fitting path of least estimated time is taken. Each move
    tries the ``max_candidates`` largest feature maps live at the peak.

    The search is bounded by work, never by the clock, so the choice depends on the program,
    the budget and the costs only: at most ``max_moves`` moves per walk, and
    ``max_evaluations`` plans built and priced in all (default :func:`default_evaluations`:
    13 to 18 s on two CPU cores for ResNet-56 at batch 128; a move that starts within the
    limit finishes, so a walk may pass it by up to ``2 * max_candidates`` plans). The first
    walks get shares of it (a third or so each: deep networks), the one from every map swapped
    (below) what is left; where the limit stopped a path, ``choice.path`` says so."""
    costs = step_costs(program, step_times, flops_per_s)
    work = SearchWork(default_evaluations(program) if max_evaluations is None
                      else max_evaluations)

    def walk(early: bool, kind: str | None, start: set[int] | None = None,
             share: float = 1.0) -> AutoChoice:
        return _walk_path(program, budget, costs, bandwidth, early, max_moves, max_candidates,
                          work, work.share(share), kind, start)

    def key(c: AutoChoice) -> tuple:  # fits first, then the least time; else the least peak
        fits = budget is not None and c.peak <= budget
        return (not fits, c.extra_time_s if fits else c.peak)

    def unfit() -> bool:
        return key(min(paths, key=key))[0] and work.spent < work.limit

    paths = [walk(False, only, share=0.35)]
    seed = None
    if unfit() and only != "swap":
        # one layer at a time cannot reach what segments of layers reach (bottleneck blocks):
        # walk on from Chen's sqrt(n) checkpoints
        seed = sqrt_dropped(program)
        paths.append(walk(False, only, seed, share=0.3))
    can_swap = only != OnlyAction.RECOMPUTE and bool(swap_candidates(program, {}, "all"))
    if unfit() and can_swap:  # time bought for memory: compute waits for copies
        lower = seed is not None and paths[-1].peak < paths[0].peak
        # from nothing first: on deep networks swapped maps go far below what sqrt(n)'s
        # segments leave live during their recomputation (ResNet-50 b32: 1.18x the lower
        # bound against 2.04x); then from the checkpoints when they reached lower
        paths.append(walk(True, only, None, share=0.5 if lower else 1.0))
        if lower and unfit():
            paths.append(walk(True, only, seed))
    if budget is not None and can_swap and key(min(paths, key=key))[0]:
        # one swap per move is too slow on deep networks: from every map swapped, give back
        # the swaps the budget does not need (its first plan is built even past the limit)
        paths.append(_trim_path(program, budget, costs, bandwidth, only, work))
    if only is None and can_swap and budget is not None and work.spent < work.limit \
            and (key(min(paths, key=key))[0] or min(paths, key=key).extra_time_s > 0):
        paths.append(walk(False, "recompute"))  # a swap taken early can cost more later
    best = min(paths, key=key)
    best.only = only
    return best


def sqrt_dropped(program: Program) -> set[int]:
    """The forward steps Chen et al.'s sqrt(n) policy recomputes
    (:func:`.recompute.choose_checkpoints`): those whose value outputs are not all kept."""
    keep = choose_checkpoints(program, "sqrt")
    out = set()
    for st in program.steps:
        if st.phase != Phase.FORWARD or program.loss in st.access.writes:
            continue
        values = [t for t in st.access.writes if program.tensors[t].role == Role.VALUE]
        if values and not set(values) <= keep:
            out.add(st.index)
    return out


def _swappable(program: Program) -> list[SwapCandidate]:
    """The swap candidates with idle time between their uses (the swap pass's lag plus two
    steps), which the walks may swap."""
    return [c for c in swap_candidates(program, {}, "all")
            if c.first_backward - c.last_forward >= 3]


def _trim_path(program: Program, budget: int, costs: list[float], bandwidth: float,
               only: str | None, work: SearchWork | float | None = None) -> AutoChoice:
    """The path down from the top: every swappable feature map swapped, each block released
    one step after its offload (vDNN_all's memory); then, largest first, each swap the budget
    does not need is given back when that saves time, while ``work`` has plans left (without
    a :class:`SearchWork`, e.g. the deadline this took before, the path runs to its end: one
    plan per swappable map)."""
    if not isinstance(work, SearchWork):
        work = SearchWork(len(program.tensors) + 1)
    blocks = block_choices(program)
    choice = forced_choice(program, True, only)
    free = [c for c in _swappable(program) if c.root not in blocks.fixed]
    choice.swapped |= {c.root for c in free}
    persistent = program.persistent_bytes()
    top = work.build(program, choice, costs, bandwidth)
    choice.peak = persistent + plan_peak(top)
    choice.extra_time_s = plan_extra(top, costs, bandwidth)
    choice.path.append(("swap", f"all {len(free)} feature maps that can be", choice.peak,
                        choice.extra_time_s))
    if choice.peak > budget:
        return choice
    for c in sorted(free, key=lambda c: -c.nbytes):
        if work.spent >= work.limit:
            choice.path.append(("stopped", f"search limit of {work.limit} plans", 0, 0.0))
            break
        trial = AutoChoice(choice.swapped - {c.root}, set(choice.dropped), early_release=True,
                           only=only)
        plan = work.build(program, trial, costs, bandwidth)
        peak = persistent + plan_peak(plan)
        if peak > budget:
            continue
        extra = plan_extra(plan, costs, bandwidth)
        if extra < choice.extra_time_s:
            trial.peak, trial.extra_time_s = peak, extra
            trial.path = choice.path + [("keep", program.tensors[c.root].name, peak, extra)]
            choice = trial
    return choice


def _walk_path(program: Program, budget: int | None, costs: list[float], bandwidth: float,
               early_release: bool, max_moves: int, max_candidates: int, work: SearchWork,
               until: int, only: str | None = None,
               start: set[int] | None = None) -> AutoChoice:
    """One greedy path (see :func:`auto_choose`), from the forced choice plus ``start``
    (forward steps to drop whose maps the blocks leave free); no move starts once ``work`` has
    built ``until`` plans."""
    persistent = program.persistent_bytes()
    producer = {t: st for st in program.steps if st.phase == Phase.FORWARD
                for t in st.access.writes}
    loss_step = producer.get(program.loss)
    cands = {c.root for c in _swappable(program)}
    blocks = block_choices(program)  # the user's choices: fixed, never revisited
    choice = forced_choice(program, early_release, only)
    if start:
        free = {k for k in start
                if not any(t in blocks.fixed for t in program.steps[k].access.writes)}
        choice.dropped |= free
    plan = work.build(program, choice, costs, bandwidth)
    peak0, area = _pressure(plan)
    choice.peak = persistent + peak0
    if start:
        choice.extra_time_s = plan_extra(plan, costs, bandwidth)
        choice.path.append(("recompute", f"{len(choice.dropped)} layers between sqrt(n) "
                            "checkpoints", choice.peak, choice.extra_time_s))
    for _ in range(max_moves):
        if budget is not None and choice.peak <= budget:
            break
        if work.spent >= until:
            choice.path.append(("stopped", f"search limit of {work.limit} plans", 0, 0.0))
            break
        best = None
        live = [t for t in dict.fromkeys(_live_at_peak(plan))  # clones of stashes: not ours
                if t < len(program.tensors) and program.tensors[t].role == Role.VALUE
                and t not in blocks.fixed]
        live.sort(key=lambda t: -program.tensors[t].nbytes)
        for t in live[:max_candidates]:
            spec = program.tensors[t]
            if spec.role != Role.VALUE \
                    or spec.category not in (Category.FEATURE_MAP, Category.INPUT):
                continue
            options = []
            if t in cands and t not in choice.swapped and only != OnlyAction.RECOMPUTE:
                options.append("swap")
            st = producer.get(t)
            if st is not None and st is not loss_step and spec.category == Category.FEATURE_MAP \
                    and st.index not in choice.dropped and only != "swap":
                options.append("recompute")
            for kind in options:
                trial = AutoChoice(set(choice.swapped), set(choice.dropped),
                                   early_release=early_release, only=only)
                if kind == "swap":
                    trial.swapped.add(t)
                else:
                    trial.dropped.add(producer[t].index)
                tplan = work.build(program, trial, costs, bandwidth)
                tpeak, tarea = _pressure(tplan)
                peak = persistent + tpeak
                if peak > choice.peak or (peak == choice.peak and tarea >= area):
                    continue  # the peak never rises; on a plateau the area must fall
                total = plan_extra(tplan, costs, bandwidth)
                extra = max(0.0, total - choice.extra_time_s)
                # peak reductions first; area reductions only break ties on a plateau
                score = ((choice.peak - peak) / (extra + 1e-9), (area - tarea) / (extra + 1e-9))
                if best is None or score > best[0]:
                    best = (score, kind, t, extra, total, trial, tplan, peak, tarea)
        if best is None:
            break
        _, kind, t, extra, total, trial, tplan, peak, area = best
        trial.extra_time_s = total
        trial.peak = peak
        trial.path = [p for p in choice.path if p[0] != "stopped"] + [
            (kind, program.tensors[t].name, peak, extra)]
        choice, plan = trial, tplan
    return choice


def auto_plan(program: Program, budget: int | None, step_times: list[float] | None = None,
              cost_source: str = "measured step times", bandwidth: float = DEFAULT_BANDWIDTH,
              flops_per_s: float = DEFAULT_FLOPS_PER_S, **kwargs) -> Plan:
    """The auto plan for ``budget`` (static offsets, notes saying what was chosen).

    Raises :class:`BudgetTooSmall` when even the end of the path does not fit."""
    choice = auto_choose(program, budget, step_times, bandwidth, flops_per_s, **kwargs) \
        if budget is not None \
        else replace(forced_choice(program), peak=program.persistent_bytes()
                     + plan_peak(build(program, forced_choice(program))))
    return plan_for_choice(program, budget, choice, step_times, cost_source, bandwidth,
                           flops_per_s)


def plan_for_choice(program: Program, budget: int | None, choice: AutoChoice,
                    step_times: list[float] | None = None,
                    cost_source: str = "measured step times",
                    bandwidth: float = DEFAULT_BANDWIDTH,
                    flops_per_s: float = DEFAULT_FLOPS_PER_S) -> Plan:
    """The auto plan of a planner's ``choice`` (static offsets, notes); raises
    :class:`BudgetTooSmall` when the choice does not fit ``budget``. ``step_times`` (or FLOPs
    at ``flops_per_s``) and ``bandwidth`` time the swaps as the planner did."""
    plan = build(program, choice, step_costs(program, step_times, flops_per_s), bandwidth)
    measured = step_times is not None and len(step_times) == len(program.steps)
    if budget is not None and choice.peak > budget:
        smallest = choice  # the walk ended without fitting: this is the smallest peak
        by_cat: dict[str, int] = {"persistent": program.persistent_bytes()}
        raise BudgetTooSmall(
            f"no plan fits the budget of {budget:,} B: the smallest peak the auto planner "
            f"reaches is {smallest.peak:,} B ({smallest.peak / 2**20:.1f} MiB: "
            f"{by_cat['persistent']:,} B of parameters, gradients and optimizer state, "
            f"{smallest.peak - by_cat['persistent']:,} B of feature maps, gradient maps and "
            f"workspace after swapping {len(smallest.swapped)} and recomputing "
            f"{len(smallest.dropped)} feature maps); "
            + ("the persistent state alone exceeds the budget" if by_cat["persistent"] >= budget
               else "a larger budget, a smaller batch or batch splitting (split=K) would fit"))
    plan = static_plan(plan, base=program.persistent_bytes())
    how = cost_source if measured else "cost model: FLOPs at an assumed rate"
    plan = plan.with_notes(
        f"auto: budget {budget:,} B; {len(choice.swapped)} feature maps swapped, "
        f"{len(choice.dropped)} layers recomputed"
        + (f" ({choice.only} only)" if choice.only else "") + "; estimated overhead "
        f"{1000 * choice.extra_time_s:.1f} ms per iteration ({how})"
        + ("; swapped blocks released one step after their offload (compute waits for the "
           "copy)" if choice.early_release and choice.swapped else "")
        if budget is not None else "auto without a budget: reuse,inplace,static", first=True)
    blocks = block_choices(program)
    if blocks:
        plan = plan.with_notes(blocks.describe())
    return replace(plan, provenance=replace(plan.provenance, measured=measured, auto=choice))

"""``auto,planner=optimal``: the keep / swap / recompute choice of :mod:`.auto` made by a
mixed-integer program instead of a greedy walk — Checkmate's idea (Jain et al. 2020: binary
recompute / keep decisions, memory at every stage under the budget, the least added compute)
extended with swapping, and restricted to the schedules :func:`.auto.build` makes, so the same
executor runs the result. The program itself is :mod:`.optimal_model`; this module solves it.

Every solution is priced exactly as the greedy planner prices its choices (the cost model's
walk of the built plan); one the model priced lower is cut off and the MILP re-solved while its
objective stays below the best checked time. The model approximates the allocator (sharing is
the decision-free plan's; prefetches land within a step or two of where the model puts them), so
every solution is checked with :func:`.auto.build` and :func:`.base_plan.plan_peak`: one that
does not fit is cut off and (after a few rounds) the budget lowered by the excess at the
position of its true peak, then re-solved. Memory over the budget is allowed at a prohibitive
price, so every solve returns a solution and overflow means the model finds nothing that fits.
Large programs get the whole MILP only up to a size (:data:`WHOLE_MAX_CONSTRAINTS`), then
windows of consecutive layers are re-solved with every other decision fixed to the best
checked choice (starting from the greedy one). The checked best is polished (actions whose
removal still fits at no more time are removed); the greedy choice is the fallback, and
:func:`optimal_plan` takes the optimal choice only when it fits at no more estimated time than
the greedy one.

Every search is bounded by work, never by the clock, so the choice is a function of the
program, the budget, the costs and the link: HiGHS gets a branch-and-bound node limit per solve
and no time limit (its search is deterministic for a given model and options; its random seed
is pinned at 0), the solves of the whole MILP and the windows are counted, all from the model's
size (:data:`NODE_WORK`), and the polish builds a bounded number of plans. The notes report the
work done (solves, nodes), not seconds.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp

from ..ir.plan import ENDS, STARTS, AutoChoice, Plan
from ..ir.program import Program
from ..passes.base_plan import plan_peak
from ..passes.block_choices import block_choices
from ..passes.swap import DEFAULT_BANDWIDTH, swap_candidates
from .auto import (
    DEFAULT_FLOPS_PER_S,
    auto_choose,
    auto_plan,
    build,
    default_evaluations,
    deprecated_time_limit,
    plan_extra,
    plan_for_choice,
    step_costs,
)
from .optimal_model import Model, Unsupported, build_model, droppable_steps, swap_costs

__all__ = ["Unsupported", "evaluate", "evaluate_placements", "optimal_choose", "optimal_plan",
           "price_cut", "swap_costs"]

#: Objective per memory unit over the budget (the objective counts iterations).
OVERFLOW_COST = 1e4
#: Above this many decisions, windows of WINDOW_STEPS consecutive forward steps are re-solved
#: after the whole MILP.
FULL_SOLVE_BINARIES = 160
WINDOW_STEPS = 32
#: The work limits, in HiGHS branch-and-bound nodes and solves. A node's work grows with the
#: model's constraints (its LP), so the limits are work budgets divided by the constraints:
#: per solve of the whole MILP NODE_WORK / constraints nodes (WHOLE_NODES at most), at most
#: ROUND_WORK / constraints solves of it (2 at least: one per placement model, ``max_rounds``
#: at most), WINDOW_WORK / constraints windows (1 at least) of WINDOW_NODES nodes each. The
#: root node (presolve, cuts, heuristics) always runs to its end: no node limit bounds it, and
#: on large models it dominates (on two cores: ResNet-20 at batch 128, 28,000 constraints,
#: 13 to 34 s; ResNet-32, 59,000: 68 to 151 s; ResNet-56, 118,000: 328 s), so the whole MILP
#: is solved only up to WHOLE_MAX_CONSTRAINTS (a window's root, mostly fixed variables: 15 s
#: CPU on ResNet-56). Calibrated so that ResNet-56 at batch 128 on the v100 model takes about
#: the minute the former 60 s clock limit gave.
NODE_WORK = 250_000
WHOLE_NODES = 1000
ROUND_WORK = 100_000
WHOLE_MAX_CONSTRAINTS = 40_000
WINDOW_WORK = 360_000
WINDOW_NODES = 50


# ---------------------------------------------------------------- exact prices of a choice


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


# ---------------------------------------------------------------- solving

def _solve(model: Model, node_limit: int, gap: float, fixed: dict[int, float] | None = None):
    """HiGHS on the model (``fixed``: variables pinned to values), bounded by ``node_limit``
    branch-and-bound nodes and by nothing else: no time limit, HiGHS's random seed pinned, so
    the result depends on the model alone."""
    lp = model.lp
    lo = np.array([r[1] for r in lp.rows])
    hi = np.array([r[2] for r in lp.rows])
    lb, ub = np.array(lp.lb), np.array(lp.ub)
    for v, x in (fixed or {}).items():
        lb[v] = ub[v] = x
    with warnings.catch_warnings():
        # scipy passes the options it does not know (random_seed) to HiGHS with a warning
        warnings.filterwarnings("ignore", "Unrecognized options", RuntimeWarning)
        return milp(c=np.array(lp.cost), integrality=np.array(lp.integer),
                    bounds=Bounds(lb, ub), constraints=[LinearConstraint(lp.matrix(), lo, hi)],
                    options={"node_limit": max(1, int(node_limit)), "disp": False,
                             "mip_rel_gap": gap, "random_seed": 0})


def _status(res) -> str:
    """A solve's status in words (HiGHS's solution limit, status 16, is its node limit; no
    time limit is ever set, so scipy's status 1 is an iteration limit)."""
    if res.status == 0:
        return "optimal"
    if res.status == 2:
        return "infeasible"
    if "Status 16" in str(res.message):
        return "node limit"
    if res.status == 1:
        return "iteration limit"
    return str(res.message)


def _choice_of(model: Model, x: np.ndarray) -> AutoChoice:
    return AutoChoice(swapped={t for t, v in model.swap.items() if x[v] > 0.5},
                      dropped={k for k, v in model.drop.items() if x[v] > 0.5})


def _no_good(model: Model, choice: AutoChoice) -> None:
    """Cut off exactly this assignment of the decisions."""
    terms, ones = [], 0
    for k, v in model.drop.items():
        terms.append((v, -1.0 if k in choice.dropped else 1.0))
        ones += k in choice.dropped
    for t, v in model.swap.items():
        terms.append((v, -1.0 if t in choice.swapped else 1.0))
        ones += t in choice.swapped
    model.lp.ge(terms, 1.0 - ones)


def price_cut(model: Model, choice: AutoChoice, stall: float) -> bool:
    """Teach the model a swap set's price on the clock: any solution swapping every map of
    ``choice`` has swap time (the link variable) at least ``stall`` (objective units), the
    stall its built plan showed. (More swaps queue behind the same copies, so the set's stall
    is a lower bound for its supersets as long as the recomputed steps stay alike: a heuristic
    cut, checked like everything else.) Returns False when there is nothing to add."""
    if model.link is None or not choice.swapped or stall <= 0.0:
        return False
    swaps = [model.swap[t] for t in choice.swapped if t in model.swap]
    if len(swaps) != len(choice.swapped):
        return False
    # z >= stall * (sum s_t - |S| + 1)
    model.lp.ge([(model.link, 1.0)] + [(v, -stall) for v in swaps], stall * (1 - len(swaps)))
    return True


def _peak_position(model: Model, plan: Plan) -> int:
    """The model position of the built plan's peak (the step running when it is reached; a
    recomputation maps to the region before the backward step it precedes)."""
    steps = plan.program.steps
    live, best, where = 0, -1, 0
    sizes = {}
    for pos, a in plan.actions():
        if a.tensor in plan.aliases:
            continue
        if isinstance(a, STARTS):
            sizes[a.tensor] = plan.program.block_size(plan.program.tensors[a.tensor].nbytes)
            live += sizes[a.tensor]
            if live > best:
                best, where = live, pos
        elif isinstance(a, ENDS) and a.tensor in sizes:
            live -= sizes.pop(a.tensor)
    where = min(max(where, 0), len(steps) - 1)
    st = steps[where]
    if st.phase == "recompute":
        nxt = next((s for s in steps[where:] if s.phase == "backward"), None)
        if nxt is not None:
            return model.region_pos.get(nxt.origin, model.pos_of_step[nxt.origin])
    return model.pos_of_step.get(st.origin, 0)


def _fix_blocks(model: Model, program: Program) -> None:
    """Fix the decisions the network's blocks force (:mod:`.block_choices`): a forced
    recompute is d=1, a forced swap s=1 where the model can swap the map (and d=0 for its
    producer), a kept feature map neither. Raises :class:`Unsupported` when the model has no
    decision for a forced recompute (the greedy planner, which honours it, decides)."""
    blocks = block_choices(program)
    producer = {t: s.index for s in program.steps if s.phase == "forward" for t in s.writes}
    fixed: dict[int, float] = {}
    for k in blocks.dropped:
        if k not in model.drop:
            raise Unsupported(f"no recompute decision for {program.steps[k].layer}, which a "
                              "block forces to recompute")
        fixed[model.drop[k]] = 1.0
    for t in blocks.swapped & model.swap.keys():  # others: nothing to swap (as in greedy)
        fixed[model.swap[t]] = 1.0
    for t in blocks.swapped | blocks.kept | blocks.recomputed:
        if t in model.swap and t not in blocks.swapped:
            fixed[model.swap[t]] = 0.0
        if producer.get(t) in model.drop and t not in blocks.recomputed:
            fixed[model.drop[producer[t]]] = 0.0
    for v, x in fixed.items():
        model.lp.lb[v] = model.lp.ub[v] = x


def _polish(program: Program, choice: AutoChoice, extra: float, budget: int,
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


#: Programs with at most this many decisions (and no block choices) are searched exhaustively:
#: every plan built and priced exactly, so the choice is optimal under the exact pricing.
EXHAUSTIVE_DECISIONS = 10


def _enumerate(program: Program, budget: int, costs: list[float], bandwidth: float,
               swap_cost: dict[int, float], only: str | None,
               ) -> tuple[AutoChoice | None, int] | None:
    """The best choice over every keep / swap / recompute assignment of a small program (the
    one of least estimated time that fits, else the least peak) and the number of decisions
    (2 ** that many plans built at most, twice); ``None`` when the program is too large or
    forces choices."""
    if block_choices(program):
        return None
    producer = {t: s.index for s in program.steps if s.phase == "forward" for t in s.writes}
    drops = [] if only == "swap" else droppable_steps(program)
    swaps = sorted(swap_cost) if only != "recompute" else []
    n = len(drops) + len(swaps)
    if n > EXHAUSTIVE_DECISIONS:
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


def optimal_choose(program: Program, budget: int, costs: list[float],
                   bandwidth: float = DEFAULT_BANDWIDTH, time_limit_s: float | None = None,
                   greedy: AutoChoice | None = None, mip_rel_gap: float = 1e-6,
                   max_rounds: int = 12, window: int | None = None,
                   only: str | None = None, node_limit: int | None = None,
                   window_node_limit: int | None = None, max_windows: int | None = None,
                   max_evaluations: int | None = None) -> AutoChoice:
    """The keep / swap / recompute choice of least estimated extra time whose plan fits
    ``budget`` (total bytes, persistent state included), from the MILP of this module (by
    exhaustive search up to :data:`EXHAUSTIVE_DECISIONS` decisions).

    ``costs`` are seconds per step (:func:`.auto.step_costs`). Small programs (up to
    :data:`FULL_SOLVE_BINARIES` decisions) are solved whole; larger ones are solved whole up to
    :data:`WHOLE_MAX_CONSTRAINTS` constraints, then windows of :data:`WINDOW_STEPS` consecutive
    layers are re-solved with every other decision fixed to the best checked choice so far
    (starting from ``greedy``'s, computed here when not given), ``max_windows`` solves at
    most. Every solution is checked on the built plan and priced by its
    walk on the clock (:func:`evaluate`); a solution the model priced below that is cut off and
    the MILP solved again while its objective stays below the best checked time, ``max_rounds``
    solves of the whole MILP at most. ``choice.path`` records each solve (status, nodes,
    objective, bound, gap) and the decisions. When nothing checked beats the greedy choice, it
    is returned with a ``("fallback", why, ...)`` entry last.

    The search is bounded by work only, so the choice is the same on any machine at any load
    (the defaults, from the model's size, are described at :data:`NODE_WORK`):
    ``node_limit`` branch-and-bound nodes per solve of the whole MILP, ``window_node_limit``
    per window, ``max_windows`` windows, and ``max_evaluations`` plans built by the polish
    (default a quarter of :func:`.auto.default_evaluations`). ``time_limit_s`` is deprecated
    and ignored."""
    deprecated_time_limit(time_limit_s, "node_limit, max_windows, max_rounds")
    polish_limit = (max(16, default_evaluations(program) // 4) if max_evaluations is None
                    else max_evaluations)
    persistent = program.persistent_bytes()
    swap_cost = {} if only == "recompute" else swap_costs(program, costs, bandwidth)
    unit = max(sum(costs), 1e-30)  # the objective in iterations: well-scaled for HiGHS
    if greedy is None:
        greedy = auto_choose(program, budget, costs, bandwidth=bandwidth)
    g_peak, g_extra, _ = evaluate(program, greedy, costs, bandwidth)

    def fallback(why: str, log: list[tuple[str, str, int, float]]) -> AutoChoice:
        g = AutoChoice(set(greedy.swapped), set(greedy.dropped), greedy.extra_time_s,
                       greedy.peak, list(greedy.path) + log, greedy.early_release, only)
        g.path.append(("fallback", f"greedy choice kept: {why}", g.peak, g.extra_time_s))
        return g

    if g_peak <= budget and g_extra <= 0.0:
        return fallback("it fits at no estimated extra time, which nothing beats", [])
    small = _enumerate(program, budget, costs, bandwidth, swap_cost, only)
    if small is not None:
        choice, n = small
        if choice is None or choice.peak > budget:
            return fallback(f"no plan fits (exhaustive search over {n} decisions)", [])
        if g_peak <= budget and g_extra <= choice.extra_time_s:
            return fallback(f"exhaustive search over {n} decisions finds nothing faster", [])
        choice.path += [("swap", program.tensors[t].name, choice.peak, swap_cost.get(t, 0.0))
                        for t in sorted(choice.swapped)]
        choice.path += [("recompute", program.steps[k].layer, choice.peak, costs[k])
                        for k in sorted(choice.dropped)]
        choice.path.append(("milp", f"exhaustive search over {n} decisions ({2 ** n} plans, "
                                    "each built and priced exactly); gap 0.00 % for the choice",
                            choice.peak, choice.extra_time_s))
        return choice
    copy_cost = {c.root: c.nbytes / bandwidth / unit for c in swap_candidates(program, {}, "all")}

    def make_model(early_release: bool) -> tuple[Model, int]:
        """The MILP with swapped blocks placed as the timed swap plan places them, or released
        one step after their offload; and its overflow variable: memory over the budget is
        allowed at a prohibitive price, so every (sub)problem has a solution, and one with
        overflow says the model finds no plan that fits."""
        model = build_model(program, [c / unit for c in costs],
                            {t: c / unit for t, c in swap_cost.items()}, budget - persistent,
                            window, copy_cost, allow_drop=only != "swap",
                            early_release=early_release)
        _fix_blocks(model, program)
        overflow = model.lp.var(ub=math.inf, cost=OVERFLOW_COST, name="overflow")
        for row in [*model.mem_rows, *(r for rs in model.region_rows.values() for r in rs)]:
            terms, lo, hi = model.lp.rows[row]
            model.lp.rows[row] = ([*terms, (overflow, -1.0)], lo, hi)
        return model, overflow

    try:
        model, overflow = make_model(False)
    except Unsupported as e:
        return fallback(f"the optimal planner does not model this program ({e})", [])
    log: list[str] = []
    nodes = 0  # branch-and-bound nodes of every solve
    best: tuple[float, AutoChoice, int, str] | None = None
    if g_peak <= budget:
        best = (g_extra, greedy, g_peak, "greedy")
    large = model.stats["binaries"] > FULL_SOLVE_BINARIES
    rows = max(1, model.stats["constraints"])
    whole = rows <= WHOLE_MAX_CONSTRAINTS
    whole_nodes = min(WHOLE_NODES, max(1, NODE_WORK // rows)) if node_limit is None \
        else node_limit
    rounds = min(max_rounds, max(2, ROUND_WORK // rows)) if whole else 0
    window_nodes = WINDOW_NODES if window_node_limit is None else window_node_limit
    windows_left = max(1, WINDOW_WORK // rows) if max_windows is None else max_windows
    whole_bound: float | None = None  # the whole MILP's dual bound (seconds)

    def check(res, what: str, rnd: int) -> str:
        """Read, check and log a solution: 'fits', 'over' (cut off) or 'none'."""
        nonlocal best, whole_bound, nodes
        if what.startswith("whole") and getattr(res, "mip_dual_bound", None) is not None:
            whole_bound = float(res.mip_dual_bound) * unit
        status = _status(res)
        n = int(getattr(res, "mip_node_count", None) or 0)
        nodes += n
        if res.x is None:
            log.append(f"{what}: {status} after {n} nodes, no solution")
            return "none"
        gap = getattr(res, "mip_gap", None)
        bound = getattr(res, "mip_dual_bound", None)
        head = (f"{what}: {status} after {n} nodes, objective {1000 * res.fun * unit:.3f} ms"
                + (f", bound {1000 * bound * unit:.3f} ms, gap {100 * gap:.2f} %"
                   if gap is not None and bound is not None and res.x[overflow] <= 1e-9 else ""))
        if res.x[overflow] > 1e-9:
            log.append(f"{head}; no plan fits in the model (over by "
                       f"{res.x[overflow] * model.mem_unit:,.0f} B)")
            return "none"
        choice, peak, extra, plan = evaluate_placements(program, _choice_of(model, res.x), costs,
                                                        bandwidth, budget)
        log.append(f"{head}; {len(choice.swapped)} swaps, {len(choice.dropped)} drops: checked "
                   f"peak {peak:,} B ({'fits' if peak <= budget else f'{peak - budget:,} B over'}"
                   f"), estimated {1000 * extra:.3f} ms")
        if peak <= budget:
            stall = extra - sum(costs[s.origin] for s in plan.program.steps
                                if s.phase == "recompute" and 0 <= s.origin < len(costs))
            if model.link is not None and stall / unit > res.x[model.link] * (1 + 1e-6) + 1e-9:
                price_cut(model, choice, stall / unit)
            if best is None or extra < best[0] or best[3] == "greedy" and extra <= best[0]:
                best = (extra, choice, peak, "milp")
            return "fits"
        # the model under-estimated this plan's memory: cut it off, and (after a few exact
        # cuts alone) lower the budget at the position of its true peak by the excess
        _no_good(model, choice)
        if rnd >= 2:
            q = _peak_position(model, plan)
            for row in [model.mem_rows[q], *model.region_rows.get(q, ())]:
                terms, lo, hi = model.lp.rows[row]
                model.lp.rows[row] = (terms, lo, hi - (peak - budget) / model.mem_unit)
        return "over"

    # the whole MILP (up to WHOLE_MAX_CONSTRAINTS); when the model with blocks released
    # as their copies end fits nothing, the one releasing them early (compute waits for the
    # copies: more time, less memory) gets the rounds left
    placement = "timed"

    def early_next() -> bool:
        """Whether to leave the timed model for the early one: it has swaps and nothing it
        gave fits (the greedy choice, when it fits, costs time: else it was returned above)."""
        return placement == "timed" and bool(model.swap) and (best is None or best[3] == "greedy")

    for r in range(rounds):
        # half the rounds for the timed model while nothing it gave fits
        if r >= max(1, rounds // 2) and early_next():
            placement = "early"
            model, overflow = make_model(True)
        res = _solve(model, whole_nodes, mip_rel_gap)
        verdict = check(res, f"whole MILP ({placement} release), round {r + 1}", r)
        if verdict == "none" and early_next():
            placement = "early"
            model, overflow = make_model(True)
            continue
        if verdict == "fits" and best is not None and res.fun * unit < best[0] * (1 - 1e-9):
            # the model priced this choice below its walk on the clock (queued copies): cut it
            # off and look again while the model still sees something cheaper than the best
            _no_good(model, _choice_of(model, res.x))
            continue
        if verdict != "over":
            break
    if not whole and model.swap and greedy.early_release:
        placement = "early"  # the windows start from the greedy choice: model its placement
        model, overflow = make_model(True)
    # windows of consecutive layers re-solved around the best checked choice
    n_windows = 0
    if (large or not whole) and best is not None:
        producer = {t: s.index for s in program.steps if s.phase == "forward" for t in s.writes}
        nf = max(model.drop, default=0) + 1
        starts = list(range(0, nf, WINDOW_STEPS // 2))
        improved = True
        while improved and best[0] > 0.0 and n_windows < windows_left:
            improved = False
            for a in starts:
                if n_windows >= windows_left or best[0] <= 0.0:
                    break
                inc = best[1]
                b = a + WINDOW_STEPS
                fixed = {v: float(k in inc.dropped) for k, v in model.drop.items()
                         if not a <= k < b}
                fixed.update({v: float(t in inc.swapped) for t, v in model.swap.items()
                              if not a <= producer.get(t, 0) < b})
                res = _solve(model, window_nodes, mip_rel_gap, fixed)
                before = best[0]
                n_windows += 1
                check(res, f"window {a}-{min(b, nf) - 1}", 3)
                improved |= best[0] < before - 1e-12 * max(before, 1e-30)
    polish_moves = 0
    if best is not None and best[3] != "greedy":
        extra, choice, peak, src = best
        choice, extra, ppeak, polish_moves = _polish(program, choice, extra, budget, costs,
                                                     swap_cost, bandwidth, polish_limit)
        best = (extra, choice, ppeak if ppeak >= 0 else peak, src)
    st = model.stats
    if whole_bound is not None and best is not None:
        lb = max(whole_bound, 0.0)
        gap_pct = 100 * max(0.0, 1 - lb / best[0]) if best[0] > 0 else 0.0
        bound_text = (f"; whole-program bound {1000 * lb:.3f} ms, gap {gap_pct:.2f} % for the "
                      "choice")
    else:
        bound_text = "; no whole-program bound"
    summary = (f"MILP of {st['variables']:,} variables ({st['binaries']} binary), "
               f"{st['constraints']:,} constraints, segments up to {st['window'] + 1} steps; "
               f"{len(log)} solve(s)" + (f" ({n_windows} windows)" if n_windows else "")
               + f", {nodes:,} nodes in all"
               + ("" if whole else f" (no whole MILP above {WHOLE_MAX_CONSTRAINTS:,} "
                                   "constraints)")
               + (f"; polished by removing {polish_moves} action(s)" if polish_moves else "")
               + bound_text)
    entries = [("solve", s, 0, 0.0) for s in log] + [("milp", summary, 0, 0.0)]
    if best is None or best[3] == "greedy":
        why = ("no checked MILP solution fits" if best is None
               else "no checked MILP solution fits at less estimated time")
        return fallback(why + (f" ({log[-1]})" if log else ""), entries)
    extra, choice, peak, _ = best
    out = AutoChoice(set(choice.swapped), set(choice.dropped), extra, peak,
                     early_release=choice.early_release, only=only)
    for t in sorted(choice.swapped):
        out.path.append(("swap", program.tensors[t].name, peak, swap_cost.get(t, 0.0)))
    for k in sorted(choice.dropped):
        out.path.append(("recompute", program.steps[k].layer, peak, costs[k]))
    out.path += [(kind, text, peak, extra) for kind, text, _, _ in entries]
    return out


def optimal_plan(program: Program, budget: int | None, step_times: list[float] | None = None,
                 bandwidth: float = DEFAULT_BANDWIDTH, flops_per_s: float = DEFAULT_FLOPS_PER_S,
                 cost_source: str = "measured step times", time_limit_s: float | None = None,
                 **greedy_kwargs) -> Plan:
    """``auto`` with ``planner=optimal``: both the greedy and the optimal choice are made and
    the optimal one is taken only when it fits at no more estimated time; the notes say which.
    Raises :class:`~.auto.BudgetTooSmall` as the greedy planner does when neither fits. Both
    searches are bounded by work (:func:`optimal_choose`, :func:`.auto.auto_choose`);
    ``time_limit_s`` is deprecated and ignored."""
    deprecated_time_limit(time_limit_s, "node_limit, max_windows, max_rounds")
    if budget is None:
        return auto_plan(program, None, step_times, cost_source, bandwidth, flops_per_s)
    costs = step_costs(program, step_times, flops_per_s)
    greedy = auto_choose(program, budget, step_times, bandwidth, flops_per_s, **greedy_kwargs)
    g_peak, g_extra, _ = evaluate(program, greedy, costs, bandwidth)
    opt = optimal_choose(program, budget, costs, bandwidth, greedy=greedy,
                         only=greedy_kwargs.get("only"))
    why = next((p[1] for p in opt.path if p[0] == "fallback"), None)
    milp_note = next((p[1] for p in opt.path if p[0] == "milp"), "no MILP solved")
    take = why is None and opt.peak <= budget and (g_peak > budget
                                                   or opt.extra_time_s <= g_extra)
    picked = opt if take else greedy
    plan = plan_for_choice(program, budget, picked, step_times, cost_source, bandwidth,
                           flops_per_s)
    g_text = (f"greedy {1000 * g_extra:.1f} ms" if g_peak <= budget
              else f"greedy does not fit (smallest peak {g_peak:,} B)")
    if take:
        verdict = (f"optimal choice taken (estimated overhead {1000 * opt.extra_time_s:.1f} ms, "
                   f"{g_text} per iteration)")
    else:
        verdict = f"{why or 'greedy choice kept'} ({g_text} per iteration)"
    return plan.with_notes(f"planner=optimal: {verdict}; {milp_note}")

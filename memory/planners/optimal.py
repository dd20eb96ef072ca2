"""``auto,planner=optimal``: the keep / swap / recompute choice of :mod:`.auto` made by a
mixed-integer program instead of a greedy walk — Checkmate's idea (Jain et al. 2020: binary
recompute / keep decisions, memory at every stage under the budget, the least added compute)
extended with swapping, and restricted to the schedules :func:`.auto.build` makes, so the same
executor runs the result. The program itself is :mod:`.optimal_model`; this module searches
with it, stage by stage (HiGHS and cuts: :mod:`.optimal_solve`; prices: :mod:`.optimal_exact`).

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
from dataclasses import dataclass, field

from ..ir.config import OnlyAction
from ..ir.names import Phase
from ..ir.plan import AutoChoice, Plan
from ..ir.program import Program
from ..passes.block_choices import block_choices
from ..passes.swap import DEFAULT_BANDWIDTH, swap_candidates
from .auto import (
    DEFAULT_FLOPS_PER_S,
    auto_choose,
    auto_plan,
    default_evaluations,
    plan_for_choice,
    step_costs,
)
from .optimal_exact import enumerate_choices, evaluate, evaluate_placements, polish
from .optimal_facts import forward_producers
from .optimal_model import Model, Unsupported, build_model, swap_costs
from .optimal_solve import choice_of, cut_off, peak_position, price_cut, solve_model, solve_status

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

#: Programs with at most this many decisions (and no block choices) are searched exhaustively:
#: every plan built and priced exactly, so the choice is optimal under the exact pricing.
EXHAUSTIVE_DECISIONS = 10



def _fix_blocks(model: Model, program: Program) -> None:
    """Fix the decisions the network's blocks force (:mod:`.block_choices`): a forced
    recompute is d=1, a forced swap s=1 where the model can swap the map (and d=0 for its
    producer), a kept feature map neither. Raises :class:`Unsupported` when the model has no
    decision for a forced recompute (the greedy planner, which honours it, decides)."""
    blocks = block_choices(program)
    producer = forward_producers(program)
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


# ---------------------------------------------------------------- the stages of optimal_choose


@dataclass
class _Problem:
    """What :func:`optimal_choose` was asked, in the units its models use."""

    program: Program
    budget: int
    costs: list[float]
    bandwidth: float
    only: str | None
    window: int | None
    mip_rel_gap: float
    unit: float  # seconds per objective unit: an iteration's compute, well-scaled for HiGHS
    swap_cost: dict[int, float]  # seconds per swap candidate (the greedy planner's price)
    copy_cost: dict[int, float] = field(default_factory=dict)  # one transfer, in units


@dataclass
class _Search:
    """The search in progress: the model solved now (its swapped blocks placed ``"timed"`` or
    ``"early"``) and its overflow variable, the best checked choice, the solves' log."""

    problem: _Problem
    greedy: AutoChoice
    model: Model
    overflow: int
    placement: str = "timed"
    best: tuple[float, AutoChoice, int, str] | None = None  # (extra s, choice, peak, source)
    log: list[str] = field(default_factory=list)
    nodes: int = 0  # branch-and-bound nodes of every solve
    whole_bound: float | None = None  # the whole MILP's dual bound (seconds)


@dataclass(frozen=True)
class _Limits:
    """The work :func:`optimal_choose` may do on a model of its size (:data:`NODE_WORK`)."""

    whole: bool  # the whole MILP is solved (up to WHOLE_MAX_CONSTRAINTS)
    windows_follow: bool  # windows are re-solved after it
    whole_nodes: int
    rounds: int
    window_nodes: int
    windows: int


def _limits(model: Model, node_limit: int | None, max_rounds: int,
            window_node_limit: int | None, max_windows: int | None) -> _Limits:
    rows = max(1, model.stats["constraints"])
    whole = rows <= WHOLE_MAX_CONSTRAINTS
    return _Limits(
        whole=whole,
        windows_follow=model.stats["binaries"] > FULL_SOLVE_BINARIES or not whole,
        whole_nodes=(min(WHOLE_NODES, max(1, NODE_WORK // rows)) if node_limit is None
                     else node_limit),
        rounds=min(max_rounds, max(2, ROUND_WORK // rows)) if whole else 0,
        window_nodes=WINDOW_NODES if window_node_limit is None else window_node_limit,
        windows=max(1, WINDOW_WORK // rows) if max_windows is None else max_windows)


def _fallback(greedy: AutoChoice, only: str | None, why: str,
              log: list[tuple[str, str, int, float]]) -> AutoChoice:
    """The greedy choice, with the search's entries and a ``("fallback", why, ...)`` last."""
    g = AutoChoice(set(greedy.swapped), set(greedy.dropped), greedy.extra_time_s,
                   greedy.peak, list(greedy.path) + log, greedy.early_release, only)
    g.path.append(("fallback", f"greedy choice kept: {why}", g.peak, g.extra_time_s))
    return g


def _exhaustive(pb: _Problem, greedy: AutoChoice, g_peak: int, g_extra: float
                ) -> AutoChoice | None:
    """The choice of a small program by exhaustive search (or the greedy one when that is
    no better); None when the program is too large for it."""
    small = enumerate_choices(pb.program, pb.budget, pb.costs, pb.bandwidth, pb.swap_cost,
                              pb.only, EXHAUSTIVE_DECISIONS)
    if small is None:
        return None
    choice, n = small
    if choice is None or choice.peak > pb.budget:
        return _fallback(greedy, pb.only, f"no plan fits (exhaustive search over {n} decisions)",
                         [])
    if g_peak <= pb.budget and g_extra <= choice.extra_time_s:
        return _fallback(greedy, pb.only,
                         f"exhaustive search over {n} decisions finds nothing faster", [])
    program = pb.program
    choice.path += [("swap", program.tensors[t].name, choice.peak, pb.swap_cost.get(t, 0.0))
                    for t in sorted(choice.swapped)]
    choice.path += [("recompute", program.steps[k].layer, choice.peak, pb.costs[k])
                    for k in sorted(choice.dropped)]
    choice.path.append(("milp", f"exhaustive search over {n} decisions ({2 ** n} plans, "
                                "each built and priced exactly); gap 0.00 % for the choice",
                        choice.peak, choice.extra_time_s))
    return choice


def _make_model(pb: _Problem, early_release: bool) -> tuple[Model, int]:
    """The MILP with swapped blocks placed as the timed swap plan places them, or released
    one step after their offload; and its overflow variable: memory over the budget is
    allowed at a prohibitive price, so every (sub)problem has a solution, and one with
    overflow says the model finds no plan that fits."""
    unit = pb.unit
    model = build_model(pb.program, [c / unit for c in pb.costs],
                        {t: c / unit for t, c in pb.swap_cost.items()},
                        pb.budget - pb.program.persistent_bytes(), pb.window, pb.copy_cost,
                        allow_drop=pb.only != "swap", early_release=early_release)
    _fix_blocks(model, pb.program)
    overflow = model.lp.var(ub=math.inf, cost=OVERFLOW_COST, name="overflow")
    for row in [*model.memory.rows, *(r for rs in model.memory.region_rows.values() for r in rs)]:
        terms, lo, hi = model.lp.rows[row]
        model.lp.rows[row] = ([*terms, (overflow, -1.0)], lo, hi)
    return model, overflow


def _solution_head(search: _Search, res, what: str) -> str | None:
    """Count a solve's nodes and keep the whole MILP's bound; the log's head for its solution,
    or None (logged) when it has none or its memory overflows the budget."""
    unit = search.problem.unit
    if what.startswith("whole") and getattr(res, "mip_dual_bound", None) is not None:
        search.whole_bound = float(res.mip_dual_bound) * unit
    status = solve_status(res)
    n = int(getattr(res, "mip_node_count", None) or 0)
    search.nodes += n
    if res.x is None:
        search.log.append(f"{what}: {status} after {n} nodes, no solution")
        return None
    gap = getattr(res, "mip_gap", None)
    bound = getattr(res, "mip_dual_bound", None)
    head = (f"{what}: {status} after {n} nodes, objective {1000 * res.fun * unit:.3f} ms"
            + (f", bound {1000 * bound * unit:.3f} ms, gap {100 * gap:.2f} %"
               if gap is not None and bound is not None and res.x[search.overflow] <= 1e-9
               else ""))
    if res.x[search.overflow] > 1e-9:
        search.log.append(f"{head}; no plan fits in the model (over by "
                          f"{res.x[search.overflow] * search.model.memory.unit:,.0f} B)")
        return None
    return head


def _check(search: _Search, res, what: str, rnd: int) -> str:
    """Read, check and log a solution: 'fits', 'over' (cut off) or 'none'."""
    pb, model = search.problem, search.model
    head = _solution_head(search, res, what)
    if head is None:
        return "none"
    choice, peak, extra, plan = evaluate_placements(pb.program, choice_of(model, res.x),
                                                    pb.costs, pb.bandwidth, pb.budget)
    search.log.append(
        f"{head}; {len(choice.swapped)} swaps, {len(choice.dropped)} drops: checked "
        f"peak {peak:,} B ({'fits' if peak <= pb.budget else f'{peak - pb.budget:,} B over'}"
        f"), estimated {1000 * extra:.3f} ms")
    if peak <= pb.budget:
        stall = extra - sum(pb.costs[s.cost.origin] for s in plan.program.steps
                            if s.phase == Phase.RECOMPUTE and 0 <= s.cost.origin < len(pb.costs))
        if model.link is not None and stall / pb.unit > res.x[model.link] * (1 + 1e-6) + 1e-9:
            price_cut(model, choice, stall / pb.unit)
        best = search.best
        if best is None or extra < best[0] or best[3] == "greedy" and extra <= best[0]:
            search.best = (extra, choice, peak, "milp")
        return "fits"
    # the model under-estimated this plan's memory: cut it off, and (after a few exact
    # cuts alone) lower the budget at the position of its true peak by the excess
    cut_off(model, choice)
    if rnd >= 2:
        q = peak_position(model, plan)
        for row in [model.memory.rows[q], *model.memory.region_rows.get(q, ())]:
            terms, lo, hi = model.lp.rows[row]
            model.lp.rows[row] = (terms, lo, hi - (peak - pb.budget) / model.memory.unit)
    return "over"


def _early_next(search: _Search) -> bool:
    """Whether to leave the timed model for the early one: it has swaps and nothing it
    gave fits (the greedy choice, when it fits, costs time: else it was returned above)."""
    return search.placement == "timed" and bool(search.model.swap) and (
        search.best is None or search.best[3] == "greedy")


def _use_early_model(search: _Search) -> None:
    """Swapped blocks released early from now on (compute waits for the copies)."""
    search.placement = "early"
    search.model, search.overflow = _make_model(search.problem, True)


def _whole_rounds(search: _Search, limits: _Limits) -> None:
    """The whole MILP, solved again while a cut removes what its solution got wrong; when the
    model with blocks released as their copies end fits nothing, the one releasing them early
    (more time, less memory) gets the rounds left."""
    rounds = limits.rounds
    for r in range(rounds):
        # half the rounds for the timed model while nothing it gave fits
        if r >= max(1, rounds // 2) and _early_next(search):
            _use_early_model(search)
        res = solve_model(search.model, limits.whole_nodes, search.problem.mip_rel_gap)
        verdict = _check(search, res, f"whole MILP ({search.placement} release), round {r + 1}",
                         r)
        if verdict == "none" and _early_next(search):
            _use_early_model(search)
            continue
        best = search.best
        if verdict == "fits" and best is not None and \
                res.fun * search.problem.unit < best[0] * (1 - 1e-9):
            # the model priced this choice below its walk on the clock (queued copies): cut it
            # off and look again while the model still sees something cheaper than the best
            cut_off(search.model, choice_of(search.model, res.x))
            continue
        if verdict != "over":
            break


def _windows(search: _Search, limits: _Limits) -> int:
    """Windows of WINDOW_STEPS consecutive layers re-solved around the best checked choice
    (every other decision fixed to it), passes over the program while one improves it.
    Returns the number of windows solved."""
    program, model = search.problem.program, search.model
    producer = forward_producers(program)
    nf = max(model.drop, default=0) + 1
    starts = list(range(0, nf, WINDOW_STEPS // 2))
    n_windows = 0
    improved = True
    while improved and search.best[0] > 0.0 and n_windows < limits.windows:
        improved = False
        for a in starts:
            if n_windows >= limits.windows or search.best[0] <= 0.0:
                break
            inc = search.best[1]
            b = a + WINDOW_STEPS
            fixed = {v: float(k in inc.dropped) for k, v in model.drop.items()
                     if not a <= k < b}
            fixed.update({v: float(t in inc.swapped) for t, v in model.swap.items()
                          if not a <= producer.get(t, 0) < b})
            res = solve_model(model, limits.window_nodes, search.problem.mip_rel_gap, fixed)
            before = search.best[0]
            n_windows += 1
            _check(search, res, f"window {a}-{min(b, nf) - 1}", 3)
            improved |= search.best[0] < before - 1e-12 * max(before, 1e-30)
    return n_windows


def _polish_best(search: _Search, max_evaluations: int) -> int:
    """Polish the best checked MILP choice (:func:`.optimal_exact.polish`); returns the
    actions removed."""
    if search.best is None or search.best[3] == "greedy":
        return 0
    pb = search.problem
    extra, choice, peak, src = search.best
    choice, extra, ppeak, moves = polish(pb.program, choice, extra, pb.budget, pb.costs,
                                         pb.swap_cost, pb.bandwidth, max_evaluations)
    search.best = (extra, choice, ppeak if ppeak >= 0 else peak, src)
    return moves


def _summary(search: _Search, limits: _Limits, n_windows: int, polish_moves: int) -> str:
    """The ``("milp", ...)`` entry's text: the model's size and the work done."""
    st, best = search.model.stats, search.best
    if search.whole_bound is not None and best is not None:
        lb = max(search.whole_bound, 0.0)
        gap_pct = 100 * max(0.0, 1 - lb / best[0]) if best[0] > 0 else 0.0
        bound_text = (f"; whole-program bound {1000 * lb:.3f} ms, gap {gap_pct:.2f} % for the "
                      "choice")
    else:
        bound_text = "; no whole-program bound"
    return (f"MILP of {st['variables']:,} variables ({st['binaries']} binary), "
            f"{st['constraints']:,} constraints, segments up to {st['window'] + 1} steps; "
            f"{len(search.log)} solve(s)" + (f" ({n_windows} windows)" if n_windows else "")
            + f", {search.nodes:,} nodes in all"
            + ("" if limits.whole else f" (no whole MILP above {WHOLE_MAX_CONSTRAINTS:,} "
                                       "constraints)")
            + (f"; polished by removing {polish_moves} action(s)" if polish_moves else "")
            + bound_text)


def _result(search: _Search, entries: list[tuple[str, str, int, float]]) -> AutoChoice:
    """The best checked MILP choice with its decisions and the search's entries in its path,
    or the greedy choice with a fallback entry."""
    pb, best, log = search.problem, search.best, search.log
    if best is None or best[3] == "greedy":
        why = ("no checked MILP solution fits" if best is None
               else "no checked MILP solution fits at less estimated time")
        return _fallback(search.greedy, pb.only, why + (f" ({log[-1]})" if log else ""), entries)
    extra, choice, peak, _ = best
    out = AutoChoice(set(choice.swapped), set(choice.dropped), extra, peak,
                     early_release=choice.early_release, only=pb.only)
    for t in sorted(choice.swapped):
        out.path.append(("swap", pb.program.tensors[t].name, peak, pb.swap_cost.get(t, 0.0)))
    for k in sorted(choice.dropped):
        out.path.append(("recompute", pb.program.steps[k].layer, peak, pb.costs[k]))
    out.path += [(kind, text, peak, extra) for kind, text, _, _ in entries]
    return out


def optimal_choose(program: Program, budget: int, costs: list[float],
                   bandwidth: float = DEFAULT_BANDWIDTH, *,
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
    (default a quarter of :func:`.auto.default_evaluations`)."""
    polish_limit = (max(16, default_evaluations(program) // 4) if max_evaluations is None
                    else max_evaluations)
    swap_cost = {} if only == OnlyAction.RECOMPUTE else swap_costs(program, costs, bandwidth)
    pb = _Problem(program, budget, costs, bandwidth, only, window, mip_rel_gap,
                  unit=max(sum(costs), 1e-30), swap_cost=swap_cost)
    if greedy is None:
        greedy = auto_choose(program, budget, costs, bandwidth=bandwidth)
    g_peak, g_extra, _ = evaluate(program, greedy, costs, bandwidth)
    if g_peak <= budget and g_extra <= 0.0:
        return _fallback(greedy, only, "it fits at no estimated extra time, which nothing beats",
                         [])
    small = _exhaustive(pb, greedy, g_peak, g_extra)
    if small is not None:
        return small
    pb.copy_cost = {c.root: c.nbytes / bandwidth / pb.unit
                    for c in swap_candidates(program, {}, "all")}
    try:
        search = _Search(pb, greedy, *_make_model(pb, False))
    except Unsupported as e:
        return _fallback(greedy, only, f"the optimal planner does not model this program ({e})",
                         [])
    if g_peak <= budget:
        search.best = (g_extra, greedy, g_peak, "greedy")
    limits = _limits(search.model, node_limit, max_rounds, window_node_limit, max_windows)
    _whole_rounds(search, limits)
    if not limits.whole and search.model.swap and greedy.early_release:
        _use_early_model(search)  # the windows start from the greedy choice: its placement
    n_windows = _windows(search, limits) if limits.windows_follow and search.best else 0
    polish_moves = _polish_best(search, polish_limit)
    entries = [("solve", s, 0, 0.0) for s in search.log]
    entries.append(("milp", _summary(search, limits, n_windows, polish_moves), 0, 0.0))
    return _result(search, entries)


def optimal_plan(program: Program, budget: int | None, step_times: list[float] | None = None,
                 bandwidth: float = DEFAULT_BANDWIDTH, flops_per_s: float = DEFAULT_FLOPS_PER_S,
                 cost_source: str = "measured step times", **greedy_kwargs) -> Plan:
    """``auto`` with ``planner=optimal``: both the greedy and the optimal choice are made and
    the optimal one is taken only when it fits at no more estimated time; the notes say which.
    Raises :class:`~.auto.BudgetTooSmall` as the greedy planner does when neither fits. Both
    searches are bounded by work (:func:`optimal_choose`, :func:`.auto.auto_choose`)."""
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

"""HiGHS on the MILP of :mod:`.optimal_model`, bounded by work alone, and what the search of
:mod:`.optimal` reads from a solution and adds to the model between solves: the choice a
solution makes, cuts (this exact choice; a swap set's price on the clock), the position of a
built plan's peak."""

from __future__ import annotations

import warnings

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp

from ..ir.names import Phase
from ..ir.plan import ENDS, STARTS, AutoChoice, Plan
from .optimal_model import Model


def solve_model(model: Model, node_limit: int, gap: float, fixed: dict[int, float] | None = None):
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


def solve_status(res) -> str:
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


def choice_of(model: Model, x: np.ndarray) -> AutoChoice:
    """The decisions of solution ``x``."""
    return AutoChoice(swapped={t for t, v in model.swap.items() if x[v] > 0.5},
                      dropped={k for k, v in model.drop.items() if x[v] > 0.5})


def cut_off(model: Model, choice: AutoChoice) -> None:
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


def peak_position(model: Model, plan: Plan) -> int:
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
    if st.phase == Phase.RECOMPUTE:
        nxt = next((s for s in steps[where:] if s.phase == Phase.BACKWARD), None)
        if nxt is not None:
            origin = nxt.cost.origin
            return model.positions.region.get(origin, model.positions.of_step[origin])
    return model.positions.of_step.get(st.cost.origin, 0)

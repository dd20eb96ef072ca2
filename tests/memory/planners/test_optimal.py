"""``auto,planner=optimal``: the MILP planner against exhaustive search on small random programs,
against the greedy planner on reference models, its plans, its fallback, its flag."""

from __future__ import annotations

import itertools

import pytest
from hand_programs import (
    MAX_POOL_2X2,
    HandLayer,
    joint_recompute,
    linear_chain,
    lower_layers,
)
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from minidl.memory.ir.config import MemoryConfig
from minidl.memory.ir.plan import AutoChoice
from minidl.memory.ir.units import size_text
from minidl.memory.passes.base_plan import plan_peak
from minidl.memory.planners import optimal
from minidl.memory.planners.auto import BudgetTooSmall, auto_choose, auto_plan, build, step_costs
from minidl.memory.planners.optimal import evaluate, evaluate_placements, optimal_choose, swap_costs
from minidl.memory.planners.optimal_solve import solve_model
from minidl.memory.planners.planner import make_plan


def exhaustive(program, budget, costs, bandwidth):
    """The least estimated extra time over every keep / swap / recompute assignment (every
    droppable forward step, every swap candidate), or None when none fits."""
    producer = {t: s.index for s in program.steps if s.phase == "forward" for t in s.access.writes}
    loss = producer[program.loss]
    drops = [s.index for s in program.steps if s.phase == "forward" and s.index != loss
             and any(program.tensors[t].role == "value" for t in s.access.writes)]
    sc = swap_costs(program, costs, bandwidth)
    swaps = sorted(sc)
    best = None
    for dm in itertools.product((0, 1), repeat=len(drops)):
        dropped = {k for k, b in zip(drops, dm) if b}
        for sm in itertools.product((0, 1), repeat=len(swaps)):
            swapped = {t for t, b in zip(swaps, sm) if b}
            if any(producer.get(t) in dropped for t in swapped):
                continue  # swapping a recomputed map: no memory saved, its cost counted
            _, peak, extra, _ = evaluate_placements(program, AutoChoice(swapped, dropped),
                                                    costs, bandwidth, budget)
            if peak <= budget and (best is None or extra < best):
                best = extra
    return best


@st.composite
def random_programs(draw):
    """Chains of 2..5 layers where an ``add`` also reads an earlier value (forks and joins),
    with random sizes, workspaces, in-place flags and FLOPs."""
    n = draw(st.integers(2, 5))
    layers: list[HandLayer] = []
    units = {"x": draw(st.integers(1, 4))}
    prev = "x"
    for i in range(n):
        kind = draw(st.sampled_from(["conv", "relu", "pool", "linear", "add"]))
        flops = draw(st.sampled_from([100, 1000, 4000, 8000]))
        same = [v for v in units if v not in (prev, "x") and units[v] == units[prev]]
        if kind == "add" and not same:
            kind = "relu"
        name = f"{kind}{i}"
        if kind == "relu":
            ly = HandLayer(name, kind, (prev,), units[prev], keeps="output", flops=flops,
                           inplace_forward=draw(st.booleans()),
                           inplace_backward=draw(st.booleans()))
        elif kind == "add":
            ly = HandLayer(name, kind, (prev, draw(st.sampled_from(same))), units[prev],
                           keeps="", inplace_forward=draw(st.booleans()), flops=flops)
        elif kind == "pool":
            half = max(1, units[prev] // 2)
            ly = HandLayer(name, kind, (prev,), half, stash={"argmax": half}, keeps="",
                           facts=MAX_POOL_2X2, flops=flops)
        else:
            ly = HandLayer(name, kind, (prev,), draw(st.integers(1, 6)), params=("w",),
                           fwd_workspace=draw(st.integers(0, 2)) if kind == "conv" else 0,
                           bwd_workspace=draw(st.integers(0, 2)) if kind == "conv" else 0,
                           flops=flops)
        layers.append(ly)
        units[name] = ly.units
        prev = name
    return lower_layers(layers, input_units=units["x"])


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_programs(), st.sampled_from([1e9, 1e10, 1e11]),
       st.sampled_from([0.0, 0.25, 0.5, 0.75]))
def test_equal_to_exhaustive_search_on_random_programs(program, bandwidth, frac):
    """Small programs are searched exhaustively by the planner itself (every plan built and
    priced exactly): equal to this test's own exhaustive search."""
    costs = step_costs(program, None)
    n_drop = sum(1 for s in program.steps if s.phase == "forward") - 1
    assume(n_drop + len(swap_costs(program, costs, bandwidth)) <= 10)
    lo = program.lower_bound_bytes()
    hi = evaluate(program, AutoChoice(), costs, bandwidth)[0]
    budget = int(lo + frac * (hi - lo))
    best = exhaustive(program, budget, costs, bandwidth)
    # the MILP alone: its only incumbent to beat is doing nothing (no greedy walk)
    nothing = AutoChoice(peak=hi)
    opt = optimal_choose(program, budget, costs, bandwidth, greedy=nothing)
    peak = program.persistent_bytes() + plan_peak(build(program, opt, costs, bandwidth))
    assert peak == opt.peak
    if best is None:
        assert opt.peak > budget  # nothing fits: the fallback, which does not fit either
    else:
        assert opt.peak <= budget
        assert opt.extra_time_s == pytest.approx(best, rel=1e-9, abs=1e-18)
        if best > 0:  # something had to be done: the MILP did it
            assert opt.path[-1][0] == "milp"


def test_joint_recomputation_beats_the_greedy_walk(monkeypatch):
    """conv -> pool -> relu -> add(relu, pool): recomputing the three first layers together costs
    less than the swap the greedy walk takes one move at a time (the MILP finds it: exhaustive
    search off)."""
    monkeypatch.setattr(optimal, "EXHAUSTIVE_DECISIONS", 0)
    p = joint_recompute()
    costs, bw, budget = step_costs(p, None), 1e9, 4608
    greedy = auto_choose(p, budget, costs, bandwidth=bw)
    g_peak, g_extra, _ = evaluate(p, greedy, costs, bw)
    opt = optimal_choose(p, budget, costs, bw)
    assert g_peak <= budget and opt.peak <= budget
    assert opt.extra_time_s < 0.6 * g_extra
    assert opt.dropped == {0, 1, 2} and not opt.swapped
    assert opt.extra_time_s == pytest.approx(exhaustive(p, budget, costs, bw))
    assert [kind for kind, *_ in opt.path[:3]] == ["recompute"] * 3
    assert any(kind == "milp" and "variables" in text for kind, text, *_ in opt.path)


def _reference(name: str, shape: tuple[int, ...], batch: int):
    from minidl.compile.lowering import lower
    from minidl.layers import SoftmaxCrossEntropy
    from minidl.zoo.models import get_model

    net = get_model(name, shape, 10)
    return lower(net, [(batch, *shape)], loss=SoftmaxCrossEntropy(),
                 label_shape=(batch,)).program


@pytest.mark.parametrize("target", [None, "v100"])
@pytest.mark.parametrize("model", [("smallcnn", (1, 28, 28), 32), ("resnet8", (3, 32, 32), 16)])
def test_never_worse_than_greedy_on_reference_models(model, target):
    p = _reference(*model)
    if target is None:
        costs, bw = step_costs(p, None), optimal.DEFAULT_BANDWIDTH
    else:
        from minidl.memory.cost.cost_model import step_costs as roofline
        from minidl.memory.cost.targets import get_target

        prof = get_target(target)
        costs = roofline(p, prof)
        bw = min(prof.link_h2d_bytes_per_s, prof.link_d2h_bytes_per_s)
    lo, hi = p.lower_bound_bytes(), evaluate(p, AutoChoice(), costs, bw)[0]
    # The greedy choice is the MILP's fallback, so the assertions hold at any work limit (one
    # solve of a few nodes here: the test's time).
    for frac in (0.15, 0.6):
        budget = int(lo + frac * (hi - lo))
        greedy = auto_choose(p, budget, costs, bandwidth=bw)
        g_peak, g_extra, _ = evaluate(p, greedy, costs, bw)
        opt = optimal_choose(p, budget, costs, bw, greedy=greedy, max_rounds=1,
                             node_limit=10)
        if g_peak <= budget:
            assert opt.peak <= budget
            assert opt.extra_time_s <= g_extra * (1 + 1e-12)
        if opt.peak <= budget:  # the recorded peak is the built plan's
            assert opt.peak == p.persistent_bytes() + plan_peak(build(p, opt, costs, bw))


def test_make_plan_with_planner_optimal_fits_and_says_which_choice_it_took():
    p = _reference("resnet8", (3, 32, 32), 16)
    lo = p.lower_bound_bytes()
    reuse = auto_plan(p, None).provenance.auto.peak
    budget = (lo + reuse) // 2
    slow = {"bandwidth": 1e7}  # a slow link: swapping costs time, so the MILP has work to do
    plan = make_plan(p, MemoryConfig.parse(f"auto,budget={budget},planner=optimal"), **slow)
    plan.validate()
    assert plan.spec == f"auto,budget={size_text(budget)},planner=optimal"
    assert MemoryConfig.parse(plan.spec).budget == budget
    assert plan.provenance.auto.peak <= budget
    assert plan.provenance.auto.peak == p.persistent_bytes() + plan_peak(plan)
    assert plan.static.base == p.persistent_bytes()
    assert plan.notes[0].startswith(f"auto: budget {budget:,} B;")
    note = next(n for n in plan.notes if n.startswith("planner=optimal: "))
    assert ("optimal choice taken" in note) != ("greedy choice kept" in note)
    assert "MILP of" in note and "gap" in note
    greedy = make_plan(p, MemoryConfig.parse(f"auto,budget={budget}"), **slow)
    assert not any(n.startswith("planner=") for n in greedy.notes)
    assert plan.provenance.auto.extra_time_s <= greedy.provenance.auto.extra_time_s
    # where the greedy choice costs nothing, it is kept without solving anything
    free = make_plan(p, MemoryConfig.parse(f"auto,budget={reuse},planner=optimal"))
    note = next(n for n in free.notes if n.startswith("planner=optimal: "))
    assert "greedy choice kept: it fits at no estimated extra time" in note


def test_budget_below_the_lower_bound_raises_as_greedy_does():
    p = linear_chain(8)
    budget = p.lower_bound_bytes() - 512
    with pytest.raises(BudgetTooSmall) as greedy_err:
        make_plan(p, MemoryConfig.parse(f"auto,budget={budget}"))
    with pytest.raises(BudgetTooSmall) as optimal_err:
        make_plan(p, MemoryConfig.parse(f"auto,budget={budget},planner=optimal"))
    said = f"no plan fits the budget of {budget:,} B: the smallest peak the auto planner reaches"
    assert str(optimal_err.value).startswith(said) and str(greedy_err.value).startswith(said)
    opt = optimal_choose(p, budget, step_costs(p, None))
    assert opt.path[-1][0] == "fallback" and "no checked MILP solution fits" in opt.path[-1][1]


def test_large_programs_are_solved_by_windows_around_the_best_choice(monkeypatch):
    monkeypatch.setattr(optimal, "FULL_SOLVE_BINARIES", 0)
    monkeypatch.setattr(optimal, "WINDOW_STEPS", 8)
    p = linear_chain(24, units=2)
    costs, bw = step_costs(p, None), 1e7
    lo, hi = p.lower_bound_bytes(), evaluate(p, AutoChoice(), costs, bw)[0]
    budget = (lo + hi) // 2
    greedy = auto_choose(p, budget, costs, bandwidth=bw)
    g_peak, g_extra, _ = evaluate(p, greedy, costs, bw)
    assert g_extra > 0
    opt = optimal_choose(p, budget, costs, bw, greedy=greedy, node_limit=5)
    texts = [text for kind, text, *_ in opt.path if kind == "solve"]
    assert texts[0].startswith("whole MILP")
    assert any(t.startswith("window 0-7") for t in texts)
    assert g_peak <= budget and opt.peak <= budget and opt.extra_time_s <= g_extra


def test_dry_run_with_planner_optimal():
    from minidl import dry_run
    from minidl.zoo.models import smallcnn

    base = dry_run(smallcnn(), 32, "auto")
    budget = (base["lower_bound_bytes"] + base["peak_reserved_bytes"]) // 2
    rep = dry_run(smallcnn(), 32, f"auto,budget={budget},planner=optimal")
    assert rep["peak_reserved_bytes"] <= budget
    assert any(n.startswith("planner=optimal: ") for n in rep["notes"])


def test_planner_flag():
    assert MemoryConfig.parse("auto,budget=1GiB,planner=optimal").get("planner") == "optimal"
    assert MemoryConfig.parse("auto,planner=greedy").get("planner") == "greedy"
    with pytest.raises(ValueError, match=r"'planner' needs a value in greedy\|optimal"):
        MemoryConfig.parse("auto,planner=fast")
    with pytest.raises(ValueError, match=r"'planner' needs a value in greedy\|optimal"):
        MemoryConfig.parse("auto,planner")
    with pytest.raises(ValueError, match="planner=greedy|optimal is for the auto planner"):
        MemoryConfig.parse("reuse,inplace,planner=optimal")


@pytest.mark.parametrize("planner", ["greedy", "optimal"])
def test_only_restricts_the_actions(planner):
    """``auto,only=recompute`` never swaps and ``only=swap`` never recomputes, with either
    planner; each fits a budget the other kind of action alone would meet differently."""
    p = linear_chain(10, units=2)
    lo = p.lower_bound_bytes()
    reuse = auto_plan(p, None).provenance.auto.peak
    slow = {"bandwidth": 1e7}
    seen = {}
    for only in ("recompute", "swap"):
        budget = (lo + reuse) // 2
        while True:
            spec = f"auto,budget={budget},only={only},planner={planner}"
            try:
                plan = make_plan(p, MemoryConfig.parse(spec), **slow)
                break
            except BudgetTooSmall:
                budget += (reuse - lo) // 8
        plan.validate()
        choice = plan.provenance.auto
        assert choice.peak <= budget and choice.only == only
        assert not choice.swapped if only == "recompute" else not choice.dropped
        assert f"({only} only)" in plan.notes[0]
        seen[only] = choice
    assert seen["recompute"].dropped and seen["swap"].swapped


def test_only_needs_auto_and_a_known_value():
    with pytest.raises(ValueError, match="only=recompute|swap is for the auto planner"):
        MemoryConfig.parse("reuse,only=recompute")
    with pytest.raises(ValueError, match="recompute|swap"):
        MemoryConfig.parse("auto,only=encode")


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(0.01, 10.0), min_size=10, max_size=10), st.floats(0.05, 50.0))
def test_timed_steps_place_release_and_prefetch_as_the_swap_pass_does(step_times, copy):
    """One swapped block with the link to itself: the model's (release, prefetch) steps are
    where :func:`swap_plan` puts them with the same step times and transfer time."""
    from hand_programs import chain, ids

    from minidl.memory.ir.plan import Prefetch, Release
    from minidl.memory.passes.swap import swap_candidates, swap_plan, timed_steps

    p = chain()
    plan = make_plan(p, MemoryConfig.parse("reuse,inplace"))
    assert len(p.steps) == len(step_times)
    x = ids(p)["x"]
    cand = next(c for c in swap_candidates(p, plan.aliases, "all") if c.root == x)
    bandwidth = cand.nbytes / copy
    out = swap_plan(plan, "all", step_times=step_times, bandwidth=bandwidth, only={x})
    placed = {type(a): i for i, a in out.actions()
              if a.tensor == x and isinstance(a, (Release, Prefetch))}
    assert timed_steps(cand.last_forward, cand.first_backward, cand.nbytes / bandwidth,
                       step_times) == (placed[Release], placed[Prefetch])


def test_engine_rows_price_copies_that_outlast_their_compute():
    """Forced swaps whose copies outlast the compute around them stall: with swaps that cost
    nothing on their own, the model's link variable is held up by the engines' rows alone
    (and is free when the copies are short)."""
    from hand_programs import chain

    from minidl.memory.planners.optimal_model import Lp, build_model, link_rows

    p = chain()
    costs = [1.0] * len(p.steps)
    roots = [c.root for c in optimal.swap_candidates(p, {}, "all")]

    def forced_link(copy: float) -> float:
        model = build_model(p, costs, {t: 0.0 for t in roots}, 10 ** 9,
                            copy_cost={t: copy for t in roots})
        assert model.link is not None and model.swap
        for v in model.swap.values():
            model.lp.ge([(v, 1.0)], 1.0)
        return float(solve_model(model, 10.0, 0.0).x[model.link])

    assert forced_link(30.0) >= 30.0 - sum(costs)
    assert forced_link(0.01) == pytest.approx(0.0, abs=1e-9)
    assert link_rows(Lp(), {}, {}, {}, {}, costs) == (None, 0)


def test_price_cut_adds_a_row_on_the_link_for_a_swap_set():
    from hand_programs import chain

    from minidl.memory.planners.optimal_model import build_model

    p = chain()
    costs = [1.0] * len(p.steps)
    cands = {c.root: c for c in optimal.swap_candidates(p, {}, "all")}
    model = build_model(p, costs, {t: 0.1 for t in cands}, 10 ** 9,
                        copy_cost={t: 0.1 for t in cands})
    t = next(iter(model.swap))
    rows = len(model.lp.rows)
    assert optimal.price_cut(model, AutoChoice(swapped={t}), 5.0)
    assert len(model.lp.rows) == rows + 1
    assert not optimal.price_cut(model, AutoChoice(), 5.0)
    assert not optimal.price_cut(model, AutoChoice(swapped={t}), 0.0)
    model.lp.ge([(model.swap[t], 1.0)], 1.0)
    assert solve_model(model, 10.0, 0.0).x[model.link] >= 5.0 - 1e-9

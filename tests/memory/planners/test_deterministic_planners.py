"""The greedy walk and the MILP are bounded by work, never by the clock: a choice is a function
of the program, the budget and the costs. A clock that jumps 1000 s at every read (as on a
machine so loaded that every search would run out of time) changes nothing, and a second run
gives the same choice, its path and notes included."""

from __future__ import annotations

import itertools
import time

import pytest
from hand_programs import joint_recompute, linear_chain

from minidl.memory.ir.config import MemoryConfig
from minidl.memory.ir.plan import AutoChoice
from minidl.memory.planners import auto, optimal
from minidl.memory.planners.auto import auto_choose, auto_plan, step_costs
from minidl.memory.planners.optimal import evaluate, optimal_choose
from minidl.memory.planners.planner import make_plan


@pytest.fixture
def jumping_clock(monkeypatch):
    """Patch ``time.perf_counter``, ``time.time`` and ``time.monotonic`` (the module
    attributes, which the planners' ``time.…`` calls read) to advance 1000 s per read.
    Returns the number of reads so far (a one-element list)."""
    reads = [0]
    ticks = itertools.count()

    def jump(*_):
        reads[0] += 1
        return 1000.0 * next(ticks)

    for name in ("perf_counter", "time", "monotonic"):
        monkeypatch.setattr(time, name, jump)
    for mod in (auto, optimal):
        if hasattr(mod, "time"):
            for name in ("perf_counter", "time", "monotonic"):
                monkeypatch.setattr(mod.time, name, jump)
    return reads


def _key(c: AutoChoice) -> tuple:
    """Everything a choice says, its path included."""
    return (sorted(c.swapped), sorted(c.dropped), c.early_release, c.peak, c.extra_time_s,
            c.only, list(c.path))


def _between(program, costs, bandwidth, frac):
    lo = program.lower_bound_bytes()
    hi = evaluate(program, AutoChoice(), costs, bandwidth)[0]
    return int(lo + frac * (hi - lo))


# ---------------------------------------------------------------- the greedy walk


@pytest.mark.parametrize("only", [None, "swap", "recompute"])
def test_greedy_walk_ignores_the_clock(only, request):
    p = linear_chain(16, units=2)
    costs, bw = step_costs(p, None), 1e7
    budget = _between(p, costs, bw, 0.3)
    calm = auto_choose(p, budget, costs, bandwidth=bw, only=only)
    assert len([e for e in calm.path if e[0] in ("swap", "recompute", "keep")]) >= 2
    assert not any(e[0] == "stopped" for e in calm.path)
    request.getfixturevalue("jumping_clock")
    loaded = auto_choose(p, budget, costs, bandwidth=bw, only=only)
    assert _key(loaded) == _key(calm)


def test_greedy_walk_stops_at_its_work_limit_the_same_way_every_time():
    """A small ``max_evaluations`` stops the walks part way: the same plan every run, and the
    path says where the limit stopped it."""
    p = linear_chain(16, units=2)
    costs, bw = step_costs(p, None), 1e7
    budget = _between(p, costs, bw, 0.2)
    full = auto_choose(p, budget, costs, bandwidth=bw)
    runs = [auto_choose(p, budget, costs, bandwidth=bw, max_evaluations=12) for _ in range(2)]
    assert _key(runs[0]) == _key(runs[1])
    assert any(e[0] == "stopped" and "12 plans" in e[1] for e in runs[0].path)
    assert _key(runs[0]) != _key(full)


def test_greedy_on_a_network_ignores_the_clock(jumping_clock, monkeypatch):
    """resnet8 on the v100 cost model, the walk's choice with the clock jumping against the
    one with a calm clock (computed first, the jumps undone)."""
    from minidl.memory.cost.cost_model import step_costs as roofline
    from minidl.memory.cost.targets import get_target

    p = _reference("resnet8", (3, 32, 32), 16)
    prof = get_target("v100")
    costs, bw = roofline(p, prof), min(prof.link_h2d_bytes_per_s, prof.link_d2h_bytes_per_s)
    budget = _between(p, costs, bw, 0.1)
    loaded = auto_choose(p, budget, costs, bandwidth=bw)
    monkeypatch.undo()
    calm = auto_choose(p, budget, costs, bandwidth=bw)
    assert len(calm.path) > 5  # the walks made moves (this budget is below their reach)
    assert _key(loaded) == _key(calm)


# ---------------------------------------------------------------- the MILP


def _reference(name: str, shape: tuple[int, ...], batch: int):
    from minidl.compile.lowering import lower
    from minidl.layers import SoftmaxCrossEntropy
    from minidl.zoo.models import get_model

    net = get_model(name, shape, 10)
    return lower(net, [(batch, *shape)], loss=SoftmaxCrossEntropy(),
                 label_shape=(batch,)).program


def test_exhaustive_search_ignores_the_clock(request):
    p = joint_recompute()
    costs, bw, budget = step_costs(p, None), 1e9, 4608
    greedy = auto_choose(p, budget, costs, bandwidth=bw)
    calm = optimal_choose(p, budget, costs, bw, greedy=greedy)
    assert any(e[0] == "milp" and "exhaustive" in e[1] for e in calm.path)
    request.getfixturevalue("jumping_clock")
    assert _key(optimal_choose(p, budget, costs, bw, greedy=greedy)) == _key(calm)


def test_whole_milp_ignores_the_clock(monkeypatch, request):
    monkeypatch.setattr(optimal, "EXHAUSTIVE_DECISIONS", 0)
    p = joint_recompute()
    costs, bw, budget = step_costs(p, None), 1e9, 4608
    greedy = auto_choose(p, budget, costs, bandwidth=bw)
    calm = optimal_choose(p, budget, costs, bw, greedy=greedy)
    assert calm.dropped == {0, 1, 2}  # the MILP's choice, not the greedy fallback
    assert not any(e[0] == "fallback" for e in calm.path)
    request.getfixturevalue("jumping_clock")
    assert _key(optimal_choose(p, budget, costs, bw, greedy=greedy)) == _key(calm)


def test_windows_ignore_the_clock(monkeypatch, request):
    monkeypatch.setattr(optimal, "FULL_SOLVE_BINARIES", 0)
    monkeypatch.setattr(optimal, "WINDOW_STEPS", 8)
    p = linear_chain(24, units=2)
    costs, bw = step_costs(p, None), 1e7
    budget = _between(p, costs, bw, 0.5)
    greedy = auto_choose(p, budget, costs, bandwidth=bw)
    calm = optimal_choose(p, budget, costs, bw, greedy=greedy, node_limit=5)
    texts = [text for kind, text, *_ in calm.path if kind == "solve"]
    assert any(t.startswith("window 0-7") for t in texts)
    request.getfixturevalue("jumping_clock")
    assert _key(optimal_choose(p, budget, costs, bw, greedy=greedy, node_limit=5)) == _key(calm)


def test_milp_on_a_network_twice_and_with_the_clock_jumping(request):
    """smallcnn on the v100 cost model with ``planner=optimal`` through make_plan: the same
    choice and the same notes on a second run and with the clock jumping."""
    from minidl.memory.cost.cost_model import step_costs as roofline
    from minidl.memory.cost.targets import get_target

    p = _reference("smallcnn", (1, 28, 28), 32)
    prof = get_target("v100")
    costs, bw = roofline(p, prof), min(prof.link_h2d_bytes_per_s, prof.link_d2h_bytes_per_s)
    budget = _between(p, costs, bw, 0.4)
    cfg = MemoryConfig.parse(f"auto,budget={budget},planner=optimal")

    def plan():
        out = make_plan(p, cfg, step_times=costs, bandwidth=bw, cost_source="v100")
        return _key(out.provenance.auto), out.notes

    first = plan()
    assert any(n.startswith("planner=optimal: ") and "nodes in all" in n for n in first[1])
    assert plan() == first
    request.getfixturevalue("jumping_clock")
    assert plan() == first


def test_optimal_plan_notes_report_work_not_seconds():
    p = _reference("smallcnn", (1, 28, 28), 32)
    lo = p.lower_bound_bytes()
    reuse = auto_plan(p, None).provenance.auto.peak
    budget = (lo + reuse) // 2
    plan = make_plan(p, MemoryConfig.parse(f"auto,budget={budget},planner=optimal"),
                     bandwidth=1e7)
    note = next(n for n in plan.notes if n.startswith("planner=optimal: "))
    assert "nodes in all" in note
    assert " s in all" not in note and "built in" not in note

"""``make_plan`` across specs and ``auto`` on hand-built programs, parametrised Chainer-style
(every spec on every program), plus random chains and DAGs with hypothesis."""

from __future__ import annotations

import pytest
from hand_programs import (
    MAX_POOL_2X2,
    HandLayer,
    chain,
    linear_chain,
    lower_layers,
    residual,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minidl.memory.ir.config import MemoryConfig
from minidl.memory.ir.plan import STARTS
from minidl.memory.passes.base_plan import plan_peak
from minidl.memory.passes.static_plan import block_intervals, max_live_bytes
from minidl.memory.planners.auto import BudgetTooSmall, auto_choose, auto_plan
from minidl.memory.planners.planner import make_plan

PROGRAMS = {"chain": chain, "residual": residual, "linear8": lambda: linear_chain(8)}
SPECS = [
    "none", "inplace", "reuse", "reuse,inplace", "reuse,inplace,static", "static",
    "reuse,swap=conv", "reuse,swap=all", "reuse,swap=all,static", "reuse,swap=all,cache",
    "reuse,recompute=sqrt", "reuse,recompute=speed", "reuse,recompute=memory",
    "reuse,recompute=cost", "reuse,inplace,binarize", "reuse,inplace,sparse",
    "reuse,inplace,dpr=fp16", "layrub", "vdnn", "superneurons", "gist", "all", "auto",
]


def check_plan(program, spec: str) -> None:
    """The plan validates, never peaks above ``none``, and a static plan's offsets hold its
    blocks."""
    config = MemoryConfig.parse(spec)
    plan = make_plan(program, config)
    plan.validate()
    assert plan.spec == config.spec
    none = plan_peak(make_plan(program, MemoryConfig.parse("none")))
    iv = block_intervals(plan)
    assert max_live_bytes(iv) == plan_peak(plan) <= none
    if config.has("static") or config.has("auto"):
        assert plan.static.arena >= max_live_bytes(iv)
        assert plan.static.base == plan.program.persistent_bytes()
        assert all(a.offset >= plan.static.base for _, a in plan.actions()
                   if isinstance(a, STARTS) and a.tensor not in plan.aliases)


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_every_spec_on_every_program(name, spec):
    check_plan(PROGRAMS[name](), spec)


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_make_plan_is_a_pure_function(name):
    p = PROGRAMS[name]()
    config = MemoryConfig.parse("reuse,inplace,swap=all,static")
    a, b = make_plan(p, config), make_plan(p, config)
    assert a.steps == b.steps and a.begin == b.begin and a.aliases == b.aliases
    assert len(p.steps) == len(PROGRAMS[name]().steps)  # the input program is not rewritten


def test_make_plan_notes_say_what_was_done():
    plan = make_plan(chain(), MemoryConfig.parse("reuse,recompute=speed"))
    assert plan.notes == ("recompute=speed: 2 checkpoints, 2 layers dropped, 2 forward steps "
                          "recomputed per iteration (300 FLOPs)",)
    plan = make_plan(chain(), MemoryConfig.parse("reuse,binarize"))
    assert plan.notes == ("compression: 2 stashes encoded (poolidx 1, sign 1)",)
    sparse = make_plan(residual(), MemoryConfig.parse("reuse,sparse"))
    assert not sparse.provenance.densities_measured
    assert make_plan(residual(), MemoryConfig.parse("reuse,sparse"),
                     densities={"relu1": 0.3}).provenance.densities_measured


# ---- auto


def test_auto_with_a_budget_between_the_lower_bound_and_the_reuse_peak_fits():
    p = linear_chain(8)
    reuse_peak = p.persistent_bytes() + plan_peak(make_plan(p, MemoryConfig.parse("layrub")))
    budget = 16000
    assert p.lower_bound_bytes() < budget < reuse_peak == 20480
    plan = auto_plan(p, budget)
    plan.validate()
    assert plan.provenance.auto.peak <= budget
    assert plan.provenance.auto.peak == p.persistent_bytes() + plan_peak(plan)  # the simulated peak
    assert plan.static.base == p.persistent_bytes()
    # the walk stops at the first plan that fits: one move earlier did not
    assert plan.provenance.auto.path[-1][2] == plan.provenance.auto.peak
    assert all(step[2] > budget for step in plan.provenance.auto.path[:-1])
    assert plan.notes[0].startswith("auto: budget 16,000 B;")


def test_auto_peak_never_rises_as_the_budget_falls():
    p = linear_chain(8)
    peaks = [auto_choose(p, b).peak for b in (20480, 19000, 17000, 15000, 14336)]
    assert peaks == sorted(peaks, reverse=True)
    assert peaks[-1] == 14336 == auto_choose(p, None).peak


def test_auto_budget_too_small():
    p = linear_chain(8)
    with pytest.raises(BudgetTooSmall, match="smallest peak the auto planner reaches is 14,336 B"):
        auto_plan(p, 12000)
    with pytest.raises(BudgetTooSmall, match="the persistent state alone exceeds the budget"):
        auto_plan(p, 4096)


# ---- random chains and DAGs


@st.composite
def random_programs(draw):
    """A backbone chain of 2..7 layers (each reads the previous one), where an ``add`` also
    reads an earlier value: forks and joins."""
    n = draw(st.integers(2, 7))
    layers: list[HandLayer] = []
    units = {"x": draw(st.integers(1, 4))}
    prev = "x"
    for i in range(n):
        kind = draw(st.sampled_from(["conv", "relu", "pool", "linear", "add"]))
        name = f"{kind}{i}"
        if kind == "add":
            same = [v for v in units if v != prev and units[v] == units[prev]]
            if not same:
                kind, name = "relu", f"relu{i}"
        if kind == "relu":
            ly = HandLayer(name, kind, (prev,), units[prev], keeps="output",
                           inplace_forward=draw(st.booleans()),
                           inplace_backward=draw(st.booleans()))
        elif kind == "add":
            other = draw(st.sampled_from(same))
            ly = HandLayer(name, kind, (prev, other), units[prev], keeps="",
                           inplace_forward=draw(st.booleans()))
        elif kind == "pool":
            ly = HandLayer(name, kind, (prev,), max(1, units[prev] // 2),
                           stash={"argmax": max(1, units[prev] // 2)}, keeps="",
                           facts=MAX_POOL_2X2)
        else:
            ly = HandLayer(name, kind, (prev,), draw(st.integers(1, 4)), params=("w",),
                           fwd_workspace=draw(st.integers(0, 2)) if kind == "conv" else 0,
                           bwd_workspace=draw(st.integers(0, 2)) if kind == "conv" else 0)
        layers.append(ly)
        units[name] = ly.units
        prev = name
    return lower_layers(layers, input_units=units["x"])


RANDOM_SPECS = ["none", "reuse,inplace", "reuse,inplace,static", "reuse,swap=all,static",
                "reuse,recompute=sqrt", "reuse,recompute=memory", "reuse,recompute=cost",
                "gist", "superneurons", "all"]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_programs())
def test_random_programs_every_spec(program):
    for spec in RANDOM_SPECS:
        check_plan(program, spec)


@settings(max_examples=25, deadline=None)
@given(random_programs(), st.sampled_from(["sqrt", "speed", "memory"]))
def test_random_recompute_backward_never_reads_a_dropped_original(program, policy):
    from minidl.memory.passes.recompute import policy_program

    q = policy_program(program, policy)
    made_in_forward = {t for s in q.steps if s.phase == "forward" for t in s.access.writes}
    last_forward = max(s.index for s in q.steps if s.phase == "forward")
    # an original a backward step reads is still live: nothing after forward frees it early
    # unless it was cloned; a clone is read only after its recomputation
    written_before = set(q.inputs) | {t.id for t in q.tensors if t.role == "seed"}
    for s in q.steps:
        for t in s.access.reads:
            if q.tensors[t].persistent:
                continue
            assert t in written_before, (s.label, q.tensors[t].name)
        written_before |= set(s.access.writes)
        if s.phase == "backward":
            for t in s.access.reads:
                spec = q.tensors[t]
                if spec.of >= 0 and "@r" in spec.name:
                    assert spec.of in made_in_forward
    assert last_forward < min(s.index for s in q.steps if s.phase == "backward")


def test_trim_path_starts_from_every_map_swapped_and_gives_back_what_the_budget_allows():
    """The path down from the top: every swappable map released one step after its offload;
    swaps given back only while the plan still fits and costs less time."""
    import time

    from minidl.memory.ir.plan import AutoChoice
    from minidl.memory.passes.swap import swap_candidates
    from minidl.memory.planners.auto import _trim_path
    from minidl.memory.planners.optimal import evaluate

    p = linear_chain(8)
    costs, bw = [1e-3] * len(p.steps), 1e6  # slow link: every swap stalls compute
    every = {c.root for c in swap_candidates(p, {}, "all")
             if c.first_backward - c.last_forward >= 3}
    top_peak, top_extra, _ = evaluate(p, AutoChoice(set(every), set(), early_release=True),
                                      costs, bw)
    assert every and top_extra > 0
    tight = _trim_path(p, top_peak, costs, bw, None, time.perf_counter() + 30)
    assert tight.peak <= top_peak and tight.early_release
    roomy = _trim_path(p, evaluate(p, AutoChoice(), costs, bw)[0], costs, bw, None,
                       time.perf_counter() + 30)
    assert not roomy.swapped and roomy.extra_time_s == 0.0  # nothing was needed
    assert [k for k, *_ in roomy.path].count("keep") == len(every)
    for c in (tight, roomy):  # what the path says is what the built plan does
        assert evaluate(p, c, costs, bw)[:2] == (c.peak, c.extra_time_s)
    below = _trim_path(p, top_peak - 1, costs, bw, None, time.perf_counter() + 30)
    assert below.peak == top_peak and below.swapped == every  # does not fit: the top

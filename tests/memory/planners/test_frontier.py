"""Issue 36: the auto planner's frontier (:mod:`minidl.memory.planners.frontier`) and ``auto``
through
:func:`~minidl.memory.planners.planner.make_plan`.

On hand-built programs (hand_programs.py) and on hypothesis-random networks lowered by the
engine (tests/minidl/random_nets.py, with BatchNorm), priced with a target's cost model:

* monotone: the fastest candidate that fits never gets slower with a larger budget;
* dominance: every fixed spec, planned and placed (``static``) on its own and priced by the
  same pricer, is never faster (1 %) than auto at that spec's placed peak;
* the lower bound: no candidate is faster than the frontier's bound at its own peak;
* exhaustive: every checkpoint subset of a small chain network (both backward groupings:
  one recomputation per dropped run, or per backward step), planned with ``reuse,inplace``
  and placed, is never faster (1 %) than auto at its peak;
* determinism: the frontier does not depend on the clock;
* ``make_plan("auto,budget=B")``: its curve and its certificate.

Where the planner falls short today the test is an expected failure (strict) with the case.
"""

from __future__ import annotations

import itertools
import time

import numpy as np
import pytest
from hand_programs import chain, linear_chain, residual
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

import minidl
from minidl import layers as L
from minidl.compile.engine import Engine
from minidl.layers import SoftmaxCrossEntropy
from minidl.memory.cost.cost_model import step_costs, step_time
from minidl.memory.cost.targets import get_target
from minidl.memory.devices.device import MetaDevice
from minidl.memory.ir.config import MemoryConfig
from minidl.memory.passes.base_plan import base_plan
from minidl.memory.passes.recompute import dropping_program, recompute_program
from minidl.memory.passes.static_plan import static_plan
from minidl.memory.planners.auto import BudgetTooSmall, auto_plan
from minidl.memory.planners.auto import step_costs as flop_costs
from minidl.memory.planners.frontier import TIE_SHARE, build_frontier, fixed_configs, pricer
from minidl.memory.planners.planner import make_plan
from minidl.memory.runtime.pool import Pool
from minidl.net.optim import make_optimizer
from tests.minidl.random_nets import random_networks

RI = MemoryConfig.parse("reuse,inplace")
#: A target whose link is so slow that swapping hides little (as in test_target_plans_random).
SLOW = "custom:flops=15.7T,hbm=900G,link=20M,mem=16GiB"
DETERMINISTIC = dict(deadline=None, derandomize=True,
                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


class Setup:
    """A program with its step costs, link and step pricer (a target's, or FLOPs at the
    default rate for hand-built programs), and its frontier."""

    def __init__(self, program, target: str | None = None, bandwidth: float = 4e9):
        self.program = program
        if target is None:
            self.costs = flop_costs(program, None)
            self.bandwidth = bandwidth
            self.step_cost = None
        else:
            prof = get_target(target)
            self.costs = step_costs(program, prof)
            self.bandwidth = min(prof.link_h2d_bytes_per_s, prof.link_d2h_bytes_per_s)
            self.step_cost = lambda p, i: step_time(p, i, prof)
        self.price = pricer(self.costs, self.bandwidth, self.step_cost)
        self.persistent = program.persistent_bytes()

    def make(self, program, config):
        return make_plan(program, config, step_times=self.costs, bandwidth=self.bandwidth)

    def frontier(self):
        return build_frontier(self.program, self.costs, self.bandwidth, self.make,
                              step_cost=self.step_cost)

    def placed(self, plan) -> tuple[int, float]:
        """(placed peak with the persistent state, seconds) of an unplaced plan."""
        arena = static_plan(plan, base=self.persistent).static.arena
        return self.persistent + arena, self.price(plan)[0]

    def auto(self, budget: int):
        return make_plan(self.program, MemoryConfig.parse(f"auto,budget={budget}"),
                         step_times=self.costs, bandwidth=self.bandwidth,
                         step_cost=self.step_cost)


def lowered(net, shape, batch: int, target: str):
    eng = Engine(net, Pool(MetaDevice(kind="cuda")), "reuse,inplace", SoftmaxCrossEntropy(),
                 make_optimizer("sgd", net.parameters()), bind=False, target=get_target(target))
    return eng.compiled([(batch, *shape)], (batch,), True).lowered.program


def random_setup(netdef, target: str, batch: int = 4) -> Setup:
    (c0, hw), (x, out, seed) = netdef
    return Setup(lowered(minidl.Network(x, out, seed=seed), (c0, hw, hw), batch, target),
                 target)


HAND = {"chain": chain, "residual": residual, "linear6": lambda: linear_chain(6, 3),
        "linear3": lambda: linear_chain(3)}


def budgets(fr, points: int = 24) -> list[int]:
    """Budgets from the least placed peak to the fastest candidate's, evenly spaced, with
    every candidate's peak and its neighbours."""
    lo, hi = fr.least_peak().peak, max(fr.fastest().peak, fr.least_peak().peak)
    out = {int(b) for b in np.linspace(lo, hi, points)}
    for c in fr.candidates:
        out |= {c.peak - 1, c.peak, c.peak + 1}
    return sorted(b for b in out if lo <= b <= hi + 1)


# ---- (a) monotone


def assert_monotone(fr):
    bs = budgets(fr)
    picks = [fr.fitting(b) for b in bs]
    assert picks[0] is not None and fr.fitting(bs[0] - 1) is None or bs[0] == 0
    for b, a, c in zip(bs[1:], picks, picks[1:]):
        # never worse in the planner's objective (time, ties within 0.5 % to less traffic),
        # so never more than that share slower in time
        assert c is not None and fr.objective(c) <= fr.objective(a), (b, a.source, c.source)
        assert c.time_s <= (1 + TIE_SHARE) * a.time_s
        assert c.peak <= b and c.live_peak <= b
    assert picks[-1].time_s == fr.fastest().time_s


@pytest.mark.parametrize("name", HAND)
@pytest.mark.parametrize("bandwidth", [4e9, 1e7])
def test_monotone_on_hand_programs(name, bandwidth):
    assert_monotone(Setup(HAND[name](), bandwidth=bandwidth).frontier())


@settings(max_examples=12, **DETERMINISTIC)
@given(random_networks(batchnorm=True), st.sampled_from(["v100", SLOW]))
def test_monotone_on_random_networks(netdef, target):
    assert_monotone(random_setup(netdef, target).frontier())


# ---- (b) dominance over every fixed spec


def assert_dominates(s: Setup):
    fr = s.frontier()
    for config in fixed_configs(s.program):
        plan = s.make(s.program, MemoryConfig({**config.flags, "static": ""}))
        peak = s.persistent + plan.static.arena
        seconds = s.price(plan)[0]
        pick = fr.fitting(peak)
        assert pick is not None, (config.spec, peak)
        assert pick.time_s <= 1.01 * seconds + 1e-12, (config.spec, peak, seconds, pick.source)


def test_fixed_configs_are_the_lossless_specs_in_order():
    """The fixed configs are built typed: each is the spec string they stood for (in the
    order auto prices them), parsed, its flags in the same order, printed the same."""
    specs = [",".join(p for p in ("reuse,inplace", rec, swap, enc) if p)
             for rec in ("", "recompute=sqrt", "recompute=speed", "recompute=memory",
                         "recompute=cost")
             for swap in ("", "swap=conv", "swap=all", "swap=auto")
             for enc in ("", "binarize", "sparse", "binarize,sparse")]
    configs = fixed_configs(None)
    assert [c.spec for c in configs] == specs
    assert [list(c.flags.items()) for c in configs] == \
        [list(MemoryConfig.parse(s).flags.items()) for s in specs]
    assert len(configs) == 80


@pytest.mark.parametrize("name", HAND)
@pytest.mark.parametrize("bandwidth", [4e9, 1e7])
def test_dominates_fixed_specs_on_hand_programs(name, bandwidth):
    assert_dominates(Setup(HAND[name](), bandwidth=bandwidth))


@settings(max_examples=10, **DETERMINISTIC)
@given(random_networks(batchnorm=True), st.sampled_from(["v100", SLOW]))
def test_dominates_fixed_specs_on_random_networks(netdef, target):
    assert_dominates(random_setup(netdef, target))


# ---- (c) the lower bound


def below_bound(fr) -> list[tuple]:
    out = []
    for c in fr.candidates:
        low = fr.lower_bound(c.peak)
        assert low is not None  # these programs are chains
        if c.time_s < low * (1 - 1e-9):
            out.append((c.source, c.peak, c.time_s, low))
    return out


#: The certificate (memory/planners/certificate.py) bounds every plan of the program: no
#: candidate, however it recomputes, swaps or encodes, is faster at its own peak. (The stage-
#: level Rotor bound it replaced did not hold for partial-stage recomputation on slow links.)


@pytest.mark.parametrize("name, bandwidth", [
    ("chain", 4e9), ("residual", 4e9), ("linear6", 4e9), ("linear3", 4e9),
    ("residual", 1e7), ("linear3", 1e7),
    # 'reuse,inplace,binarize' at 9216 B: 2.32 us; the bound there: 95.2 us
    pytest.param("chain", 1e7),
    # 'reuse,inplace,recompute=sqrt' at 15872 B: 1.25 us; the bound there: 1.30 us
    pytest.param("linear6", 1e7),
])
def test_no_candidate_below_the_bound_on_hand_programs(name, bandwidth):
    assert below_bound(Setup(HAND[name](), bandwidth=bandwidth).frontier()) == []


@pytest.mark.parametrize("name", [
    "chain", "residual", "linear3",
    # 'reuse,inplace,recompute=sqrt' (no swap, no encoding) at 15872 B: 1.25 us; the
    # recomputation bound there: 1.30 us
    pytest.param("linear6"),
])
def test_recompute_bound_holds_for_plain_candidates(name):
    """The recomputation bound alone (no swaps) against the candidates that neither swap nor
    encode (what the bound is said to cover)."""
    fr = Setup(HAND[name]()).frontier()
    plain = [c for c in fr.candidates if not c.plan.swapping.blocks and "binarize" not in c.source
             and "sparse" not in c.source]
    assert plain
    assert [(c.source, c.peak, c.time_s, fr.bound.seconds(c.peak)) for c in plain
            if c.time_s < fr.bound.seconds(c.peak) * (1 - 1e-9)] == []


@settings(max_examples=12, **DETERMINISTIC)
@given(random_networks(batchnorm=True))
def test_no_candidate_below_the_bound_on_random_networks_v100(netdef):
    assert below_bound(random_setup(netdef, "v100").frontier()) == []


@settings(max_examples=4, phases=[Phase.explicit, Phase.generate], **DETERMINISTIC)
@given(random_networks(batchnorm=True))
def test_no_candidate_below_the_bound_on_random_networks_slow_link(netdef):
    assert below_bound(random_setup(netdef, SLOW).frontier()) == []


# ---- (d) exhaustive over checkpoint subsets of small chain networks


def chain_network(ops, c0: int, seed: int):
    """``ops`` (kind, channels) in a row on a ``(c0, hw, hw)`` input, then global average
    pooling and a 5-way linear layer."""
    def build(hw):
        x = minidl.Input((c0, hw, hw))
        v, c, s = x, c0, hw
        for op, width in ops:
            if op == "conv":
                v, c = L.Conv2d(c, width, 3, padding=1)(v), width
            elif op == "relu":
                v = L.ReLU()(v)
            elif op == "tanh":
                v = L.Tanh()(v)
            elif op == "bn":
                v = L.BatchNorm2d(c)(v)
            elif op == "pool" and s >= 2:
                v, s = L.MaxPool2d(2)(v), s // 2
            elif op == "dropout":
                v = L.Dropout(0.3)(v)
        return minidl.Network(x, L.Linear(c, 5)(L.GlobalAvgPool2d()(v)), seed=seed)
    return build


chain_nets = st.tuples(
    st.lists(st.tuples(st.sampled_from(["conv", "relu", "tanh", "bn", "pool", "dropout"]),
                       st.integers(1, 4)), min_size=2, max_size=6),
    st.integers(1, 3), st.sampled_from([4, 8]), st.sampled_from([2, 4, 8]),
    st.sampled_from(["v100", SLOW]))


def enumerated(s: Setup) -> list[tuple[int, float, str, tuple[int, ...]]]:
    """(placed peak, seconds, grouping, dropped forward steps) of every checkpoint subset."""
    p = s.program
    fwd = [st_ for st_ in p.steps if st_.phase == "forward"]
    droppable = [st_.index for st_ in fwd if p.loss not in st_.access.writes]
    per_step = {st_.index: -1 - st_.index for st_ in p.steps if st_.phase == "backward"}
    out = []
    for r in range(len(droppable) + 1):
        for drop in itertools.combinations(droppable, r):
            progs = [("per run", dropping_program(p, set(drop)))]
            if drop:
                keep = {t for st_ in fwd if st_.index not in drop for t in st_.access.writes
                        if p.tensors[t].role == "value"}
                progs.append(("per step", recompute_program(p, keep, per_step)))
            for grouping, q in progs:
                out.append((*s.placed(base_plan(q, RI)), grouping, drop))
    return out


#: Recorded (see the report of issue 36's tests):
#: * relu, bn, bn, conv(3) on 2x8x8, batch 8, the 20 MB/s link: dropping the first BatchNorm's
#:   output (one recomputation per dropped run) peaks at 36352 B and runs in 70.1 us; auto's
#:   pick there ('rotor 148/400 x1') takes 85.1 us (+21 %);
#: * bn, relu, conv(1), conv(1), pool, dropout on 2x8x8, batch 8, v100: dropping the
#:   BatchNorm's output (recomputed per backward step) peaks at 29696 B, 95.1 us; auto's least
#:   peak is 30208 B (nothing fits), and there it takes 105.1 us (+10 %).
CHAIN_CASES = [
    ([("relu", 1), ("bn", 2), ("bn", 2), ("conv", 3)], 2, 8, 8, SLOW),
    ([("bn", 3), ("relu", 2), ("conv", 1), ("conv", 1), ("pool", 3), ("dropout", 3)], 2, 8, 8,
     "v100"),
]


def auto_gaps(case) -> list[tuple]:
    """(peak, seconds, grouping, dropped layers, auto's seconds or None, auto's pick) of each
    enumerated plan auto is slower than (1 %) at its peak (with monotone auto, the same as
    comparing auto with the best plan within each peak)."""
    ops, c0, hw, batch, target = case
    s = Setup(lowered(chain_network(ops, c0, 1)(hw), (c0, hw, hw), batch, target), target)
    fr = s.frontier()
    gaps = []
    for peak, seconds, grouping, drop in enumerated(s):
        pick = fr.fitting(peak)
        if pick is None or pick.time_s > 1.01 * seconds + 1e-12:
            gaps.append((peak, seconds, grouping, [s.program.steps[i].layer for i in drop],
                         pick and pick.time_s, pick and pick.source))
    return gaps


@pytest.mark.xfail(strict=True, reason="the frontier lacks checkpoint subsets Rotor's chain "
                   "model cannot express (a stage's input dropped while the next stage's "
                   "outputs are kept): auto is slower, or fits nothing, where such a plan fits")
@settings(max_examples=6, phases=[Phase.explicit, Phase.generate], **DETERMINISTIC)
@example(CHAIN_CASES[1])
@given(chain_nets)
def test_auto_beats_every_checkpoint_subset(case):
    assert auto_gaps(case) == []


@pytest.mark.xfail(strict=True, reason="see CHAIN_CASES")
@pytest.mark.parametrize("case", CHAIN_CASES)
def test_auto_beats_every_checkpoint_subset_recorded(case):
    assert auto_gaps(case) == []


# ---- (e) determinism: no clock


def picks(fr) -> list:
    return [(c.source, c.time_s, c.peak) for c in fr.pareto()] + [
        (b, None if (c := fr.fitting(b)) is None else (c.source, c.time_s, c.peak))
        for b in budgets(fr, 12)]


def test_frontier_does_not_read_the_clock(monkeypatch):
    s = Setup(lowered(chain_network(CHAIN_CASES[1][0], 2, 1)(8), (2, 8, 8), 8, "v100"), "v100")
    first, second = picks(s.frontier()), picks(s.frontier())
    assert first == second
    budget = sorted(c.peak for c in s.frontier().pareto())[1]
    plan = s.auto(budget)
    clock = itertools.count(0, 1000.0)
    for name in ("perf_counter", "time", "monotonic", "process_time"):
        monkeypatch.setattr(time, name, lambda: float(next(clock)))
    assert picks(s.frontier()) == first
    jumped = s.auto(budget)
    assert (jumped.notes, jumped.static.arena, jumped.provenance.auto.curve) == \
        (plan.notes, plan.static.arena, plan.provenance.auto.curve)
    # (the patch was in place: each read jumps 1000 s)
    assert time.perf_counter() + 1000.0 == time.time()


# ---- (f) make_plan("auto,budget=B")


def assert_auto_plans(s: Setup, points: int = 5):
    fr = s.frontier()
    for budget in budgets(fr, points)[::max(1, len(budgets(fr, points)) // points)]:
        plan = s.auto(budget)
        a = plan.provenance.auto
        assert a is not None and a.curve
        peaks = [c.peak for c in a.curve]
        times = [c.time_s for c in a.curve]
        assert peaks == sorted(peaks) and len(set(peaks)) == len(peaks)
        assert all(t0 >= t1 for t0, t1 in zip(times, times[1:]))  # (equal: less traffic)
        picked = a.oracle_s + a.extra_time_s
        assert picked == pytest.approx(fr.fitting(budget).time_s)
        assert s.persistent + plan.static.arena == a.peak <= budget
        assert a.lower_bound_s is not None and a.lower_bound_s <= picked * (1 + 1e-9)


@pytest.mark.parametrize("name", HAND)
def test_auto_plan_curve_and_certificate_on_hand_programs(name):
    assert_auto_plans(Setup(HAND[name]()))


def test_auto_plan_certificate_on_a_slow_link():
    assert_auto_plans(Setup(chain(), bandwidth=1e7))


@settings(max_examples=6, **DETERMINISTIC)
@given(random_networks(batchnorm=True))
def test_auto_plan_curve_and_certificate_on_random_networks(netdef):
    assert_auto_plans(random_setup(netdef, "v100"), points=3)



def test_planner_greedy_asks_for_the_greedy_walk():
    """``planner=greedy`` is the Capuchin-style walk, plan for plan, at every budget it fits;
    the default (the frontier) plans otherwise at some of them."""
    from minidl.memory.planners.auto import BudgetTooSmall, auto_plan

    s = Setup(chain())
    differs = 0
    for budget in budgets(s.frontier(), 8):
        try:
            walk = auto_plan(s.program, budget, None)
        except BudgetTooSmall:
            continue
        greedy = make_plan(s.program, MemoryConfig.parse(f"auto,budget={budget},planner=greedy"))
        default = make_plan(s.program, MemoryConfig.parse(f"auto,budget={budget}"))
        assert (greedy.begin, greedy.steps) == (walk.begin, walk.steps)
        differs += (default.begin, default.steps) != (walk.begin, walk.steps)
    assert differs


# ---- (f) the certificate against plans made outside the frontier


def certificate_gaps(s: Setup, plans) -> list[tuple]:
    """(what, peak, seconds, bound) of each plan faster than the certificate at its peak."""
    fr = s.frontier()
    out = []
    for what, peak, seconds in plans:
        low = fr.lower_bound(peak)
        if seconds < low * (1 - 1e-9):
            out.append((what, peak, seconds, low))
    return out


@settings(max_examples=4, phases=[Phase.explicit, Phase.generate], **DETERMINISTIC)
@example(CHAIN_CASES[0])
@example(CHAIN_CASES[1])
@given(chain_nets)
def test_no_checkpoint_subset_beats_the_certificate(case):
    """Every checkpoint subset of a small chain (both backward groupings), planned and
    placed, at or above the certificate at its own peak: partial-stage recomputation
    included, which the stage-level bound it replaced did not cover."""
    ops, c0, hw, batch, target = case
    s = Setup(lowered(chain_network(ops, c0, 1)(hw), (c0, hw, hw), batch, target), target)
    plans = [(f"{g} {d}", peak, seconds) for peak, seconds, g, d in enumerated(s)]
    assert certificate_gaps(s, plans) == []


@pytest.mark.parametrize("name", HAND)
@pytest.mark.parametrize("bandwidth", [4e9, 1e7])
def test_greedy_and_fixed_plans_never_beat_the_certificate(name, bandwidth):
    """The greedy walk's plans at many budgets, and every fixed spec placed, priced alike."""
    s = Setup(HAND[name](), bandwidth=bandwidth)
    fr = s.frontier()
    plans = []
    for config in fixed_configs(s.program):
        plan = s.make(s.program, MemoryConfig({**config.flags, "static": ""}))
        plans.append((config.spec, s.persistent + plan.static.arena, s.price(plan)[0]))
    for budget in budgets(fr, 8):
        try:
            plan = auto_plan(s.program, budget, s.costs, bandwidth=s.bandwidth)
        except BudgetTooSmall:
            continue
        plans.append((f"greedy {budget}", s.persistent + plan.static.arena, s.price(plan)[0]))
    assert len(plans) > len(fixed_configs(s.program)) // 2
    assert certificate_gaps(s, plans) == []

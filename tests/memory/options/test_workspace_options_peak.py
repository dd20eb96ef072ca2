"""vDNN's rule without a budget (memory/options/workspace_options.py :func:`peak_options`), on
hand-built programs: the peak of the least-workspace plan kept while every workspace below it
grows to its fastest size, one set of caps whatever the spec planned, the level traded
against the estimated time, and the caps lifted where this machine's rows fit them."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from minidl.kernels.convolution.conv_geometry import REFERENCE_ROWS
from minidl.memory.ir.config import MemoryConfig
from minidl.memory.options import workspace_caps as WC
from minidl.memory.options import workspace_options as W
from minidl.memory.options import workspace_peak as WP
from minidl.memory.options import workspace_times as WT
from minidl.memory.passes.base_plan import base_plan, plan_peak
from tests.memory.options.test_workspace_options import _program, _resized

REUSE = MemoryConfig.parse("reuse,inplace")


def _lowering(ws: list[tuple[int, int]], grow: list[int]):
    """A program whose convolutions' least workspaces are ``ws`` (units) and fastest ones
    ``grow`` * 512 B more, and a ``plan_with`` lowering it under caps: each workspace the
    largest size within its cap (at least its least), as :func:`conv_config` picks the
    fastest configuration that fits. Records each call's (options, spec)."""
    lean = _program(ws)
    small = W.workspaces(lean)
    fast = {k: b + g * 512 for (k, b), g in zip(sorted(small.items()), grow + grow)}
    calls = []

    def sizes(options):
        out = dict(fast)
        for node, o in (options or {}).items():
            for backward, cap in zip((False, True), o.get(WC.OPTION, (None, None))):
                if cap is not None and (node, backward) in small:
                    out[(node, backward)] = max(small[(node, backward)],
                                                min(cap, fast[(node, backward)]))
        return out

    def plan_with(options, config):
        calls.append((options, config.spec))
        program = _resized(lean, sizes(options))
        return program, base_plan(program, config)

    return _resized(lean, fast), lean, small, fast, plan_with, calls


WS = st.lists(st.tuples(st.integers(0, 6), st.integers(1, 8)), min_size=1, max_size=4)
GROW = st.lists(st.integers(1, 12), min_size=4, max_size=4)


@settings(max_examples=40, deadline=None)
@given(ws=WS, grow=GROW)
def test_no_budget_keeps_the_least_workspace_peak_and_grows_every_workspace_below_it(ws, grow):
    program, lean, small, fast, plan_with, calls = _lowering(ws, grow)
    low, plan = W.plan_fitting(program, {}, REUSE, plan_with, share=float("inf"))
    least = plan_peak(base_plan(lean, REUSE))
    assert plan_peak(plan) == least  # the least-workspace plan's peak, not one byte more
    assert plan_peak(plan) <= plan_peak(base_plan(program, REUSE))
    got = W.workspaces(low)
    for key in fast:
        assert small[key] <= got[key] <= fast[key]
        # a workspace short of its fastest size: its fastest size would raise the peak
        if got[key] < fast[key]:
            grown = _resized(low, {key: fast[key]})
            assert plan_peak(base_plan(grown, REUSE)) > least, key
    # the caps come from the canonical spec's plans, before the spec's own
    assert [spec for _, spec in calls[:2]] == [W.CANONICAL.spec] * 2


@settings(max_examples=25, deadline=None)
@given(ws=WS, grow=GROW)
def test_every_spec_runs_the_same_caps(ws, grow):
    """One set of caps whatever the spec: the lossless specs stay bit-identical."""
    program, _, _, _, plan_with, calls = _lowering(ws, grow)
    finals = []
    for spec in ("reuse,inplace", "reuse", "none", "reuse,inplace,static"):
        calls.clear()
        W.plan_fitting(program, {}, MemoryConfig.parse(spec), plan_with, share=float("inf"))
        finals.append(calls[-1][0])
        assert calls[-1][1] == MemoryConfig.parse(spec).spec or spec == "reuse,inplace"
    assert all(f == finals[0] for f in finals)


def test_the_convolution_at_the_peak_stays_lean_the_others_get_their_fastest_size():
    # conv0's backward runs where the most is live: growing it raises the peak; conv1's
    # workspaces have room below that peak
    program, lean, small, fast, plan_with, _ = _lowering([(1, 6), (1, 1)], [9, 1, 1, 1])
    low, plan = W.plan_fitting(program, {}, REUSE, plan_with, share=float("inf"))
    got = W.workspaces(low)
    assert plan_peak(plan) == plan_peak(base_plan(lean, REUSE)) < \
        plan_peak(base_plan(program, REUSE))
    leaner = [k for k in fast if got[k] < fast[k]]
    assert leaner and all(got[k] == fast[k] for k in fast if k not in leaner)
    assert any(n.startswith(W.NOTE_PREFIX) and W.AT_PEAK in n for n in plan.notes)
    # without the rule: the fastest sizes, no note
    low, plan = W.plan_fitting(program, {}, REUSE, plan_with, enabled=False)
    assert W.workspaces(low) == fast and not plan.notes


class _Times:
    """Estimated times of the steps of one key: the least workspace ``slow`` times its
    default's, ``mid`` bytes ``medium`` times, the fastest size 1x; every other step 1."""

    def __init__(self, key, small, mid, fast, slow, medium, weight, total):
        self.steps = [(weight, ((small, mid, fast), (slow, medium, 1.0), 1.0))]
        self.key, self.total = key, total

    def table(self, program):
        return {self.key: self.steps}, self.total


def test_the_level_rises_until_the_estimated_time_fits_the_share():
    program, lean, small, fast, plan_with, _ = _lowering([(1, 6), (1, 1)], [9, 9, 9, 9])
    blocks, least = W._blocks(base_plan(lean, REUSE))
    key = next(k for k, _, most, _ in blocks if most == least)  # a workspace at the peak
    mid = small[key] + 2048
    times = _Times(key, small[key], mid, fast[key], slow=3.0, medium=1.5, weight=10.0,
                   total=100.0)
    # its least workspace: 20 % slower, mid: 5 %, its fastest size: 0 %
    cases = {float("inf"): least, 0.25: least, 0.1: least + mid - small[key],
             0.01: least + fast[key] - small[key]}
    for share, peak in cases.items():
        _, plan = W.plan_fitting(program, {}, REUSE, plan_with, times=times, share=share)
        assert plan_peak(plan) == peak, share
        assert plan_peak(plan) <= plan_peak(base_plan(program, REUSE))


@settings(max_examples=60, deadline=None)
@given(blocks=st.lists(st.tuples(st.integers(0, 3), st.booleans(), st.integers(0, 8),
                                 st.integers(0, 20)), min_size=1, max_size=6),
       steps=st.lists(st.tuples(st.integers(1, 30), st.floats(1.0, 5.0)), min_size=1,
                      max_size=4),
       share=st.floats(0.0, 0.5), weight=st.floats(0.5, 20.0))
def test_peak_level_is_the_lowest_level_within_the_share(blocks, steps, share, weight):
    """The bisection against a scan of every level: the lowest one whose caps are estimated
    within ``share``."""
    unit = 512
    peak = max(size + extra for _, _, size, extra in blocks) * unit
    bl = [((node, b), size * unit, (size + extra) * unit, False)
          for node, b, size, extra in blocks]
    caps = sorted({c * unit for c, _ in steps})
    rels = sorted((r for _, r in steps), reverse=True)[:len(caps)]
    rels += [1.0] * (len(caps) - len(rels))
    rels[-1] = 1.0  # the fastest size: the default
    table = {k: [(weight, (tuple(caps), tuple(rels), 1.0))] for k, _, _, _ in bl}
    total = 100.0

    def cost(level):
        c = W.level_caps(bl, level, unit)
        return sum(WT._extra(table[k], v) for k, v in c.items()) / total

    level, added = WP.peak_level(bl, peak, unit, table, total, share)
    assert added == cost(level) and added <= share + 1e-12
    assert all(cost(lv) > share for lv in range(peak, level, unit))


def test_released_lifts_only_caps_this_machines_rows_fit():
    caps = {0: {WC.OPTION: (100, 50)}, 2: {WC.OPTION: (None, 10)}}
    fast = {(0, False): 80, (0, True): 60, (2, True): 10}
    assert W.released(caps, fast, rows=1) == caps  # one row: the capped size may differ
    # the reference rows: a cap holding the fastest size runs the same rows as no cap
    assert W.released(caps, fast, rows=REFERENCE_ROWS) == caps
    assert W.released(caps, fast, rows=16) == {0: {WC.OPTION: (None, 50)}}
    # the uncapped size would raise the capped plan's peak: the cap stays (its rows only)
    assert W.released(caps, fast, rows=16, room={(0, False): 70, (2, True): 10}) == {
        0: {WC.OPTION: (100, 50)}}
    assert W.released(caps, fast, rows=16, room={(0, False): 80}) == {
        0: {WC.OPTION: (None, 50)}, 2: {WC.OPTION: (None, 10)}}

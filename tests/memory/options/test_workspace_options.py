"""memory/options/workspace_options.py on hand-built programs: which steps take the ``conv_ws``
option, the least-workspace options, caps from a plan's headroom that keep every point within
the budget, and the note."""

from __future__ import annotations

from dataclasses import replace

from hand_programs import UNIT, HandLayer, lower_layers
from hypothesis import given, settings
from hypothesis import strategies as st

from minidl.memory.ir.capabilities import op_caps
from minidl.memory.ir.config import MemoryConfig
from minidl.memory.ir.program import Program, TensorSpec
from minidl.memory.options import workspace_caps as WC
from minidl.memory.options import workspace_options as W
from minidl.memory.passes.base_plan import base_plan, plan_peak

CONV = op_caps("conv", cost="expensive", convolution=True, options=("conv_ws",))
REUSE = MemoryConfig.parse("reuse,inplace")


def _program(ws: list[tuple[int, int]]) -> Program:
    """conv0 -> relu0 -> conv1 -> relu1 -> ... -> fc, conv i with (forward, backward)
    workspaces of ``ws[i]`` units, its steps taking the option."""
    layers = []
    prev = "x"
    for i, (f, b) in enumerate(ws):
        layers.append(HandLayer(f"conv{i}", "conv", (prev,), 4, params=("w",),
                                fwd_workspace=f, bwd_workspace=b, flops=8000))
        layers.append(HandLayer(f"relu{i}", "relu", (f"conv{i}",), 4, keeps="output",
                                inplace_forward=True, inplace_backward=True, flops=100))
        prev = f"relu{i}"
    layers.append(HandLayer("fc", "linear", (prev,), 1, params=("w",), flops=4000))
    p = lower_layers(layers)
    steps = [replace(st, op=replace(st.op, caps=CONV)) if st.kind == "conv" else st
             for st in p.steps]
    return replace(p, steps=steps)


def _resized(program: Program, sizes: dict[W.Key, int]) -> Program:
    """``program`` with the workspaces of the given (node, backward) keys grown to ``sizes``
    bytes (never shrunk), as a lowering under caps that size could make them."""
    tensors = list(program.tensors)
    for i in WC.capped_steps(program):
        st = program.steps[i]
        key = (st.node, st.phase == "backward")
        if key in sizes:
            t = tensors[st.access.workspace]
            tensors[st.access.workspace] = TensorSpec(
                t.id, t.name, (max(t.nbytes, sizes[key]) // 4,), t.dtype, t.category,
                t.role, t.layer, t.of, t.persistent)
    return replace(program, tensors=tensors)


def test_steps_taking_the_option_and_lean_options():
    p = _program([(2, 3), (0, 5)])
    nodes = {p.steps[i].node for i in WC.capped_steps(p)}
    assert nodes == {0, 2}  # conv0's and conv1's nodes (a relu in between)
    assert len(WC.capped_steps(p)) == 3  # conv1 has no forward workspace
    assert W.workspaces(p) == {(0, False): 2 * UNIT * 4, (0, True): 3 * UNIT * 4,
                               (2, True): 5 * UNIT * 4}
    assert W.lean_options(p) == {0: {"conv_ws": (0, 0)}, 2: {"conv_ws": (None, 0)}}
    assert W.merged({0: {"bptt": "x"}}, W.lean_options(p)) == {
        0: {"bptt": "x", "conv_ws": (0, 0)}, 2: {"conv_ws": (None, 0)}}
    no_option = lower_layers([HandLayer("c", "conv", ("x",), 4, fwd_workspace=2)])
    assert WC.capped_steps(no_option) == [] and W.lean_options(no_option) == {}


@settings(max_examples=40, deadline=None)
@given(ws=st.lists(st.tuples(st.integers(0, 6), st.integers(1, 8)), min_size=1, max_size=4),
       grow=st.lists(st.integers(1, 12), min_size=4, max_size=4), slack=st.integers(0, 20))
def test_headroom_caps_keep_every_point_within_the_budget(ws, grow, slack):
    lean = _program(ws)
    plan = base_plan(lean, REUSE)
    persistent = lean.persistent_bytes()
    budget = persistent + plan_peak(plan) + slack * 512
    small = W.workspaces(lean)
    fast = {k: b + g * 512 for (k, b), g in zip(sorted(small.items()), grow + grow)}
    caps = W.headroom_options(plan, budget)
    assert set(caps) == {n for n, _ in small}  # every convolution gets a cap
    sizes = dict(fast)  # every workspace at its cap, or its fast size if smaller
    for node, o in caps.items():
        assert set(o) == {"conv_ws"}
        for backward, cap in zip((False, True), o["conv_ws"]):
            assert (cap is None) == ((node, backward) not in small)
            if cap is not None:
                assert cap >= 0 and cap % 512 == 0
                sizes[(node, backward)] = max(min(cap, fast[(node, backward)]),
                                              small[(node, backward)])
    peak = plan_peak(base_plan(_resized(lean, sizes), REUSE))
    assert persistent + peak <= budget and peak <= plan_peak(plan)  # never above its peak
    # room for every fast workspace under the plan's peak: every cap reaches it
    if plan_peak(base_plan(_resized(lean, fast), REUSE)) <= plan_peak(plan):
        assert all(_cap(caps, n, b) >= size for (n, b), size in fast.items())
    # a smaller budget: caps never larger
    tighter = W.headroom_options(plan, budget - 1024)
    for node, b in fast:
        assert _cap(tighter, node, b) <= _cap(caps, node, b)


def _cap(caps: dict, node: int, backward: bool) -> float:
    c = caps.get(node, {}).get("conv_ws", (None, None))[int(backward)]
    return float("inf") if c is None else c


def test_at_the_peak_the_workspace_live_there_stays_lean():
    lean = _program([(1, 6), (1, 1)])
    plan = base_plan(lean, REUSE)
    budget = lean.persistent_bytes() + plan_peak(plan)
    small = W.workspaces(lean)
    caps = W.headroom_options(plan, budget)
    at_peak = [(n, b) for n, o in caps.items() for b, c in zip((False, True), o["conv_ws"])
               if c == small[(n, b)]]
    assert at_peak  # no room left where the plan peaks: that workspace cannot grow


def test_note_names_capped_layers_largest_saving_first():
    p = _program([(2, 3), (2, 5)])
    fast = {(0, False): 2 * UNIT * 4, (0, True): 3 * UNIT * 4 + (8 << 20),
            (2, False): 2 * UNIT * 4 + (1 << 20), (2, True): 5 * UNIT * 4}
    note = W.describe(p, fast)  # p's workspaces: the smaller ones
    assert note.startswith(W.NOTE_PREFIX) and "2 of 2 convolutions" in note
    assert note.index("conv0") < note.index("conv1")  # 8 MiB saved before 1 MiB
    assert W.describe(p, W.workspaces(p)).startswith(f"{W.NOTE_PREFIX}: 0 of 2")


def test_levels_are_tried_largest_cap_first():
    """No plan with vDNN's caps fits: every convolution capped at the first level (32 MiB) is
    tried before 1 MiB and the least workspace; the first that fits is the plan."""
    from minidl.memory.planners.auto import BudgetTooSmall

    p = _program([(2, 3), (0, 5)])
    tried = []

    def plan_with(options, config):
        tried.append((options, config.budget))
        if config.budget is not None and options != W.lean_options(p, 32 << 20):
            raise BudgetTooSmall("no fit")
        return "lowered", base_plan(p, REUSE)

    config = MemoryConfig.parse("auto,budget=1000000000")
    low, plan = W.plan_fitting(p, {}, config, plan_with)
    assert W.LEVELS[0] == 32 << 20 and list(W.LEVELS[1:]) == [1 << 20, 0]
    budgeted = [options for options, budget in tried if budget is not None]
    # first the caps of vDNN's rule (planned under the canonical spec, no budget)
    assert [b for _, b in tried[:2]] == [None, None]
    assert budgeted[0] != W.lean_options(p, 32 << 20)
    assert budgeted[1] == W.lean_options(p, 32 << 20)
    assert low == "lowered"

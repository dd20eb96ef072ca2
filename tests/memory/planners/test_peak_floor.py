"""Issue 45: the peak floor (:mod:`minidl.memory.planners.floor`) — no plan goes under it, and a
budget under it is refused before any search.

* on hand-built programs, the floor is the step the test names, with the bytes it names;
* on the hand programs and on hypothesis-random networks (BatchNorm, fan-out, pools) lowered
  for a target, every candidate of the auto planner's frontier (fixed specs, Rotor's
  schedules, the knapsack's, swaps added), the greedy walk's plans at several budgets, and
  the least placed peak, is at or above the floor;
* the engine refuses a budget one byte under the floor with :class:`BelowFloor` (the floor's
  bytes and its step in the message) and plans at the least placed peak;
* the CLI says so in one line, with no suggestion run.
"""

from __future__ import annotations

import dataclasses

import pytest
from hand_programs import chain, joint_recompute, linear_chain, residual
from hypothesis import given, settings

import minidl
from minidl.cli import main
from minidl.memory.planners.auto import BelowFloor, BudgetTooSmall, auto_plan
from minidl.memory.planners.floor import peak_floor, unavoidable_bytes
from minidl.zoo.models import get_model
from tests.memory.planners.test_frontier import DETERMINISTIC, Setup, random_setup
from tests.minidl.random_nets import random_networks


def test_floor_of_the_hand_chain():
    """chain(): the floor is the largest step's unavoidable bytes; conv's forward holds its
    input and output whole, and its workspace unless the op can cap it."""
    prog = chain()
    floor = peak_floor(prog)
    sizes = [unavoidable_bytes(prog, st) for st in prog.steps]
    assert floor.step_bytes == max(sizes) and floor.step == sizes.index(max(sizes))
    assert floor.bytes == prog.persistent_bytes() + max(sizes)
    # never more than the old lower bound (which counts workspaces and stashes too)
    assert floor.bytes <= prog.lower_bound_bytes()
    fwd = next(st for st in prog.steps if st.layer == "conv" and st.phase == "forward")
    x, out, ws = fwd.forward.inputs[0], fwd.forward.outputs[0], fwd.access.workspace
    whole = prog.block_size(prog.tensors[x].nbytes) + prog.block_size(prog.tensors[out].nbytes)
    # this hand conv declares no workspace option: its workspace cannot be capped, so counts
    assert not fwd.op.caps.options
    assert unavoidable_bytes(prog, fwd) == whole + prog.block_size(prog.tensors[ws].nbytes)
    caps = dataclasses.replace(fwd.op.caps, options=frozenset({"conv_ws"}))
    capped = dataclasses.replace(fwd, op=dataclasses.replace(fwd.op, caps=caps))
    assert unavoidable_bytes(prog, capped) == whole


@pytest.mark.parametrize("make", [chain, residual, joint_recompute, lambda: linear_chain(5)])
def test_no_candidate_under_the_floor_on_hand_programs(make):
    setup = Setup(make())
    floor = peak_floor(setup.program).bytes
    fr = setup.frontier()
    assert all(c.live_peak >= floor and c.peak >= floor for c in fr.candidates)
    assert fr.least_peak().peak >= floor


def _greedy_peaks(setup: Setup, budgets: list[int]) -> list[int]:
    out = []
    for b in budgets:
        try:
            plan = auto_plan(setup.program, b, setup.costs, bandwidth=setup.bandwidth)
        except BudgetTooSmall:
            continue
        out.append(setup.persistent + plan.static.arena)
    return out


@settings(max_examples=12, **DETERMINISTIC)
@given(netdef=random_networks(batchnorm=True))
def test_no_plan_under_the_floor_on_random_networks(netdef):
    setup = random_setup(netdef, "v100")
    floor = peak_floor(setup.program).bytes
    fr = setup.frontier()
    low = fr.least_peak().peak
    assert floor <= low
    for c in fr.candidates:
        assert c.live_peak >= floor, (c.source, c.live_peak, floor)
    top = fr.fastest().peak
    for peak in _greedy_peaks(setup, sorted({low, (low + top) // 2, top})):
        assert peak >= floor


def test_engine_refuses_under_the_floor_and_plans_at_it():
    net = get_model("resnet8", input_shape=(3, 16, 16))
    rep = minidl.dry_run(net, 8, "reuse,inplace", input_shape=(3, 16, 16), target="v100")
    floor = rep["lower_bound_bytes"]  # the floor is at most this
    with pytest.raises(BelowFloor) as info:
        minidl.dry_run(get_model("resnet8", input_shape=(3, 16, 16)), 8, "auto,budget=1MiB",
                       input_shape=(3, 16, 16), target="v100")
    assert "every plan of this program needs at least" in str(info.value)
    assert info.value.floor.bytes <= floor and info.value.budget == 1 << 20
    just = info.value.floor.bytes - 1
    with pytest.raises(BelowFloor):
        minidl.dry_run(get_model("resnet8", input_shape=(3, 16, 16)), 8,
                       f"auto,budget={just}", input_shape=(3, 16, 16), target="v100")
    # at the least peak the frontier reaches, auto plans (the floor is no false refusal)
    fine = minidl.dry_run(get_model("resnet8", input_shape=(3, 16, 16)), 8,
                          f"auto,budget={rep['peak_reserved_bytes']}",
                          input_shape=(3, 16, 16), target="v100")
    assert fine["peak_reserved_bytes"] >= info.value.floor.bytes


def test_cli_refuses_under_the_floor_in_one_line(capsys):
    code = main(["plan", "resnet8", "--input", "3x16x16", "--batch-size", "8", "--target",
                 "v100", "--memory", "auto,budget=1MiB"])
    err = capsys.readouterr().err
    assert code != 0
    assert "every plan of this program needs at least" in err
    assert "Traceback" not in err and "specs that fit: none" in err

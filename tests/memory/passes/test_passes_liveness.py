"""Unit tests of the liveness-based passes on hand-built programs: ``lifetimes``,
``liveness_plan``, the ``none`` baseline, ``inplace`` and ``reuse`` sharing, ``base_plan`` and
``Plan.validate``."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hand_programs import chain, ids, render, residual

from minidl.memory.ir.config import MemoryConfig
from minidl.memory.ir.liveness import Lifetime, lifetimes, liveness_plan
from minidl.memory.ir.plan import Alloc, Free, StepPlan
from minidl.memory.ir.program import Step
from minidl.memory.passes.base_plan import base_plan, iteration_peak, plan_peak
from minidl.memory.passes.inplace import inplace_aliases
from minidl.memory.passes.network_wide import network_wide_keep
from minidl.memory.passes.reuse import intra_layer_aliases

UNIT = 512


def named(program, mapping: dict[int, int]) -> dict[str, str]:
    n = {t.id: t.name for t in program.tensors}
    return {n[k]: n[v] for k, v in mapping.items()}


def test_lifetimes_of_the_chain():
    p = chain()
    t = ids(p)
    life = lifetimes(p)
    assert life[t["x"]] == Lifetime(t["x"], -1, 9, True)  # fed; read by conv's backward
    assert life[t["labels"]] == Lifetime(t["labels"], -1, 5, True)
    assert life[t["conv"]] == Lifetime(t["conv"], 0, 1, False)
    assert life[t["relu"]] == Lifetime(t["relu"], 1, 8, True)
    assert life[t["pool.argmax"]] == Lifetime(t["pool.argmax"], 2, 7, True)
    assert life[t["loss"]] == Lifetime(t["loss"], 4, 4, False)  # written, never read
    assert life[t["conv.bwd_ws"]] == Lifetime(t["conv.bwd_ws"], 9, 9, False)
    assert not any(p.tensors[k].persistent for k in life)  # parameters are not planned


def test_liveness_plan_frees_right_after_the_last_reader():
    assert render(liveness_plan(chain())) == [
        ("begin", [], ["alloc x", "alloc labels"]),
        ("conv (forward)", ["alloc conv", "alloc conv.fwd_ws"], ["free conv.fwd_ws"]),
        ("relu (forward)", ["alloc relu"], ["free conv"]),
        ("pool (forward)", ["alloc pool", "alloc pool.argmax"], []),
        ("fc (forward)", ["alloc fc"], []),
        ("loss (forward)", ["alloc loss"], ["free loss"]),
        ("loss (backward)", ["alloc loss.grad", "alloc fc.grad"],
         ["free labels", "free fc", "free loss.grad"]),
        ("fc (backward)", ["alloc pool.grad"], ["free pool", "free fc.grad"]),
        ("pool (backward)", ["alloc relu.grad"], ["free pool.argmax", "free pool.grad"]),
        ("relu (backward)", ["alloc conv.grad"], ["free relu", "free relu.grad"]),
        ("conv (backward)", ["alloc conv.bwd_ws"],
         ["free x", "free conv.grad", "free conv.bwd_ws"]),
        ("end", [], []),
    ]


def test_none_keeps_everything_but_scratch_to_the_end():
    p = chain()
    keep = network_wide_keep(p)
    assert sorted(p.tensors[k].name for k in keep) == sorted(
        ["x", "labels", "conv", "relu", "pool", "pool.argmax", "fc", "loss", "loss.grad",
         "fc.grad", "pool.grad", "relu.grad", "conv.grad"])
    plan = base_plan(p, MemoryConfig.parse("none"))
    rows = render(plan)
    frees = [a for _, before, after in rows for a in before + after if a.startswith("free")]
    # only the workspaces die within the iteration; every other block is freed at the end
    assert frees == ["free conv.fwd_ws", "free conv.bwd_ws"] + [f"free {n}" for n in (
        "x", "labels", "conv", "relu", "pool", "pool.argmax", "fc", "loss", "loss.grad",
        "fc.grad", "pool.grad", "relu.grad", "conv.grad")]
    assert rows[-1][1] == frees[2:]
    assert plan.aliases == {}
    # everything kept: 31 units at the end of backward, plus conv's 3-unit workspace
    assert plan_peak(plan) == 34 * UNIT


def test_liveness_plan_keep_extends_to_the_end():
    p = chain()
    t = ids(p)
    rows = render(liveness_plan(p, keep={t["conv"]}))
    assert rows[2] == ("relu (forward)", ["alloc relu"], [])
    assert rows[-1] == ("end", ["free conv"], [])


def test_inplace_aliases_the_output_over_a_dying_input():
    assert named(chain(), inplace_aliases(chain())) == {"relu": "conv"}


def test_inplace_refuses_an_input_still_read_later():
    # add may write over relu1, but conv2's backward still reads relu1: only relu2 -> add
    p = residual()
    assert named(p, inplace_aliases(p)) == {"relu1": "conv1", "relu2": "add"}


def _sharing(st: Step, shares: tuple[tuple[int, int], ...]) -> Step:
    """``st`` with its ``access.shares`` replaced."""
    return replace(st, access=replace(st.access, shares=shares))


def test_inplace_refuses_a_fed_input_and_different_sizes():
    p = chain()
    t = ids(p)
    relu_fwd = p.steps[1]
    # relu declared in place over the data: fed tensors are never written over
    over_fed = replace(p, steps=[*p.steps[:1], _sharing(relu_fwd, ((t["relu"], t["x"]),)),
                                 *p.steps[2:]])
    assert inplace_aliases(over_fed) == {}
    # pool (2 units) in place over relu (4 units): sizes differ
    pool_fwd = _sharing(p.steps[2], ((t["pool"], t["relu"]),))
    resized = replace(p, steps=[*p.steps[:1], _sharing(relu_fwd, ()), pool_fwd,
                                *p.steps[3:]])
    assert inplace_aliases(resized) == {}


def test_reuse_aliases_input_gradient_over_dead_output_gradient():
    assert named(chain(), intra_layer_aliases(chain())) == {"conv.grad": "relu.grad"}
    p = residual()
    assert named(p, intra_layer_aliases(p)) == {"add.grad": "relu2.grad",
                                               "conv1.grad": "relu1.grad"}


def test_reuse_and_inplace_plan_views_and_group_lifetimes():
    p = chain()
    plan = base_plan(p, MemoryConfig.parse("reuse,inplace"))
    assert named(p, plan.aliases) == {"relu": "conv", "conv.grad": "relu.grad"}
    rows = render(plan)
    # relu is a view of conv's block: conv's block lives until relu's last reader (step 8)
    assert rows[2] == ("relu (forward)", ["alloc relu"], [])
    assert rows[9] == ("relu (backward)", ["alloc conv.grad"], ["free relu", "free conv"])
    assert rows[10] == ("conv (backward)", ["alloc conv.bwd_ws"],
                        ["free conv.grad", "free x", "free relu.grad", "free conv.bwd_ws"])
    plan.validate()
    # units live: 5 fed + 4 conv + 2 pool + 2 argmax + 1 fc - ... peaks at pool's backward
    assert plan_peak(plan) == 16 * UNIT
    assert iteration_peak(p, MemoryConfig.parse("reuse,inplace")) == 16 * UNIT


# reuse peaks in backward, where the in-place ReLU (which saves conv's 4 units in forward)
# no longer matters; inplace alone saves those 4 units for the whole iteration
@pytest.mark.parametrize("spec, peak_units", [
    ("none", 34), ("inplace", 30), ("reuse", 16), ("reuse,inplace", 16)])
def test_base_plan_peaks_of_the_chain(spec, peak_units):
    plan = base_plan(chain(), MemoryConfig.parse(spec))
    plan.validate()
    assert plan_peak(plan) == peak_units * UNIT


# ---- Plan.validate catches broken plans


def _edit(plan, i, before=None, after=None):
    steps = list(plan.steps)
    sp = steps[i]
    steps[i] = StepPlan(sp.before if before is None else before,
                        sp.after if after is None else after)
    return replace(plan, steps=tuple(steps))


def test_validate_accepts_the_liveness_plan():
    liveness_plan(chain()).validate()
    liveness_plan(residual(), intra_layer_aliases(residual())).validate()


def test_validate_catches_use_after_free():
    p = chain()
    t = ids(p)
    plan = liveness_plan(p)
    early = _edit(_edit(plan, 1, after=[]), 0, after=[Free(t["conv.fwd_ws"]), Free(t["conv"])])
    with pytest.raises(AssertionError, match=r"step 1 \(relu \(forward\)\) touches conv"):
        early.validate()


def test_validate_catches_double_alloc_and_double_free():
    p = chain()
    t = ids(p)
    plan = liveness_plan(p)
    twice = _edit(plan, 2, before=[*plan.steps[2].before, Alloc(t["conv"])])
    with pytest.raises(AssertionError, match=f"step 2 before: tensor {t['conv']} allocated twice"):
        twice.validate()
    freed_twice = _edit(plan, 2, after=[Free(t["conv"])])
    with pytest.raises(AssertionError, match=f"tensor {t['conv']} freed while not live"):
        freed_twice.validate()


def test_validate_catches_a_leak():
    p = chain()
    plan = liveness_plan(p)
    leak = _edit(plan, 6, after=[a for a in plan.steps[6].after
                                 if p.tensors[a.tensor].name != "pool"])
    with pytest.raises(AssertionError, match=r"still live at the end: \['pool'\]"):
        leak.validate()


def test_validate_catches_a_missing_alloc():
    p = chain()
    plan = liveness_plan(p)
    missing = _edit(plan, 8, before=[])  # relu's backward writes conv.grad, never allocated
    with pytest.raises(AssertionError, match=r"step 8 \(relu \(backward\)\) touches conv.grad"):
        missing.validate()


def _swap_plan_of_chain():
    from minidl.memory.ir.config import MemoryConfig as Cfg
    from minidl.memory.planners.planner import make_plan

    plan = make_plan(chain(), Cfg.parse("reuse,swap=all"))
    assert plan.swapping.blocks, "the chain has a tensor to swap"
    return plan


def _drop(plan, action):
    """``plan`` without one occurrence of ``action`` (wherever it sits)."""
    steps = [StepPlan([a for a in sp.before if a != action], [a for a in sp.after if a != action])
             for sp in plan.steps]
    return replace(plan, steps=tuple(steps))


def test_validate_follows_a_swapped_tensor_through_its_four_actions():
    from minidl.memory.ir.plan import Await, Prefetch, Release

    plan = _swap_plan_of_chain()
    plan.validate()
    root = plan.swapping.blocks[0]
    with pytest.raises(AssertionError, match=f"tensor {root} is offloading: cannot prefetch it"):
        _drop(plan, Release(root)).validate()
    with pytest.raises(AssertionError, match=f"tensor {root} is on_host: cannot await_prefetch it"):
        _drop(plan, Prefetch(root)).validate()
    with pytest.raises(AssertionError, match=r"touches \w+ which is not live"):
        _drop(plan, Await(root)).validate()  # backward would read it while away

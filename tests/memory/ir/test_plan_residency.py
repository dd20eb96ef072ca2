"""Plan.validate follows the residency table the runtime follows (memory/ir/residency.py):
each plan action declares its move, and validation accepts exactly the table's moves (plus one
plan rule: a tensor is allocated once)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hand_programs import chain, ids

from minidl.memory.ir.config import MemoryConfig
from minidl.memory.ir.liveness import liveness_plan
from minidl.memory.ir.plan import (
    ACTIONS,
    EFFECTS,
    Alloc,
    Await,
    Free,
    Offload,
    Prefetch,
    Release,
    StepPlan,
    residency_move,
)
from minidl.memory.ir.residency import ACTIONS as RESIDENCY_ACTIONS
from minidl.memory.ir.residency import Residency
from minidl.memory.planners.planner import make_plan


def _with_after(plan, i, after):
    steps = list(plan.steps)
    steps[i] = StepPlan(steps[i].before, after)
    return replace(plan, steps=tuple(steps))


def _conv_freed():
    """The chain's liveness plan, its tensor ``conv``, the step after which the plan frees it,
    and that step's other after-actions."""
    p = chain()
    plan = liveness_plan(p)
    t = ids(p)["conv"]
    i = next(i for i, sp in enumerate(plan.steps) if Free(t) in sp.after)
    return plan, t, i, [a for a in plan.steps[i].after if a != Free(t)]


def test_every_plan_action_declares_a_move_of_the_table():
    assert {EFFECTS[a.kind].move for a in ACTIONS} <= set(RESIDENCY_ACTIONS)


def test_the_cache_turns_release_and_prefetch_into_the_cached_moves():
    assert residency_move(Release(1), Residency.OFFLOADING, cache=True) == "keep_cached"
    assert residency_move(Release(1), Residency.OFFLOADING, cache=False) == "release"
    assert residency_move(Prefetch(1), Residency.CACHED, cache=True) == "reuse_cached"
    assert residency_move(Prefetch(1), Residency.ON_HOST, cache=True) == "prefetch"


@pytest.mark.parametrize("cache", [False, True])
def test_a_swap_plan_validates_with_and_without_the_cache(cache):
    plan = make_plan(chain(), MemoryConfig.parse("reuse,swap=all"))
    assert plan.swapping.blocks
    replace(plan, swapping=replace(plan.swapping, cache=cache)).validate()


def test_a_tensor_offloaded_and_freed_on_the_host_is_a_legal_plan():
    """The table lets a swapped-out tensor be freed where it is (the runtime returns its host
    buffer); a plan doing so validates."""
    plan, t, i, others = _conv_freed()
    offloaded = _with_after(plan, i, [*others, Offload(t), Release(t)])
    freed_on_host = replace(offloaded, end=(*offloaded.end, Free(t)))
    freed_on_host.validate()
    with pytest.raises(AssertionError, match="offloaded and never brought back"):
        offloaded.validate()


def test_an_illegal_move_names_the_state_and_the_legal_moves():
    plan, t, i, others = _conv_freed()
    bad = _with_after(plan, i, [*others, Offload(t), Await(t)])
    with pytest.raises(AssertionError, match=f"step {i} after: tensor {t} is offloading: cannot "
                       r"await_prefetch it \(allowed: free, keep_cached, release\)"):
        bad.validate()


def test_a_freed_tensor_is_not_allocated_again():
    plan, t, i, _ = _conv_freed()
    again = _with_after(plan, i, [*plan.steps[i].after, Alloc(t), Free(t)])
    with pytest.raises(AssertionError, match=f"tensor {t} allocated twice \\(freed before"):
        again.validate()

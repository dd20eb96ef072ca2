"""Issue 45: below the least peak of the frontier, ``auto`` tries the greedy walk before it
refuses (resnet50 224 b32 v100 at 1.10x the lower bound: no frontier plan fits, the walk's
does at 205.6 ms). Here the frontier's search is made to refuse, so that what happens then
is seen on a small network: the walk's plan when it fits, the first refusal when it does not.
"""

from __future__ import annotations

import pytest

import minidl
from minidl.compile import option_search
from minidl.memory.planners.auto import BelowFloor, BudgetTooSmall
from minidl.zoo.models import get_model

SHAPE = (3, 16, 16)


def _dry(spec: str) -> dict:
    return minidl.dry_run(get_model("resnet8", input_shape=SHAPE), 8, spec, input_shape=SHAPE,
                          target="v100")


@pytest.fixture
def refuse(monkeypatch):
    """Call it to make the frontier's search refuse every budget from then on."""
    def start():
        def refusing(*args, **kwargs):
            raise BudgetTooSmall("no plan fits the budget: the smallest peak the auto planner "
                                 "reaches is 1 B (the frontier, refusing for the test)")
        monkeypatch.setattr(option_search, "plan_fitting", refusing)
    return start


def test_the_greedy_walk_plans_when_the_frontier_refuses(refuse):
    plain = _dry("reuse,inplace")["peak_reserved_bytes"]
    refuse()
    rep = _dry(f"auto,budget={plain}")
    assert rep["peak_reserved_bytes"] <= plain
    assert any("the greedy walk's does" in n for n in rep["notes"])
    assert rep["memory"] == f"auto,budget={plain}" or "greedy" not in rep["memory"]


def test_the_frontier_refusal_stands_when_the_walk_does_not_fit(refuse):
    with pytest.raises(BelowFloor) as under:
        _dry("auto,budget=1")
    floor = under.value.floor.bytes  # no plan goes under it; the walk does not reach it here
    refuse()
    with pytest.raises(BudgetTooSmall, match="refusing for the test"):
        _dry(f"auto,budget={floor}")


def test_no_last_resort_when_a_planner_was_asked_for(refuse):
    plain = _dry("reuse,inplace")["peak_reserved_bytes"]
    refuse()
    with pytest.raises(BudgetTooSmall, match="refusing for the test"):
        _dry(f"auto,budget={plain},planner=optimal")

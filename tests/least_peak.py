"""The least peak the auto planner reaches for a program, read from its refusals.

A budget under the peak floor of every plan is refused at once (:class:`BelowFloor`, naming
the floor, not the least peak reached: no search ran); a budget at the floor runs the search,
whose refusal names the least peak it reached. Imported as ``tests.least_peak``.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from minidl.memory.planners.auto import BelowFloor, BudgetTooSmall


def _reached(e: BudgetTooSmall) -> int:
    return int(re.search(r"reaches is ([\d,]+) B", str(e))[1].replace(",", ""))


def least_reached(plan_at: Callable[[int], object]) -> int:
    """The least peak reached by ``plan_at(budget)`` (an auto plan or dry run under that budget,
    raising :class:`BudgetTooSmall` where none fits)."""
    try:
        plan_at(1)
    except BelowFloor as e:
        floor = e.floor.bytes
    except BudgetTooSmall as e:
        return _reached(e)
    else:
        raise AssertionError("a budget of 1 B fitted")
    try:
        plan_at(floor)
    except BudgetTooSmall as e:
        return _reached(e)
    return floor  # (no plan goes under the floor: this one is at it)

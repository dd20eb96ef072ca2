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
    budget = 1
    while True:
        try:
            plan_at(budget)
        except BelowFloor as e:
            if e.floor.bytes <= budget:
                raise
            # (a budget the persistent state alone fills plans with the state on the host,
            # whose floor may lie below the one of the state on the device: the next budget
            # is then under that one's floor)
            budget = e.floor.bytes
        except BudgetTooSmall as e:
            return _reached(e)
        else:
            if budget == 1:
                raise AssertionError("a budget of 1 B fitted")
            return budget  # (no plan goes under the floor: this one is at it)

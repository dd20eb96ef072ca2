"""The one walk over a plan: the order in which its actions and its steps' compute run.

A plan runs as ``begin``, then per step ``before`` / the step's compute / ``after``, then
``end``. :func:`walk` yields that order once, as :class:`Visit` records, so every interpreter
of a plan — :meth:`.Plan.validate`, the static layout's block lifetimes, the cost model's
clock, the executor driving the memory runtime — visits it the same way. A plan is frozen, so
``tuple(walk(plan))`` may be computed once and replayed every iteration.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from enum import Enum
from typing import Any, NamedTuple, Protocol

__all__ = ["PlanActions", "StepActions", "Visit", "Where", "walk"]

# (plan.py builds on this module, so the plan's types are described here, not imported: an
# action is a :data:`.plan.Action`)


class StepActions(Protocol):
    """What the walk reads of one step's plan (:class:`.plan.StepPlan`)."""

    @property
    def before(self) -> tuple[Any, ...]: ...

    @property
    def after(self) -> tuple[Any, ...]: ...


class PlanActions(Protocol):
    """What the walk reads of a plan (:class:`.plan.Plan`)."""

    @property
    def begin(self) -> tuple[Any, ...]: ...

    @property
    def steps(self) -> Sequence[StepActions]: ...

    @property
    def end(self) -> tuple[Any, ...]: ...


class Where(Enum):
    """A position in a plan's run: its actions run at all but ``COMPUTE``."""

    BEGIN = "begin"
    BEFORE = "before"
    COMPUTE = "compute"
    AFTER = "after"
    END = "end"

    def label(self, step: int) -> str:
        """How messages name the position: ``begin``, ``step 3 before``, ``end``, ..."""
        if self in (Where.BEGIN, Where.END):
            return self.value
        return f"step {step} {self.value}"


class Visit(NamedTuple):
    """One position of the walk and the actions run there (none at ``COMPUTE``). ``step`` is
    the step's index: -1 at ``BEGIN``, the number of steps at ``END``."""

    where: Where
    step: int
    actions: tuple[Any, ...] = ()


def walk(plan: PlanActions) -> Iterator[Visit]:
    """Every position of ``plan`` in run order: begin, then per step (one per program step)
    before, compute and after, then end."""
    yield Visit(Where.BEGIN, -1, plan.begin)
    for i, sp in enumerate(plan.steps):
        yield Visit(Where.BEFORE, i, sp.before)
        yield Visit(Where.COMPUTE, i)
        yield Visit(Where.AFTER, i, sp.after)
    yield Visit(Where.END, len(plan.steps), plan.end)

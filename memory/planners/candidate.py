"""A plan on the auto planner's curve (:mod:`.frontier`) and its price: what made it, its
peak and its predicted iteration time under one cost model."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property

from ..cost.cost_model import walk_time
from ..ir.config import MemoryConfig
from ..ir.names import Phase
from ..ir.plan import Plan
from ..ir.program import Program
from ..passes.base_plan import plan_peak
from ..passes.static_plan import static_plan

__all__ = ["BASE", "CODEC_BYTES_PER_S", "Candidate", "priced", "pricer"]

#: The memory flags every candidate the frontier builds itself is planned with.
BASE = MemoryConfig.parse("reuse,inplace")


@dataclass
class Candidate:
    """One plan on the curve: what made it (``source``), the plan (offsets unplaced), its
    predicted iteration seconds and the seconds it adds to the oracle's."""

    source: str
    plan: Plan
    time_s: float
    extra_s: float
    _placed: Plan | None = field(default=None, repr=False)

    @cached_property
    def live_peak(self) -> int:
        """Persistent bytes plus the most bytes of the iteration live at once (a lower bound
        of :attr:`peak`: no placement does better)."""
        return self.plan.program.persistent_bytes() + plan_peak(self.plan)

    @property
    def placed(self) -> Plan:
        """The plan with static offsets (what runs)."""
        if self._placed is None:
            self._placed = static_plan(self.plan, base=self.plan.program.persistent_bytes())
        return self._placed

    @property
    def peak(self) -> int:
        """Bytes the run reaches: the persistent state plus the placed arena."""
        return self.plan.program.persistent_bytes() + self.placed.static.arena

    @cached_property
    def traffic(self) -> int:
        """Bytes the plan moves and recomputes per iteration: each swapped tensor (offloaded
        and brought back), and what every recomputation step writes."""
        prog = self.plan.program
        moved = sum(prog.tensors[t].nbytes for t in self.plan.swapping.blocks)
        redone = sum(prog.tensors[t].nbytes for st in prog.steps if st.phase == Phase.RECOMPUTE
                     for t in st.access.writes)
        return moved + redone


def priced(plan: Plan, price: Callable[[Plan], tuple[float, float]], source: str) -> Candidate:
    """``plan`` as a candidate made by ``source``, priced with ``price`` (:func:`pricer`)."""
    time_s, extra_s = price(plan)
    return Candidate(source, plan, time_s, extra_s)


#: Bytes per second an encode or decode step is assumed to stream when no target's roofline
#: prices it (memory-bound passes on this class of CPU).
CODEC_BYTES_PER_S = 1e10


def pricer(costs: Sequence[float], bandwidth: float,
           step_cost: Callable[[Program, int], float] | None = None
           ) -> Callable[[Plan], tuple[float, float]]:
    """``plan -> (iteration seconds, seconds over the oracle)``: the end of the cost model's
    walk of the plan (:func:`~.cost_model.walk_time`), and that over the base program's
    oracle (``sum(costs)``); a step costs ``step_cost(program, i)`` when given (a target's
    roofline, which prices encode / decode steps too), else its lowered step's cost
    (``costs[step.cost.origin]``), and a step a pass added (encode, decode) its bytes at
    :data:`CODEC_BYTES_PER_S`."""
    oracle = sum(costs)

    def added(prog: Program, i: int) -> float:
        st = prog.steps[i]
        touched = sum(prog.tensors[t].nbytes for t in set(st.access.reads) | set(st.access.writes))
        return touched / CODEC_BYTES_PER_S

    by_program: dict[int, tuple[Program, list[float]]] = {}  # (plans sharing a program)

    def price(plan: Plan) -> tuple[float, float]:
        prog = plan.program
        got = by_program.get(id(prog))
        if got is not None:
            c = got[1]
        elif step_cost is not None:
            c = [step_cost(prog, i) for i in range(len(prog.steps))]
        else:
            c = [costs[s.cost.origin] if 0 <= s.cost.origin < len(costs) else added(prog, s.index)
                 for s in prog.steps]
        by_program[id(prog)] = (prog, c)
        # the walk's end, every plan alike: an encoded program's own steps (its backward from
        # encodings, its codecs) at their costs, not the base program's oracle plus its extra
        end = walk_time(plan, c, bandwidth)
        return end, end - oracle

    return price

"""vDNN's rule without a budget: caps under which each convolution runs the fastest
configuration whose workspace does not raise the iteration's peak (:func:`peak_options`), the
peak as low as a share of the estimated step time allows (:func:`peak_level`). Off by default
(:data:`~.workspace_options.RULE_KINDS`); :mod:`.workspace_options` describes where it applies.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any, TypeVar

from ..ir.config import MemoryConfig
from ..ir.plan import Plan
from ..ir.program import Program
from ..ir.units import ALLOCATION_UNIT
from ..passes.base_plan import base_plan, plan_peak
from .workspace_caps import (
    Key,
    _key,
    _live_curve,
    as_options,
    capped_steps,
    lean_options,
    merged,
    workspaces,
)
from .workspace_times import ConvTimes, _extra

#: The spec whose least-workspace plan sets the convolutions' room without a budget
#: (:func:`peak_options`), whatever the spec planned: one set of caps for every spec.
CANONICAL = MemoryConfig.parse("reuse,inplace")

T = TypeVar("T")

#: The estimated step time vDNN's rule may add without a budget before the level rises above the
#: least-workspace plan's peak (a fraction of the iteration's estimated time; ``0.02``: the
#: lowest peak whose caps are estimated to add at most 2 %). Default: no limit, vDNN's rule as
#: it stands (the peak never rises for a workspace; the note says what that is estimated to
#: cost).
TIME_SHARE = float("inf")


def _blocks(plan: Plan) -> tuple[list[tuple[Key, int, int, bool]], int]:
    """Each workspace block of ``plan`` taking the option: (key, its size, the most bytes
    live while it is, whether it shares another block), and the plan's peak."""
    program = plan.program
    iv, live = _live_curve(plan)
    key_of = {program.steps[i].access.workspace: _key(program, i) for i in capped_steps(program)}
    out = [(key_of[tid], size, int(live[s:max(e, s + 1)].max()), tid in plan.aliases)
           for (tid, _), (s, e, size) in iv.items() if tid in key_of]
    return out, int(live.max(initial=0))


def measured(plan: Plan) -> Plan:
    """``plan`` (of :data:`CANONICAL`) as its program plans with the default allocation unit
    (:data:`~.units.ALLOCATION_UNIT`): what vDNN's rule measures the room below the peak on,
    so that the caps, and with them the configurations and the bits, do not depend on the
    unit of the pool the program runs on (a coarser unit rounds every block up: the peak of
    the plan it runs may then differ from the least-workspace plan's by that rounding).
    Blocks a network declares swapped are kept (the room is smaller, never larger)."""
    if plan.program.alignment == ALLOCATION_UNIT:
        return plan
    return base_plan(replace(plan.program, alignment=ALLOCATION_UNIT), CANONICAL)


def level_caps(blocks: list[tuple[Key, int, int, bool]], level: int,
               alignment: int) -> dict[Key, int]:
    """The cap of each key under which no point of the plan of ``blocks`` rises above
    ``level`` bytes (at least each block's own size there: a key's smallest room)."""
    caps: dict[Key, int] = {}
    for key, size, most, aliased in blocks:
        cap = 0 if aliased else max(0, size + level - most) // alignment * alignment
        caps[key] = min(caps.get(key, cap), cap)
    return caps


def peak_level(blocks: list[tuple[Key, int, int, bool]], peak: int, alignment: int,
               table: dict[Key, list[tuple[float, tuple]]], total: float,
               share: float = TIME_SHARE) -> tuple[int, float]:
    """The lowest level from ``peak`` (the least-workspace plan's) up at which the caps of
    :func:`level_caps` add at most ``share`` of ``total`` to the estimated time, and the
    share they add there. The added time never grows with the level (a larger cap never
    picks a slower configuration), so a bisection over bytes finds it."""

    def cost(level: int) -> float:
        caps = level_caps(blocks, level, alignment)
        return sum(_extra(table[k], c) for k, c in caps.items() if k in table) / max(total, 1e-30)

    lo_cost = cost(peak)
    if lo_cost <= share:
        return peak, lo_cost
    top = max((steps[0][-1] for k in table for _, steps in table[k]), default=0)
    hi = peak + top + alignment  # every cap at least every key's largest workspace
    while hi - peak > alignment:
        mid = (peak + hi) // 2 // alignment * alignment
        if mid <= peak:
            break
        if cost(mid) <= share:
            hi = mid
        else:
            peak = mid
    return hi, cost(hi)


def peak_options(program: Program, options: dict[int, dict[str, Any]],
                 plan_with: Callable[[dict[int, dict[str, Any]] | None, MemoryConfig],
                                     tuple[T, Plan]],
                 times: ConvTimes | None = None, share: float = TIME_SHARE,
                 ) -> tuple[dict[int, dict[str, Any]], tuple[T, Plan] | None, str]:
    """vDNN's rule without a budget: caps under which each convolution runs the fastest
    configuration whose workspace does not raise the iteration's peak, the peak as low as
    ``share`` of the estimated step time allows.

    The iteration is planned under :data:`CANONICAL` with every convolution at its least
    workspace. Workspaces live one step at a time, so each convolution may take all the room
    that plan leaves free below a level while it is live (:func:`level_caps`); the level is
    that plan's peak (vDNN's rule) or, where the configurations that fit there are estimated
    (``times``, :class:`ConvTimes`) to add more than ``share`` of the iteration's time, the
    lowest level where they do not (:func:`peak_level`). The iteration is planned again with
    those caps; if its peak rose above the level (it cannot while the plan's sharing does not
    depend on workspace sizes), the least workspaces are kept. Returns the caps (``{}``:
    ``program`` has no convolution workspace), the canonical ``(lowering, plan)`` under them
    and a few words on the level. A function of the program alone: the caps depend neither
    on the spec being planned, nor on the thread count, nor on the pool's allocation unit
    (the plans are measured with the default one, :func:`measured`)."""
    if not workspaces(program):
        return {}, None, ""
    lean_caps = lean_options(program)
    lean = plan_with(merged(options, lean_caps), CANONICAL)
    blocks, peak = _blocks(measured(lean[1]))
    table, total = (times.table(lean[1].program) if times is not None else ({}, 0.0))
    level, added = peak_level(blocks, peak, ALLOCATION_UNIT, table, total, share)
    caps = as_options(level_caps(blocks, level, ALLOCATION_UNIT))
    roomy = plan_with(merged(options, caps), CANONICAL)
    if plan_peak(measured(roomy[1])) > level:
        return lean_caps, lean, "every convolution at its least workspace"
    words = ("the least-workspace peak" if level == peak else
             f"{level - peak:,} B above the least-workspace peak, where the configurations "
             f"that fit are estimated to add at most {100 * share:g} % to the step")
    return caps, roomy, f"{words}; estimated {100 * added:.1f} % slower" if table else words

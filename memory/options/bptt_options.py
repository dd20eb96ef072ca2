"""The BPTT schedule of fused recurrent steps as a per-op option of the plan (Gruslys et al.
2016; Chen et al.'s √n as a special case).

A step whose capabilities include the ``"bptt"`` option (a fused LSTM/GRU stack, which loops
over time inside) runs the schedule the plan hands it: everything kept (``None``), every
⌈√U⌉-th state of its U time units (``sqrt``), or Gruslys's dynamic programme with at most N
stored states (``dp:N``, ``dp:sqrt``). The memory spec names the policy (``bptt=N``; any
``recompute=`` policy); ``auto`` with a budget tries the candidates, most states first. The
schedules are plain data from :mod:`.bptt`; lowering sizes the step's stash and workspace
for the option, the executor hands it to the layer in ``ctx.options``.
"""

from __future__ import annotations

import math
from typing import Any

from ..ir.config import MemoryConfig, RecomputePolicy
from ..ir.names import Phase
from ..ir.program import Program
from ..passes import bptt

OPTION = "bptt"


def bptt_policy(memory: str | MemoryConfig | None) -> str | None:
    """The policy a memory spec asks for: None (keep all), ``"sqrt"``, or ``"dp:<slots>"`` /
    ``"dp:sqrt"`` (Gruslys's dynamic programme)."""
    cfg = MemoryConfig.parse(memory)
    if cfg.bptt:
        return f"dp:{cfg.bptt}"
    rec = cfg.recompute
    if rec == RecomputePolicy.SQRT:
        return "sqrt"
    if rec:
        return "dp:sqrt"
    return None


def time_schedule(policy: str | None, units: int) -> bptt.BPTTSchedule | None:
    """The schedule of ``policy`` over ``units`` time units; None keeps everything (also when
    there is a single unit)."""
    if policy is None or units < 2:
        return None
    if policy == "sqrt":
        return bptt.sqrt_schedule(units)
    slots = policy.split(":", 1)[1]
    n = math.ceil(math.sqrt(units)) if slots == "sqrt" else int(slots)
    return bptt.schedule_for_budget(units, n)


def candidate_policies(units: int) -> list[str | None]:
    """Policies to try under a budget, most states kept (fastest) first: keep all, then
    Gruslys's schedule with U-1, U/2, U/4, ..., 1 states."""
    slots, out = units - 1, [None]
    while slots >= 1:
        out.append(f"dp:{slots}")
        slots = slots // 2 if slots > 1 else 0
    return out


def _units(program: Program) -> dict[int, int]:
    """Node -> time units of every forward step taking the option."""
    return {st.node: st.op.facts.time_units for st in program.steps
            if st.phase == Phase.FORWARD and OPTION in st.op.caps.options}


def policies(program: Program, config: MemoryConfig) -> list[str | None]:
    """The policies to plan ``program`` with, in order of preference (one unless ``auto``
    with a budget and no explicit policy); ``[None]`` when no step takes the option."""
    units = _units(program)
    if not units:
        return [None]
    if not program.training:
        return ["dp:1"]  # no backward: keep one state over time
    policy = bptt_policy(config)
    if policy is None and config.auto and config.budget is not None:
        return candidate_policies(max(units.values()))
    return [policy]


def options_for(program: Program, policy: str | None) -> dict[int, dict[str, Any]]:
    """Per node, the option of every step taking it, under ``policy`` (empty: nothing to set)."""
    if policy is None:
        return {}
    return {node: {OPTION: time_schedule(policy, u)} for node, u in _units(program).items()}

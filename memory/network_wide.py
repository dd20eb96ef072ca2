"""The ``none`` baseline: network-wide allocation, as the papers measure against.

Every feature map, stash and gradient map is allocated when first written and lives until the
end of the iteration. Only a step's own scratch (its workspace, and a fan-out partial gradient
that is added into its target within the same step) is freed right after that step.
"""

from __future__ import annotations

from .plan import Action, Plan, StepPlan
from .program import Program

#: Roles freed right after the step that uses them, in every policy.
SCRATCH_ROLES = ("workspace", "grad_partial")


def first_touch(program: Program) -> dict[int, int]:
    """Step index where each non-persistent, non-fed tensor is first read or written."""
    first: dict[int, int] = {}
    for st in program.steps:
        ids = list(st.reads) + list(st.writes) + ([st.workspace] if st.workspace >= 0 else [])
        for t in ids:
            if t not in first and not program.tensors[t].persistent and t not in program.inputs:
                first[t] = st.index
    return first


def network_wide_plan(program: Program) -> Plan:
    """Allocate at first touch; free scratch after its step and everything else at the end."""
    steps = [StepPlan() for _ in program.steps]
    begin = [Action("alloc", t) for t in program.inputs]
    end: list[Action] = []
    for t, i in sorted(first_touch(program).items(), key=lambda kv: (kv[1], kv[0])):
        steps[i].before.append(Action("alloc", t))
        if program.tensors[t].role in SCRATCH_ROLES:
            steps[i].after.append(Action("free", t))
        else:
            end.append(Action("free", t))
    end.extend(Action("free", t) for t in program.inputs)
    return Plan(program=program, steps=steps, begin=begin, end=end, spec="none")

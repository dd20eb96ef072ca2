"""Liveness: for every tensor of a program, where it is defined and where it is last used.

This is the analysis of Chen et al.'s memory sharing, Layrub's layer-wise reuse and
SuperNeurons' liveness lists. It also builds the plan that frees each tensor (or group of
tensors sharing one block, see ``aliases``) right after its last use.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .names import Phase
from .plan import Action, Alloc, Free, Plan, StepPlan
from .program import Program


@dataclass(frozen=True)
class Lifetime:
    """``first`` and ``last`` are step indices (-1 for fed tensors, allocated before step 0).
    ``backward_use`` is true when a backward step reads the tensor."""

    tensor: int
    first: int
    last: int
    backward_use: bool


def lifetimes(program: Program) -> dict[int, Lifetime]:
    """Lifetimes of every non-persistent tensor the program touches (computed once per
    program: programs are never changed once made, a pass makes a new one)."""
    cached = program.__dict__.get("_lifetimes")
    if cached is None:
        cached = program.__dict__["_lifetimes"] = _lifetimes(program)
    return cached


def _lifetimes(program: Program) -> dict[int, Lifetime]:
    first: dict[int, int] = {t: -1 for t in program.inputs}
    last: dict[int, int] = {t: -1 for t in program.inputs}
    bwd: set[int] = set()
    persistent = {spec.id for spec in program.tensors if spec.persistent}
    for st in program.steps:
        i = st.index
        ids = [t for t in st.access.reads if t not in persistent]
        if st.phase == Phase.BACKWARD:
            bwd.update(ids)
        ids += [t for t in st.access.writes if t not in persistent]
        if st.access.workspace >= 0 and st.access.workspace not in persistent:
            ids.append(st.access.workspace)
        for t in ids:
            if t not in first:
                first[t] = i
            last[t] = i
    return {t: Lifetime(t, first[t], last[t], t in bwd) for t in first}


def root_of(aliases: dict[int, int], t: int) -> int:
    while t in aliases:
        t = aliases[t]
    return t


def liveness_plan(program: Program, aliases: dict[int, int] | None = None,
                  keep: set[int] | None = None) -> Plan:
    """Allocate each block at its group's first use and free it after the group's last use.

    ``aliases`` maps a tensor to the tensor whose memory it shares (in-place outputs and
    gradients): the group lives from its first member's definition to its last member's use.
    Tensors in ``keep`` live until the end of the iteration (as in the ``none`` baseline).
    """
    aliases = dict(aliases or {})
    keep = keep or set()
    life = lifetimes(program)
    span: dict[int, list[int]] = {}
    for t, lt in life.items():
        r = root_of(aliases, t)
        last = len(program.steps) if (t in keep or r in keep) else lt.last
        if r in span:
            span[r][0] = min(span[r][0], lt.first)
            span[r][1] = max(span[r][1], last)
        else:
            span[r] = [lt.first, last]
    before: list[list[Action]] = [[] for _ in program.steps]
    after: list[list[Action]] = [[] for _ in program.steps]
    begin: list[Action] = []
    end: list[Action] = []
    for r, (first, last) in sorted(span.items(), key=lambda kv: (kv[1][0], kv[0])):
        (begin if first < 0 else before[first]).append(Alloc(r))
        (end if last >= len(program.steps) or last < 0 else after[last]).append(Free(r))
    # aliased tensors get views at their own first use and drop them after their last use
    for t in sorted(aliases):
        lt = life.get(t)
        if lt is None:
            continue
        before[lt.first].append(Alloc(t))
        after[lt.last].insert(0, Free(t))
    steps = [StepPlan(b, a) for b, a in zip(before, after)]
    return Plan(program=program, steps=steps, begin=begin, end=end, aliases=aliases)


def liveness_peak(program: Program, aliases: dict[int, int] | None = None,
                  keep: set[int] | None = None) -> int:
    """The most bytes of blocks live at once under :func:`liveness_plan` with the same
    arguments (``plan_peak`` of that plan), without making the plan: each block lives from
    its group's first use to its last (blocks of fed tensors from the start, those kept or
    never used after being fed to the end)."""
    aliases = aliases or {}
    keep = keep or set()
    life = lifetimes(program)
    n = len(program.steps)
    span: dict[int, list[int]] = {}
    for t, lt in life.items():
        r = t
        while r in aliases:
            r = aliases[r]
        last = n if (t in keep or r in keep) else lt.last
        got = span.get(r)
        if got is None:
            span[r] = [lt.first, last]
        else:
            if lt.first < got[0]:
                got[0] = lt.first
            if last > got[1]:
                got[1] = last
    if not span:
        return 0
    diff = np.zeros(n + 3, np.int64)
    sizes = program.block_sizes
    for r, (first, last) in span.items():
        if last < 0 or last >= n:
            last = n
        size = sizes[r]
        diff[first + 1] += size
        diff[last + 2] -= size
    return int(np.cumsum(diff).max())

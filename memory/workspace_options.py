"""Workspace-aware convolution algorithms as a per-op option of the plan: vDNN's
memory-optimal versus performance-optimal algorithms, and moDNN's layer-wise sub-batches.

A step whose capabilities include the ``"conv_ws"`` option (a convolution) takes a cap in
bytes on its workspace (one for both steps, or a ``(forward, backward)`` pair, ``None``
meaning no cap). The layer then runs the fastest algorithm and chunking whose workspace
fits it: im2col instead of Winograd, fewer images per product (a sub-batch of the batch at a
time, while its input and output stay whole-batch tensors), bands of output rows, one
gradient part, fewer threads' rows. Without the option (or ``None``) it runs the fastest
configuration whatever its workspace; cap 0 asks for the least workspace.

Under a budget the engine plans with no caps first. If no plan fits, it lowers again with
every convolution capped at 32 MiB, then 1 MiB, then at its least workspace (:data:`LEVELS`,
:func:`lean_options`), and plans (tighter, if the plan's static offsets need more than its
peak). Once one fits, :func:`headroom_options` gives each convolution back the memory that
plan leaves free around its workspace, below that plan's peak (so the workspaces live at the
peak stay lean, the others get their fastest configuration back, and a smaller budget never
leads to a higher peak), and the engine plans once more (with half that room if the first
try does not fit), keeping the plan with more workspace if it is no worse (:func:`better`).
Without a budget nothing changes. Plain data, like the BPTT schedule of :mod:`.bptt_options`.

Results under given caps are bit-identical whatever the thread count, and so are the caps:
capped workspaces hold rows for a fixed number of threads, so the plans at the levels and
their headroom do not depend on it. Whether caps are needed at all does: uncapped workspaces
hold one row per thread.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any, TypeVar

import numpy as np

from .auto import BudgetTooSmall
from .base_plan import plan_peak
from .config import MemoryConfig
from .plan import Plan
from .program import Program
from .static_plan import block_intervals

OPTION = "conv_ws"
#: Notes this module writes start with this.
NOTE_PREFIX = "convolution workspaces"

T = TypeVar("T")
#: A workspace of one op: (node, True for its backward step / False for forward and
#: recompute steps).
Key = tuple[int, bool]


def capped_steps(program: Program) -> list[int]:
    """Indices of the steps taking the option that have a workspace."""
    return [st.index for st in program.steps
            if OPTION in st.caps.options and st.workspace >= 0]


def _key(program: Program, i: int) -> Key:
    st = program.steps[i]
    return st.node, st.phase == "backward"


def workspaces(program: Program) -> dict[Key, int]:
    """(node, backward) -> the largest workspace (bytes) of those steps taking the option."""
    out: dict[Key, int] = {}
    for i in capped_steps(program):
        k = _key(program, i)
        out[k] = max(out.get(k, 0), program.tensors[program.steps[i].workspace].nbytes)
    return out


#: Caps tried in turn on every convolution at once when no uncapped plan fits: a generous one
#: (im2col with its default blocking, or Winograd where its transformed filters are small:
#: the fastest workspaces, F(4x4)'s of wide layers, reach 150 MB, and without this level a
#: budget they did not fit dropped every layer to 1 MiB: VGG-11 b128 at 217 MB ran 4.75x
#: slower than `reuse`), a moderate one (measured on VGG layers: 1.0-1.9x the time of
#: forward + backward), then the least workspace (2.3-4x: one output row of one image per
#: product, one thread in backward).
LEVELS = (32 << 20, 1 << 20, 0)


def lean_options(program: Program, cap: int = 0) -> dict[int, dict[str, Any]]:
    """Every convolution capped at ``cap`` (default: its least workspace) on each of its
    steps that has a workspace (the form :func:`headroom_options` gives)."""
    ws = workspaces(program)
    return {node: {OPTION: tuple(cap if (node, b) in ws else None for b in (False, True))}
            for node in sorted({n for n, _ in ws})}


def _live_curve(plan: Plan) -> tuple[dict[tuple[int, int], tuple[int, int, int]], np.ndarray]:
    """The plan's blocks and the bytes live at every action position."""
    iv = block_intervals(plan)
    end = max((e for _, e, _ in iv.values()), default=0) + 1
    diff = np.zeros(end + 1, np.int64)
    for s, e, size in iv.values():
        diff[s] += size
        diff[e] -= size
    return iv, np.cumsum(diff)[:end]


def headroom_options(plan: Plan, budget: int, share: float = 1.0) -> dict[int, dict[str, Any]]:
    """Caps for the convolutions of ``plan`` (made with every one at its least workspace) that
    keep every point of it within ``budget`` (bytes, the persistent state included) and
    within its own peak: each workspace may grow by ``share`` of what the plan leaves free
    below them while it is live. (Below its own peak: so a smaller budget never leads to a
    higher peak, as along the auto planner's path.) The option is a ``(forward, backward)``
    pair of caps (``None`` for a step without a workspace). Every convolution gets one, even
    where it is above the uncapped workspace: the layer then runs its fastest configuration,
    and a cap, unlike the uncapped size, does not depend on the thread count (so neither do
    the results)."""
    program = plan.program
    iv, live = _live_curve(plan)
    free = min(budget - program.persistent_bytes(), int(live.max(initial=0)))
    key_of = {program.steps[i].workspace: _key(program, i) for i in capped_steps(program)}
    caps: dict[Key, int] = {}
    for (tid, _), (s, e, size) in iv.items():
        key = key_of.get(tid)
        if key is None:
            continue
        room = int(share * (free - int(live[s:max(e, s + 1)].max())))
        cap = max(0, size + room) // program.alignment * program.alignment
        caps[key] = min(caps.get(key, cap), cap)
    for tid, key in key_of.items():
        if tid in plan.aliases:  # shares another block: its size is not its own to grow
            caps[key] = 0
    return {node: {OPTION: (caps.get((node, False)), caps.get((node, True)))}
            for node in sorted({n for n, _ in caps})}


def arena_fits(plan: Plan, budget: int) -> bool:
    """Whether the plan's static arena (if it has one: static offsets can leave gaps that
    the sum of live bytes does not count) sits within ``budget`` above the persistent state."""
    return plan.static_arena < 0 or \
        plan.program.persistent_bytes() + plan.static_arena <= budget


def better(new: Plan, old: Plan, budget: int) -> bool:
    """Whether ``new`` (more workspace) is to be taken over ``old``: its static arena fits
    the budget too, its peak is no higher, and the auto planner estimates no more swap /
    recompute time for it."""
    if not arena_fits(new, budget) or plan_peak(new) > plan_peak(old):
        return False
    return new.auto is None or old.auto is None or new.auto.extra_time_s <= old.auto.extra_time_s


def describe(program: Program, fast: dict[Key, int]) -> str:
    """A note naming the convolutions whose workspace ``program`` makes smaller than in
    ``fast`` (the uncapped :func:`workspaces`), largest saving first."""
    now = workspaces(program)
    names = {program.steps[i].node: program.steps[i].layer for i in capped_steps(program)}
    nodes = {n for n, _ in fast}

    def most(sizes: dict[Key, int], n: int) -> int:
        return max(sizes.get((n, False), 0), sizes.get((n, True), 0))

    rows = sorted(((most(fast, n) - most(now, n), names.get(n, str(n)), most(fast, n),
                    most(now, n)) for n in nodes
                   if any(now.get((n, b), 0) < fast.get((n, b), 0) for b in (False, True))),
                  key=lambda r: (-r[0], r[1]))
    shown = ", ".join(f"{name} {old / 2**20:.2f}->{new / 2**20:.2f} MiB"
                      for _, name, old, new in rows[:8])
    more = f", and {len(rows) - 8} more" if len(rows) > 8 else ""
    return (f"{NOTE_PREFIX}: {len(rows)} of {len(nodes)} convolutions capped to fit the "
            f"budget (leaner algorithm and chunking; largest workspace before -> after): "
            f"{shown}{more}")


def merged(*options: dict[int, dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Per-node options of several modules in one mapping."""
    out: dict[int, dict[str, Any]] = {}
    for opts in options:
        for node, o in opts.items():
            out[node] = {**out.get(node, {}), **o}
    return out


def _fit(options: dict[int, dict[str, Any]] | None, config: MemoryConfig,
         plan_with: Callable[[dict[int, dict[str, Any]] | None, MemoryConfig], tuple[T, Plan]]
         ) -> tuple[T, Plan]:
    """``plan_with(options, config)``, planned tighter when the plan's static offsets need
    more than its peak, until they fit the budget (else :class:`BudgetTooSmall`)."""
    budget, tight = config.budget, config
    for _ in range(4):
        try:
            low, plan = plan_with(options, tight)
        except BudgetTooSmall as e:
            if tight is config:
                raise
            need = plan.program.persistent_bytes() + plan.static_arena
            raise BudgetTooSmall(f"the peak fits the budget of {budget:,} B, but its static "
                                 f"offsets need {need:,} B with the persistent state; planned "
                                 f"to {tight.budget:,} B instead: {e}") from None
        if arena_fits(plan, budget):
            break
        over = plan.program.persistent_bytes() + plan.static_arena - budget
        tight = MemoryConfig({**tight.flags, "budget": str(tight.budget - over)})
    else:
        raise BudgetTooSmall(f"the peak fits the budget of {budget:,} B, but not the "
                             f"{plan.static_arena:,} B its static offsets need")
    if tight is not config:
        plan = replace(plan, spec=config.spec).with_notes(
            f"auto planned to {tight.budget:,} B so that its static offsets fit {budget:,} B")
    return low, plan


def plan_fitting(program: Program, options: dict[int, dict[str, Any]], config: MemoryConfig,
                 plan_with: Callable[[dict[int, dict[str, Any]] | None, MemoryConfig],
                                     tuple[T, Plan]],
                 enabled: bool = True) -> tuple[T, Plan]:
    """The plan of ``program`` (lowered with the per-op ``options``), or when none fits the
    budget, of a re-lowering with convolutions' workspaces capped (module docstring).

    ``plan_with(options, config)`` lowers with those options (``None``: ``program`` as it
    is) and plans, returning ``(lowering, plan)`` or raising :class:`BudgetTooSmall`. Under a
    budget, every plan returned has its static offsets within it (:func:`_fit`), uncapped ones
    too."""
    try:
        if config.budget is None:
            return plan_with(None, config)
        return _fit(None, config, plan_with)
    except BudgetTooSmall as e:
        fast = workspaces(program)
        if not (enabled and config.budget is not None and fast):
            raise
        uncapped = e
    budget = config.budget
    for i, level in enumerate(LEVELS):
        try:
            low, plan = _fit(merged(options, lean_options(program, level)), config, plan_with)
            break
        except BudgetTooSmall as e:
            if i < len(LEVELS) - 1:
                continue
            if "static offsets" in str(e):  # the planner's peak fitted, its arena did not
                raise BudgetTooSmall(f"{uncapped}; with every convolution at its least "
                                     f"workspace {e}") from None
            raise BudgetTooSmall(f"{e} (every convolution at its least workspace)") from None
    tried = [lean_options(program, level)]
    for share in (1.0, 0.5):  # give back the room that plan leaves (or half of it)
        caps = headroom_options(plan, budget, share)
        if caps in tried:
            continue
        tried.append(caps)
        try:
            rlow, rplan = plan_with(merged(options, caps), config)
        except BudgetTooSmall:
            continue
        if better(rplan, plan, budget):
            low, plan = rlow, rplan
            break
    return low, plan.with_notes(describe(plan.program, fast))

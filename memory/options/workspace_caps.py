"""The ``"conv_ws"`` option per convolution: which steps take it, their workspaces, and the
caps the planning tries (:mod:`.workspace_options`): every convolution at one cap
(:func:`lean_options`), the room a plan leaves free around each workspace
(:func:`headroom_options`), caps lifted where they hold this machine's fastest configuration
(:func:`released`); and the note naming the convolutions a plan caps (:func:`describe`).

The option is a cap in bytes on a step's workspace, or a ``(forward, backward)`` pair of caps,
``None`` meaning no cap.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ...kernels.convolution.conv_geometry import MAX_THREADS, REFERENCE_ROWS
from ...kernels.parallel import num_threads
from ..ir.names import Phase
from ..ir.plan import Plan
from ..ir.program import Program
from ..passes.static_plan import block_intervals

#: The per-op option: a cap on a step's workspace (module docstring).
OPTION = "conv_ws"
#: Notes the workspace options write start with this.
NOTE_PREFIX = "convolution workspaces"

#: A workspace of one op: (node, True for its backward step / False for forward and
#: recompute steps).
Key = tuple[int, bool]


def capped_steps(program: Program) -> list[int]:
    """Indices of the steps taking the option that have a workspace."""
    return [st.index for st in program.steps
            if OPTION in st.op.caps.options and st.access.workspace >= 0]


def _key(program: Program, i: int) -> Key:
    st = program.steps[i]
    return st.node, st.phase == Phase.BACKWARD


def workspaces(program: Program) -> dict[Key, int]:
    """(node, backward) -> the largest workspace (bytes) of those steps taking the option."""
    out: dict[Key, int] = {}
    for i in capped_steps(program):
        k = _key(program, i)
        out[k] = max(out.get(k, 0), program.tensors[program.steps[i].access.workspace].nbytes)
    return out


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


def headroom_options(plan: Plan, budget: int | None,
                     share: float = 1.0) -> dict[int, dict[str, Any]]:
    """Caps for the convolutions of ``plan`` (made with every one at its least workspace) that
    keep every point of it within ``budget`` (bytes, the persistent state included; ``None``:
    no budget) and within its own peak: each workspace may grow by ``share`` of what the plan
    leaves free below them while it is live. (Below its own peak: so a smaller budget never
    leads to a higher peak, as along the auto planner's path.) The option is a ``(forward,
    backward)`` pair of caps (``None`` for a step without a workspace). Every convolution gets
    one, even where it is above the uncapped workspace: the layer then runs its fastest
    configuration, and a cap, unlike the uncapped size, does not depend on the thread count
    (so neither do the results; :func:`released` lifts the caps that hold this machine's
    uncapped workspace)."""
    program = plan.program
    iv, live = _live_curve(plan)
    free = int(live.max(initial=0))
    if budget is not None:
        free = min(budget - program.persistent_bytes(), free)
    key_of = {program.steps[i].access.workspace: _key(program, i) for i in capped_steps(program)}
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


#: Why the convolutions of a plan are capped: under a budget, or by vDNN's rule without one.
FIT_BUDGET = "capped to fit the budget"
AT_PEAK = "capped so as not to raise the iteration's peak (vDNN's rule)"


def capped_rows(program: Program, fast: dict[Key, int]) -> list[tuple[int, str, int, int]]:
    """(bytes saved, layer, fast bytes, bytes now) of the convolutions whose workspace
    ``program`` makes smaller than in ``fast`` (the uncapped :func:`workspaces`), largest
    saving first (the larger of each one's forward and backward workspaces)."""
    now = workspaces(program)
    names = {program.steps[i].node: program.steps[i].layer for i in capped_steps(program)}
    nodes = {n for n, _ in fast}

    def most(sizes: dict[Key, int], n: int) -> int:
        return max(sizes.get((n, False), 0), sizes.get((n, True), 0))

    return sorted(((most(fast, n) - most(now, n), names.get(n, str(n)), most(fast, n),
                    most(now, n)) for n in nodes
                   if any(now.get((n, b), 0) < fast.get((n, b), 0) for b in (False, True))),
                  key=lambda r: (-r[0], r[1]))


def describe(program: Program, fast: dict[Key, int], why: str = FIT_BUDGET) -> str:
    """A note naming the convolutions whose workspace ``program`` makes smaller than in
    ``fast`` (the uncapped :func:`workspaces`), largest saving first."""
    rows = capped_rows(program, fast)
    shown = ", ".join(f"{name} {old / 2**20:.2f}->{new / 2**20:.2f} MiB"
                      for _, name, old, new in rows[:8])
    more = f", and {len(rows) - 8} more" if len(rows) > 8 else ""
    return (f"{NOTE_PREFIX}: {len(rows)} of {len({n for n, _ in fast})} convolutions {why} "
            f"(leaner algorithm and chunking; largest workspace before -> after): "
            f"{shown}{more}")


def merged(*options: dict[int, dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Per-node options of several modules in one mapping."""
    out: dict[int, dict[str, Any]] = {}
    for opts in options:
        for node, o in opts.items():
            out[node] = {**out.get(node, {}), **o}
    return out


def as_options(caps: dict[Key, int]) -> dict[int, dict[str, Any]]:
    """Per-node options of per-key caps."""
    return {node: {OPTION: (caps.get((node, False)), caps.get((node, True)))}
            for node in sorted({n for n, _ in caps})}


def released(caps: dict[int, dict[str, Any]], fast: dict[Key, int],
             rows: int | None = None, room: dict[Key, int] | None = None
             ) -> dict[int, dict[str, Any]]:
    """``caps`` with no cap (``None``) wherever the cap holds the uncapped workspace ``fast``
    (one row per thread of ``rows``, default this machine's kernel threads), so does ``room``
    (the most each workspace may take without raising the peak of the plan the caps were
    made for; ``None``: no such limit), and ``rows`` is more than
    :data:`~minidl.kernels.convolution.conv_geometry.REFERENCE_ROWS`: the cap then holds the fastest
    configuration with those rows too, so the layer runs that configuration (the same bits)
    on all its threads instead of the rows a cap is sized for, and the peak stays that of the
    capped plan. (With no more rows than that, the cap runs the same rows as no cap would:
    the caps stay, the same as on a machine of fewer threads.) Nodes left with no cap at all
    are dropped."""
    rows = min(num_threads(), MAX_THREADS) if rows is None else rows
    if rows <= REFERENCE_ROWS:
        return caps

    def lifted(key: Key, cap: int | None) -> bool:
        return cap is None or (key in fast and cap >= fast[key]
                               and (room is None or fast[key] <= room.get(key, 0)))

    out: dict[int, dict[str, Any]] = {}
    for node, o in caps.items():
        pair = tuple(None if lifted((node, b), c) else c
                     for b, c in zip((False, True), o[OPTION]))
        if pair != (None, None):
            out[node] = {**o, OPTION: pair}
    return out

"""Parameters streamed from the host (ZeRO-Infinity's parameter offload; FSDP's prefetch and
its limit on gathers in flight): under ``offload=parameters`` the device keeps no trainable
parameter between steps.

The program is lowered as for ZeRO stage 3: every step that reads a trainable parameter reads
a tensor of its own (a recomputation reads its forward's). Those tensors' home is the host
(the float32 master, or in mixed precision its half copy rounded after each update), so this
pass rewrites their lifetimes with the actions swapping uses (:mod:`.swap`):

* each tensor starts the iteration on the host (``Swapping.host_homed``);
* its uses are cut into *visits* (runs of uses at most :data:`KEEP_GAP` steps apart); before a
  visit's first step compute ``Await`` s it, after its last step it is dropped: ``Offload`` +
  ``Release`` (its home holds its bytes: the offload copies nothing) or, after the last visit,
  ``Free``;
* each visit's ``Prefetch`` is issued ``distance`` fetch points ahead (a fetch point: a step
  that awaits a streamed tensor), not before its previous visit was dropped, and later when
  issuing it then would put more than ``inflight`` bytes of prefetched, not yet awaited
  parameters on the device (a prefetch larger than the cap alone is issued at its own step).

The cost model prices each prefetch on the target's host-to-device link like a swap's; the
planners saw these tensors allocated just before their step, so a prefetch ahead adds at most
``inflight`` bytes to the peak they planned.
"""

from __future__ import annotations

from dataclasses import replace

from ..ir.names import Role
from ..ir.plan import Action, Alloc, Await, Free, Offload, Plan, Prefetch, Release, StepPlan
from ..ir.program import Program

#: Uses of a streamed tensor at most this many steps apart stay one visit (no drop between).
KEEP_GAP = 2


def streamed_parameters(program: Program) -> list[int]:
    """The parameter tensors of the iteration (lowered per step, ZeRO stage 3's way), in id
    order."""
    return [t.id for t in program.tensors if t.role == Role.PARAM and not t.persistent]


def _visits(program: Program, tids: set[int]) -> dict[int, list[tuple[int, int]]]:
    """Tensor -> its visits ``(first step, last step)`` in step order."""
    uses: dict[int, list[int]] = {t: [] for t in tids}
    for i, st in enumerate(program.steps):
        for t in set(st.access.reads) & tids:
            uses[t].append(i)
    out: dict[int, list[tuple[int, int]]] = {}
    for t, steps in uses.items():
        runs: list[tuple[int, int]] = []
        for i in steps:
            if runs and i - runs[-1][1] <= KEEP_GAP:
                runs[-1] = (runs[-1][0], i)
            else:
                runs.append((i, i))
        out[t] = runs
    return out


def stream_parameters_plan(plan: Plan, distance: int = 2, inflight: int = 1 << 30) -> Plan:
    """``plan`` with every streamed parameter (:func:`streamed_parameters`) fetched from the
    host ahead of each visit and dropped after it (module docstring); a new plan."""
    program = plan.program
    tids = set(streamed_parameters(program))
    if not tids:
        return plan
    if distance < 1 or inflight < 0:
        raise ValueError(f"stream: prefetch distance must be >= 1 and inflight >= 0 bytes, got "
                         f"{distance} and {inflight}")
    aliased = tids & (set(plan.aliases) | set(plan.aliases.values()))
    if aliased:
        raise ValueError(f"stream: parameter {program.tensors[min(aliased)].name} shares a "
                         "block; it cannot be streamed alone")

    def kept(actions: tuple[Action, ...]) -> list[Action]:
        return [a for a in actions
                if not (isinstance(a, (Alloc, Free)) and a.tensor in tids)]

    n = len(plan.steps)
    before = [kept(sp.before) for sp in plan.steps]
    after = [kept(sp.after) for sp in plan.steps]
    begin, end = kept(plan.begin), kept(plan.end)
    visits = {t: v for t, v in _visits(program, tids).items() if v}
    sizes = program.block_sizes
    points = sorted({a for v in visits.values() for a, _ in v})
    rank = {s: k for k, s in enumerate(points)}
    ahead = [0] * (n + 1)  # bytes prefetched and not yet awaited, at each step's ``before``
    fetches: list[list[Action]] = [[] for _ in range(n)]
    awaits: list[list[Action]] = [[] for _ in range(n)]
    order = sorted(((a, b, t, k) for t, v in visits.items() for k, (a, b) in enumerate(v)))
    for a, b, t, k in order:
        earliest = points[max(0, rank[a] - distance)]
        if k > 0:
            earliest = max(earliest, visits[t][k - 1][1] + 1)
        size = sizes[t]
        start = a
        for s in range(earliest, a):
            if max(ahead[s:a]) + size <= inflight:
                start = s
                break
        for s in range(start, a):
            ahead[s] += size
        fetches[start].append(Prefetch(t))
        awaits[a].append(Await(t))
        if k == len(visits[t]) - 1:
            after[b].append(Free(t))
        else:
            after[b] += [Offload(t), Release(t)]
    steps = tuple(StepPlan((*fetches[i], *before[i], *awaits[i]), tuple(after[i]))
                  for i in range(n))
    streamed = sum(sizes[t] * len(v) for t, v in visits.items())
    note = (f"offload=parameters: {len(visits)} parameter tensors streamed from the host in "
            f"{sum(len(v) for v in visits.values())} fetches ({streamed / 2**20:.1f} MiB per "
            f"iteration), each {distance} fetch points ahead, at most "
            f"{inflight / 2**20:.0f} MiB fetched ahead")
    swapping = replace(plan.swapping, host_homed=tuple(sorted(visits)))
    return replace(plan, begin=tuple(begin), steps=steps, end=tuple(end), swapping=swapping,
                   notes=(*plan.notes, note))

"""Workspace-aware convolution algorithms as a per-op option of the plan: vDNN's
memory-optimal versus performance-optimal algorithms, and moDNN's layer-wise sub-batches.

A step whose capabilities include the ``"conv_ws"`` option (a convolution) takes a cap in
bytes on its workspace (one for both steps, or a ``(forward, backward)`` pair, ``None``
meaning no cap). The layer then runs the fastest algorithm and chunking whose workspace
fits it: im2col instead of Winograd, fewer images per product (a sub-batch of the batch at a
time, while its input and output stay whole-batch tensors), bands of output rows, one
gradient part, fewer threads' rows. Without the option (or ``None``) it runs the fastest
configuration whatever its workspace; cap 0 asks for the least workspace.

Without a budget, vDNN's rule (:func:`peak_options`): a convolution gets a faster,
larger-workspace configuration only where that does not raise the iteration's peak. The
engine plans the iteration with every convolution at its least workspace under
:data:`CANONICAL` (``reuse,inplace``: the iteration's peak once each tensor is freed after
its last use), gives each convolution all the room that plan leaves free below its peak while
its workspace is live (:func:`level_caps`: workspaces live one step at a time), checks that
the peak did not rise, and every memory spec then runs those caps. One set of caps for every
spec keeps the lossless specs bit-identical to each other (a cap can change the algorithm and
so the order of the sums); caps are computed for rows of a fixed number of threads, so they,
the configurations and the peak do not depend on the thread count either. Where a cap holds
the fastest configuration and this machine has more threads than those rows, the convolution
runs uncapped (all threads; the same configuration, so the same bits; :func:`released`). The
plan's note names the convolutions capped and the step time they are estimated to add
(:class:`ConvTimes`, the CPU kernels' configuration costs; never a clock). A caller may trade
some of the peak back for time (``share``, ``Engine.workspace_time_share``): the level then
rises to the lowest one where the caps are estimated to add at most that share of the step
(:func:`peak_level`); by default (:data:`TIME_SHARE`) it does not.

The rule is for kinds whose convolutions have leaner algorithms (:data:`RULE_KINDS`, the CPU
kernels: im2col for Winograd, fewer images per product, one gradient part). On the ``cuda``
kind a smaller workspace is the same im2col + GEMM cut into more tiles, each with its own
launches (im2col, a GEMM per group, the block copy; one output row of one image per tile at the
least): capping there multiplies a step's launches (resnet8 3x8x8 b4: 3 -> 96 per forward)
rather than choosing a memory-optimal algorithm, so without a budget device convolutions keep
their default tiles; under a budget, or vDNN's policy on a target's memory, they are capped
like the others.

Under a budget the engine plans with those caps first (none on the ``cuda`` kind). If no plan
fits, it lowers again with every convolution capped at 32 MiB, then 1 MiB, then at its least
workspace (:data:`LEVELS`, :func:`lean_options`), and plans (tighter, if the plan's static
offsets need more than its peak). Once one fits, :func:`headroom_options` gives each
convolution back the memory that plan leaves free around its workspace, below that plan's peak
(so the workspaces live at the peak stay lean, the others get their fastest configuration back,
and a smaller budget never leads to a higher peak), and the engine plans once more (with half
that room if the first try does not fit), keeping the plan with more workspace if it is no
worse (:func:`better`). Plain data, like the BPTT schedule of :mod:`.bptt_options`.

Results under given caps are bit-identical whatever the thread count, and so are the caps:
capped workspaces hold rows for a fixed number of threads, so the plans at the levels and
their headroom do not depend on it.
"""

from __future__ import annotations

import functools
from bisect import bisect_right
from collections.abc import Callable
from dataclasses import replace
from typing import Any, TypeVar

import numpy as np

from ...kernels import conv_geometry as CG
from ...kernels.conv_geometry import MAX_THREADS, REFERENCE_ROWS
from ...kernels.parallel import num_threads
from ..ir.config import MemoryConfig
from ..ir.plan import Plan
from ..ir.program import Program
from ..ir.units import ALLOCATION_UNIT
from ..passes.base_plan import base_plan, plan_peak
from ..passes.static_plan import block_intervals
from ..planners.auto import BudgetTooSmall

OPTION = "conv_ws"
#: Notes this module writes start with this.
NOTE_PREFIX = "convolution workspaces"
#: The spec whose least-workspace plan sets the convolutions' room without a budget
#: (:func:`peak_options`), whatever the spec planned: one set of caps for every spec.
CANONICAL = MemoryConfig.parse("reuse,inplace")

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


def released(caps: dict[int, dict[str, Any]], fast: dict[Key, int],
             rows: int | None = None, room: dict[Key, int] | None = None
             ) -> dict[int, dict[str, Any]]:
    """``caps`` with no cap (``None``) wherever the cap holds the uncapped workspace ``fast``
    (one row per thread of ``rows``, default this machine's kernel threads), so does ``room``
    (the most each workspace may take without raising the peak of the plan the caps were
    made for; ``None``: no such limit), and ``rows`` is more than
    :data:`~minidl.kernels.conv_geometry.REFERENCE_ROWS`: the cap then holds the fastest
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


#: The estimated step time vDNN's rule may add without a budget before the level rises above the
#: least-workspace plan's peak (a fraction of the iteration's estimated time; ``0.02``: the
#: lowest peak whose caps are estimated to add at most 2 %). Default: no limit, vDNN's rule as
#: it stands (the peak never rises for a workspace; the note says what that is estimated to
#: cost).
TIME_SHARE = float("inf")
#: Device kinds whose convolutions vDNN's rule caps without a budget (module docstring).
#: None by default for now: under the rule each spec's plan caps its own convolutions, so a
#: lossless spec can run other algorithms than ``none`` (not bit-identical: 7 strategy,
#: compression and ZeRO tests) and a recomputing plan can peak above ``reuse``'s; the rule
#: is on where a kind is listed here (tests/minidl/test_workspace_peak.py lists ``cpu``).
RULE_KINDS: tuple[str, ...] = ()


def _geometry(layer: Any) -> tuple | None:
    """(out channels, kernel, stride, padding, dilation, groups) of a convolution layer."""
    names = ("out_channels", "kernel_size", "stride", "padding", "dilation", "groups")
    if not all(hasattr(layer, n) for n in names):
        return None
    return tuple(getattr(layer, n) for n in names)


def _rel_time(x_shape: tuple[int, ...], geom: tuple, itemsize: int, backward: bool,
              cap: int | None) -> float:
    """:func:`~minidl.kernels.conv_geometry.conv_config`'s estimate of the time of the
    configuration it runs under ``cap`` (``None``: the default configuration), per
    multiply-add relative to a large im2col product on one thread, with the rows of
    :data:`~minidl.kernels.conv_geometry.REFERENCE_ROWS` threads that fit the cap."""
    cout, kernel, stride, padding, dilation, groups = geom
    cfg = CG.conv_config(x_shape, cout, kernel, stride, padding, dilation, groups, itemsize,
                         backward, cap)
    sz = CG._sized(x_shape, cout, kernel, stride, padding, dilation, groups, backward,
                   itemsize, cfg)
    rows = min(REFERENCE_ROWS, sz.units)
    if cap is not None and sz.per:
        rows = max(1, min(rows, (cap - sz.fixed) // sz.per))
    cols = CG._product_cols(x_shape, kernel, stride, padding, dilation, groups, itemsize, sz)
    return CG.WINOGRAD_TIME.get(cfg.algo, 1.0) * (1.0 + CG.SMALL_PRODUCT_COLS / max(1, cols)) \
        / max(1, rows)


@functools.lru_cache(maxsize=4096)
def _time_steps(x_shape: tuple[int, ...], geom: tuple, itemsize: int, backward: bool
                ) -> tuple[tuple[int, ...], tuple[float, ...], float]:
    """The estimated time of a convolution step as a step function of its cap: the caps at
    which :func:`~minidl.kernels.conv_geometry.conv_config`'s choice or its rows can change
    (each candidate configuration's workspace with 1 to REFERENCE_ROWS rows), the relative
    time (:func:`_rel_time`) from each of them on, and the default configuration's."""
    cout, kernel, stride, padding, dilation, groups = geom
    default = CG.conv_config(x_shape, cout, kernel, stride, padding, dilation, groups,
                             itemsize, backward)
    algos = [default.algo] + {"winograd4": ["winograd", "gemm"],
                              "winograd": ["gemm"]}.get(default.algo, [])
    needs = set()
    for algo in algos:
        for col in CG.LEAN_COL_BYTES:
            for parts in ((CG.GRAD_PARTS, 1) if backward else (CG.GRAD_PARTS,)):
                sz = CG._sized(x_shape, cout, kernel, stride, padding, dilation, groups,
                               backward, itemsize, CG.ConvConfig(algo, col, parts))
                needs.update(r * sz.per + sz.fixed
                             for r in range(1, min(REFERENCE_ROWS, sz.units) + 1))
    caps = tuple(sorted(needs))
    return (caps, tuple(_rel_time(x_shape, geom, itemsize, backward, c) for c in caps),
            _rel_time(x_shape, geom, itemsize, backward, None))


class ConvTimes:
    """Estimated times of a program's convolution steps under caps, in multiply-adds of a
    large im2col product (``flops / 2`` times :func:`_rel_time`), and the iteration's
    estimated time (every other step at its multiply-adds): what :func:`peak_options` weighs
    a lower peak against. Convolutions of the ``"cpu"`` kind only (their configurations are
    the CPU kernels'); the ``layers`` (node index -> layer) give their geometry."""

    def __init__(self, layers: dict[int, Any], kind: str = "cpu") -> None:
        self.geom = {n: g for n, layer in layers.items()
                     if (g := _geometry(layer)) is not None} if kind == "cpu" else {}

    def _steps(self, program: Program, i: int) -> tuple | None:
        st = program.steps[i]
        geom = self.geom.get(st.node)
        if geom is None or not st.in_shapes or OPTION not in st.caps.options:
            return None
        itemsize = np.dtype(program.tensors[st.inputs[0]].dtype).itemsize
        return _time_steps(tuple(st.in_shapes[0]), geom, itemsize, st.phase == "backward")

    def table(self, program: Program) -> tuple[dict[Key, list[tuple[float, tuple]]], float]:
        """Per (node, backward) of the steps taking the option: (weight, time steps) of each
        of its steps (weight: the step's multiply-adds); and the iteration's estimated time
        with every convolution at its default configuration."""
        out: dict[Key, list[tuple[float, tuple]]] = {}
        total = 0.0
        for st in program.steps:
            steps = self._steps(program, st.index) if st.workspace >= 0 else None
            if steps is None:
                total += st.flops / 2
                continue
            out.setdefault(_key(program, st.index), []).append((st.flops / 2, steps))
            total += st.flops / 2 * steps[2]
        return out, total


def _extra(steps: list[tuple[float, tuple]], cap: int) -> float:
    """Estimated time over the default configuration's of the steps of one key at ``cap``."""
    out = 0.0
    for weight, (caps, rels, default) in steps:
        i = bisect_right(caps, cap) - 1
        out += weight * (rels[max(i, 0)] - default)
    return out


def _blocks(plan: Plan) -> tuple[list[tuple[Key, int, int, bool]], int]:
    """Each workspace block of ``plan`` taking the option: (key, its size, the most bytes
    live while it is, whether it shares another block), and the plan's peak."""
    program = plan.program
    iv, live = _live_curve(plan)
    key_of = {program.steps[i].workspace: _key(program, i) for i in capped_steps(program)}
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


def as_options(caps: dict[Key, int]) -> dict[int, dict[str, Any]]:
    """Per-node options of per-key caps."""
    return {node: {OPTION: (caps.get((node, False)), caps.get((node, True)))}
            for node in sorted({n for n, _ in caps})}


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


def plan_fitting(program: Program, options: dict[int, dict[str, Any]], config: MemoryConfig,
                 plan_with: Callable[[dict[int, dict[str, Any]] | None, MemoryConfig],
                                     tuple[T, Plan]],
                 enabled: bool = True, times: ConvTimes | None = None,
                 share: float = TIME_SHARE, rule: bool = True) -> tuple[T, Plan]:
    """The plan of ``program`` (lowered with the per-op ``options``) with its convolutions'
    workspaces chosen by vDNN's rule (:func:`peak_options`, weighing the peak against the
    estimated ``times``), or when that does not fit the budget, capped further (module
    docstring). ``enabled=False``: every convolution at its fastest configuration, capped
    only when no plan fits the budget otherwise. ``rule=False`` (a kind not in
    :data:`RULE_KINDS`): without a budget the same, under one the caps as with the rule.

    ``plan_with(options, config)`` lowers with those options (``None``: ``program`` as it
    is) and plans, returning ``(lowering, plan)`` or raising :class:`BudgetTooSmall`. Under a
    budget, every plan returned has its static offsets within it (:func:`_fit`), uncapped ones
    too."""
    fast = workspaces(program)
    start: dict[int, dict[str, Any]] | None = None
    canonical: tuple[T, Plan] | None = None
    if enabled and rule and fast:
        caps, canonical, why = peak_options(program, options, plan_with, times, share)
        room = None
        if canonical is not None:
            blocks, peak = _blocks(measured(canonical[1]))
            room = level_caps(blocks, peak, ALLOCATION_UNIT)
        free = released(caps, fast, room=room)
        if free != caps:
            canonical = None  # planned with the caps, not with these
        start = merged(options, free) if free else None
    try:
        if config.budget is not None:
            low, plan = _fit(start, config, plan_with)
        elif canonical is not None and start is not None and config == CANONICAL:
            low, plan = canonical  # these very caps under this very spec: planned already
        else:
            low, plan = plan_with(start, config)
        if start is None or not capped_rows(plan.program, fast):
            return low, plan
        return low, plan.with_notes(f"{describe(plan.program, fast, AT_PEAK)}; the level: "
                                    f"{why}")
    except BudgetTooSmall as e:
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

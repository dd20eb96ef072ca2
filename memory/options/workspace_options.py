"""Workspace-aware convolution algorithms as a per-op option of the plan: vDNN's
memory-optimal versus performance-optimal algorithms, and moDNN's layer-wise sub-batches.

A step whose capabilities include the ``"conv_ws"`` option (a convolution) takes a cap in
bytes on its workspace (one for both steps, or a ``(forward, backward)`` pair, ``None``
meaning no cap). The layer then runs the fastest algorithm and chunking whose workspace
fits it: im2col instead of Winograd, fewer images per product (a sub-batch of the batch at a
time, while its input and output stay whole-batch tensors), bands of output rows, one
gradient part, fewer threads' rows. Without the option (or ``None``) it runs the fastest
configuration whatever its workspace; cap 0 asks for the least workspace.

Without a budget every convolution runs its fastest configuration by default: vDNN's rule is
off on every device kind (:data:`RULE_KINDS` is empty, see there why, so :func:`plan_fitting`
gets ``rule=False``). On a kind listed there (the rule's tests list ``cpu``), vDNN's rule
(:func:`peak_options`) applies: a convolution gets a faster, larger-workspace configuration
only where that does not raise the iteration's peak. The engine plans the iteration with every
convolution at its least workspace under :data:`CANONICAL` (``reuse,inplace``: the iteration's
peak once each tensor is freed after its last use), gives each convolution all the room that
plan leaves free below its peak while its workspace is live (:func:`level_caps`: workspaces
live one step at a time), checks that the peak did not rise, and every memory spec then runs
those caps. One set of caps for every spec keeps the lossless specs bit-identical to each other
(a cap can change the algorithm and so the order of the sums); caps are computed for rows of a
fixed number of threads, so they, the configurations and the peak do not depend on the thread
count either. Where a cap holds the fastest configuration and this machine has more threads
than those rows, the convolution runs uncapped (all threads; the same configuration, so the
same bits; :func:`released`). The plan's note names the convolutions capped and the step time
they are estimated to add (:class:`ConvTimes`, the CPU kernels' configuration costs; never a
clock). A caller may trade some of the peak back for time (``share``,
``Engine.workspace_time_share``): the level then rises to the lowest one where the caps are
estimated to add at most that share of the step (:func:`peak_level`); by default
(:data:`TIME_SHARE`) it does not.

The rule is meant for kinds whose convolutions have leaner algorithms (the CPU kernels:
im2col for Winograd, fewer images per product, one gradient part). On the ``cuda`` kind a
smaller workspace is the same im2col + GEMM cut into more tiles, each with its own launches
(im2col, a GEMM per group, the block copy; one output row of one image per tile at the least):
capping there multiplies a step's launches (resnet8 3x8x8 b4: 3 -> 96 per forward) rather than
choosing a memory-optimal algorithm, so without a budget device convolutions keep their
default tiles even where the rule is on for other kinds; under a budget, or vDNN's policy on a
target's memory, they are capped like the others.

Under a budget the engine plans first as without one (uncapped by default; with the rule's caps
on a kind in :data:`RULE_KINDS`). If no plan fits, it lowers again with every convolution
capped at 32 MiB, then 1 MiB, then at its least workspace (:data:`LEVELS`,
:func:`lean_options`), and plans (tighter, if the plan's static offsets need more than its
peak). Once one fits, :func:`headroom_options` gives each convolution back the memory that plan
leaves free around its workspace, below that plan's peak (so the workspaces live at the peak
stay lean, the others get their fastest configuration back, and a smaller budget never leads to
a higher peak), and the engine plans once more (with half that room if the first try does not
fit), keeping the plan with more workspace if it is no worse (:func:`better`). Plain data, like
the BPTT schedule of :mod:`.bptt_options`.

Results under given caps are bit-identical whatever the thread count, and so are the caps:
capped workspaces hold rows for a fixed number of threads, so the plans at the levels and
their headroom do not depend on it.

Here is the search that fits a budget (:func:`plan_fitting`); the option per convolution and
the caps tried are in :mod:`.workspace_caps`, the estimated step times under caps in
:mod:`.workspace_times`, vDNN's rule in :mod:`.workspace_peak` (their names are importable
from here).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from ..ir.config import MemoryConfig
from ..ir.plan import ChoiceKind, Plan
from ..ir.program import Program
from ..ir.units import ALLOCATION_UNIT
from ..passes.base_plan import plan_peak
from ..planners.auto import BudgetTooSmall
from .workspace_caps import (
    AT_PEAK,
    NOTE_PREFIX,  # noqa: F401  (tests read the notes' start through this module)
    Key,
    capped_rows,
    describe,
    headroom_options,
    lean_options,
    merged,
    released,
    workspaces,
)
from .workspace_peak import (
    CANONICAL,
    TIME_SHARE,
    T,
    _blocks,
    level_caps,
    measured,
    peak_options,
)
from .workspace_times import ConvTimes

#: Device kinds whose convolutions vDNN's rule caps without a budget (module docstring).
#: None by default for now: under the rule each spec's plan caps its own convolutions, so a
#: lossless spec can run other algorithms than ``none`` (not bit-identical: 7 strategy,
#: compression and ZeRO tests) and a recomputing plan can peak above ``reuse``'s; the rule
#: is on where a kind is listed here (tests/minidl/compile/test_workspace_peak.py lists ``cpu``).
RULE_KINDS: tuple[str, ...] = ()

#: Caps tried in turn on every convolution at once when no uncapped plan fits: a generous one
#: (im2col with its default blocking, or Winograd where its transformed filters are small:
#: the fastest workspaces, F(4x4)'s of wide layers, reach 150 MB, and without this level a
#: budget they did not fit dropped every layer to 1 MiB: VGG-11 b128 at 217 MB ran 4.75x
#: slower than `reuse`), a moderate one (measured on VGG layers: 1.0-1.9x the time of
#: forward + backward), then the least workspace (2.3-4x: one output row of one image per
#: product, one thread in backward).
LEVELS = (32 << 20, 1 << 20, 0)


def arena_fits(plan: Plan, budget: int) -> bool:
    """Whether the plan's static arena (if it has one: static offsets can leave gaps that
    the sum of live bytes does not count) sits within ``budget`` above the persistent state."""
    return plan.static.arena < 0 or \
        plan.program.persistent_bytes() + plan.static.arena <= budget


def better(new: Plan, old: Plan, budget: int) -> bool:
    """Whether ``new`` (more workspace) is to be taken over ``old``: its static arena fits
    the budget too, its peak is no higher, and the auto planner estimates no more swap /
    recompute time for it."""
    if not arena_fits(new, budget) or plan_peak(new) > plan_peak(old):
        return False
    new_auto, old_auto = new.provenance.auto, old.provenance.auto
    return new_auto is None or old_auto is None or new_auto.extra_time_s <= old_auto.extra_time_s


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
            need = plan.program.persistent_bytes() + plan.static.arena
            raise BudgetTooSmall(f"the peak fits the budget of {budget:,} B, but its static "
                                 f"offsets need {need:,} B with the persistent state; planned "
                                 f"to {tight.budget:,} B instead: {e}") from None
        if arena_fits(plan, budget):
            break
        over = plan.program.persistent_bytes() + plan.static.arena - budget
        tight = MemoryConfig({**tight.flags, "budget": str(tight.budget - over)})
    else:
        raise BudgetTooSmall(f"the peak fits the budget of {budget:,} B, but not the "
                             f"{plan.static.arena:,} B its static offsets need")
    if tight is not config:
        plan = replace(plan, spec=config.spec).with_notes(
            f"auto planned to {tight.budget:,} B so that its static offsets fit {budget:,} B")
    return low, plan


#: ``plan_with(options, config)``: lowers with those per-op options (``None``: the program as
#: it is) and plans, returning ``(lowering, plan)`` or raising :class:`BudgetTooSmall`.
PlanWith = Callable[[dict[int, dict[str, Any]] | None, MemoryConfig], tuple[Any, Plan]]


def _rule_start(program: Program, options: dict[int, dict[str, Any]], plan_with: PlanWith,
                fast: dict[Key, int], times: ConvTimes | None, share: float
                ) -> tuple[dict[int, dict[str, Any]] | None, tuple[Any, Plan] | None, str]:
    """vDNN's rule (:func:`peak_options`) as the options to plan with first, lifted where
    they hold this machine's fastest configuration (:func:`released`; ``None``: no cap left),
    the canonical ``(lowering, plan)`` if it was planned with exactly these caps (else
    ``None``), and the words on the level."""
    caps, canonical, why = peak_options(program, options, plan_with, times, share)
    room = None
    if canonical is not None:
        blocks, peak = _blocks(measured(canonical[1]))
        room = level_caps(blocks, peak, ALLOCATION_UNIT)
    free = released(caps, fast, room=room)
    if free != caps:
        canonical = None  # planned with the caps, not with these
    return (merged(options, free) if free else None), canonical, why


def _first_plan(start: dict[int, dict[str, Any]] | None, canonical: tuple[T, Plan] | None,
                config: MemoryConfig, plan_with: PlanWith) -> tuple[T, Plan]:
    """The plan with the options ``start`` (``None``: uncapped): within the budget if there is
    one (:func:`_fit`), else the ``canonical`` plan where it was planned with these very caps
    under this very spec, else planned now."""
    if config.budget is not None:
        return _fit(start, config, plan_with)
    if canonical is not None and start is not None and config == CANONICAL:
        return canonical  # these very caps under this very spec: planned already
    return plan_with(start, config)


def _lean_plan(program: Program, options: dict[int, dict[str, Any]], config: MemoryConfig,
               plan_with: PlanWith, uncapped: BudgetTooSmall) -> tuple[Any, Plan, int]:
    """The first of the :data:`LEVELS` with every convolution capped there whose plan fits
    the budget: ``(lowering, plan, level)``; :class:`BudgetTooSmall` if not even the least
    workspaces fit (naming ``uncapped``, the uncapped failure, where the peak fitted and the
    static offsets did not)."""
    *generous, least = LEVELS
    for level in generous:
        try:
            low, plan = _fit(merged(options, lean_options(program, level)), config, plan_with)
            return low, plan, level
        except BudgetTooSmall:
            continue
    try:
        low, plan = _fit(merged(options, lean_options(program, least)), config, plan_with)
    except BudgetTooSmall as e:
        if "static offsets" in str(e):  # the planner's peak fitted, its arena did not
            raise BudgetTooSmall(f"{uncapped}; with every convolution at its least "
                                 f"workspace {e}") from None
        raise BudgetTooSmall(f"{e} (every convolution at its least workspace)") from None
    return low, plan, least


def _with_headroom(program: Program, options: dict[int, dict[str, Any]],
                   config: MemoryConfig, plan_with: PlanWith, lean: tuple[T, Plan],
                   level: int) -> tuple[T, Plan]:
    """``lean`` (every convolution capped at ``level``) or, where it is :func:`better`, the
    plan with each convolution given back the room ``lean`` leaves free around its workspace
    (:func:`headroom_options`), or else half that room."""
    plan = lean[1]
    tried = [lean_options(program, level)]
    for share in (1.0, 0.5):
        caps = headroom_options(plan, config.budget, share)
        if caps in tried:
            continue
        tried.append(caps)
        try:
            roomy = plan_with(merged(options, caps), config)
        except BudgetTooSmall:
            continue
        if better(roomy[1], plan, config.budget):
            return roomy
    return lean


def plan_fitting(program: Program, options: dict[int, dict[str, Any]], config: MemoryConfig,
                 plan_with: Callable[[dict[int, dict[str, Any]] | None, MemoryConfig],
                                     tuple[T, Plan]],
                 enabled: bool = True, times: ConvTimes | None = None,
                 share: float = TIME_SHARE, rule: bool = True) -> tuple[T, Plan]:
    """The plan of ``program`` (lowered with the per-op ``options``) with its convolutions'
    workspaces chosen by vDNN's rule (:func:`peak_options`, weighing the peak against the
    estimated ``times``), or when that does not fit the budget, capped further (module
    docstring). ``enabled=False``: every convolution at its fastest configuration, never
    capped (a budget it does not fit raises). ``rule=False`` (a kind not in
    :data:`RULE_KINDS`): the first plan uncapped; under a budget it does not fit, capped
    further as with the rule.

    ``plan_with(options, config)`` lowers with those options (``None``: ``program`` as it
    is) and plans, returning ``(lowering, plan)`` or raising :class:`BudgetTooSmall`. Under a
    budget, every plan returned has its static offsets within it (:func:`_fit`), uncapped ones
    too."""
    fast = workspaces(program)
    start, canonical, why = None, None, ""
    if enabled and rule and fast:
        start, canonical, why = _rule_start(program, options, plan_with, fast, times, share)
    try:
        low, plan = _first_plan(start, canonical, config, plan_with)
    except BudgetTooSmall as e:
        if not (enabled and config.budget is not None and fast):
            raise
        uncapped = e
    else:
        if start is None or not capped_rows(plan.program, fast):
            return low, plan
        return low, plan.with_choice(ChoiceKind.CONV_WORKSPACE,
                                     f"{describe(plan.program, fast, AT_PEAK)}; the level: "
                                     f"{why}")
    low, plan, level = _lean_plan(program, options, config, plan_with, uncapped)
    low, plan = _with_headroom(program, options, config, plan_with, (low, plan), level)
    return low, plan.with_choice(ChoiceKind.CONV_WORKSPACE, describe(plan.program, fast))

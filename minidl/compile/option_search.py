"""The plan of one lowered program: the options searched before and around planning.

Per-op options first (fused RNNs' BPTT schedules, attention's memory forms: the spec's, or
under an auto budget the candidates, most kept first: :func:`search_options`), then
convolutions' workspaces by vDNN's rule, capped further when no plan fits the budget
(:func:`plan_fitting`), and for a swapping spec planned for a target, vDNN's own schedule
when the timed one does not fit the target's memory (:func:`vdnn_fitting`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any, Protocol

from ..memory.cost.cost_model import step_costs, step_time
from ..memory.cost.targets import DeviceProfile
from ..memory.ir.config import MemoryConfig, SwapPolicy
from ..memory.ir.plan import ChoiceKind, Plan
from ..memory.options import attention_options, bptt_options, workspace_options
from ..memory.passes.base_plan import plan_peak
from ..memory.planners.auto import BelowFloor, BudgetTooSmall
from ..memory.planners.floor import peak_floor
from ..memory.planners.planner import make_plan
from .lowering import Lowered

#: Lowers the program for a set of per-op options (``None``: the defaults).
LowerWith = Callable[[dict | None], Lowered]


class PlanningEngine(Protocol):
    """What the option search needs of an :class:`~minidl.compile.engine.Engine`."""

    target: DeviceProfile | None
    device_kind: str
    cap_workspaces: bool
    workspace_time_share: float
    scratch: Any


def search_options(engine: PlanningEngine, first: Lowered, lowered_with: LowerWith,
                   config: MemoryConfig) -> tuple[Lowered, Plan]:
    """The first per-op option choice (BPTT schedule x attention form) whose plan fits,
    ``first`` being the program lowered with the defaults; the last choice's
    :class:`BudgetTooSmall` when none does. A choice among several is said in the notes.

    A budget under the peak floor of every plan (:func:`~minidl.memory.planners.floor.
    peak_floor`: the persistent state plus what the largest step holds whole, whatever the
    options) raises :class:`BelowFloor` at once, before any search."""
    if config.budget is not None and first.program.training:
        floor = peak_floor(first.program)
        if config.budget < floor.bytes:
            raise BelowFloor(floor, config.budget)
    policies = bptt_options.policies(first.program, config)
    forms = attention_options.policies(first.program, config)
    choices = [(policy, form) for policy in policies for form in forms]
    for i, (policy, form) in enumerate(choices):
        options = workspace_options.merged(
            bptt_options.options_for(first.program, policy),
            attention_options.options_for(first.program, form))
        lowered = lowered_with(options) if options else first
        try:
            lowered, plan = plan_fitting(engine, lowered, options, lowered_with, config)
        except BudgetTooSmall:
            if i < len(choices) - 1:
                continue
            greedy = greedy_fitting(engine, lowered, options, lowered_with, config)
            if greedy is None:
                raise
            lowered, plan = greedy
        break
    if len(policies) > 1:
        plan = plan.with_choice(
            ChoiceKind.BPTT, f"recurrent layers' BPTT schedule {policy or 'keep all'} chosen "
            f"to fit the budget ({len(policies)} candidates, most states first)")
    if len(forms) > 1:
        plan = plan.with_choice(ChoiceKind.ATTENTION, attention_options.describe(
            lowered.program, form, forms.index(form) + 1))
    return lowered, plan


def greedy_fitting(engine: PlanningEngine, lowered: Lowered, options: dict,
                   lowered_with: LowerWith, config: MemoryConfig
                   ) -> tuple[Lowered, Plan] | None:
    """The last resort of ``auto`` under a budget below the least peak of its frontier: the
    greedy walk (swap or recompute, one feature map at a time, what frees the most bytes per
    second of overhead: partial moves the frontier's candidates do not express), with every
    convolution at its least workspace; ``None`` when it does not fit either (or the spec
    asked for another planner)."""
    if config.budget is None or not config.has("auto") or config.get("planner") is not None \
            or not lowered.program.training:
        return None
    lean = workspace_options.lean_options(lowered.program) if engine.cap_workspaces else {}
    low = lowered_with(workspace_options.merged(options, lean)) if lean else lowered
    greedy = MemoryConfig({**config.flags, "planner": "greedy"})
    try:
        plan = make_plan(low.program, greedy, **target_costs(engine.target, low))
    except BudgetTooSmall:
        return None
    if not workspace_options.arena_fits(plan, config.budget):
        return None
    return low, replace(plan, spec=config.spec).with_notes(
        "auto: no plan of the frontier fits this budget (its least peak is above it); the "
        "greedy walk's does, every convolution at its least workspace", first=True)


def choice_notes(plan: Plan) -> list[str]:
    """The notes of ``plan`` saying choices made before planning (BPTT schedule, workspace
    caps, attention form: :attr:`Provenance.choices <minidl.memory.ir.plan.Provenance.choices>`
    of the plan): they stay with any later plan of the same program."""
    return [c.note for c in plan.provenance.choices]


def plan_fitting(engine: PlanningEngine, lowered: Lowered, options: dict,
                 lowered_with: LowerWith, config: MemoryConfig) -> tuple[Lowered, Plan]:
    """The plan of ``lowered`` with convolutions' workspaces chosen by vDNN's rule, capped
    further when no plan fits the budget
    (:func:`~minidl.memory.options.workspace_options.plan_fitting`; the convolutions'
    geometry for their estimated times is in their steps' facts). A swapping spec planned for a
    target (vDNN's policy) that does not fit the target's memory with its transfers timed
    by the cost model is planned again as vDNN schedules them, each prefetch a fixed
    number of steps ahead (compute waits for the copy), with memory-optimal workspaces
    where that is what fits (:func:`vdnn_fitting`)."""

    def plan_with(opts: dict | None, cfg: MemoryConfig) -> tuple[Lowered, Plan]:
        low = lowered if opts is None else lowered_with(opts)
        return low, make_plan(low.program, cfg, **target_costs(engine.target, low))

    times = workspace_options.ConvTimes(engine.device_kind)
    low, plan = workspace_options.plan_fitting(lowered.program, options, config, plan_with,
                                               engine.cap_workspaces, times,
                                               engine.workspace_time_share,
                                               vdnn_rule_applies(engine.device_kind))
    capacity = swap_capacity(engine.target, config)
    if capacity is None or reserved_bytes(engine, plan) <= capacity:
        return low, plan
    return vdnn_fitting(engine, lowered, options, lowered_with, config, times, capacity,
                        (low, plan))


def vdnn_rule_applies(device_kind: str) -> bool:
    """Whether vDNN's rule caps convolutions without a budget on ``device_kind`` (one of
    :data:`~minidl.memory.options.workspace_options.RULE_KINDS`)."""
    return device_kind in workspace_options.RULE_KINDS


def swap_capacity(target: DeviceProfile | None, config: MemoryConfig) -> int | None:
    """The target's memory, for a swapping spec without a search (``swap=conv|all``:
    vDNN's policy) planned for a target; else ``None``."""
    if target is None or config.swap not in (SwapPolicy.CONV, SwapPolicy.ALL) \
            or config.has("auto"):
        return None
    return target.capacity_bytes


def reserved_bytes(engine: PlanningEngine, plan: Plan) -> int:
    """The bytes a run of ``plan`` reserves (the persistent state, the engine's scratch block
    and the iteration's static arena), or without static offsets, allocates at its peak."""
    scratch = engine.scratch.size if engine.scratch is not None else 0
    arena = plan.static.arena if plan.static.arena >= 0 else plan_peak(plan)
    return plan.program.persistent_bytes() + scratch + arena


def vdnn_fitting(engine: PlanningEngine, lowered: Lowered, options: dict,
                 lowered_with: LowerWith, config: MemoryConfig, times: Any, capacity: int,
                 timed: tuple[Lowered, Plan]) -> tuple[Lowered, Plan]:
    """vDNN's policy within ``capacity``: prefetches a fixed number of steps ahead (no
    step times: :func:`~minidl.memory.passes.swap.swap_plan`'s lookahead), then convolutions'
    workspaces capped as under a budget of ``capacity``. ``timed`` (the plan that did not
    fit) when nothing does, with a note saying so."""
    need = reserved_bytes(engine, timed[1])
    target = engine.target  # (not None: swap_capacity gave the target's memory)

    def plan_with(opts: dict | None, cfg: MemoryConfig) -> tuple[Lowered, Plan]:
        low = lowered if opts is None else lowered_with(opts)
        costs = {k: v for k, v in target_costs(target, low).items() if k != "step_times"}
        fitting = cfg.budget is not None  # the spec within capacity (not the canonical)
        cfg = MemoryConfig({k: v for k, v in cfg.flags.items() if k != "budget"})
        plan = make_plan(low.program, cfg, **costs)
        if fitting and reserved_bytes(engine, plan) > capacity:
            raise BudgetTooSmall(f"{reserved_bytes(engine, plan):,} B")
        return low, plan

    fit = MemoryConfig({**config.flags, "budget": str(capacity)})
    where = f"{target.name}'s {capacity:,} B"
    try:
        low, plan = workspace_options.plan_fitting(
            lowered.program, options, fit, plan_with, engine.cap_workspaces, times,
            engine.workspace_time_share, vdnn_rule_applies(engine.device_kind))
    except BudgetTooSmall as e:
        return timed[0], timed[1].with_notes(
            f"vDNN's policy: does not fit {where}, with the transfers timed by the cost "
            f"model ({need:,} B) nor with each prefetch a fixed number of steps ahead and "
            f"the least workspaces ({str(e).split(' (')[0]})")
    return low, plan.with_notes(
        f"vDNN's policy: each prefetch a fixed number of steps ahead, compute waiting for "
        f"its copy, to fit {where} (the transfers timed by the cost model needed "
        f"{need:,} B)")


def target_costs(target: DeviceProfile | None, lowered: Lowered) -> dict[str, Any]:
    """Step times and link rate from the target's cost model (none without a target)."""
    if target is None:
        return {}
    return {"step_times": step_costs(lowered.program, target),
            "bandwidth": min(target.link_h2d_bytes_per_s, target.link_d2h_bytes_per_s),
            "cost_source": f"{target.name}'s cost model",
            "step_cost": lambda program, i: step_time(program, i, target)}

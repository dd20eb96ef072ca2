"""From a program and a memory spec to a plan: each flag's module contributes in turn."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from ..ir.config import MemoryConfig, OffloadPolicy
from ..ir.liveness import root_of
from ..ir.plan import Plan
from ..ir.program import Program
from ..passes.base_plan import base_plan, iteration_peak, sharing_of
from ..passes.block_choices import block_choices
from ..passes.compress import ASSUMED_DENSITY, compress_program
from ..passes.offload_state import offload_state_plan
from ..passes.recompute import dropping_program, policy_program
from ..passes.static_plan import static_plan
from ..passes.stream_parameters import stream_parameters_plan
from ..passes.swap import DEFAULT_BANDWIDTH, swap_plan
from .auto import auto_plan, step_costs
from .frontier import frontier_plan

__all__ = ["iteration_peak", "make_plan"]


def rewritten(program: Program, config: MemoryConfig,
              densities: dict[str, float] | None = None,
              cache: dict | None = None) -> Program:
    """The program ``config``'s rewrites make of ``program``: recomputation (a policy, or the
    blocks the network forces), then compression. ``cache`` (a dict the caller keeps) shares
    the rewrites between specs that differ elsewhere (the auto planner prices dozens)."""
    def cached(key: tuple, make: Callable[[], Program]) -> Program:
        if cache is None:
            return make()
        if key not in cache:
            cache[key] = (program, make())  # (the source kept alive: ids are not reused)
        return cache[key][1]

    source = program
    blocks = block_choices(program)
    if config.recompute is not None and program.training:
        program = cached((id(source), config.recompute, config.reuse,
                          config.inplace),
                         lambda: policy_program(source, config.recompute,
                                                peak_of=lambda p: iteration_peak(p, config)))
    elif blocks.dropped:
        program = cached((id(source), "blocks"),
                         lambda: dropping_program(source, set(blocks.dropped)))
    compressing = config.binarize or config.sparse or config.dpr is not None
    if compressing and program.training:
        recomputed = program
        program = cached((id(recomputed), config.binarize, config.sparse,
                          config.dpr, tuple(sorted((densities or {}).items()))),
                         lambda: compress_program(recomputed, config.binarize,
                                                  config.sparse,
                                                  config.dpr, densities))
    return program


def make_plan(program: Program, config: MemoryConfig,
              step_times: list[float] | None = None,
              densities: dict[str, float] | None = None,
              bandwidth: float | None = None,
              cost_source: str = "measured step times",
              rewrites: dict | None = None,
              step_cost: Callable[[Program, int], float] | None = None) -> Plan:
    """The plan for ``program`` under ``config`` (a pure function of both).

    ``recompute`` first rewrites the program (dropped feature maps are recomputed from
    checkpoints); ``none`` keeps every tensor to the end of the iteration; ``reuse`` frees each
    after its last use and shares gradient blocks within layers; ``inplace`` shares forward
    outputs with dead inputs; ``swap`` offloads feature maps to host and prefetches them back
    (``step_times`` measured in a first iteration drive ``swap=auto``); ``cache`` keeps
    released blocks while memory allows; ``static`` fixes every block's offset ahead of time.
    ``bandwidth`` (bytes/s of the host link; default :data:`~.swap.DEFAULT_BANDWIDTH`) and
    ``step_times`` may come from a target device's cost model (:mod:`.cost_model`) instead
    of a measurement (``cost_source`` names where they came from in the notes). ``rewrites``:
    a cache of program rewrites shared between calls (:func:`rewritten`). ``step_cost``
    (``(program, step) -> seconds``, a target's roofline) prices the steps of the plans the
    auto planner compares, those a pass adds included.
    """
    link: dict = {"cost_source": cost_source}
    if config.only:
        link["only"] = config.only
    if bandwidth is not None:
        link["bandwidth"] = bandwidth
    if config.auto and program.training and config.offload is not None:
        return _offloaded_within(program, config, lambda c: make_plan(
            program, c, step_times, densities, bandwidth, cost_source, rewrites, step_cost))
    if config.auto and program.training:
        if config.planner == "optimal":
            from .optimal import optimal_plan

            return replace(optimal_plan(program, config.budget, step_times, **link),
                           spec=config.spec)
        if config.only or config.planner == "greedy" or block_choices(program):
            # asked for, one kind of action only, or the network's own choices on blocks:
            # the greedy walk
            return replace(auto_plan(program, config.budget, step_times, **link),
                           spec=config.spec)
        return replace(_frontier_plan(program, config, step_times, bandwidth, cost_source,
                                      step_cost, densities), spec=config.spec)
    blocks = block_choices(program)
    program = rewritten(program, config, densities, rewrites)
    compressing = config.binarize or config.sparse or config.dpr is not None
    if rewrites is None:
        plan = base_plan(program, config)
    else:  # (specs that differ only in swapping share their liveness plan)
        key = ("base", id(program), *sharing_of(config))
        if key not in rewrites:
            rewrites[key] = (program, base_plan(program, config))
        plan = rewrites[key][1]
    if compressing and program.training:
        summary = program.rewrites.compression
        enc = {} if summary is None else summary.encoded
        dens = {} if summary is None else summary.sparse_densities
        measured = [n for n, d in dens.items() if d is not None]
        plan = plan.with_notes(
            f"compression: {len(enc)} stashes encoded ("
            + ", ".join(f"{c} {sum(1 for v in enc.values() if v == c)}"
                        for c in sorted(set(enc.values()))) + ")"
            + (f"; sparse sizes from measured densities ({len(measured)} tensors)"
               if measured else
               f"; sparse sizes assume {ASSUMED_DENSITY:.0%} non-zeros until measured"
               if dens else ""))
        plan = replace(plan, provenance=replace(plan.provenance,
                                                densities_measured=bool(measured) or not dens))
    if config.recompute is not None and program.training:
        m = program.rewrites.recompute
        plan = plan.with_notes(
            f"recompute={config.get('recompute')}: {m.checkpoints} checkpoints, "
            f"{m.dropped_layers} layers dropped, {m.recomputed_steps} forward steps "
            f"recomputed per iteration ({m.recomputed_flops:,} FLOPs)")
    if config.swap is not None or blocks.swapped:
        force = frozenset(root_of(plan.aliases, t) for t in blocks.swapped)
        swapped = swap_plan(plan, config.swap or "all", step_times=step_times,
                            only=None if config.swap is not None else set(force), force=force,
                            exclude=frozenset(root_of(plan.aliases, t) for t in blocks.kept),
                            **link)
        plan = replace(swapped, swapping=replace(swapped.swapping, cache=config.cache))
    if blocks:
        plan = plan.with_notes(blocks.describe())
    if config.offload is not None and program.training:
        plan = _offloaded_state(plan, config)
    if config.static:
        plan = static_plan(plan, base=program.persistent_bytes())
    return replace(plan, spec=config.spec)


def _offloaded_state(plan: Plan, config: MemoryConfig) -> Plan:
    """``plan`` with the gradients' copies to the host (not under ``zero=2``: data
    parallelism's buckets take them) and, under ``offload=parameters``, the parameters
    streamed in from there."""
    plan = offload_state_plan(plan, sharded=True) if config.zero >= 2 \
        else offload_state_plan(plan)
    if config.offload is OffloadPolicy.PARAMETERS:
        plan = stream_parameters_plan(plan, config.prefetch, config.inflight)
    return plan


def _without_offload(config: MemoryConfig) -> MemoryConfig:
    """``config`` without its ``offload`` flag (what the auto planners plan the iteration
    with)."""
    return MemoryConfig({k: v for k, v in config.flags.items()
                         if k not in ("offload", "prefetch", "inflight")})


#: Times ``auto`` plans again, for a budget lowered by the excess, when the gradients' copies
#: to the host raise a fitting plan's placed peak above the budget.
OFFLOAD_REFITS = 3


def _offloaded_within(program: Program, config: MemoryConfig,
                      plan_for: Callable[[MemoryConfig], Plan]) -> Plan:
    """The auto plan with the gradients' copies to the host (:func:`_offloaded`), its placed
    peak within the budget: the copies keep each gradient a step (and a bucket) longer than
    the planner's candidates did, so where that raises the peak over the budget the
    iteration is planned again for a budget lowered by the excess, at most
    :data:`OFFLOAD_REFITS` times; :class:`~.auto.BudgetTooSmall` if it still does not fit."""
    from .auto import BudgetTooSmall

    inner = _without_offload(config)
    budget = config.budget
    peak = 0
    for _ in range(OFFLOAD_REFITS + 1):
        try:
            plan = _offloaded(plan_for(inner), config)
        except BudgetTooSmall:
            if inner.budget == budget:
                raise  # (the user's own budget: the planner's words)
            break
        if budget is None or plan.static.arena < 0:
            return plan
        peak = program.persistent_bytes() + plan.static.arena
        if peak <= budget:
            return plan
        lower = inner.budget - (peak - budget)
        if lower <= program.persistent_bytes():
            break
        inner = MemoryConfig({**inner.flags, "budget": str(lower)})
    raise BudgetTooSmall(
        f"no plan fits the budget of {budget:,} B with offload=optimizer: the gradients' "
        f"copies to the host keep them on the device longer than any plan of the iteration "
        f"leaves room for (the least placed peak with them: {peak:,} B)")


def _offloaded(plan: Plan, config: MemoryConfig) -> Plan:
    """An auto plan with the gradients' copies to the host added
    (:func:`~..passes.offload_state.offload_state_plan`) and, when it was placed, placed
    again (the gradients now leave a step later than the planner's candidates freed them)."""
    offloaded = _offloaded_state(plan, config)
    if plan.static.arena >= 0:
        offloaded = static_plan(offloaded.with_notes(), base=plan.program.persistent_bytes())
        kept = tuple(n for n in offloaded.notes if not n.startswith("static:"))
        offloaded = replace(offloaded, notes=(*kept, offloaded.notes[-1]))
    return replace(offloaded, spec=config.spec)


def _frontier_plan(program: Program, config: MemoryConfig, step_times: list[float] | None,
                   bandwidth: float | None, cost_source: str,
                   step_cost: Callable[[Program, int], float] | None,
                   densities: dict[str, float] | None) -> Plan:
    """``auto``: the fastest plan of the program's frontier that fits the budget
    (:mod:`.frontier`), every fixed spec priced among the candidates."""
    costs = step_costs(program, step_times)
    measured = step_times is not None and len(step_times) == len(program.steps)
    link = DEFAULT_BANDWIDTH if bandwidth is None else bandwidth
    rewrites: dict = {}

    plans: dict[tuple, Plan] = {}

    def make(prog: Program, cfg: MemoryConfig) -> Plan:
        # specs whose rewrites leave the same program (an encoding with nothing to encode)
        # and that swap alike make the same plan: made once
        key = (id(rewritten(prog, cfg, densities, rewrites)), cfg.swap,
               *sharing_of(cfg))
        if key not in plans:
            plans[key] = make_plan(prog, cfg, step_times=costs, densities=densities,
                                   bandwidth=link, cost_source=cost_source, rewrites=rewrites)
        return plans[key]

    how = cost_source if measured else "cost model: FLOPs at an assumed rate"
    return frontier_plan(program, config.budget, costs, link, make, step_cost, how, measured)

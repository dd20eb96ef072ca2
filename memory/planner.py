"""From a program and a memory spec to a plan: each flag's module contributes in turn."""

from __future__ import annotations

from dataclasses import replace

from .auto import auto_plan
from .base_plan import base_plan, iteration_peak
from .block_choices import block_choices
from .compress import ASSUMED_DENSITY, compress_program
from .config import MemoryConfig
from .liveness import root_of
from .plan import Plan
from .program import Program
from .recompute import dropping_program, policy_program
from .static_plan import static_plan
from .swap import swap_plan

__all__ = ["iteration_peak", "make_plan"]


def make_plan(program: Program, config: MemoryConfig,
              step_times: list[float] | None = None,
              densities: dict[str, float] | None = None,
              bandwidth: float | None = None,
              cost_source: str = "measured step times") -> Plan:
    """The plan for ``program`` under ``config`` (a pure function of both).

    ``recompute`` first rewrites the program (dropped feature maps are recomputed from
    checkpoints); ``none`` keeps every tensor to the end of the iteration; ``reuse`` frees each
    after its last use and shares gradient blocks within layers; ``inplace`` shares forward
    outputs with dead inputs; ``swap`` offloads feature maps to host and prefetches them back
    (``step_times`` measured in a first iteration drive ``swap=auto``); ``cache`` keeps
    released blocks while memory allows; ``static`` fixes every block's offset ahead of time.
    ``bandwidth`` (bytes/s of the host link; default :data:`~.swap.DEFAULT_BANDWIDTH`) and
    ``step_times`` may come from a target device's cost model (:mod:`.cost_model`) instead
    of a measurement (``cost_source`` names where they came from in the notes).
    """
    link: dict = {"cost_source": cost_source}
    if config.get("only"):
        link["only"] = config.get("only")
    if bandwidth is not None:
        link["bandwidth"] = bandwidth
    if config.has("auto") and program.training:
        if config.get("planner") == "optimal":
            from .optimal import optimal_plan

            return replace(optimal_plan(program, config.budget, step_times, **link),
                           spec=config.spec)
        return replace(auto_plan(program, config.budget, step_times, **link), spec=config.spec)
    blocks = block_choices(program)
    if config.has("recompute") and program.training:
        program = policy_program(program, config.get("recompute"),
                                 peak_of=lambda p: iteration_peak(p, config))
    elif blocks.dropped:
        program = dropping_program(program, set(blocks.dropped))
    compressing = config.has("binarize") or config.has("sparse") or config.has("dpr")
    if compressing and program.training:
        program = compress_program(program, config.has("binarize"), config.has("sparse"),
                                   config.get("dpr") or None, densities)
    plan = base_plan(program, config)
    if compressing and program.training:
        enc = program.meta.get("encoded", {})
        dens = program.meta.get("sparse_densities", {})
        measured = [n for n, d in dens.items() if d is not None]
        plan = plan.with_notes(
            f"compression: {len(enc)} stashes encoded ("
            + ", ".join(f"{c} {sum(1 for v in enc.values() if v == c)}"
                        for c in sorted(set(enc.values()))) + ")"
            + (f"; sparse sizes from measured densities ({len(measured)} tensors)"
               if measured else
               f"; sparse sizes assume {ASSUMED_DENSITY:.0%} non-zeros until measured"
               if dens else ""))
        plan = replace(plan, densities_measured=bool(measured) or not dens)
    if config.has("recompute") and program.training:
        m = program.meta
        plan = plan.with_notes(
            f"recompute={config.get('recompute')}: {m['checkpoints']} checkpoints, "
            f"{m['dropped_layers']} layers dropped, {m['recomputed_steps']} forward steps "
            f"recomputed per iteration ({m['recomputed_flops']:,} FLOPs)")
    if config.has("swap") or blocks.swapped:
        force = frozenset(root_of(plan.aliases, t) for t in blocks.swapped)
        plan = replace(swap_plan(plan, config.get("swap") or "all", step_times=step_times,
                                 only=None if config.has("swap") else set(force), force=force,
                                 exclude=frozenset(root_of(plan.aliases, t)
                                                   for t in blocks.kept), **link),
                       cache=config.has("cache"))
    if blocks:
        plan = plan.with_notes(blocks.describe())
    if config.has("static"):
        plan = static_plan(plan, base=program.persistent_bytes())
    return replace(plan, spec=config.spec)

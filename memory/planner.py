"""From a program and a memory spec to a plan: each flag's module contributes in turn."""

from __future__ import annotations

from .auto import auto_plan
from .base_plan import base_plan, iteration_peak
from .config import MemoryConfig
from .plan import Plan
from .program import Program
from .recompute import policy_program
from .static_plan import static_plan
from .swap import swap_plan

__all__ = ["iteration_peak", "make_plan"]


def make_plan(program: Program, config: MemoryConfig,
              step_times: list[float] | None = None) -> Plan:
    """The plan for ``program`` under ``config`` (a pure function of both).

    ``recompute`` first rewrites the program (dropped feature maps are recomputed from
    checkpoints); ``none`` keeps every tensor to the end of the iteration; ``reuse`` frees each
    after its last use and shares gradient blocks within layers; ``inplace`` shares forward
    outputs with dead inputs; ``swap`` offloads feature maps to host and prefetches them back
    (``step_times`` measured in a first iteration drive ``swap=auto``); ``cache`` keeps
    released blocks while memory allows; ``static`` fixes every block's offset ahead of time.
    """
    if config.has("auto") and program.training:
        plan = auto_plan(program, config.budget, step_times)
        plan.spec = config.spec
        return plan
    if config.has("recompute") and program.training:
        program = policy_program(program, config.get("recompute"),
                                 peak_of=lambda p: iteration_peak(p, config))
    plan = base_plan(program, config)
    if config.has("recompute") and program.training:
        m = program.meta
        plan.notes.append(
            f"recompute={config.get('recompute')}: {m['checkpoints']} checkpoints, "
            f"{m['dropped_layers']} layers dropped, {m['recomputed_steps']} forward steps "
            f"recomputed per iteration ({m['recomputed_flops']:,} FLOPs)")
    if config.has("swap"):
        plan = swap_plan(plan, config.get("swap"), step_times=step_times)
        plan.cache = config.has("cache")
    if config.has("static"):
        plan = static_plan(plan, base=program.persistent_bytes())
    plan.spec = config.spec
    return plan

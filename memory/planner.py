"""From a program and a memory spec to a plan: each flag's module contributes in turn."""

from __future__ import annotations

from .config import MemoryConfig
from .inplace import inplace_aliases
from .liveness import liveness_plan
from .network_wide import network_wide_keep
from .plan import Plan
from .program import Program
from .reuse import intra_layer_aliases
from .static_plan import static_plan
from .swap import swap_plan


def make_plan(program: Program, config: MemoryConfig,
              step_times: list[float] | None = None) -> Plan:
    """The plan for ``program`` under ``config`` (a pure function of both).

    ``none`` keeps every tensor to the end of the iteration; ``reuse`` frees each after its
    last use and shares gradient blocks within layers; ``inplace`` shares forward outputs with
    dead inputs; ``static`` fixes every block's offset ahead of time; ``swap`` offloads
    feature maps to host and prefetches them back (``step_times`` measured in a first
    iteration drive ``swap=auto``); ``cache`` keeps released blocks while memory allows.
    """
    keep = None if config.has("reuse") else network_wide_keep(program)
    aliases: dict[int, int] = {}
    if config.has("inplace"):
        aliases = inplace_aliases(program, aliases)
    if config.has("reuse"):
        aliases = intra_layer_aliases(program, aliases)
    plan = liveness_plan(program, aliases, keep)
    if config.has("swap"):
        plan = swap_plan(plan, config.get("swap"), step_times=step_times)
        plan.cache = config.has("cache")
    if config.has("static"):
        plan = static_plan(plan, base=program.persistent_bytes())
    plan.spec = config.spec
    return plan

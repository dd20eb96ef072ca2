"""From a program and a memory spec to a plan: each flag's module contributes in turn."""

from __future__ import annotations

from .config import MemoryConfig
from .inplace import inplace_aliases
from .liveness import liveness_plan
from .network_wide import network_wide_keep
from .plan import Plan
from .program import Program
from .recompute import policy_program
from .reuse import intra_layer_aliases
from .static_plan import block_intervals, max_live_bytes, static_plan
from .swap import swap_plan


def _liveness_plan(program: Program, config: MemoryConfig) -> Plan:
    frees_early = config.has("reuse") or config.has("recompute")
    keep = None if frees_early else network_wide_keep(program)
    aliases: dict[int, int] = {}
    if config.has("inplace"):
        aliases = inplace_aliases(program, aliases)
    if frees_early:
        aliases = intra_layer_aliases(program, aliases)
    return liveness_plan(program, aliases, keep)


def iteration_peak(program: Program, config: MemoryConfig) -> int:
    """Peak bytes of one iteration's non-persistent tensors under ``config``'s sharing."""
    return max_live_bytes(block_intervals(_liveness_plan(program, config)))


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
    if config.has("recompute") and program.training:
        program = policy_program(program, config.get("recompute"),
                                 peak_of=lambda p: iteration_peak(p, config))
    plan = _liveness_plan(program, config)
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

"""The liveness plan every spec starts from: which tensors are kept to the end (``none``) or
freed after their last use (``reuse``, ``recompute``), and which blocks are shared (``inplace``
forward, ``reuse``'s intra-layer backward)."""

from __future__ import annotations

from ..ir.config import MemoryConfig
from ..ir.liveness import liveness_peak, liveness_plan
from ..ir.plan import Plan
from ..ir.program import Program
from .inplace import inplace_aliases
from .network_wide import network_wide_keep
from .reuse import intra_layer_aliases
from .static_plan import block_intervals, max_live_bytes


def sharing_of(config: MemoryConfig) -> tuple[bool, bool]:
    """What of ``config`` the liveness plan depends on: (blocks freed after their last use,
    forward outputs in place)."""
    frees_early = config.reuse or config.recompute is not None or config.auto
    return frees_early, config.inplace or config.auto


def _sharing(program: Program, config: MemoryConfig) -> tuple[dict[int, int], set | None]:
    """The aliases and the tensors kept to the end under ``config``."""
    frees_early, in_place = sharing_of(config)
    keep = None if frees_early else network_wide_keep(program)
    aliases: dict[int, int] = {}
    if in_place:
        aliases = inplace_aliases(program, aliases)
    if frees_early:
        aliases = intra_layer_aliases(program, aliases)
    return aliases, keep


def base_plan(program: Program, config: MemoryConfig) -> Plan:
    """Liveness plan of ``program`` with the sharing ``config`` asks for."""
    return liveness_plan(program, *_sharing(program, config))


def plan_peak(plan: Plan) -> int:
    """Peak bytes of the plan's non-persistent blocks (what the pool allocates on top of the
    persistent state, fragmentation aside)."""
    return max_live_bytes(block_intervals(plan))


def iteration_peak(program: Program, config: MemoryConfig) -> int:
    """Peak bytes of one iteration's non-persistent tensors under ``config``'s sharing."""
    return liveness_peak(program, *_sharing(program, config))

"""``auto``'s choice of where the persistent state lives: on the device, or (ZeRO-Offload,
:mod:`~..passes.offload_state`) the optimizer state and gradients on the host.

Keep / swap / recompute choices act on the iteration's tensors only; the persistent state is
below every plan. When it alone fills the budget, no plan of the iteration fits, and
offloading it is the only way to fit (the cheapest too: every other choice fails); the
planner then plans the program with ``offload=optimizer`` and says so. Below that, the
state stays on the device (plans without the flag are unchanged).
"""

from __future__ import annotations

from ..ir.config import MemoryConfig
from ..ir.units import format_size


def with_offload_if_needed(config: MemoryConfig, persistent_bytes: int,
                           offloadable_bytes: int) -> tuple[MemoryConfig, str]:
    """``config`` and ``""``, or, under ``auto`` with a budget that the device's persistent
    state (``persistent_bytes``, of which ``offloadable_bytes`` are gradients and optimizer
    state) fills, ``config`` with ``offload=optimizer`` and the note saying why."""
    budget = config.budget
    if not config.auto or budget is None or config.offload is not None or config.zero \
            or persistent_bytes < budget or offloadable_bytes <= 0:
        return config, ""
    offloaded = MemoryConfig.parse(f"{config.spec},offload=optimizer")
    return offloaded, (
        f"auto: the persistent state ({format_size(persistent_bytes)}: parameters, gradients "
        f"and optimizer state) fills the budget {format_size(budget)} before any activation; "
        f"planned with offload=optimizer ({format_size(offloadable_bytes)} of gradients and "
        "optimizer state on the host, the update there)")

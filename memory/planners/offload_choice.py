"""``auto``'s choice of where the persistent state lives: on the device, or (ZeRO-Offload,
:mod:`~..passes.offload_state`) the optimizer state and gradients on the host.

Keep / swap / recompute choices act on the iteration's tensors only; the persistent state is
below every plan. When it alone fills the budget, no plan of the iteration fits, and
offloading it is the only way to fit (the cheapest too: every other choice fails); the
planner then plans the program with ``offload=optimizer`` and says so. Below that, the
state stays on the device (plans without the flag are unchanged).

When the parameters the device would still keep under ``offload=optimizer`` (their half
copies in mixed precision) take more than :data:`STREAM_SHARE` of the budget, the iteration
would have less than the rest, and ``auto`` streams the parameters too
(``offload=parameters``): on a 32 GB V100 that is what plans a 26 B GPT, and at 13 B it is
predicted as fast as keeping the half parameters (BENCHMARKS 26e: the prefetches overlap the
compute where the copy back after the update does not).
"""

from __future__ import annotations

from ..ir.config import MemoryConfig, OffloadPolicy
from ..ir.units import format_size

#: The share of the budget above which the parameters are streamed rather than kept.
STREAM_SHARE = 0.5


def with_offload_if_needed(config: MemoryConfig, persistent_bytes: int,
                           offloadable_bytes: int,
                           kept_parameter_bytes: int = 0) -> tuple[MemoryConfig, str]:
    """``config`` and ``""``, or, under ``auto`` with a budget that the device's persistent
    state (``persistent_bytes``, of which ``offloadable_bytes`` are gradients and optimizer
    state) fills, ``config`` with ``offload=optimizer`` — or ``offload=parameters`` when the
    parameters the device keeps under it (``kept_parameter_bytes``) take over
    :data:`STREAM_SHARE` of the budget — and the note saying why."""
    budget = config.budget
    if not config.auto or budget is None or config.offload is not None or config.zero \
            or persistent_bytes < budget or offloadable_bytes <= 0:
        return config, ""
    stream = kept_parameter_bytes > STREAM_SHARE * budget
    policy = OffloadPolicy.PARAMETERS if stream else OffloadPolicy.OPTIMIZER
    offloaded = MemoryConfig.parse(f"{config.spec},offload={policy}")
    note = (f"auto: the persistent state ({format_size(persistent_bytes)}: parameters, "
            f"gradients and optimizer state) fills the budget {format_size(budget)} before any "
            f"activation; planned with offload={policy} ({format_size(offloadable_bytes)} of "
            "gradients and optimizer state on the host, the update there")
    if stream:
        note += (f"; the parameters the device would keep ({format_size(kept_parameter_bytes)}"
                 f") take over {STREAM_SHARE:.0%} of the budget, so they are streamed in "
                 "ahead of each step")
    return offloaded, note + ")"

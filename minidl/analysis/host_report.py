"""What a dry run reports of host memory beside the device peak: the persistent state kept on
the host (``offload=optimizer``: master weights, gradients, optimizer state) and the swap
buffers' peak, and on a target the price of the host's part of the iteration
(:mod:`~minidl.memory.cost.host_update`)."""

from __future__ import annotations

from typing import Any

from ..memory.cost.host_update import host_update
from ..memory.cost.targets import DeviceProfile


def host_figures(engine: Any, profile: DeviceProfile | None, ranks: int = 1) -> dict[str, Any]:
    """``host_state_bytes`` (0 without offloaded state), ``host_bytes`` (that plus the swap
    buffers' peak: what the host needs for the run), by kind, and the host update's price;
    under ``zero=K`` those of rank 0 of ``ranks`` (its owned ranges of the state)."""
    state = engine.host_state
    if state is not None and engine.config.zero:
        state = state.for_rank(ranks, 0, engine.config.zero >= 2)
    held = 0 if state is None else state.nbytes
    out: dict[str, Any] = {"host_state_bytes": held,
                           "host_bytes": held + engine.host_pool.peak_bytes}
    if state is not None:
        out["host_state"] = state.by_kind()
        if profile is not None:
            out["host_update"] = host_update(state.values, len(state.slots), state.upload_bytes,
                                             profile).as_dict()
    return out


def host_budget_error(report: dict[str, Any], host_memory: int | None) -> str | None:
    """One line when the run needs more host memory than ``host_memory`` (else None)."""
    need = report.get("host_bytes", 0)
    if host_memory is None or need <= host_memory:
        return None
    return (f"the plan needs {need / 2**30:.2f} GiB of host memory ({need:,} B: offloaded "
            f"state {report.get('host_state_bytes', 0):,} B, swap buffers "
            f"{report.get('host_peak_bytes', 0):,} B) but --host-memory is "
            f"{host_memory / 2**30:.2f} GiB")

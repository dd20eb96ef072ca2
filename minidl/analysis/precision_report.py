"""What a dry run reports of its precision: bytes by dtype, and on a target the rate each step
was priced at (:mod:`~minidl.memory.ir.precision`, :func:`~minidl.memory.cost.cost_model.
step_rate`)."""

from __future__ import annotations

from typing import Any

from ..memory.cost.cost_model import rate_breakdown, step_rate
from ..memory.cost.targets import DeviceProfile
from ..memory.ir.precision import Precision, bytes_by_dtype

__all__ = ["precision_report"]


def precision_report(c: Any, info: Any, precision: Precision,
                     profile: DeviceProfile | None) -> dict[str, Any]:
    """The dry run's entries for ``precision`` (none for ``fp32``, whose report is as
    before): ``precision``; ``peak_bytes_by_dtype`` (the blocks live at the peak, by their
    tensors' dtype; workspaces are ``uint8``); ``tensor_bytes_by_dtype`` (every tensor of
    the iteration once, persistent ones included); with a target ``rates`` (per rate the cost
    model used: its FLOP/s, steps, FLOPs, seconds and bandwidth-bound steps) and
    ``step_rates`` (``[index, layer, phase, rate]`` of every step)."""
    if precision is Precision.FP32:
        return {}
    program = c.plan.program
    dtype_of: dict[str, str] = {}
    for t in program.tensors:
        dtype_of.setdefault(t.name, str(t.dtype))
    at_peak: dict[str, int] = {}
    for name, _category, nbytes in info.live:
        dt = dtype_of.get(name, "uint8")  # (cupy.scratch: the device library's bytes)
        at_peak[dt] = at_peak.get(dt, 0) + nbytes
    out: dict[str, Any] = {
        "precision": str(precision),
        "peak_bytes_by_dtype": dict(sorted(at_peak.items(), key=lambda kv: -kv[1])),
        "tensor_bytes_by_dtype": bytes_by_dtype(program.tensors),
    }
    if profile is not None:
        out["rates"] = rate_breakdown(program, profile)
        out["step_rates"] = [[i, st.layer, str(st.phase), step_rate(st, profile)[0]]
                             for i, st in enumerate(program.steps)]
    return out

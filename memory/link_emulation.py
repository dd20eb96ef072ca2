"""Link emulation: a CPU run whose host link is as slow, next to its compute, as a GPU's.

On this CPU a copy to host costs almost nothing next to compute; on a GPU the ratio is the
opposite (a V100 computes ~150x faster than two CPU cores while its PCIe link moves ~12 GB/s).
To make a real CPU run show the overlap and stalls a run on target ``P`` would, the CPU
device's copy engine is throttled (:class:`~.device.CopyEngine`'s ``bytes_per_s``) so that
copy time / compute time is ``P``'s:

* ``slowdown`` = the CPU's measured seconds of an iteration's forward and backward steps
  (the executor's ``step_times``) / ``P``'s roofline seconds of the same steps
  (:func:`~.cost_model.step_costs`) — how much slower this CPU computes than ``P``;
* emulated link = ``P``'s link rate / ``slowdown`` (the slower direction of ``P``'s link: the
  CPU device has one copy engine for both, as the CUDA device has one copy stream).

A copy of ``n`` bytes then takes ``slowdown`` times what it takes on ``P``, as every step
does, so the model's prediction for ``P`` scaled by ``slowdown`` is what the CPU run should
measure. The slowdown is measured at the first training iteration and refined at the next
:data:`CALIBRATION_ITERATIONS` - 1 (the lowest seen: the first iteration's compute carries
one-time costs — page faults on fresh arena memory, first calls), then fixed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .cost_model import step_costs
from .program import Program
from .targets import DeviceProfile

__all__ = ["CALIBRATION_ITERATIONS", "LinkEmulation", "compute_slowdown"]

#: Training iterations whose step times set the slowdown (the lowest of them is kept).
CALIBRATION_ITERATIONS = 3

#: Phases whose steps are compared (those of an unlimited-memory device's iteration).
_COMPARED = ("forward", "backward")


def compute_slowdown(program: Program, step_times: Sequence[float],
                     profile: DeviceProfile) -> float:
    """Measured seconds of ``program``'s forward and backward steps (``step_times``, one per
    step) over ``profile``'s roofline seconds of the same steps."""
    if len(step_times) != len(program.steps):
        raise ValueError(f"{len(step_times)} step times for a program of "
                         f"{len(program.steps)} steps")
    costs = step_costs(program, profile)
    measured = predicted = 0.0
    for st, t, c in zip(program.steps, step_times, costs):
        if st.phase in _COMPARED:
            measured += float(t)
            predicted += c
    if measured <= 0 or predicted <= 0:
        raise ValueError("no measured forward or backward step time to compare with the target")
    return measured / predicted


@dataclass
class LinkEmulation:
    """The emulated link of one run: ``profile``'s link slowed by the measured ``slowdown``
    (``None`` until the first iteration has been measured)."""

    profile: DeviceProfile
    slowdown: float | None = None
    #: Training iterations measured so far (calibration stops at
    #: :data:`CALIBRATION_ITERATIONS`).
    iterations: int = 0

    @property
    def target_link_bytes_per_s(self) -> float:
        """``profile``'s host link (its slower direction)."""
        return min(self.profile.link_h2d_bytes_per_s, self.profile.link_d2h_bytes_per_s)

    @property
    def bytes_per_s(self) -> float | None:
        """The throttle's rate: the target's link / ``slowdown`` (``None`` before calibration)."""
        return None if self.slowdown is None else self.target_link_bytes_per_s / self.slowdown

    @property
    def calibrating(self) -> bool:
        return self.iterations < CALIBRATION_ITERATIONS

    def observe(self, program: Program, step_times: Sequence[float]) -> bool:
        """Take one training iteration's measured ``step_times`` of ``program`` into the
        slowdown while calibrating; True when the rate changed."""
        if not self.calibrating:
            return False
        self.iterations += 1
        s = compute_slowdown(program, step_times, self.profile)
        if self.slowdown is not None and s >= self.slowdown:
            return False
        self.slowdown = s
        return True

    def as_dict(self) -> dict[str, float | int | str | None]:
        return {"target": self.profile.name, "slowdown": self.slowdown,
                "target_link_bytes_per_s": self.target_link_bytes_per_s,
                "link_bytes_per_s": self.bytes_per_s, "calibration_iterations": self.iterations}

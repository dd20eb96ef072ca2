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
measure. The slowdown is measured at every training iteration and the throttle follows it:
the first iteration sets it (its compute carries one-time costs — first calls, page faults on
fresh arena memory — so the link starts too slow), then the median of the last
:data:`WINDOW` iterations' slowdowns, the first left out. A machine whose speed drifts (clock,
other processes) keeps its copy/compute ratio.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ..ir.program import Program
from .cost_model import step_costs
from .targets import DeviceProfile

__all__ = ["WINDOW", "LinkEmulation", "compute_slowdown"]

#: Iterations whose median slowdown sets the throttle.
WINDOW = 5

#: Phases whose steps are compared (those of an unlimited-memory device's iteration).
_COMPARED = ("forward", "backward")


def _compared(program: Program, profile: DeviceProfile) -> tuple[np.ndarray, float]:
    """The mask of ``program``'s compared steps and ``profile``'s roofline seconds of them."""
    mask = np.array([st.phase in _COMPARED for st in program.steps], dtype=bool)
    costs = np.asarray(step_costs(program, profile))
    return mask, float(costs[mask].sum()) if mask.any() else 0.0


def _slowdown(mask: np.ndarray, predicted: float, step_times: Sequence[float]) -> float:
    times = np.asarray(step_times, dtype=float)
    if times.shape != mask.shape:
        raise ValueError(f"{times.size} step times for a program of {mask.size} steps")
    measured = float(times[mask].sum())
    if measured <= 0 or predicted <= 0:
        raise ValueError("no measured forward or backward step time to compare with the target")
    return measured / predicted


def compute_slowdown(program: Program, step_times: Sequence[float],
                     profile: DeviceProfile) -> float:
    """Measured seconds of ``program``'s forward and backward steps (``step_times``, one per
    step) over ``profile``'s roofline seconds of the same steps."""
    return _slowdown(*_compared(program, profile), step_times)


@dataclass
class LinkEmulation:
    """The emulated link of one run: ``profile``'s link slowed by the measured ``slowdown``
    (``None`` until a first iteration has been measured)."""

    profile: DeviceProfile
    slowdown: float | None = None
    #: Training iterations measured so far.
    iterations: int = 0
    #: The last :data:`WINDOW` slowdowns after the first iteration's.
    recent: deque = field(default_factory=lambda: deque(maxlen=WINDOW))
    _programs: dict = field(default_factory=dict, repr=False)

    @property
    def target_link_bytes_per_s(self) -> float:
        """``profile``'s host link (its slower direction)."""
        return min(self.profile.link_h2d_bytes_per_s, self.profile.link_d2h_bytes_per_s)

    @property
    def bytes_per_s(self) -> float | None:
        """The throttle's rate: the target's link / ``slowdown`` (``None`` before a first
        measurement)."""
        return None if self.slowdown is None else self.target_link_bytes_per_s / self.slowdown

    def observe(self, program: Program, step_times: Sequence[float]) -> float:
        """Take one training iteration's measured ``step_times`` of ``program`` into the
        slowdown; returns that iteration's own slowdown."""
        key = id(program)
        entry = self._programs.get(key)
        if entry is None or entry[0] is not program:
            entry = self._programs[key] = (program, *_compared(program, self.profile))
        s = _slowdown(entry[1], entry[2], step_times)
        self.iterations += 1
        if self.iterations > 1:
            self.recent.append(s)
        self.slowdown = statistics.median(self.recent) if self.recent else s
        return s

    def as_dict(self) -> dict[str, float | int | str | None]:
        return {"target": self.profile.name, "slowdown": self.slowdown,
                "target_link_bytes_per_s": self.target_link_bytes_per_s,
                "link_bytes_per_s": self.bytes_per_s, "iterations": self.iterations}

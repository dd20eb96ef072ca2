"""A device cost model: roofline step times and a simulation of one iteration's copies.

Step time on a :class:`~.targets.DeviceProfile`: ``max(flops / peak FLOP/s, bytes / memory
bandwidth) + launch`` — the roofline at the datasheet peaks, where the bytes are the step's
tensors read and written once at their dtypes' sizes and the peak FLOP/s is the rate of the
step's precision (:func:`step_rate`: FP32, or a matrix op's tensor-core rate). An upper
bound on speed: real kernels reach a fraction of the peaks, the same fraction on both sides of
a ratio to first order, so overheads (plan time over an oracle's) are what the model is for.

:func:`simulate` walks a plan as the CUDA runtime runs it (memory/runtime/runtime.py and
memory/devices/cuda_device.py): compute on one stream; each ``Offload`` queued on the device-to-host
engine once the compute issued before it has finished; each ``Prefetch`` on the host-to-device
engine likewise; ``Await`` and ``Release`` make compute wait for their copy (the stall). Copies
in one direction run one at a time in issue order; the two directions overlap each other and
compute. The oracle is vDNN's baseline: the same network's forward and backward steps on a
device with unlimited memory (no recomputation, no transfers, no codecs).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..ir.names import Phase
from ..ir.plan import Action, Await, Offload, Plan, Prefetch, Release
from ..ir.program import Program, Step
from ..ir.walk import Where, walk
from .targets import DeviceProfile

__all__ = ["Prediction", "extra_time", "rate_breakdown", "simulate", "step_costs", "step_rate",
           "step_time", "walk_time"]


def step_rate(step: Step, profile: DeviceProfile) -> tuple[str, float]:
    """``(name, FLOP/s)`` the cost model prices ``step``'s FLOPs at: its matrix products'
    tensor-core rate (:attr:`~minidl.memory.ir.program.Step.cost.matmul_dtype`), else FP32."""
    if not step.cost.matmul_dtype:
        return "fp32", profile.flops_per_s
    return profile.matmul_rate(step.cost.matmul_dtype)


def step_time(program: Program, index: int, profile: DeviceProfile) -> float:
    """Roofline seconds of step ``index`` of ``program`` on ``profile``: FLOPs at
    :func:`step_rate`, bytes (each tensor read or written once, at its dtype's size) at the
    memory bandwidth."""
    st = program.steps[index]
    tensors = program.tensors
    touched = sum(tensors[t].nbytes for t in set(st.access.reads) | set(st.access.writes))
    flops_per_s = profile.flops_per_s if not st.cost.matmul_dtype else step_rate(st, profile)[1]
    return max(st.cost.flops / flops_per_s, touched / profile.hbm_bytes_per_s) + profile.launch_s


def rate_breakdown(program: Program, profile: DeviceProfile) -> dict[str, dict[str, float]]:
    """Per rate :func:`step_time` used: the steps (``steps``), their FLOPs, roofline seconds
    and how many of them the memory bandwidth bounds (``bandwidth_bound``), and the rate."""
    out: dict[str, dict[str, float]] = {}
    for i, st in enumerate(program.steps):
        name, rate = step_rate(st, profile)
        row = out.setdefault(name, {"rate_flops_per_s": rate, "steps": 0, "flops": 0,
                                    "seconds": 0.0, "bandwidth_bound": 0})
        seconds = step_time(program, i, profile)
        row["steps"] += 1
        row["flops"] += st.cost.flops
        row["seconds"] += seconds
        row["bandwidth_bound"] += st.cost.flops / rate < seconds - profile.launch_s
    return out


def step_costs(program: Program, profile: DeviceProfile) -> list[float]:
    """Roofline seconds of every step (the planners' ``step_times``)."""
    return [step_time(program, i, profile) for i in range(len(program.steps))]


@dataclass(frozen=True)
class Prediction:
    """One iteration of a plan on a device, as the cost model predicts it."""

    target: str
    #: Predicted seconds of the iteration under the plan.
    step_s: float
    #: Seconds on a device with unlimited memory (forward + backward, nothing else).
    oracle_s: float
    #: Seconds compute waited for copies (``Await`` of a prefetch, ``Release`` of an offload).
    stall_s: float
    #: Seconds of recomputed forward steps, and of encode / decode steps.
    recompute_s: float
    codec_s: float
    #: Bytes over the host link, each way.
    offloaded_bytes: int
    prefetched_bytes: int

    @property
    def overhead(self) -> float:
        """Extra time over the oracle, as a fraction of it."""
        return self.step_s / self.oracle_s - 1.0 if self.oracle_s > 0 else 0.0

    def as_dict(self) -> dict[str, float | int | str]:
        return {"target": self.target, "step_s": self.step_s, "oracle_s": self.oracle_s,
                "overhead": self.overhead, "stall_s": self.stall_s,
                "recompute_s": self.recompute_s, "codec_s": self.codec_s,
                "offloaded_bytes": self.offloaded_bytes,
                "prefetched_bytes": self.prefetched_bytes}


@dataclass(frozen=True)
class _Walk:
    """One walk of a plan: the compute clock at the end and where its time went."""

    end_s: float
    stall_s: float
    recompute_s: float
    codec_s: float
    offloaded_bytes: int
    prefetched_bytes: int


class _Clock:
    """The compute stream's clock and the two copy engines' along a plan's walk."""

    def __init__(self, program: Program, d2h_bytes_per_s: float, h2d_bytes_per_s: float,
                 host_homed: frozenset[int] = frozenset()):
        self.program = program
        self.host_homed = host_homed
        self.d2h_bytes_per_s = d2h_bytes_per_s
        self.h2d_bytes_per_s = h2d_bytes_per_s
        self.now = 0.0  # the compute stream's clock
        self.d2h_free = self.h2d_free = 0.0
        self.d2h_end: dict[int, float] = {}
        self.h2d_end: dict[int, float] = {}
        self.stall = self.recompute = self.codec = 0.0
        self.offloaded = self.prefetched = 0

    def _nbytes(self, tid: int) -> int:
        return self.program.block_size(self.program.tensors[tid].nbytes)

    def _wait_for(self, t_end: float) -> None:
        if t_end > self.now:
            self.stall += t_end - self.now
            self.now = t_end

    def apply(self, action: Action) -> None:
        """Queue an ``Offload`` / ``Prefetch`` on its engine, or make compute wait for its
        copy (``Release`` / ``Await``); allocations and frees take no time."""
        if isinstance(action, Offload):
            if action.tensor in self.host_homed:  # (its home holds its bytes: no copy)
                self.d2h_end[action.tensor] = self.now
                return
            nbytes = self._nbytes(action.tensor)
            start = max(self.now, self.d2h_free)
            self.d2h_free = self.d2h_end[action.tensor] = start + nbytes / self.d2h_bytes_per_s
            self.offloaded += nbytes
        elif isinstance(action, Prefetch):
            nbytes = self._nbytes(action.tensor)
            start = max(self.now, self.h2d_free)
            self.h2d_free = self.h2d_end[action.tensor] = start + nbytes / self.h2d_bytes_per_s
            self.prefetched += nbytes
        elif isinstance(action, Await):
            self._wait_for(self.h2d_end.get(action.tensor, 0.0))
        elif isinstance(action, Release):
            self._wait_for(self.d2h_end.get(action.tensor, 0.0))

    def compute(self, i: int, cost: float) -> None:
        """Step ``i`` runs for ``cost`` seconds on the compute stream."""
        self.now += cost
        st = self.program.steps[i]
        phase = st.phase
        if phase == Phase.RECOMPUTE:
            self.recompute += cost
        elif st.cost.recompute_flops:  # (the share of a backward spent recomputing inside the op)
            self.recompute += cost * _redo_share(st)
        elif phase in (Phase.ENCODE, Phase.DECODE):
            self.codec += cost


#: The actions that take time (allocations and frees take none).
_TIMED = (Offload, Prefetch, Await, Release)


def _walk(plan: Plan, costs: Sequence[float], d2h_bytes_per_s: float,
          h2d_bytes_per_s: float) -> _Walk:
    """Run ``plan``'s steps (``costs`` seconds each) and copies on the clock (module docstring),
    in :func:`~minidl.memory.ir.walk.walk`'s order."""
    clock = _Clock(plan.program, d2h_bytes_per_s, h2d_bytes_per_s,
                   frozenset(plan.swapping.host_homed))
    for visit in walk(plan):
        if visit.where is Where.COMPUTE:
            clock.compute(visit.step, costs[visit.step])
        else:
            for action in visit.actions:
                if isinstance(action, _TIMED):
                    clock.apply(action)
    return _Walk(clock.now, clock.stall, clock.recompute, clock.codec, clock.offloaded,
                 clock.prefetched)


def _redo_share(step) -> float:
    """The share of ``step``'s FLOPs that recompute forward work inside its op."""
    return step.cost.recompute_flops / step.cost.flops if step.cost.flops > 0 else 0.0


def _oracle(program: Program, costs: Sequence[float]) -> float:
    """The forward and backward steps' seconds, less what their ops recompute (a BPTT
    schedule's forward work again: an unlimited-memory device keeps every state)."""
    return sum(c * (1.0 - _redo_share(st)) for c, st in zip(costs, program.steps)
               if st.phase in (Phase.FORWARD, Phase.BACKWARD))


def extra_time(plan: Plan, costs: Sequence[float], bandwidth: float) -> float:
    """Seconds ``plan`` adds to an iteration over its forward and backward steps (stalls on a
    link of ``bandwidth`` bytes/s each way, recomputation, codecs): what the planners
    minimise, by the same walk as :func:`simulate`."""
    walk = _walk(plan, costs, bandwidth, bandwidth)
    return walk.end_s - _oracle(plan.program, costs)


def walk_time(plan: Plan, costs: Sequence[float], bandwidth: float) -> float:
    """Seconds of one iteration of ``plan``: the end of the same walk as :func:`extra_time`,
    every step at its own program's cost (encode / decode steps, and backward steps that
    start from an encoded stash, priced as they run, not as the base program's steps)."""
    return _walk(plan, costs, bandwidth, bandwidth).end_s


def simulate(plan: Plan, profile: DeviceProfile,
             step_times: Sequence[float] | None = None) -> Prediction:
    """Predict one iteration of ``plan`` on ``profile`` (see the module docstring);
    ``step_times`` (seconds per step, e.g. measured) replace the roofline's step costs."""
    program = plan.program
    costs = step_costs(program, profile) if step_times is None else [float(t) for t in step_times]
    w = _walk(plan, costs, profile.link_d2h_bytes_per_s, profile.link_h2d_bytes_per_s)
    return Prediction(profile.name, w.end_s, _oracle(program, costs), w.stall_s, w.recompute_s,
                      w.codec_s, w.offloaded_bytes, w.prefetched_bytes)

"""Re-planning after a measured iteration: what depends on the measurements.

The tensors whose transfer hides under compute (``swap=auto``, ``auto``: Capuchin) are
chosen again from the measured step times and host link, and sparse stashes are sized from
the densities seen; a timed plan that would raise the peak a dry run promised is not taken.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Protocol

import numpy as np

from ..memory.cost.targets import DeviceProfile
from ..memory.devices.device import MetaArray, MetaDevice
from ..memory.devices.traits import device_traits
from ..memory.ir.config import MemoryConfig, SwapPolicy
from ..memory.ir.plan import Plan
from ..memory.planners.planner import make_plan
from ..memory.runtime.host_pool import HostPool
from ..memory.runtime.pool import Pool
from .compiled import Compiled
from .executor import Executor
from .lowering import Lowered
from .option_search import target_costs


class ReplanningEngine(Protocol):
    """What re-planning needs of an :class:`~minidl.compile.engine.Engine`."""

    config: MemoryConfig
    target: DeviceProfile | None
    pool: Any
    compute: bool
    scratch: Any
    persistent_blocks: list[Any]

    def note_temporaries(self, executor: Executor) -> None: ...

    def replace_plan(self, c: Compiled, plan: Plan) -> Compiled: ...


#: Iterations a compiled step runs before its step times are a measure: the first compiles
#: the kernels (Numba's JIT, CUDA modules) and warms caches, so its times are no guide.
WARM_RUNS = 2


def refine(engine: ReplanningEngine, c: Compiled) -> Compiled:
    """``c`` re-planned from its measured iteration: see :meth:`Engine.refine
    <minidl.compile.engine.Engine.refine>`. Step times count only from a warm iteration
    (:data:`WARM_RUNS`): until then the timed re-planning waits (densities do not)."""
    need_times = (engine.config.swap == SwapPolicy.AUTO or engine.config.has("auto")) \
        and not c.plan.provenance.measured and engine.target is None  # a target's costs stand
    need_times = need_times and c.executor.runs >= WARM_RUNS
    need_dens = engine.config.has("sparse") and not c.plan.provenance.densities_measured \
        and bool(c.executor.densities)
    engine.note_temporaries(c.executor)
    if engine.scratch is not None and c.executor.scratch is None:
        return c  # the cache was cleared: the next step compiles with the scratch block
    if not (need_times or need_dens):
        return c
    times = list(c.executor.step_times) if need_times else None
    dens = {k: min(1.0, 1.1 * v + 1e-3) for k, v in c.executor.densities.items()}
    costs = target_costs(engine.target, c.lowered)
    if times is not None:
        costs["step_times"] = times
        costs["cost_source"] = "measured step times"
        link = measured_link(engine.pool.device, engine.compute)
        if link is not None:
            costs["bandwidth"] = link
            costs["cost_source"] += " and host link"
    plan = make_plan(c.lowered.program, engine.config, densities=dens, **costs)
    # choices made before planning (the BPTT schedule) stay in the notes
    made = plan.provenance
    plan = replace(plan, provenance=replace(made, measured=made.measured or need_times)) \
        .with_notes(*c.notes)
    if need_times and not need_dens and raises_peak(engine, c.lowered, plan, c.plan):
        # timing decisions must not raise the peak a dry run promised (it cannot measure):
        # a measured plan that would (more swaps, more fragmentation) is not taken
        plan = replace(c.plan, provenance=replace(c.plan.provenance, measured=True))
    new = engine.replace_plan(c, plan)
    new.executor.densities = dict(c.executor.densities)
    return new


def measured_link(device: Any, compute: bool) -> float | None:
    """Bytes per second ``device``'s copy engine moved, timed by the device (a GPU's copy
    streams, CUDA events), once it has copied anything; ``None`` elsewhere (the CPU's copy
    thread is not the link a plan for it should assume) or without ``compute``."""
    if not device_traits(device).asynchronous or not compute:
        return None
    copies = device.copy_engine
    copies.synchronize()  # (once: a first iteration's re-planning)
    if copies.busy_s <= 0 or copies.total_bytes <= 0:
        return None
    return copies.total_bytes / copies.busy_s


def raises_peak(engine: ReplanningEngine, lowered: Lowered, plan: Plan, old: Plan) -> bool:
    """Whether ``plan`` reaches a higher reserved or allocated peak than ``old`` (the same
    program's), each simulated beside ``engine``'s persistent blocks."""
    return any(new > was for new, was in zip(simulated_peaks(engine, lowered, plan),
                                             simulated_peaks(engine, lowered, old)))


def simulated_peaks(engine: ReplanningEngine, lowered: Lowered, plan: Plan) -> tuple[int, int]:
    """(reserved, allocated) peak bytes one iteration of ``plan`` reaches, placed on a
    meta pool holding ``engine``'s persistent blocks, no compute."""
    pool = Pool(MetaDevice(), alignment=engine.pool.alignment)
    for blk in engine.persistent_blocks:
        pool.allocate(blk.size, tag=blk.tag, category="parameter")
    ex = Executor(lowered, plan, pool, compute=False, host_pool=HostPool(pool.device, None))
    prog = plan.program  # (streamed parameters come from their host homes: sizes only here)
    ex.host_homes = {t: MetaArray((prog.block_size(prog.tensors[t].nbytes),), np.uint8)
                     for t in plan.swapping.host_homed}
    ex.run([None] * len(prog.inputs))
    stats = pool.stats()
    return stats["reserved_bytes.peak"], stats["allocated_bytes.peak"]

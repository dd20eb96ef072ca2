"""The stall a GPU's compute stream spends waiting for copies reaches the swap statistics."""

from __future__ import annotations

import numpy as np

from minidl.memory.devices.device import CopyEvent, CpuDevice
from minidl.memory.ir.plan import Alloc, Await, Offload, Plan, Prefetch, Release
from minidl.memory.ir.program import Program, TensorSpec
from minidl.memory.runtime.host_pool import HostPool
from minidl.memory.runtime.pool import Pool
from minidl.memory.runtime.runtime import MemoryRuntime


class _Probe:
    def __init__(self, seconds: float) -> None:
        self._seconds = seconds
        self.read = False

    def ready(self) -> bool:
        return True

    def seconds(self) -> float:
        self.read = True
        return self._seconds


class _DeviceOrderedCopy(CopyEvent):
    """A copy the compute stream waits for on the device (as a GPU's), measured by a probe."""

    probes: list = []

    def order_compute(self) -> _Probe:
        probe = _Probe(0.25)
        self.probes.append(probe)
        return probe


class _Engine:
    def copy_async(self, dst, src):
        np.copyto(dst, src)
        ev = _DeviceOrderedCopy(dst.nbytes)
        ev._finish(0.0)
        return ev


def test_the_compute_streams_waits_are_the_reported_stall():
    device = CpuDevice("64KiB")
    device._copy_engine = _Engine()
    program = Program(tensors=[TensorSpec(0, "t0", (256,), "float32", "feature_map", "value")],
                      steps=[], inputs=[])
    rt = MemoryRuntime(Pool(device), program, Plan(program, steps=()), HostPool(device))
    for a in (Alloc(0), Offload(0), Release(0), Prefetch(0), Await(0)):
        rt.apply(a)
    probes = _DeviceOrderedCopy.probes
    assert len(probes) == 2 and not any(p.read for p in probes)  # nothing read while running
    assert rt.swap_stats.stall_s == 0.5  # the release's and the await's waits

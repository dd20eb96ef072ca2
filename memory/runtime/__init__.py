"""Running a plan: the pool and its reports, host memory, transfers, the scratch block, the cache,
the runtime that applies a plan's actions.

``minidl.memory.runtime`` was the module of :class:`MemoryRuntime` before the sub-packages; its
names stay importable from here.
"""

from .runtime import MemoryRuntime, SwapStats, TensorNotResident, tensor_info

__all__ = ["MemoryRuntime", "SwapStats", "TensorNotResident", "tensor_info"]

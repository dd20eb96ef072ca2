"""minidl.memory: devices, the heap pool, plans, and memory policies.

Never imports minidl or layers.
"""

from __future__ import annotations

from typing import Any

from ..kernels.moved import install
from .device_factory import make_device
from .devices.device import (
    CopyEngine,
    CopyEvent,
    CpuDevice,
    ImmediateCopyEngine,
    MetaArray,
    MetaDevice,
)
from .ir.units import format_size, parse_size
from .runtime.pool import (
    CATEGORIES,
    Block,
    DeviceOutOfMemory,
    DoubleFreeError,
    ForeignBlockError,
    PlacementError,
    Pool,
    PoolError,
    UseAfterFreeError,
)

__all__ = [
    "CATEGORIES",
    "Block",
    "CopyEngine",
    "CopyEvent",
    "CpuDevice",
    "CudaDevice",
    "DeviceOutOfMemory",
    "DoubleFreeError",
    "ForeignBlockError",
    "ImmediateCopyEngine",
    "MetaArray",
    "MetaDevice",
    "PlacementError",
    "Pool",
    "PoolError",
    "UseAfterFreeError",
    "format_size",
    "make_device",
    "parse_size",
]


#: Modules that lived flat in this package before the sub-packages (old name -> sub-package):
#: ``minidl.memory.pool`` still imports, as the same module object as
#: ``minidl.memory.runtime.pool``.
MOVED_MODULES = {
    "attention_options": "options",
    "auto": "planners",
    "base_plan": "passes",
    "block_choices": "passes",
    "bptt": "passes",
    "bptt_options": "options",
    "cache": "runtime",
    "capabilities": "ir",
    "chain": "planners",
    "codecs": "passes",
    "compress": "passes",
    "config": "ir",
    "cost_model": "cost",
    "cuda_device": "devices",
    "device": "devices",
    "frontier": "planners",
    "host_pool": "runtime",
    "inplace": "passes",
    "link_emulation": "cost",
    "liveness": "ir",
    "network_wide": "passes",
    "optimal": "planners",
    "optimal_model": "planners",
    "plan": "ir",
    "planner": "planners",
    "pool": "runtime",
    "pool_errors": "runtime",
    "pool_report": "runtime",
    "program": "ir",
    "recompute": "passes",
    "residency": "ir",
    "reuse": "passes",
    "rotor": "planners",
    "scratch": "runtime",
    "sharing": "passes",
    "static_plan": "passes",
    "stream_model": "testing",
    "strict_device": "testing",
    "swap": "passes",
    "targets": "cost",
    "timeline": "ir",
    "transfer": "runtime",
    "units": "ir",
    "workspace_options": "options",
    "zero": "passes",
}
_moved_module = install(__name__, MOVED_MODULES)


def __getattr__(name: str) -> Any:
    # CudaDevice is imported on first use so that importing minidl.memory never imports cupy
    # (cuda_device itself imports cupy only when a CudaDevice is built).
    if name == "CudaDevice":
        from .devices.cuda_device import CudaDevice

        return CudaDevice
    return _moved_module(name)

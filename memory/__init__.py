"""minidl.memory: devices, the heap pool, plans, and memory policies.

Never imports minidl or layers.
"""

from __future__ import annotations

from typing import Any

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
    Block,
    DeviceOutOfMemory,
    DoubleFreeError,
    ForeignBlockError,
    PlacementError,
    Pool,
    PoolError,
    UseAfterFreeError,
)
from .runtime.pool_report import CATEGORIES

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


def __getattr__(name: str) -> Any:
    # CudaDevice is imported on first use so that importing minidl.memory never imports cupy
    # (cuda_device itself imports cupy only when a CudaDevice is built).
    if name == "CudaDevice":
        from .devices.cuda_device import CudaDevice

        return CudaDevice
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

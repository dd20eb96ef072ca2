"""What a :class:`~minidl.train.trainer.Trainer` runs on: the device, its pool, the kernels'
threads and the emulated host link, made from the trainer's arguments."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...kernels._cuda import set_disk_cache
from ...kernels.parallel import set_thread_policy
from ...memory.cost.link_emulation import LinkEmulation
from ...memory.cost.targets import DeviceProfile, get_target
from ...memory.device_factory import make_device
from ...memory.devices.device import CpuDevice
from ...memory.ir.names import DeviceKind
from ...memory.ir.units import ALLOCATION_UNIT
from ...memory.runtime.pool import Pool
from ...settings import Settings


@dataclass
class DeviceSetup:
    """A device, the pool over its memory, and the emulated link (``target`` the GPU whose
    cost model plans are made with, ``link_emulation`` its throttle; both ``None`` without)."""

    device: Any
    pool: Pool
    target: DeviceProfile | None
    link_emulation: LinkEmulation | None


def set_up_device(
    device: Any = "cpu",
    device_memory: int | str = "auto",
    host_memory: int | str | None = None,
    debug: bool | None = None,
    threads: int | None = None,
    alignment: int = ALLOCATION_UNIT,
    emulate_link: str | DeviceProfile | None = None,
) -> DeviceSetup:
    """The device (made by :func:`~minidl.memory.device_factory.make_device` when ``device`` is
    a name), its pool and the link emulation, with the kernels' thread policy applied; the
    arguments are :class:`~minidl.train.trainer.Trainer`'s."""
    target = get_target(emulate_link) if isinstance(emulate_link, str) else emulate_link
    cpu = isinstance(device, CpuDevice) or (isinstance(device, str)
                                            and device.strip().lower() == DeviceKind.CPU)
    if target is not None and not cpu:
        raise ValueError(f"emulate_link throttles the cpu device's copy engine: it needs "
                         f"device='cpu', not {device!r}")
    link_emulation = None if target is None else LinkEmulation(target)
    if isinstance(device, str):
        extra = {}
        if device.strip().lower().startswith("cuda") and host_memory is not None:
            # (cuda-strict takes the same bound for its stand-in of pinned memory)
            extra["pinned_capacity"] = host_memory  # swapped tensors live in pinned memory
        device = make_device(device, device_memory, **extra)
    if debug is None:
        debug = Settings.from_environment().debug_pool
    # the kernels' threads: ``threads``, else MINIDL_NUM_THREADS / MINIDL_BLAS_THREADS
    # (minidl/settings.py), applied when a trainer is made rather than at import
    settings = Settings.from_environment()
    set_thread_policy(threads if threads is not None else settings.num_threads,
                      settings.blas_threads)
    set_disk_cache(settings.cuda_disk_cache)
    pool = Pool(device, alignment=alignment, debug=debug)
    return DeviceSetup(device, pool, target, link_emulation)

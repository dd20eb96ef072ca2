"""Devices' traits and GPU hooks are read in one place (memory/devices/traits.py)."""

import contextlib

import pytest

from minidl.memory.devices.cuda_device import CudaDevice
from minidl.memory.devices.device import CpuDevice, GpuDevice, MetaDevice
from minidl.memory.devices.traits import DeviceTraits, device_traits
from minidl.memory.testing.strict_device import StrictCudaDevice

DECLARED = ("name", "kind", "has_storage", "asynchronous")
HOOKS = ("activate", "route_allocations", "copy_from_host", "fetch_async")


@pytest.mark.parametrize("cls", [CpuDevice, MetaDevice, CudaDevice, StrictCudaDevice])
def test_every_device_declares_its_traits(cls):
    for field in DECLARED:
        assert field in dir(cls) or field in cls.__init__.__code__.co_names, (cls, field)


@pytest.mark.parametrize("cls", [CudaDevice, StrictCudaDevice])
def test_gpu_devices_have_the_declared_hooks(cls):
    assert cls.asynchronous is True and cls.has_storage is True
    for hook in HOOKS:
        assert callable(getattr(cls, hook)), hook
        assert hook in GpuDevice.__dict__, hook


def test_the_cpu_and_meta_devices():
    cpu = device_traits(CpuDevice(1 << 20))
    assert (cpu.name, cpu.kind, cpu.has_storage, cpu.asynchronous) == ("cpu", "cpu", True, False)
    assert cpu.fetch_async is None and cpu.route_allocations is None
    meta = device_traits(MetaDevice(1 << 20, kind="cuda"))
    assert (meta.name, meta.kind, meta.has_storage, meta.asynchronous) == ("meta", "cuda", False,
                                                                          False)


def test_what_a_device_leaves_out_takes_one_default_everywhere():
    class Bare:
        capacity = 1024

    t = device_traits(Bare())
    assert t == DeviceTraits(name="Bare")
    assert (t.kind, t.has_storage, t.asynchronous) == ("cpu", True, False)
    assert t.activate is contextlib.nullcontext and t.step_timer is None

"""What the strict-device layer tests share: host and device
memory for one engine-like run, garbage-filled buffers and workspaces, normal samples."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from minidl.memory.testing import strict_device as strict

ALIGN = 512


class HostMem:
    """NumPy arrays."""

    device = False

    def empty(self, shape, dtype) -> np.ndarray:
        return np.empty(shape, dtype)

    def put(self, host: np.ndarray) -> np.ndarray:
        return np.array(host, copy=True)

    def get(self, a: Any) -> np.ndarray:
        return np.array(a, copy=True)

    def fill(self, a: Any, value: Any) -> None:
        a.fill(value)


class DeviceMem(HostMem):
    """Views of the strict device's arena, each at its own 512-byte aligned offset."""

    device = True

    def __init__(self, dev) -> None:
        self.dev = dev
        self.offset = 0

    def empty(self, shape, dtype):
        dtype = np.dtype(dtype)
        nbytes = math.prod(shape) * dtype.itemsize
        off = self.offset
        self.offset += -(-max(nbytes, 1) // ALIGN) * ALIGN
        return self.dev.view(off, nbytes, tuple(shape), dtype)

    def put(self, host: np.ndarray):
        v = self.empty(host.shape, host.dtype)
        self.dev.copy_from_host(v, host)
        return v

    def get(self, a: Any) -> np.ndarray:
        assert isinstance(a, strict.StrictArray), f"a {type(a).__name__} on the device"
        return a.get()


def garbage(mem, shape, dtype):
    a = mem.empty(shape, dtype)
    dt = np.dtype(dtype)
    if dt.kind == "f":
        mem.fill(a, np.nan)
    elif dt.kind in "iu":
        mem.fill(a, np.iinfo(dt).max)
    else:
        mem.fill(a, 1)
    return a


def workspace(mem, nbytes: int):
    if not nbytes:
        return None
    ws = mem.empty((nbytes,), np.uint8)
    mem.fill(ws, 0xFF)  # NaN in float32 and float64
    return ws


def normal(rng, *shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)

"""Devices: where the pool's arena lives and how bytes move between device and host.

* :class:`CpuDevice` — device memory is one preallocated NumPy byte arena whose base is
  aligned to the allocation unit;
  host memory is ordinary NumPy memory; copies run on a :class:`CopyEngine` worker thread.
* :class:`MetaDevice` — no storage at all: views are :class:`MetaArray` (shape, dtype, nbytes)
  and copies complete at once. The pool places blocks exactly as on a real device.
* ``CudaDevice`` lives in :mod:`.cuda_device` (with :mod:`.cuda_streams` and
  :mod:`.cuda_interop`, the only modules that know CuPy).

Every device offers the same small surface (see :class:`Device`); :func:`as_shape` and
:func:`check_view` are the checks every device's ``view`` shares. The copy engines live in
:mod:`.copy_engine` (re-exported here). Devices are built by name in :mod:`.device_factory`
(``make_device``).
"""

from __future__ import annotations

import math
import os
from typing import Any, Protocol, runtime_checkable

import numpy as np

from ..ir.names import DeviceKind
from ..ir.units import ALLOCATION_UNIT, format_size, parse_size
from .copy_engine import CopyEngine, CopyEvent, ImmediateCopyEngine, _check_rate

__all__ = [
    "CopyEngine",
    "CopyEvent",
    "CpuDevice",
    "Device",
    "ImmediateCopyEngine",
    "MetaArray",
    "MetaDevice",
    "as_shape",
    "available_host_memory",
    "check_view",
]

_NAN32 = 0x7FC00000  # float32 quiet NaN bit pattern


#: Kinds of device a program is lowered for (workspaces and kernels differ per kind), as
#: plain strings (:class:`~minidl.memory.ir.names.DeviceKind`'s values).
DEVICE_KINDS = tuple(k.value for k in DeviceKind)


def as_shape(shape: int | tuple[int, ...] | list[int]) -> tuple[int, ...]:
    """``shape`` as a tuple of ints (an int is a 1-D shape)."""
    if type(shape) is tuple:
        return shape
    if isinstance(shape, (int, np.integer)):
        return (int(shape),)
    return tuple(map(int, shape))


def check_view(device: Any, offset: int, nbytes: int, shape: tuple[int, ...],
               dtype: np.dtype) -> None:
    """Raise ``ValueError`` unless ``shape``/``dtype`` fit ``nbytes`` inside the arena."""
    if shape and min(shape) < 0:
        raise ValueError(f"negative dimension in shape {shape}")
    need = math.prod(shape) * dtype.itemsize
    if need > nbytes:
        raise ValueError(f"view of shape {shape} and dtype {dtype} needs {need} bytes, "
                         f"more than the {nbytes} bytes given")
    if offset < 0 or offset + nbytes > device.capacity:
        raise ValueError(f"bytes [{offset}, {offset + nbytes}) lie outside the "
                         f"{device.capacity}-byte arena of the {device.name} device")


@runtime_checkable
class Device(Protocol):
    """What the pool and the runtime need from a device (read its traits and optional hooks
    through :func:`~.traits.device_traits`)."""

    name: str
    kind: DeviceKind
    capacity: int
    has_storage: bool
    asynchronous: bool
    xp: Any

    def view(self, offset: int, nbytes: int, shape: Any, dtype: Any = np.float32) -> Any: ...
    def host_empty(self, shape: Any, dtype: Any = np.float32) -> Any: ...
    def fill(self, offset: int, nbytes: int, value: int | float) -> None: ...
    @property
    def copy_engine(self) -> Any: ...
    def close(self) -> None: ...


class GpuDevice(Device, Protocol):
    """A device whose compute runs asynchronously on its own streams (CUDA, the strict test
    device): the hooks the executor and the runtime call when a device has them."""

    def activate(self) -> Any: ...
    def route_allocations(self, allocate: Any) -> Any: ...
    def copy_from_host(self, dst: Any, src: np.ndarray) -> None: ...
    def fetch_async(self, src: Any) -> Any: ...


def available_host_memory() -> int:
    """Bytes of host memory available now (``MemAvailable`` of /proc/meminfo, else sysconf)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 1 << 62  # unknown: do not refuse


class CpuDevice:
    """Device memory as one preallocated NumPy byte arena of ``capacity`` bytes.

    The arena is ``np.empty`` (pages are touched only when used) with a base aligned to
    the allocation unit (``ALLOCATION_UNIT`` bytes).
    A capacity larger than the host's available memory is refused. ``link_bytes_per_s``
    throttles the copy engine to a slower host link (see :class:`CopyEngine`; settable later
    as the attribute of the same name); ``None`` (default): copies at memory speed.
    """

    name = "cpu"
    kind = DeviceKind.CPU
    asynchronous = False
    has_storage = True
    xp = np

    def __init__(self, capacity: int | str = "256MiB",
                 link_bytes_per_s: float | None = None) -> None:
        self._link_bytes_per_s = _check_rate(link_bytes_per_s)
        self.capacity = parse_size(capacity)
        avail = available_host_memory()
        if self.capacity > avail:
            raise ValueError(
                f"cpu device capacity {format_size(self.capacity)} ({self.capacity} bytes) is "
                f"larger than the host's available memory {format_size(avail)} ({avail} bytes); "
                "choose a smaller device memory")
        raw = np.empty(self.capacity + ALLOCATION_UNIT, dtype=np.uint8)
        shift = (-raw.ctypes.data) % ALLOCATION_UNIT
        self._arena: np.ndarray | None = raw[shift:shift + self.capacity]
        self._copy_engine: CopyEngine | None = None

    @property
    def arena(self) -> np.ndarray:
        """The whole arena as a 1-D ``uint8`` array."""
        if self._arena is None:
            raise RuntimeError("cpu device is closed")
        return self._arena

    def view(self, offset: int, nbytes: int, shape: Any, dtype: Any = np.float32) -> np.ndarray:
        """A ``dtype`` array of ``shape`` over arena bytes ``[offset, offset + nbytes)``."""
        arena = self._arena
        if arena is None:
            raise RuntimeError("cpu device is closed")
        dtype = np.dtype(dtype)
        shape = as_shape(shape)
        check_view(self, offset, nbytes, shape, dtype)
        return np.ndarray(shape, dtype, buffer=arena, offset=offset)

    def host_empty(self, shape: Any, dtype: Any = np.float32) -> np.ndarray:
        """Ordinary (host) NumPy memory."""
        return np.empty(as_shape(shape), dtype)

    def fill(self, offset: int, nbytes: int, value: int | float) -> None:
        """Fill arena bytes with a byte value (0..255) or, for ``float('nan')``, float32 NaNs."""
        raw = self.arena[offset:offset + nbytes]
        if isinstance(value, float) and math.isnan(value):
            n4 = nbytes // 4
            raw[:n4 * 4].view(np.uint32)[...] = _NAN32
            raw[n4 * 4:] = 0xFF
        else:
            raw[...] = int(value)

    @property
    def copy_engine(self) -> CopyEngine:
        """The device's copy engine (created on first use)."""
        if self._copy_engine is None:
            if self._arena is None:
                raise RuntimeError("cpu device is closed")
            self._copy_engine = CopyEngine("cpu-copy", self._link_bytes_per_s)
        return self._copy_engine

    @property
    def link_bytes_per_s(self) -> float | None:
        """The copy engine's throttle (bytes/s of the emulated host link), or ``None``."""
        return self._link_bytes_per_s

    @link_bytes_per_s.setter
    def link_bytes_per_s(self, value: float | None) -> None:
        self._link_bytes_per_s = _check_rate(value)
        if self._copy_engine is not None:
            self._copy_engine.bytes_per_s = self._link_bytes_per_s

    def close(self) -> None:
        """Stop the copy engine and release the arena. Idempotent."""
        if self._copy_engine is not None:
            self._copy_engine.close()
        self._arena = None

    def __enter__(self) -> CpuDevice:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        link = "" if self._link_bytes_per_s is None else \
            f", link_bytes_per_s={self._link_bytes_per_s:.4g}"
        return f"CpuDevice(capacity={format_size(self.capacity)!r}{link})"


class MetaArray:
    """A shape without data: what a meta device hands out instead of an array."""

    __slots__ = ("shape", "dtype")

    def __init__(self, shape: Any, dtype: Any = np.float32) -> None:
        self.shape = as_shape(shape)
        self.dtype = np.dtype(dtype)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def reshape(self, *shape: Any) -> MetaArray:
        """Same data-less array with another shape of the same size (one ``-1`` allowed)."""
        new = as_shape(shape[0] if len(shape) == 1 else shape)
        if -1 in new:
            rest = math.prod(d for d in new if d != -1)
            new = tuple(self.size // rest if d == -1 and rest else d for d in new)
        if math.prod(new) != self.size:
            raise ValueError(f"cannot reshape MetaArray of shape {self.shape} into {new}")
        return MetaArray(new, self.dtype)

    def __repr__(self) -> str:
        return f"MetaArray(shape={self.shape}, dtype={self.dtype})"


class MetaDevice:
    """A device with no storage: blocks are placed, views are :class:`MetaArray`.

    ``capacity`` defaults to unlimited (``1 << 62``); placement never depends on it.
    """

    name = "meta"
    has_storage = False
    asynchronous = False
    xp = np
    UNLIMITED = 1 << 62

    def __init__(self, capacity: int | str | None = None,
                 kind: DeviceKind | str = DeviceKind.CPU) -> None:
        if kind not in DEVICE_KINDS:
            raise ValueError(f"unknown device kind {kind!r}; valid kinds: "
                             f"{', '.join(DEVICE_KINDS)}")
        #: The kind of device this dry run stands for (its layers' workspaces follow it).
        self.kind = DeviceKind(kind)
        self.capacity = self.UNLIMITED if capacity is None else parse_size(capacity)
        self._copy_engine: ImmediateCopyEngine | None = None

    def view(self, offset: int, nbytes: int, shape: Any, dtype: Any = np.float32) -> MetaArray:
        """A :class:`MetaArray` of ``shape`` and ``dtype`` (bounds checked as on a real device)."""
        dtype = np.dtype(dtype)
        shape = as_shape(shape)
        check_view(self, offset, nbytes, shape, dtype)
        return MetaArray(shape, dtype)

    def host_empty(self, shape: Any, dtype: Any = np.float32) -> MetaArray:
        """Host memory on a meta device has no data either."""
        return MetaArray(shape, dtype)

    def fill(self, offset: int, nbytes: int, value: int | float) -> None:
        """Nothing to fill."""

    @property
    def copy_engine(self) -> ImmediateCopyEngine:
        if self._copy_engine is None:
            self._copy_engine = ImmediateCopyEngine()
        return self._copy_engine

    def close(self) -> None:
        if self._copy_engine is not None:
            self._copy_engine.close()

    def __enter__(self) -> MetaDevice:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        cap = "unlimited" if self.capacity == self.UNLIMITED else format_size(self.capacity)
        return f"MetaDevice(capacity={cap!r}, kind={self.kind!r})"

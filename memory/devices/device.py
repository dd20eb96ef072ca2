"""Devices: where the pool's arena lives and how bytes move between device and host.

* :class:`CpuDevice` — device memory is one preallocated NumPy byte arena whose base is
  aligned to the allocation unit;
  host memory is ordinary NumPy memory; copies run on a :class:`CopyEngine` worker thread.
* :class:`MetaDevice` — no storage at all: views are :class:`MetaArray` (shape, dtype, nbytes)
  and copies complete at once. The pool places blocks exactly as on a real device.
* ``CudaDevice`` lives in :mod:`.cuda_device` (the only module that knows CuPy).

Every device offers the same small surface (see :class:`Device`); :func:`as_shape` and
:func:`check_view` are the checks every device's ``view`` shares. Devices are built by name in
:mod:`.device_factory` (``make_device``).
"""

from __future__ import annotations

import math
import os
import queue
import threading
import time
import weakref
from typing import Any, Protocol, runtime_checkable

import numpy as np

from ..ir.units import ALLOCATION_UNIT, format_size, parse_size

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


#: Kinds of device a program is lowered for (workspaces and kernels differ per kind).
DEVICE_KINDS = ("cpu", "cuda")


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
    """What the pool and the runtime need from a device."""

    name: str
    capacity: int
    has_storage: bool
    xp: Any

    def view(self, offset: int, nbytes: int, shape: Any, dtype: Any = np.float32) -> Any: ...
    def host_empty(self, shape: Any, dtype: Any = np.float32) -> Any: ...
    def fill(self, offset: int, nbytes: int, value: int | float) -> None: ...
    @property
    def copy_engine(self) -> Any: ...
    def close(self) -> None: ...


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


# --------------------------------------------------------------------------- copies


class CopyEvent:
    """Completion of one asynchronous copy: ``wait()``, ``done()``, ``elapsed_s``, ``nbytes``."""

    __slots__ = ("nbytes", "_event", "_error", "_elapsed")

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self._event = threading.Event()
        self._error: BaseException | None = None
        self._elapsed: float | None = None

    def _finish(self, elapsed: float, error: BaseException | None = None) -> None:
        self._elapsed = elapsed
        self._error = error
        self._event.set()

    def done(self) -> bool:
        """True once the copy has finished (successfully or not)."""
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> None:
        """Block until the copy has finished; re-raise its error; ``TimeoutError`` on timeout."""
        if not self._event.wait(timeout):
            raise TimeoutError(f"copy of {self.nbytes} bytes not finished after {timeout} s")
        if self._error is not None:
            raise self._error

    @property
    def elapsed_s(self) -> float | None:
        """Seconds the copy took (``None`` until it has finished)."""
        return self._elapsed

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"CopyEvent({format_size(self.nbytes)}, {state})"


class _EngineStats:
    __slots__ = ("total_bytes", "busy_s", "num_copies", "error", "bytes_per_s", "link_free")

    def __init__(self) -> None:
        self.total_bytes = 0
        self.busy_s = 0.0
        self.num_copies = 0
        self.error: BaseException | None = None
        #: The throttle (``None``: copies at memory speed) and when the emulated link is next
        #: free (``perf_counter`` seconds): the end of the last throttled copy's time slot.
        self.bytes_per_s: float | None = None
        self.link_free = 0.0


def _throttle(stats: _EngineStats, nbytes: int, queued: float | None, t0: float) -> float:
    """Sleep until a link of ``stats.bytes_per_s`` would have finished this copy; returns
    when its slot on the link began. The slot starts when the copy was queued or when the
    link's previous slot ended, whichever is later, and lasts ``nbytes / rate``: a FIFO link
    whose timing errors (sleep overshoot, waiting for the GIL) do not add up from copy to
    copy."""
    rate = stats.bytes_per_s
    if not rate:
        return t0
    start = max(t0 if queued is None else queued, stats.link_free)
    end = start + nbytes / rate
    rest = end - time.perf_counter()
    if rest > 0:
        time.sleep(rest)
    stats.link_free = end if rest > 0 else time.perf_counter()
    return start


def _copy_worker(q: queue.Queue, stats: _EngineStats) -> None:
    # Holds no reference to the engine, so an unreferenced engine can be collected and closed.
    while True:
        item = q.get()
        try:
            if item is None:
                return
            event, dst, src, queued = item
            t0 = time.perf_counter()
            try:
                np.copyto(dst, src, casting="no")
                error = None
            except BaseException as e:  # reported through the event
                error = e
            if stats.bytes_per_s and error is None:
                t0 = _throttle(stats, event.nbytes, queued, t0)
            dt = time.perf_counter() - t0
            stats.busy_s += dt
            stats.num_copies += 1
            if error is None:
                stats.total_bytes += event.nbytes
            elif stats.error is None:
                stats.error = error
            event._finish(dt, error)
        finally:
            q.task_done()


def _check_copy(dst: Any, src: Any) -> int:
    if dst.shape != src.shape or dst.dtype != src.dtype:
        raise ValueError(f"copy needs arrays of the same shape and dtype, got dst {dst.shape} "
                         f"{dst.dtype} and src {src.shape} {src.dtype}")
    return int(dst.nbytes)


def _check_rate(bytes_per_s: float | None) -> float | None:
    if bytes_per_s is None:
        return None
    rate = float(bytes_per_s)
    if not (rate > 0 and math.isfinite(rate)):
        raise ValueError(f"a copy engine's rate must be a positive finite number of bytes per "
                         f"second (or None: unthrottled), got {bytes_per_s!r}")
    return rate


class CopyEngine:
    """One worker thread copying arrays in FIFO order (``np.copyto`` releases the GIL).

    The thread is started on the first copy and stopped by :meth:`close` (or when the engine is
    garbage collected). Not meant to be shared between threads that submit copies concurrently
    with :meth:`close`.

    ``bytes_per_s`` throttles it to a slower link (link emulation, :mod:`.link_emulation`): a
    copy of ``n`` bytes then takes at least ``n / bytes_per_s`` seconds — its slot on the link
    starts when it is queued or when the previous copy's slot ends, and the worker sleeps out
    what the real copy did not use, so compute overlaps it as it would a DMA. ``None``
    (default): copies at memory speed.
    """

    def __init__(self, name: str = "copy", bytes_per_s: float | None = None) -> None:
        self.name = name
        self._queue: queue.Queue = queue.Queue()
        self._stats = _EngineStats()
        self._stats.bytes_per_s = _check_rate(bytes_per_s)
        self._thread: threading.Thread | None = None
        self._closed = False
        self._finalizer: weakref.finalize | None = None

    @property
    def bytes_per_s(self) -> float | None:
        """The throttle's rate, or ``None`` (unthrottled). Settable at any time; copies already
        queued take the rate in force when the worker reaches them."""
        return self._stats.bytes_per_s

    @bytes_per_s.setter
    def bytes_per_s(self, value: float | None) -> None:
        self._stats.bytes_per_s = _check_rate(value)

    def _start(self) -> None:
        self._thread = threading.Thread(target=_copy_worker, args=(self._queue, self._stats),
                                        name=f"minidl-{self.name}", daemon=True)
        self._thread.start()
        self._finalizer = weakref.finalize(self, self._queue.put, None)

    def copy_async(self, dst: np.ndarray, src: np.ndarray) -> CopyEvent:
        """Queue ``dst[...] = src`` (same shape and dtype); return its :class:`CopyEvent`.

        Neither array may be written (``src``) or read (``dst``) until the event is done.
        """
        if self._closed:
            raise RuntimeError(f"copy engine {self.name!r} is closed")
        event = CopyEvent(_check_copy(dst, src))
        if self._thread is None:
            self._start()
        self._queue.put((event, dst, src,
                         time.perf_counter() if self._stats.bytes_per_s else None))
        return event

    def synchronize(self) -> None:
        """Wait for every queued copy; re-raise the first copy error since the last call."""
        if self._thread is not None:
            self._queue.join()
        error, self._stats.error = self._stats.error, None
        if error is not None:
            raise error

    def close(self) -> None:
        """Finish the queued copies and stop the thread. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            if self._finalizer is not None:
                self._finalizer.detach()

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def total_bytes(self) -> int:
        """Bytes copied successfully so far."""
        return self._stats.total_bytes

    @property
    def busy_s(self) -> float:
        """Seconds the worker spent copying (throttled: the copies' slots on the link)."""
        return self._stats.busy_s

    @property
    def num_copies(self) -> int:
        return self._stats.num_copies

    def __enter__(self) -> CopyEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ImmediateCopyEngine:
    """The meta device's copy engine: nothing to copy, every event is done at once."""

    def __init__(self, name: str = "meta-copy") -> None:
        self.name = name
        self.total_bytes = 0
        self.busy_s = 0.0
        self.num_copies = 0
        self._closed = False

    def copy_async(self, dst: Any, src: Any) -> CopyEvent:
        """Check shapes and dtypes, count the bytes, and return a completed event."""
        if self._closed:
            raise RuntimeError(f"copy engine {self.name!r} is closed")
        event = CopyEvent(_check_copy(dst, src))
        event._finish(0.0)
        self.total_bytes += event.nbytes
        self.num_copies += 1
        return event

    def synchronize(self) -> None:
        """Nothing is ever pending."""

    def close(self) -> None:
        self._closed = True

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> ImmediateCopyEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --------------------------------------------------------------------------- devices


class CpuDevice:
    """Device memory as one preallocated NumPy byte arena of ``capacity`` bytes.

    The arena is ``np.empty`` (pages are touched only when used) with a base aligned to
    the allocation unit (``ALLOCATION_UNIT`` bytes).
    A capacity larger than the host's available memory is refused. ``link_bytes_per_s``
    throttles the copy engine to a slower host link (see :class:`CopyEngine`; settable later
    as the attribute of the same name); ``None`` (default): copies at memory speed.
    """

    name = "cpu"
    kind = "cpu"
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
    xp = np
    UNLIMITED = 1 << 62

    def __init__(self, capacity: int | str | None = None, kind: str = "cpu") -> None:
        if kind not in DEVICE_KINDS:
            raise ValueError(f"unknown device kind {kind!r}; valid kinds: "
                             f"{', '.join(DEVICE_KINDS)}")
        #: The kind of device this dry run stands for (its layers' workspaces follow it).
        self.kind = kind
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

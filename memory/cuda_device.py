"""The CUDA device: the only module that knows CuPy (imported when a device is built).

* The arena is one ``cupy.cuda.Memory(capacity)`` (a raw ``cudaMalloc``, so it never comes from
  CuPy's caching pool nor from an allocator routed to our own pool); views are ``cupy.ndarray``
  over ``MemoryPointer(arena, offset)``.
* Copies run on two non-blocking copy streams, one per direction; each returns a
  :class:`CudaCopyEvent` (the interface of :class:`~.device.CopyEvent`) built on two CUDA
  events.
* Host memory is pinned (``cupy.cuda.alloc_pinned_memory``) and bounded by ``pinned_capacity``
  (default: the host's available memory; the trainer passes ``--host-memory``).
* ``cuda:N``: :meth:`CudaDevice.activate` makes device N current; the executor runs every
  step under it.
* Step times come from CUDA events on the compute stream (:class:`CudaStepTimer`), not from
  the host clock around asynchronous launches.
* :func:`route_cupy_allocations` sends CuPy's own temporaries to a :class:`~.pool.Pool`.

Stream ordering: blocks freed by the pool may be handed out again at once. That is safe for work
on one stream; across streams, every copy waits for the compute queued before it
(:meth:`CudaCopyEngine.copy_async`) and the memory runtime makes compute wait for a copy's
event before it touches the block again (:meth:`CudaCopyEvent.order_compute`).
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterator
from typing import Any

import numpy as np

from .device import as_shape, available_host_memory, check_view
from .units import format_size, parse_size

__all__ = ["CudaCopyEngine", "CudaCopyEvent", "CudaDevice", "route_cupy_allocations"]

_NAN32 = 0x7FC00000


def _import_cupy() -> Any:
    try:
        import cupy
    except ImportError as e:
        raise RuntimeError(
            "the cuda device needs CuPy, which is not installed: pip install 'minidl[cuda]' "
            "(cupy-cuda12x), or use the cpu or meta device") from e
    try:
        ok = bool(cupy.cuda.is_available())
    except Exception:  # a broken driver or runtime counts as unavailable
        ok = False
    if not ok:
        raise RuntimeError("CuPy is installed but no CUDA device is available "
                           "(cupy.cuda.is_available() is False); use the cpu or meta device")
    return cupy


class CudaCopyEvent:
    """Completion of one copy on the copy stream: ``wait()``, ``done()``, ``elapsed_s``."""

    __slots__ = ("nbytes", "_cp", "_start", "_end", "_refs", "_elapsed")

    def __init__(self, cp: Any, nbytes: int, start: Any, end: Any, refs: tuple) -> None:
        self.nbytes = nbytes
        self._cp = cp
        self._start = start
        self._end = end
        self._refs: tuple | None = refs  # keep both arrays alive while the DMA may run
        self._elapsed: float | None = None

    def done(self) -> bool:
        """True once the copy has finished."""
        if self._refs is None:
            return True
        if self._end.done:
            self._complete()
            return True
        return False

    def wait(self, timeout: float | None = None) -> None:
        """Block until the copy has finished (CUDA errors raise); ``TimeoutError`` on timeout."""
        if self._refs is None:
            return
        if timeout is None:
            self._end.synchronize()
        else:
            deadline = time.perf_counter() + timeout
            while not self._end.done:
                if time.perf_counter() > deadline:
                    raise TimeoutError(f"copy of {self.nbytes} bytes not finished after "
                                       f"{timeout} s")
                time.sleep(50e-6)
        self._complete()

    def order_compute(self) -> None:
        """Work queued afterwards on the compute stream (CuPy's current stream) waits on the
        device for this copy to finish; the host does not wait."""
        if self._refs is not None:
            self._cp.cuda.get_current_stream().wait_event(self._end)

    def _complete(self) -> None:
        if self._refs is not None:
            self._elapsed = self._cp.cuda.get_elapsed_time(self._start, self._end) / 1e3
            self._refs = None

    @property
    def elapsed_s(self) -> float | None:
        """Seconds between the copy's start and end events (``None`` until done)."""
        if self._elapsed is None:
            self.done()
        return self._elapsed


class CudaCopyEngine:
    """Copies between device and (pinned) host on two non-blocking streams, one per direction
    (a GPU's two copy engines: an offload and a prefetch overlap), each in FIFO order.

    Each copy first makes the copy stream wait (on the device) for an event recorded on the
    compute stream (CuPy's current stream) when it is queued: a device-to-host copy then never
    reads a block before the kernel producing it has finished, and a host-to-device copy never
    overwrites a block that a queued kernel still reads. The other direction, compute after a
    copy, is :meth:`CudaCopyEvent.order_compute`.
    """

    def __init__(self, cp: Any, device_id: int) -> None:
        self._cp = cp
        self._device = cp.cuda.Device(device_id)
        with self._device:
            #: ``"h2d"`` and ``"d2h"``; a device-to-device copy goes on ``d2h``.
            self.streams = {"h2d": cp.cuda.Stream(non_blocking=True),
                            "d2h": cp.cuda.Stream(non_blocking=True)}
        self._inflight: deque[CudaCopyEvent] = deque()
        self.total_bytes = 0
        self.busy_s = 0.0
        self.num_copies = 0
        self._closed = False

    def copy_async(self, dst: Any, src: Any) -> CudaCopyEvent:
        """Queue ``dst[...] = src`` (same shape and dtype, C-contiguous, one side on device)."""
        if self._closed:
            raise RuntimeError("cuda copy engine is closed")
        cp = self._cp
        if dst.shape != src.shape or dst.dtype != src.dtype:
            raise ValueError(f"copy needs arrays of the same shape and dtype, got dst {dst.shape} "
                             f"{dst.dtype} and src {src.shape} {src.dtype}")
        if not (dst.flags.c_contiguous and src.flags.c_contiguous):
            raise ValueError("copy needs C-contiguous arrays")
        nbytes = int(dst.nbytes)
        d_dev = isinstance(dst, cp.ndarray)
        s_dev = isinstance(src, cp.ndarray)
        if not (d_dev or s_dev):
            raise ValueError("a cuda copy needs at least one cupy array")
        stream = self.streams["h2d" if d_dev and not s_dev else "d2h"]
        with self._device:
            start = cp.cuda.Event()
            end = cp.cuda.Event()
            produced = cp.cuda.Event(disable_timing=True)
            produced.record(cp.cuda.get_current_stream())
            stream.wait_event(produced)
            start.record(stream)
            if d_dev and s_dev:
                dst.data.copy_from_device_async(src.data, nbytes, stream)
            elif d_dev:
                dst.data.copy_from_host_async(src.ctypes.data, nbytes, stream)
            else:
                src.data.copy_to_host_async(dst.ctypes.data, nbytes, stream)
            end.record(stream)
        event = CudaCopyEvent(cp, nbytes, start, end, (dst, src))
        self.total_bytes += nbytes
        self.num_copies += 1
        self._inflight.append(event)
        self._retire()
        return event

    def _retire(self) -> None:
        inflight = self._inflight
        while inflight and inflight[0].done():
            self.busy_s += inflight.popleft().elapsed_s or 0.0

    def synchronize(self) -> None:
        """Wait for every queued copy."""
        for stream in self.streams.values():
            stream.synchronize()
        self._retire()

    def close(self) -> None:
        if not self._closed:
            self.synchronize()
            self._closed = True

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> CudaCopyEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


#: Host arrays up to this size go to the device through the pinned staging buffer.
STAGING_MAX_BYTES = 64 << 20


class CudaStepTimer:
    """Times of the steps of one iteration from CUDA events recorded on the compute stream.

    ``start(i)`` / ``stop(i)`` record events around step ``i``'s kernels; :meth:`collect`
    waits for the last event and returns the device-side seconds of each step (what the swap
    and recomputation planners need: kernel time, not launch time).
    """

    def __init__(self, cp: Any, num_steps: int) -> None:
        self._cp = cp
        self._events: list[tuple[Any, Any] | None] = [None] * num_steps

    def start(self, i: int) -> None:
        ev = self._cp.cuda.Event()
        ev.record()
        self._events[i] = (ev, None)

    def stop(self, i: int) -> None:
        pair = self._events[i]
        if pair is not None:
            ev = self._cp.cuda.Event()
            ev.record()
            self._events[i] = (pair[0], ev)

    def collect(self) -> np.ndarray:
        times = np.zeros(len(self._events))
        last = next((p[1] for p in reversed(self._events) if p and p[1] is not None), None)
        if last is not None:
            last.synchronize()
        for i, pair in enumerate(self._events):
            if pair is not None and pair[1] is not None:
                times[i] = self._cp.cuda.get_elapsed_time(pair[0], pair[1]) / 1e3
        return times


class _PinnedCounter:
    """Bytes of pinned host memory handed out and not yet garbage collected."""

    def __init__(self) -> None:
        self.used = 0
        self._lock = threading.Lock()

    def add(self, n: int) -> None:
        with self._lock:
            self.used += n

    def release(self, n: int) -> None:
        with self._lock:
            self.used -= n


class CudaDevice:
    """One CUDA device: an arena of ``capacity`` bytes, copy streams, bounded pinned memory."""

    name = "cuda"
    kind = "cuda"
    has_storage = True

    def __init__(self, capacity: int | str, device_id: int = 0,
                 pinned_capacity: int | str | None = None) -> None:
        cp = _import_cupy()
        self._cp = cp
        self.xp = cp
        self.capacity = parse_size(capacity)
        self.pinned_capacity = available_host_memory() if pinned_capacity is None \
            else parse_size(pinned_capacity)
        self.device_id = int(device_id)
        self._device = cp.cuda.Device(self.device_id)
        with self._device:
            free, total = cp.cuda.runtime.memGetInfo()
            if self.capacity > free:
                raise ValueError(
                    f"cuda:{self.device_id} capacity {format_size(self.capacity)} "
                    f"({self.capacity} bytes) is larger than the device's free memory "
                    f"{format_size(free)} ({free} bytes of {total})")
            self._mem: Any = cp.cuda.Memory(self.capacity)
        self.base_ptr: int = int(self._mem.ptr)
        self._pinned = _PinnedCounter()
        self._copy_engine: CudaCopyEngine | None = None
        self._staging: np.ndarray | None = None  # pinned bytes for copy_from_host
        self._staging_done: Any = None

    def _arena(self) -> Any:
        if self._mem is None:
            raise RuntimeError("cuda device is closed")
        return self._mem

    def view(self, offset: int, nbytes: int, shape: Any, dtype: Any = np.float32) -> Any:
        """A ``cupy.ndarray`` of ``shape``/``dtype`` over arena bytes from ``offset``."""
        cp = self._cp
        dtype = np.dtype(dtype)
        shape = as_shape(shape)
        check_view(self, offset, nbytes, shape, dtype)
        return cp.ndarray(shape, dtype, memptr=cp.cuda.MemoryPointer(self._arena(), offset))

    def host_empty(self, shape: Any, dtype: Any = np.float32) -> np.ndarray:
        """A NumPy array in pinned host memory; ``MemoryError`` beyond ``pinned_capacity``."""
        shape = as_shape(shape)
        dtype = np.dtype(dtype)
        count = math.prod(shape)
        nbytes = count * dtype.itemsize
        used = self._pinned.used
        if used + nbytes > self.pinned_capacity:
            raise MemoryError(
                f"pinned host memory exhausted: {format_size(nbytes)} ({nbytes} bytes) asked, "
                f"{format_size(used)} ({used} bytes) of {format_size(self.pinned_capacity)} "
                f"({self.pinned_capacity} bytes) in use; raise pinned_capacity")
        mem = self._cp.cuda.alloc_pinned_memory(max(nbytes, 1))
        root = np.frombuffer(mem, dtype, count)
        # Views of the returned array keep ``root`` alive, so the bytes are released only when
        # the last view is gone.
        self._pinned.add(nbytes)
        weakref.finalize(root, self._pinned.release, nbytes)
        return root.reshape(shape)

    @property
    def pinned_in_use(self) -> int:
        """Bytes of pinned host memory currently handed out by :meth:`host_empty`."""
        return self._pinned.used

    def fill(self, offset: int, nbytes: int, value: int | float) -> None:
        """Fill arena bytes with a byte value or, for ``float('nan')``, float32 NaNs."""
        cp = self._cp
        mem = self._arena()
        with self._device:
            if isinstance(value, float) and math.isnan(value):
                n4 = nbytes // 4
                if n4:
                    words = cp.ndarray((n4,), cp.uint32, memptr=cp.cuda.MemoryPointer(mem, offset))
                    words.fill(_NAN32)
                if nbytes > 4 * n4:
                    cp.cuda.MemoryPointer(mem, offset + 4 * n4).memset_async(0xFF, nbytes - 4 * n4)
            else:
                cp.cuda.MemoryPointer(mem, offset).memset_async(int(value), nbytes)

    @property
    def copy_engine(self) -> CudaCopyEngine:
        if self._copy_engine is None:
            self._arena()
            self._copy_engine = CudaCopyEngine(self._cp, self.device_id)
        return self._copy_engine

    def activate(self) -> Any:
        """Context manager making this device CuPy's current device (``cuda:N``)."""
        return self._device

    def step_timer(self, num_steps: int) -> CudaStepTimer:
        """Per-step compute times from CUDA events (see :class:`CudaStepTimer`)."""
        return CudaStepTimer(self._cp, num_steps)

    def copy_from_host(self, dst: Any, src: np.ndarray) -> None:
        """Host-to-device copy of ``src`` into the C-contiguous ``dst``, asynchronous on the
        compute stream from a pinned staging buffer (kernels queued after it see the data; the
        host does not wait unless the staging buffer is still being read by the last copy).
        Arrays above :data:`STAGING_MAX_BYTES` go synchronously (``ndarray.set``)."""
        cp = self._cp
        host = np.array(src, dtype=dst.dtype, order="C", copy=None).reshape(dst.shape)
        nbytes = int(host.nbytes)
        if nbytes == 0:
            return
        if nbytes > STAGING_MAX_BYTES or not dst.flags.c_contiguous:
            dst.set(host)
            return
        with self._device:
            if self._staging_done is not None:
                self._staging_done.synchronize()  # the last staged copy has read the buffer
            if self._staging is None or self._staging.nbytes < nbytes:
                self._staging = None
                self._staging = self.host_empty((max(nbytes, 1 << 20),), np.uint8)
            stage = self._staging[:nbytes]
            stage[...] = host.reshape(-1).view(np.uint8)
            stream = cp.cuda.get_current_stream()
            dst.data.copy_from_host_async(stage.ctypes.data, nbytes, stream)
            done = cp.cuda.Event(disable_timing=True)
            done.record(stream)
            self._staging_done = done

    def copy_to_host(self, src: Any) -> np.ndarray:
        """Device-to-host copy of ``src`` (``ndarray.get``)."""
        return src.get()

    def route_allocations(self, allocate: Any) -> Any:
        """Context manager: CuPy's allocations take arena bytes from ``allocate``."""
        return route_allocations(self, allocate)

    def synchronize(self) -> None:
        """Wait for all work on this device."""
        with self._device:
            self._device.synchronize()

    def close(self) -> None:
        """Finish the copies and release the arena (views must not be used afterwards)."""
        if self._copy_engine is not None:
            self._copy_engine.close()
        if self._mem is not None:
            self.synchronize()
            self._mem = None

    def __enter__(self) -> CudaDevice:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"CudaDevice(capacity={format_size(self.capacity)!r}, device_id={self.device_id})"


class _Release:
    """Owner of a CuPy temporary: calls ``release`` when CuPy drops the memory."""

    __slots__ = ("release",)

    def __init__(self, release: Any) -> None:
        self.release = release

    def __del__(self) -> None:
        self.release()


@contextlib.contextmanager
def route_allocations(device: CudaDevice, allocate: Any) -> Iterator[None]:
    """Within the block, CuPy's own allocations take arena bytes from ``allocate``
    (``nbytes -> (offset, release)``); the previous allocator is restored on exit and
    temporaries still alive then are released when CuPy frees them."""
    cp = device._cp
    base = device.base_ptr
    device_id = device.device_id

    def cupy_allocator(nbytes: int) -> Any:
        offset, release = allocate(nbytes)
        mem = cp.cuda.UnownedMemory(base + offset, nbytes, _Release(release), device_id)
        return cp.cuda.MemoryPointer(mem, 0)

    previous = cp.cuda.get_allocator()
    cp.cuda.set_allocator(cupy_allocator)
    try:
        yield
    finally:
        cp.cuda.set_allocator(previous)


def pool_allocator(pool: Any) -> Any:
    """``nbytes -> (offset, release)`` over ``pool`` (workspace blocks tagged "cupy.temp");
    the release is deferred to the pool's next call, since CuPy may free from a finalizer in
    the middle of another pool call."""

    def allocate(nbytes: int) -> tuple[int, Any]:
        block = pool.allocate(max(nbytes, 1), tag="cupy.temp", category="workspace")
        return block.offset, lambda: pool.free_deferred(block)

    return allocate


@contextlib.contextmanager
def route_cupy_allocations(pool: Any) -> Iterator[None]:
    """Within the block, CuPy's own allocations come from ``pool`` (workspace, "cupy.temp").

    ``pool.device`` must be a :class:`CudaDevice`.
    """
    device = pool.device
    if not isinstance(device, CudaDevice):
        raise TypeError(f"route_cupy_allocations needs a pool on a CudaDevice, not {device!r}")
    with route_allocations(device, pool_allocator(pool)):
        yield

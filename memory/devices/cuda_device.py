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
  step and the trainer the optimizer's update under it.
* Step and iteration times come from CUDA events on the compute stream (:class:`CudaStepTimer`),
  not from the host clock around asynchronous launches; the time compute waits for a copy is
  measured by events around the wait (:class:`StallProbe`). All are read lazily: recording
  them never stops the host.
* Losses and outputs come back through :meth:`CudaDevice.fetch_async` (a copy into pinned
  memory queued on the compute stream, waited for only when read).
* :func:`route_cupy_allocations` sends CuPy's own temporaries made on this thread to a
  :class:`~.pool.Pool`.
* The CUDA context, cuBLAS' handle and workspaces and the kernel modules live outside the
  arena: they are started and measured before it is allocated (:meth:`CudaDevice.outside_arena`).

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

from ..ir.units import format_size, parse_size
from .device import as_shape, available_host_memory, check_view

__all__ = ["CUDA_INSTALL_HINT", "CudaCopyEngine", "CudaCopyEvent", "CudaDevice", "CudaHostResult",
           "CudaStepTimer", "StallProbe", "route_cupy_allocations"]

_NAN32 = 0x7FC00000

#: How to install the GPU stack, for error messages: the extra matching the driver's CUDA.
CUDA_INSTALL_HINT = ("pip install 'minidl[cuda13]' or 'minidl[cuda12]', the one matching the "
                     "\"CUDA Version\" nvidia-smi prints (over a CuPy already installed: pip "
                     "install --no-deps -e .)")


def _import_cupy() -> Any:
    try:
        import cupy
    except ImportError as e:
        raise RuntimeError(
            f"the cuda device needs CuPy, which is not installed: {CUDA_INSTALL_HINT}; or use "
            "the cpu or meta device") from e
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

    def order_compute(self) -> StallProbe | None:
        """Work queued afterwards on the compute stream (CuPy's current stream) waits on the
        device for this copy to finish; the host does not wait. Returns the probe measuring
        how long the compute stream stood still for it (``None`` if the copy had finished)."""
        if self._refs is None:
            return None
        stream = self._cp.cuda.get_current_stream()
        before = self._cp.cuda.Event()
        before.record(stream)
        stream.wait_event(self._end)
        after = self._cp.cuda.Event()
        after.record(stream)
        return StallProbe(self._cp, before, after)

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


class StallProbe:
    """Two events on the compute stream around its wait for a copy: the time between them is
    how long the GPU's compute stood still waiting for that copy (0 when the copy had finished
    before the compute work queued ahead of the wait). Read lazily: :meth:`seconds` waits for
    the second event only if it has not completed."""

    __slots__ = ("_cp", "_before", "_after", "_seconds")

    def __init__(self, cp: Any, before: Any, after: Any) -> None:
        self._cp, self._before, self._after = cp, before, after
        self._seconds: float | None = None

    def ready(self) -> bool:
        return self._seconds is not None or bool(self._after.done)

    def seconds(self) -> float:
        if self._seconds is None:
            self._after.synchronize()
            self._seconds = self._cp.cuda.get_elapsed_time(self._before, self._after) / 1e3
            self._before = self._after = None
        return self._seconds


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
    """Times of one iteration from CUDA events recorded on the compute stream.

    ``begin()`` / ``end()`` bracket the whole iteration (its device time includes the compute
    stream's waits for copies and any gap where the GPU waited for the host); ``start(i)`` /
    ``stop(i)`` bracket step ``i``'s kernels. Nothing waits while recording: :meth:`ready`
    asks the last event without blocking, :meth:`collect` waits for it and returns the
    device-side seconds of each step (what the swap and recomputation planners need: kernel
    time, not launch time) and :attr:`iteration_s`.
    """

    def __init__(self, cp: Any, num_steps: int) -> None:
        self._cp = cp
        self._events: list[tuple[Any, Any] | None] = [None] * num_steps
        self._begin: Any = None
        self._end: Any = None
        self._times: np.ndarray | None = None
        #: Device seconds from :meth:`begin` to :meth:`end` (after :meth:`collect`).
        self.iteration_s: float | None = None

    def _record(self) -> Any:
        ev = self._cp.cuda.Event()
        ev.record()
        return ev

    def begin(self) -> None:
        self._begin = self._record()

    def end(self) -> None:
        self._end = self._record()

    def start(self, i: int) -> None:
        self._events[i] = (self._record(), None)

    def stop(self, i: int) -> None:
        pair = self._events[i]
        if pair is not None:
            self._events[i] = (pair[0], self._record())

    def _last(self) -> Any:
        if self._end is not None:
            return self._end
        return next((p[1] for p in reversed(self._events) if p and p[1] is not None), None)

    def ready(self) -> bool:
        """True once every recorded event has completed (reading the times will not wait)."""
        last = self._last()
        return self._times is not None or last is None or bool(last.done)

    def collect(self) -> np.ndarray:
        """Per-step device seconds (waits for the last event if it has not completed)."""
        if self._times is not None:
            return self._times
        elapsed = self._cp.cuda.get_elapsed_time
        times = np.zeros(len(self._events))
        last = self._last()
        if last is not None:
            last.synchronize()
        for i, pair in enumerate(self._events):
            if pair is not None and pair[1] is not None:
                times[i] = elapsed(pair[0], pair[1]) / 1e3
        if self._begin is not None and self._end is not None:
            self.iteration_s = elapsed(self._begin, self._end) / 1e3
        self._times = times
        self._events = []
        return times


class CudaHostResult:
    """A device-to-host copy queued on the compute stream (:meth:`CudaDevice.fetch_async`):
    :meth:`ready` asks without blocking, :meth:`result` waits for the copy if need be."""

    __slots__ = ("_host", "_event", "_src")

    def __init__(self, host: np.ndarray, event: Any, src: Any) -> None:
        self._host, self._event, self._src = host, event, src

    def ready(self) -> bool:
        return self._event is None or bool(self._event.done)

    def result(self) -> np.ndarray:
        if self._event is not None:
            self._event.synchronize()
            self._event = self._src = None
        return self._host


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


#: Device memory left free beside the arena for what the CUDA libraries load after the
#: device is made (kernel modules of CuPy, cuBLAS and Numba loaded lazily at first use, cuBLAS
#: workspaces of new streams): an arena closer than this to the free memory is refused.
OUTSIDE_ARENA_MARGIN = 256 << 20
#: Pinned staging buffers for batches going up (a ring: an upload reuses a slot only once the
#: copy that last read it has finished).
STAGING_SLOTS = 4


class CudaDevice:
    """One CUDA device: an arena of ``capacity`` bytes, copy streams, bounded pinned memory.

    Before the arena is allocated the libraries a step uses are started (the CUDA context,
    cuBLAS' handle and workspace, a GEMM's and an elementwise kernel's modules) and their
    device memory measured (:attr:`libraries_bytes`); the arena must then leave
    :data:`OUTSIDE_ARENA_MARGIN` free. :meth:`outside_arena` reports, at any time, the device
    bytes this process holds beside the arena.
    """

    name = "cuda"
    kind = "cuda"
    has_storage = True
    asynchronous = True

    def __init__(self, capacity: int | str, device_id: int = 0,
                 pinned_capacity: int | str | None = None) -> None:
        """``capacity``: the arena's bytes, or ``"auto"``: the GPU's free memory less
        :data:`OUTSIDE_ARENA_MARGIN`."""
        cp = _import_cupy()
        self._cp = cp
        self.xp = cp
        auto = isinstance(capacity, str) and capacity.strip().lower() == "auto"
        self.capacity = 0 if auto else parse_size(capacity)
        self.pinned_capacity = available_host_memory() if pinned_capacity is None \
            else parse_size(pinned_capacity)
        self.device_id = int(device_id)
        self._device = cp.cuda.Device(self.device_id)
        with self._device:
            free_start, total = cp.cuda.runtime.memGetInfo()  # (the context exists from here)
            self._warm_up()
            free, total = cp.cuda.runtime.memGetInfo()
            if auto:  # the free memory, less the libraries' margin, in whole MiB
                self.capacity = max(0, free - OUTSIDE_ARENA_MARGIN) >> 20 << 20
            #: Device bytes the libraries took when started (cuBLAS, the first modules).
            self.libraries_bytes = max(0, free_start - free)
            #: Device bytes in use before this device was made (the CUDA context, other
            #: processes).
            self.used_before = total - free_start
            if self.capacity + OUTSIDE_ARENA_MARGIN > free:
                most = max(0, free - OUTSIDE_ARENA_MARGIN)
                raise ValueError(
                    f"cuda:{self.device_id} capacity {format_size(self.capacity)} "
                    f"({self.capacity} bytes) leaves less than {format_size(OUTSIDE_ARENA_MARGIN)}"
                    f" of the device's free memory ({format_size(free)} of "
                    f"{format_size(total)}) for the CUDA libraries outside the arena (cuBLAS "
                    f"workspaces, kernel modules): ask for at most {format_size(most)} "
                    f"({most} bytes)")
            self._mem: Any = cp.cuda.Memory(self.capacity)
            self._free_after_arena = cp.cuda.runtime.memGetInfo()[0]
        self.total_bytes = total
        self.base_ptr: int = int(self._mem.ptr)
        self._pinned = _PinnedCounter()
        self._copy_engine: CudaCopyEngine | None = None
        #: (pinned buffer, event of the copy that last read it) per staging slot
        self._staging: list[tuple[np.ndarray | None, Any]] = [(None, None)] * STAGING_SLOTS
        self._next_slot = 0

    def _warm_up(self) -> None:
        """Start what every training step uses, so its device memory is taken before the
        arena: cuBLAS (handle, workspace, a GEMM kernel) and an elementwise and a reduction
        kernel of CuPy; their temporaries are given back to CuPy's pool and then freed."""
        cp = self._cp
        a = cp.ones((64, 64), cp.float32)
        b = a @ a
        float((b * 2).sum())
        del a, b
        cp.get_default_memory_pool().free_all_blocks()

    def outside_arena(self) -> dict[str, int]:
        """Device bytes this process holds beside the arena, as measured now
        (``cudaMemGetInfo``; other processes on the GPU show up as ``since_arena`` too):
        ``libraries_at_start`` (cuBLAS and modules started with the device), ``since_arena``
        (loaded or allocated since the arena: lazily loaded kernel modules, cuBLAS workspaces,
        CuPy's own pool), ``cupy_pool`` (CuPy's default pool: temporaries that escaped the
        arena), ``cupy_pinned_pool`` (host memory, pinned by CuPy's pool), and ``total``
        (libraries + since the arena)."""
        cp = self._cp
        with self._device:
            free, _ = cp.cuda.runtime.memGetInfo()
        since = max(0, self._free_after_arena - free)
        return {"libraries_at_start": self.libraries_bytes, "since_arena": since,
                "cupy_pool": int(cp.get_default_memory_pool().total_bytes()),
                "cupy_pinned_pool": int(cp.get_default_pinned_memory_pool().total_bytes()),
                "total": self.libraries_bytes + since}

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
        compute stream from a ring of :data:`STAGING_SLOTS` pinned staging buffers (kernels
        queued after it see the data; the host waits only when the slot's previous copy, four
        uploads ago, is still reading it). Arrays above :data:`STAGING_MAX_BYTES` go
        synchronously (``ndarray.set``)."""
        cp = self._cp
        host = np.array(src, dtype=dst.dtype, order="C", copy=None).reshape(dst.shape)
        nbytes = int(host.nbytes)
        if nbytes == 0:
            return
        if nbytes > STAGING_MAX_BYTES or not dst.flags.c_contiguous:
            dst.set(host)
            return
        with self._device:
            slot = self._next_slot
            self._next_slot = (slot + 1) % STAGING_SLOTS
            buf, done = self._staging[slot]
            if done is not None and not done.done:
                done.synchronize()  # the copy four uploads ago still reads this buffer
            if buf is None or buf.nbytes < nbytes:
                buf = None
                buf = self.host_empty((max(nbytes, 1 << 20),), np.uint8)
            stage = buf[:nbytes]
            stage[...] = host.reshape(-1).view(np.uint8)
            stream = cp.cuda.get_current_stream()
            dst.data.copy_from_host_async(stage.ctypes.data, nbytes, stream)
            done = cp.cuda.Event(disable_timing=True)
            done.record(stream)
            self._staging[slot] = (buf, done)

    def fetch_async(self, src: Any) -> CudaHostResult:
        """Queue a copy of ``src`` into pinned host memory on the compute stream (after the
        work that produces it); the host does not wait until :meth:`CudaHostResult.result`."""
        cp = self._cp
        if not src.flags.c_contiguous:
            src = cp.ascontiguousarray(src)
        host = self.host_empty(src.shape, src.dtype)
        nbytes = int(src.nbytes)
        if nbytes == 0:
            return CudaHostResult(host, None, None)
        with self._device:
            stream = cp.cuda.get_current_stream()
            src.data.copy_to_host_async(host.ctypes.data, nbytes, stream)
            done = cp.cuda.Event(disable_timing=True)
            done.record(stream)
        return CudaHostResult(host, done, src)

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
    """Within the block, CuPy's own allocations *on this thread* take arena bytes from
    ``allocate`` (``nbytes -> (offset, release)``; ``cupy.cuda.using_allocator``); the previous
    allocator is restored on exit and temporaries still alive then are released when CuPy
    frees them."""
    cp = device._cp
    base = device.base_ptr
    device_id = device.device_id

    def cupy_allocator(nbytes: int) -> Any:
        offset, release = allocate(nbytes)
        mem = cp.cuda.UnownedMemory(base + offset, nbytes, _Release(release), device_id)
        return cp.cuda.MemoryPointer(mem, 0)

    # per thread (CuPy's set_allocator is process-wide: other threads' temporaries would land
    # in this pool, which is not thread-safe; and it refuses to run inside using_allocator)
    with cp.cuda.using_allocator(cupy_allocator):
        yield


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

"""The CUDA device: with :mod:`.cuda_streams` (copies, step timers, fetches on CUDA streams and
events) and :mod:`.cuda_interop` (importing CuPy, routing its allocations), the only modules that
know CuPy, imported when a device is built. Their public names are re-exported here.

* The arena is one ``cupy.cuda.Memory(capacity)`` (a raw ``cudaMalloc``, so it never comes from
  CuPy's caching pool nor from an allocator routed to our own pool); views are ``cupy.ndarray``
  over ``MemoryPointer(arena, offset)``.
* Copies run on two non-blocking copy streams, one per direction; each returns a
  :class:`CudaCopyEvent` (the interface of :class:`~.copy_engine.CopyEvent`) built on two
  CUDA events.
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
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np

from ..ir.names import DeviceKind
from ..ir.units import format_size, parse_size
from .cuda_interop import (
    CUDA_INSTALL_HINT,
    _import_cupy,
    pool_allocator,
    route_allocations,
)
from .cuda_streams import (
    CudaCopyEngine,
    CudaCopyEvent,
    CudaHostResult,
    CudaStepTimer,
    StallProbe,
)
from .device import as_shape, available_host_memory, check_view

__all__ = ["CUDA_INSTALL_HINT", "CudaCopyEngine", "CudaCopyEvent", "CudaDevice", "CudaHostResult",
           "CudaStepTimer", "PinnedMemory", "StallProbe", "route_cupy_allocations"]

_NAN32 = 0x7FC00000

#: Host arrays up to this size go to the device through the pinned staging buffer.
STAGING_MAX_BYTES = 64 << 20


class PinnedMemory:
    """The device's pinned host memory (``cupy.cuda.alloc_pinned_memory``), bounded by
    ``capacity`` bytes; ``used``: the bytes handed out and not yet garbage collected."""

    def __init__(self, cp: Any, capacity: int) -> None:
        self._cp = cp
        self.capacity = capacity
        self.used = 0
        self._lock = threading.Lock()

    def empty(self, shape: Any, dtype: Any = np.float32) -> np.ndarray:
        """A NumPy array in pinned host memory; ``MemoryError`` beyond ``capacity``."""
        shape = as_shape(shape)
        dtype = np.dtype(dtype)
        count = math.prod(shape)
        nbytes = count * dtype.itemsize
        used = self.used
        if used + nbytes > self.capacity:
            raise MemoryError(
                f"pinned host memory exhausted: {format_size(nbytes)} ({nbytes} bytes) asked, "
                f"{format_size(used)} ({used} bytes) of {format_size(self.capacity)} "
                f"({self.capacity} bytes) in use; raise pinned_capacity")
        mem = self._cp.cuda.alloc_pinned_memory(max(nbytes, 1))
        root = np.frombuffer(mem, dtype, count)
        # Views of the returned array keep ``root`` alive, so the bytes are released only when
        # the last view is gone.
        with self._lock:
            self.used += nbytes
        weakref.finalize(root, self._release, nbytes)
        return root.reshape(shape)

    def _release(self, nbytes: int) -> None:
        with self._lock:
            self.used -= nbytes


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
    kind = DeviceKind.CUDA
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
        #: Pinned host memory (:meth:`host_empty`), bounded by ``pinned_capacity`` (default:
        #: the host's available memory).
        self.pinned = PinnedMemory(cp, available_host_memory() if pinned_capacity is None
                                   else parse_size(pinned_capacity))
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
        """A NumPy array in pinned host memory (:attr:`pinned`); ``MemoryError`` beyond
        ``pinned_capacity``."""
        return self.pinned.empty(shape, dtype)

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

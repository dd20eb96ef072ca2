"""What the CUDA device runs on its streams and events, apart from kernels: copies, step times,
fetched results.

* :class:`CudaCopyEngine` — copies between device and pinned host memory on two non-blocking
  streams, one per direction, each ordered after the compute queued before it; every copy
  returns a :class:`CudaCopyEvent` (the interface of :class:`~.copy_engine.CopyEvent`) built on
  two CUDA events, whose :meth:`~CudaCopyEvent.order_compute` makes later compute wait for it
  on the device and returns a :class:`StallProbe` timing that wait.
* :class:`CudaStepTimer` — per-step and per-iteration device times from events on the compute
  stream.
* :class:`CudaHostResult` — a device-to-host copy queued on the compute stream
  (:meth:`~.cuda_device.CudaDevice.fetch_async`), waited for only when read.

Everything here is handed the ``cupy`` module by the device (nothing imports CuPy).
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

import numpy as np

__all__ = ["CudaCopyEngine", "CudaCopyEvent", "CudaHostResult", "CudaStepTimer", "StallProbe"]


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
        #: Bytes of every copy queued so far (finished or not).
        self.total_bytes = 0
        #: Seconds the copies retired so far kept a copy stream busy (each copy's start to end
        #: event), and the bytes of those copies: :meth:`link_rate` divides the two.
        self.busy_s = 0.0
        self.retired_bytes = 0
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
            event = inflight.popleft()
            self.busy_s += event.elapsed_s or 0.0
            self.retired_bytes += event.nbytes

    def retired(self) -> tuple[int, float]:
        """``(bytes, busy seconds)`` of the copies that have completed, after retiring (without
        waiting) every finished copy at the head of the queue. A copy waited for with
        :meth:`CudaCopyEvent.wait` has completed but is only counted here once retired, so
        ``total_bytes / busy_s`` (bytes queued over time of copies retired) is not a rate."""
        self._retire()
        return self.retired_bytes, self.busy_s

    def link_rate(self) -> float | None:
        """Bytes per second over the copies that have completed (:meth:`retired`); ``None``
        before any has."""
        nbytes, busy = self.retired()
        return nbytes / busy if nbytes > 0 and busy > 0 else None

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

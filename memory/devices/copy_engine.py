"""Copy engines: how bytes move between a CPU or meta device's arena and host memory.

* :class:`CopyEngine` — one worker thread copying arrays in FIFO order (``np.copyto``
  releases the GIL), optionally throttled to an emulated link's rate.
* :class:`ImmediateCopyEngine` — the meta device's: nothing to copy, every copy done at once.

Both hand back a :class:`CopyEvent` per copy (``wait()``, ``done()``, ``elapsed_s``); the CUDA
device's copies (:mod:`.cuda_streams`) offer the same interface.
"""

from __future__ import annotations

import math
import queue
import threading
import time
import weakref
from typing import Any

import numpy as np

from ..ir.units import format_size

__all__ = ["CopyEngine", "CopyEvent", "ImmediateCopyEngine"]


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

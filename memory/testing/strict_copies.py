"""The strict test device's copies and fetches on its recorded streams
(:class:`~.stream_model.StreamModel`): a copy stream per direction, ordered after the compute
issued before it (unless the device's ``copy_waits_for_compute`` is off, to show the races that
prevents); events the host waits on (counted as host synchronisations) or the compute stream
waits on (:meth:`StrictCopyEvent.order_compute`, no host synchronisation). Pinned host buffers
are ranges of their own in the stream model (:func:`_host_range`), so a copy reading a buffer an
unfinished copy still writes is a race too.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .stream_model import StreamEvent
from .strict_array import StrictArray

__all__ = ["StrictCopyEngine", "StrictCopyEvent", "StrictHostResult"]

#: Host buffers' ranges in the stream model: their addresses moved above any arena offset.
_HOST_SPACE = 1 << 62


def _host_range(a: np.ndarray) -> tuple[tuple[int, int], ...]:
    """The bytes of a host array as a stream-model range (a space apart from the arena's)."""
    if a.size == 0:
        return ()
    lo, hi = np.lib.array_utils.byte_bounds(a)
    return ((_HOST_SPACE + lo, _HOST_SPACE + hi),)


class StrictCopyEvent:
    """A copy on the strict device's copy stream: ``wait()`` (host), ``order_compute()``."""

    def __init__(self, device: Any, nbytes: int, event: StreamEvent) -> None:
        self.nbytes = nbytes
        self._dev = device
        self._event = event
        self.elapsed_s = 0.0

    def done(self) -> bool:
        return False if not self._dev.copies_complete_at_once else True

    def wait(self, timeout: float | None = None) -> None:
        """The host waits for the copy."""
        self._dev.host_syncs += 1
        self._dev.streams.host_wait(self._event)

    def order_compute(self) -> None:
        """Later compute work waits for this copy on the device (no host synchronisation)."""
        self._dev.streams.wait_event("compute", self._event)


class StrictHostResult:
    """A fetch of :meth:`StrictCudaDevice.fetch_async`: ``ready()`` once the host has waited
    for its point of the compute stream, ``result()`` (a host synchronisation if not)."""

    def __init__(self, device: Any, host: np.ndarray, event: StreamEvent) -> None:
        self._dev, self._host, self._event = device, host, event

    def ready(self) -> bool:
        return self._dev.streams.host_reached(self._event)

    def result(self) -> np.ndarray:
        if not self.ready():
            self._dev.host_syncs += 1
            self._dev.streams.host_wait(self._event)
        return self._host


class StrictCopyEngine:
    """Copies on the recorded copy stream, ordered after the compute work issued before."""

    def __init__(self, device: Any) -> None:
        self._dev = device
        self.total_bytes = 0
        self.num_copies = 0
        self.busy_s = 0.0
        self.closed = False

    def copy_async(self, dst: Any, src: Any) -> StrictCopyEvent:
        """Queue ``dst[...] = src`` (one side a device array, the other pinned host memory)."""
        dev = self._dev
        if dst.shape != src.shape or dst.dtype != src.dtype:
            raise ValueError(f"copy needs arrays of the same shape and dtype, got dst "
                             f"{dst.shape} {dst.dtype} and src {src.shape} {src.dtype}")
        streams = dev.streams
        d_dev, s_dev = isinstance(dst, StrictArray), isinstance(src, StrictArray)
        if not (d_dev or s_dev):
            raise ValueError("a device copy needs at least one device array")
        stream = "h2d" if d_dev and not s_dev else "d2h"  # one copy stream per direction
        if dev.copy_waits_for_compute:
            streams.wait_event(stream, streams.record("compute"))
        streams.issue(stream, dev._ranges((src,)) if s_dev else _host_range(src),
                      dev._ranges((dst,)) if d_dev else _host_range(dst), f"a {stream} copy")
        np.copyto(dst._a if d_dev else dst, src._a if s_dev else src)
        self.total_bytes += int(dst.nbytes)
        self.num_copies += 1
        return StrictCopyEvent(dev, int(dst.nbytes), streams.record(stream))

    def synchronize(self) -> None:
        self._dev.host_syncs += 1
        for stream in ("h2d", "d2h"):
            self._dev.streams.host_wait(self._dev.streams.record(stream))

    def close(self) -> None:
        self.closed = True

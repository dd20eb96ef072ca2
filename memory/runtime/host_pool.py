"""A bounded pool of host buffers for swapped tensors, reused across iterations.

Buffers are kept by size once allocated (pinned memory on cuda is expensive to allocate), so
after the first iteration offloading allocates nothing. ``capacity`` bounds the bytes held;
a request beyond it raises :class:`HostMemoryExceeded` with the numbers.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..ir.units import format_size


class HostMemoryExceeded(MemoryError):
    """The host pool's bound is too small for the bytes being offloaded."""


class HostPool:
    """Host byte buffers from ``device.host_empty`` (or shape-only buffers on meta).

    ``acquire(nbytes)`` returns a uint8 buffer of exactly ``nbytes``; ``release(buf)`` keeps it
    for reuse. Stats: ``in_use_bytes``, ``peak_bytes`` (the most in use at once),
    ``held_bytes`` (allocated, in use or idle) and ``capacity``.
    """

    def __init__(self, device: Any, capacity: int | None = None) -> None:
        self.device = device
        self.capacity = capacity
        self._idle: dict[int, list[Any]] = {}
        self.in_use_bytes = 0
        self.peak_bytes = 0
        self.held_bytes = 0
        self.num_allocations = 0

    def acquire(self, nbytes: int, tag: str = "") -> Any:
        idle = self._idle.get(nbytes)
        if idle:
            buf = idle.pop()
        else:
            if self.capacity is not None and self.held_bytes + nbytes > self.capacity:
                # drop idle buffers of other sizes before giving up
                for size, bufs in list(self._idle.items()):
                    while bufs and self.held_bytes + nbytes > self.capacity:
                        bufs.pop()
                        self.held_bytes -= size
                if self.held_bytes + nbytes > self.capacity:
                    raise HostMemoryExceeded(
                        f"host pool bound {format_size(self.capacity)} ({self.capacity:,} B) is "
                        f"too small: offloading {tag or 'a tensor'} needs {nbytes:,} B more with "
                        f"{self.in_use_bytes:,} B already holding offloaded tensors; raise "
                        "--host-memory or swap fewer tensors"
                    )
            buf = self.device.host_empty((nbytes,), np.uint8)
            self.held_bytes += nbytes
            self.num_allocations += 1
        self.in_use_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.in_use_bytes)
        return buf

    def release(self, buf: Any) -> None:
        n = int(buf.nbytes)
        self.in_use_bytes -= n
        self._idle.setdefault(n, []).append(buf)

    def stats(self) -> dict[str, int | None]:
        return {"host_in_use_bytes": self.in_use_bytes, "host_peak_bytes": self.peak_bytes,
                "host_held_bytes": self.held_bytes, "host_capacity": self.capacity}

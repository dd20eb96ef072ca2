"""The pool's errors, the out-of-memory report among them (re-exported by :mod:`.pool`)."""

from __future__ import annotations

from typing import Any

from ..ir.units import format_size

__all__ = [
    "DeviceOutOfMemory",
    "DoubleFreeError",
    "ForeignBlockError",
    "PlacementError",
    "PoolError",
    "UseAfterFreeError",
]


class PoolError(RuntimeError):
    """Misuse of the pool (double free, foreign block, use after free)."""


class DoubleFreeError(PoolError):
    """A block was freed twice."""


class ForeignBlockError(PoolError):
    """A block was handed to a pool that did not allocate it."""


class UseAfterFreeError(PoolError):
    """A freed block was used."""


class PlacementError(ValueError):
    """A fixed offset that does not lie within a free region, or is not aligned."""


class DeviceOutOfMemory(MemoryError):
    """No free region fits the request. The pool is left exactly as it was.

    Attributes: ``requested`` (rounded bytes), ``nbytes`` (as asked), ``tag``, ``category``,
    ``capacity``, ``allocated``, ``free``, ``largest_free_block``, ``fragmentation``,
    ``largest_live`` (list of ``(tag, category, bytes)``, largest first, at most 5).
    """

    def __init__(self, *, requested: int, nbytes: int, tag: str, category: str, device: str,
                 capacity: int, allocated: int, free: int, largest_free_block: int,
                 fragmentation: float, num_live: int,
                 largest_live: list[tuple[str, str, int]], offset: int | None = None) -> None:
        self._kwargs = dict(requested=requested, nbytes=nbytes, tag=tag, category=category,
                            device=device, capacity=capacity, allocated=allocated, free=free,
                            largest_free_block=largest_free_block, fragmentation=fragmentation,
                            num_live=num_live, largest_live=largest_live, offset=offset)
        self.requested = requested
        self.nbytes = nbytes
        self.tag = tag
        self.category = category
        self.capacity = capacity
        self.allocated = allocated
        self.free = free
        self.largest_free_block = largest_free_block
        self.fragmentation = fragmentation
        self.largest_live = largest_live
        self.offset = offset

        def sz(n: int) -> str:
            return f"{format_size(n)} ({n} bytes)"

        where = "" if offset is None else f" at fixed offset {offset}"
        lines = [
            f"out of memory on the {device} device: cannot allocate {sz(requested)}{where} for "
            f"{tag or '<untagged>'!r} ({category})",
            f"  capacity            {sz(capacity)}",
            f"  in use              {sz(allocated)} in {num_live} blocks",
            f"  free                {sz(free)}",
            f"  largest free block  {sz(largest_free_block)}",
            f"  fragmentation       {fragmentation:.3f}",
        ]
        if largest_live:
            lines.append("  largest live blocks:")
            for t, c, n in largest_live:
                lines.append(f"    {t or '<untagged>'} ({c}): {sz(n)}")
        lines.append("  raise the device memory, lower the batch size, or enable a memory "
                     "strategy (reuse, swap, recompute, ...)")
        super().__init__("\n".join(lines))

    def __reduce__(self) -> tuple:
        return _rebuild_oom, (self._kwargs,)


def _rebuild_oom(kwargs: dict[str, Any]) -> DeviceOutOfMemory:
    return DeviceOutOfMemory(**kwargs)

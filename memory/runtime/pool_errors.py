"""The pool's errors, the out-of-memory report among them (re-exported by :mod:`.pool`)."""

from __future__ import annotations

from dataclasses import dataclass

from ..ir.units import format_size

__all__ = [
    "DeviceOutOfMemory",
    "DoubleFreeError",
    "FailedRequest",
    "ForeignBlockError",
    "PlacementError",
    "PoolFigures",
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


@dataclass(frozen=True)
class FailedRequest:
    """The allocation that did not fit: ``requested`` (rounded bytes), ``nbytes`` (as asked),
    its tag and category, and the fixed ``offset`` asked for (``None``: anywhere)."""

    requested: int
    nbytes: int
    tag: str
    category: str
    offset: int | None = None


@dataclass(frozen=True)
class PoolFigures:
    """The pool when the request failed: its device's name, capacity, bytes in use in
    ``num_live`` blocks, free bytes, the largest free block, fragmentation, and the largest
    live blocks (``(tag, category, bytes)``, largest first, at most 5)."""

    device: str
    capacity: int
    allocated: int
    free: int
    largest_free_block: int
    fragmentation: float
    num_live: int
    largest_live: list[tuple[str, str, int]]


class DeviceOutOfMemory(MemoryError):
    """No free region fits the request. The pool is left exactly as it was.

    Attributes: ``request`` (:class:`FailedRequest`), ``figures`` (:class:`PoolFigures`), and
    their fields ``requested``, ``nbytes``, ``tag``, ``category``, ``offset``, ``capacity``,
    ``allocated``, ``free``, ``largest_free_block``, ``fragmentation``, ``largest_live``.
    """

    def __init__(self, request: FailedRequest, figures: PoolFigures) -> None:
        self.request = request
        self.figures = figures
        self.requested = request.requested
        self.nbytes = request.nbytes
        self.tag = request.tag
        self.category = request.category
        self.offset = request.offset
        self.capacity = figures.capacity
        self.allocated = figures.allocated
        self.free = figures.free
        self.largest_free_block = figures.largest_free_block
        self.fragmentation = figures.fragmentation
        self.largest_live = figures.largest_live
        super().__init__(_message(request, figures))

    def __reduce__(self) -> tuple:
        return DeviceOutOfMemory, (self.request, self.figures)


def _message(request: FailedRequest, figures: PoolFigures) -> str:
    """The out-of-memory report: the request, the pool's figures and what to do."""

    def sz(n: int) -> str:
        return f"{format_size(n)} ({n} bytes)"

    where = "" if request.offset is None else f" at fixed offset {request.offset}"
    lines = [
        f"out of memory on the {figures.device} device: cannot allocate "
        f"{sz(request.requested)}{where} for {request.tag or '<untagged>'!r} "
        f"({request.category})",
        f"  capacity            {sz(figures.capacity)}",
        f"  in use              {sz(figures.allocated)} in {figures.num_live} blocks",
        f"  free                {sz(figures.free)}",
        f"  largest free block  {sz(figures.largest_free_block)}",
        f"  fragmentation       {figures.fragmentation:.3f}",
    ]
    if figures.largest_live:
        lines.append("  largest live blocks:")
        for t, c, n in figures.largest_live:
            lines.append(f"    {t or '<untagged>'} ({c}): {sz(n)}")
    lines.append("  raise the device memory, lower the batch size, or enable a memory "
                 "strategy (reuse, swap, recompute, ...)")
    return "\n".join(lines)

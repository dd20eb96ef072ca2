"""The heap pool: blocks of one device arena, placed by best-fit, first-fit or fixed offsets.

Layout. The arena ``[0, capacity)`` is covered by address-ordered chunks: live blocks, interior
free chunks, and the *top* region ``[top, capacity)`` where ``top`` is the highest end of any
live block (dlmalloc's wilderness chunk). A request is rounded up to ``alignment`` bytes (a
zero-byte request gets one ``alignment`` block) and served from the best (smallest, then lowest
address) interior free chunk that fits — or the lowest-address one under ``first_fit`` — and
only when none fits, from the bottom of the top region. The chosen chunk is split; a freed block
merges with its free neighbours, and with the top region when it touches it. Because the top
region is never searched like an interior chunk, placement never depends on the capacity: a meta
dry run with unlimited capacity places every block at the same offset as a real run, and only
the out-of-memory point depends on the capacity (it is exactly ``reserved_bytes.peak``).

The errors live in :mod:`.pool_errors`, the categories and the summary table in
:mod:`.pool_report`, the counters and what the pool reports from them
(``stats``, ``stats_at_peak``, ``memory_summary``, ...) in :mod:`.pool_stats`, a base class of
:class:`Pool`.

The pool is not thread-safe; :meth:`Pool.free_deferred` is the one call that may come from a
finalizer or another thread.
"""

from __future__ import annotations

import heapq
import operator
from bisect import bisect_left, bisect_right, insort
from collections.abc import Iterable
from typing import Any

import numpy as np

from ..devices.traits import device_traits
from ..ir.units import ALLOCATION_UNIT, format_size
from .pool_errors import (
    DeviceOutOfMemory,
    DoubleFreeError,
    FailedRequest,
    ForeignBlockError,
    PlacementError,
    PoolError,
    PoolFigures,
    UseAfterFreeError,
)
from .pool_report import CATEGORIES
from .pool_stats import PoolStatistics

__all__ = [
    "CATEGORIES",
    "Block",
    "DeviceOutOfMemory",
    "DoubleFreeError",
    "ForeignBlockError",
    "PlacementError",
    "Pool",
    "PoolError",
    "UseAfterFreeError",
]

POLICIES = ("best_fit", "first_fit")


class Block:
    """A live (or freed) region of the arena handed out by :meth:`Pool.allocate`."""

    __slots__ = ("offset", "size", "nbytes", "tag", "category", "freed", "pool")

    def __init__(self, pool: Pool, offset: int, size: int, nbytes: int, tag: str,
                 category: str) -> None:
        self.pool = pool
        self.offset = offset
        self.size = size  # rounded up to the pool's alignment
        self.nbytes = nbytes  # as requested
        self.tag = tag
        self.category = category
        self.freed = False

    @property
    def end(self) -> int:
        return self.offset + self.size

    def view(self, shape: Any, dtype: Any = np.float32) -> Any:
        """The block as a device array of ``shape``/``dtype`` (at most ``nbytes`` bytes)."""
        if self.freed:
            raise UseAfterFreeError(f"use after free: {self!r}")
        return self.pool.device.view(self.offset, self.nbytes, shape, dtype)

    def __repr__(self) -> str:
        state = ", freed" if self.freed else ""
        return (f"Block({self.tag or '<untagged>'!r}, {self.category}, offset={self.offset}, "
                f"size={self.size}, nbytes={self.nbytes}{state})")


class Pool(PoolStatistics):
    """A heap over ``device``'s arena. See the module docstring for the placement rules.

    ``policy`` is ``"best_fit"`` or ``"first_fit"``; ``alignment`` the allocation unit, a power
    of two (offsets and sizes are multiples of it; programs must be lowered for it);
    ``debug=True`` poisons with float32 NaN every byte not in a live block: freed blocks when
    freed, and arena bytes never handed out before when a block first reaches them (the
    device's own initial contents, often zeros, would hide a read before the first write).
    """

    def __init__(self, device: Any, policy: str = "best_fit", alignment: int = ALLOCATION_UNIT,
                 debug: bool = False) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; valid policies: {', '.join(POLICIES)}")
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a positive power of two, got {alignment!r}")
        self.device = device
        self.policy = policy
        self.alignment = alignment
        self.debug = debug
        self.capacity: int = int(device.capacity)
        self._mask = alignment - 1
        self._best_fit = policy == "best_fit"
        self._poison = debug and device_traits(device).has_storage
        #: With poisoning: arena bytes below this were poisoned on first touch (or are live).
        self._poisoned_to = 0
        # Chunks. Live blocks by offset; interior free chunks by start (-> size) and by end
        # (-> start); a (size, offset) index for best fit and an offset index for first fit and
        # fixed placement. Everything from ``_top`` to the capacity is the top region.
        self._live: dict[int, Block] = {}
        self._free_start: dict[int, int] = {}
        self._free_end: dict[int, int] = {}
        self._by_size: list[tuple[int, int]] = []
        self._by_addr: list[int] = []
        self._top = 0
        self._deferred: list[Block] = []
        self._init_statistics()

    # ------------------------------------------------------------------ allocate

    def allocate(self, nbytes: int, tag: str = "", category: str = "workspace",
                 offset: int | None = None) -> Block:
        """Allocate at least ``nbytes`` bytes; place at ``offset`` if given (static plans).

        Raises :class:`DeviceOutOfMemory` when nothing fits, :class:`PlacementError` when a
        fixed offset is not aligned or not inside a free region, ``ValueError`` for an unknown
        category or a negative size.
        """
        if self._deferred:
            self._drain_deferred()
        if category not in self._cat_cur:
            raise ValueError(f"unknown category {category!r}; valid categories: "
                             f"{', '.join(CATEGORIES)}")
        if type(nbytes) is not int:
            nbytes = operator.index(nbytes)
        if nbytes < 0:
            raise ValueError(f"cannot allocate a negative number of bytes ({nbytes})")
        mask = self._mask
        size = ((nbytes + mask) & ~mask) or self.alignment
        if offset is not None:
            off = self._take_at(offset, size, nbytes, tag, category)
        elif self._best_fit:
            by_size = self._by_size
            i = bisect_left(by_size, (size, -1))
            if i < len(by_size):
                csize, off = by_size.pop(i)
                self._take_interior(off, csize, size)
            else:
                off = self._take_top(size, nbytes, tag, category)
        else:
            free_start = self._free_start
            for off in self._by_addr:
                csize = free_start[off]
                if csize >= size:
                    del self._by_size[bisect_left(self._by_size, (csize, off))]
                    self._take_interior(off, csize, size)
                    break
            else:
                off = self._take_top(size, nbytes, tag, category)
        if self._poison and off + size > self._poisoned_to:
            self._poison_fresh(off + size)
        block = Block(self, off, size, nbytes, tag, category)
        self._live[off] = block
        self._num_allocs += 1
        self._requested += nbytes
        a = self._allocated + size
        self._allocated = a
        if a > self._allocated_peak:
            self._allocated_peak = a
            self._peak_pending = True
        c = self._cat_cur[category] + size
        self._cat_cur[category] = c
        if c > self._cat_peak[category]:
            self._cat_peak[category] = c
        if self._top > self._reserved_peak:
            self._reserved_peak = self._top
        return block

    def _poison_fresh(self, end: int) -> None:
        # Bytes up to ``end`` never handed out before (a fixed offset may leave a gap below the
        # block: it is poisoned too, so every byte below ``_poisoned_to`` not in a live block
        # holds NaN).
        self.device.fill(self._poisoned_to, end - self._poisoned_to, float("nan"))
        self._poisoned_to = end

    def _take_interior(self, off: int, csize: int, size: int) -> None:
        # The chunk (off, csize) is already out of _by_size; carve ``size`` from its start.
        del self._free_start[off]
        end = off + csize
        if csize == size:
            del self._free_end[end]
            by_addr = self._by_addr
            del by_addr[bisect_left(by_addr, off)]
        else:
            rest = off + size
            rsize = csize - size
            self._free_start[rest] = rsize
            self._free_end[end] = rest
            by_addr = self._by_addr
            by_addr[bisect_left(by_addr, off)] = rest  # same rank among free chunks
            insort(self._by_size, (rsize, rest))

    def _take_top(self, size: int, nbytes: int, tag: str, category: str) -> int:
        off = self._top
        if off + size > self.capacity:
            raise self._oom(size, nbytes, tag, category)
        self._top = off + size
        return off

    def _take_at(self, offset: int, size: int, nbytes: int, tag: str, category: str) -> int:
        offset = operator.index(offset)
        if offset < 0 or offset & self._mask:
            raise PlacementError(f"fixed offset {offset} for {tag!r} must be a non-negative "
                                 f"multiple of the alignment {self.alignment}")
        end = offset + size
        top = self._top
        if offset >= top:
            if end > self.capacity:
                raise self._oom(size, nbytes, tag, category, offset)
            if offset > top:
                self._add_free(top, offset - top)
            self._top = end
            return offset
        by_addr = self._by_addr
        j = bisect_right(by_addr, offset) - 1
        if j >= 0:
            c_off = by_addr[j]
            c_size = self._free_start[c_off]
            c_end = c_off + c_size
            if end <= c_end:
                self._remove_free(c_off, c_size)
                if c_off < offset:
                    self._add_free(c_off, offset - c_off)
                if end < c_end:
                    self._add_free(end, c_end - end)
                return offset
        clash = [b for b in self._live.values() if b.offset < end and offset < b.offset + b.size]
        raise PlacementError(
            f"cannot place {tag!r} ({size} bytes) at fixed offset {offset}: bytes "
            f"[{offset}, {end}) are not free; they overlap " + ", ".join(map(repr, clash[:3])))

    # ------------------------------------------------------------------ free

    def free(self, block: Block) -> None:
        """Return ``block`` to the pool (merging with free neighbours); poison it in debug mode."""
        if self._deferred:
            self._drain_deferred()
        self._free(block)

    def free_deferred(self, block: Block) -> None:
        """Queue ``block`` to be freed at the pool's next call. Safe from finalizers/threads."""
        self._deferred.append(block)

    def _drain_deferred(self) -> None:
        deferred = self._deferred
        while deferred:
            self._free(deferred.pop(0))

    def _free(self, block: Block) -> None:
        if block.pool is not self:
            raise ForeignBlockError(f"{block!r} belongs to another pool")
        if block.freed:
            raise DoubleFreeError(f"double free of {block!r}")
        if self._peak_pending:
            self._take_peak_snapshot()
        off = block.offset
        size = block.size
        end = off + size
        del self._live[off]
        block.freed = True
        self._num_frees += 1
        self._allocated -= size
        self._requested -= block.nbytes
        self._cat_cur[block.category] -= size
        if self._poison:
            self.device.fill(off, size, float("nan"))
        free_end = self._free_end
        free_start = self._free_start
        by_size = self._by_size
        start = off
        prev = free_end.pop(off, None)
        if prev is not None:  # merge with the free chunk below
            psize = free_start.pop(prev)
            del by_size[bisect_left(by_size, (psize, prev))]
            start = prev
        if end == self._top:  # merge into the top region
            if prev is not None:
                by_addr = self._by_addr
                del by_addr[bisect_left(by_addr, prev)]
            self._top = start
            return
        nsize = free_start.pop(end, None)
        if nsize is not None:  # merge with the free chunk above
            new_end = end + nsize
            del by_size[bisect_left(by_size, (nsize, end))]
            by_addr = self._by_addr
            i = bisect_left(by_addr, end)
            if prev is None:
                by_addr[i] = start  # same rank among free chunks
            else:
                del by_addr[i]
            end = new_end
        elif prev is None:
            insort(self._by_addr, start)
        free_start[start] = end - start
        free_end[end] = start
        insort(by_size, (end - start, start))

    # ------------------------------------------------------------------ chunk helpers

    def _add_free(self, off: int, size: int) -> None:
        self._free_start[off] = size
        self._free_end[off + size] = off
        insort(self._by_size, (size, off))
        insort(self._by_addr, off)

    def _remove_free(self, off: int, size: int) -> None:
        del self._free_start[off]
        del self._free_end[off + size]
        del self._by_size[bisect_left(self._by_size, (size, off))]
        del self._by_addr[bisect_left(self._by_addr, off)]

    def _oom(self, size: int, nbytes: int, tag: str, category: str,
             offset: int | None = None) -> DeviceOutOfMemory:
        self._num_ooms += 1
        largest = self._largest_free()
        top = heapq.nlargest(5, self._live.values(), key=lambda b: b.size)
        return DeviceOutOfMemory(
            FailedRequest(requested=size, nbytes=nbytes, tag=tag, category=category,
                          offset=offset),
            PoolFigures(device=device_traits(self.device).name, capacity=self.capacity,
                        allocated=self._allocated, free=self.capacity - self._allocated,
                        largest_free_block=largest, fragmentation=self._fragmentation(largest),
                        num_live=len(self._live),
                        largest_live=[(b.tag, b.category, b.size) for b in top]))

    # ------------------------------------------------------------------ blocks and chunks

    def live_blocks(self) -> list[Block]:
        """Live blocks in address order."""
        return [self._live[o] for o in sorted(self._live)]

    def free_chunks(self) -> list[tuple[int, int]]:
        """Interior free chunks as ``(offset, size)`` in address order (the top region excluded)."""
        return [(o, self._free_start[o]) for o in self._by_addr]

    def check_invariants(self) -> None:
        """Assert the heap's structure (for tests); raises ``AssertionError`` on corruption."""
        chunks = [(b.offset, b.size, True) for b in self._live.values()]
        chunks += [(o, n, False) for o, n in self._free_start.items()]
        chunks.sort()
        pos = 0
        prev_free = False
        allocated = 0
        for off, size, live in chunks:
            assert off == pos, f"gap or overlap at {pos}: next chunk starts at {off}"
            assert off % self.alignment == 0 and size % self.alignment == 0 and size > 0, \
                f"misaligned chunk ({off}, {size})"
            assert not (prev_free and not live), f"two adjacent free chunks at {off}"
            if live:
                b = self._live[off]
                assert not b.freed and b.pool is self and b.size >= b.nbytes
                allocated += size
            prev_free = not live
            pos = off + size
        assert pos == self._top, f"chunks end at {pos} but top is {self._top}"
        assert not prev_free, "a free chunk touches the top region"
        assert self._top <= self.capacity, "top beyond capacity"
        assert allocated == self._allocated, "allocated counter out of sync"
        assert allocated + sum(self._free_start.values()) + (self.capacity - self._top) \
            == self.capacity
        assert sum(self._cat_cur.values()) == allocated
        assert self._by_size == sorted((n, o) for o, n in self._free_start.items())
        assert self._by_addr == sorted(self._free_start)
        assert self._free_end == {o + n: o for o, n in self._free_start.items()}

    def __repr__(self) -> str:
        return (f"Pool({self.device!r}, policy={self.policy!r}, "
                f"allocated={format_size(self._allocated)}, live={len(self._live)})")


def replay(pool: Pool, trace: Iterable[tuple]) -> list[int]:
    """Run ``("alloc", key, nbytes, tag, category)`` / ``("free", key)`` events; return offsets.

    A helper for dry runs, tests and benchmarks: the offsets of the allocations in order.
    """
    blocks: dict[Any, Block] = {}
    offsets = []
    for ev in trace:
        if ev[0] == "alloc":
            _, key, nbytes, tag, category = ev
            b = pool.allocate(nbytes, tag, category)
            blocks[key] = b
            offsets.append(b.offset)
        else:
            pool.free(blocks.pop(ev[1]))
    return offsets

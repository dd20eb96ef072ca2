"""The memory runtime: carries out a plan's actions against a pool, tensor by tensor.

It owns the residency of every non-persistent tensor of one iteration — on device, offloading,
on host, prefetching, cached — hands the executor typed views of resident tensors only, moves
swapped blocks through the device's copy engine, and records where the peak happened and what
swapping cost (bytes moved, stall time, cache hits and misses).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .liveness import root_of
from .plan import Action, Alloc, Await, Free, Offload, Plan, Prefetch, Release
from .pool import DeviceOutOfMemory, PlacementError
from .program import Program


def tensor_info(program: Program) -> list[tuple[int, tuple[int, ...], np.dtype]]:
    """(aligned bytes, shape, dtype) of every tensor (compute once per program and pass it to
    every :class:`MemoryRuntime` of that program)."""
    return [(program.block_size(t.nbytes), t.shape, np.dtype(t.dtype)) for t in program.tensors]


class TensorNotResident(RuntimeError):
    """A step asked for a tensor that is not on the device (never allocated, freed, offloaded,
    or still being prefetched)."""


@dataclass
class SwapStats:
    """What swapping did during one iteration."""

    offloaded_bytes: int = 0
    prefetched_bytes: int = 0
    stall_s: float = 0.0
    cache_hits: int = 0
    cache_misses: int = 0
    evictions: int = 0
    host_peak_bytes: int = 0

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class _Swapped:
    host: Any = None
    d2h: Any = None
    h2d: Any = None
    state: str = "offloading"  # offloading | cached | on_host | prefetching
    nbytes: int = 0  # the block's size (an encoded stash may be larger than planned)
    shapes: dict[int, tuple[int, ...]] = field(default_factory=dict)


class MemoryRuntime:
    """Apply plan actions on ``pool``; ``position`` is the step being run (-1 before the first,
    ``len(steps)`` after the last), used to say where the peak occurred. ``host_pool`` holds
    offloaded tensors (needed only by plans that swap)."""

    def __init__(self, pool: Any, program: Program, plan: Plan, host_pool: Any = None,
                 poison_offloaded: bool = False,
                 info: list[tuple[int, tuple[int, ...], np.dtype]] | None = None) -> None:
        if program.alignment != pool.alignment:
            raise ValueError(f"the program was planned for {program.alignment}-byte blocks but "
                             f"the pool allocates {pool.alignment}-byte blocks")
        self.pool = pool
        self.program = program
        self.plan = plan
        self.host_pool = host_pool
        self.poison_offloaded = poison_offloaded
        self.blocks: dict[int, Any] = {}
        self.arrays: dict[int, Any] = {}
        self.alive: dict[int, set[int]] = {}  # root -> alias members with a view
        self.swapped: dict[int, _Swapped] = {}
        self.cached: OrderedDict[int, None] = OrderedDict()  # LRU order of cached roots
        self.position = -1
        self.peak_bytes = -1
        self.peak_position = -1
        self.peak_live: list[int] = []
        self._peak_pending = False
        self.info = info if info is not None else tensor_info(program)
        self.fallbacks: list[str] = []
        self.reallocs = 0
        self.kept_for_backward: dict[str, int] = {}
        self.swap_stats = SwapStats()
        #: With ``record=True``: (time, step, op, category, byte delta, tensor) per block event.
        self.events: list[tuple] | None = None

    # ------------------------------------------------------------------ actions
    def apply(self, action: Action) -> None:
        """Carry out one plan action (see :mod:`.plan`)."""
        if isinstance(action, Alloc):
            self.alloc(action.tensor, action.offset)
        elif isinstance(action, Free):
            self.free(action.tensor)
        elif isinstance(action, Offload):
            self.offload(action.tensor)
        elif isinstance(action, Release):
            self.release(action.tensor)
        elif isinstance(action, Prefetch):
            self.prefetch(action.tensor, action.offset)
        elif isinstance(action, Await):
            self.await_(action.tensor)
        else:
            raise TypeError(f"memory runtime cannot carry out {action!r}: not a plan action")

    def _allocate(self, tid: int, offset: int = -1, size: int = 0) -> Any:
        """A pool block for ``tid`` (of ``size`` bytes if given, else the planned size); under
        pressure, evicts cached blocks (LRU first)."""
        t = self.program.tensors[tid]
        planned = self.info[tid][0]
        if size and size != planned:
            offset = -1  # not the planned block: the pool places it
        size = size or planned
        while True:
            try:
                if offset >= 0:
                    try:
                        return self.pool.allocate(size, tag=t.name, category=t.category,
                                                  offset=offset)
                    except PlacementError as e:
                        # the planned offset is taken: say so and let the pool place it
                        self.fallbacks.append(f"{t.name}: {e}")
                        offset = -1
                return self.pool.allocate(size, tag=t.name, category=t.category)
            except DeviceOutOfMemory:
                if not self.cached:
                    raise
                self._evict(next(iter(self.cached)))

    def _record(self, op: str, blk: Any, tid: int) -> None:
        if self.events is not None:
            t = self.program.tensors[tid]
            delta = blk.size if op == "alloc" else -blk.size
            self.events.append((time.perf_counter(), self.position, op, t.category, delta,
                                t.name))

    def note_kept_for_backward(self) -> None:
        """Record what is on device as the backward pass begins, by category (the feature
        maps, stashes and encoded forms kept for backward)."""
        kept: dict[str, int] = {}
        for tid, blk in self.blocks.items():
            if tid in self.swapped and self.swapped[tid].state != "cached":
                continue
            cat = self.program.tensors[tid].category
            kept[cat] = kept.get(cat, 0) + blk.size
        self.kept_for_backward = kept

    def _note_peak(self) -> None:
        current = self.pool.allocated_bytes
        if current > self.peak_bytes:
            self.peak_bytes = current
            self.peak_position = self.position
            self._peak_pending = True  # what is live now is listed before the next free

    def snapshot_peak(self) -> None:
        """List the blocks live at the peak (done lazily: the peak state lasts until the next
        free, so the list is taken then, or when asked)."""
        if self._peak_pending:
            self.peak_live = list(self.blocks)
            self._peak_pending = False

    def alloc(self, tid: int, offset: int = -1) -> None:
        _, shape, dtype = self.info[tid]
        if tid in self.plan.aliases:
            root = root_of(self.plan.aliases, tid)
            self.alive.setdefault(root, set()).add(tid)
            if root in self.swapped:
                return  # the view appears when the block is back on device
            self.arrays[tid] = self.blocks[root].view(shape, dtype)
            return
        blk = self._allocate(tid, offset)
        if self.events is not None:
            self._record("alloc", blk, tid)
        self.blocks[tid] = blk
        self.arrays[tid] = blk.view(shape, dtype)
        self._note_peak()

    def realloc(self, tid: int, nbytes: int) -> None:
        """Replace ``tid``'s block by one of ``nbytes`` (an encoded stash larger than planned);
        the contents are not kept."""
        self.snapshot_peak()
        old = self.blocks.pop(tid)
        self._record("free", old, tid)
        self.pool.free(old)
        blk = self.pool.allocate(self.program.block_size(nbytes),
                                 tag=self.program.tensors[tid].name,
                                 category=self.program.tensors[tid].category)
        self._record("alloc", blk, tid)
        self.blocks[tid] = blk
        self.arrays[tid] = blk.view((int(nbytes),), np.uint8)
        self.reallocs += 1
        self._note_peak()

    def free(self, tid: int) -> None:
        self.snapshot_peak()
        self.arrays.pop(tid, None)
        if tid in self.plan.aliases:
            self.alive.get(root_of(self.plan.aliases, tid), set()).discard(tid)
            return
        sw = self.swapped.pop(tid, None)
        if sw is not None:
            self._drop_host(sw)
            self.cached.pop(tid, None)
        blk = self.blocks.pop(tid, None)
        if blk is None:
            if sw is not None:
                return
            raise TensorNotResident(f"free of {self.program.tensors[tid].name}: not allocated")
        self._record("free", blk, tid)
        self.pool.free(blk)

    # ------------------------------------------------------------------ swapping
    def _members(self, root: int) -> list[int]:
        return [root, *sorted(self.alive.get(root, ()))]

    def offload(self, root: int) -> None:
        """Start copying ``root``'s block to host; its views disappear until it is back."""
        blk = self.blocks[root]
        nbytes = blk.size
        host = self.host_pool.acquire(nbytes, self.program.tensors[root].name)
        engine = self.pool.device.copy_engine
        ev = engine.copy_async(host, blk.view((nbytes,), np.uint8))
        shapes = {}
        for m in self._members(root):
            a = self.arrays.pop(m, None)
            if a is not None:
                shapes[m] = tuple(a.shape)
        self.swapped[root] = _Swapped(host=host, d2h=ev, nbytes=nbytes, shapes=shapes)
        self.swap_stats.offloaded_bytes += nbytes
        self.swap_stats.host_peak_bytes = max(self.swap_stats.host_peak_bytes,
                                              self.host_pool.in_use_bytes)

    def _wait(self, ev: Any) -> None:
        if ev is not None and not ev.done():
            t0 = time.perf_counter()
            ev.wait()
            self.swap_stats.stall_s += time.perf_counter() - t0
        elif ev is not None:
            ev.wait()  # re-raises a failed copy

    def release(self, root: int) -> None:
        """The device block of an offloaded tensor may go: wait for its copy (usually done),
        then free it — or keep it cached when the plan caches."""
        sw = self.swapped[root]
        self._wait(sw.d2h)
        if self.plan.cache:
            sw.state = "cached"
            self.cached[root] = None
            return
        self._free_swapped_block(root)
        sw.state = "on_host"

    def _free_swapped_block(self, root: int) -> None:
        self.snapshot_peak()
        blk = self.blocks.pop(root)
        if self.poison_offloaded and getattr(self.pool.device, "has_storage", False):
            self.pool.device.fill(blk.offset, blk.size, float("nan"))
        self._record("free", blk, root)
        self.pool.free(blk)

    def _evict(self, root: int) -> None:
        self.cached.pop(root)
        self._free_swapped_block(root)
        self.swapped[root].state = "on_host"
        self.swap_stats.evictions += 1

    def prefetch(self, root: int, offset: int = -1) -> None:
        """Bring ``root`` back: free if still cached on device, else allocate and copy."""
        sw = self.swapped[root]
        if sw.state == "cached":
            self.cached.pop(root)
            sw.state = "prefetching"
            sw.h2d = None
            self.swap_stats.cache_hits += 1
            return
        if self.plan.cache:
            self.swap_stats.cache_misses += 1
        blk = self._allocate(root, offset, sw.nbytes)
        self._record("alloc", blk, root)
        self.blocks[root] = blk
        self._note_peak()
        nbytes = sw.nbytes
        sw.h2d = self.pool.device.copy_engine.copy_async(blk.view((nbytes,), np.uint8), sw.host)
        sw.state = "prefetching"
        self.swap_stats.prefetched_bytes += nbytes

    def await_(self, root: int) -> None:
        """Compute is about to read ``root``: wait for its prefetch, restore its views."""
        sw = self.swapped.pop(root)
        self._wait(sw.h2d)
        self._drop_host(sw)
        blk = self.blocks[root]
        for m in self._members(root):
            _, shape, dtype = self.info[m]
            self.arrays[m] = blk.view(sw.shapes.get(m, shape), dtype)

    def _drop_host(self, sw: _Swapped) -> None:
        if sw.host is not None:
            self.host_pool.release(sw.host)
            sw.host = None

    # ------------------------------------------------------------------ access
    def array(self, tid: int) -> Any:
        try:
            return self.arrays[tid]
        except KeyError:
            t = self.program.tensors[tid]
            where = "swapped out" if root_of(self.plan.aliases, tid) in self.swapped \
                else "not allocated"
            raise TensorNotResident(
                f"tensor {t.name} ({t.category}) is {where} at step {self.position}"
            ) from None

    def release_all(self) -> None:
        """Free whatever is still allocated (after a failure), leaving the pool clean."""
        self.snapshot_peak()
        for sw in self.swapped.values():
            for ev in (sw.d2h, sw.h2d):
                if ev is not None:
                    try:
                        ev.wait()
                    except Exception:
                        pass
            self._drop_host(sw)
        self.swapped.clear()
        self.cached.clear()
        for tid in list(self.blocks):
            self.pool.free(self.blocks.pop(tid))
        self.arrays.clear()

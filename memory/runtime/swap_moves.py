"""The runtime's moves over the host link: offload a block to the host, release it (or keep it
in the tensor cache), prefetch it back and wait for it, and how long compute stood still for
the copies (a part of :class:`~.runtime.MemoryRuntime`, by meaning)."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from ..ir.residency import TensorRecord


class SwapMoves:
    """The swap actions of :class:`~.runtime.MemoryRuntime` (a mixin: it reads the runtime's
    records, pool, host pool, cache, peak tracker and swap statistics below, and calls its
    ``_record_of``, ``_allocate_block``, ``_assign_block`` and ``_log``)."""

    records: dict[int, TensorRecord]
    pool: Any
    host_pool: Any
    host_homes: dict[int, Any]
    host_homed: frozenset[int]
    cache: Any
    peak: Any
    position: int
    poison_offloaded: bool
    info: list[tuple[int, tuple[int, ...], np.dtype]]
    _swap: Any
    _stall_probes: list[Any]

    def _members(self, root: TensorRecord) -> list[TensorRecord]:
        return [root, *(self.records[m] for m in sorted(root.members))]

    def _offload(self, root: int) -> None:
        """Start copying ``root``'s block to host; its views disappear until it is back."""
        rec = self._record_of(root)
        rec.check("offload")
        blk = rec.block
        nbytes = blk.size
        host = self.host_homes.get(root)
        if host is None:
            host = self.host_pool.acquire(nbytes, rec.name)
        if root in self.host_homed:  # (its home holds its bytes already: nothing to copy)
            ev = None
        else:
            if root in self.host_homes:  # a gradient into its landing buffer (offload)
                self._swap.offloaded_gradient_bytes += nbytes
            ev = self.pool.device.copy_engine.copy_async(host, blk.view((nbytes,), np.uint8))
            self._swap.offloaded_bytes += nbytes
        for m in self._members(rec):
            m.swap.saved_shape = None if m.view is None else tuple(m.view.shape)
            m.view = None
        rec.offload(host, ev)
        self._swap.host_peak_bytes = max(self._swap.host_peak_bytes,
                                         self.host_pool.in_use_bytes)

    def _wait(self, ev: Any) -> None:
        if ev is not None and not ev.done():
            t0 = time.perf_counter()
            ev.wait()
            self._swap.stall_s += time.perf_counter() - t0
        elif ev is not None:
            ev.wait()  # re-raises a failed copy

    def _order_compute(self, ev: Any) -> None:
        """Later compute work must follow the copy ``ev``: on a GPU the compute stream waits
        for its event on the device (no host synchronisation; how long it stood still is
        measured by events, read with :attr:`swap_stats`); elsewhere the host waits."""
        order = getattr(ev, "order_compute", None)
        if order is None:
            self._wait(ev)
            return
        probe = order()
        if probe is not None:
            self._stall_probes.append(probe)

    def _release(self, root: int) -> None:
        """The device block of an offloaded tensor may go: once its copy has read it (on a
        GPU, compute that may reuse the block waits for the copy's event), free it — or keep
        it cached when the plan caches."""
        rec = self._record_of(root)
        rec.check("release")
        self._order_compute(rec.swap.d2h)
        if self.cache.keep(rec):
            return
        self._free_swapped_block(rec)
        rec.release()

    def _free_swapped_block(self, rec: TensorRecord) -> None:
        self.peak.snapshot(self.records)
        blk = rec.block
        if self.poison_offloaded and getattr(self.pool.device, "has_storage", False):
            self.pool.device.fill(blk.offset, blk.size, float("nan"))
        self._log("release", blk, rec.tensor)
        self.pool.free(blk)

    def _prefetch(self, root: int, offset: int = -1) -> None:
        """Bring ``root`` back: free if still cached on device, else allocate and copy."""
        rec = self._record_of(root)
        if self.cache.take(rec):
            return
        rec.check("prefetch")
        blk = self._allocate_block(root, offset, rec.swap.nbytes)
        self._log("prefetch", blk, root)
        nbytes = rec.swap.nbytes
        rec.prefetch(blk, None)
        self._assign_block(rec)
        self.peak.note(self.pool.allocated_bytes, self.position)
        rec.swap.h2d = self.pool.device.copy_engine.copy_async(blk.view((nbytes,), np.uint8),
                                                          rec.swap.host)
        self._swap.prefetched_bytes += nbytes
        if root in self.host_homed:
            self._swap.streamed_parameter_bytes += nbytes

    def _await(self, root: int) -> None:
        """Compute is about to read ``root``: wait for its prefetch, restore its views."""
        rec = self._record_of(root)
        rec.check("await_prefetch")
        self._order_compute(rec.swap.h2d)
        if rec.swap.host is not None and root not in self.host_homes:
            self.host_pool.release(rec.swap.host)
        blk = rec.block
        for m in self._members(rec):
            _, shape, dtype = self.info[m.tensor]
            saved = m.swap.saved_shape
            m.view = blk.view(shape if saved is None else saved, dtype)
        rec.await_prefetch(rec.view)

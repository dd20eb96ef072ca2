"""The memory runtime: carries out a plan's actions against a pool, tensor by tensor.

It owns the residency of every non-persistent tensor of one iteration — one
:class:`~.residency.TensorRecord` per tensor (on device, offloading, on host, prefetching,
cached; illegal moves raise) — hands the executor typed views of resident tensors only, moves
swapped blocks through the device's copy engine, keeps released blocks in the tensor cache
(:mod:`.cache`) when the plan asks, and counts what swapping cost (bytes moved, stall time,
cache hits and misses). Where the peak happened is kept by its :class:`~.peak.PeakTracker`, the
log of a recorded iteration by its :class:`~.recording.RuntimeRecording`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ..ir.liveness import root_of
from ..ir.plan import Action, Plan
from ..ir.program import Program
from ..ir.residency import SWAPPED_OUT, IllegalTransition, Move, Residency, TensorRecord
from ..ir.walk import Visit, Where
from .cache import TensorCache
from .peak import PeakTracker
from .pool import DeviceOutOfMemory, PlacementError
from .recording import RuntimeRecording
from .swap_moves import SwapMoves


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
    #: Of ``offloaded_bytes``, parameter gradients copied into their host homes
    #: (``offload=optimizer``).
    offloaded_gradient_bytes: int = 0
    prefetched_bytes: int = 0
    #: Of ``prefetched_bytes``, parameters streamed in from their host homes
    #: (``offload=parameters``).
    streamed_parameter_bytes: int = 0
    stall_s: float = 0.0
    cache_hits: int = 0
    cache_misses: int = 0
    evictions: int = 0
    host_peak_bytes: int = 0

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


#: Swapped-out states whose block is on device but not counted as kept (in flight).
_IN_FLIGHT = frozenset({Residency.OFFLOADING, Residency.PREFETCHING})


class MemoryRuntime(SwapMoves):
    """Apply plan actions on ``pool``; ``position`` is the step being run (-1 before the first,
    ``len(steps)`` after the last), used to say where the peak occurred. ``host_pool`` holds
    offloaded tensors (needed only by plans that swap).

    Each tensor touched by an action has one :class:`~.residency.TensorRecord` in
    ``records``, kept in the order its current device block was assigned (a record moves to the
    end when it gets a new block), so the blocks live at any moment read in allocation order.
    ``peak`` says where the allocated bytes peaked; ``recording`` is the iteration's log after
    :meth:`start_recording` (``None`` otherwise).
    """

    def __init__(self, pool: Any, program: Program, plan: Plan, host_pool: Any = None,
                 poison_offloaded: bool = False,
                 info: list[tuple[int, tuple[int, ...], np.dtype]] | None = None,
                 host_homes: dict[int, Any] | None = None) -> None:
        if program.alignment != pool.alignment:
            raise ValueError(f"the program was planned for {program.alignment}-byte blocks but "
                             f"the pool allocates {pool.alignment}-byte blocks")
        self.pool = pool
        self.program = program
        self.plan = plan
        self.host_pool = host_pool
        #: Host byte buffers that tensors are offloaded into instead of the host pool's (the
        #: gradients of offloaded persistent state land where the host update reads them).
        self.host_homes = host_homes or {}
        #: Tensors whose home is the host (streamed parameters): they start there
        self.host_homed = frozenset(plan.swapping.host_homed)
        self.poison_offloaded = poison_offloaded
        self.records: dict[int, TensorRecord] = {}
        self.cache = TensorCache(plan.swapping.cache)
        #: The step being run (-1 before the first, ``len(steps)`` after the last).
        self.position = -1
        self.peak = PeakTracker()
        self.recording: RuntimeRecording | None = None
        self.info = info if info is not None else tensor_info(program)
        self.fallbacks: list[str] = []
        self.reallocs = 0
        self.kept_for_backward: dict[str, int] = {}
        self._swap = SwapStats()
        self._stall_probes: list[Any] = []  # a GPU's measures of compute waiting for copies
        for tid in plan.swapping.host_homed:
            home = self.host_homes.get(tid)
            if home is None:
                raise ValueError(f"{program.tensors[tid].name} is streamed from the host but "
                                 "has no host copy to stream from")
            rec = self.records[tid] = TensorRecord(tid, program.tensors[tid].name,
                                                   Residency.ON_HOST)
            rec.swap.host, rec.swap.nbytes = home, program.block_size(program.tensors[tid].nbytes)

    def start_recording(self) -> RuntimeRecording:
        """Log every block event and applied action from now on (:attr:`recording`)."""
        self.recording = RuntimeRecording()
        return self.recording

    @property
    def swap_stats(self) -> SwapStats:
        """What swapping (and the tensor cache) did so far this iteration. ``stall_s`` is the
        time compute waited for copies: the host's waits, plus on a GPU the compute stream's
        (read from CUDA events around each wait: this waits for the last of them)."""
        c = self.cache.stats
        stall = self._swap.stall_s + sum(p.seconds() for p in self._stall_probes)
        return replace(self._swap, stall_s=stall, cache_hits=c.hits, cache_misses=c.misses,
                       evictions=c.evictions)

    def residency(self, tid: int) -> Residency:
        """Where ``tid`` is now; a live alias is where its root's block is."""
        rec = self.records.get(tid)
        if rec is None:
            return Residency.UNALLOCATED
        if tid in self.plan.aliases and rec.state is Residency.ON_DEVICE:
            root = self.records.get(root_of(self.plan.aliases, tid))
            return root.state if root is not None else Residency.FREED
        return rec.state

    def _record_of(self, tid: int) -> TensorRecord:
        rec = self.records.get(tid)
        if rec is None:
            rec = self.records[tid] = TensorRecord(tid, self.program.tensors[tid].name)
        return rec

    def _assign_block(self, rec: TensorRecord) -> None:
        """Move ``rec`` to the end of ``records``: it has just been given a block."""
        del self.records[rec.tensor]
        self.records[rec.tensor] = rec

    # ------------------------------------------------------------------ actions
    def run_visit(self, visit: Visit) -> None:
        """Carry out the actions of one position of the plan's walk (:func:`.walk.walk`, not
        ``COMPUTE``): before a step's and at the end, :attr:`position` moves there first."""
        if visit.where is Where.BEFORE or visit.where is Where.END:
            self.position = visit.step
            if self.recording is not None:
                self.recording.step(visit.step)
        for action in visit.actions:
            self.apply(action)

    def apply(self, action: Action) -> None:
        """Carry out one plan action (see :mod:`.plan`); while recording, note when it ran
        and the copy it started."""
        recording = self.recording
        if recording is None:
            self._apply(action)
            return
        t0 = time.perf_counter()
        self._apply(action)
        rec = self.records.get(action.tensor)
        effect = action.effect
        copy = None  # a prefetch's is None when the tensor cache still held the block
        if rec is not None and effect.copy is not None:
            copy = rec.swap.d2h if effect.copy == "d2h" else rec.swap.h2d
        recording.action(t0, self.position, action.kind, action.tensor, copy)

    def _apply(self, action: Action) -> None:
        try:
            carry_out = _CARRY_OUT[action.move]
        except (AttributeError, KeyError):
            raise TypeError(f"memory runtime cannot carry out {action!r}: not a plan action") \
                from None
        carry_out(self, action)

    def _allocate_block(self, tid: int, offset: int = -1, size: int = 0) -> Any:
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
                if not self.cache.evict_oldest(self._free_swapped_block):
                    raise

    def _log(self, op: str, blk: Any, tid: int) -> None:
        if self.recording is not None:
            t = self.program.tensors[tid]
            self.recording.block(op, blk, self.position, t.category, t.name)

    def note_kept_for_backward(self) -> None:
        """Record what is on device as the backward pass begins, by category (the feature
        maps, stashes and encoded forms kept for backward)."""
        kept: dict[str, int] = {}
        for tid, rec in self.records.items():
            if rec.block is None or rec.state in _IN_FLIGHT:
                continue
            cat = self.program.tensors[tid].category
            kept[cat] = kept.get(cat, 0) + rec.block.size
        self.kept_for_backward = kept

    def _alloc(self, tid: int, offset: int = -1) -> None:
        _, shape, dtype = self.info[tid]
        if tid in self.plan.aliases:
            root = self._record_of(root_of(self.plan.aliases, tid))
            rec = self._record_of(tid)
            rec.check("allocate")
            root.members.add(tid)
            if root.state in SWAPPED_OUT:
                rec.allocate(None, None)  # the view appears when the block is back on device
            elif root.block is None:
                raise TensorNotResident(f"alias {rec.name} of {root.name}: {root.name} is "
                                        f"{root.state.value} at step {self.position}")
            else:
                rec.allocate(None, root.block.view(shape, dtype))
            return
        rec = self._record_of(tid)
        rec.check("allocate")
        blk = self._allocate_block(tid, offset)
        if self.recording is not None:
            self._log("alloc", blk, tid)
        rec.allocate(blk, blk.view(shape, dtype))
        self._assign_block(rec)
        self.peak.note(self.pool.allocated_bytes, self.position)

    def realloc(self, tid: int, nbytes: int) -> None:
        """Replace ``tid``'s block by one of ``nbytes`` (an encoded stash larger than planned);
        the contents are not kept."""
        self.peak.snapshot(self.records)
        rec = self._record_of(tid)
        rec.check("reallocate")
        old = rec.block
        self._log("free", old, tid)
        self.pool.free(old)
        rec.block = None  # returned to the pool: no longer live
        blk = self.pool.allocate(self.program.block_size(nbytes),
                                 tag=self.program.tensors[tid].name,
                                 category=self.program.tensors[tid].category)
        self._log("alloc", blk, tid)
        rec.reallocate(blk, blk.view((int(nbytes),), np.uint8))
        self._assign_block(rec)
        self.reallocs += 1
        self.peak.note(self.pool.allocated_bytes, self.position)

    def _free(self, tid: int) -> None:
        self.peak.snapshot(self.records)
        rec = self._record_of(tid)
        if tid in self.plan.aliases:
            rec.free()
            root = self.records.get(root_of(self.plan.aliases, tid))
            if root is not None:
                root.members.discard(tid)
            return
        blk, host = rec.block, rec.swap.host
        try:
            rec.free()
        except IllegalTransition:
            raise TensorNotResident(f"free of {rec.name}: not allocated") from None
        if host is not None and tid not in self.host_homes:
            self.host_pool.release(host)
        self.cache.discard(tid)
        if blk is not None:
            self._log("free", blk, tid)
            self.pool.free(blk)

    # ------------------------------------------------------------------ access
    def array(self, tid: int) -> Any:
        rec = self.records.get(tid)
        if rec is not None and rec.view is not None:
            return rec.view
        t = self.program.tensors[tid]
        root = self.records.get(root_of(self.plan.aliases, tid))
        where = "swapped out" if root is not None and root.state in SWAPPED_OUT \
            else "not allocated"
        raise TensorNotResident(f"tensor {t.name} ({t.category}) is {where} at step "
                                f"{self.position}")

    def release_all(self) -> None:
        """Free whatever is still allocated (after a failure), leaving the pool clean."""
        self.peak.snapshot(self.records)
        for rec in self.records.values():
            if rec.state not in SWAPPED_OUT:
                continue
            for ev in (rec.swap.d2h, rec.swap.h2d):
                if ev is not None:
                    try:
                        ev.wait()
                    except Exception:
                        pass
            if rec.swap.host is not None and rec.tensor not in self.host_homes:
                self.host_pool.release(rec.swap.host)
        self.cache.clear()
        for rec in list(self.records.values()):
            if rec.block is not None:
                self.pool.free(rec.block)
        self.records.clear()


#: How the runtime carries out each plan action, by the residency move it declares
#: (``Action.move``; the records check the move against the one table, TRANSITIONS).
_CARRY_OUT: dict[Move, Callable[[MemoryRuntime, Any], None]] = {
    Move.ALLOCATE: lambda rt, a: rt._alloc(a.tensor, a.offset),
    Move.FREE: lambda rt, a: rt._free(a.tensor),
    Move.OFFLOAD: lambda rt, a: rt._offload(a.tensor),
    Move.RELEASE: lambda rt, a: rt._release(a.tensor),
    Move.PREFETCH: lambda rt, a: rt._prefetch(a.tensor, a.offset),
    Move.AWAIT_PREFETCH: lambda rt, a: rt._await(a.tensor),
}

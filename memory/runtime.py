"""The memory runtime: carries out a plan's actions against a pool, tensor by tensor.

It owns the residency of every non-persistent tensor of one iteration (which block holds it),
hands the executor typed views, and records where the peak happened.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .plan import Action, Plan
from .pool import PlacementError
from .program import Program, aligned


class TensorNotResident(RuntimeError):
    """A step asked for a tensor the plan has not allocated (or has already freed)."""


class MemoryRuntime:
    """Apply plan actions on ``pool``; ``position`` is the step being run (-1 before the first,
    ``len(steps)`` after the last), used to say where the peak occurred."""

    def __init__(self, pool: Any, program: Program, plan: Plan) -> None:
        self.pool = pool
        self.program = program
        self.plan = plan
        self.blocks: dict[int, Any] = {}
        self.arrays: dict[int, Any] = {}
        self.position = -1
        self.peak_bytes = -1
        self.peak_position = -1
        self.peak_live: list[int] = []
        self.fallbacks: list[str] = []

    # ------------------------------------------------------------------ actions
    def apply(self, action: Action) -> None:
        op = action.op
        if op == "alloc":
            self.alloc(action.tensor, action.arg)
        elif op == "free":
            self.free(action.tensor)
        else:
            raise ValueError(f"memory runtime cannot carry out action {action!r}")

    def alloc(self, tid: int, offset: int = -1) -> None:
        t = self.program.tensors[tid]
        if tid in self.plan.aliases:
            root = self._root(tid)
            blk = self.blocks[root]
            self.arrays[tid] = blk.view(t.shape, np.dtype(t.dtype))
            return
        if offset >= 0:
            try:
                blk = self.pool.allocate(aligned(t.nbytes), tag=t.name, category=t.category,
                                         offset=offset)
            except PlacementError as e:
                # the planned offset is taken (something else lives in the pool): say so once
                # and fall back to the pool's own placement for this block
                self.fallbacks.append(f"{t.name}: {e}")
                blk = self.pool.allocate(aligned(t.nbytes), tag=t.name, category=t.category)
        else:
            blk = self.pool.allocate(aligned(t.nbytes), tag=t.name, category=t.category)
        self.blocks[tid] = blk
        self.arrays[tid] = blk.view(t.shape, np.dtype(t.dtype))
        current = self.pool.allocated_bytes
        if current > self.peak_bytes:
            self.peak_bytes = current
            self.peak_position = self.position
            self.peak_live = list(self.blocks)

    def free(self, tid: int) -> None:
        self.arrays.pop(tid, None)
        if tid in self.plan.aliases:
            return
        blk = self.blocks.pop(tid, None)
        if blk is None:
            raise TensorNotResident(f"free of {self.program.tensors[tid].name}: not allocated")
        self.pool.free(blk)

    def _root(self, tid: int) -> int:
        while tid in self.plan.aliases:
            tid = self.plan.aliases[tid]
        return tid

    # ------------------------------------------------------------------ access
    def array(self, tid: int) -> Any:
        try:
            return self.arrays[tid]
        except KeyError:
            t = self.program.tensors[tid]
            raise TensorNotResident(
                f"tensor {t.name} ({t.category}) is not resident at step {self.position}"
            ) from None

    def release_all(self) -> None:
        """Free whatever is still allocated (after a failure), leaving the pool clean."""
        for tid in list(self.blocks):
            self.pool.free(self.blocks.pop(tid))
        self.arrays.clear()

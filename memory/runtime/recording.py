"""A memory runtime's log of one iteration, kept while recording (``Trainer.record_memory``,
the dry run's snapshot and trace): its block events with their arena offsets, the plan actions
it applied, and when each step began."""

from __future__ import annotations

import time
from typing import Any


class RuntimeRecording:
    """``events``: (time, step, op, category, byte delta, tensor) per block event; ``op`` is
    ``alloc`` / ``free``, ``prefetch`` (a block for a copy back) or ``release`` (an offloaded
    tensor's block given back, or evicted from the cache). ``event_offsets``: the offset in the
    device arena of each event's block (in the order of ``events``): where the pool placed it, or
    where it was when given back. ``actions``: (start, end, step, action kind, tensor, copy event
    or None) per action applied. ``step_marks``: (time, step) each time the runtime moved to a
    new step."""

    def __init__(self) -> None:
        self.events: list[tuple] = []
        self.event_offsets: list[int] = []
        self.actions: list[tuple] = []
        self.step_marks: list[tuple[float, int]] = []

    def block(self, op: str, block: Any, position: int, category: str, tensor: str) -> None:
        """A block event: ``block`` allocated (``alloc``, ``prefetch``) or given back."""
        delta = block.size if op in ("alloc", "prefetch") else -block.size
        self.events.append((time.perf_counter(), position, op, category, delta, tensor))
        self.event_offsets.append(block.offset)

    def action(self, start: float, position: int, kind: Any, tensor: int, copy: Any) -> None:
        """An action applied from ``start`` until now (``copy``: the copy it started)."""
        self.actions.append((start, time.perf_counter(), position, kind, tensor, copy))

    def step(self, position: int) -> None:
        """The runtime moved to step ``position``."""
        self.step_marks.append((time.perf_counter(), position))

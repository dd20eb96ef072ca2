"""Where one iteration's allocated bytes peaked: the bytes, the step, and the blocks live there."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class PeakTracker:
    """The highest allocated bytes seen (``bytes``; -1 before any block), the step it was reached
    at (``position``) and the tensors whose blocks were live there (``live``, in the order their
    blocks were assigned; listed lazily by :meth:`snapshot`)."""

    def __init__(self) -> None:
        self.bytes = -1
        self.position = -1
        self.live: list[int] = []
        self._pending = False

    def note(self, allocated: int, position: int) -> None:
        """A block was just placed: ``allocated`` bytes are now in use at ``position``."""
        if allocated > self.bytes:
            self.bytes = allocated
            self.position = position
            self._pending = True  # what is live now is listed before the next free

    def snapshot(self, records: Mapping[int, Any]) -> None:
        """List the tensors of ``records`` holding a block, if the peak is new since the last
        list (the peak state lasts until the next free: the runtime calls this before each)."""
        if self._pending:
            self.live = [t for t, rec in records.items() if rec.block is not None]
            self._pending = False

"""What the heap pool reports about itself: counters with PyTorch-style names
(:meth:`PoolStatistics.stats`), the state at the allocated peak (recorded lazily, just before
the free that ends it), the largest free chunk and the fragmentation, and the readable summary
(:func:`~.pool_report.format_memory_summary`).

:class:`PoolStatistics` is a base class of :class:`~.pool.Pool`: the pool keeps the counters
up to date as it allocates and frees (its hot path), this reads them and its chunk indexes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .pool_report import CATEGORIES, format_memory_summary

__all__ = ["PoolStatistics"]


class PoolStatistics:
    """The counters of a :class:`~.pool.Pool` and what it reports from them."""

    # Kept by the pool (its arena, its chunk indexes, its deferred frees; see Pool.__init__).
    device: Any
    policy: str
    capacity: int
    _top: int
    _by_size: list[tuple[int, int]]
    _free_start: dict[int, int]
    _live: dict[int, Any]
    _deferred: list[Any]
    _drain_deferred: Callable[[], None]

    def _init_statistics(self) -> None:
        """Every counter at zero, the peak state that of an empty pool."""
        self._allocated = 0
        self._allocated_peak = 0
        self._reserved_peak = 0
        self._requested = 0
        self._cat_cur = dict.fromkeys(CATEGORIES, 0)
        self._cat_peak = dict.fromkeys(CATEGORIES, 0)
        self._num_allocs = 0
        self._num_frees = 0
        self._num_ooms = 0
        # The state at the allocated peak is recorded lazily: the peak state lasts until the
        # next free, so it is captured just before that free (or when asked for).
        self._peak_pending = True
        self._peak_snapshot: dict[str, Any] = {"allocated_bytes": 0, "by_category": {},
                                               "live": []}

    def _largest_free(self) -> int:
        interior = self._by_size[-1][0] if self._by_size else 0
        return max(interior, self.capacity - self._top)

    def _fragmentation(self, largest: int) -> float:
        free = self.capacity - self._allocated
        return 1.0 - largest / free if free > 0 else 0.0

    def _take_peak_snapshot(self) -> None:
        self._peak_pending = False
        self._peak_snapshot = {
            "allocated_bytes": self._allocated,
            "by_category": {c: n for c, n in self._cat_cur.items() if n},
            "live": [(b.tag, b.category, b.size) for b in self._live.values()],
        }

    def stats(self) -> dict[str, Any]:
        """A flat dict of counters with PyTorch-style names.

        ``allocated`` counts rounded sizes of live blocks; ``reserved`` is the highest end of
        any live block (the arena span the live blocks need); ``fragmentation`` is
        ``1 - largest free block / free bytes`` with free counted up to the capacity.
        """
        if self._deferred:
            self._drain_deferred()
        largest = self._largest_free()
        s: dict[str, Any] = {
            "allocated_bytes.current": self._allocated,
            "allocated_bytes.peak": self._allocated_peak,
            "active_bytes.current": self._allocated,
            "active_bytes.peak": self._allocated_peak,
            "requested_bytes.current": self._requested,
            "reserved_bytes.current": self._top,
            "reserved_bytes.peak": self._reserved_peak,
            "active_blocks": len(self._live),
            "num_allocs": self._num_allocs,
            "num_frees": self._num_frees,
            "num_ooms": self._num_ooms,
            "capacity": self.capacity,
            "free_bytes": self.capacity - self._allocated,
            "largest_free_block": largest,
            "fragmentation": self._fragmentation(largest),
            "free_chunks": len(self._free_start),
        }
        for c in CATEGORIES:
            s[f"allocated_bytes.{c}.current"] = self._cat_cur[c]
            s[f"allocated_bytes.{c}.peak"] = self._cat_peak[c]
        return s

    def stats_at_peak(self) -> dict[str, Any]:
        """The state when ``allocated_bytes.peak`` was last raised.

        ``{"allocated_bytes": int, "by_category": {category: bytes}, "live": [(tag, category,
        size), ...]}`` with ``live`` largest first.
        """
        if self._peak_pending:
            self._take_peak_snapshot()
        snap = self._peak_snapshot
        live = sorted(snap["live"], key=lambda t: -t[2])
        return {"allocated_bytes": snap["allocated_bytes"],
                "by_category": dict(snap["by_category"]), "live": live}

    def reset_peak_stats(self) -> None:
        """Set every peak to its current value."""
        self._allocated_peak = self._allocated
        self._reserved_peak = self._top
        self._cat_peak = dict(self._cat_cur)
        self._peak_pending = True

    @property
    def allocated_bytes(self) -> int:
        """Current ``allocated_bytes`` (rounded sizes of live blocks), without building stats."""
        return self._allocated

    @property
    def reserved_bytes(self) -> int:
        """Current ``reserved_bytes``: the highest end of any live block."""
        return self._top

    @property
    def top(self) -> int:
        """Start of the top region: the highest end of any live block (0 when empty)."""
        return self._top

    def memory_summary(self) -> str:
        """A readable table of the stats and the per-category current and peak bytes."""
        return format_memory_summary(self.stats(), self.device.name, self.policy)

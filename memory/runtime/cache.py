"""SuperNeurons' tensor cache: offloaded tensors whose blocks stay on device while memory allows.

With the plan's ``cache`` flag (``--memory ...,swap=...,cache``), releasing an offloaded tensor
keeps its device block (state ``cached``, see :mod:`.residency`); a later prefetch of it is a
hit — no allocation, no copy back. When an allocation finds the device full, the runtime evicts
cached blocks, least recently cached first, until it fits. Without the flag every release frees
its block at once (plain swapping) and the cache stays empty.

The planner only sets the flag (``Plan.swapping.cache``); :func:`~.static_plan.static_plan`
leaves such plans to the pool, since what stays resident depends on memory pressure at run time;
:func:`without_cache` is the fallback when fragmentation defeats eviction.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from ..ir.plan import Plan
from ..ir.residency import Residency, TensorRecord


@dataclass
class CacheStats:
    """What the cache did during one iteration."""

    hits: int = 0  # prefetches that found their block still on device
    misses: int = 0  # prefetches that had to allocate and copy back (cache on)
    evictions: int = 0  # cached blocks freed to make room


class TensorCache:
    """The cached tensors of one iteration in LRU order (``enabled`` is the plan's flag)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.stats = CacheStats()
        self._lru: OrderedDict[int, TensorRecord] = OrderedDict()

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, tensor: int) -> bool:
        return tensor in self._lru

    def order(self) -> list[int]:
        """The cached tensors, the next to be evicted first."""
        return list(self._lru)

    def keep(self, record: TensorRecord) -> bool:
        """Release an offloaded ``record``: True if the cache keeps its block (now ``cached``),
        False if the cache is off and the caller must free the block."""
        if not self.enabled:
            return False
        record.keep_cached()
        self._lru[record.tensor] = record
        return True

    def take(self, record: TensorRecord) -> bool:
        """A prefetch of ``record``: True on a hit (its block was still cached: now
        ``prefetching``, nothing to copy), False if the caller must allocate and copy back."""
        if record.state is Residency.CACHED:
            record.reuse_cached()
            del self._lru[record.tensor]
            self.stats.hits += 1
            return True
        if self.enabled:
            self.stats.misses += 1
        return False

    def evict_oldest(self, free_block: Callable[[TensorRecord], Any]) -> bool:
        """Evict the least recently cached tensor (``free_block`` returns its block to the
        pool, then it is ``on_host``); False if nothing is cached."""
        if not self._lru:
            return False
        _, record = self._lru.popitem(last=False)
        free_block(record)
        record.evict()
        self.stats.evictions += 1
        return True

    def discard(self, tensor: int) -> None:
        """Forget ``tensor`` (it is being freed)."""
        self._lru.pop(tensor, None)

    def clear(self) -> None:
        """Forget everything (the runtime is releasing all its blocks)."""
        self._lru.clear()


def without_cache(plan: Plan) -> Plan:
    """``plan`` with the cache turned off, after an out-of-memory that evicting every cached
    tensor could not resolve (fragmentation): released blocks are freed at once."""
    return replace(plan, swapping=replace(plan.swapping, cache=False)).with_notes(
        "cache: turned off after an out-of-memory that evicting every cached tensor "
        "could not resolve (fragmentation)")

"""The host buffers of data parallelism's gradient buckets, as a ring: a bucket takes a slot
(the largest bucket's bytes) when its first gradient goes in, and gives it back once its
collective is done, so the host holds a few buckets' bytes instead of every gradient's
(DeepSpeed's ``reduce_bucket_size`` buffers; under ZeRO stage 2 with ``offload=optimizer`` the
host then keeps little more than its shards).

A bucket that finds every slot taken waits for one only while a bucket holding a slot has been
launched (its collective will end, since every rank launches the buckets in the same order);
while every holder is still filling (gradients completed out of bucket order) it gets a new
slot instead, so the ring never deadlocks and grows only as far as the plan's order needs.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np


class BucketRing:
    """Slots of ``slot_bytes`` for buckets of ``counts`` elements of ``dtypes`` (by bucket
    index); at least ``slots`` of them once used."""

    def __init__(self, counts: list[int], dtypes: list[Any], slots: int = 2) -> None:
        self.counts = list(counts)
        self.dtypes = [np.dtype(d) for d in dtypes]
        self.slot_bytes = max((n * d.itemsize for n, d in zip(self.counts, self.dtypes)),
                              default=0)
        self.slots = slots
        self._cond = threading.Condition()
        self._all: list[np.ndarray] = []  # every slot made
        self._free: list[np.ndarray] = []
        self._held: dict[int, np.ndarray] = {}  # bucket -> its slot
        self._launched: set[int] = set()

    @property
    def nbytes(self) -> int:
        """Host bytes of the slots made so far."""
        return len(self._all) * self.slot_bytes

    def take(self, b: int) -> np.ndarray:
        """Bucket ``b``'s buffer (its slot's first elements), taking a slot if it has none."""
        with self._cond:
            slot = self._held.get(b)
            while slot is None:
                if self._free:
                    slot = self._free.pop()
                elif len(self._all) < self.slots or not self._launched:
                    slot = np.empty(self.slot_bytes, np.uint8)
                    self._all.append(slot)
                else:
                    self._cond.wait()
                    continue
                self._held[b] = slot
            d = self.dtypes[b]
            return slot[:self.counts[b] * d.itemsize].view(d)

    def launch(self, b: int) -> None:
        """Bucket ``b``'s collective is under way: its slot will come back when it ends (a
        bucket waiting for a slot may wait for it)."""
        with self._cond:
            self._launched.add(b)

    def give_back(self, b: int) -> None:
        """Bucket ``b``'s collective is done (its sums copied out): its slot is free."""
        with self._cond:
            slot = self._held.pop(b, None)
            self._launched.discard(b)
            if slot is not None:
                self._free.append(slot)
                self._cond.notify_all()

    def reset(self) -> None:
        """A new step (after a failed one, buckets may still hold slots): every slot free."""
        with self._cond:
            self._held.clear()
            self._launched.clear()
            self._free = list(self._all)

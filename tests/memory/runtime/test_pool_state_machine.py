"""The heap pool under random allocate / free / fixed-offset sequences (hypothesis state machines
against a shadow model of placement), best fit and first fit."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)
from pool_sizes import KiB, rounded

from minidl.memory import (
    CATEGORIES,
    Block,
    CpuDevice,
    DeviceOutOfMemory,
    PlacementError,
    Pool,
)

# --------------------------------------------------------------------------- state machine


class PoolMachine(RuleBasedStateMachine):
    """Random allocate / free / fixed-offset sequences against a shadow model of placement."""

    policy = "best_fit"
    capacity = 64 * KiB

    @initialize(seed=st.integers(0, 2**32 - 1))
    def setup(self, seed):
        self.pool = Pool(CpuDevice(self.capacity), policy=self.policy, debug=True)
        self.rng = np.random.default_rng(seed)
        self.live: dict[int, tuple[Block, bytes]] = {}  # id -> (block, written pattern)
        self.next_id = 0
        self.allocated = self.peak = self.reserved_peak = 0
        self.allocs = self.frees = self.ooms = 0
        self.last_peak = 0

    # --- shadow model of the placement rule
    def _intervals(self):
        return sorted((b.offset, b.offset + b.size) for b, _ in self.live.values())

    def _expected_offset(self, size):
        ivs = self._intervals()
        holes, pos = [], 0
        for s, e in ivs:
            if s > pos:
                holes.append((pos, s - pos))
            pos = e
        top = pos
        fits = [(n, o) for o, n in holes if n >= size]
        if fits:
            return min(fits)[1] if self.policy == "best_fit" else min(o for _, o in fits)
        return top if top + size <= self.capacity else None

    def _record(self, blk):
        nbytes = blk.nbytes
        data = self.rng.integers(0, 256, size=nbytes, dtype=np.uint8).tobytes()
        if nbytes:
            blk.view((nbytes,), np.uint8)[...] = np.frombuffer(data, np.uint8)
        self.live[self.next_id] = (blk, data)
        self.next_id += 1
        self.allocs += 1
        self.allocated += blk.size
        self.peak = max(self.peak, self.allocated)
        self.reserved_peak = max(self.reserved_peak, max(e for _, e in self._intervals()))

    @rule(nbytes=st.integers(0, 20_000), category=st.sampled_from(CATEGORIES))
    def allocate(self, nbytes, category):
        size = rounded(nbytes)
        expected = self._expected_offset(size)
        if expected is None:
            with pytest.raises(DeviceOutOfMemory):
                self.pool.allocate(nbytes, tag="x", category=category)
            self.ooms += 1
            return
        blk = self.pool.allocate(nbytes, tag=f"b{self.next_id}", category=category)
        assert blk.offset == expected and blk.size == size and blk.nbytes == nbytes
        self._record(blk)

    @rule(slot=st.integers(0, 127), nbytes=st.integers(0, 6000))
    def allocate_at(self, slot, nbytes):
        offset, size = slot * 512, rounded(nbytes)
        overlaps = any(s < offset + size and offset < e for s, e in self._intervals())
        if overlaps:
            with pytest.raises(PlacementError):
                self.pool.allocate(nbytes, offset=offset)
        elif offset + size > self.capacity:
            with pytest.raises(DeviceOutOfMemory):
                self.pool.allocate(nbytes, offset=offset)
            self.ooms += 1
        else:
            blk = self.pool.allocate(nbytes, tag=f"b{self.next_id}", offset=offset)
            assert blk.offset == offset
            self._record(blk)

    @precondition(lambda self: self.live)
    @rule(pick=st.integers(0, 10**6))
    def free(self, pick):
        keys = sorted(self.live)
        key = keys[pick % len(keys)]
        blk, _ = self.live.pop(key)
        self.pool.free(blk)
        self.frees += 1
        self.allocated -= blk.size
        assert np.all(np.isnan(self.pool.device.view(blk.offset, blk.size, blk.size // 4)))

    @rule()
    def reset_peaks(self):
        self.pool.reset_peak_stats()
        self.peak = self.allocated
        self.reserved_peak = max((e for _, e in self._intervals()), default=0)
        self.last_peak = self.peak

    @invariant()
    def structure_and_stats(self):
        if not hasattr(self, "pool"):
            return
        pool = self.pool
        pool.check_invariants()
        blocks = pool.live_blocks()
        for a, b in zip(blocks, blocks[1:], strict=False):
            assert a.offset + a.size <= b.offset  # no overlap
        for b in blocks:
            assert b.offset % 512 == 0 and b.offset + b.size <= self.capacity
        chunks = pool.free_chunks()
        for (o1, n1), (o2, _) in zip(chunks, chunks[1:], strict=False):
            assert o1 + n1 < o2  # complete merging: no two free chunks touch
        s = pool.stats()
        assert s["allocated_bytes.current"] + s["free_bytes"] == self.capacity
        assert s["allocated_bytes.current"] == self.allocated
        assert s["allocated_bytes.peak"] == self.peak
        assert s["reserved_bytes.peak"] == self.reserved_peak
        assert s["reserved_bytes.current"] == max((e for _, e in self._intervals()), default=0)
        assert s["active_blocks"] == len(self.live)
        assert (s["num_allocs"], s["num_frees"], s["num_ooms"]) == \
            (self.allocs, self.frees, self.ooms)
        assert s["allocated_bytes.peak"] >= self.last_peak  # peaks only grow until reset
        self.last_peak = s["allocated_bytes.peak"]
        by_cat = {c: 0 for c in CATEGORIES}
        for blk, _ in self.live.values():
            by_cat[blk.category] += blk.size
        for c in CATEGORIES:
            assert s[f"allocated_bytes.{c}.current"] == by_cat[c]
            assert s[f"allocated_bytes.{c}.peak"] >= by_cat[c]
        # data integrity: every live block still holds what was written into it
        for blk, data in self.live.values():
            if blk.nbytes:
                assert blk.view((blk.nbytes,), np.uint8).tobytes() == data


class FirstFitMachine(PoolMachine):
    policy = "first_fit"


_machine_settings = settings(max_examples=100, stateful_step_count=50, deadline=None,
                             suppress_health_check=[HealthCheck.too_slow])
TestPoolBestFit = PoolMachine.TestCase
TestPoolBestFit.settings = _machine_settings
TestPoolFirstFit = FirstFitMachine.TestCase
TestPoolFirstFit.settings = _machine_settings

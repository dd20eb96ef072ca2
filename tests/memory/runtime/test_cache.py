"""The tensor cache: what it keeps, LRU eviction under pressure, hit/miss/eviction counts."""

from __future__ import annotations

import numpy as np
import pytest

from minidl.memory.devices.device import CpuDevice
from minidl.memory.ir.plan import (
    Alloc,
    Await,
    Free,
    Offload,
    Plan,
    Prefetch,
    Release,
    Swapping,
)
from minidl.memory.ir.program import Program, TensorSpec
from minidl.memory.ir.residency import IllegalTransition, Residency, TensorRecord
from minidl.memory.runtime.cache import TensorCache, without_cache
from minidl.memory.runtime.host_pool import HostPool
from minidl.memory.runtime.pool import DeviceOutOfMemory, Pool
from minidl.memory.runtime.runtime import MemoryRuntime


def _offloading(tid: int) -> TensorRecord:
    return TensorRecord(tid, f"t{tid}", Residency.OFFLOADING, block=f"block{tid}")


def test_a_disabled_cache_keeps_nothing_and_counts_nothing():
    cache = TensorCache(enabled=False)
    rec = _offloading(0)
    assert not cache.keep(rec)
    assert rec.state is Residency.OFFLOADING and len(cache) == 0
    rec.release()
    assert not cache.take(rec)
    assert (cache.stats.hits, cache.stats.misses, cache.stats.evictions) == (0, 0, 0)


def test_lru_order_hits_misses_and_evictions():
    cache = TensorCache(enabled=True)
    recs = [_offloading(i) for i in range(3)]
    for r in recs:
        assert cache.keep(r)
    assert cache.order() == [0, 1, 2] and all(r.state is Residency.CACHED for r in recs)
    assert cache.take(recs[1])  # a hit: back without a copy
    assert recs[1].state is Residency.PREFETCHING and 1 not in cache
    freed = []
    assert cache.evict_oldest(lambda r: freed.append(r.block))
    assert freed == ["block0"] and recs[0].state is Residency.ON_HOST and recs[0].block is None
    assert not cache.take(recs[0])  # a miss: it was evicted
    cache.discard(2)
    assert not cache.evict_oldest(freed.append) and freed == ["block0"]
    assert (cache.stats.hits, cache.stats.misses, cache.stats.evictions) == (1, 1, 1)


def test_keeping_a_tensor_that_is_not_offloading_is_illegal():
    cache = TensorCache(enabled=True)
    with pytest.raises(IllegalTransition, match="t0 is on_device: cannot keep_cached"):
        cache.keep(TensorRecord(0, "t0", Residency.ON_DEVICE))
    assert len(cache) == 0


def test_without_cache_returns_a_new_plan_with_a_note():
    program = Program(tensors=[], steps=[], inputs=[])
    plan = Plan(program, steps=(), swapping=Swapping(cache=True))
    off = without_cache(plan)
    assert plan.swapping.cache and not off.swapping.cache
    assert off.notes[-1].startswith("cache: turned off after an out-of-memory")


# ---------------------------------------------------------------- in the runtime
def _runtime(n: int, units: int, capacity: int, cache: bool) -> MemoryRuntime:
    tensors = [TensorSpec(i, f"t{i}", (units * 128,), "float32", "feature_map", "value")
               for i in range(n)]
    program = Program(tensors=tensors, steps=[], inputs=[])
    device = CpuDevice(capacity)
    plan = Plan(program, steps=(), swapping=Swapping(cache=cache))
    return MemoryRuntime(Pool(device), program, plan, HostPool(device))


def _swap_out(rt: MemoryRuntime, tid: int) -> None:
    rt.apply(Offload(tid))
    rt.apply(Release(tid))


def test_without_pressure_cached_blocks_stay_and_prefetches_hit():
    rt = _runtime(4, units=2, capacity=4 * 1024, cache=True)  # room for 4 blocks
    for t in range(3):
        rt.apply(Alloc(t))
    _swap_out(rt, 0)
    _swap_out(rt, 1)
    assert rt.cache.order() == [0, 1] and rt.pool.allocated_bytes == 3 * 1024
    rt.apply(Alloc(3))  # fits: nothing evicted
    assert rt.cache.order() == [0, 1]
    rt.apply(Prefetch(1))
    rt.apply(Prefetch(0))
    assert rt.pool.allocated_bytes == 4 * 1024 and len(rt.cache) == 0
    s = rt.swap_stats
    assert (s.cache_hits, s.cache_misses, s.evictions, s.prefetched_bytes) == (2, 0, 0, 0)


def test_pressure_evicts_least_recently_cached_first_until_nothing_is_left():
    rt = _runtime(4, units=2, capacity=3 * 1024, cache=True)  # room for 3 blocks
    for t in range(3):
        rt.apply(Alloc(t))
    _swap_out(rt, 0)
    _swap_out(rt, 1)
    rt.apply(Alloc(3))  # the device is full: t0, cached first, goes
    assert rt.residency(0) is Residency.ON_HOST and rt.residency(1) is Residency.CACHED
    rt.apply(Prefetch(1))  # still on device: a hit
    with pytest.raises(DeviceOutOfMemory):  # full again, and nothing left to evict
        rt.apply(Prefetch(0))
    s = rt.swap_stats
    assert (s.cache_hits, s.cache_misses, s.evictions) == (1, 1, 1)


def test_cache_statistics_reach_swap_stats():
    rt = _runtime(4, units=2, capacity=3 * 1024, cache=True)
    for t in range(3):
        rt.apply(Alloc(t))
        rt.array(t)[:] = t + 1
    _swap_out(rt, 0)
    _swap_out(rt, 1)
    rt.apply(Alloc(3))  # evicts t0
    rt.apply(Free(2))
    rt.apply(Free(3))
    rt.apply(Prefetch(1))  # hit
    rt.apply(Prefetch(0))  # miss: allocated and copied back
    rt.apply(Await(1))
    rt.apply(Await(0))
    np.testing.assert_array_equal(rt.array(0), np.full(256, 1, np.float32))
    np.testing.assert_array_equal(rt.array(1), np.full(256, 2, np.float32))
    s = rt.swap_stats
    assert (s.cache_hits, s.cache_misses, s.evictions) == (1, 1, 1)
    assert (s.offloaded_bytes, s.prefetched_bytes) == (2048, 1024)
    assert set(s.as_dict()) == {"offloaded_bytes", "offloaded_gradient_bytes", "prefetched_bytes",
                                "streamed_parameter_bytes", "stall_s", "cache_hits",
                                "cache_misses", "evictions", "host_peak_bytes"}
    assert s.offloaded_gradient_bytes == 0  # (no gradient went to a host home)
    assert s.streamed_parameter_bytes == 0  # (nor came from one)


def test_without_the_flag_release_frees_at_once():
    rt = _runtime(1, units=2, capacity=4 * 1024, cache=False)
    rt.apply(Alloc(0))
    _swap_out(rt, 0)
    assert rt.residency(0) is Residency.ON_HOST and rt.pool.allocated_bytes == 0
    rt.apply(Prefetch(0))
    s = rt.swap_stats
    assert (s.cache_hits, s.cache_misses, s.evictions) == (0, 0, 0)

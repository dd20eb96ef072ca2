"""The heap pool: placement, merging, stats, errors, OOM, fixed offsets, poisoning."""

from __future__ import annotations

import gc
import pickle

import numpy as np
import pytest
from pool_sizes import KiB, rounded

from minidl.memory import (
    CATEGORIES,
    Block,
    CpuDevice,
    DeviceOutOfMemory,
    MetaDevice,
    PlacementError,
    Pool,
    PoolError,
)
from minidl.memory.runtime.pool import DoubleFreeError, ForeignBlockError, UseAfterFreeError, replay

# --------------------------------------------------------------------------- basics


def test_public_surface():
    pool = Pool(CpuDevice("64MiB"))
    blk = pool.allocate(3 * 224 * 4, tag="conv1.out", category="feature_map")
    arr = blk.view((3, 224), np.float32)
    arr[...] = 1.5
    assert isinstance(blk, Block) and blk.pool is pool and not blk.freed
    assert blk.nbytes == 3 * 224 * 4 and blk.size == rounded(3 * 224 * 4)
    assert "conv1.out" in repr(blk) and "feature_map" in repr(blk)
    s = pool.stats()
    assert s["allocated_bytes.current"] == blk.size == s["allocated_bytes.feature_map.current"]
    pool.free(blk)
    assert blk.freed and pool.stats()["allocated_bytes.current"] == 0
    pool.check_invariants()


def test_rounding_and_zero_bytes():
    pool = Pool(MetaDevice())
    assert [pool.allocate(n).size for n in (0, 1, 511, 512, 513, 1024)] == \
        [512, 512, 512, 512, 1024, 1024]
    pool = Pool(MetaDevice(), alignment=64)
    assert [pool.allocate(n).size for n in (0, 1, 64, 65)] == [64, 64, 64, 128]
    with pytest.raises(ValueError, match="power of two"):
        Pool(MetaDevice(), alignment=384)
    with pytest.raises(ValueError, match="best_fit, first_fit"):
        Pool(MetaDevice(), policy="worst_fit")
    with pytest.raises(ValueError, match="negative"):
        pool.allocate(-1)


def test_categories():
    assert set(CATEGORIES) == {"parameter", "gradient", "optimizer_state", "feature_map",
                               "gradient_map", "workspace", "stash", "input", "encoded"}
    pool = Pool(MetaDevice())
    with pytest.raises(ValueError) as e:
        pool.allocate(10, category="activations")
    assert all(c in str(e.value) for c in CATEGORIES)
    assert pool.stats()["num_allocs"] == 0
    for c in CATEGORIES:
        pool.allocate(1000, category=c)
    s = pool.stats()
    for c in CATEGORIES:
        assert s[f"allocated_bytes.{c}.current"] == 1024 == s[f"allocated_bytes.{c}.peak"]
    assert pool.allocate(5).category == "workspace"


def test_best_fit_and_first_fit_choices():
    for policy, expect in (("best_fit", 3), ("first_fit", 1)):
        pool = Pool(MetaDevice(), policy=policy)
        b = [pool.allocate(n) for n in (512, 2048, 512, 1024, 512, 512)]
        pool.free(b[1])  # hole of 2048 at 1024
        pool.free(b[3])  # hole of 1024 at 3584
        blk = pool.allocate(1000)
        assert blk.offset == b[expect].offset, policy
        pool.check_invariants()


def test_top_region_used_only_when_no_hole_fits():
    pool = Pool(MetaDevice())
    a = pool.allocate(4096)
    pool.allocate(512)
    pool.free(a)
    big = pool.allocate(8192)  # hole too small: from the top, not the (huge) top region first
    assert big.offset == 4096 + 512
    small = pool.allocate(2048)  # fits the hole
    assert small.offset == 0
    pool.check_invariants()


def test_merging_both_sides_and_into_top():
    pool = Pool(MetaDevice())
    b = [pool.allocate(512 * (i + 1)) for i in range(5)]
    pool.free(b[1])
    pool.free(b[3])
    assert len(pool.free_chunks()) == 2
    pool.free(b[2])  # merges with both neighbours
    assert pool.free_chunks() == [(b[1].offset, b[1].size + b[2].size + b[3].size)]
    pool.free(b[4])  # last block: its chunk and the hole below merge into the top
    assert pool.free_chunks() == [] and pool.top == b[0].size
    pool.free(b[0])
    assert pool.top == 0
    pool.check_invariants()


def test_placement_independent_of_capacity():
    rng = np.random.default_rng(7)
    trace, live, key = [], [], 0
    for _ in range(3000):
        if live and rng.random() < 0.48:
            trace.append(("free", live.pop(int(rng.integers(len(live))))))
        else:
            trace.append(("alloc", key, int(rng.integers(0, 200_000)), f"t{key}", "workspace"))
            live.append(key)
            key += 1
    for policy in ("best_fit", "first_fit"):
        ref_pool = Pool(MetaDevice(), policy=policy)
        ref = replay(ref_pool, trace)
        need = ref_pool.stats()["reserved_bytes.peak"]
        for cap in (need, need + 512, 2 * need, 1 << 40):
            pool = Pool(MetaDevice(cap), policy=policy)
            assert replay(pool, trace) == ref
            pool.check_invariants()
        with pytest.raises(DeviceOutOfMemory):  # one byte less than the peak span is too little
            replay(Pool(MetaDevice(need - 1), policy=policy), trace)


# --------------------------------------------------------------------------- errors


def test_double_foreign_and_use_after_free():
    pool, other = Pool(MetaDevice()), Pool(MetaDevice())
    blk = pool.allocate(100, tag="x")
    with pytest.raises(ForeignBlockError, match="another pool"):
        other.free(blk)
    assert issubclass(ForeignBlockError, PoolError) and issubclass(PoolError, RuntimeError)
    v = blk.view((5,))
    assert v.shape == (5,)
    with pytest.raises(ValueError, match="needs 104 bytes"):
        blk.view((26,))
    pool.free(blk)
    with pytest.raises(DoubleFreeError, match="double free"):
        pool.free(blk)
    with pytest.raises(UseAfterFreeError, match="use after free"):
        blk.view((5,))
    s = pool.stats()
    assert s["num_frees"] == 1 and s["allocated_bytes.current"] == 0
    pool.check_invariants()
    other.check_invariants()


def test_oom_message_and_state_unchanged():
    pool = Pool(CpuDevice("64KiB"))
    blocks = [pool.allocate(8 * KiB, tag=f"layer{i}.out", category="feature_map")
              for i in range(6)]
    big = pool.allocate(12 * KiB, tag="conv9.ws", category="workspace")
    pool.free(blocks[1])
    pool.free(blocks[3])
    before_stats = pool.stats()
    before_chunks = pool.free_chunks()
    before_live = [(b.offset, b.size) for b in pool.live_blocks()]
    with pytest.raises(DeviceOutOfMemory) as e:
        pool.allocate(20_000, tag="fc6.out", category="feature_map")
    err = e.value
    assert isinstance(err, MemoryError)
    msg = str(err)
    for text in ("fc6.out", "feature_map", "20480 bytes", "20.00 KiB", "64.00 KiB",
                 "65536 bytes", "in use", "free", "largest free block", "fragmentation",
                 "conv9.ws (workspace): 12.00 KiB (12288 bytes)", "layer0.out (feature_map)"):
        assert text in msg, text
    free = 64 * KiB - 48 * KiB - 12 * KiB + 16 * KiB
    assert err.requested == 20480 and err.capacity == 65536
    assert err.allocated == 44 * KiB and err.free == free == 20 * KiB
    assert err.largest_free_block == 8 * KiB
    assert err.fragmentation == pytest.approx(1 - 8 / 20)
    assert err.largest_live[0] == ("conv9.ws", "workspace", 12 * KiB)
    assert len(err.largest_live) == 5 and err.tag == "fc6.out" and err.category == "feature_map"
    clone = pickle.loads(pickle.dumps(err))
    assert str(clone) == msg and clone.largest_live == err.largest_live
    after = pool.stats()
    assert after.pop("num_ooms") == before_stats.pop("num_ooms") + 1
    assert after == before_stats
    assert pool.free_chunks() == before_chunks
    assert [(b.offset, b.size) for b in pool.live_blocks()] == before_live
    pool.check_invariants()
    # the pool works normally afterwards
    a = pool.allocate(8 * KiB)
    assert a.offset == blocks[1].offset
    pool.free(big)
    pool.free(blocks[5])  # both merge into the top region: 24 KiB at the top
    c = pool.allocate(20_000, tag="fc6.out", category="feature_map")
    assert c.offset == blocks[5].offset and pool.stats()["num_ooms"] == 1
    pool.check_invariants()


def test_oom_on_unaligned_capacity():
    pool = Pool(MetaDevice(1000))
    pool.allocate(1)
    with pytest.raises(DeviceOutOfMemory):
        pool.allocate(1)
    assert pool.stats()["free_bytes"] == 1000 - 512
    pool.check_invariants()


# --------------------------------------------------------------------------- fixed offsets


def test_fixed_offsets():
    pool = Pool(MetaDevice(64 * KiB))
    a = pool.allocate(1024, tag="a", offset=4096)  # in the top region, leaves a hole below
    assert a.offset == 4096 and pool.free_chunks() == [(0, 4096)] and pool.top == 5120
    b = pool.allocate(1024, tag="b", offset=1024)  # inside the hole: split in three
    assert b.offset == 1024 and pool.free_chunks() == [(0, 1024), (2048, 2048)]
    c = pool.allocate(2048, tag="c", offset=2048)  # exactly the second hole
    assert c.offset == 2048 and pool.free_chunks() == [(0, 1024)]
    pool.check_invariants()
    with pytest.raises(PlacementError, match="alignment"):
        pool.allocate(512, offset=100)
    with pytest.raises(PlacementError, match="not free") as e:
        pool.allocate(2048, tag="d", offset=0)  # runs into b
    assert "'b'" in str(e.value)
    with pytest.raises(PlacementError, match="not free"):
        pool.allocate(512, offset=4096 + 512)  # inside a
    assert issubclass(PlacementError, ValueError)
    with pytest.raises(DeviceOutOfMemory):
        pool.allocate(2048, offset=63 * KiB)  # free, but beyond the capacity
    s = pool.stats()
    assert s["num_allocs"] == 3 and s["num_ooms"] == 1 and s["reserved_bytes.current"] == 5120
    pool.check_invariants()
    for blk in (a, b, c):
        pool.free(blk)
    assert pool.free_chunks() == [] and pool.top == 0
    pool.check_invariants()


# --------------------------------------------------------------------------- debug, stats


def test_debug_poisons_freed_blocks_with_nan():
    pool = Pool(CpuDevice("64KiB"), debug=True)
    a = pool.allocate(4096, tag="a")
    b = pool.allocate(4096, tag="b")
    va, vb = a.view((1024,)), b.view((1024,))
    va[...] = 1.0
    vb[...] = 2.0
    pool.free(a)
    assert np.all(np.isnan(va))  # a stale view reads NaN
    assert np.all(vb == 2.0)  # neighbours untouched
    no_debug = Pool(CpuDevice("64KiB"))
    c = no_debug.allocate(4096)
    vc = c.view((1024,))
    vc[...] = 3.0
    no_debug.free(c)
    assert np.all(vc == 3.0)


def test_stats_definitions_and_peaks():
    pool = Pool(MetaDevice(64 * KiB))
    s = pool.stats()
    for key in ("allocated_bytes.current", "allocated_bytes.peak", "reserved_bytes.current",
                "reserved_bytes.peak", "active_blocks", "num_allocs", "num_frees", "num_ooms",
                "fragmentation", "capacity", "free_bytes", "largest_free_block"):
        assert key in s
    assert s["fragmentation"] == 0.0 and s["largest_free_block"] == 64 * KiB
    a = pool.allocate(16 * KiB, category="feature_map")
    b = pool.allocate(8 * KiB, category="workspace")
    c = pool.allocate(8 * KiB, category="feature_map")
    pool.free(b)
    s = pool.stats()
    assert s["allocated_bytes.current"] == 24 * KiB and s["allocated_bytes.peak"] == 32 * KiB
    assert s["reserved_bytes.current"] == 32 * KiB == s["reserved_bytes.peak"]
    assert s["free_bytes"] == 40 * KiB and s["largest_free_block"] == 32 * KiB
    assert s["fragmentation"] == pytest.approx(1 - 32 / 40)
    assert s["allocated_bytes.workspace.current"] == 0
    assert s["allocated_bytes.workspace.peak"] == 8 * KiB
    assert s["active_blocks"] == 2 and s["num_allocs"] == 3 and s["num_frees"] == 1
    assert pool.allocated_bytes == 24 * KiB and pool.reserved_bytes == 32 * KiB
    pool.free(c)
    s = pool.stats()
    assert s["reserved_bytes.current"] == 16 * KiB and s["reserved_bytes.peak"] == 32 * KiB
    pool.reset_peak_stats()
    s = pool.stats()
    assert s["allocated_bytes.peak"] == 16 * KiB == s["reserved_bytes.peak"]
    assert s["allocated_bytes.workspace.peak"] == 0
    assert s["allocated_bytes.feature_map.peak"] == 16 * KiB
    pool.free(a)
    assert pool.stats()["fragmentation"] == 0.0
    full = Pool(MetaDevice(1024))
    full.allocate(1024)
    assert full.stats()["fragmentation"] == 0.0 and full.stats()["free_bytes"] == 0


def test_stats_at_peak():
    pool = Pool(MetaDevice())
    assert pool.stats_at_peak() == {"allocated_bytes": 0, "by_category": {}, "live": []}
    x = pool.allocate(4096, tag="x", category="input")
    f1 = pool.allocate(8192, tag="conv1.out", category="feature_map")
    ws = pool.allocate(2048, tag="conv1.ws", category="workspace")
    pool.free(ws)  # the peak was here: x + f1 + ws
    f2 = pool.allocate(1024, tag="conv2.out", category="feature_map")
    pool.free(f1)
    expect = {"allocated_bytes": 14336,
              "by_category": {"input": 4096, "feature_map": 8192, "workspace": 2048},
              "live": [("conv1.out", "feature_map", 8192), ("x", "input", 4096),
                       ("conv1.ws", "workspace", 2048)]}
    assert pool.stats_at_peak() == expect
    big = pool.allocate(1 << 20, tag="fc.out", category="feature_map")
    snap = pool.stats_at_peak()  # taken lazily on request
    assert snap["allocated_bytes"] == 4096 + 1024 + (1 << 20)
    assert snap["live"][0] == ("fc.out", "feature_map", 1 << 20)
    for b in (x, f2, big):
        pool.free(b)
    assert pool.stats_at_peak() == snap


def test_memory_summary():
    pool = Pool(CpuDevice("1MiB"), policy="first_fit")
    pool.allocate(300 * KiB, tag="w", category="parameter")
    text = pool.memory_summary()
    for word in ("allocated", "reserved", "fragmentation", "first_fit", "1.00 MiB",
                 "300.00 KiB", *CATEGORIES):
        assert word in text
    assert "unlimited" in Pool(MetaDevice()).memory_summary()


def test_free_deferred():
    pool = Pool(MetaDevice())
    a = pool.allocate(1000)
    pool.free_deferred(a)
    assert not a.freed
    assert pool.stats()["active_blocks"] == 0 and a.freed
    b = pool.allocate(1000)
    pool.free_deferred(b)
    c = pool.allocate(1000)  # drained first, so b's bytes are reused
    assert c.offset == b.offset == 0
    del c
    gc.collect()


def test_many_blocks_performance_smoke():
    # Not a timing test: a long random run keeps the structure consistent for both policies.
    rng = np.random.default_rng(11)
    for policy in ("best_fit", "first_fit"):
        pool = Pool(MetaDevice(), policy=policy)
        live: list[Block] = []
        for _ in range(20_000):
            if live and rng.random() < 0.5:
                pool.free(live.pop(int(rng.integers(len(live)))))
            else:
                live.append(pool.allocate(int(rng.integers(0, 1 << 20))))
        pool.check_invariants()

"""The device library's temporaries: a scratch block sized by its footprint, not its live bytes."""

from __future__ import annotations

from minidl.memory.devices.device import MetaDevice
from minidl.memory.runtime.pool import Pool
from minidl.memory.runtime.scratch import TemporaryRouter


def _fragmenting(router: TemporaryRouter) -> None:
    """1000 B, 1000 B, free the first, 1500 B: 2560 B live at most (in 512-byte units), but
    the 1536-byte block does not fit the 1024-byte hole: 3584 B of scratch needed."""
    _, free_a = router.allocate(1000)
    _, free_b = router.allocate(1000)
    free_a()
    _, free_c = router.allocate(1500)
    free_b()
    free_c()


def test_the_footprint_is_the_reserved_peak_not_the_live_peak():
    pool = Pool(MetaDevice(1 << 20))
    measuring = TemporaryRouter(pool, None)  # the first step: temporaries from the pool
    _fragmenting(measuring)
    assert measuring.peak_live == 2560
    assert measuring.footprint == 3584


def test_a_scratch_block_of_the_footprint_holds_the_same_sequence():
    pool = Pool(MetaDevice(1 << 20))
    measuring = TemporaryRouter(pool, None)
    _fragmenting(measuring)
    scratch = pool.allocate(measuring.footprint, tag="cupy.scratch")
    router = TemporaryRouter(pool, (scratch.offset, scratch.size))
    before = pool.allocated_bytes
    _fragmenting(router)
    assert router.overflow_bytes == 0 and pool.allocated_bytes == before


def test_what_does_not_fit_the_scratch_block_comes_from_the_pool_and_is_counted():
    """Sized by live bytes (2560 B), the same sequence overflows: the 1536-byte temporary is
    taken from the pool instead of failing (an evaluation at a larger batch, for instance)."""
    pool = Pool(MetaDevice(1 << 20))
    scratch = pool.allocate(2560, tag="cupy.scratch")
    router = TemporaryRouter(pool, (scratch.offset, scratch.size))
    offsets = []
    _, free_a = router.allocate(1000)
    off_b, free_b = router.allocate(1000)
    free_a()
    off_c, free_c = router.allocate(1500)
    offsets += [off_b, off_c]
    assert router.overflow_bytes == 1536
    assert not scratch.offset <= off_c < scratch.offset + scratch.size
    assert scratch.offset <= off_b < scratch.offset + scratch.size
    free_b()
    free_c()
    pool.allocate(1)  # (deferred frees are drained at the next call)
    assert router.live == 0 and router.footprint == 3584

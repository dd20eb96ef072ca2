"""The strict test device refuses what CuPy refuses, reading CuPy's API from the cupy package."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("cupy")

from minidl.memory.runtime.pool import Pool  # noqa: E402
from minidl.memory.runtime.transfer import copy_into, to_host  # noqa: E402
from minidl.memory.testing.strict_device import StrictArray, StrictCudaDevice, StrictCupyError  # noqa: E402


@pytest.fixture
def dev():
    return StrictCudaDevice("1MiB")


def _array(dev, offset, values):
    values = np.asarray(values, np.float32)
    a = dev.view(offset, values.nbytes, values.shape, np.float32)
    dev.copy_from_host(a, values)
    return a


def test_no_implicit_conversion_to_numpy(dev):
    a = _array(dev, 0, [1.0, -2.0])
    for convert in (np.asarray, np.array, lambda x: np.ascontiguousarray(x)):
        with pytest.raises(TypeError, match="Implicit conversion"):
            convert(a)
    assert np.array_equal(a.get(), [1.0, -2.0]) and np.array_equal(to_host(a), [1.0, -2.0])


def test_host_arrays_are_refused_as_operands_values_and_indices(dev):
    a = _array(dev, 0, np.arange(4))
    host = np.ones(4, np.float32)
    with pytest.raises(StrictCupyError, match="NumPy array"):
        np.add(a, host)
    with pytest.raises(StrictCupyError, match="implicit host-to-device"):
        a[...] = host
    with pytest.raises(StrictCupyError, match="implicit host-to-device"):
        a[...] = [1, 2, 3, 4]
    with pytest.raises(StrictCupyError, match="index"):
        a[np.array([0, 1])]
    copy_into(a, host)  # the explicit way
    assert np.array_equal(a.get(), host)


def test_keywords_are_checked_against_cupy(dev):
    a = _array(dev, 0, [1.0, 2.0])
    b = dev.view(512, 8, (2,), np.float32)
    np.add(a, 1, out=b)  # CuPy's ufuncs take out, dtype, casting
    assert np.array_equal(b.get(), [2.0, 3.0])
    with pytest.raises(StrictCupyError, match="where"):
        np.add(a, 1, where=True)  # CuPy's ufuncs have no where=
    with pytest.raises(StrictCupyError, match="mode"):
        np.take(a, 0, mode="clip")  # cupy.take(a, indices, axis, out)
    with pytest.raises(StrictCupyError, match="where"):
        a.sum(where=True)
    with pytest.raises(AttributeError):
        a.ctypes  # noqa: B018  (a host pointer; CuPy arrays have none)


def test_reductions_are_zero_d_device_arrays(dev):
    a = _array(dev, 0, [1.0, 2.0, 4.0])
    s = a.sum()
    assert isinstance(s, StrictArray) and s.shape == ()
    assert float(s) == 7.0 and bool(a.max() > 3)
    assert np.array_equal(np.maximum(a, 2).get(), [2, 2, 4])


def test_temporaries_come_from_the_routed_allocator(dev):
    a = _array(dev, 0, [1.0, 2.0])
    t = a * 2
    assert dev.default_pool_bytes == 512  # CuPy's own pool, outside the arena
    del t
    assert dev.default_pool_bytes == 0
    pool = Pool(dev)
    taken = []

    def allocate(nbytes):
        blk = pool.allocate(nbytes, tag="cupy.temp")
        taken.append(blk)
        return blk.offset, lambda: pool.free_deferred(blk)

    with dev.route_allocations(allocate):
        t = a + 1
    assert dev.default_pool_bytes == 0 and len(taken) == 1
    assert np.array_equal(t.get(), [2.0, 3.0])
    off = taken[0].offset
    assert np.array_equal(dev.view(off, 8, (2,), np.float32).get(), [2.0, 3.0])  # in the arena


def test_views_share_memory_and_keep_the_type(dev):
    a = _array(dev, 0, np.arange(6))
    v = a.reshape(2, 3)[:, 1]
    assert isinstance(v, StrictArray) and dev.default_pool_bytes == 0
    v[...] = 0
    assert np.array_equal(a.get(), [0, 0, 2, 3, 0, 5])


def test_pinned_buffers_are_ordered_too():
    """A host-to-device copy reading the pinned buffer a device-to-host copy is still writing
    races (one copy stream per direction); ordered through the compute stream, as the memory
    runtime does (compute waits for the offload, later copies wait for compute), it does not."""
    from minidl.memory.testing.stream_model import StreamRace

    dev = StrictCudaDevice("1MiB")
    x = _array(dev, 0, np.arange(256))
    y = dev.view(1024, 1024, (256,), np.float32)
    host = dev.host_empty((256,), np.float32)
    eng = dev.copy_engine
    eng.copy_async(host, x)
    with pytest.raises(StreamRace, match="h2d copy .* d2h copy"):
        eng.copy_async(y, host)
    dev = StrictCudaDevice("1MiB")
    x = _array(dev, 0, np.arange(256))
    y = dev.view(1024, 1024, (256,), np.float32)
    eng = dev.copy_engine
    eng.copy_async(host, x).order_compute()
    eng.copy_async(y, host)
    assert np.array_equal(y.get(), np.arange(256))


def test_host_synchronisations_and_launches_are_counted(dev):
    a = _array(dev, 0, [1.0, 2.0, 3.0])
    syncs, launches = dev.host_syncs, dev.launches
    b = a.reshape(3, 1)[:, 0]  # views launch nothing
    assert dev.launches == launches
    s = b.sum()  # a reduction: one launch, no wait
    assert dev.launches == launches + 1 and dev.host_syncs == syncs
    assert float(s) == 6.0 and dev.host_syncs == syncs + 1  # reading it waits
    pending = dev.fetch_async(s)
    assert not pending.ready() and dev.host_syncs == syncs + 1
    assert pending.result()[()] == 6.0 and dev.host_syncs == syncs + 2
    assert pending.ready()


def test_a_second_device_refuses_work_while_another_is_current():
    one = StrictCudaDevice("1MiB", device_id=1)
    a = one.view(0, 16, (4,), np.float32)
    with pytest.raises(StrictCupyError, match="cuda:1 ran while cuda:0"):
        a.fill(1.0)
    with one.activate():
        a.fill(1.0)
        assert float(a.sum()) == 4.0

"""Devices: capacity checks, typed aligned views, the copy engine, the meta device."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from minidl.memory import (
    CopyEngine,
    CpuDevice,
    MetaDevice,
    Pool,
    make_device,
)
from minidl.memory.devices.device import MetaArray, available_host_memory
from minidl.memory.ir.units import ALLOCATION_UNIT
from minidl.memory.runtime.pool import replay


@pytest.mark.parametrize("bad", [0, -1, "0", "-4MiB", "lots", "12 parsecs", None, 2.5])
def test_cpu_capacity_refused(bad):
    with pytest.raises(ValueError, match="invalid size"):
        CpuDevice(bad)


def test_cpu_capacity_larger_than_host_memory():
    avail = available_host_memory()
    too_big = 2 * avail + (1 << 30)
    with pytest.raises(ValueError) as e:
        CpuDevice(too_big)
    msg = str(e.value)
    assert str(too_big) in msg and "available" in msg
    assert any(ch.isdigit() for ch in msg.split("available memory")[1])


def test_cpu_capacity_parsed_and_arena_aligned():
    with CpuDevice("1MiB") as dev:
        assert dev.capacity == 1 << 20
        assert dev.name == "cpu" and dev.has_storage and dev.xp is np
        assert dev.arena.dtype == np.uint8 and dev.arena.size == 1 << 20
        assert dev.arena.ctypes.data % ALLOCATION_UNIT == 0


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int8, np.int32, np.float16])
def test_cpu_views_typed_aligned_and_shared(dtype):
    dev = CpuDevice("64KiB")
    a = dev.view(1024, 4096, (8, 16), dtype)
    assert a.dtype == np.dtype(dtype) and a.shape == (8, 16)
    assert a.ctypes.data == dev.arena.ctypes.data + 1024
    assert a.ctypes.data % 512 == 0 and a.flags.c_contiguous and a.flags.writeable
    a[...] = 7
    b = dev.view(1024, 4096, 128, dtype)  # the same bytes
    assert np.all(b == 7)
    assert dev.view(0, 4, (), np.float32).shape == ()
    assert dev.view(0, 0, (0, 3), np.float32).size == 0


def test_cpu_view_checks():
    dev = CpuDevice("8KiB")
    with pytest.raises(ValueError, match="needs 4096 bytes"):
        dev.view(0, 4095, (1024,), np.float32)
    with pytest.raises(ValueError, match="outside"):
        dev.view(8192 - 512, 1024, (16,), np.float32)
    with pytest.raises(ValueError, match="negative"):
        dev.view(0, 512, (-1, 4), np.float32)
    dev.close()
    with pytest.raises(RuntimeError, match="closed"):
        dev.view(0, 512, (4,), np.float32)


def test_cpu_fill():
    dev = CpuDevice("4KiB")
    dev.fill(0, 1024, float("nan"))
    assert np.all(np.isnan(dev.view(0, 1024, 256, np.float32)))
    assert np.all(dev.view(0, 1024, 256, np.uint32) == 0x7FC00000)
    dev.fill(512, 512, 0xAB)
    assert np.all(dev.view(512, 512, 512, np.uint8) == 0xAB)
    assert np.all(np.isnan(dev.view(0, 512, 128, np.float32)))


def test_host_empty_is_ordinary_memory():
    dev = CpuDevice("4KiB")
    h = dev.host_empty((3, 5), np.float64)
    assert h.shape == (3, 5) and h.dtype == np.float64
    assert not np.shares_memory(h, dev.arena)


# --------------------------------------------------------------------------- copies


def test_copy_roundtrip_device_host_device_bit_exact():
    rng = np.random.default_rng(0)
    with CpuDevice("8MiB") as dev:
        pool = Pool(dev)
        shape = (64, 1024)
        src_blk = pool.allocate(64 * 1024 * 4, tag="x", category="feature_map")
        dst_blk = pool.allocate(64 * 1024 * 4, tag="y", category="feature_map")
        x = src_blk.view(shape)
        x[...] = rng.standard_normal(shape, dtype=np.float32)
        x[0, :4] = [np.nan, np.inf, -0.0, 1e-45]  # special values survive
        host = dev.host_empty(shape)
        eng = dev.copy_engine
        assert eng is dev.copy_engine
        e1 = eng.copy_async(host, x)
        e1.wait()
        assert e1.done() and e1.nbytes == x.nbytes and e1.elapsed_s >= 0
        y = dst_blk.view(shape)
        e2 = eng.copy_async(y, host)
        e2.wait()
        assert x.tobytes() == host.tobytes() == y.tobytes()
        assert eng.total_bytes == 2 * x.nbytes and eng.num_copies == 2 and eng.busy_s >= 0


def test_many_copies_in_flight_fifo_and_poll():
    rng = np.random.default_rng(1)
    with CopyEngine() as eng:
        srcs = [rng.integers(0, 255, size=(257 + i,), dtype=np.uint8) for i in range(200)]
        dsts = [np.zeros_like(s) for s in srcs]
        events = [eng.copy_async(d, s) for d, s in zip(dsts, srcs, strict=True)]
        # FIFO: once the last one is done, all earlier ones are done
        events[-1].wait(timeout=10)
        assert all(e.done() for e in events)
        for d, s in zip(dsts, srcs, strict=True):
            assert np.array_equal(d, s)
        # the same destination written twice in order: the second copy wins
        d = np.zeros(1 << 20, np.float32)
        eng.copy_async(d, np.ones_like(d))
        last = eng.copy_async(d, np.full_like(d, 2.0))
        while not last.done():  # poll
            pass
        assert np.all(d == 2.0)
        eng.synchronize()
    assert eng.closed
    with pytest.raises(RuntimeError, match="closed"):
        eng.copy_async(d, d)


def test_copy_overlaps_with_caller():
    # A large copy runs on the worker while this thread keeps running.
    big = np.ones(16 << 20, np.uint8)
    out = np.empty_like(big)
    with CopyEngine() as eng:
        ev = eng.copy_async(out, big)
        assert isinstance(ev.done(), bool)
        ev.wait(timeout=30)
    assert np.array_equal(out, big)


def test_copy_errors():
    with CopyEngine() as eng:
        with pytest.raises(ValueError, match="same shape"):
            eng.copy_async(np.zeros(3), np.zeros(4))
        with pytest.raises(ValueError, match="same shape and dtype"):
            eng.copy_async(np.zeros(3, np.float32), np.zeros(3, np.float64))
        ro = np.zeros(8)
        ro.flags.writeable = False
        ev = eng.copy_async(ro, np.ones(8))
        with pytest.raises(ValueError):
            ev.wait(timeout=10)
        assert ev.done()
        with pytest.raises(ValueError):
            eng.synchronize()  # the error is reported once more, then cleared
        eng.synchronize()
        ok = eng.copy_async(np.zeros(8), np.ones(8))
        ok.wait()


def _copy_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "minidl-lazy-test"]


def test_copy_engine_thread_lazy_daemon_and_closed():
    eng = CopyEngine("lazy-test")
    assert _copy_threads() == []  # no thread until the first copy
    eng.copy_async(np.zeros(4), np.ones(4)).wait()
    (t,) = _copy_threads()
    assert t.daemon and t.is_alive()
    eng.close()
    eng.close()
    assert not t.is_alive()


def test_copy_engine_stops_when_collected():
    import gc

    eng = CopyEngine("lazy-test")
    eng.copy_async(np.zeros(4), np.ones(4)).wait()
    (t,) = _copy_threads()
    del eng
    gc.collect()
    t.join(timeout=5)
    assert not t.is_alive()


# --------------------------------------------------------------------------- meta


def test_meta_device_has_no_storage():
    dev = MetaDevice()
    assert dev.name == "meta" and not dev.has_storage and dev.capacity == 1 << 62
    assert MetaDevice("1GiB").capacity == 1 << 30
    a = dev.view(512, 4096, (4, 256), np.float32)
    assert isinstance(a, MetaArray)
    assert a.shape == (4, 256) and a.dtype == np.float32 and a.nbytes == 4096
    assert a.size == 1024 and a.ndim == 2 and a.reshape(-1, 4).shape == (256, 4)
    with pytest.raises(ValueError, match="needs"):
        dev.view(0, 100, (4, 256), np.float32)
    h = dev.host_empty((4, 256))
    ev = dev.copy_engine.copy_async(h, a)
    assert ev.done() and ev.elapsed_s == 0.0 and ev.nbytes == 4096
    ev.wait()
    dev.copy_engine.synchronize()
    dev.fill(0, 512, float("nan"))  # no-op
    pool = Pool(dev)
    blk = pool.allocate(3 * 5 * 8, tag="t", category="feature_map")
    v = blk.view((3, 5), np.float64)
    assert v.shape == (3, 5) and v.dtype == np.float64


def _trace(seed: int, n: int = 400):
    rng = np.random.default_rng(seed)
    live: list[int] = []
    events = []
    key = 0
    for _ in range(n):
        if live and rng.random() < 0.45:
            k = live.pop(int(rng.integers(len(live))))
            events.append(("free", k))
        else:
            size = int(rng.integers(0, 20_000))
            events.append(("alloc", key, size, f"t{key}", "feature_map"))
            live.append(key)
            key += 1
    return events


@pytest.mark.parametrize("policy", ["best_fit", "first_fit"])
def test_meta_places_like_cpu(policy):
    trace = _trace(3)
    meta = Pool(MetaDevice(), policy=policy)
    offsets_meta = replay(meta, trace)
    need = meta.stats()["reserved_bytes.peak"]
    cpu = Pool(CpuDevice(need), policy=policy)  # exactly the dry run's reserved peak suffices
    offsets_cpu = replay(cpu, trace)
    assert offsets_meta == offsets_cpu
    sm, sc = meta.stats(), cpu.stats()
    for k in ("allocated_bytes.peak", "reserved_bytes.peak", "allocated_bytes.current",
              "num_allocs", "num_frees"):
        assert sm[k] == sc[k]
    assert meta.stats_at_peak() == cpu.stats_at_peak()


def test_make_device():
    assert make_device("cpu", "1MiB").capacity == 1 << 20
    assert make_device("CPU").capacity == 256 << 20
    assert make_device("meta").capacity == 1 << 62
    assert make_device("meta", "2GiB").capacity == 2 << 30
    with pytest.raises(ValueError, match="cpu, meta, cuda"):
        make_device("tpu", "1MiB")
    with pytest.raises(ValueError, match="invalid size"):
        make_device("cpu", "much")


def test_make_device_auto_capacity():
    from minidl.memory.device_factory import AUTO_STRICT_CAPACITY, auto_host_capacity

    cpu = make_device("cpu", "auto")
    assert cpu.capacity % (1 << 20) == 0 and cpu.capacity <= available_host_memory()
    assert abs(cpu.capacity - auto_host_capacity()) <= 64 << 20
    assert make_device("meta", "AUTO").capacity == 1 << 62
    assert make_device("cuda-strict", "auto").capacity == AUTO_STRICT_CAPACITY

"""The CUDA device. GPU tests carry ``@pytest.mark.gpu`` (skipped without CUDA)."""

from __future__ import annotations

import gc
import subprocess
import sys

import numpy as np
import pytest

from minidl.memory import Pool, make_device

# --------------------------------------------------------------------------- without a GPU


def test_importing_memory_does_not_import_cupy():
    code = ("import sys, minidl.memory as m; m.CudaDevice; "
            "assert 'cupy' not in sys.modules, 'cupy imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_clear_error_without_cupy(monkeypatch):
    from minidl.memory import CudaDevice

    monkeypatch.setitem(sys.modules, "cupy", None)  # makes ``import cupy`` fail
    with pytest.raises(RuntimeError, match="needs CuPy"):
        CudaDevice("1MiB")
    with pytest.raises(RuntimeError, match="needs CuPy"):
        make_device("cuda", "1MiB")


def test_make_device_cuda_arguments():
    with pytest.raises(ValueError, match="needs a capacity"):
        make_device("cuda")
    with pytest.raises(ValueError, match="cuda:<integer id>"):
        make_device("cuda:first", "1MiB")


def test_routing_is_per_thread_and_nests_inside_using_allocator():
    """CuPy's set_allocator is process-wide (another thread's arrays would land in the pool,
    which is not thread-safe) and refuses to run inside using_allocator: the routing uses the
    per-thread form."""
    import threading

    cp = pytest.importorskip("cupy")
    from types import SimpleNamespace

    from minidl.memory.devices.cuda_device import route_allocations

    device = SimpleNamespace(_cp=cp, base_ptr=1 << 40, device_id=0)
    seen = {}
    outer = cp.cuda.get_allocator()

    def other_thread():
        seen["allocator"] = cp.cuda.get_allocator()

    def allocate(nbytes):
        return 0, lambda: None

    with cp.cuda.using_allocator(lambda n: None):  # a caller's own scoped allocator
        inside = cp.cuda.get_allocator()
        with route_allocations(device, allocate):
            t = threading.Thread(target=other_thread)
            t.start()
            t.join()
            assert cp.cuda.get_allocator() is not inside
        assert cp.cuda.get_allocator() is inside
    assert seen["allocator"] is outer  # the other thread never saw the routing


def test_cupy_allocations_routed_into_the_arena_without_a_gpu():
    """Real CuPy (no GPU needed to allocate through a custom allocator): arrays CuPy creates
    inside route_allocations sit at arena offsets and give their bytes back when freed."""
    cp = pytest.importorskip("cupy")
    from types import SimpleNamespace

    from minidl.memory.devices.cuda_device import route_allocations

    device = SimpleNamespace(_cp=cp, base_ptr=1 << 40, device_id=0)  # a fake arena address
    events = []

    def allocate(nbytes):
        events.append(("alloc", nbytes))
        return 4096 * len(events), lambda: events.append(("free", nbytes))

    previous = cp.cuda.get_allocator()
    with route_allocations(device, allocate):
        a = cp.empty((10,), np.float32)
        assert a.data.ptr == (1 << 40) + 4096
        del a
        gc.collect()
    assert events == [("alloc", 40), ("free", 40)]
    assert cp.cuda.get_allocator() is previous


# --------------------------------------------------------------------------- on a GPU


@pytest.mark.gpu
def test_views_into_the_arena():
    import cupy as cp

    from minidl.memory import CudaDevice

    with CudaDevice("4MiB") as dev:
        assert dev.xp is cp and dev.has_storage and dev.name == "cuda"
        pool = Pool(dev)
        a = pool.allocate(4096, tag="a", category="feature_map")
        b = pool.allocate(4096, tag="b", category="feature_map")
        va, vb = a.view((32, 32)), b.view((1024,), np.int32)
        assert isinstance(va, cp.ndarray) and va.dtype == np.float32
        assert va.data.ptr == dev.base_ptr + a.offset and vb.data.ptr == dev.base_ptr + b.offset
        va[...] = 3.0
        vb[...] = 7
        assert float(va.sum()) == 3.0 * 1024 and int(vb.sum()) == 7 * 1024
        with pytest.raises(ValueError, match="needs"):
            a.view((2000,))


@pytest.mark.gpu
def test_copy_roundtrip_pinned_bit_exact():
    import cupy as cp

    from minidl.memory import CudaDevice

    rng = np.random.default_rng(0)
    with CudaDevice("16MiB", pinned_capacity="8MiB") as dev:
        pool = Pool(dev)
        shape = (256, 1024)
        x = pool.allocate(shape[0] * shape[1] * 4).view(shape)
        y = pool.allocate(shape[0] * shape[1] * 4).view(shape)
        x[...] = cp.asarray(rng.standard_normal(shape, dtype=np.float32))
        dev.synchronize()
        host = dev.host_empty(shape)
        eng = dev.copy_engine
        e1 = eng.copy_async(host, x)
        # each direction has its own copy stream: the host-to-device copy reading `host` must
        # follow the device-to-host copy writing it (through compute, as the runtime orders)
        e1.order_compute()
        e2 = eng.copy_async(y, host)
        e2.wait()
        assert e1.done() and e2.done() and e1.nbytes == x.nbytes
        assert e1.elapsed_s is not None and e1.elapsed_s >= 0
        assert cp.asnumpy(x).tobytes() == host.tobytes() == cp.asnumpy(y).tobytes()
        events = [eng.copy_async(host, x) for _ in range(50)]
        eng.synchronize()
        assert all(e.done() for e in events)
        with pytest.raises(ValueError, match="same shape"):
            eng.copy_async(host[:1], x)


@pytest.mark.gpu
def test_pinned_pool_is_bounded():
    from minidl.memory import CudaDevice

    with CudaDevice("1MiB", pinned_capacity="1MiB") as dev:
        h = dev.host_empty((1 << 18,), np.float32)
        assert dev.pinned.used == 1 << 20
        with pytest.raises(MemoryError, match="pinned host memory exhausted"):
            dev.host_empty((1,), np.float32)
        view = h[10:]
        del h
        gc.collect()
        assert dev.pinned.used == 1 << 20  # a view still holds the bytes
        del view
        gc.collect()
        assert dev.pinned.used == 0
        dev.host_empty((16,), np.float32)


@pytest.mark.gpu
def test_route_cupy_allocations():
    import cupy as cp

    from minidl.memory import CudaDevice
    from minidl.memory.devices.cuda_device import route_cupy_allocations

    with CudaDevice("16MiB") as dev:
        pool = Pool(dev)
        before = cp.cuda.get_allocator()
        with route_cupy_allocations(pool):
            a = cp.arange(1000, dtype=cp.float32)  # CuPy's own allocation
            tags = {(b.tag, b.category) for b in pool.live_blocks()}
            assert tags == {("cupy.temp", "workspace")}
            assert a.data.ptr == dev.base_ptr + pool.live_blocks()[0].offset
            assert float((a * 2).sum()) == 999 * 1000
            del a
            gc.collect()
            assert pool.stats()["active_blocks"] == 0  # freed when CuPy freed them
        assert cp.cuda.get_allocator() is before
        pool.check_invariants()


@pytest.mark.gpu
def test_debug_poisoning_on_cuda():
    from minidl.memory import CudaDevice

    with CudaDevice("1MiB") as dev:
        pool = Pool(dev, debug=True)
        blk = pool.allocate(4096)
        v = blk.view((1024,))
        v[...] = 1.0
        pool.free(blk)
        dev.synchronize()
        assert bool(np.isnan(v.get()).all())


@pytest.mark.gpu
def test_capacity_larger_than_device_refused():
    import cupy as cp

    from minidl.memory import CudaDevice

    free, total = cp.cuda.runtime.memGetInfo()
    with pytest.raises(ValueError, match="free memory"):
        CudaDevice(2 * total)


@pytest.mark.gpu
def test_an_arena_must_leave_room_for_the_libraries():
    """cuBLAS' workspace, the context and kernel modules live outside the arena: an arena
    closer to the free memory than the margin is refused with one clear error, and what sits
    outside it is reported."""
    import cupy as cp

    from minidl.memory import CudaDevice
    from minidl.memory.devices.cuda_device import OUTSIDE_ARENA_MARGIN

    free, _ = cp.cuda.runtime.memGetInfo()
    with pytest.raises(ValueError, match="CUDA libraries outside the arena"):
        CudaDevice(free - OUTSIDE_ARENA_MARGIN // 2)
    with CudaDevice("64MiB") as dev:
        a = dev.view(0, 1 << 20, (512, 512), np.float32)
        a.fill(1.0)
        float((a @ a).sum())
        out = dev.outside_arena()
        assert out["total"] == out["libraries_at_start"] + out["since_arena"]
        assert out["total"] < OUTSIDE_ARENA_MARGIN + (512 << 20)

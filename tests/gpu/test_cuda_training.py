"""The GPU suite: run with ``python -m pytest -m gpu`` on a machine with a CUDA GPU.

Every test here is marked ``gpu`` and is skipped where ``cupy.cuda.is_available()`` is false
(tests/conftest.py), so the suite collects and skips cleanly on CPU-only machines. It checks
what the strict test device (tests/minidl/compile/test_strict_device.py) cannot: real kernels, real
streams and CuPy's real allocator.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import minidl
from minidl.memory.runtime.transfer import to_host
from minidl.net.optim import SGD
from minidl.zoo.models import resnet, smallcnn
from minidl.zoo.rnn import char_rnn

pytestmark = pytest.mark.gpu

#: Every memory strategy of the project (auto and split with a budget below the need).
SPECS = ["none", "reuse", "reuse,inplace", "reuse,inplace,static", "vdnn", "vdnn-all",
         "reuse,swap=all,cache", "reuse,swap=auto", "reuse,recompute=sqrt",
         "reuse,recompute=cost", "superneurons", "reuse,inplace,binarize", "reuse,sparse",
         "gist", "reuse,dpr=fp16", "all", "auto", "reuse,split=2"]
TOL = 1e-5


def _image_data(batch=8, shape=(1, 28, 28), classes=10):
    rng = np.random.default_rng(0)
    return (rng.standard_normal((batch, *shape)).astype(np.float32),
            rng.integers(0, classes, batch))


def _text_data(batch=4, seq=16, vocab=65):
    rng = np.random.default_rng(0)
    x = rng.integers(0, vocab, (batch, seq))
    return x, np.roll(x, -1, axis=1)


MODELS = {
    "smallcnn": (lambda: smallcnn(), _image_data),
    "resnet20": (lambda: resnet(20, input_shape=(3, 32, 32), num_classes=10),
                 lambda: _image_data(8, (3, 32, 32))),
    "char-lstm": (lambda: char_rnn(65, 32, 64, cell="lstm"), _text_data),
}


def _resolve(model, spec):
    """``auto`` gets a budget of 80% of the model's plain peak; batch splitting is refused
    for BatchNorm networks (resnet20), so that cell is skipped."""
    make, data = MODELS[model]
    if spec == "auto":
        x, _ = data()
        peak = minidl.dry_run(make(), len(x), "none", input_shape=x.shape[1:])[
            "peak_allocated_bytes"]
        return f"auto,budget={int(0.8 * peak)}"
    if "split" in spec and make().buffers():
        pytest.skip("batch splitting is refused for networks with batch statistics")
    return spec


def _train(model, spec, device, steps=3):
    make, data = MODELS[model]
    spec = _resolve(model, spec)
    x, y = data()
    net = make()
    tr = minidl.Trainer(net, SGD(net.parameters(), lr=0.01, momentum=0.9), memory=spec,
                        device=device, device_memory="512MiB")
    losses = [tr.step(x, y) for _ in range(steps)]
    grads = {k: to_host(p.grad) for k, p in net.named_parameters()}
    return losses, grads, tr


def _lossy(spec: str) -> bool:
    """Specs storing feature maps at reduced precision (Gist's DPR): a last-bit difference
    between the GPU's and the CPU's sums can move an fp16 code by one step (1e-3 relative)."""
    return "dpr" in spec or spec == "all"


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("model", sorted(MODELS))
def test_cuda_training_equals_cpu(model, spec):
    cpu = _train(model, spec, "cpu")
    gpu = _train(model, spec, "cuda")
    scale = 1e-3 if _lossy(spec) else TOL
    np.testing.assert_allclose(gpu[0], cpu[0], rtol=scale, atol=TOL)
    for k in cpu[1]:
        np.testing.assert_allclose(gpu[1][k], cpu[1][k], rtol=TOL,
                                   atol=scale * max(np.abs(cpu[1][k]).max(), 1.0), err_msg=k)


@pytest.mark.parametrize("spec", ["reuse,inplace", "vdnn", "reuse,recompute=sqrt"])
def test_dry_run_peak_equals_gpu_peak_and_cupy_pool_stays_empty(spec):
    import cupy

    cupy.get_default_memory_pool().free_all_blocks()
    _, _, tr = _train("smallcnn", spec, "cuda", steps=1)  # measures CuPy's temporaries
    tr.pool.reset_peak_stats()
    x, y = _image_data()
    tr.step(x, y)
    real = tr.pool.stats()["allocated_bytes.peak"]
    rep = minidl.dry_run(smallcnn(), 8, spec, device_kind="cuda",
                         scratch_bytes=tr.engine.scratch.size)
    assert rep["peak_allocated_bytes"] == real
    # CuPy's pool keeps what it ever handed out (emptied at the start): 0 means no temporary,
    # the optimizer's and clipping's included, ever left the arena (a peak, not the current)
    assert cupy.get_default_memory_pool().total_bytes() == 0


def test_offload_waits_for_its_producer():
    """A device-to-host copy queued right after a long kernel reads the kernel's result."""
    import cupy

    from minidl.memory.devices.cuda_device import CudaDevice

    with CudaDevice("64MiB") as dev:
        a = dev.view(0, 4 << 20, (1024, 1024), np.float32)
        b = dev.view(4 << 20, 4 << 20, (1024, 1024), np.float32)
        a[...] = 1.0
        for _ in range(20):  # long work on the compute stream writing b last
            cupy.matmul(a, a, out=b)
        b *= 0.5
        host = dev.host_empty((1024, 1024), np.float32)
        dev.copy_engine.copy_async(host, b).wait()
        assert np.all(host == 512.0)


def test_prefetch_waits_for_queued_readers():
    """A host-to-device copy into a block a queued kernel still reads does not overtake it."""
    import cupy

    from minidl.memory.devices.cuda_device import CudaDevice

    with CudaDevice("64MiB") as dev:
        a = dev.view(0, 4 << 20, (1024, 1024), np.float32)
        b = dev.view(4 << 20, 4 << 20, (1024, 1024), np.float32)
        a[...] = 1.0
        for _ in range(20):
            cupy.matmul(a, a, out=b)  # reads a
        new = dev.host_empty((1024, 1024), np.float32)
        new[...] = 7.0
        ev = dev.copy_engine.copy_async(a, new)  # overwrites a
        ev.order_compute()
        assert float(b[0, 0]) == 1024.0 and float(a[0, 0]) == 7.0


def test_cli_smoke_run_on_cuda():
    r = subprocess.run([sys.executable, "-m", "minidl", "train", "smallcnn", "--dataset",
                        "synthetic", "--device", "cuda", "--max-steps", "5", "--memory", "vdnn",
                        "--no-progress"], capture_output=True, text=True, timeout=600,
                       env={**os.environ})
    assert r.returncode == 0, r.stdout + r.stderr
    assert "memory report" in r.stdout


def test_batches_go_up_asynchronously_from_pinned_staging():
    """copy_from_host stages through pinned memory on the compute stream; a second upload
    reuses the buffer only after the first copy has read it."""
    from minidl.memory.devices.cuda_device import CudaDevice

    with CudaDevice("16MiB") as dev:
        a = dev.view(0, 4 << 20, (1 << 20,), np.float32)
        b = dev.view(4 << 20, 4 << 20, (1 << 20,), np.float32)
        first = np.arange(1 << 20, dtype=np.float32)
        dev.copy_from_host(a, first)
        dev.copy_from_host(b, first[::-1].copy())
        assert np.array_equal(a.get(), first) and np.array_equal(b.get(), first[::-1])
        assert dev.pinned.used >= 4 << 20

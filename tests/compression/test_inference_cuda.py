"""Inference from a compressed model on the CUDA code path, without a GPU: the strict test
device (``cuda-strict``: CuPy-like arrays that refuse implicit host conversion, every array
call checked against CuPy's API) with the records fed to the device and decoded there by the
Numba CUDA kernels of kernels/compression/weight_record.py (run as one emulated thread). Every
decoded
weight equals the decompressed network's bit for bit and the predictions equal the CPU
device's (the outputs to rounding: the strict device's GEMMs are NumPy's on other pool
offsets), and ``minidl plan --inference --compressed FILE --device cuda`` gives the real
peak."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from minidl.cli import main
from minidl.compression import container
from minidl.compression.container import CompressedModelError
from minidl.compression.inference import CompressedRunner, plan_inference
from minidl.kernels.compression import weight_record as wr
from minidl.memory.testing import strict_device

pytestmark = pytest.mark.skipif(not strict_device.cupy_available(),
                                reason="the strict device reads CuPy's API from cupy")


def _compressed_and_net(name: str, shape: tuple[int, ...], **kw):
    """A compressed model and its decompressed network (test_inference.py's helper)."""
    spec = importlib.util.spec_from_file_location(
        "_minidl_test_inference", Path(__file__).with_name("test_inference.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod._compressed(name, shape, **kw)


def _compressed(name: str, shape: tuple[int, ...], **kw):
    return _compressed_and_net(name, shape, **kw)[0]


@pytest.fixture
def device_decodes(monkeypatch):
    """(record bytes, decoded values) of every record the device kernels decode (read back
    explicitly after each decode)."""
    calls = []
    real = wr._decode_device

    def record(buf, out, stream, status):
        real(buf, out, stream, status)
        calls.append((buf.get().tobytes(), out.get()))

    monkeypatch.setattr(wr, "_decode_device", record)
    return calls


@pytest.mark.parametrize("name,shape,kw", [("lenet5", (1, 28, 28), {}),
                                           ("vgg11_bn", (1, 16, 16), {"width": 8})])
def test_strict_cuda_predictions_equal_the_cpu_ones(name, shape, kw, device_decodes):
    cm, net = _compressed_and_net(name, shape, **kw)
    x = np.random.default_rng(0).normal(size=(10, *shape)).astype(np.float32)
    cpu = CompressedRunner(cm).predict(x, batch_size=4)
    assert device_decodes == []
    runner = CompressedRunner(cm, "cuda-strict")
    gpu = runner.predict(x, batch_size=4)  # batches of 4, 4 and 2
    assert (gpu.argmax(1) == cpu.argmax(1)).all()
    np.testing.assert_allclose(gpu, cpu, rtol=1e-5, atol=1e-6)
    assert len(device_decodes) == 3 * len(cm.records)  # every record, every batch
    names = {rec: n for n, rec in cm.records.items()}
    params = dict(net.named_parameters(include_buffers=True))
    for rec, values in device_decodes:
        want = params[names[rec]].data
        assert values.dtype == want.dtype
        assert values.tobytes() == want.tobytes(), names[rec]
    dev = runner.pool.device
    assert dev.kind == "cuda" and dev.default_pool_peak == 0  # nothing outside the arena


@pytest.mark.parametrize("batch", [1, 3])
def test_planned_peak_is_the_real_peak_on_strict_cuda(batch):
    cm = _compressed("lenet5", (1, 28, 28))
    planned = plan_inference(cm, batch, device_kind="cuda")
    assert planned["device"] == "meta (cuda kind)"
    runner = CompressedRunner(cm, "cuda-strict")
    runner.run_batch(np.zeros((batch, 1, 28, 28), np.float32))
    stats = runner.pool.stats()
    assert stats["allocated_bytes.peak"] == planned["peak_allocated_bytes"]
    assert stats["reserved_bytes.peak"] == planned["peak_reserved_bytes"]
    decoded = {r["tensor"].rpartition(".")[0] for r in planned["live_at_peak"]
               if r["category"] == "parameter"}
    assert len(decoded) <= 1  # at most one layer's weights decoded at a time


def test_plan_cli_device_cuda(tmp_path, capsys):
    cm = _compressed("lenet5", (1, 28, 28))
    path = tmp_path / "lenet5.mdc"
    container.write(cm, path)
    argv = ["plan", "--inference", "--compressed", str(path), "--batch-size", "3", "--json"]
    assert main(argv + ["--device", "cuda"]) == 0
    rep = json.loads(capsys.readouterr().out)
    runner = CompressedRunner(container.read(path), "cuda-strict")
    runner.run_batch(np.zeros((3, 1, 28, 28), np.float32))
    assert rep["peak_allocated_bytes"] == runner.pool.stats()["allocated_bytes.peak"]
    assert rep["device"] == "meta (cuda kind)"
    assert main(argv) == 0  # the cpu plan (its convolutions' workspaces differ)
    assert json.loads(capsys.readouterr().out)["device"] == "meta"


def test_corrupt_stream_refused_when_loaded():
    cm = _compressed("lenet5", (1, 8, 8))
    cm.records["fc1.weight"] = cm.records["fc1.weight"][:-1]  # a CRC of its own would match
    for device in ("cuda-strict", "cpu"):
        with pytest.raises(CompressedModelError, match="record fc1.weight: .*invalid after"):
            CompressedRunner(cm, device)

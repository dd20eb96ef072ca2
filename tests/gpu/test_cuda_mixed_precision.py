"""Mixed precision on a real CUDA GPU (``-m gpu``; skipped without one): what the strict device
checks in CI (tests/minidl/train/precision/test_mixed_precision_strict_device.py) with CuPy's
real arrays, cuBLAS and Numba's kernels. bf16 arrays need CuPy 14 (ml_dtypes' bfloat16)."""

from __future__ import annotations

import numpy as np
import pytest

import minidl
from minidl.memory.runtime.transfer import to_host
from minidl.net.optim import SGD
from minidl.zoo.models import lenet5, smallcnn
from minidl.zoo.transformers import TransformerConfig, gpt

pytestmark = pytest.mark.gpu

MIXED = ["bf16-mixed", "fp16-mixed"]
#: Unit roundoff of each half dtype.
EPS = {"bf16-mixed": 2.0 ** -8, "fp16-mixed": 2.0 ** -11}
MODELS = {
    "smallcnn": (lambda: smallcnn((1, 28, 28), 10, width=8), "images"),
    "lenet5": (lambda: lenet5((1, 28, 28), 10), "images"),
    "gpt": (lambda: gpt(TransformerConfig(2, 2, 32, 16, 29, dropout=0.0)), "tokens"),
}


def _data(kind):
    rng = np.random.default_rng(0)
    if kind == "images":
        return rng.standard_normal((8, 1, 28, 28)).astype(np.float32), rng.integers(0, 10, 8)
    x = rng.integers(0, 29, (4, 16))
    return x, np.roll(x, -1, axis=1)


def _train(model, precision, device, steps=3, spec="reuse,inplace"):
    make, kind = MODELS[model]
    net = make()
    tr = minidl.Trainer(net, SGD(net.parameters(), lr=0.05, momentum=0.9), memory=spec,
                        device=device, device_memory="512MiB", precision=precision)
    losses = [tr.step(*_data(kind)) for _ in range(steps)]
    return losses, {k: to_host(p.data) for k, p in net.named_parameters()}, tr


@pytest.mark.parametrize("precision", MIXED)
@pytest.mark.parametrize("model", sorted(MODELS))
def test_mixed_training_on_cuda_equals_cpu(model, precision):
    """cuBLAS and the device kernels sum in their own order: a last float32 bit can flip a
    half rounding, so losses within one half unit roundoff, parameters within one of their
    largest entry (the strict device's bounds)."""
    import cupy

    cupy.get_default_memory_pool().free_all_blocks()
    cpu = _train(model, precision, "cpu")
    gpu = _train(model, precision, "cuda")
    np.testing.assert_allclose(gpu[0], cpu[0], rtol=EPS[precision])
    for k in cpu[1]:
        np.testing.assert_allclose(gpu[1][k], cpu[1][k], rtol=0,
                                   atol=EPS[precision] * np.abs(cpu[1][k]).max(), err_msg=k)
    assert cupy.get_default_memory_pool().total_bytes() == 0, "float32 copies left the arena"


@pytest.mark.parametrize("precision", MIXED)
def test_mixed_dry_run_peak_equals_cuda_peak(precision):
    _, _, tr = _train("lenet5", precision, "cuda", steps=1)
    tr.pool.reset_peak_stats()
    tr.step(*_data("images"))
    real = tr.pool.stats()["allocated_bytes.peak"]
    rep = minidl.dry_run(lenet5((1, 28, 28), 10), 8, "reuse,inplace", input_shape=(1, 28, 28),
                         device_kind="cuda", precision=precision,
                         scratch_bytes=tr.engine.scratch.size)
    assert rep["peak_allocated_bytes"] == real


@pytest.mark.parametrize("precision", MIXED)
@pytest.mark.parametrize("model", ["smallcnn", "lenet5"])
def test_mixed_peak_is_below_fp32_on_cuda(model, precision):
    """Half feature maps and gradients on a card take less than fp32's (the strict device's
    test_mixed_peak_is_below_fp32_on_the_device), CuPy's own scratch included."""
    peaks = {}
    for p in ("fp32", precision):
        _, _, tr = _train(model, p, "cuda", steps=1)
        tr.pool.reset_peak_stats()
        tr.step(*_data("images"))
        peaks[p] = tr.pool.stats()["allocated_bytes.peak"]
    assert peaks[precision] < peaks["fp32"], peaks


def test_fp16_overflow_skips_the_step_on_cuda():
    _, _, tr = _train("smallcnn", "fp16-mixed", "cuda", steps=1)
    scaler, net = tr.loss_scaler, tr.net
    scaler.scale = 2.0 ** 40
    before = {n: to_host(p.data) for n, p in net.named_parameters()}
    tr.step(*_data("images"))
    assert scaler.skipped == 1 and scaler.scale == 2.0 ** 39
    for n, p in net.named_parameters():
        assert np.array_equal(to_host(p.data), before[n]), n

"""Mixed precision on the strict CUDA test device (CuPy's rules on the CPU): an MLP trains in
bf16-mixed and fp16-mixed with the CPU device's losses and parameters bit for bit (the device
runs the same float32 kernels on float32 copies of its half arrays and rounds the same way); a
small CNN, LeNet-5, ResNet-8 and a tiny GPT within the last-bit differences their float32
device kernels already have in fp32 (tests/minidl/compile/test_strict_device.py); the float32
copies are device temporaries (none reaches CuPy's own pool or the host), the dry run's peak
equals the real run's, and fp16's overflow skip works there. Gist's codecs read the half
feature maps on the device (the ReLU sign mask from the half values' bits: bitpack's
_k_pack_half_bits)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("cupy")

from mixed_nets import branches  # noqa: E402

import minidl  # noqa: E402
from minidl.kernels import blas  # noqa: E402
from minidl.memory.runtime.transfer import to_host  # noqa: E402
from minidl.memory.testing.strict_device import StrictCudaDevice  # noqa: E402
from minidl.net.graph import Input, Network  # noqa: E402
from minidl.net.optim import SGD  # noqa: E402
from minidl.zoo.models import lenet5, resnet, smallcnn  # noqa: E402
from minidl.zoo.transformers import TransformerConfig, gpt  # noqa: E402

MIXED = ["bf16-mixed", "fp16-mixed"]
HALF = {"bf16-mixed": "bfloat16", "fp16-mixed": "float16"}
#: Unit roundoff of each half dtype.
EPS = {"bf16-mixed": 2.0 ** -8, "fp16-mixed": 2.0 ** -11}
#: model -> (build, one batch)
CNNS = {
    "smallcnn": (lambda: smallcnn((1, 12, 12), 10, width=4), (1, 12, 12)),
    "lenet5": (lambda: lenet5((1, 8, 8), 10), (1, 8, 8)),
    "resnet8": (lambda: resnet(8, (3, 8, 8), 10, width=4), (3, 8, 8)),  # (batch norm, adds)
    "branches": (branches, (3, 8, 8)),  # (a Concat of two convolutions)
}


def _images(shape, n=8):
    rng = np.random.default_rng(0)
    return rng.standard_normal((n, *shape)).astype(np.float32), rng.integers(0, 10, n)


def _tokens(n=2, t=8, vocab=13):
    x = np.random.default_rng(0).integers(0, vocab, (n, t))
    return x, np.roll(x, -1, axis=1)


def _train(make, data, precision, device, spec="reuse,inplace", steps=3):
    x, y = data
    net = make()
    tr = minidl.Trainer(net, SGD(net.parameters(), lr=0.05, momentum=0.9), memory=spec,
                        device=device, device_memory="64MiB", precision=precision)
    losses = [tr.step(x, y) for _ in range(steps)]
    params = {k: to_host(p.data) for k, p in net.named_parameters()}
    return losses, params, tr


def _mlp():
    x = Input((1, 8, 8))
    h = minidl.layers.Flatten()(x)
    h = minidl.layers.ReLU()(minidl.layers.Linear(64, 32)(h))
    h = minidl.layers.Dropout(0.25)(minidl.layers.ReLU()(minidl.layers.Linear(32, 32)(h)))
    return Network(x, minidl.layers.Linear(32, 10)(h), seed=3)


def _no_escape(dev: StrictCudaDevice) -> None:
    assert dev.checked_calls > 50
    assert dev.default_pool_bytes == 0 and dev.default_pool_peak == 0, \
        "float32 copies escaped the arena"


@pytest.mark.parametrize("spec", ["reuse,inplace", "reuse,recompute=sqrt", "reuse,swap=all",
                                  "reuse,inplace,offload=optimizer"])
@pytest.mark.parametrize("precision", MIXED)
def test_mlp_equals_cpu_bit_for_bit(precision, spec, monkeypatch):
    """Linear takes its half arrays as they are there: every GEMM is a mixed-precision one
    (GemmEx's stand-in, the float32 BLAS call the CPU makes on float32 copies), its half
    output the product plus the bias in float32, rounded once (GemmEx's epilogue)."""
    cpu = _train(_mlp, _images((1, 8, 8)), precision, "cpu", spec)
    dev = StrictCudaDevice("64MiB")
    calls = []
    real = blas.emulated_gemm_ex
    monkeypatch.setattr(blas, "emulated_gemm_ex", lambda *a: calls.append(a[2].dtype) or real(*a))
    gpu = _train(_mlp, _images((1, 8, 8)), precision, dev, spec)
    # 3 steps: 3 forward products, 2 input and 3 weight gradients (the first layer's input
    # takes none), more where a policy recomputes; the forward products and the input
    # gradients rounded once into their half arrays, the weight gradients float32
    assert len(calls) >= 3 * 8
    assert set(calls) == {np.dtype(np.float32), np.dtype(HALF[precision])}
    assert gpu[0] == cpu[0]
    for k in cpu[1]:
        assert np.array_equal(gpu[1][k], cpu[1][k]), k
    _no_escape(dev)


@pytest.mark.parametrize("spec", ["reuse,inplace", "reuse,recompute=sqrt", "gist"])
@pytest.mark.parametrize("precision", MIXED)
@pytest.mark.parametrize("model", sorted(CNNS))
def test_cnn_equals_cpu(model, precision, spec):
    """The device's float32 convolution kernels sum in another order than the CPU's (fp32's
    last-bit differences, test_strict_device.py): a float32 weight gradient can differ in its
    last bit, so parameters agree within 1e-5 of their largest entry (the losses, rounded
    through half activations, within one unit roundoff of the half dtype)."""
    make, shape = CNNS[model]
    cpu = _train(make, _images(shape), precision, "cpu", spec)
    dev = StrictCudaDevice("64MiB")
    gpu = _train(make, _images(shape), precision, dev, spec)
    np.testing.assert_allclose(gpu[0], cpu[0], rtol=EPS[precision])
    for k in cpu[1]:
        np.testing.assert_allclose(gpu[1][k], cpu[1][k], rtol=0,
                                   atol=1e-5 * np.abs(cpu[1][k]).max(), err_msg=k)
    prog = gpu[2].last_compiled.plan.program
    assert HALF[precision] in {str(t.dtype) for t in prog.tensors}
    _no_escape(dev)


@pytest.mark.parametrize("dropout", [0.1, 0.0])  # (attention runs in batch chunks)
@pytest.mark.parametrize("precision", MIXED)
def test_tiny_gpt_equals_cpu(precision, dropout):
    """The float32 device kernels (attention, layer norm, the loss) may round a float32 sum
    differently in the last bit from the CPU's (as in fp32: test_strict_device.py), and a half
    rounding can carry such a bit into one half unit of an activation, which moves the
    gradients it feeds by about one half unit: losses within one unit roundoff of the half
    dtype, parameters (three steps of lr 0.05) within one unit roundoff of their largest
    entry (seen: 1.5e-5 of it in fp16, under 1e-5 in bf16)."""
    make = lambda: gpt(TransformerConfig(2, 2, 16, 8, 13, dropout=dropout))  # noqa: E731
    cpu = _train(make, _tokens(), precision, "cpu")
    dev = StrictCudaDevice("64MiB")
    gpu = _train(make, _tokens(), precision, dev)
    np.testing.assert_allclose(gpu[0], cpu[0], rtol=EPS[precision])
    for k in cpu[1]:
        np.testing.assert_allclose(gpu[1][k], cpu[1][k], rtol=0,
                                   atol=EPS[precision] * np.abs(cpu[1][k]).max(),
                                   err_msg=k)
    _no_escape(dev)


@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("spec", ["reuse,recompute=sqrt", "reuse,swap=all",
                                  "reuse,inplace,static"])
def test_attention_in_batch_chunks_is_lossless(spec, dropout, monkeypatch):
    """A device stages attention's, GELU's and the adds' float32 copies one batch chunk at a
    time (parameter gradients through staged partials; dropout masks at their positions in
    the whole batch: test_tiny_gpt_equals_cpu): every lossless spec gives the bits of
    ``none``, the dry run equals the run, and nothing spills out of the workspaces."""
    from minidl.compile import mixed_staging, mixed_steps

    chunks = []
    real = mixed_steps.batch_chunk
    monkeypatch.setattr(mixed_steps, "batch_chunk",
                        lambda *a: chunks.append(real(*a)) or chunks[-1])
    empty = mixed_staging.Staging.empty

    def no_spill(self, shape, dtype):
        a = empty(self, shape, dtype)
        assert self.spilled == 0, (shape, dtype)
        return a

    monkeypatch.setattr(mixed_staging.Staging, "empty", no_spill)
    make = lambda: gpt(TransformerConfig(2, 2, 16, 8, 13, dropout=dropout))  # noqa: E731
    x, y = _tokens(n=4)
    runs = {}
    for s in ("none", spec):
        runs[s] = _train(make, (x, y), "bf16-mixed", StrictCudaDevice("64MiB"), s)
    assert 1 in chunks  # (4 sequences: chunks of one)
    assert runs[spec][0] == runs["none"][0]
    for k, v in runs["none"][1].items():
        assert np.array_equal(runs[spec][1][k], v), k
    tr = runs[spec][2]
    rep = minidl.dry_run(make(), 4, spec, input_shape=(8,), device_kind="cuda",
                         precision="bf16-mixed", scratch_bytes=tr.engine.scratch.size)
    assert rep["peak_allocated_bytes"] == tr.memory_report()["peak_allocated_bytes"]


def _second_step(make, shape, precision, batch=8):
    """The strict device's run of ``make`` at ``batch``: (its second step's arena peak, its
    scratch block's bytes, the trainer)."""
    dev = StrictCudaDevice("64MiB")
    _, _, tr = _train(make, _images(shape, batch), precision, dev, steps=1)
    tr.pool.reset_peak_stats()
    tr.step(*_images(shape, batch))
    return tr.pool.stats()["allocated_bytes.peak"], tr.engine.scratch.size, tr


@pytest.mark.parametrize("model", ["lenet5", "branches"])
@pytest.mark.parametrize("precision", MIXED)
def test_dry_run_peak_equals_real_peak(precision, model):
    """The float32 arrays the layers compute on are staged in their steps' workspaces, which
    the plan sizes for them: the scratch block holds CuPy's own temporaries only (fp32's, and
    under fp16 the overflow check's boolean map of a gradient), and the dry run for the cuda
    kind gives every other byte."""
    make, shape = CNNS[model]
    real, scratch, tr = _second_step(make, shape, precision)
    fp32_scratch = _second_step(make, shape, "fp32")[1]
    largest_grad = max(p.data.size for p in tr.net.parameters())
    assert scratch <= fp32_scratch + -(-largest_grad // 512) * 512
    rep = minidl.dry_run(make(), 8, "reuse,inplace", input_shape=shape, device_kind="cuda",
                         precision=precision, scratch_bytes=scratch)
    assert rep["peak_allocated_bytes"] == real
    bare = minidl.dry_run(make(), 8, "reuse,inplace", input_shape=shape, device_kind="cuda",
                          precision=precision)
    assert bare["peak_allocated_bytes"] == real - scratch


@pytest.mark.parametrize("precision", MIXED)
@pytest.mark.parametrize("model", ["smallcnn", "lenet5"])
def test_mixed_peak_is_below_fp32_on_the_device(model, precision):
    """Part 25's point on a GPU: half feature maps and gradients take less memory than fp32's
    even though the layers compute in float32 (conv, ReLU, max pooling and flatten on their
    half arrays; the others on float32 copies staged in their workspaces)."""
    make = {"smallcnn": smallcnn, "lenet5": lenet5}[model]
    fp32 = _second_step(make, (1, 28, 28), "fp32")[0]
    mixed = _second_step(make, (1, 28, 28), precision)[0]
    assert mixed < fp32


def test_fp16_overflow_skips_the_step_on_the_device():
    make, shape = CNNS["smallcnn"]
    x, y = _images(shape)
    net = make()
    tr = minidl.Trainer(net, SGD(net.parameters(), lr=0.05, momentum=0.9),
                        device=StrictCudaDevice("64MiB"), device_memory="64MiB",
                        precision="fp16-mixed")
    scaler = tr.loss_scaler
    tr.step(x, y)
    assert scaler.skipped == 0 and scaler.clean_steps == 1
    scaler.scale = 2.0 ** 40  # the loss gradient overflows float16: inf gradients
    before = {n: to_host(p.data) for n, p in net.named_parameters()}
    tr.step(x, y)
    assert scaler.skipped == 1 and scaler.scale == 2.0 ** 39 and scaler.clean_steps == 0
    for n, p in net.named_parameters():  # the update was skipped
        assert np.array_equal(to_host(p.data), before[n]), n
    while scaler.skipped < 30 and scaler.scale > 2.0 ** 20:
        tr.step(x, y)
    assert scaler.scale <= 2.0 ** 20 and np.isfinite(tr.step(x, y))


@pytest.mark.parametrize("precision", MIXED)
@pytest.mark.parametrize("model", ["smallcnn", "lenet5"])
def test_conv_reads_half_through_gemm_ex(model, precision, monkeypatch):
    """Conv2d takes its half input, weight copy and output gradient as they are on the device
    (conv_device_half: im2col on their bits, GemmEx into float32, its half output and input
    gradient rounded once from float32 inside its workspace): every convolution product
    is a gemm_ex (forward, dW, and dx but for the first layer's), the results within
    test_cnn_equals_cpu's bounds, and none of the convolutions' float32 operand copies is in
    the scratch block any longer (smaller than with Conv2d back on float32 copies)."""
    from minidl.compile import mixed_steps
    from minidl.kernels.convolution import conv_device_half as cdh

    make, shape = CNNS[model]
    cpu = _train(make, _images(shape), precision, "cpu")
    inside, conv_calls, ex_calls = [False], [], []
    real_ex, real_gemm = blas.emulated_gemm_ex, cdh.gemm

    def conv_gemm(*a, **k):
        inside[0] = True
        conv_calls.append(a[2].dtype)
        try:
            real_gemm(*a, **k)
        finally:
            inside[0] = False

    monkeypatch.setattr(blas, "emulated_gemm_ex",
                        lambda *a: ex_calls.append(inside[0]) or real_ex(*a))
    monkeypatch.setattr(cdh, "gemm", conv_gemm)
    dev = StrictCudaDevice("64MiB")
    gpu = _train(make, _images(shape), precision, dev)
    # 3 steps of two convolutions: 2 forward products, 2 dW, and conv2's dx over two tiles of
    # half the columns (conv1 takes none)
    assert len(conv_calls) == 3 * 6 and set(conv_calls) == {np.dtype(np.float32)}
    assert ex_calls.count(True) == len(conv_calls)
    np.testing.assert_allclose(gpu[0], cpu[0], rtol=EPS[precision])
    for k in cpu[1]:
        np.testing.assert_allclose(gpu[1][k], cpu[1][k], rtol=0,
                                   atol=1e-5 * np.abs(cpu[1][k]).max(), err_msg=k)
    _no_escape(dev)
    monkeypatch.setattr(mixed_steps, "DEVICE_HALF_OPERAND_KINDS", frozenset({"linear"}))
    monkeypatch.setattr(mixed_steps, "DEVICE_HALF_IO_KINDS",
                        mixed_steps.DEVICE_HALF_IO_KINDS - {"conv"})
    copies = _train(make, _images(shape), precision, StrictCudaDevice("64MiB"))
    assert gpu[2].engine.scratch.size < copies[2].engine.scratch.size

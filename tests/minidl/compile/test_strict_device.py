"""Training on the strict CUDA test device: CuPy's rules, recorded streams, the arena bound.

Every step runs the GPU code path (device arrays, explicit transfers, CuPy temporaries routed
into the arena, copies ordered by events) on arrays whose every NumPy call is checked against
the installed cupy package; the numbers must equal the CPU device's bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("cupy")

import minidl  # noqa: E402
from minidl import layers as L  # noqa: E402
from minidl.memory.runtime.transfer import to_host  # noqa: E402
from minidl.memory.testing.stream_model import StreamRace  # noqa: E402
from minidl.memory.testing.strict_copies import StrictCopyEvent  # noqa: E402
from minidl.memory.testing.strict_device import StrictCudaDevice  # noqa: E402
from minidl.net.optim import SGD  # noqa: E402
from minidl.zoo.models import resnet, smallcnn  # noqa: E402
from minidl.zoo.rnn import char_rnn  # noqa: E402

MLP_SPECS = ["none", "reuse,inplace", "reuse,inplace,static", "swap=all", "reuse,swap=all,cache",
             "reuse,recompute=sqrt", "reuse,inplace,binarize", "reuse,sparse", "superneurons"]


def _mlp():
    return minidl.Sequential([L.Linear(20, 32), L.ReLU(), L.Linear(32, 32), L.ReLU(),
                              L.Dropout(0.25), L.Linear(32, 5)], input_shape=(20,))


def _data():
    rng = np.random.default_rng(0)
    return rng.standard_normal((8, 20)).astype(np.float32), rng.integers(0, 5, 8)


def _train(device, spec, steps=3, make=_mlp, data=_data):
    x, y = data()
    net = make()
    tr = minidl.Trainer(net, SGD(net.parameters(), lr=0.05, momentum=0.9), memory=spec,
                        device=device, device_memory="32MiB")
    losses = [tr.step(x, y) for _ in range(steps)]
    grads = {k: to_host(p.grad) for k, p in net.named_parameters()}
    return losses, grads, tr


@pytest.mark.parametrize("spec", MLP_SPECS)
def test_mlp_equals_cpu_bit_for_bit(spec):
    cpu = _train("cpu", spec)
    dev = StrictCudaDevice("32MiB")
    gpu = _train(dev, spec)
    assert gpu[0] == cpu[0]
    for k in cpu[1]:
        assert np.array_equal(gpu[1][k], cpu[1][k]), k
    assert dev.checked_calls > 50 and dev.streams.issued > 50
    assert dev.default_pool_bytes == 0, "CuPy temporaries escaped the arena"


def test_copies_without_events_race():
    dev = StrictCudaDevice("32MiB", copy_waits_for_compute=False)
    with pytest.raises(StreamRace, match="d2h stream"):
        _train(dev, "swap=all", steps=1)


def test_compute_not_waiting_for_a_prefetch_races(monkeypatch):
    monkeypatch.setattr(StrictCopyEvent, "order_compute", lambda self: None)
    with pytest.raises(StreamRace, match="compute stream"):
        _train(StrictCudaDevice("32MiB"), "swap=all", steps=1)


def test_scratch_block_and_dry_run_equal_real_peak():
    dev = StrictCudaDevice("32MiB")
    losses, _, tr = _train(dev, "reuse,inplace", steps=1)
    scratch = tr.engine.scratch
    assert scratch is not None and scratch.size > 0
    tr.pool.reset_peak_stats()
    x, y = _data()
    tr.step(x, y)
    real = tr.pool.stats()["allocated_bytes.peak"]
    rep = minidl.dry_run(_mlp(), 8, "reuse,inplace", device_kind="cuda",
                         scratch_bytes=scratch.size)
    assert rep["peak_allocated_bytes"] == real


# ----------------------------------------------------------------------------- reference models
#: Every memory strategy (auto with a budget under the plain peak; split for nets without BN).
MODEL_SPECS = ["none", "reuse,inplace,static", "vdnn", "reuse,swap=all,cache",
               "reuse,swap=auto", "reuse,recompute=sqrt", "reuse,recompute=cost",
               "superneurons", "reuse,inplace,binarize", "reuse,sparse", "gist",
               "reuse,dpr=fp16", "all", "auto", "reuse,split=2"]


def _images(shape):
    def data():
        rng = np.random.default_rng(0)
        return rng.standard_normal((4, *shape)).astype(np.float32), rng.integers(0, 10, 4)
    return data


def _text():
    rng = np.random.default_rng(0)
    x = rng.integers(0, 17, (2, 6))
    return x, np.roll(x, -1, axis=1)


REFERENCE = {
    "smallcnn": (lambda: smallcnn((1, 12, 12), 10, width=4), _images((1, 12, 12))),
    "resnet8": (lambda: resnet(8, (3, 8, 8), 10, width=4), _images((3, 8, 8))),
    "char-lstm": (lambda: char_rnn(17, 8, 12, num_layers=2, steps=6), _text),
    "char-gru-unrolled": (lambda: char_rnn(17, 8, 12, num_layers=1, steps=6, cell="gru",
                                           fused=False), _text),
}


def _spec_for(model, spec):
    make, data = REFERENCE[model]
    if spec == "auto":
        x, _ = data()
        peak = minidl.dry_run(make(), len(x), "none", input_shape=x.shape[1:])[
            "peak_allocated_bytes"]
        return f"auto,budget={int(0.85 * peak)}"
    if "split" in spec and make().buffers():
        pytest.skip("batch splitting is refused for networks with batch statistics")
    return spec


@pytest.mark.parametrize("spec", MODEL_SPECS)
@pytest.mark.parametrize("model", sorted(REFERENCE))
def test_reference_model_step_equals_cpu(model, spec):
    make, data = REFERENCE[model]
    spec = _spec_for(model, spec)
    cpu = _train("cpu", spec, steps=2, make=make, data=data)
    dev = StrictCudaDevice("32MiB")
    gpu = _train(dev, spec, steps=2, make=make, data=data)
    # the device path's products and sums may round differently in the last bit; fp16 stashes
    # (dpr) can turn such a bit into one fp16 step (1e-3 relative) of a gradient entry
    scale = 1e-3 if "dpr" in spec or spec == "all" else 1e-5
    np.testing.assert_allclose(gpu[0], cpu[0], rtol=1e-5)
    for k in cpu[1]:
        np.testing.assert_allclose(gpu[1][k], cpu[1][k], rtol=1e-5,
                                   atol=scale * np.abs(cpu[1][k]).max() + 1e-7, err_msg=k)
    assert dev.default_pool_bytes == 0, "CuPy temporaries escaped the arena"


def test_fit_evaluate_predict_save_load_equal_cpu(tmp_path):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((48, 20)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64)

    def run(device, name):
        net = minidl.Sequential([L.Linear(20, 16), L.ReLU(), L.Linear(16, 2)], input_shape=(20,))
        tr = minidl.Trainer(net, minidl.net.optim.Adam(net.parameters(), lr=0.01),
                            memory="reuse,swap=all", device=device, device_memory="8MiB",
                            clip_grad_norm=1.0)
        tr.fit((x, y), epochs=2, batch_size=16)
        metrics = tr.evaluate(x, y, batch_size=32)
        pred = tr.predict(x[:5])
        path = tmp_path / f"{name}.npz"
        tr.save(path)
        tr.load(path)
        state = net.state_dict()
        tr.close()
        return metrics, pred, state

    cpu = run("cpu", "cpu")
    gpu = run(StrictCudaDevice("8MiB"), "gpu")
    assert gpu[0] == cpu[0] and np.array_equal(gpu[1], cpu[1])
    for k in cpu[2]:
        assert np.array_equal(gpu[2][k], cpu[2][k]), k


def test_cli_trains_on_the_strict_cuda_device():
    """The CLI's GPU path end to end (auto device memory for the cuda kind, swapping, the
    memory report) with every array call checked against CuPy."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "minidl", "train", "smallcnn", "--dataset",
                        "synthetic", "--device", "cuda-strict", "--max-steps", "3", "--memory",
                        "vdnn", "--no-progress"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "memory report (cuda-strict device" in r.stdout
    assert "feature maps offloaded" in r.stdout


def test_plan_for_a_gpu_counts_the_device_workspaces():
    cpu = minidl.dry_run(smallcnn(), 32, "reuse,inplace")
    gpu = minidl.dry_run(smallcnn(), 32, "reuse,inplace", device_kind="cuda")
    assert gpu["device"] == "meta (cuda kind)"
    assert gpu["peak_allocated_bytes"] != cpu["peak_allocated_bytes"]  # conv workspaces differ
    # the GPU run's own peak (without CuPy's temporaries) is what the dry run promised
    dev = StrictCudaDevice("64MiB")
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((32, 1, 28, 28)).astype(np.float32), rng.integers(0, 10, 32)
    net = smallcnn()
    tr = minidl.Trainer(net, SGD(net.parameters(), lr=0.01, momentum=0.9),
                        memory="reuse,inplace", device=dev, device_memory="64MiB")
    tr.step(x, y)
    tr.pool.reset_peak_stats()
    tr.step(x, y)
    again = minidl.dry_run(smallcnn(), 32, "reuse,inplace", device_kind="cuda",
                           scratch_bytes=tr.engine.scratch.size)
    assert again["peak_allocated_bytes"] == tr.pool.stats()["allocated_bytes.peak"]

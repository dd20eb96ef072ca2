"""Interoperability: public submodules as attributes, PyTorch state dicts both ways (BatchNorm's
``num_batches_tracked`` included), and clear errors when a file is not a minidl checkpoint."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import minidl
from minidl.train.trainer import CheckpointError
from minidl.zoo.models import resnet


def test_public_submodules_are_attributes_after_import_minidl():
    """A fresh interpreter: ``import minidl`` alone makes ``minidl.optim.SGD`` etc. usable."""
    code = (
        "import minidl\n"
        "net = minidl.models.get_model('lenet5', (1, 8, 8), 10)\n"
        "opt = minidl.optim.SGD(net.parameters(), lr=0.1)\n"
        "for name in ('data', 'dryrun', 'graph', 'kernels', 'layers', 'memory', 'models', "
        "'optim', 'report', 'rnn', 'safetensors_io', 'text', 'torch_bridge', 'trainer'):\n"
        "    assert name in minidl.__all__ and hasattr(minidl, name), name\n"
        "assert minidl.memory.ir.config.MemoryConfig is minidl.MemoryConfig\n"
        "assert callable(minidl.data.load_dataset) and minidl.memory.parse_size('1KiB') == 1024\n"
        "print(type(opt).__name__, minidl.__version__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    from importlib.metadata import version

    assert out.stdout.split() == ["SGD", version("minidl")]


# ------------------------------------------------------------------ PyTorch state dicts
torch_names = ("conv1", "bn1", "layer1", "layer2", "layer3", "layer4", "fc")


def _torch_resnet18(num_classes: int):
    """torchvision's resnet18 (same module names, so the same state-dict keys), written out
    here because torchvision is not a dependency."""
    torch = pytest.importorskip("torch")
    nn = torch.nn

    class BasicBlock(nn.Module):
        def __init__(self, cin: int, cout: int, stride: int) -> None:
            super().__init__()
            self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(cout)
            self.relu = nn.ReLU(inplace=True)
            self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(cout)
            self.downsample = None
            if stride != 1 or cin != cout:
                self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                                nn.BatchNorm2d(cout))

        def forward(self, x):
            y = self.bn2(self.conv2(self.relu(self.bn1(self.conv1(x)))))
            return self.relu(y + (x if self.downsample is None else self.downsample(x)))

    class ResNet18(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
            self.bn1 = nn.BatchNorm2d(64)
            self.relu = nn.ReLU(inplace=True)
            self.maxpool = nn.MaxPool2d(3, 2, 1)
            cin = 64
            for i, w in enumerate((64, 128, 256, 512)):
                stride = 1 if i == 0 else 2
                setattr(self, f"layer{i + 1}",
                        nn.Sequential(BasicBlock(cin, w, stride), BasicBlock(w, w, 1)))
                cin = w
            self.avgpool = nn.AdaptiveAvgPool2d(1)
            self.fc = nn.Linear(512, num_classes)

        def forward(self, x):
            x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
            x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
            return self.fc(torch.flatten(self.avgpool(x), 1))

    return ResNet18()


def _randomise_bn_stats(tm, torch, rng) -> None:
    with torch.no_grad():
        for m in tm.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                c = m.num_features
                m.weight.copy_(torch.tensor(rng.uniform(0.5, 1.5, c), dtype=torch.float32))
                m.bias.copy_(torch.tensor(rng.normal(0, 0.1, c), dtype=torch.float32))
                m.running_mean.copy_(torch.tensor(rng.normal(0, 0.1, c), dtype=torch.float32))
                m.running_var.copy_(torch.tensor(rng.uniform(0.5, 1.5, c), dtype=torch.float32))
                m.num_batches_tracked.fill_(int(rng.integers(1, 1000)))


def _eval_outputs(net, x):
    tr = minidl.Trainer(net, device_memory="256MiB")
    try:
        return tr.predict(x)
    finally:
        tr.close()


def test_resnet18_state_dicts_move_both_ways_with_strict_and_outputs_match():
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    tm = _torch_resnet18(10)
    _randomise_bn_stats(tm, torch, rng)
    tm.eval()
    net = resnet(18, (3, 64, 64), 10)
    state = tm.state_dict()
    assert set(net.state_dict()) == set(state)  # num_batches_tracked included
    net.load_state_dict(state, strict=True)  # torch -> minidl
    mine = net.state_dict()
    assert mine["bn1.num_batches_tracked"].dtype == np.int64
    assert int(mine["bn1.num_batches_tracked"]) == int(state["bn1.num_batches_tracked"])
    x = rng.standard_normal((2, 3, 64, 64)).astype(np.float32)
    with torch.no_grad():
        want = tm(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(_eval_outputs(net, x), want, rtol=1e-4, atol=1e-4)

    # minidl -> torch: a fresh torch model takes minidl's state dict strictly
    back = _torch_resnet18(10)
    back.load_state_dict({k: torch.from_numpy(np.asarray(v)) for k, v in mine.items()},
                         strict=True)
    back.eval()
    with torch.no_grad():
        np.testing.assert_array_equal(back(torch.from_numpy(x)).numpy(), want)
    assert back.bn1.num_batches_tracked.dtype == torch.int64


def test_training_steps_count_num_batches_tracked_as_torch_does():
    """One training step of minidl and torch from the same weights: the counter and the
    running statistics move the same way."""
    torch = pytest.importorskip("torch")
    conv = torch.nn.Conv2d(3, 4, 3, padding=1, bias=False)
    bn = torch.nn.BatchNorm2d(4)
    tm = torch.nn.Sequential(conv, bn, torch.nn.ReLU(), torch.nn.Flatten(),
                             torch.nn.Linear(4 * 6 * 6, 5))
    net = minidl.Sequential([minidl.layers.Conv2d(3, 4, 3, padding=1, bias=False),
                             minidl.layers.BatchNorm2d(4), minidl.layers.ReLU(),
                             minidl.layers.Flatten(), minidl.layers.Linear(4 * 6 * 6, 5)],
                            input_shape=(3, 6, 6))
    net.load_state_dict(tm.state_dict(), strict=True)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((8, 3, 6, 6)).astype(np.float32)
    y = rng.integers(0, 5, 8)
    tr = minidl.Trainer(net, minidl.optim.SGD(net.parameters(), lr=0.0), device_memory="16MiB")
    for _ in range(3):
        tr.step(x, y)
        tm.train()(torch.from_numpy(x))
    got = net.state_dict()
    assert int(got["1.num_batches_tracked"]) == int(bn.num_batches_tracked) == 3
    np.testing.assert_allclose(got["1.running_mean"], bn.running_mean.numpy(), rtol=1e-5,
                               atol=1e-6)
    np.testing.assert_allclose(got["1.running_var"], bn.running_var.numpy(), rtol=1e-5)
    tr.close()


def test_failed_state_dict_load_changes_nothing():
    net = resnet(8, (3, 8, 8), 10, width=4)
    before = net.state_dict()
    bad = {k: v for k, v in before.items()}
    bad["fc.weight"] = np.ones((3, 3), np.float32)  # last in layer order: copied last
    bad["conv1.weight"] = bad["conv1.weight"] + 1
    with pytest.raises(ValueError, match="fc.weight"):
        net.load_state_dict(bad)
    for k, v in net.state_dict().items():
        np.testing.assert_array_equal(v, before[k])


# ------------------------------------------------------------------ checkpoints
def _trainer():
    net = minidl.Sequential([minidl.layers.Linear(4, 3), minidl.layers.BatchNorm1d(3),
                             minidl.layers.Linear(3, 2)], input_shape=(4,))
    return minidl.Trainer(net, minidl.optim.SGD(net.parameters(), lr=0.1, momentum=0.9),
                          device_memory="8MiB")


def _write_torch_file(path):
    torch = pytest.importorskip("torch")
    torch.save(torch.nn.Linear(4, 3).state_dict(), path)


def _write_legacy_torch_file(path):
    torch = pytest.importorskip("torch")
    torch.save(torch.nn.Linear(4, 3).state_dict(), path, _use_new_zipfile_serialization=False)


@pytest.mark.parametrize("make, needle", [
    (lambda p, tr: np.savez(p, **tr.net.state_dict()), "plain .npz of this network's state"),
    (lambda p, tr: np.savez(p, a=np.zeros(3)), r"an \.npz of 1 arrays \(a\)"),
    (lambda p, tr: np.save(p, np.zeros((2, 3))), r"single NumPy array \(.npy\) of shape \(2, 3\)"),
    (lambda p, tr: _write_torch_file(p), "a PyTorch file"),
    (lambda p, tr: _write_legacy_torch_file(p), "a Python pickle"),
    (lambda p, tr: p.write_text("hello\n"), "a text file"),
    (lambda p, tr: p.write_bytes(b""), "an empty file"),
])
def test_load_of_a_file_that_is_not_a_checkpoint_says_what_it_is(tmp_path, make, needle):
    tr = _trainer()
    tr.step(np.ones((4, 4), np.float32), np.arange(4) % 2)
    path = tmp_path / "file.bin"
    make(path, tr)
    (path,) = tmp_path.iterdir()  # np.save / np.savez append .npy / .npz
    before = tr.net.state_dict()
    with pytest.raises(CheckpointError, match=needle) as e:
        tr.load(path)
    assert "not a minidl checkpoint" in str(e.value)
    assert "missing" not in str(e.value)
    for k, v in tr.net.state_dict().items():
        np.testing.assert_array_equal(v, before[k])


def test_load_of_a_missing_file(tmp_path):
    tr = _trainer()
    with pytest.raises(FileNotFoundError, match="does not exist"):
        tr.load(tmp_path / "nope.npz")


def test_load_of_another_networks_checkpoint_changes_nothing(tmp_path):
    other = minidl.Sequential([minidl.layers.Linear(4, 2)], input_shape=(4,))
    tro = minidl.Trainer(other, device_memory="8MiB")
    tro.save(tmp_path / "other.npz")
    tr = _trainer()
    before = (tr.net.state_dict(), tr.optimizer.state_dict(), tr.iteration)
    with pytest.raises(CheckpointError, match="does not match this network"):
        tr.load(tmp_path / "other.npz")
    assert tr.iteration == before[2]
    for k, v in tr.net.state_dict().items():
        np.testing.assert_array_equal(v, before[0][k])


def test_checkpoint_round_trip_keeps_num_batches_tracked(tmp_path):
    tr = _trainer()
    for _ in range(2):
        tr.step(np.random.default_rng(0).standard_normal((4, 4)).astype(np.float32),
                np.arange(4) % 2)
    tr.save(tmp_path / "ck.npz")
    fresh = _trainer()
    fresh.load(tmp_path / "ck.npz")
    assert int(fresh.net.state_dict()["1.num_batches_tracked"]) == 2
    assert fresh.iteration == tr.iteration


def test_save_into_a_missing_folder_names_the_folder(tmp_path):
    tr = _trainer()
    with pytest.raises(FileNotFoundError, match=f"folder {tmp_path / 'nope'} does not exist"):
        tr.save(tmp_path / "nope" / "x.npz")

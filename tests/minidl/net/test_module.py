"""minidl.Module: a model written as a PyTorch-style class traces into the same graph as the
functional API (trains bit for bit like it), takes PyTorch's state_dict names from its
attributes, works wherever a Network does (Trainer, fit, dry_run, the command line's
MODULE:CLASS), and says in one line what is wrong with a forward it cannot trace."""

from __future__ import annotations

import importlib.util
import json
import textwrap

import numpy as np
import pytest

import minidl
from minidl import layers as L
from minidl.cli import main
from minidl.net.module import ModuleError
from minidl.net.optim import SGD
from minidl.zoo.user_models import UserModelError, build_user_model


class Block(minidl.Module):
    """A residual block as a sub-Module (no input shape of its own)."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv = L.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn = L.BatchNorm2d(c)
        self.relu = L.ReLU()

    def forward(self, x):
        return self.relu(L.Add()(x, self.bn(self.conv(x))))


class Net(minidl.Module):
    def __init__(self, input_shape=(1, 8, 8)) -> None:
        super().__init__(input_shape=input_shape)
        self.conv1 = L.Conv2d(1, 8, 3, padding=1)
        self.relu = L.ReLU()  # applied twice (a parameter-free layer may be)
        self.block = Block(8)
        self.features = minidl.Sequential([L.Conv2d(8, 8, 3, padding=1), L.ReLU()])
        self.head = [L.MaxPool2d(2), L.Flatten(), L.Dropout(0.25), L.Linear(8 * 4 * 4, 10)]

    def forward(self, x):
        x = self.relu(self.conv1(x))
        x = self.block(x)
        x = self.relu(self.features(x))
        for layer in self.head:
            x = layer(x)
        return x


def functional_net() -> minidl.Network:
    """The same network written with Input / Network, layers applied in the same order."""
    x = minidl.Input((1, 8, 8))
    a = L.ReLU()(L.Conv2d(1, 8, 3, padding=1)(x))
    b = L.ReLU()(L.Add()(a, L.BatchNorm2d(8)(L.Conv2d(8, 8, 3, padding=1, bias=False)(a))))
    y = L.ReLU()(L.ReLU()(L.Conv2d(8, 8, 3, padding=1)(b)))
    y = L.Linear(8 * 4 * 4, 10)(L.Dropout(0.25)(L.Flatten()(L.MaxPool2d(2)(y))))
    return minidl.Network(x, y)


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint8)


def _train(net: minidl.Network, steps: int = 3):
    trainer = minidl.Trainer(net, SGD(net.parameters(), lr=0.1, momentum=0.9),
                             memory="reuse,inplace", seed=3)
    rng = np.random.default_rng(0)
    losses, grads = [], []
    for _ in range(steps):
        x = rng.standard_normal((16, 1, 8, 8)).astype(np.float32)
        y = rng.integers(0, 10, 16)
        losses.append(trainer.step(x, y))
        grads.append([p.grad.copy() for p in net.parameters()])
    return losses, grads, [a for a in net.state_dict().values()]


def test_a_class_trains_bit_for_bit_like_the_functional_network():
    net, ref = Net(), functional_net()
    assert [p.shape for p in net.parameters()] == [p.shape for p in ref.parameters()]
    losses, grads, state = _train(net)
    ref_losses, ref_grads, ref_state = _train(ref)
    assert np.array(losses).view(np.uint64).tolist() == \
        np.array(ref_losses).view(np.uint64).tolist()
    for step, (g, rg) in enumerate(zip(grads, ref_grads)):
        for k, (a, b) in enumerate(zip(g, rg)):
            assert np.array_equal(_bits(a), _bits(b)), (step, k)
    for a, b in zip(state, ref_state):
        assert np.array_equal(_bits(a), _bits(b))


def test_state_dict_names_come_from_the_attributes():
    net = Net()
    assert list(net.state_dict()) == [
        "conv1.weight", "conv1.bias", "block.conv.weight", "block.bn.weight", "block.bn.bias",
        "block.bn.running_mean", "block.bn.running_var", "block.bn.num_batches_tracked",
        "features.0.weight", "features.0.bias", "head.3.weight", "head.3.bias"]
    names = [node.name for node in net.nodes]
    assert names[:3] == ["conv1", "relu", "block.conv"] and "relu_2" in names
    # the Sequential block holds no parameters of its own: the Module's, the same arrays
    assert net.features.state_dict().keys() == {"features.0.weight", "features.0.bias"}
    assert net.features.parameters()[0] is dict(net.named_parameters())["features.0.weight"]


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch")
def test_state_dict_names_are_pytorchs_and_weights_load_there():
    import torch
    from torch import nn

    class TorchBlock(nn.Module):
        def __init__(self, c):
            super().__init__()
            self.conv = nn.Conv2d(c, c, 3, padding=1, bias=False)
            self.bn = nn.BatchNorm2d(c)
            self.relu = nn.ReLU()

    class TorchNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1 = nn.Conv2d(1, 8, 3, padding=1)
            self.relu = nn.ReLU()
            self.block = TorchBlock(8)
            self.features = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.ReLU())
            self.head = nn.ModuleList([nn.MaxPool2d(2), nn.Flatten(), nn.Dropout(0.25),
                                       nn.Linear(8 * 4 * 4, 10)])

    net, twin = Net(), TorchNet()
    assert list(net.state_dict()) == list(twin.state_dict())
    twin.load_state_dict({k: torch.from_numpy(v) for k, v in net.state_dict().items()},
                         strict=True)
    net.load_state_dict(twin.state_dict())


def test_input_shape_from_the_first_batch_and_anywhere_a_network_goes():
    net = Net(input_shape=None)
    assert not net.traced
    trainer = minidl.Trainer(net, memory="reuse,inplace")  # (traces it)
    assert net.traced and net.input_shapes == [None]
    rng = np.random.default_rng(1)
    x = rng.standard_normal((40, 1, 8, 8)).astype(np.float32)
    y = rng.integers(0, 10, 40)
    hist = trainer.fit((x, y), epochs=1, batch_size=16, progress=False)
    assert len(hist.losses) == 3
    assert minidl.dry_run(Net(), batch_size=8, memory="reuse")["peak_allocated_bytes"] > 0


class NoForward(minidl.Module):
    def __init__(self):
        super().__init__(input_shape=(4,))
        self.fc = L.Linear(4, 2)


class ReturnsNumber(minidl.Module):
    def __init__(self):
        super().__init__(input_shape=(4,))
        self.fc = L.Linear(4, 2)

    def forward(self, x):
        self.fc(x)
        return 3


class UsesUnassigned(minidl.Module):
    def __init__(self):
        super().__init__(input_shape=(4,))
        self.fc = L.Linear(4, 2)

    def forward(self, x):
        return self.fc2(self.fc(x))


class MakesLayerInForward(minidl.Module):
    def __init__(self):
        super().__init__(input_shape=(4,))

    def forward(self, x):
        return L.Linear(4, 2)(x)


class SharesWeights(minidl.Module):
    def __init__(self):
        super().__init__(input_shape=(4,))
        self.fc = L.Linear(4, 4)

    def forward(self, x):
        return self.fc(self.fc(x))


class NoSuperInit(minidl.Module):
    def __init__(self):
        self.fc = L.Linear(4, 2)

    def forward(self, x):
        return self.fc(x)


class CallsOnData(minidl.Module):
    def __init__(self):
        super().__init__(input_shape=(4,))
        self.fc = L.Linear(4, 2)

    def forward(self, x):
        return self.fc(np.zeros((1, 4), np.float32))


@pytest.mark.parametrize("cls, error, needle", [
    (NoForward, ModuleError, "NoForward defines no forward(self, x)"),
    (ReturnsNumber, ModuleError, "ReturnsNumber.forward returned int, not the symbolic output"),
    (UsesUnassigned, AttributeError, "UsesUnassigned has no attribute 'fc2' (read in forward)"),
    (MakesLayerInForward, ModuleError, "applies a Linear (Linear(4, 2)) that is no attribute"),
    (SharesWeights, ModuleError, "applies self.fc (Linear(4, 4)) more than once"),
    (NoSuperInit, ModuleError, "NoSuperInit.__init__ did not call super().__init__()"),
    (CallsOnData, TypeError, "Linear takes symbolic tensors"),
])
def test_what_cannot_be_traced_is_said_in_one_line(cls, error, needle):
    with pytest.raises(error) as info:
        cls()
    message = str(info.value)
    assert needle in message and "\n" not in message, message


def test_a_module_called_on_data_says_how_to_run_it():
    with pytest.raises(TypeError, match=r"Net\(\.\.\.\) takes symbolic tensors .*predict"):
        Net()(np.zeros((1, 1, 8, 8), np.float32))


SOURCE = '''
import minidl
from minidl import layers as L


class Small(minidl.Module):
    def __init__(self, num_classes=10):
        super().__init__()
        self.conv = L.Conv2d(1, 4, 3, padding=1)
        self.relu = L.ReLU()
        self.fc = L.Linear(4 * 8 * 8, num_classes)

    def forward(self, x):
        return self.fc(L.Flatten()(self.relu(self.conv(x))))


class NotAModule:
    pass
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch, request):
    name = f"user_classes_{request.node.name.replace('[', '_').replace(']', '')}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(SOURCE))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def test_the_command_line_takes_a_module_class(user_module, capsys):
    net = build_user_model(f"{user_module}:Small", (1, 8, 8), 3)
    assert net.input_shapes == [(1, 8, 8)] and net.name == "Small"
    assert list(net.state_dict()) == ["conv.weight", "conv.bias", "fc.weight", "fc.bias"]
    with pytest.raises(UserModelError, match="Small has no input shape: give --input"):
        build_user_model(f"{user_module}:Small")
    with pytest.raises(UserModelError, match="the class NotAModule, not a minidl.Module"):
        build_user_model(f"{user_module}:NotAModule")
    assert main(["plan", f"{user_module}:Small", "--input", "1x8x8", "--batch-size", "4",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["peak_allocated_bytes"] > 0
    assert main(["train", f"{user_module}:Small", "--dataset", "synthetic", "--input", "1x8x8",
                 "--max-steps", "2", "--json", "--no-progress"]) == 0
    assert json.loads(capsys.readouterr().out)["steps"] == 2

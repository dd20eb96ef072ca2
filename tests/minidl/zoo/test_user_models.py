"""A user's own model by MODULE:FUNCTION in plan and train (bench and export build it alike): the
function gets the arguments it declares, its network's input shape is used without --input, and
every mistake (no module, no function, not a Network, the function raising) is one line naming
the module and what was wrong."""

from __future__ import annotations

import json
import textwrap

import pytest

from minidl.cli import main
from minidl.net.graph import Network
from minidl.zoo.user_models import UserModelError, build_user_model, is_user_model

SOURCE = '''
import minidl
from minidl import layers as L


def build(input_shape=(1, 8, 8), num_classes=10):
    c, h, w = input_shape
    return minidl.Sequential([L.Conv2d(c, 4, 3, padding=1), L.ReLU(), L.Flatten(),
                              L.Linear(4 * h * w, num_classes)], input_shape=input_shape)


def fixed():
    return minidl.Sequential([L.Flatten(), L.Linear(12, 3)], input_shape=(3, 2, 2))


def everything(**kwargs):
    return build(**{k: v for k, v in kwargs.items() if k != "width"})


def broken(input_shape=None):
    raise RuntimeError("the user's bug\\nsecond line")


def not_a_network():
    return 42


NOT_CALLABLE = 3
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch, request):
    """A module of the user's in the current folder, under a name unique to the test."""
    name = f"user_nets_{request.node.name.replace('[', '_').replace(']', '').replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(SOURCE))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def test_the_function_gets_the_arguments_it_declares(user_module):
    net = build_user_model(f"{user_module}:build", (3, 6, 6), 5, width=7)
    assert isinstance(net, Network) and net.input_shapes[0] == (3, 6, 6)
    assert build_user_model(f"{user_module}:fixed", (1, 8, 8), 10).input_shapes[0] == (3, 2, 2)
    assert build_user_model(f"{user_module}:everything", (2, 4, 4), 3,
                            width=9).input_shapes[0] == (2, 4, 4)
    assert is_user_model("a.b:c") and not is_user_model("resnet20")


@pytest.mark.parametrize("function, needle", [
    ("missing", "has no 'missing'; its functions: broken, build, everything, fixed, "
                "not_a_network"),
    ("broken", "broken(input_shape=(1, 8, 8)) raised RuntimeError: the user's bug"),
    ("not_a_network", "returned int, not a minidl Network"),
    ("NOT_CALLABLE", "is a int, not a function returning a Network"),
])
def test_mistakes_are_one_line_naming_the_module(user_module, function, needle):
    with pytest.raises(UserModelError) as e:
        build_user_model(f"{user_module}:{function}", (1, 8, 8), 10)
    assert needle in str(e.value) and "\n" not in str(e.value)
    assert f"{user_module}:{function}" in str(e.value)


def test_a_missing_module_or_bad_spec(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserModelError, match="no module named 'nowhere_at_all' "
                                             r"\(looked in .* and on sys.path\)"):
        build_user_model("nowhere_at_all:build")
    with pytest.raises(UserModelError, match="expected MODULE:FUNCTION"):
        build_user_model("a b:c")


def test_plan_and_train_take_a_user_model(user_module, capsys):
    assert main(["plan", f"{user_module}:build", "--input", "3x8x8", "--batch-size", "4",
                 "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["input"] == [3, 8, 8] and rep["peak_allocated_bytes"] > 0
    # without --input: the network's own input shape
    assert main(["plan", f"{user_module}:fixed", "--batch-size", "4", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["input"] == [3, 2, 2]
    assert main(["train", f"{user_module}:build", "--dataset", "synthetic", "--input",
                 "1x8x8", "--max-steps", "2", "--json", "--no-progress"]) == 0
    assert json.loads(capsys.readouterr().out)["steps"] == 2
    assert main(["plan", f"{user_module}:broken", "--batch-size", "4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "raised RuntimeError: the user's bug" in err[0]

"""Per-block memory choices: ``layers.Checkpoint(block, memory=...)`` and ``layer(x, memory=)``
force recompute / swap / keep on a block's feature maps, and every planner honours them
(plain ``reuse``, ``recompute=`` policies, ``swap=``, ``auto`` greedy and MILP), losslessly,
with the dry run's peak equal to the real run's."""

from __future__ import annotations

import numpy as np
import pytest

import minidl
from minidl import layers as L
from minidl.compile.lowering import lower
from minidl.memory.passes.base_plan import plan_peak
from minidl.memory.planners.auto import auto_choose, build, forced_choice, step_costs
from minidl.memory.planners.optimal import optimal_choose
from minidl.net.optim import SGD

X = np.random.default_rng(0).standard_normal((6, 3, 8, 8)).astype(np.float32)
Y = np.random.default_rng(1).integers(0, 10, 6)
BLOCK = ["b_conv1", "b_bn", "b_relu1", "b_conv2", "b_relu2"]


def named(layer, name):
    layer.name = name
    return layer


def make_net(choice: str | None = "recompute", second: str | None = None) -> minidl.Network:
    """conv-relu, then a marked block conv-bn-relu-conv-relu (``choice``), then conv-relu
    (marked ``second`` with ``memory=``), pool, linear."""
    x = minidl.Input((3, 8, 8))
    h = L.ReLU()(L.Conv2d(3, 4, 3, padding=1)(x))
    block = [named(L.Conv2d(4, 6, 3, padding=1), "b_conv1"), named(L.BatchNorm2d(6), "b_bn"),
             named(L.ReLU(), "b_relu1"), named(L.Conv2d(6, 6, 3, padding=1), "b_conv2"),
             named(L.ReLU(), "b_relu2")]
    if choice is None:
        for layer in block:
            h = layer(h)
    else:
        h = L.Checkpoint(block, memory=choice)(h)
    h = named(L.Conv2d(6, 4, 3, padding=1), "c_conv")(h, memory=second)
    h = named(L.ReLU(), "c_relu")(h, memory=second)
    h = L.MaxPool2d(2)(h)
    y = L.Linear(64, 10)(L.Flatten()(h))
    return minidl.Network(x, y, seed=3)


def train(make, spec: str, steps: int = 3):
    net = make()
    tr = minidl.Trainer(net, SGD(net.parameters(), lr=0.05, momentum=0.9), memory=spec,
                        device_memory="16MiB", debug=True)
    losses = [tr.step(X, Y) for _ in range(steps)]
    plan = tr.engine.compiled([X.shape], Y.shape, True).plan
    return losses, net.state_dict(), tr, plan


def check_lossless_and_exact(make, spec: str):
    """Bit-identical to ``none`` (NaN-poisoned pool) and the dry run's peak == the real one."""
    base_losses, base_state, _, _ = train(make, "none")
    losses, state, tr, plan = train(make, spec)
    assert losses == base_losses, spec
    for k in base_state:
        assert np.array_equal(state[k], base_state[k]), (spec, k)
    dry = minidl.dry_run(make(), X.shape[0], spec, input_shape=X.shape[1:])
    assert dry["peak_allocated_bytes"] == tr.memory_report()["peak_allocated_bytes"], spec
    return plan, dry


def recomputed(plan) -> set[str]:
    return {s.layer for s in plan.program.steps if s.phase == "recompute"}


def swapped(plan) -> set[str]:
    return {plan.program.tensors[t].layer for t in plan.swapping.blocks}


def test_forced_recompute_without_a_recompute_flag():
    plan, dry = check_lossless_and_exact(make_net, "reuse,inplace")
    assert recomputed(plan) == set(BLOCK)
    assert any(n.startswith("blocks force: recompute 5 layers") for n in dry["notes"])
    unmarked = train(lambda: make_net(None), "reuse,inplace", steps=1)[3]
    assert recomputed(unmarked) == set()


def test_forced_swap_without_a_swap_flag():
    plan, _ = check_lossless_and_exact(lambda: make_net("swap"), "reuse")
    assert swapped(plan) and swapped(plan) <= set(BLOCK)
    assert recomputed(plan) == set()


def test_memory_argument_on_a_layer_and_keep_under_swap_all():
    plan, _ = check_lossless_and_exact(lambda: make_net("keep", second="swap"), "reuse,swap=all")
    assert not swapped(plan) & set(BLOCK)  # kept, although swap=all swaps the others
    assert swapped(plan) & {"c_conv", "c_relu"}
    unmarked = train(lambda: make_net(None), "reuse,swap=all", steps=1)[3]
    assert swapped(unmarked) & set(BLOCK)


def test_keep_block_under_recompute_sqrt():
    plan, _ = check_lossless_and_exact(lambda: make_net("keep"), "reuse,recompute=sqrt")
    assert not recomputed(plan) & set(BLOCK)
    unmarked = train(lambda: make_net(None), "reuse,recompute=sqrt", steps=1)[3]
    assert recomputed(unmarked) & set(BLOCK)  # sqrt alone drops some of them


def test_forced_recompute_under_a_policy_that_keeps_convolutions():
    plan, _ = check_lossless_and_exact(make_net, "reuse,recompute=speed")
    assert {"b_conv1", "b_conv2"} <= recomputed(plan)  # speed keeps convolutions otherwise


@pytest.mark.parametrize("planner", ["", ",planner=optimal"])
def test_auto_honours_forced_choices_and_the_budget(planner):
    make = lambda: make_net("recompute", second="swap")  # noqa: E731
    free = minidl.dry_run(make_net(None), X.shape[0], "reuse,inplace", input_shape=X.shape[1:])
    # below what reuse,inplace reserves, above what auto needs without capping workspaces
    budget = free["peak_reserved_bytes"] - 2048
    spec = f"auto,budget={budget}{planner}"
    plan, dry = check_lossless_and_exact(make, spec)
    assert set(BLOCK) <= recomputed(plan)
    assert swapped(plan) & {"c_conv", "c_relu"}
    assert dry["peak_reserved_bytes"] <= budget
    choice = plan.provenance.auto
    assert not {plan.program.tensors[t].layer for t in choice.swapped} & set(BLOCK)


def test_checkpoint_of_a_function_marks_its_sub_graph():
    x = minidl.Input((3, 8, 8))
    stem = L.Conv2d(3, 4, 3, padding=1)
    h = stem(x)

    def residual(v):
        return L.Add()(v, L.ReLU()(L.Conv2d(4, 4, 3, padding=1)(v)))

    y = L.Linear(256, 10)(L.Flatten()(L.Checkpoint(residual)(h)))
    net = minidl.Network(x, y)
    marks = {n.name: n.memory for n in net.nodes}
    assert marks == {"conv2d1": "", "conv2d2": "recompute", "relu1": "recompute",
                     "add1": "recompute", "flatten1": "", "linear1": ""}


def test_bad_choices_are_one_line_errors():
    x = minidl.Input((3, 8, 8))
    y = L.Flatten()(L.ReLU()(x, memory="drop"))
    with pytest.raises(ValueError, match=r"memory='drop' is not a memory choice; valid: "
                                         r"recompute, swap, keep"):
        minidl.Network(x, y)
    other = minidl.Input((3, 8, 8))
    with pytest.raises(ValueError, match="not among the symbols it was called on"):
        L.Checkpoint(lambda v: L.Add()(v, other))(x)
    with pytest.raises(TypeError, match="Checkpoint takes a layer"):
        L.Checkpoint([])


@pytest.mark.parametrize("choice,second,cut", [("recompute", "swap", 3), ("keep", "recompute", 2)])
def test_milp_treats_forced_choices_as_constraints(choice, second, cut):
    """The MILP itself (not the greedy fallback) solves with the forced decisions fixed."""
    program = lower(make_net(choice, second), [X.shape], loss=L.SoftmaxCrossEntropy(),
                    label_shape=Y.shape).program
    start = forced_choice(program)
    forced_peak = program.persistent_bytes() + plan_peak(build(program, start))
    smallest = auto_choose(program, None).peak
    budget = smallest + (forced_peak - smallest) // cut  # between the forced and the least
    got = optimal_choose(program, budget, step_costs(program, None), bandwidth=1e6,
                         greedy=start)
    assert not [p for p in got.path if p[0] == "fallback"], got.path[-1]
    assert got.peak <= budget
    dropped = {program.steps[k].layer for k in got.dropped}
    swapped_layers = {program.tensors[t].layer for t in got.swapped}
    if choice == "recompute":
        assert set(BLOCK) <= dropped and "c_relu" in swapped_layers
    else:  # the block is kept; the MILP drops the unmarked conv-relu it would keep otherwise
        assert not (dropped | swapped_layers) & set(BLOCK)
        assert {"c_conv", "c_relu"} <= dropped

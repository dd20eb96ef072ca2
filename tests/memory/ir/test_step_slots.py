"""A step's reads and writes come from its named slots (Step.slot_reads / slot_writes), the
way lowering sets them."""

from __future__ import annotations

import pytest

from minidl.compile.lowering import Sharding, lower
from minidl.layers import SoftmaxCrossEntropy
from minidl.memory.ir.program import Step
from minidl.memory.ir.step_parts import BackwardSlots, ForwardSlots, GradInput
from minidl.zoo.models import get_model


def test_a_forward_step_reads_inputs_then_parameters_and_writes_outputs_then_stash():
    st = Step(0, "forward", "fc", "linear", 0, forward=ForwardSlots(
        inputs=(3, 3), outputs=(5,), params={"weight": 1, "bias": 2}, stash={"mask": 6}))
    assert st.slot_reads() == (3, 3, 1, 2)  # an input read twice stays twice (add(x, x))
    assert st.slot_writes() == (5, 6)


def test_a_backward_step_reads_what_it_retains_and_writes_each_gradient_once():
    st = Step(0, "backward", "add", "add", 0,
              forward=ForwardSlots(inputs=(3, 4), outputs=(5,), stash={"s": 7}, params={"w": 1}),
              backward=BackwardSlots(grad_outputs=(9,), retained_inputs=(1,),
                                     retained_outputs=(0,),
                                     grad_inputs=(GradInput(10, 11), None),
                                     grad_params={"w": 12}, param_partials={"w": 13}))
    assert st.slot_reads() == (9, 4, 5, 7, 1)
    assert st.slot_writes() == (10, 11, 12, 13)
    # the same tensor in two slots is read once
    again = Step(0, "backward", "x", "x", 0, forward=ForwardSlots(inputs=(9,)),
                 backward=BackwardSlots(grad_outputs=(9,), retained_inputs=(0,)))
    assert again.slot_reads() == (9,)


@pytest.mark.parametrize("name", ["smallcnn", "resnet18", "char-lstm", "gpt-char"])
@pytest.mark.parametrize("accumulate, gather", [(False, False), (True, True)])
def test_lowering_sets_reads_and_writes_from_the_slots(name, accumulate, gather):
    net = get_model(name)
    shape = (2, *net.input_shapes[0])
    text = len(shape) == 2  # a character model: one label per position
    low = lower(net, [shape], SoftmaxCrossEntropy(), label_shape=shape if text else (2,),
                accumulate_grads=accumulate, sharding=Sharding((), ()) if gather else None)
    steps = low.program.steps
    assert {st.phase for st in steps} == {"forward", "backward"}
    for st in steps:
        assert (st.access.reads, st.access.writes) == (st.slot_reads(), st.slot_writes()), st.label

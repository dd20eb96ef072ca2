"""Phases, roles and categories are enums that read as their strings (memory/ir/names.py)."""

import json
import pickle

import pytest

from minidl.memory.ir.names import Category, Phase, Role
from minidl.memory.ir.program import Step, TensorSpec
from minidl.memory.ir.step_parts import StepAccess
from minidl.memory.runtime.pool_report import CATEGORIES


@pytest.mark.parametrize("member", [*Phase, *Role, *Category])
def test_members_are_their_strings(member):
    assert member == member.value and hash(member) == hash(member.value)
    assert str(member) == f"{member}" == member.value and repr(member) == repr(member.value)
    assert json.loads(json.dumps({member: member})) == {member.value: member.value}
    assert pickle.loads(pickle.dumps(member)) is member
    assert {member.value: 1}[member] == 1 and member in {member.value}


def test_specs_and_steps_take_strings_and_hold_members():
    t = TensorSpec(0, "x", (2, 3), "float32", "feature_map", "value")
    assert t.role is Role.VALUE and t.category is Category.FEATURE_MAP
    s = Step(0, "forward", "conv1", "conv", 0, StepAccess((0,), (1,)))
    assert s.phase is Phase.FORWARD and s.label == "conv1 (forward)"


def test_unknown_names_fail_where_made_naming_the_valid_ones():
    with pytest.raises(ValueError, match="unknown role 'vaule'; valid: value, grad, "):
        TensorSpec(0, "x", (1,), "float32", "feature_map", "vaule")
    with pytest.raises(ValueError, match="unknown category 'featuremap'"):
        TensorSpec(0, "x", (1,), "float32", "featuremap", "value")
    with pytest.raises(ValueError, match="unknown phase 'fwd'; valid: forward, backward"):
        Step(0, "fwd", "conv1", "conv", 0)


def test_the_pool_keeps_statistics_by_the_same_categories():
    assert CATEGORIES == tuple(c.value for c in Category)

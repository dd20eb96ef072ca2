"""Memory specs: parsing, presets, and combinations that would be silently ignored."""

from __future__ import annotations

import pytest

from minidl.memory.ir.config import (
    AUTO_EXCLUDES,
    MemoryConfig,
    OnlyAction,
    PlannerChoice,
    RecomputePolicy,
    SwapPolicy,
)
from minidl.memory.ir.names import Codec


def test_flags_presets_and_values():
    assert MemoryConfig.parse("reuse, inplace").flags == {"reuse": "", "inplace": ""}
    assert MemoryConfig.parse("layrub").flags == {"reuse": "", "inplace": ""}
    assert MemoryConfig.parse("").flags == {"none": ""}
    assert MemoryConfig.parse("auto,budget=1KiB").budget == 1024
    assert MemoryConfig.parse("auto,budget=1GiB,split=2").split == 2


def test_policy_values_read_as_enums():
    """The policies read typed, and still print and compare as the spec's words."""
    c = MemoryConfig.parse("reuse,swap=conv,recompute=cost,dpr=bf16")
    assert c.swap is SwapPolicy.CONV and c.recompute is RecomputePolicy.COST
    assert c.dpr is Codec.BF16 and c.planner is None and c.only is None
    a = MemoryConfig.parse("auto,budget=1GiB,planner=greedy,only=swap")
    assert a.planner is PlannerChoice.GREEDY and a.only is OnlyAction.SWAP
    assert c.swap == "conv" and f"swap={c.swap}" == "swap=conv"
    assert c.spec == "reuse,swap=conv,recompute=cost,dpr=bf16"


@pytest.mark.parametrize("spec, message", [
    ("reuse,bogus", "unknown memory flag 'bogus'; valid: none"),
    ("swap=most", "needs a value in conv|all|auto"),
    ("budget=1GiB", "add 'auto' to the spec"),
    ("bptt=0", "needs a positive integer"),
    ("reuse=yes", "takes no value"),
])
def test_bad_specs_name_the_value_and_what_is_valid(spec, message):
    with pytest.raises(ValueError, match=message):
        MemoryConfig.parse(spec)


@pytest.mark.parametrize("flag", ["swap=all", "cache", "binarize", "sparse", "dpr=fp16"])
def test_auto_refuses_flags_it_would_ignore(flag):
    """auto plans keep / swap / recompute itself on reuse,inplace,static: a flag it would drop
    is an error, not a silent no-op (the gist preset included)."""
    assert flag.split("=")[0] in AUTO_EXCLUDES
    with pytest.raises(ValueError, match=f"'{flag.split('=')[0]}' cannot be combined with auto"):
        MemoryConfig.parse(f"auto,budget=1GiB,{flag}")
    with pytest.raises(ValueError, match="cannot be combined with auto"):
        MemoryConfig.parse("gist,auto")


def test_typed_attributes_read_the_parsed_spec():
    c = MemoryConfig.parse("superneurons")
    assert (c.reuse, c.inplace, c.cache, c.static, c.auto) == (True, True, True, False, False)
    assert (c.swap, c.recompute, c.dpr, c.bptt, c.budget) == ("conv", "cost", None, None, None)
    a = MemoryConfig.parse("auto,budget=1KiB,planner=optimal,only=swap,split=2,bptt=3")
    assert (a.auto, a.budget, a.planner, a.only, a.split, a.bptt) == (True, 1024, "optimal",
                                                                       "swap", 2, 3)
    n = MemoryConfig.parse(None)
    assert n.flags == {"none": ""} and not n.reuse and n.swap is None and n.zero == 0


def test_a_preset_keeps_flags_given_before_it_and_yields_to_those_after():
    assert MemoryConfig.parse("swap=all,vdnn").swap == "all"
    assert MemoryConfig.parse("vdnn,swap=all").swap == "all"
    assert MemoryConfig.parse("vdnn").spec == "reuse,swap=conv,static"

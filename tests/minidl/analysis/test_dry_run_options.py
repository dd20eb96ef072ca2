"""dry_run's options as one typed object (DryRunOptions): each field taken as a keyword too,
the same report either way, and an unknown keyword a TypeError naming the valid ones."""

from __future__ import annotations

import pytest

import minidl
from minidl.analysis.dry_run_options import (
    DryRunDevice,
    DryRunInputs,
    DryRunOptions,
    DryRunOutputs,
    keyword_names,
)
from minidl.zoo.models import smallcnn

SHAPE = (1, 16, 16)


def _net():
    return smallcnn(SHAPE, 10, width=8)


def test_options_and_keywords_give_the_same_report():
    by_keywords = minidl.dry_run(_net(), 16, "reuse,inplace", input_shape=SHAPE, top=3,
                                 device_kind="cuda")
    options = DryRunOptions(inputs=DryRunInputs(input_shape=SHAPE),
                            device=DryRunDevice(device_kind="cuda"),
                            outputs=DryRunOutputs(top=3))
    by_options = minidl.dry_run(_net(), 16, "reuse,inplace", options=options)
    assert by_options == by_keywords
    assert len(by_options["live_at_peak"]) == 3


def test_keywords_override_options():
    options = DryRunOptions(outputs=DryRunOutputs(top=1))
    rep = minidl.dry_run(_net(), batch_size=8, memory="reuse", options=options, top=2)
    assert len(rep["live_at_peak"]) == 2


def test_with_keywords_sets_each_group():
    options = DryRunOptions().with_keywords({"training": False, "ranks": 2, "budget": 5})
    assert options.inputs.training is False
    assert options.device.ranks == 2
    assert options.outputs.budget == 5
    assert DryRunOptions().with_keywords({}) == DryRunOptions()


def test_an_unknown_keyword_names_the_valid_ones():
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'topp' \(valid: .*top"):
        minidl.dry_run(_net(), 8, "reuse", topp=3)
    assert keyword_names() == sorted(keyword_names())
    assert {"input_shape", "target", "precision", "snapshot"} <= set(keyword_names())

"""Typed step and program payloads (memory/ir/payloads.py): what lowering makes of a layer's
plain facts, the per-op options, the rewriting passes' summary, and the former dict views."""

from __future__ import annotations

import pytest
from hand_programs import chain, ids

from minidl.layers.convolution.conv2d import Conv2d
from minidl.layers.pooling.pool import MaxPool2d
from minidl.layers.recurrent.fused import LSTM
from minidl.layers.transformer.attention import MultiHeadAttention
from minidl.memory.ir.payloads import (
    AttentionShape,
    ConvGeometry,
    OpFacts,
    OpOptions,
    PoolWindow,
)
from minidl.memory.ir.program import Step
from minidl.memory.ir.step_parts import OpTraits, StepAccess
from minidl.memory.passes.compress import compress_program


def test_a_max_pool_states_its_window():
    facts = OpFacts.of(MaxPool2d(3, stride=2, padding=1).memory_attrs([(2, 4, 9, 9)]))
    assert facts == OpFacts(pool=PoolWindow(9, (3, 3), (2, 2), (1, 1)))


def test_a_convolution_states_its_geometry():
    """Memory reads a convolution's geometry from its step's facts, never from the layer."""
    layer = Conv2d(3, 8, 3, stride=2, padding=1, dilation=1, groups=1)
    facts = OpFacts.of(layer.memory_attrs([(2, 3, 9, 9)]))
    assert facts.convolution == ConvGeometry(8, (3, 3), (2, 2), (1, 1), (1, 1), 1)
    assert facts.convolution.as_tuple() == (8, (3, 3), (2, 2), (1, 1), (1, 1), 1)
    assert facts.pool is None


def test_attention_states_its_shape():
    layer = MultiHeadAttention(16, 4, causal=True)
    facts = OpFacts.of(layer.memory_attrs([(2, 8, 16)]))
    assert facts.attention == AttentionShape(batch=2, seq=8, dim=16, heads=4, causal=True,
                                             dropout=False)
    assert facts.pool is None and facts.time_units is None


def test_a_fused_rnn_states_its_time_units():
    facts = OpFacts.of(LSTM(3, 5, unit_steps=4).memory_attrs([(2, 10, 3)]))
    assert facts.time_units == 3  # 10 steps in units of 4


def test_no_facts_is_the_empty_record():
    assert OpFacts.of({}) == OpFacts()


@pytest.mark.parametrize("bad, message", [
    ({"windw": 4}, "unknown memory fact 'windw' (valid: window, kernel, stride, padding, "
                   "convolution, attention, time_units)"),
    ({"convolution": {"out_channels": 4, "kernel": (3, 3), "stride": (1, 1),
                      "padding": (1, 1), "dilation": (1, 1), "groups": 1, "bias": True}},
     "unknown convolution fact 'bias'"),
    ({"attention": {"batch": 1, "seq": 2, "dim": 3, "heads": 1, "causal": False,
                    "dropout": False, "rope": True}}, "unknown attention fact 'rope'"),
])
def test_an_unknown_fact_fails_naming_the_valid_ones(bad, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        OpFacts.of(bad)


def test_options_from_a_plain_mapping_and_back():
    opts = OpOptions.of({"attn": "blockwise:64", "conv_ws": (0, None)})
    assert opts.attn == "blockwise:64" and opts.conv_ws == (0, None) and opts.bptt is None
    assert opts.as_layer_options == {"attn": "blockwise:64", "conv_ws": (0, None)}
    assert "attn" in opts and "bptt" not in opts and opts.get("bptt", 7) == 7
    assert OpOptions.of(None) == OpOptions() and OpOptions.of(opts) is opts


def test_an_unknown_option_fails_naming_the_valid_ones():
    with pytest.raises(ValueError, match=r"unknown per-op option 'workspace' \(valid: bptt, "
                                         r"attn, conv_ws, device_kind\)"):
        OpOptions.of({"workspace": 0})


def test_a_step_takes_plain_mappings_and_holds_the_typed_records():
    st = Step(0, "forward", "pool", "pool", 0, StepAccess((1,), (2,)), op=OpTraits(
        facts={"window": 4, "kernel": (2, 2), "stride": (2, 2), "padding": (0, 0)},
        options={"device_kind": "cpu"}))
    assert st.op.facts.pool == PoolWindow(4, (2, 2), (2, 2), (0, 0))
    assert st.op.options == OpOptions(device_kind="cpu")
    with pytest.raises(ValueError, match="unknown per-op option 'cache'"):
        Step(0, "forward", "x", "x", 0, op=OpTraits(options={"cache": 1}))


def test_compression_keeps_the_pool_window_on_its_encode_step():
    q = compress_program(chain(), binarize=True)
    t = ids(q)
    enc = next(st for st in q.steps if st.phase == "encode" and st.op.codec.codec == "poolidx")
    assert enc.op.codec.source == t["pool.argmax"] and enc.op.codec.window.size == 4
    assert q.rewrites.compression.encoded == {"relu": "sign", "pool.argmax": "poolidx"}

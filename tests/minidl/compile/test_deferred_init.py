"""Deferred parameter initialisation (minidl/net/deferred_init.py): planning builds draw no
weight, the dry run of a deferred model equals the eager one's, and a deferred model's values,
drawn on first read, equal an eager build's bit for bit."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

import minidl
from minidl.analysis.meta_run import dry_run
from minidl.cli import main
from minidl.net.deferred_init import deferred_parameters, deferring
from minidl.net.optim import AdamW
from minidl.zoo.models import get_model
from minidl.zoo.transformers import TransformerConfig, gpt

# (each builder: Network's own generator, the char RNNs' ParameterStore, the GPT/BERT graph)
MODELS = {"lenet5": None, "resnet18": (3, 32, 32), "char-lstm-unrolled": None,
          "gpt-char": None, "bert-base": None}
GPT2_XL = TransformerConfig(48, 25, 1600, 1024, 50257, dropout=0.1, gelu="tanh")


def _deferred(name: str, shape=None):
    with deferred_parameters():
        assert deferring()
        net = get_model(name, input_shape=shape)
    assert not deferring()
    return net


@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_deferred_models_dry_run_equals_the_eager_ones_and_draws_nothing(name):
    shape = MODELS[name]
    net = _deferred(name, shape)
    assert all(not p.materialised for _, p in net.named_parameters(True))
    eager = get_model(name, input_shape=shape)
    assert all(p.materialised for _, p in eager.named_parameters(True))
    assert [(n, p.shape, p.dtype) for n, p in net.named_parameters(True)] == \
        [(n, p.shape, p.dtype) for n, p in eager.named_parameters(True)]
    for spec in ("none", "reuse,inplace"):
        a = dry_run(net, 2, spec, "adam", input_shape=shape)
        b = dry_run(eager, 2, spec, "adam", input_shape=shape)
        assert a["peak_reserved_bytes"] == b["peak_reserved_bytes"], spec
        assert a["peak_allocated_bytes"] == b["peak_allocated_bytes"], spec
    assert all(not p.materialised for _, p in net.named_parameters(True))


@pytest.mark.parametrize("name", sorted(set(MODELS) - {"bert-base"}))  # (gpt-char: same graph)
def test_reading_one_value_draws_them_all_as_an_eager_build_does(name):
    net = _deferred(name, MODELS[name])
    params = dict(net.named_parameters(True))
    last = list(params.values())[-1]
    assert last.data.shape == last.shape  # (the last read first: all drawn, in creation order)
    assert all(p.materialised for p in params.values())
    eager = get_model(name, input_shape=MODELS[name]).state_dict()
    deferred = net.state_dict()
    assert list(deferred) == list(eager)
    for n, v in eager.items():
        assert deferred[n].dtype == v.dtype and np.array_equal(deferred[n], v), n


def test_training_a_deferred_model_equals_training_an_eager_one():
    config = TransformerConfig(2, 2, 16, 8, 11)
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 11, (3, 8)), rng.integers(0, 11, (3, 8))
    losses = []
    for defer in (False, True):
        if defer:
            with deferred_parameters():
                net = gpt(config)
        else:
            net = gpt(config)
        tr = minidl.Trainer(net, AdamW(net.parameters(), lr=1e-2), device_memory="32MiB")
        losses.append([tr.step(x, y) for _ in range(3)])
    assert losses[0] == losses[1]


def test_a_value_replaced_before_the_first_read_leaves_the_others_as_drawn():
    with deferred_parameters():
        net = get_model("lenet5")
    params = list(net.parameters())
    params[0].data = np.zeros(params[0].shape, np.float32)
    eager = get_model("lenet5").state_dict()
    assert not np.any(params[0].data)
    for n, p in list(net.named_parameters())[1:]:
        assert np.array_equal(p.data, eager[n]), n


def test_planning_a_gpt2_xl_allocates_no_parameter_array():
    """1.56 B float32 values (5.8 GiB) planned with a few MiB traced."""
    tracemalloc.start()
    try:
        with deferred_parameters():
            net = gpt(GPT2_XL, name="gpt2-xl")
        rep = dry_run(net, 1, "none", "adam")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert net.num_parameters() == 1_557_611_200
    assert rep["peak_reserved_bytes"] == 42_126_707_712  # (the eager build's, measured)
    assert all(not p.materialised for _, p in net.named_parameters(True))
    assert peak < 256 * 2**20, peak


def test_minidl_plan_draws_no_weight(capsys):
    """``minidl plan`` of GPT-2 small (124 M values, 475 MiB) traces far less than its
    weights, and the estimate table too (a model built per row)."""
    for extra in ([], ["--table", "--ranks", "1,2"]):
        tracemalloc.start()
        try:
            assert main(["plan", "gpt2-small", "--batch-size", "2", "--seq-len", "64",
                         "--optimizer", "adam", *extra]) == 0
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 100 * 2**20, (extra, peak)
    assert "gpt2-small" in capsys.readouterr().out

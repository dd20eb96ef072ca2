"""Part 9 items 2 and 4: auto never promises what training refuses; plan reports (text, plot
data, trace, exit code) show what the plan does; micro-batch weight gradients accumulate
straight into ``.grad`` (no partial buffers)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import minidl
from minidl import layers as L
from minidl.cli import main
from minidl.compile.lowering import lower
from minidl.layers.base import Context
from minidl.memory.planners.auto import BudgetTooSmall
from minidl.zoo.models import smallcnn
from minidl.zoo.rnn import char_rnn
from tests.least_peak import least_reached


@st.composite
def batchnorm_networks(draw):
    """Small random CNNs with BatchNorm, residual adds and concats (as in
    test_memory_strategies.random_networks, with at least one BatchNorm)."""
    c0 = draw(st.integers(1, 2))
    hw = 6
    x = minidl.Input((c0, hw, hw))
    values = [(x, c0)]
    for _ in range(draw(st.integers(2, 7))):
        op = draw(st.sampled_from(["conv", "bn", "relu", "add", "concat"]))
        v, c = values[draw(st.integers(0, len(values) - 1))]
        if op == "conv":
            co = draw(st.integers(1, 4))
            values.append((L.Conv2d(c, co, 3, padding=1)(v), co))
        elif op == "bn":
            values.append((L.BatchNorm2d(c)(v), c))
        elif op == "relu":
            values.append((L.ReLU()(v), c))
        elif op == "add":
            same = [w for w in values if w[1] == c]
            w = same[draw(st.integers(0, len(same) - 1))]
            values.append((L.Add()(v, w[0]), c))
        else:
            w = values[draw(st.integers(0, len(values) - 1))]
            values.append((L.Concat(axis=1)(v, w[0]), c + w[1]))
    v, c = values[-1]
    v = L.BatchNorm2d(c)(v)
    out = L.Linear(c, 3)(L.GlobalAvgPool2d()(v))
    return c0, x, out, draw(st.integers(0, 1000))


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batchnorm_networks(), st.lists(st.floats(0.3, 1.2), min_size=1, max_size=3))
def test_what_the_auto_dry_run_accepts_training_runs(netdef, factors):
    c0, x_sym, out_sym, seed = netdef

    def make():
        return minidl.Network(x_sym, out_sym, seed=seed)

    batch, shape = 8, (c0, 6, 6)
    base = minidl.dry_run(make(), batch, "reuse,inplace", input_shape=shape)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch, *shape)).astype(np.float32)
    y = rng.integers(0, 3, batch)
    for f in factors:
        spec = f"auto,budget={int(base['peak_allocated_bytes'] * f)}"
        try:
            rep = minidl.dry_run(make(), batch, spec, input_shape=shape)
        except BudgetTooSmall as e:
            with pytest.raises(BudgetTooSmall):  # training refuses it the same way
                minidl.Trainer(make(), memory=spec, device_memory="64MiB").step(x, y)
            assert "BatchNorm" in str(e)
            continue
        assert rep["split"] == 1
        tr = minidl.Trainer(make(), memory=spec, device_memory="64MiB")
        assert np.isfinite(tr.step(x, y))  # whatever the dry run accepts, training runs
        assert tr.memory_report()["peak_allocated_bytes"] == rep["peak_allocated_bytes"]


def test_explicit_split_with_batchnorm_is_refused_by_the_dry_run_too():
    net = minidl.Sequential([L.Conv2d(1, 2, 3), L.BatchNorm2d(2), L.GlobalAvgPool2d(),
                             L.Linear(2, 3)], input_shape=(1, 6, 6))
    with pytest.raises(ValueError, match="BatchNorm"):
        minidl.dry_run(net, 8, "reuse,split=2")


def _split_budget():
    """A budget smallcnn (batch 64, no BatchNorm) meets only by splitting the batch: just
    below the least peak any plan of the whole batch reaches."""
    return least_reached(lambda b: minidl.dry_run(
        smallcnn((1, 16, 16), 10, width=8), 64, f"auto,budget={b},split=1",
        input_shape=(1, 16, 16))) - 512


def run_cli(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_plan_text_shows_an_automatic_split_and_the_micro_batch_layer_table(capsys):
    budget = _split_budget()
    code, out, _ = run_cli(capsys, "plan", "smallcnn", "--input", "1x16x16", "--width", "8",
                           "--batch-size", "64", "--memory", "auto", "--budget", str(budget),
                           "--json")
    assert code == 0
    split = json.loads(out)["split"]
    assert split > 1
    micro = 64 // split
    code, out, _ = run_cli(capsys, "plan", "smallcnn", "--input", "1x16x16", "--width", "8",
                           "--batch-size", "64", "--memory", "auto", "--budget", str(budget),
                           "--layers")
    assert code == 0
    assert f"batch split into {split} micro-batches of {micro}" in out
    assert f"layers of one micro-batch of {micro}" in out


@pytest.mark.parametrize("spec", ["reuse,inplace", "none", "reuse,swap=all"])
def test_plan_over_the_budget_says_so_and_exits_1(capsys, spec):
    code, out, _ = run_cli(capsys, "plan", "smallcnn", "--input", "1x16x16", "--width", "8",
                           "--memory", spec, "--budget", "1MiB")
    assert code == 1
    assert "does NOT fit" in out
    code, out, _ = run_cli(capsys, "plan", "smallcnn", "--input", "1x16x16", "--width", "8",
                           "--memory", spec, "--budget", "1GiB", "--json")
    assert code == 0 and json.loads(out)["fits_budget"] is True


def test_plot_data_has_one_point_per_event_and_shows_the_peak(monkeypatch, tmp_path):
    import minidl.analysis.report as report

    seen = {}
    monkeypatch.setattr(report, "plot_timeline",
                        lambda series, path, title="", budget=None: seen.update(
                            series=series, budget=budget))
    budget = _split_budget()
    rep = minidl.dry_run(smallcnn((1, 16, 16), 10, width=8), 64, f"auto,budget={budget}",
                         input_shape=(1, 16, 16), plot=str(tmp_path / "p.png"))
    series = seen["series"]
    xs = series["x"]
    assert all(a < b for a, b in zip(xs, xs[1:]))  # distinct, ordered: nothing collapses
    totals = [sum(v[i] for v in series["bytes"].values()) for i in range(len(xs))]
    assert max(totals) == rep["peak_allocated_bytes"]
    assert seen["budget"] == budget


def test_trace_events_have_distinct_ordered_timestamps_and_the_peak(tmp_path):
    path = tmp_path / "t.json"
    rep = minidl.dry_run(smallcnn((1, 16, 16), 10, width=8), 16, "reuse,inplace",
                         input_shape=(1, 16, 16), trace=str(path))
    events = json.loads(path.read_text())["traceEvents"]
    counters = [e for e in events if e["name"] == "device bytes"]
    ts = [e["ts"] for e in counters]
    assert all(a < b for a, b in zip(ts, ts[1:]))
    assert max(sum(e["args"].values()) for e in counters) == rep["peak_allocated_bytes"]
    slices = {e["ts"]: e for e in events if e.get("ph") == "X"}
    instants = [e for e in events if e.get("ph") == "i"]
    assert len(instants) == len(counters) and len(slices) == rep["num_steps"]


# ------------------------------------------------------------------ gradient accumulation
def _micro_batch_program(net, shape, label_shape=None):
    from minidl.layers import SoftmaxCrossEntropy

    return lower(net, [shape], loss=SoftmaxCrossEntropy(), label_shape=label_shape or shape[:1],
                 accumulate_grads=True).program


def test_micro_batches_keep_no_partial_weight_gradient_for_linear_bn_embedding():
    net = minidl.Sequential([L.Flatten(), L.Linear(12, 8), L.BatchNorm1d(8), L.ReLU(),
                             L.Linear(8, 3)], input_shape=(3, 4))
    prog = _micro_batch_program(net, (4, 3, 4))
    assert not [t.name for t in prog.tensors if t.role == "grad_partial"]
    tok = minidl.Input((5,), dtype="int64")
    emb = minidl.Network(tok, L.Linear(20, 3)(L.Flatten()(L.Embedding(10, 4)(tok))))
    prog = _micro_batch_program(emb, (2, 5))
    assert not [t.name for t in prog.tensors if t.role == "grad_partial"]


def test_micro_batches_keep_no_partial_weight_gradient_for_conv_and_fused_rnn():
    net = minidl.Sequential([L.Conv2d(2, 4, 3, padding=1), L.ReLU(), L.Flatten(),
                             L.Linear(4 * 5 * 5, 3)], input_shape=(2, 5, 5))
    prog = _micro_batch_program(net, (4, 2, 5, 5))
    assert not [t.name for t in prog.tensors if t.role == "grad_partial"]
    lm = char_rnn(vocab_size=11, embedding_dim=6, hidden_size=5, steps=7)
    prog = _micro_batch_program(lm, (3, 7), (3, 7))
    assert not [t.name for t in prog.tensors if t.role == "grad_partial"]


@pytest.mark.parametrize("make", [
    lambda: (L.Linear(6, 4), [np.float64], (5, 6)),
    lambda: (L.BatchNorm1d(6), [np.float64], (5, 6)),
    lambda: (L.Conv2d(3, 4, 3, padding=1), [np.float64], (5, 3, 6, 6)),
    lambda: (L.Conv2d(16, 4, 3, padding=1), [np.float64], (2, 16, 8, 8)),  # Winograd
    lambda: (L.LSTM(4, 5, num_layers=2), [np.float64], (3, 6, 4)),
    lambda: (L.GRU(4, 5, num_layers=2), [np.float64], (3, 6, 4)),
])
def test_backward_adds_into_the_gradients_named_in_ctx_accumulate(make):
    layer, (dt,), shape = make()
    rng = np.random.default_rng(0)
    params = {k: s.initial_value(rng, dt) for k, s in layer.param_specs().items()}
    trainable = [k for k, s in layer.param_specs().items() if s.trainable]
    x = rng.standard_normal(shape)
    y = np.empty(layer.output_shapes([shape])[0])
    stash = {k: np.empty(s, d) for k, (s, d) in layer.stash_specs([shape], np.dtype(dt)).items()}
    fws = np.empty(layer.forward_workspace_bytes([shape], np.dtype(dt)), np.uint8)
    bws = np.empty(layer.backward_workspace_bytes([shape], np.dtype(dt)), np.uint8)
    layer.forward(Context(), [x], [y], params, stash, fws)
    dy = rng.standard_normal(y.shape)
    fresh = {k: np.zeros_like(params[k]) for k in trainable}
    layer.backward(Context(), [dy], [None], [x], [y], params, fresh, stash, bws)
    start = {k: rng.standard_normal(params[k].shape) for k in trainable}
    acc = {k: v.copy() for k, v in start.items()}
    layer.backward(Context(accumulate=frozenset(trainable)), [dy], [None], [x], [y], params,
                   acc, stash, bws)
    for k in trainable:
        np.testing.assert_allclose(acc[k], start[k] + fresh[k], rtol=1e-12, atol=1e-12)


def test_split_gradients_equal_the_whole_batch_with_embedding_and_linear():
    t = minidl.Input((5,), dtype="int64")
    h = L.Flatten()(L.Embedding(10, 4)(t))
    out = L.Linear(20, 3)(h)
    rng = np.random.default_rng(2)
    x = rng.integers(0, 10, (8, 5))
    y = rng.integers(0, 3, 8)
    grads = {}
    for spec in ("none", "reuse,split=4"):
        net = minidl.Network(t, out, seed=3)
        tr = minidl.Trainer(net, memory=spec, device_memory="16MiB")
        tr.compute_gradients(x, y)
        grads[spec] = {n: np.array(p.grad) for n, p in net.named_parameters()}
    for n, g in grads["none"].items():
        np.testing.assert_allclose(grads["reuse,split=4"][n], g, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("model", ["conv", "char-lstm", "char-gru"])
def test_split_gradients_equal_the_whole_batch_with_conv_and_fused_rnn(model):
    rng = np.random.default_rng(4)
    if model == "conv":
        def make():
            return minidl.Sequential([L.Conv2d(16, 8, 3, padding=1), L.ReLU(),
                                      L.Conv2d(8, 4, 3, stride=2), L.Flatten(),
                                      L.Linear(4 * 3 * 3, 3)], input_shape=(16, 8, 8), seed=3)
        x = rng.standard_normal((8, 16, 8, 8)).astype(np.float32)
        y = rng.integers(0, 3, 8)
    else:
        def make():  # embedding folded into the fused layer: token-table gradients too
            return char_rnn(vocab_size=7, embedding_dim=6, hidden_size=5, steps=9,
                            cell=model.split("-")[1], seed=3)
        x = rng.integers(0, 7, (8, 9))
        y = rng.integers(0, 7, (8, 9))
    grads = {}
    for spec in ("none", "reuse,split=4"):
        net = make()
        minidl.Trainer(net, memory=spec, device_memory="16MiB").compute_gradients(x, y)
        grads[spec] = {n: np.array(p.grad) for n, p in net.named_parameters()}
    for n, g in grads["none"].items():
        np.testing.assert_allclose(grads["reuse,split=4"][n], g, rtol=1e-4, atol=1e-6)

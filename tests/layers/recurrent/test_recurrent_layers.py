"""Fused whole-sequence LSTM / GRU layers (``minidl.layers.LSTM`` / ``GRU``): finite-difference
gradients through the engine simulation of ``gradcheck``, parity with torch.nn.LSTM / nn.GRU
(float input and Embedding -> RNN token input, both token paths), every BPTT schedule
bit-identical to keeping everything, float32 against float64, bad input, and stash sizes."""

from __future__ import annotations

import numpy as np
import pytest
from gradcheck import (
    check_declarations,
    check_layer,
    make_params,
    run_forward,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from recurrent_cases import (
    CELLS,
    _in_shapes,
    _inputs,
    _make,
    _run,
    _schedule,
    _units,
    _vocab_for,
    cells,
    seeds,
)

from minidl.layers import GRU, LSTM, Context, ShapeError
from minidl.memory.passes import bptt

SMALL = settings(max_examples=8, deadline=None)


# ---------------------------------------------------------------- finite differences
@SMALL
@given(cell=cells, n=st.integers(1, 3), t=st.integers(1, 7), i=st.integers(1, 3),
       h=st.integers(1, 3), layers=st.integers(1, 2), bias=st.booleans(),
       init=st.booleans(), unit_steps=st.integers(1, 3), seed=seeds)
def test_float_input_gradients(cell, n, t, i, h, layers, bias, init, unit_steps, seed):
    rng = np.random.default_rng(seed)
    layer = _make(cell, i, h, layers, bias, unit_steps=unit_steps, initial_state=init)
    check_layer(layer, _inputs(layer, n, t, rng), rng=rng)


@SMALL
@given(cell=cells, n=st.integers(1, 3), t=st.integers(1, 7), v=st.integers(1, 25),
       i=st.integers(1, 3), h=st.integers(1, 3), layers=st.integers(1, 2), bias=st.booleans(),
       init=st.booleans(), unit_steps=st.integers(1, 3), seed=seeds)
def test_token_input_gradients(cell, n, t, v, i, h, layers, bias, init, unit_steps, seed):
    """Tokens are not differentiable; the embedding and every weight are (either path)."""
    rng = np.random.default_rng(seed)
    layer = _make(cell, i, h, layers, bias, unit_steps=unit_steps, initial_state=init,
                  vocab_size=v)
    res = check_layer(layer, _inputs(layer, n, t, rng), rng=rng, float32=False)
    assert res.grad_inputs[0] is None
    assert "embedding" in res.grad_params


@pytest.mark.parametrize("path", ["table", "gather"])
@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_token_gradients_on_both_paths(cell, path):
    n, t = 3, 7
    v = _vocab_for(path, n, t)
    layer = _make(cell, 3, 4, 2, unit_steps=2, initial_state=True, vocab_size=v)
    assert layer._table(n, t) == (path == "table")
    rng = np.random.default_rng(1)
    inputs = _inputs(layer, n, t, rng)
    inputs[0][0, :2] = 0  # a repeated token: its gradient rows accumulate
    check_layer(layer, inputs, rng=rng, float32=False)


def test_declarations():
    for cell in CELLS:
        for kw in ({}, {"initial_state": True}, {"vocab_size": 9},
                   {"vocab_size": 9, "initial_state": True, "schedule": bptt.sqrt_schedule(3)}):
            layer = _make(cell, 3, 4, 2, unit_steps=2, **kw)
            shapes = _in_shapes(layer, 2, 5)
            check_declarations(layer, shapes)
            assert layer.kind == "recurrent"
            assert layer.num_inputs == len(shapes)
            assert layer.retain_inputs == tuple(range(len(shapes)))
            assert layer.nondiff_inputs == ((0,) if "vocab_size" in kw else ())
            assert layer.output_shapes(shapes) == [(2, 5, 4)]
            assert layer.units(5) == [(0, 2), (2, 4), (4, 5)]
            assert layer.flops(shapes) > 0
            names = [f"{w}_l{k}" for k in range(2)
                     for w in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")]
            specs = layer.param_specs()
            assert sorted(specs) == sorted(names + (["embedding"] if "vocab_size" in kw else []))
            g = {"lstm": 16, "gru": 12}[cell]
            assert specs["weight_ih_l0"].shape == (g, 3)
            assert specs["weight_ih_l1"].shape == specs["weight_hh_l1"].shape == (g, 4)
            assert specs["bias_hh_l1"].shape == (g,)
            if "vocab_size" in kw:
                assert specs["embedding"].shape == (9, 3)
                assert layer.output_dtypes([np.dtype(np.int64)]) == [np.dtype(np.float64)]
                assert layer.output_dtypes([np.dtype(np.uint8)]) == [np.dtype(np.float64)]
        plain = CELLS[cell](3, 4, bias=False)
        assert "bias_ih_l0" not in plain.param_specs()
        assert plain.output_dtypes([np.dtype(np.float32)]) == [np.dtype(np.float32)]
        assert plain.recompute_flops([(2, 40, 3)]) == 0


# ---------------------------------------------------------------- parity with PyTorch
def _torch_reference(layer, inputs, params, gy):
    """Outputs and gradients of ``<gy, y>`` through torch (Embedding ->) LSTM/GRU, float64."""
    torch = pytest.importorskip("torch")
    cls = torch.nn.LSTM if layer.cell == "lstm" else torch.nn.GRU
    mod = cls(layer.input_size, layer.hidden_size, layer.num_layers, bias=layer.bias,
              batch_first=True, dtype=torch.float64)
    got_names = {k for k in params if k != "embedding"}
    assert {k for k, _ in mod.named_parameters()} == got_names
    with torch.no_grad():
        for name, p in mod.named_parameters():
            p.copy_(torch.from_numpy(params[name]))
    tokens = layer.vocab_size is not None
    if tokens:
        emb = torch.nn.Embedding(layer.vocab_size, layer.input_size, dtype=torch.float64)
        with torch.no_grad():
            emb.weight.copy_(torch.from_numpy(params["embedding"]))
        x = emb(torch.from_numpy(inputs[0]))
    else:
        x = torch.from_numpy(inputs[0].copy()).requires_grad_()
    states = [torch.from_numpy(a.copy()).requires_grad_() for a in inputs[1:]]
    if not states:
        y, _ = mod(x)
    else:
        y, _ = mod(x, tuple(states) if layer.cell == "lstm" else states[0])
    (y * torch.from_numpy(gy)).sum().backward()
    grads = {name: p.grad.numpy() for name, p in mod.named_parameters()}
    if tokens:
        grads["embedding"] = emb.weight.grad.numpy()
    grad_inputs = [None if tokens else x.grad.numpy()] + [s.grad.numpy() for s in states]
    return y.detach().numpy(), grad_inputs, grads


def _close(got, want, what, rtol=1e-10):
    scale = max(1.0, float(np.max(np.abs(want)))) if want.size else 1.0
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * 1e-2 * scale, err_msg=what)


@pytest.mark.parametrize("init", [False, True])
@pytest.mark.parametrize("layers,bias", [(1, True), (2, False), (3, True)])
@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_float_input_matches_torch(cell, layers, bias, init):
    n, t = 3, 11
    layer = _make(cell, 5, 6, layers, bias, unit_steps=4, initial_state=init)
    rng = np.random.default_rng(3)
    inputs = _inputs(layer, n, t, rng)
    params = make_params(layer, rng)
    gy = rng.standard_normal((n, t, 6))
    res = _run(layer, inputs, params, gy)
    y, gin, gp = _torch_reference(layer, inputs, params, gy)
    _close(res.outputs[0], y, "output")
    assert len(res.grad_inputs) == len(gin)
    for k, (a, b) in enumerate(zip(res.grad_inputs, gin, strict=True)):
        _close(a, b, f"gradient of input {k}")
    assert sorted(res.grad_params) == sorted(gp)
    for name, g in gp.items():
        _close(res.grad_params[name], g, f"gradient of {name}")


@pytest.mark.parametrize("path", ["table", "gather"])
@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_tokens_match_torch_embedding_then_rnn(cell, path):
    n, t = 4, 9
    v = _vocab_for(path, n, t)
    layer = _make(cell, 5, 6, 2, unit_steps=3, initial_state=True, vocab_size=v)
    assert layer._table(n, t) == (path == "table")
    rng = np.random.default_rng(4)
    inputs = _inputs(layer, n, t, rng)
    params = make_params(layer, rng)
    gy = rng.standard_normal((n, t, 6))
    res = _run(layer, inputs, params, gy)
    y, gin, gp = _torch_reference(layer, inputs, params, gy)
    _close(res.outputs[0], y, "output")
    assert res.grad_inputs[0] is None
    for k in range(1, len(gin)):
        _close(res.grad_inputs[k], gin[k], f"gradient of initial state {k}")
    assert sorted(res.grad_params) == sorted(gp)
    for name, g in gp.items():
        _close(res.grad_params[name], g, f"gradient of {name}")


@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_only_some_input_gradients_requested(cell):
    """``None`` grad_inputs (a network input x, or initial states nobody trains) leave the
    other gradients as they are."""
    n, t = 2, 9
    layer = _make(cell, 3, 4, 2, unit_steps=2, initial_state=True,
                  schedule=bptt.dp_schedule(5, 2))
    rng = np.random.default_rng(8)
    inputs = _inputs(layer, n, t, rng)
    params = make_params(layer, rng)
    gy = rng.standard_normal((n, t, 4))
    full = _run(layer, inputs, params, gy)
    k = len(inputs)
    for need in ([False] + [True] * (k - 1), [True] + [False] * (k - 1), [False] * k,
                 [False, True] + [False] * (k - 2)):
        got = _run(layer, inputs, params, gy, need=need)
        for i, (a, b) in enumerate(zip(got.grad_inputs, full.grad_inputs, strict=True)):
            assert (a is None) == (not need[i])
            assert a is None or np.array_equal(a, b)
        for name, g in full.grad_params.items():
            assert np.array_equal(got.grad_params[name], g), name


# ---------------------------------------------------------------- schedules
@settings(max_examples=30, deadline=None)
@given(cell=cells, n=st.integers(1, 3), t=st.integers(1, 14), unit_steps=st.integers(1, 4),
       layers=st.integers(1, 3), kind=st.sampled_from(["all", "sqrt", "dp", "budget"]),
       slots=st.integers(1, 5), mode=st.sampled_from(["float", "table", "gather"]),
       bias=st.booleans(), init=st.booleans(), seed=seeds, pieces=st.integers(1, 4),
       edge=st.integers(1, 3))
def test_schedules_bit_identical_to_keeping_everything(cell, n, t, unit_steps, layers, kind,
                                                       slots, mode, bias, init, seed, pieces,
                                                       edge):
    units = _units(t, unit_steps)
    schedule = _schedule(kind, units, slots)
    vocab = None if mode == "float" else _vocab_for(mode, n, t)
    kw = {"unit_steps": unit_steps, "initial_state": init, "vocab_size": vocab}
    ref_layer = _make(cell, 3, 4, layers, bias, **kw)
    layer = _make(cell, 3, 4, layers, bias, schedule=schedule, **kw)
    ref_layer.projection_steps = layer.projection_steps = pieces  # projections in pieces
    ref_layer.edge_projection_steps = layer.edge_projection_steps = edge  # first and last
    assert layer._table(n, t) == (mode == "table")
    rng = np.random.default_rng(seed)
    inputs = _inputs(layer, n, t, rng)
    params = make_params(layer, rng)
    gy = rng.standard_normal((n, t, 4))
    want = _run(ref_layer, inputs, params, gy)
    got = _run(layer, inputs, params, gy)
    assert np.array_equal(got.outputs[0], want.outputs[0])
    for a, b in zip(got.grad_inputs, want.grad_inputs, strict=True):
        assert (a is None and b is None) or np.array_equal(a, b)
    assert sorted(got.grad_params) == sorted(want.grad_params)
    for name, g in want.grad_params.items():
        assert np.array_equal(got.grad_params[name], g), name
    slots_used = max(1, schedule.max_stored)
    parts = layer.state_parts
    assert {k: v.shape for k, v in got.stash.items()} == {
        "states": (slots_used, layers, parts, n, 4)}


@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_schedules_bit_identical_long_sequence_many_units(cell):
    """50 steps in units of 3 (17 units, the last one short): every policy and budget."""
    n, t, us = 2, 50, 3
    units = _units(t, us)
    rng = np.random.default_rng(5)
    ref = _make(cell, 4, 5, 2, unit_steps=us, initial_state=True)
    inputs = _inputs(ref, n, t, rng)
    params = make_params(ref, rng)
    gy = rng.standard_normal((n, t, 5))
    want = _run(ref, inputs, params, gy)
    schedules = [bptt.store_all_schedule(units), bptt.sqrt_schedule(units)]
    schedules += [bptt.dp_schedule(units, s) for s in (1, 2, 3, 5, 16)]
    for sched in schedules:
        sched.validate()
        got = _run(_make(cell, 4, 5, 2, unit_steps=us, initial_state=True, schedule=sched),
                   inputs, params, gy)
        what = f"{sched.policy}:{sched.max_stored}"
        assert np.array_equal(got.outputs[0], want.outputs[0]), what
        for a, b in zip(got.grad_inputs, want.grad_inputs, strict=True):
            assert np.array_equal(a, b), what
        for name, g in want.grad_params.items():
            assert np.array_equal(got.grad_params[name], g), f"{what}: {name}"


# ---------------------------------------------------------------- float32
@pytest.mark.parametrize("mode", ["float", "table", "gather"])
@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_float32_agrees_with_float64(cell, mode):
    n, t, h = 3, 20, 8
    vocab = None if mode == "float" else _vocab_for(mode, n, t)
    kw = {"unit_steps": 4, "initial_state": True, "vocab_size": vocab,
          "schedule": bptt.dp_schedule(5, 2)}
    l64 = _make(cell, 6, h, 2, **kw)
    l32 = _make(cell, 6, h, 2, **{**kw, "dtype": np.float32})
    rng = np.random.default_rng(6)
    inputs = _inputs(l64, n, t, rng)
    params = make_params(l64, rng)
    gy = rng.standard_normal((n, t, h))

    def cast(a):
        return a.astype(np.float32) if a.dtype.kind == "f" else a

    r64 = _run(l64, inputs, params, gy)
    r32 = _run(l32, [cast(x) for x in inputs], {k: cast(v) for k, v in params.items()},
               cast(gy))
    pairs = [("output", r32.outputs[0], r64.outputs[0])]
    pairs += [(f"input {k}", a, b) for k, (a, b) in
              enumerate(zip(r32.grad_inputs, r64.grad_inputs, strict=True)) if b is not None]
    pairs += [(k, r32.grad_params[k], g) for k, g in r64.grad_params.items()]
    for what, a32, a64 in pairs:
        assert a32.dtype == np.float32, what
        scale = max(1.0, float(np.max(np.abs(a64))))
        np.testing.assert_allclose(a32, a64, rtol=1e-4, atol=1e-4 * scale, err_msg=what)
    assert all(v.dtype == np.float32 for v in r32.stash.values())


# ---------------------------------------------------------------- bad input
@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_bad_shapes_raise_shape_error_naming_the_layer(cell):
    layer = _make(cell, 3, 4, 2, initial_state=True)
    layer.name = "encoder"
    st_ = (2, 5, 4)  # (L, N, H) for N = 5
    parts = [st_] * layer.state_parts
    cases = [
        [(5, 7, 2)] + parts,  # wrong feature size
        [(5, 7)] + parts,  # tokens for a float-input layer
        [(5, 0, 3)] + parts,  # empty sequence
        [(5, 7, 3), (1, 5, 4)] + parts[1:],  # too few layers in h0
        [(5, 7, 3), (2, 4, 4)] + parts[1:],  # batch of h0
        [(5, 7, 3)] + parts[:-1] + [(2, 5, 3)],  # hidden size of the last state
    ]
    for shapes in cases:
        with pytest.raises(ShapeError) as err:
            layer.output_shapes(shapes)
        assert "encoder" in str(err.value)
        with pytest.raises(ShapeError):
            layer.stash_specs(shapes, np.dtype(np.float32))
        with pytest.raises(ShapeError):
            layer.forward_workspace_bytes(shapes, np.dtype(np.float32))
    tok = _make(cell, 3, 4, vocab_size=10)
    for shapes in ([(5, 7, 3)], [(5,)], [(5, 0)]):
        with pytest.raises(ShapeError):
            tok.output_shapes(shapes)


@pytest.mark.parametrize("path", ["table", "gather"])
@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_out_of_vocabulary_token_raises_index_error(cell, path):
    n, t = 2, 6
    v = _vocab_for(path, n, t)
    layer = _make(cell, 3, 4, vocab_size=v, unit_steps=2)
    layer.name = "char_rnn.lstm"
    params = make_params(layer, np.random.default_rng(0))
    for bad in (v, v + 100, -1):
        tokens = np.zeros((n, t), np.int64)
        tokens[1, 4] = bad
        with pytest.raises(IndexError, match="char_rnn.lstm") as err:
            run_forward(layer, Context(), [tokens], params)
        assert str(bad) in str(err.value) and str(v) in str(err.value)


@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_float_tokens_raise_type_error(cell):
    layer = _make(cell, 3, 4, vocab_size=10)
    layer.name = "tok"
    for dt in (np.float32, np.float64):
        with pytest.raises(TypeError, match="tok.*integer"):
            layer.output_dtypes([np.dtype(dt)])


@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_schedule_for_another_length_raises_value_error(cell):
    layer = _make(cell, 3, 4, unit_steps=4, schedule=bptt.dp_schedule(3, 1))
    layer.name = "rnn0"
    assert layer.output_shapes([(2, 12, 3)]) == [(2, 12, 4)]  # 3 units: fine
    assert layer.output_shapes([(2, 9, 3)]) == [(2, 9, 4)]  # 4 + 4 + 1
    for t in (8, 13, 40):
        with pytest.raises(ValueError, match="rnn0.*3 units"):
            layer.output_shapes([(2, t, 3)])
        with pytest.raises(ValueError, match="3 units"):
            layer.stash_specs([(2, t, 3)], np.dtype(np.float32))


@pytest.mark.parametrize("cls", [LSTM, GRU])
def test_constructor_refuses_zero_sizes(cls):
    for args, kw in [((0, 4), {}), ((3, 0), {}), ((3, 4, 0), {}), ((3, 4), {"unit_steps": 0}),
                     ((-1, 4), {}), ((3, 4), {"vocab_size": 0})]:
        with pytest.raises(ValueError, match=cls.__name__):
            cls(*args, **kw)


# ---------------------------------------------------------------- stash sizes
@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_stash_sizes_keep_all_against_schedules(cell):
    n, t, i, h, layers, us = 4, 400, 3, 5, 2, 16
    units = _units(t, us)
    shapes = [(n, t, i)]
    dt = np.dtype(np.float32)
    keep = _make(cell, i, h, layers, unit_steps=us)
    want = {"gates": ((layers, t, n, 4 * h), dt), "h": ((layers, t + 1, n, h), dt)}
    if cell == "lstm":
        want["c"] = ((layers, t + 1, n, h), dt)
    assert keep.stash_specs(shapes, dt) == want
    parts = 2 if cell == "lstm" else 1

    def nbytes(specs):
        return sum(int(np.prod(s)) * np.dtype(d).itemsize for s, d in specs.values())

    keep_bytes = nbytes(want)
    keep_total = keep_bytes + keep.forward_workspace_bytes(shapes, dt)
    for slots in (1, 2, 4, 7):
        sched = bptt.dp_schedule(units, slots)
        assert sched.max_stored == slots  # 25 units: every slot pays off
        layer = _make(cell, i, h, layers, unit_steps=us, schedule=sched)
        specs = layer.stash_specs(shapes, dt)
        assert specs == {"states": ((slots, layers, parts, n, h), dt)}
        assert nbytes(specs) < 0.01 * keep_bytes
        # one unit's internals move to the workspace: still far below keeping everything
        total = nbytes(specs) + layer.forward_workspace_bytes(shapes, dt)
        assert total < 0.2 * keep_total
        assert layer.backward_workspace_bytes(shapes, dt) >= layer.forward_workspace_bytes(
            shapes, dt)
        assert layer.recompute_flops(shapes) == int(
            layer.flops(shapes) * (sched.unit_forwards - units) / units) > 0
    sq = _make(cell, i, h, layers, unit_steps=us, schedule=bptt.sqrt_schedule(units))
    assert sq.stash_specs(shapes, dt)["states"][0][0] == bptt.sqrt_schedule(units).max_stored
    assert nbytes(sq.stash_specs(shapes, dt)) < 0.05 * keep_bytes


# workspace bytes (forward, backward) of the positional layouts before the buffers were named;
# the named layouts must not grow them
_WORKSPACE_BYTES = {
    ("LSTM", None, False): (6912, 10816), ("LSTM", None, True): (6592, 10304),
    ("LSTM", 11, False): (8192, 12096), ("LSTM", 11, True): (7872, 12864),
    ("GRU", None, False): (5248, 12928), ("GRU", None, True): (5248, 9280),
    ("GRU", 11, False): (6208, 13888), ("GRU", 11, True): (6208, 11200),
}


@pytest.mark.parametrize("key", sorted(_WORKSPACE_BYTES, key=str))
def test_named_workspace_layouts_keep_their_bytes_and_name_every_buffer(key):
    cell, vocab, scheduled = key
    n, t, unit_steps = 3, 10, 4
    sched = bptt.sqrt_schedule(_units(t, unit_steps)) if scheduled else None
    layer = {"LSTM": LSTM, "GRU": GRU}[cell](5, 7, 2, unit_steps=unit_steps, schedule=sched,
                                              vocab_size=vocab)
    shapes = [(n, t) if vocab else (n, t, 5)]
    fwd = layer.forward_workspace_bytes(shapes, np.float32)
    bwd = layer.backward_workspace_bytes(shapes, np.float32)
    assert (fwd, bwd) == _WORKSPACE_BYTES[key]
    ws = layer._backward_layout(sched, n, t).carve(np.zeros(bwd, np.uint8), np.float32)
    assert ws.carry.shape == (2, layer.state_parts, n, 7)
    assert ws.token_dg.shape == ((11, layer.gates) if vocab else (0,))
    if scheduled:
        assert set(ws.forward.unit) == ({"gates", "h", "c"} if cell == "LSTM" else {"gates", "h"})
    else:
        assert [w.prod.shape for w in ws.worker] == [(layer.gates, 7)] * 2


@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_critical_path_order_keeps_the_bits(cell):
    """From the second call on the lanes take their tasks in critical-path order (durations
    measured at the call before, per phase and shapes): results bit-identical to the first
    call's wavefront order and to a scheduled run."""
    n, t, us = 3, 23, 4
    rng = np.random.default_rng(11)
    layer = _make(cell, 4, 5, 3, unit_steps=us, initial_state=True, threads=2)
    layer.projection_steps = 3  # the lanes' forward tasks in pieces of 3 steps
    inputs = _inputs(layer, n, t, rng)
    params = make_params(layer, rng)
    gy = rng.standard_normal((n, t, 5))
    first = _run(layer, inputs, params, gy)
    assert set(layer._lane_durations) == {("forward", n, t), ("backward", n, t)}
    assert len(layer._lane_durations[("backward", n, t)]) > _units(t, us)
    sched = _make(cell, 4, 5, 3, unit_steps=us, initial_state=True,
                  schedule=bptt.sqrt_schedule(_units(t, us)))
    sched.projection_steps = 3
    for got in (_run(layer, inputs, params, gy), _run(layer, inputs, params, gy),
                _run(sched, inputs, params, gy)):
        assert np.array_equal(got.outputs[0], first.outputs[0])
        for a, b in zip(got.grad_inputs, first.grad_inputs, strict=True):
            assert (a is None and b is None) or np.array_equal(a, b)
        for name, g in first.grad_params.items():
            assert np.array_equal(got.grad_params[name], g), name


def test_projection_pieces_cut_the_sequence_edges_shorter():
    layer = _make("lstm", 3, 4, 2, unit_steps=16)
    layer.projection_steps, layer.edge_projection_steps = 8, 3
    assert layer._pieces(0, 16, 40) == [(0, 3), (3, 8), (8, 16)]  # the first unit
    assert layer._pieces(16, 32, 40) == [(0, 8), (8, 16)]
    assert layer._pieces(32, 40, 40) == [(0, 5), (5, 8)]  # the last unit
    assert layer._pieces(0, 5, 5) == [(0, 3), (3, 5)]  # one unit: the first cut only
    assert layer._pieces(0, 2, 2) == [(0, 2)]  # no piece longer than the edge

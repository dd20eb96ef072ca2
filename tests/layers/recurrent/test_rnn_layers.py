"""RNN layers (RNNInputProjection, LSTMCell, GRUCell): gradient checks of each layer, a
sequence unrolled by hand (projection -> T cells per layer, 2 layers) against a textbook NumPy
reference of the recurrences and against torch.nn.LSTM / torch.nn.GRU, and bad input."""

from __future__ import annotations

import numpy as np
import pytest
from gradcheck import check_declarations, check_layer, make_inputs
from hypothesis import given, settings
from hypothesis import strategies as st

from minidl.layers import Context, ShapeError
from minidl.layers.recurrent.gru import GRUCell
from minidl.layers.recurrent.lstm import LSTMCell
from minidl.layers.recurrent.rnn_projection import RNNInputProjection

SMALL = settings(max_examples=8, deadline=None)
sizes = st.integers(1, 4)
seeds = st.integers(0, 2**32 - 1)
NGATES = {"lstm": 4, "gru": 3}


# ---------------------------------------------------------------- single layers
@SMALL
@given(n=sizes, h=sizes, bias=st.booleans(), seed=seeds)
def test_lstm_cell_gradients(n, h, bias, seed):
    rng = np.random.default_rng(seed)
    layer = LSTMCell(h, bias=bias)
    check_layer(layer, make_inputs(layer, [(n, 4 * h), (n, h), (n, h)], rng), rng=rng)


@SMALL
@given(n=sizes, h=sizes, bias=st.booleans(), seed=seeds)
def test_gru_cell_gradients(n, h, bias, seed):
    rng = np.random.default_rng(seed)
    layer = GRUCell(h, bias=bias)
    check_layer(layer, make_inputs(layer, [(n, 3 * h), (n, h)], rng), rng=rng)


@SMALL
@given(n=sizes, t=sizes, i=sizes, h=sizes, step_inputs=st.booleans(), bias=st.booleans(),
       seed=seeds)
def test_input_projection_gradients(n, t, i, h, step_inputs, bias, seed):
    rng = np.random.default_rng(seed)
    layer = RNNInputProjection(i, 4 * h, t, bias=bias, step_inputs=step_inputs, hidden_size=h)
    shapes = [(n, i)] * t if step_inputs else [(n, t, i)]
    check_layer(layer, make_inputs(layer, shapes, rng), rng=rng)


def test_input_projection_strided_sequence():
    """A non-contiguous (N, T, I) input takes the batched-matmul path with the same result."""
    rng = np.random.default_rng(0)
    layer = RNNInputProjection(3, 8, 4, hidden_size=2)
    params = {k: s.initial_value(rng, np.float64) for k, s in layer.param_specs().items()}
    x = rng.standard_normal((4, 2, 3))  # (T, N, I) memory, viewed as (N, T, I)
    xs = x.transpose(1, 0, 2)
    want, got = _forward(layer, [xs.copy()], params)[0], _forward(layer, [xs], params)[0]
    for a, b in zip(want, got):
        np.testing.assert_allclose(a, b, rtol=1e-14)
    check_layer(layer, [xs], params, float32=False)


def test_declarations():
    n, t, i, h = 2, 3, 5, 4
    lstm, gru = LSTMCell(h), GRUCell(h)
    p0 = RNNInputProjection(i, 4 * h, t, hidden_size=h)
    p1 = RNNInputProjection(i, 3 * h, t, step_inputs=True, hidden_size=h)
    check_declarations(lstm, [(n, 4 * h), (n, h), (n, h)])
    check_declarations(gru, [(n, 3 * h), (n, h)])
    check_declarations(p0, [(n, t, i)])
    check_declarations(p1, [(n, i)] * t)
    assert all(x.kind == "rnn" for x in (lstm, gru, p0, p1))
    assert (lstm.num_outputs, gru.num_outputs, p0.num_outputs) == (2, 1, t)
    assert (p0.num_inputs, p1.num_inputs, p1.retain_inputs) == (1, t, (0, 1, 2))
    assert lstm.stash_specs([(n, 4 * h), (n, h), (n, h)], np.float32) == {
        "gates": ((n, 4 * h), np.float32)}
    assert gru.stash_specs([(n, 3 * h), (n, h)], np.float32) == {"gates": ((n, 4 * h),
                                                                           np.float32)}
    assert p0.output_shapes([(n, t, i)]) == [(n, 4 * h)] * t
    assert p0.forward_workspace_bytes([(n, t, i)], np.dtype(np.float32)) >= n * t * 4 * h * 4
    assert p1.backward_workspace_bytes([(n, i)] * t, np.dtype(np.float64)) >= n * t * (
        3 * h + i) * 8
    assert p0.flops([(n, t, i)]) == 2 * n * t * i * 4 * h + n * t * 4 * h
    specs = lstm.param_specs()
    assert specs["weight_hh"].shape == (4 * h, h) and specs["weight_hh"].fan_in == h
    assert p0.param_specs()["weight"].fan_in == h
    assert "LSTMCell(4)" == lstm.describe() and "steps=3" in p0.describe()


def test_bad_input_raises_shape_error():
    lstm, gru = LSTMCell(4), GRUCell(4)
    proj = RNNInputProjection(5, 16, 3, hidden_size=4)
    steps = RNNInputProjection(5, 12, 3, step_inputs=True, hidden_size=4)
    lstm.name = "encoder.l0"
    cases = [
        (lstm, [(2, 16), (2, 3), (2, 4)]),  # wrong hidden size of h_prev
        (lstm, [(2, 12), (2, 4), (2, 4)]),  # gx of a GRU
        (lstm, [(2, 16), (3, 4), (2, 4)]),  # batch mismatch
        (lstm, [(2, 16), (2, 4)]),  # missing c_prev
        (gru, [(2, 16), (2, 4)]),
        (gru, [(2, 12), (2, 4, 1)]),
        (proj, [(2, 3, 6)]),  # wrong feature size
        (proj, [(2, 4, 5)]),  # wrong number of steps
        (proj, [(2, 5)] * 3),  # step tensors for a sequence projection
        (steps, [(2, 6)] * 3),
        (steps, [(2, 5)] * 2),
        (steps, [(2, 5), (3, 5), (2, 5)]),
    ]
    for layer, shapes in cases:
        with pytest.raises(ShapeError) as err:
            layer.output_shapes(shapes)
        msg = str(err.value)
        assert (layer.name or type(layer).__name__) in msg and str(tuple(shapes[-1])) in msg
    assert "encoder.l0" in str(pytest.raises(ShapeError, lstm.output_shapes,
                                             [(2, 16), (2, 3), (2, 4)]).value)
    with pytest.raises(ValueError, match="steps"):
        RNNInputProjection(5, 16, 0)
    with pytest.raises(ValueError):
        LSTMCell(0)


# ---------------------------------------------------------------- driving layers by hand
def _ws(layer, nbytes):
    return np.full(nbytes, 0xA5, np.uint8) if nbytes else None


def _forward(layer, inputs, params):
    shapes = [x.shape for x in inputs]
    dtype = inputs[0].dtype
    outs = [np.full(s, np.nan, dtype) for s in layer.output_shapes(shapes)]
    stash = {k: np.full(s, np.nan, d) for k, (s, d) in layer.stash_specs(shapes, dtype).items()}
    layer.forward(Context(), inputs, outs, params, stash,
                  _ws(layer, layer.forward_workspace_bytes(shapes, dtype)))
    return outs, stash


def _backward(layer, grad_outputs, inputs, outputs, params, stash, need=None):
    shapes = [x.shape for x in inputs]
    dtype = inputs[0].dtype
    kept_in = [x if i in layer.retain_inputs else None for i, x in enumerate(inputs)]
    kept_out = [o if i in layer.retain_outputs else None for i, o in enumerate(outputs)]
    need = need or [True] * len(inputs)
    gin = [np.full(x.shape, np.nan, dtype) if k else None for x, k in zip(inputs, need)]
    gp = {k: np.full(v.shape, np.nan, dtype) for k, v in params.items()}
    layer.backward(Context(), grad_outputs, gin, kept_in, kept_out, params, gp, stash,
                   _ws(layer, layer.backward_workspace_bytes(shapes, dtype)))
    return gin, gp


def unrolled(kind, x, weights, h0, c0, gy, ghn, gcn):
    """Forward and backward of a multi-layer LSTM/GRU built from the per-step layers, the way
    the engine unrolls it: outputs (y, h_n, c_n) and gradients (dx, dh0, dc0, dweights) of
    ``<gy, y> + <ghn, h_n> + <gcn, c_n>``. ``weights`` are PyTorch-named dicts per layer."""
    n, t_len, _ = x.shape
    lstm = kind == "lstm"
    layer_in, tape = [x], []
    for k, w in enumerate(weights):
        hid = w["weight_hh"].shape[1]
        proj = RNNInputProjection(w["weight_ih"].shape[1], NGATES[kind] * hid, t_len,
                                  step_inputs=k > 0, hidden_size=hid)
        cell = LSTMCell(hid) if lstm else GRUCell(hid)
        pp = {"weight": w["weight_ih"], "bias": w["bias_ih"]}
        cp = {"weight_hh": w["weight_hh"], "bias_hh": w["bias_hh"]}
        gx, _ = _forward(proj, layer_in, pp)
        h, c, steps = h0[k], (c0[k] if lstm else None), []
        for t in range(t_len):
            ins = [gx[t], h, c] if lstm else [gx[t], h]
            outs, stash = _forward(cell, ins, cp)
            steps.append((ins, outs, stash))
            h = outs[0]
            c = outs[1] if lstm else None
        tape.append((proj, pp, layer_in, cell, cp, steps))
        layer_in = [s[1][0] for s in steps]
    y = np.stack(layer_in, axis=1)
    h_n = np.stack([steps[-1][1][0] for *_, steps in tape])
    c_n = np.stack([steps[-1][1][1] for *_, steps in tape]) if lstm else None

    # backward, top layer first; dh of each step sums the layer above and the next step
    dh_up = [gy[:, t] for t in range(t_len)]
    grads = [None] * len(weights)
    dh0, dc0 = np.zeros_like(h0), np.zeros_like(h0)
    for k in reversed(range(len(weights))):
        proj, pp, layer_in, cell, cp, steps = tape[k]
        dh, dc = ghn[k], (gcn[k] if lstm else None)
        dgx = [None] * t_len
        gw = {"weight_hh": 0, "bias_hh": 0}
        for t in reversed(range(t_len)):
            ins, outs, stash = steps[t]
            g_out = [dh_up[t] + dh, dc] if lstm else [dh_up[t] + dh]
            gin, gp = _backward(cell, g_out, ins, outs, cp, stash)
            dgx[t], dh = gin[0], gin[1]
            dc = gin[2] if lstm else None
            gw = {name: gw[name] + gp[name] for name in gw}  # shared parameters accumulate
        dh0[k] = dh
        if lstm:
            dc0[k] = dc
        gin, gp = _backward(proj, dgx, layer_in, [], pp, {})
        grads[k] = {"weight_ih": gp["weight"], "bias_ih": gp["bias"], **gw}
        dh_up = gin
    return (y, h_n, c_n), (dh_up[0], dh0, dc0 if lstm else None, grads)


# ---------------------------------------------------------------- textbook reference
def _sig(v):
    return 1 / (1 + np.exp(-v))


def reference(kind, x, weights, h0, c0, gy, ghn, gcn):
    """Straightforward NumPy forward of the recurrences over whole (N, T, .) arrays and
    backpropagation through time, independent of minidl's kernels and layers."""
    lstm = kind == "lstm"
    n, t_len, _ = x.shape
    inp, caches, hns, cns = x, [], [], []
    for k, w in enumerate(weights):
        hid = w["weight_hh"].shape[1]
        h, c = h0[k], (c0[k] if lstm else None)
        out, cache = np.empty((n, t_len, hid)), []
        for t in range(t_len):
            gi = inp[:, t] @ w["weight_ih"].T + w["bias_ih"]
            gh = h @ w["weight_hh"].T + w["bias_hh"]
            if lstm:
                a = gi + gh
                i, f, g, o = (_sig(a[:, :hid]), _sig(a[:, hid:2 * hid]),
                              np.tanh(a[:, 2 * hid:3 * hid]), _sig(a[:, 3 * hid:]))
                c_new = f * c + i * g
                h_new = o * np.tanh(c_new)
                cache.append((inp[:, t], h, c, i, f, g, o, c_new))
                c = c_new
            else:
                r = _sig(gi[:, :hid] + gh[:, :hid])
                z = _sig(gi[:, hid:2 * hid] + gh[:, hid:2 * hid])
                nn = np.tanh(gi[:, 2 * hid:] + r * gh[:, 2 * hid:])
                h_new = (1 - z) * nn + z * h
                cache.append((inp[:, t], h, r, z, nn, gh[:, 2 * hid:]))
            h = h_new
            out[:, t] = h
        caches.append(cache)
        hns.append(h)
        cns.append(c)
        inp = out
    y, h_n = inp, np.stack(hns)
    c_n = np.stack(cns) if lstm else None

    dy = gy.copy()
    grads = [None] * len(weights)
    dh0, dc0 = np.zeros_like(h0), np.zeros_like(h0)
    for k in reversed(range(len(weights))):
        w = weights[k]
        g = {name: np.zeros_like(v) for name, v in w.items()}
        dh, dc = ghn[k].copy(), (gcn[k].copy() if lstm else None)
        dx = np.zeros(caches[k][0][0].shape[:1] + (t_len, w["weight_ih"].shape[1]))
        for t in reversed(range(t_len)):
            dh = dh + dy[:, t]
            if lstm:
                xin, hp, cp, i, f, gg, o, cc = caches[k][t]
                tc = np.tanh(cc)
                dc = dc + dh * o * (1 - tc ** 2)
                da = np.concatenate([dc * gg * i * (1 - i), dc * cp * f * (1 - f),
                                     dc * i * (1 - gg ** 2), dh * tc * o * (1 - o)], axis=1)
                dgi = dgh = da
                dc = dc * f
                dh_direct = 0
            else:
                xin, hp, r, z, nn, ghn_ = caches[k][t]
                dn = dh * (1 - z) * (1 - nn ** 2)
                dz = dh * (hp - nn) * z * (1 - z)
                dr = dn * ghn_ * r * (1 - r)
                dgi = np.concatenate([dr, dz, dn], axis=1)
                dgh = np.concatenate([dr, dz, dn * r], axis=1)
                dh_direct = dh * z
            g["weight_ih"] += dgi.T @ xin
            g["bias_ih"] += dgi.sum(0)
            g["weight_hh"] += dgh.T @ hp
            g["bias_hh"] += dgh.sum(0)
            dx[:, t] = dgi @ w["weight_ih"]
            dh = dgh @ w["weight_hh"] + dh_direct
        dh0[k] = dh
        if lstm:
            dc0[k] = dc
        grads[k] = g
        dy = dx
    return (y, h_n, c_n), (dy, dh0, dc0 if lstm else None, grads)


def _problem(kind, n, t, i, hid, layers, seed, dtype=np.float64):
    rng = np.random.default_rng(seed)
    bound = 1 / np.sqrt(hid)
    g = NGATES[kind] * hid
    weights = []
    for k in range(layers):
        fan = i if k == 0 else hid
        weights.append({
            "weight_ih": rng.uniform(-bound, bound, (g, fan)).astype(dtype),
            "weight_hh": rng.uniform(-bound, bound, (g, hid)).astype(dtype),
            "bias_ih": rng.uniform(-bound, bound, g).astype(dtype),
            "bias_hh": rng.uniform(-bound, bound, g).astype(dtype),
        })
    x = rng.standard_normal((n, t, i)).astype(dtype)
    h0, c0 = (0.5 * rng.standard_normal((2, layers, n, hid))).astype(dtype)
    gy = rng.standard_normal((n, t, hid)).astype(dtype)
    ghn, gcn = rng.standard_normal((2, layers, n, hid)).astype(dtype)
    return x, weights, h0, c0, gy, ghn, gcn


def _assert_same(got, want, rtol, atol=0.0):
    (y, hn, cn), (dx, dh0, dc0, gw) = got
    (y2, hn2, cn2), (dx2, dh02, dc02, gw2) = want
    pairs = [(y, y2), (hn, hn2), (cn, cn2), (dx, dx2), (dh0, dh02), (dc0, dc02)]
    pairs += [(a[k], b[k]) for a, b in zip(gw, gw2) for k in b]
    for a, b in pairs:
        if b is None:
            assert a is None
            continue
        scale = max(1.0, float(np.abs(b).max()))
        np.testing.assert_allclose(a, b, rtol=rtol, atol=atol * scale)


@pytest.mark.parametrize("kind", ["lstm", "gru"])
@settings(max_examples=6, deadline=None)
@given(n=sizes, t=st.integers(1, 5), i=sizes, hid=sizes, layers=st.integers(1, 2), seed=seeds)
def test_unrolled_sequence_matches_numpy_reference(kind, n, t, i, hid, layers, seed):
    prob = _problem(kind, n, t, i, hid, layers, seed)
    _assert_same(unrolled(kind, *prob), reference(kind, *prob), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_unrolled_sequence_finite_differences(kind):
    """Gradients of the unrolled layers agree with central differences (float64)."""
    x, weights, h0, c0, gy, ghn, gcn = _problem(kind, 2, 3, 2, 3, 2, seed=7)
    _, (dx, dh0, dc0, gw) = unrolled(kind, x, weights, h0, c0, gy, ghn, gcn)

    def loss():
        y, hn, cn = unrolled(kind, x, weights, h0, c0, gy, ghn, gcn)[0]
        extra = np.vdot(gcn, cn) if cn is not None else 0.0
        return np.vdot(gy, y) + np.vdot(ghn, hn) + extra

    arrays = [(x, dx), (h0, dh0)] + ([(c0, dc0)] if kind == "lstm" else [])
    arrays += [(w[k], g[k]) for w, g in zip(weights, gw) for k in w]
    rng = np.random.default_rng(0)
    eps = 1e-6
    for a, g in arrays:
        for idx in rng.choice(a.size, size=min(a.size, 4), replace=False):
            old = a.flat[idx]
            a.flat[idx] = old + eps
            up = loss()
            a.flat[idx] = old - eps
            down = loss()
            a.flat[idx] = old
            assert abs((up - down) / (2 * eps) - g.flat[idx]) <= 1e-6 * max(1, abs(g.flat[idx]))


# ---------------------------------------------------------------- parity with PyTorch
@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_unrolled_matches_torch(kind):
    torch = pytest.importorskip("torch")
    n, t, i, hid, layers = 3, 7, 5, 6, 2
    x, weights, h0, c0, gy, ghn, gcn = _problem(kind, n, t, i, hid, layers, seed=11,
                                                dtype=np.float32)
    mod = (torch.nn.LSTM if kind == "lstm" else torch.nn.GRU)(
        i, hid, num_layers=layers, batch_first=True)
    with torch.no_grad():
        for k, w in enumerate(weights):
            for name, v in w.items():
                getattr(mod, f"{name}_l{k}").copy_(torch.from_numpy(v))
    tx, th0, tc0 = (torch.from_numpy(a.copy()).requires_grad_() for a in (x, h0, c0))
    if kind == "lstm":
        ty, (thn, tcn) = mod(tx, (th0, tc0))
        loss = (ty * torch.from_numpy(gy)).sum() + (thn * torch.from_numpy(ghn)).sum() + (
            tcn * torch.from_numpy(gcn)).sum()
    else:
        ty, thn = mod(tx, th0)
        tcn = None
        loss = (ty * torch.from_numpy(gy)).sum() + (thn * torch.from_numpy(ghn)).sum()
    loss.backward()
    want = (
        (ty.detach().numpy(), thn.detach().numpy(),
         None if tcn is None else tcn.detach().numpy()),
        (tx.grad.numpy(), th0.grad.numpy(), None if tcn is None else tc0.grad.numpy(),
         [{name: getattr(mod, f"{name}_l{k}").grad.numpy() for name in w}
          for k, w in enumerate(weights)]),
    )
    got = unrolled(kind, x, weights, h0, c0, gy, ghn, gcn)
    assert got[0][0].dtype == np.float32
    _assert_same(got, want, rtol=1e-5, atol=1e-6)

"""kernels/recurrent/rnn.py: accuracy of the float32 activations, and the Numba LSTM / GRU gate
kernels
against their NumPy references for both float dtypes."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minidl.kernels.recurrent import rnn as rk
from minidl.kernels.workspace import workspace_bytes, workspace_views

DTYPES = [np.float32, np.float64]
TOL = {np.float32: 2e-6, np.float64: 1e-13}
SIZES = dict(n=st.integers(1, 5), hid=st.integers(1, 9), seed=st.integers(0, 2**31))


def _probe_values() -> np.ndarray:
    rng = np.random.default_rng(0)
    parts = [
        rng.standard_normal(200_000) * 3,
        np.linspace(-130, 130, 20_001),
        np.geomspace(1e-38, 50, 20_000),
        -np.geomspace(1e-38, 50, 20_000),
        [0.0, 88.7, -88.7, 103.9, -103.9, 1e30, -1e30],
    ]
    return np.concatenate([np.asarray(p, dtype=np.float64) for p in parts]).astype(np.float32)


def _rel_err(got: np.ndarray, exact: np.ndarray) -> np.ndarray:
    return np.abs(got.astype(np.float64) - exact) / np.maximum(np.abs(exact), 1e-300)


def test_float32_tanh_and_sigmoid_are_within_float32_rounding():
    x = _probe_values()
    x64 = x.astype(np.float64)
    for kernel, exact in [(rk.tanh_nb, np.tanh(x64)),
                          (rk.sigmoid_nb, np.exp(-np.logaddexp(0, -x64)))]:
        got = np.empty_like(x)
        kernel(x, got)
        normal = np.abs(exact) >= np.finfo(np.float32).tiny  # denormal results: absolute
        assert _rel_err(got, exact)[normal].max() < 6.5e-8  # one float32 rounding (2**-24)
        tiny = np.abs(got - exact)[~normal]
        assert tiny.max(initial=0) <= np.finfo(np.float32).smallest_subnormal
    np.testing.assert_array_equal(_tanh32(np.array([0.0, -0.0, np.inf, -np.inf])),
                                  [0.0, -0.0, 1.0, -1.0])
    assert np.signbit(_tanh32(np.array([-0.0]))[0])
    assert np.isnan(_tanh32(np.array([np.nan]))).all()
    sig = np.empty(3, np.float32)
    rk.sigmoid_nb(np.array([np.inf, -np.inf, np.nan], np.float32), sig)
    assert sig[0] == 1 and sig[1] == 0 and np.isnan(sig[2])


def test_float32_tanh_agrees_with_numpy():
    x = _probe_values()
    got = _tanh32(x)
    np.testing.assert_allclose(got, np.tanh(x), rtol=2.5e-7, atol=0)


def _tanh32(x) -> np.ndarray:
    x = np.asarray(x, dtype=np.float32)
    out = np.empty_like(x)
    rk.tanh_nb(x, out)
    return out


def test_float64_activations_are_libm():
    x = np.random.default_rng(1).standard_normal(1000) * 5
    got = np.empty_like(x)
    rk.tanh_nb(x, got)
    np.testing.assert_allclose(got, np.tanh(x), rtol=1e-15, atol=1e-300)
    rk.sigmoid_nb(x, got)
    np.testing.assert_allclose(got, 1 / (1 + np.exp(-x)), rtol=1e-15)


def _arrays(rng, dtype, *shapes):
    return [(rng.standard_normal(s) * 1.5).astype(dtype) for s in shapes]


@pytest.mark.parametrize("dtype", DTYPES)
@settings(max_examples=15, deadline=None)
@given(**SIZES, write_dc=st.booleans())
def test_lstm_kernels_match_reference(dtype, n, hid, seed, write_dc):
    rng = np.random.default_rng(seed)
    g = 4 * hid
    hw_t, gx, c_prev = _arrays(rng, dtype, (g, n), (n, g), (n, hid))
    (bias,) = _arrays(rng, dtype, (g,))
    res = []
    for fwd in (rk._lstm_fwd_nb, rk.lstm_forward_ref):
        gates = np.full((n, g), np.nan, dtype)
        h, c = np.full((n, hid), np.nan, dtype), np.full((n, hid), np.nan, dtype)
        fwd(hw_t, gx, bias, c_prev, gates, h, c)
        res.append((gates, h, c))
    for a, b in zip(*res):
        assert a.dtype == dtype
        np.testing.assert_allclose(a, b, rtol=TOL[dtype], atol=TOL[dtype])

    gates, _, c = res[1]
    dh, dc = _arrays(rng, dtype, (n, hid), (n, hid))
    out = []
    for use_nb in (True, False):
        dg = np.full((n, g), np.nan, dtype)
        dcp = np.full((n, hid), np.nan, dtype) if write_dc else None
        db = np.full(g, np.nan, dtype)
        if use_nb:
            rk.lstm_cell_backward(dh, dc, gates, c, c_prev, dg, dcp, db)
        else:
            rk.lstm_backward_ref(dh, dc, gates, c, c_prev, dg, dcp, db)
        out.append((dg, db) + ((dcp,) if write_dc else ()))
    for a, b in zip(*out):
        assert np.isfinite(a).all()
        np.testing.assert_allclose(a, b, rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@settings(max_examples=15, deadline=None)
@given(**SIZES)
def test_gru_kernels_match_reference(dtype, n, hid, seed):
    rng = np.random.default_rng(seed)
    g = 3 * hid
    gx, hw_t, h_prev = _arrays(rng, dtype, (n, g), (g, n), (n, hid))
    (bias,) = _arrays(rng, dtype, (g,))
    res = []
    for fwd in (rk._gru_fwd_nb, rk.gru_forward_ref):
        stash, h = np.full((n, 4 * hid), np.nan, dtype), np.full((n, hid), np.nan, dtype)
        fwd(gx, hw_t, bias, h_prev, stash, h)
        res.append((stash, h))
    for a, b in zip(*res):
        np.testing.assert_allclose(a, b, rtol=TOL[dtype], atol=TOL[dtype])

    stash = res[1][0]
    (dh,) = _arrays(rng, dtype, (n, hid))
    out = []
    for bwd in (rk._gru_bwd_nb, rk.gru_backward_ref):
        dgx, dgh = np.full((n, g), np.nan, dtype), np.full((n, g), np.nan, dtype)
        db = np.full(g, np.nan, dtype)
        if bwd is rk._gru_bwd_nb:
            bwd(dh, stash, h_prev, dtype(1), dgx, dgh, db)
        else:
            bwd(dh, stash, h_prev, dgx, dgh, db)
        out.append((dgx, dgh, db))
    for a, b in zip(*out):
        np.testing.assert_allclose(a, b, rtol=TOL[dtype], atol=TOL[dtype])

    acc = np.ones((n, hid), dtype)
    rk.gru_add_direct(acc, dh, stash)
    np.testing.assert_allclose(acc, 1 + dh * stash[:, hid:2 * hid], rtol=TOL[dtype])


def test_kernels_accept_strided_views():
    """Non-contiguous views (any layout) give the same results as contiguous copies."""
    rng = np.random.default_rng(3)
    n, hid = 3, 5
    big = rng.standard_normal((n, 2, 8 * hid)).astype(np.float32)
    gx = big[:, 1, 4 * hid:]
    hw_t = rng.standard_normal((n, 4 * hid)).astype(np.float32).T
    bias = rng.standard_normal(4 * hid).astype(np.float32)
    c_prev = rng.standard_normal((hid, n)).astype(np.float32).T
    want = [np.empty(s, np.float32) for s in ((n, 4 * hid), (n, hid), (n, hid))]
    rk.lstm_cell_forward(hw_t.copy(), gx.copy(), bias, c_prev.copy(), *want)
    got = [big[:, 0, :4 * hid], np.empty((hid, n), np.float32).T, np.empty((n, hid), np.float32)]
    rk.lstm_cell_forward(hw_t, gx, bias, c_prev, *got)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)


def test_workspace_views_are_aligned_and_disjoint():
    shapes = [(3, 5), (7,), (2, 2)]
    nbytes = workspace_bytes(np.float32, *shapes)
    ws = np.zeros(nbytes + 64, np.uint8)
    off = -ws.ctypes.data % 64
    views = workspace_views(ws[off:off + nbytes], np.float32, *shapes)
    for v, s in zip(views, shapes):
        assert v.shape == s and v.dtype == np.float32 and v.ctypes.data % 64 == 0
        v.fill(len(s))
    assert [float(v.flat[0]) for v in views] == [2.0, 1.0, 2.0]
